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

from crossbow_graph.engine.learners import learn_group

from _plans import TinyBN, make_plan

MOVING = {"copy_", "clone", "zero_", "fill_", "stack", "cat", "index_select"}  # kernels, not views


class _Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _two_steps(m: int, b: int = 4):
    """A TinyBN plan of m fused replicas, one step (checked against eager BatchNorm per replica),
    then a second step under the counter. Returns (plan, counts of the second step)."""
    plan = make_plan(TinyBN, replicas=m, learner_mode="fused", executor="inline", batch_size=b)
    state, fused = plan.states[0], plan.scheduler.fused_programs[0]
    g = torch.Generator().manual_seed(1)
    batch = [torch.randn(m * b, 1, 8, 8, generator=g), torch.randint(0, 4, (m * b,), generator=g)]
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
def test_fused_step_moves_memory_once_per_gradient_tensor_and_not_per_buffer(m):
    """At most one copy per parameter tensor (its gradient into g) plus 3 (the conv batching
    rule's clone of its input, the buffers' gather and write-back) at m = 2 and 4: no zeroing
    of g, no per-replica or per-buffer copies; every replica's num_batches_tracked counts both
    steps, in the module and in the stacked ``state.ints``."""
    plan, moving = _two_steps(m)
    n_params = len(plan.states[0].params.entries)  # 6: conv, bn, fc weights and biases
    assert sum(moving.values()) <= n_params + 3, moving
    assert "zero_" not in moving and "stack" not in moving, moving
    state = plan.states[0]
    assert state.ints["bn.num_batches_tracked"].tolist() == [2] * m
    assert [r.bn.num_batches_tracked.item() for r in state.replicas] == [2] * m


def test_count_does_not_grow_with_replicas():
    assert _two_steps(2)[1] == _two_steps(4)[1]
