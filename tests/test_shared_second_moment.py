"""SMA(share_second_moment=True): a device's Adam or AdamW learners step with one second moment,
from their mean gradient (engine/state/optim.py ``shared_adam_step``; docs/design-overview.md §2,
"One second moment per device"). A hand-written per-learner loop is the oracle."""

from __future__ import annotations

import copy
import functools
import math

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import crossbow_graph as cg
from crossbow_graph.engine.state.optim import shared_adam_step

from _plans import make_plan
from _reference import batches_of

N, B = 192, 8


def _net() -> nn.Module:
    """LayerNorm, not BatchNorm: a bias before BatchNorm has a true gradient of 0, which Adam
    turns into ±η steps of rounding noise (design §2) that no oracle can follow."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 16), nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, 3))


@pytest.fixture(scope="module")
def data():
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(N, 12, generator=g), torch.randint(0, 3, (N,), generator=g))


def _adamw(model):
    """AdamW in two groups, one with its own lr and weight decay."""
    return torch.optim.AdamW([
        {"params": model[0].parameters(), "lr": 3e-3},
        {"params": list(model[1].parameters()) + list(model[3].parameters()), "lr": 1e-3,
         "weight_decay": 0.1}], lr=1e-3, betas=(0.8, 0.99))


def _adam_l2(model):
    """Adam with its L2 weight decay (added to the gradient)."""
    return torch.optim.Adam(model.parameters(), lr=2e-3, betas=(0.9, 0.95), weight_decay=0.05)


def _reference(start: nn.Module, make_opt, batches, k: int, rounds: int) -> list[torch.Tensor]:
    """k learners that never synchronise, learner j on batch t·k + j in round t; Adam written out
    per learner and parameter, v from the learners' mean gradient; their flat weights."""
    models = [copy.deepcopy(start) for _ in range(k)]
    groups = make_opt(start).param_groups
    where = {id(p): gi for gi, g in enumerate(groups) for p in g["params"]}
    names = [n for n, p in start.named_parameters() if id(p) in where]
    group_of = {n: groups[where[id(p)]] for n, p in start.named_parameters() if n in names}
    decoupled = isinstance(make_opt(start), torch.optim.AdamW)
    m = [{n: torch.zeros_like(p) for n, p in mod.named_parameters()} for mod in models]
    v = [{n: torch.zeros_like(p) for n, p in mod.named_parameters()} for mod in models]
    for t in range(rounds):
        grads = []
        for j, mod in enumerate(models):
            x, y = batches[t * k + j]
            mod.zero_grad()
            nn.functional.cross_entropy(mod(x), y).backward()
            grads.append({n: p.grad.detach().clone() for n, p in mod.named_parameters()})
        with torch.no_grad():
            for n in names:
                g = group_of[n]
                lr, (b1, b2), eps, wd = g["lr"], g["betas"], g["eps"], g["weight_decay"]
                ps = [dict(mod.named_parameters())[n] for mod in models]
                gs = [grads[j][n] + (0 if decoupled else wd * ps[j]) for j in range(k)]
                mean = sum(gs) / k
                # the floor: at least the learners' mean square over k²
                sq = torch.maximum(mean * mean, sum(gj * gj for gj in gs) / k ** 3)
                for j in range(k):
                    if decoupled:
                        ps[j].mul_(1 - lr * wd)
                    m[j][n] = b1 * m[j][n] + (1 - b1) * gs[j]
                    v[j][n] = b2 * v[j][n] + (1 - b2) * sq
                    m_hat = m[j][n] / (1 - b1 ** (t + 1))
                    v_hat = v[j][n] / (1 - b2 ** (t + 1))
                    ps[j].sub_(lr * m_hat / (v_hat.sqrt() + eps))
    return [torch.cat([p.detach().reshape(-1) for n, p in mod.named_parameters() if n in names])
            for mod in models]


_plan = functools.partial(make_plan, seed=None, batch_size=B)


