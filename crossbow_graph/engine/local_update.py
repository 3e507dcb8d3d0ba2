"""The updates every backend runs: the learners' local update of a device's rows
(docs/design-overview.md §2, steps 1–2) and, under torchrun, the ranks' all-reduce of the sums
(docs/distributed.md)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from .faults import FaultMonitor
from .optim import LocalOptimizer
from .state import DeviceState

if TYPE_CHECKING:
    from .scheduler import Scheduler

__all__ = ["local_update_rows", "row_update", "all_reduce_sums"]


def local_update_rows(sched: "Scheduler", state: DeviceState, r0: int, r1: int, *, alpha: float,
                      synchronise: bool, optimizer: LocalOptimizer,
                      out: torch.Tensor | None = None,
                      losses: list[torch.Tensor] | None = None, on_device: bool = False
                      ) -> tuple[torch.Tensor | None, Any]:
    """Rows ``r0 … r1−1``: faulty replicas (NaN/Inf gradients or ``losses``, r1 − r0 0-dim
    tensors) reset from z, the optimizer's step, and in a round that synchronises the correction
    α·(ŵ − z), summed into ``out [P]`` (default: a new tensor); ``on_device``: masks, no host read.

    Returns:
        (Σ corrections ``[P]``, None without synchronisation; the faulty rows' indices, or with
        ``on_device`` their mask ``[r1 − r0]`` bool on the device).
    """
    if on_device:
        faulty = FaultMonitor.find_and_reset_masked(state, r0, r1, sched.max_divergence, losses)
    else:
        faulty = FaultMonitor.find_and_reset(state, r0, r1, sched.max_divergence, sched.kernels,
                                             losses)
    z = state.z if synchronise and alpha else None
    if optimizer.kernel:
        sgd = optimizer.sgd()
        hyper = sched.graph_hyper(state)  # a graph round: device tensors, read at replay
        alpha_in = alpha if z is not None else 0.0
        args = hyper.local_args(sgd, alpha_in) if hyper is not None else dict(
            lr=sgd.lr, momentum=sgd.momentum, weight_decay=sgd.weight_decay, alpha=alpha_in)
        acc = sched.kernels.local_update(
            state.w[r0:r1], state.v[r0:r1], state.g[r0:r1], z, nesterov=sgd.nesterov,
            first_step=all(state.first_step[r0:r1]),  # a new replica's momentum is zero: same maths
            out=out, **args)
        state.first_step[r0:r1] = [False] * (r1 - r0)
    else:
        acc = row_update(state, r0, r1, z, alpha, out)
    if on_device:
        FaultMonitor.reset_masked(state, r0, faulty)
    else:
        FaultMonitor.reset(state, faulty)  # back at z: the zero gradient still met weight decay
    return acc, faulty


@torch.no_grad()
def row_update(state: DeviceState, r0: int, r1: int, z: torch.Tensor | None, alpha: float,
               out: torch.Tensor | None) -> torch.Tensor | None:
    """A row optimizer's local update of rows r0 … r1−1 (engine/optim.py): c = α·(ŵ − z) from
    the pre-step weights, the step, w ← w − c; returns Σ c ``[P]`` (in ``out``), or None
    without a correction (``z`` None)."""
    w = state.w[r0:r1]
    c = None
    if z is not None:
        c = torch.sub(w, z, out=state.optim_rows.scratch(w)).mul_(alpha)
    state.optim_rows.step(state, r0, r1)
    if c is None:
        return None
    w.sub_(c)
    return torch.sum(c, dim=0, out=out) if out is not None else c.sum(dim=0)


def all_reduce_sums(sched: "Scheduler", total: torch.Tensor, bufs: list[torch.Tensor],
                    home: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``total [P]``, the sum of the buffers ``bufs`` (``[m, Q]`` each) and this rank's count of
    unshared fault events packed in one ``[P + Q + 1]`` tensor (the masters' dtype), all-reduced
    (sum) over the ranks; the count goes to ``sched.backend.share_faults``.

    Returns:
        (C ``[P]``, the mean buffers over all k replicas ``[Q]`` or None).
    """
    P, Q = total.shape[0], sched.states[0].buf.shape[1]
    flat = torch.empty(P + Q + 1, dtype=total.dtype, device=home)
    flat[:P].copy_(total)
    if Q:
        torch.sum(torch.cat([bb.to(home, total.dtype) for bb in bufs]), dim=0, out=flat[P:P + Q])
    flat[P + Q] = len(sched.faults.pending)
    sched.comm.all_reduce_sum_(flat, sched.round_index, num_parameters=P)
    sched.backend.share_faults(flat[P + Q:])
    mean_buf = flat[P:P + Q].div_(sched.num_learners).to(sched.states[0].buf.dtype) if Q else None
    return flat[:P], mean_buf
