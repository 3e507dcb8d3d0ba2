"""The memory-moving ops of a fused learner step with BatchNorm, counted with a dispatch mode:
the BatchNorm buffers go in and out in one op each and ``num_batches_tracked`` is updated on
its stacked tensor, so the count does not grow with m (bench/fused_ops.py counts a ResNet-32)."""

from __future__ import annotations

import collections
import copy

import pytest
import torch
from torch.nn import functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from crossbow_graph.engine.learning.learners import learn_group
from crossbow_graph.engine.state import flat as state_module

from _plans import TinyBN, make_plan
from test_row_padding import SENTINEL, pad_columns

MOVING = {"copy_", "clone", "zero_", "fill_", "stack", "cat", "index_select"}  # kernels, not views


class _Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


class _Unused(TinyBN):
    """TinyBN with a layer its forward never calls (a None gradient: zeros in g)."""

    def __init__(self) -> None:
        super().__init__()
        self.spare = torch.nn.Linear(2, 2)


def _batch(m: int, b: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(m * b, 1, 8, 8, generator=g), torch.randint(0, 4, (m * b,), generator=g)]


def _two_steps(m: int, b: int = 4):
    """A TinyBN plan of m fused replicas, one step (checked against eager BatchNorm per replica),
    then a second step under the counter. Returns (plan, counts of the second step)."""
    plan = make_plan(TinyBN, replicas=m, learner_mode="fused", executor="inline", batch_size=b)
    state, fused = plan.states[0], plan.rounds.ctx.fused[0]
    batch = _batch(m, b)
    learn_group(state, 0, m, batch, F.cross_entropy, b, "fused", fused)
    for j in range(m):  # oracle: eager BatchNorm of the template on replica j's samples
        eager = copy.deepcopy(plan.template).train()
        eager(batch[0][j * b:(j + 1) * b])
        bn = state.replicas[j].bn
        torch.testing.assert_close(bn.running_mean, eager.bn.running_mean, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(bn.running_var, eager.bn.running_var, rtol=1e-5, atol=1e-6)
    with _Count() as counter:
        learn_group(state, 0, m, batch, F.cross_entropy, b, "fused", fused)
    return plan, {k: v for k, v in counter.counts.items() if k in MOVING}


@pytest.mark.parametrize("m", [2, 4])
def test_fused_step_moves_memory_in_a_few_ops_whatever_the_tensors_and_replicas(m):
    """At m = 2 and 4, at most 4 memory-moving kernels plus one per channels-last weight: the
    conv batching rule's clone of its input, the buffers' gather and write-back, one cat of the
    gradients into g (a channels-last weight's gradient reordered first). No zeroing of g, no
    per-replica, per-buffer or per-gradient copies; every replica's num_batches_tracked counts
    both steps, in the module and in the stacked ``state.ints``."""
    plan, moving = _two_steps(m)
    state = plan.states[0]
    assert state.params.channels_last == {"conv.weight"}  # the CPU's "auto" memory format
    assert sum(moving.values()) <= 4 + len(state.params.channels_last), moving
    assert "zero_" not in moving and "stack" not in moving and "copy_" not in moving, moving
    assert state.ints["bn.num_batches_tracked"].tolist() == [2] * m
    assert [r.bn.num_batches_tracked.item() for r in state.replicas] == [2] * m


def test_count_does_not_grow_with_replicas():
    assert _two_steps(2)[1] == _two_steps(4)[1]


def test_gradients_fill_padded_rows_and_leave_their_pads(monkeypatch):
    """With rows padded (forced on the CPU) the fused step writes the same gradients, bit for
    bit, as into contiguous rows, zeros for an unused layer, and never the pad columns; rows
    r0 … r1−1 of a group only (the other rows keep their values)."""
    out = {}
    for pad in (False, True):
        monkeypatch.setattr(state_module, "_PAD_ROWS_ON_CPU", pad)
        plan = make_plan(_Unused, replicas=4, learner_mode="fused", executor="inline")
        state, fused = plan.states[0], plan.rounds.ctx.fused[0]
        state.g.fill_(SENTINEL)  # zeros in the unused layer's gradient must be written
        if pad:
            pad_columns(state.g).fill_(SENTINEL)
        learn_group(state, 1, 3, _batch(2, 4), F.cross_entropy, 4, "fused", fused)
        out[pad] = state.g.clone()
        if pad:
            assert state.g.stride(0) > state.g.shape[1]
            assert bool((pad_columns(state.g) == SENTINEL).all())
    assert torch.equal(out[True], out[False])
    spare = [e for e in state.params.entries if e[0].startswith("spare.")]
    assert spare and all(bool((state.params.view(out[True][1:3], e) == 0).all()) for e in spare)
    assert bool((out[True][[0, 3]] == SENTINEL).all()) and not bool((out[True][1:3] == SENTINEL).any())
