"""Models as users write them: a learned 0-dim temperature, a loss_fn that returns a dict,
non-tensor keyword inputs in fused mode, gradient and module hooks, and a frozen BatchNorm
backbone. Oracles: eager PyTorch with the same model, and tests/_reference.py's SMA."""

from __future__ import annotations

import copy
import csv
import json

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset, TensorDataset

import crossbow_graph as cg
from crossbow_graph.errors import TaskError
from _plans import make_plan
from _reference import batches_of, eager_steps, flat, reference_sma

N, B = 32, 4


def _data(n: int = N, classes: int = 4) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(n, 1, 4, 4, generator=g) * 2,
                         torch.randint(0, classes, (n,), generator=g))


def _sgd(model: nn.Module) -> torch.optim.SGD:
    """The eager twin of the plans' cg.SGD(lr=0.1, momentum=0.9)."""
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


# -- a 0-dim parameter (a learned temperature) ----------------------------------------------

class Temperature(nn.Module):
    """A convolution (whose weight the channels-last probe stores channels-last), a linear head
    and CLIP's learned ``logit_scale`` (0-dim), with a 0-dim float buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 2, 3)
        self.head = nn.Linear(8, 4)
        self.logit_scale = nn.Parameter(torch.tensor(0.3))
        self.register_buffer("shift", torch.tensor(0.25))

    def forward(self, x):
        return self.head(self.conv(x).flatten(1)) * self.logit_scale.exp() + self.shift


class _Steps(cg.Hook):
    """z after every round."""

    def __init__(self) -> None:
        self.z: list[torch.Tensor] = []

    def after_round(self, ctx) -> None:
        self.z.append(ctx.plan.central_weights())


def test_a_learned_temperature_trains_at_k1_as_eager_sgd_step_for_step():
    torch.manual_seed(0)
    model, data = Temperature(), _data()
    expected = eager_steps(copy.deepcopy(model), _sgd, batches_of(data, B)).weights
    plan = cg.compile(model, (data.tensors[0][:2],), F.cross_entropy, batch_size=B, devices=1,
                      replicas=1, executor="inline", memory_format="channels_last",
                      optimizer=cg.SGD(lr=0.1, momentum=0.9))
    assert plan.states[0].replicas[0].logit_scale.shape == ()
    steps = _Steps()
    plan.fit(data, 1, shuffle=False, progress=False, metrics_every=None, hooks=[steps])
    assert len(steps.z) == N // B
    for t, z in enumerate(steps.z):
        torch.testing.assert_close(z, expected[t], rtol=1e-5, atol=1e-6)
    z = plan.central_model()
    assert z.logit_scale.shape == () and z.shift.shape == ()
    torch.testing.assert_close(z.logit_scale.detach(), expected[-1][0], rtol=1e-5, atol=1e-6)  # first
    assert float(z.shift) == 0.25


@pytest.mark.parametrize("mode,executor", [("per_replica", "inline"), ("fused", "process")])
def test_a_learned_temperature_trains_at_k2_as_reference_sma(mode, executor):
    torch.manual_seed(0)
    model, data = Temperature(), _data()
    x, y = data.tensors
    rounds = N // (2 * B)
    z_ref, _ = reference_sma(model, batches_of(data, B), k=2, rounds=rounds, lr=0.1, momentum=0.9)
    plan = cg.compile(model, (x[:2],), F.cross_entropy, batch_size=B, devices=1, replicas=2,
                      learner_mode=mode, executor=executor, optimizer=cg.SGD(lr=0.1, momentum=0.9))
    plan.fit(data, 1, shuffle=False, progress=False, metrics_every=None)
    torch.testing.assert_close(plan.central_weights(), flat(z_ref), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(plan.central_model().logit_scale.detach(), z_ref[0], rtol=1e-5, atol=1e-6)


def test_adamw_keeps_a_temperatures_state_per_replica(monkeypatch):
    """AdamW's one stacked instance over a device's rows keeps the 0-dim parameter's moments per
    replica (``[m]``), apart from its one step count: the same numbers as an AdamW per replica."""
    results = []
    for stacked in (True, False):
        torch.manual_seed(0)
        model = Temperature()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
        plan = cg.compile(model, (_data().tensors[0][:2],), F.cross_entropy, batch_size=B,
                          devices=1, replicas=3, executor="inline", optimizer=opt)
        if not stacked:
            monkeypatch.setattr(plan.settings.optimizer, "stacked", False)
            for s in plan.states:
                s.optim_rows = type(s.optim_rows)(plan.settings.optimizer, s)
        plan.fit(_data(48), 2, shuffle=False, progress=False, metrics_every=None)
        results.append(plan.replica_weights())
    torch.testing.assert_close(results[0], results[1], rtol=1e-6, atol=1e-7)
    assert not torch.equal(results[0][0, -1], results[0][1, -1])  # the replicas' temperatures


def test_a_checkpoint_of_a_temperature_resumes_as_the_fit_goes_on():
    def new_plan() -> cg.Plan:
        torch.manual_seed(0)
        return cg.compile(Temperature(), (_data().tensors[0][:2],), F.cross_entropy, batch_size=B,
                          devices=1, replicas=2, executor="inline")
    whole = new_plan()
    whole.fit(_data(), 2, progress=False, metrics_every=None)
    half = new_plan()
    half.fit(_data(), 1, progress=False, metrics_every=None)
    resumed = new_plan()
    resumed.load_state_dict(half.state_dict())
    resumed.fit(_data(), 1, progress=False, metrics_every=None)
    torch.testing.assert_close(resumed.central_weights(), whole.central_weights(), rtol=0, atol=0)


# -- a loss_fn that returns a dict ----------------------------------------------------------

def _dict_loss(out, y):
    return {"loss": F.cross_entropy(out, y), "confidence": out.softmax(1).amax(1).mean()}


@pytest.mark.parametrize("mode", ["per_replica", "fused"])
def test_a_dict_loss_trains_on_its_loss_entry_as_eager(mode):
    torch.manual_seed(0)
    model, data = nn.Sequential(nn.Flatten(), nn.Linear(16, 4)), _data()
    ref = copy.deepcopy(model)
    expected = eager_steps(ref, _sgd, batches_of(data, B),
                           loss_fn=lambda o, y: _dict_loss(o, y)["loss"]).weights
    plan = cg.compile(model, (data.tensors[0][:2],), _dict_loss, batch_size=B, devices=1,
                      replicas=1, learner_mode=mode, executor="inline",
                      optimizer=cg.SGD(lr=0.1, momentum=0.9))
    plan.fit(data, 1, shuffle=False, progress=False, metrics_every=None)
    torch.testing.assert_close(plan.central_weights(), expected[-1], rtol=1e-5, atol=1e-6)
    accuracy, loss = plan.evaluate(data, batch_size=8)
    with torch.no_grad():
        out = ref(data.tensors[0])
    assert loss == pytest.approx(float(F.cross_entropy(out, data.tensors[1])), rel=1e-5)
    assert accuracy == pytest.approx(float((out.argmax(1) == data.tensors[1]).float().mean()))


def test_a_dict_losss_other_entries_are_logged_at_each_evaluation(tmp_path):
    """The other scalar entries of the dict ("confidence") are averaged over the evaluation's
    samples, as the loss is: in History.evals, evals.csv and history.json."""
    torch.manual_seed(0)
    model, data = nn.Sequential(nn.Flatten(), nn.Linear(16, 4)), _data()
    plan = cg.compile(model, (data.tensors[0][:2],), _dict_loss, batch_size=B, devices=1,
                      replicas=2, executor="inline", optimizer=cg.SGD(lr=0.1))
    history = plan.fit(data, 1, eval_dataset=data, eval_batch_size=8, progress=False,
                       log_dir=str(tmp_path))
    with torch.no_grad():  # the oracle: batches of 8, weighted by their sizes (all equal here)
        out = plan.central_model()(data.tensors[0])
    expected = float(torch.stack([o.softmax(1).amax(1).mean() for o in out.split(8)]).mean())
    assert history.evals[-1].test_extras == {"confidence": pytest.approx(expected, rel=1e-5)}
    with open(tmp_path / "evals.csv") as f:
        row = list(csv.DictReader(f))[-1]
    assert json.loads(row["test_extras"])["confidence"] == pytest.approx(expected, rel=1e-5)
    assert json.load(open(tmp_path / "history.json"))["evals"][-1]["test_extras"] == \
        history.evals[-1].test_extras


@pytest.mark.parametrize("loss_fn,match", [
    (lambda o, y: {"ce": F.cross_entropy(o, y), "aux": o.mean()},
     r"loss_fn returned a dict with keys \['aux', 'ce'\] but no 'loss' entry; training reads "
     r"out\['loss'\]: put the scalar loss under the key 'loss'"),
    (lambda o, y: (F.cross_entropy(o, y), o.mean()),
     r"loss_fn returned a tuple of 2 items \(tensor \[\], tensor \[\]\); return the loss as a 0-dim "
     r"tensor, or a dict whose 'loss' entry is one"),
    (lambda o, y: {"loss": F.cross_entropy(o, y, reduction="none")},
     r"loss_fn's 'loss' entry must be a scalar tensor, got a tensor of shape \[4\]; reduce it"),
    (lambda o, y: None, r"loss_fn must return a scalar tensor that autograd can differentiate, "
                        r"got NoneType"),
], ids=["dict-without-loss", "tuple", "dict-of-a-vector", "none"])
@pytest.mark.parametrize("mode", ["per_replica", "fused"])
def test_a_loss_of_another_form_fails_round_0_with_the_fix(loss_fn, match, mode):
    """Checked where training computes the loss (fit calls loss_fn in training rounds only)."""
    plan = cg.compile(nn.Sequential(nn.Flatten(), nn.Linear(16, 4)), (_data().tensors[0][:2],),
                      loss_fn, batch_size=B, devices=1, replicas=2, learner_mode=mode)
    with pytest.raises(TaskError, match=r"task 'learn:d0:r0' \(LEARN on cpu:0\) failed in round 0: "
                                        r"ValueError: " + match):
        plan.fit(_data(), 1, progress=False)


# -- non-tensor inputs in fused mode ------------------------------------------------------

class Flagged(nn.Module):
    """A keyword flag (CLIP's ``return_loss=True``) and an optional mask."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 4)

    def forward(self, x, scale: bool = False, mask=None):
        out = self.lin(x if mask is None else x * mask)
        return out * 2.0 if scale else out


def _flag_batch(samples):
    x, y = zip(*samples)
    return {"x": torch.stack(x), "scale": True, "mask": None}, torch.stack(y)


def _trained(make, example, loss_fn, data, mode, **kw) -> torch.Tensor:
    kw.setdefault("optimizer", None)  # compile's
    plan = make_plan(make, example=example, loss_fn=loss_fn, batch_size=B, devices=1, replicas=2,
                     learner_mode=mode, executor="inline", **kw)
    plan.fit(data, 2, shuffle=False, progress=False, metrics_every=None)
    return plan.replica_weights()


@pytest.mark.filterwarnings("ignore::crossbow_graph.TraceWarning")  # `if scale:` has no fx graph
def test_bool_and_none_keyword_inputs_train_fused_as_per_replica():
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(N, 6, generator=g), torch.randint(0, 4, (N,), generator=g)
    loader = DataLoader(TensorDataset(x, y), batch_size=B, collate_fn=_flag_batch)
    example = {"x": x[:2], "scale": True, "mask": None}
    per_replica, fused = (_trained(Flagged, example, F.cross_entropy, loader, mode)
                          for mode in ("per_replica", "fused"))
    torch.testing.assert_close(fused, per_replica, rtol=1e-5, atol=1e-6)
    unscaled = _trained(Flagged, {"x": x[:2]}, F.cross_entropy, TensorDataset(x, y), "per_replica")
    assert not torch.allclose(unscaled, per_replica, atol=1e-3)  # the flag reached the model


class OwnLoss(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 1)

    def forward(self, x, t):
        return {"loss": (self.lin(x).squeeze(-1) - t).pow(2).mean()}


class Unlabelled(Dataset):
    """Dict samples without "labels": their target is None."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(3)
        self.x = torch.randn(N, 6, generator=g)
        self.t = self.x.sum(1)

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "t": self.t[i]}


def test_a_none_target_trains_fused_as_per_replica():
    data = Unlabelled()
    example = {"x": data.x[:2], "t": data.t[:2]}
    per_replica, fused = (_trained(OwnLoss, example, None, data, mode, optimizer=cg.SGD(lr=0.05))
                          for mode in ("per_replica", "fused"))
    torch.testing.assert_close(fused, per_replica, rtol=1e-5, atol=1e-6)


# -- gradient and module hooks --------------------------------------------------------------

def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 4))


def _clamp(g):
    return g.clamp(-0.01, 0.01)


def _hooked_run(model: nn.Module, mode: str, **kw) -> cg.Plan:
    kw = {"devices": 1, "replicas": 1, "executor": "inline", "optimizer": cg.SGD(lr=0.1, momentum=0.9), **kw}
    plan = make_plan(model, seed=None, example=_data().tensors[0][:2], batch_size=B, learner_mode=mode, **kw)
    plan.fit(_data(), 1, shuffle=False, progress=False, metrics_every=None)
    return plan


@pytest.mark.parametrize("mode", ["per_replica", "fused"])
def test_a_clamping_gradient_hook_trains_at_k1_as_eager_with_the_hook(mode):
    eager = _net()
    eager[1].weight.register_hook(_clamp)
    expected = eager_steps(eager, _sgd, batches_of(_data(), B)).weights[-1]
    unhooked = eager_steps(_net(), _sgd, batches_of(_data(), B)).weights[-1]
    assert not torch.allclose(expected, unhooked, atol=1e-3)  # the hook matters
    model = _net()
    model[1].weight.register_hook(_clamp)
    plan = _hooked_run(model, mode)
    torch.testing.assert_close(plan.central_weights(), expected, rtol=1e-5, atol=1e-6)
    assert list(plan.central_model()[1].weight._backward_hooks.values()) == [_clamp]


@pytest.mark.parametrize("mode,executor", [("per_replica", "process"), ("fused", "inline")])
def test_every_replica_runs_the_gradient_hooks_also_new_ones(mode, executor):
    """A hook that zeroes the bias's gradient keeps it at its start in every replica and in z
    (SGD without weight decay), also in the replica that set_replicas adds."""
    model = _net()
    start = model[3].bias.detach().clone()
    model[3].bias.register_hook(torch.zeros_like)
    plan = _hooked_run(model, mode, replicas=2, executor=executor)
    plan.set_replicas(3)
    plan.fit(_data(48), 1, progress=False, metrics_every=None)
    for replica in plan.states[0].replicas:
        torch.testing.assert_close(replica[3].bias.detach(), start, rtol=0, atol=0)
    z = plan.central_model()
    torch.testing.assert_close(z[3].bias.detach(), start, rtol=0, atol=0)
    assert not torch.equal(z[3].weight, plan.template[3].weight)


def test_a_post_accumulate_grad_hook_is_refused_at_compile():
    model = _net()
    model[3].weight.register_post_accumulate_grad_hook(lambda p: None)
    with pytest.raises(ValueError, match=r"parameter '3.weight' of Sequential has a post-accumulate-grad "
                                         r"hook \(register_post_accumulate_grad_hook: .*<lambda>\).*remove "
                                         r"the hook .*fit\(max_grad_norm=...\)"):
        cg.compile(model, (_data().tensors[0][:2],), F.cross_entropy, batch_size=B, devices=1)


@pytest.mark.parametrize("mode", ["per_replica", "fused"])
def test_module_forward_hooks_run_as_in_eager(mode):
    def hook(model):
        model[1].register_forward_hook(lambda mod, args, out: out * 0.5)
        model[3].register_forward_pre_hook(lambda mod, args: (args[0] * 2.0,))
        return model
    expected = eager_steps(hook(_net()), _sgd, batches_of(_data(), B)).weights[-1]
    unhooked = eager_steps(_net(), _sgd, batches_of(_data(), B)).weights[-1]
    assert not torch.allclose(expected, unhooked, atol=1e-3)
    plan = _hooked_run(hook(_net()), mode)
    torch.testing.assert_close(plan.central_weights(), expected, rtol=1e-5, atol=1e-6)


def test_a_module_backward_hook_trains_per_replica_and_fused_says_so():
    def hook(model):
        model[3].register_full_backward_hook(lambda mod, gin, gout: (gin[0] * 0.1,))
        return model
    expected = eager_steps(hook(_net()), _sgd, batches_of(_data(), B)).weights[-1]
    plan = _hooked_run(hook(_net()), "per_replica")
    torch.testing.assert_close(plan.central_weights(), expected, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match=r"learner_mode='fused' cannot run Sequential: .*module '3' has "
                                         r"a backward hook .*use learner_mode='per_replica'"):
        _hooked_run(hook(_net()), "fused")


# -- BatchNorm of a frozen backbone ---------------------------------------------------------

class FineTuned(nn.Module):
    """A frozen backbone kept in evaluation mode by ``train()`` (the fine-tuning idiom) and a
    trained head with its own BatchNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Flatten(), nn.Linear(16, 8), nn.BatchNorm1d(8))
        self.head = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 4))
        self.backbone.requires_grad_(False)
        with torch.no_grad():
            self.backbone[2].running_mean.fill_(0.5)
            self.backbone[2].running_var.fill_(3.16)

    def forward(self, x):
        return self.head(self.backbone(x))

    def train(self, mode: bool = True):
        super().train(mode)
        self.backbone.eval()
        return self


def test_a_frozen_backbones_statistics_survive_and_the_heads_are_re_estimated():
    torch.manual_seed(0)
    data = _data(64)
    plan = cg.compile(FineTuned(), (data.tensors[0][:2],), F.cross_entropy, batch_size=B,
                      devices=1, replicas=2, executor="inline")
    plan.fit(data, 1, progress=False, metrics_every=None)
    accuracy, loss = plan.evaluate(data)
    z = plan.central_model()
    assert torch.equal(z.backbone[2].running_mean, torch.full((8,), 0.5))
    assert torch.equal(z.backbone[2].running_var, torch.full((8,), 3.16))
    head = dict(z.head[1].named_buffers())
    offsets = {name: (off, n) for name, _, off, n in plan.states[0].buffers.entries}
    off, n = offsets["head.1.running_var"]
    replicas_mean = plan.states[0].zbuf[off:off + n]
    assert not torch.allclose(head["running_var"], replicas_mean, rtol=1e-3)  # re-estimated
    with torch.no_grad():  # evaluate saw these statistics
        out = z(data.tensors[0])
    assert loss == pytest.approx(float(F.cross_entropy(out, data.tensors[1])), rel=1e-5)
