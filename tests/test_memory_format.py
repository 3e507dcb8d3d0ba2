"""Convolution weights channels-last in the flat rows (engine/state/flat.py ``FlatLayout``,
``compile(memory_format=...)``). The oracles: the same plan with contiguous rows, eager PyTorch,
and the standard order of ``torch.cat([p.flatten() for p in model.parameters()])``."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import crossbow_graph as cg
from crossbow_graph.engine.state.flat import FlatLayout, channels_last_weights

from _plans import make_plan
from _reference import batches_of, eager_steps, flat

B, N = 16, 128


def _net() -> nn.Module:
    torch.manual_seed(0)
    # no bias before BatchNorm: its gradient is rounding noise, which Adam scales to ±lr
    return nn.Sequential(nn.Conv2d(3, 6, 3, padding=1, bias=False), nn.BatchNorm2d(6), nn.ReLU(),
                         nn.MaxPool2d(2), nn.Conv2d(6, 8, 3), nn.ReLU(), nn.Flatten(),
                         nn.Linear(8 * 2 * 2, 5))


@pytest.fixture(scope="module")
def data():
    g = torch.Generator().manual_seed(3)
    return TensorDataset(torch.randn(N, 3, 8, 8, generator=g), torch.randint(0, 5, (N,), generator=g))


# the plans of these tests: _net at b = B on one device, inline, SGD(0.05, momentum 0.9) unless given;
# the example inputs and memory_format given
_plan = functools.partial(make_plan, model=_net, seed=None, batch_size=B, devices=1, executor="inline")


def _adamw(model):
    return torch.optim.AdamW([{"params": model[0].parameters(), "lr": 3e-3},
                              {"params": list(model[1].parameters()) + list(model[4].parameters())
                               + list(model[7].parameters()), "lr": 1e-3}], weight_decay=0.05)


def test_layout_views_are_channels_last_and_round_trip():
    """A conv weight's view has channels-last strides; ``to_standard`` gives each tensor's
    ``flatten()`` order and ``from_standard`` inverts it, on rows ``[m, P]`` and on ``[P]``."""
    w, bias = torch.randn(4, 3, 2, 5), torch.randn(4)
    layout = FlatLayout.of([("conv.weight", w), ("conv.bias", bias)], frozenset({"conv.weight"}))
    standard = torch.cat([w.flatten(), bias])
    flat = layout.from_standard(standard)
    assert not torch.equal(flat, standard)  # the weight's segment is stored [O, kH, kW, I]
    view = layout.view(flat, layout.entries[0])
    assert view.is_contiguous(memory_format=torch.channels_last) and not view.is_contiguous()
    assert torch.equal(view, w) and torch.equal(layout.view(flat, layout.entries[1]), bias)
    assert torch.equal(layout.to_standard(flat), standard)
    rows = torch.stack([flat, 2 * flat])
    assert torch.equal(layout.to_standard(rows), torch.stack([standard, 2 * standard]))
    assert torch.equal(layout.from_standard(layout.to_standard(rows)), rows)


def test_auto_picks_channels_last_on_cpu_only():
    model = _net()
    assert channels_last_weights(model, "auto", {"cpu"}) == {"0.weight", "4.weight"}
    assert channels_last_weights(model, "auto", {"cuda"}) == frozenset()
    assert channels_last_weights(model, "contiguous", {"cpu"}) == frozenset()
    assert channels_last_weights(nn.Linear(3, 2), "channels_last", {"cpu"}) == frozenset()


def test_bad_memory_format_is_refused_before_tracing(data):
    with pytest.raises(ValueError, match="memory_format='nhwc'.*'auto', 'channels_last', 'contiguous'"):
        _plan(example=data.tensors[0][:B], memory_format="nhwc")


@pytest.mark.parametrize("mode,optimizer", [("per_replica", cg.SGD(lr=0.05, momentum=0.9)),
                                            ("per_replica", _adamw), ("fused", _adamw)],
                         ids=["per_replica-sgd", "per_replica-adamw", "fused-adamw"])
def test_channels_last_trains_as_contiguous_rows(data, mode, optimizer):
    """Two replicas for two epochs: channels-last rows end within float32 rounding of contiguous
    rows (the CPU's convolutions sum in another order), z and every replica."""
    plans = {}
    for fmt in ("channels_last", "contiguous"):
        plan = _plan(example=data.tensors[0][:B], memory_format=fmt, optimizer=optimizer, replicas=2,
                     learner_mode=mode)
        weight = plan.states[0].replicas[1][4].weight
        assert weight.is_contiguous(memory_format=torch.channels_last) == (fmt == "channels_last")
        assert weight.grad.stride() == weight.stride()
        plan.fit(data, epochs=2, progress=False, shuffle=False, metrics_every=None)
        plans[fmt] = plan
    cl, std = plans["channels_last"], plans["contiguous"]
    torch.testing.assert_close(cl.central_weights(), std.central_weights(), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(cl.replica_weights(), std.replica_weights(), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(flat(cl.central_model()), cl.central_weights(), rtol=0, atol=0)


def test_one_learner_with_channels_last_rows_is_eager_adamw(data):
    """k = 1 with AdamW and param groups, channels-last rows: eager PyTorch step for step."""
    plan = _plan(example=data.tensors[0][:B], memory_format="channels_last", optimizer=_adamw, replicas=1)
    assert plan.states[0].params.channels_last
    plan.fit(data, epochs=1, progress=False, shuffle=False, metrics_every=None)
    ref = eager_steps(_net(), _adamw, batches_of(data, B)).weights[-1]
    assert ((plan.central_weights() - ref).norm() / ref.norm()) < 1e-5


@pytest.mark.parametrize("sync", ["sma", "diloco"])
def test_checkpoints_hold_the_standard_order_and_move_between_formats(data, sync):
    """A channels-last plan's state_dict holds w, v, z, z_prev and DiLoCo's outer momentum in the
    standard order: a contiguous plan loads it with the same z, and both train on alike."""
    kw = dict(sync=cg.DiLoCo(sync_every=2)) if sync == "diloco" else {}
    cl = _plan(example=data.tensors[0][:B], memory_format="channels_last", replicas=2, **kw)
    cl.fit(data, epochs=1, progress=False, shuffle=False, metrics_every=None)
    sd = cl.state_dict()
    state = sd["states"][0]
    assert torch.equal(state["z"], cl.central_weights())
    assert torch.equal(state["w"], cl.replica_weights())
    if sync == "diloco":
        momentum = sd["outer_optimizer"]["state"]["state"][0]["momentum_buffer"]
        assert momentum.abs().sum() > 0
    std = _plan(example=data.tensors[0][:B], memory_format="contiguous", replicas=2, **kw)
    std.load_state_dict(copy.deepcopy(sd))
    assert torch.equal(std.central_weights(), cl.central_weights())
    assert torch.equal(std.replica_weights(), cl.replica_weights())
    if sync == "diloco":
        assert torch.equal(std.state_dict()["outer_optimizer"]["state"]["state"][0]["momentum_buffer"], momentum)
    fit = functools.partial(cg.Plan.fit, train_dataset=data, epochs=1, progress=False,
                            shuffle=False, metrics_every=None)
    fit(cl)
    fit(std)
    torch.testing.assert_close(std.central_weights(), cl.central_weights(), rtol=1e-4, atol=1e-5)


def test_one_replica_row_takes_torch_fused_adamw_with_channels_last_rows(data):
    """A row's channels-last views are dense, and the optimizer state is laid out as them: the
    row optimizer keeps torch's fused AdamW (a stacked view of two rows is strided: not fused)."""
    for replicas, fused in ((1, True), (2, False)):
        model = _net()
        plan = _plan(example=data.tensors[0][:B], memory_format="channels_last", replicas=replicas,
                     optimizer=lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3))
        plan.fit(TensorDataset(*(t[:B * replicas] for t in data.tensors)), epochs=1,
                 progress=False, shuffle=False, metrics_every=None)
        rows = plan.states[0].optim_rows
        (inst, _), = rows._cache.values()
        assert bool(inst.param_groups[0].get("fused")) is fused
        if fused:
            p = inst.param_groups[0]["params"][0]
            assert inst.state[p]["exp_avg"].stride() == p.stride() == p.grad.stride()
        del model


class _StandardisedConv(nn.Conv2d):
    """Weight standardisation: its own forward reads the weight with ``.view``."""

    def forward(self, x):
        v = self.weight.view(self.weight.shape[0], -1)
        v = (v - v.mean(1, keepdim=True)) / (v.std(1, keepdim=True) + 1e-5)
        return nn.functional.conv2d(x, v.view_as(self.weight), self.bias, self.stride, self.padding)


class _ViewsItsWeight(nn.Module):
    """nn.Conv2d's own forward, but the model reads the weight with ``.view`` besides."""

    def __init__(self):
        super().__init__()
        self.conv, self.fc = nn.Conv2d(3, 4, 3), nn.Linear(4 * 6 * 6, 5)

    def forward(self, x):
        return self.fc(torch.relu(self.conv(x)).flatten(1)) + 0 * self.conv.weight.view(-1).sum()


class _Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Conv2d(3, 3, 3, padding=1), nn.Conv2d(3, 3, 3, padding=1)
        self.b.weight = self.a.weight
        self.fc = nn.Linear(3 * 8 * 8, 5)

    def forward(self, x):
        return self.fc(self.b(torch.relu(self.a(x))).flatten(1))


def test_weights_user_code_may_read_as_contiguous_stay_contiguous(data):
    """A Conv2d subclass with its own forward, a weight tied to two modules and a parametrized
    (spectral-norm) weight keep their layout; the spectral norm's power iteration is not run by
    the layout's choice (the two plans train alike bit for bit)."""
    torch.manual_seed(0)
    sub = nn.Sequential(_StandardisedConv(3, 4, 3), nn.Flatten(), nn.Linear(4 * 6 * 6, 5))
    assert channels_last_weights(sub, "channels_last", {"cpu"}) == frozenset()
    assert channels_last_weights(_Tied(), "channels_last", {"cpu"}) == frozenset()
    plans = []
    for fmt in ("auto", "contiguous"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.utils.parametrizations.spectral_norm(nn.Conv2d(3, 4, 3)),
                              nn.Flatten(), nn.Linear(4 * 6 * 6, 5))
        plan = cg.compile(model, (data.tensors[0][:B],), nn.functional.cross_entropy, batch_size=B,
                          devices=1, replicas=2, executor="inline", memory_format=fmt)
        assert not plan.states[0].params.channels_last
        plan.fit(data, epochs=1, progress=False, shuffle=False, metrics_every=None)
        plans.append(plan)
    assert torch.equal(plans[0].central_weights(), plans[1].central_weights())


def test_a_forward_that_views_a_weight_keeps_it_contiguous_or_is_refused(data):
    """The layout's dry run: ``"auto"`` warns and keeps the weights contiguous (and trains);
    ``"channels_last"`` is a ValueError naming ``memory_format='contiguous'``, before training."""
    x = data.tensors[0][:B]
    with pytest.warns(UserWarning, match=r"fails with its Conv2d weights channels-last.*\.view"):
        plan = cg.compile(_ViewsItsWeight(), (x,), nn.functional.cross_entropy, batch_size=B,
                          devices=1, replicas=1)
    assert not plan.states[0].params.channels_last
    plan.fit(data, epochs=1, progress=False, metrics_every=None)
    with pytest.raises(ValueError, match="memory_format='contiguous'"):
        cg.compile(_ViewsItsWeight(), (x,), nn.functional.cross_entropy, batch_size=B, devices=1,
                   replicas=1, memory_format="channels_last")