@pytest.mark.parametrize("make_opt", [_adamw, _adam_l2], ids=["adamw-groups", "adam-l2"])
def test_each_learner_steps_with_its_own_first_moment_and_the_devices_mean_gradients_second(
        data, make_opt):
    """With τ beyond the fit the replicas never synchronise: replica j is the hand-written loop's
    learner j, whose v is the moving average of the 3 learners' mean gradient squared."""
    k, rounds = 3, N // (3 * B)
    model = _net()
    start = copy.deepcopy(model)
    plan = _plan(model, example=data.tensors[0][:B], devices=1, replicas=k, executor="inline",
                 optimizer=make_opt(model),
                 sync=cg.SMA(sync_every=10 * rounds, scale_lr=False, share_second_moment=True))
    plan.fit(data, shuffle=False, progress=False, metrics_every=None)
    expected = _reference(start, make_opt, batches_of(data, B), k, rounds)
    for j in range(k):
        torch.testing.assert_close(plan.replica_weights()[j], expected[j], rtol=1e-5, atol=1e-6)
    rows = plan.states[0].optim_rows
    for per_param in rows.store:  # one second moment, first moments apart
        assert torch.equal(per_param["exp_avg_sq"][0], per_param["exp_avg_sq"][2])
    assert not torch.equal(rows.store[0]["exp_avg"][0], rows.store[0]["exp_avg"][1])
    own = _plan(_net(), example=data.tensors[0][:B], devices=1, replicas=k, executor="inline",
                optimizer=make_opt, sync=cg.SMA(sync_every=10 * rounds, scale_lr=False))
    own.fit(data, shuffle=False, progress=False, metrics_every=None)  # each learner's own v
    assert (own.replica_weights() - plan.replica_weights()).abs().max() > 1e-4


def test_one_learner_per_device_is_torchs_adamw_bit_for_bit(data):
    """A step of one row has no other gradient to share: torch.optim's own AdamW, as without."""
    weights = []
    for share in (True, False):
        model = _net()
        plan = _plan(model, example=data.tensors[0][:B], devices=2, replicas=1, executor="inline",
                     optimizer=_adamw(model), sync=cg.SMA(share_second_moment=share))
        plan.fit(data, epochs=1, progress=False, metrics_every=None)
        weights.append(plan.replica_weights())
    assert torch.equal(weights[0], weights[1])


def test_a_new_learner_starts_its_moments_from_zero_and_averages_the_same_mean(data):
    """A replica added in mid-run (the tuner's, ``set_replicas``) has its own step count and
    bias correction; its v follows the same mean gradient from its own start."""
    model = _net()
    plan = _plan(model, example=data.tensors[0][:B], devices=1, replicas=2, executor="inline",
                 optimizer=_adamw(model), sync=cg.SMA(share_second_moment=True))
    plan.fit(data, epochs=1, progress=False, metrics_every=None)
    rows = plan.states[0].optim_rows
    before = rows.store[0]["exp_avg_sq"][0].clone()
    plan.set_replicas(3)
    plan.fit(data, epochs=1, progress=False, metrics_every=None)
    later = N // (3 * B)
    steps = [float(s) for s in rows.store[0]["step"]]
    assert steps == [N // (2 * B) + later] * 2 + [later]
    v = rows.store[0]["exp_avg_sq"]
    assert torch.equal(v[0], v[1])
    # the same squares of the mean gradient since the new row started: the older rows' v
    # differs from it by their history, decayed (β₂ of group 0)
    b2 = plan.optimizer.param_groups[0]["betas"][1]
    torch.testing.assert_close(v[0] - v[2], before * b2 ** later, rtol=1e-4, atol=1e-9)
    assert torch.isfinite(plan.replica_weights()).all()


def test_a_faulty_learners_zeroed_gradient_is_left_out_of_the_mean(data):
    """Learner 1's batch holds a NaN in round 0: it is reset (docs/reliability.md), and the
    others' v is (1 − β₂)·max(((g₀ + g₂)/2)², (g₀² + g₂²)/8), not a mean over 3 that counts its
    zero."""
    k = 3
    model = _net()
    start = copy.deepcopy(model)
    x, y = data.tensors[0][:k * B].clone(), data.tensors[1][:k * B]
    x[B + 2, 0] = float("nan")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.99))
    plan = _plan(model, example=x[:B], devices=1, replicas=k, executor="inline", optimizer=opt,
                 sync=cg.SMA(sync_every=1000, scale_lr=False, share_second_moment=True))
    history = plan.fit(TensorDataset(x, y), shuffle=False, progress=False, metrics_every=None)
    assert [f.replica for f in history.faults] == [1]
    grads = []
    for j in (0, 2):
        ref = copy.deepcopy(start)
        nn.functional.cross_entropy(ref(x[j * B:(j + 1) * B]), y[j * B:(j + 1) * B]).backward()
        grads.append(torch.cat([p.grad.reshape(-1) for p in ref.parameters()]))
    expected = 0.01 * torch.maximum(((grads[0] + grads[1]) / 2) ** 2,
                                    (grads[0] ** 2 + grads[1] ** 2) / 8)
    rows = plan.states[0].optim_rows
    v0 = torch.cat([rows.store[i]["exp_avg_sq"][0].reshape(-1) for i in range(len(rows.store))])
    torch.testing.assert_close(v0, expected, rtol=1e-5, atol=1e-12)


def test_where_the_learners_gradients_cancel_the_floor_bounds_each_step():
    """k learners whose gradients cancel (ḡ = 0 in every coordinate): v is floored at the
    learners' mean square over k², so the first step moves each row by k·η where k equal gradients
    cancel (here 2η), where ḡ² alone (0) would give a step of g_j/ε; where they agree, ḡ² is
    above the floor: Adam's sign step η."""
    a = torch.tensor([3.0, -0.5, 1e-3])
    for g, moved in ((torch.stack([a, -a]), 2.0), (torch.stack([a, a]), 1.0)):
        w, m, v = torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 3)
        shared_adam_step(w, g, m, v, torch.zeros(2), lr=1e-2, betas=(0.9, 0.99), eps=1e-12,
                         weight_decay=0.0, decoupled=True)
        torch.testing.assert_close(w.abs(), torch.full((2, 3), moved * 1e-2), rtol=1e-5, atol=0)
        torch.testing.assert_close(v[0], 0.01 * torch.maximum(g.mean(0) ** 2, (g ** 2).mean(0) / 4))


def test_resume_is_bit_identical(data, tmp_path):
    def run(epochs, resume, directory):
        model = _net()
        plan = _plan(model, example=data.tensors[0][:B], devices=1, replicas=3,
                     optimizer=_adamw(model), sync=cg.SMA(share_second_moment=True))
        plan.fit(data, epochs=epochs, progress=False, metrics_every=None,
                 checkpoint_dir=str(directory), resume=resume)
        return plan

    whole = run(2, False, tmp_path / "a")
    run(1, False, tmp_path / "b")
    resumed = run(2, True, tmp_path / "b")
    assert torch.equal(whole.replica_weights(), resumed.replica_weights())
    assert torch.equal(whole.central_weights(), resumed.central_weights())


@pytest.mark.parametrize("make_opt,options,match", [
    (lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), {}, "Adam or AdamW"),
    (lambda m: torch.optim.RMSprop(m.parameters(), lr=1e-3), {}, "Adam or AdamW"),
    (lambda m: torch.optim.AdamW(m.parameters(), amsgrad=True), {}, "amsgrad"),
    (lambda m: torch.optim.Adam(m.parameters(), maximize=True), {}, "maximize"),
    (lambda m: torch.optim.AdamW(m.parameters()), {"executor": "process"}, "inline executor"),
], ids=["sgd", "rmsprop", "amsgrad", "maximize", "process"])
def test_what_it_cannot_share_is_refused_at_compile(data, make_opt, options, match):
    with pytest.raises(ValueError, match=match):
        _plan(_net(), example=data.tensors[0][:B], devices=1, replicas=2, optimizer=make_opt,
              sync=cg.SMA(share_second_moment=True), **options)


def test_the_flag_must_be_a_bool():
    with pytest.raises(TypeError, match="share_second_moment"):
        cg.SMA(share_second_moment=1)


def test_the_summary_and_description_name_it(data):
    plan = _plan(_net(), example=data.tensors[0][:B], devices=1, replicas=2, executor="inline",
                 optimizer=_adamw, sync=cg.SMA(share_second_moment=True))
    assert plan.settings.sync.describe()["share_second_moment"] is True
    assert "one second moment" in plan.summary()
    assert math.isfinite(plan.fit(data, epochs=1, progress=False, metrics_every=None,
                                  eval_dataset=data).evals[-1].test_loss)
