"""The sums over devices and ranks that the algorithms' global updates share (engine/sync/)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ..state import DeviceState
    from .base import SyncContext

__all__ = ["sum_on", "mean_buffers", "global_sum", "restart_from_z"]


def sum_on(accs: list[torch.Tensor], home: torch.device) -> torch.Tensor:
    """Σ_d acc_d ``[P]`` on ``home`` (never writes an acc_d; with one device it may be acc_0)."""
    total = None
    for acc in accs:
        acc = acc.to(home)
        total = acc if total is None else total + acc
    return total


def mean_buffers(bufs: list[torch.Tensor], home: torch.device) -> torch.Tensor | None:
    """The mean over every replica of the devices' float buffers ``[m_d, Q]``, ``[Q]`` on
    ``home``; None without float buffers."""
    if not bufs[0].shape[1]:
        return None
    return torch.cat([bb.to(home) for bb in bufs]).mean(dim=0)


def global_sum(ctx: "SyncContext", accs: list[torch.Tensor], bufs: list[torch.Tensor],
               scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor | None, int]:
    """Σ_d acc_d ``[P]`` on the first device, under torchrun summed over the ranks too
    (``SyncContext.all_reduce_sums``), under torchft over the live replica groups
    (``FaultTolerantSync.all_reduce``, each group's sum multiplied by ``scale`` first); the mean
    buffers ``[Q]`` over all k replicas (None without float buffers); and k, the learners whose
    contributions the sum holds (under torchft the live groups', else ``ctx.num_learners``)."""
    home = ctx.states[0].torch_device
    total = sum_on(accs, home)
    if ctx.ft is not None:
        return ctx.ft.all_reduce(ctx, total * scale, bufs, ctx.round_index)
    if ctx.comm is None:
        return total, mean_buffers(bufs, home), ctx.num_learners
    return (*ctx.all_reduce_sums(total, bufs, home), ctx.num_learners)


def restart_from_z(states: list["DeviceState"], mean_buf: torch.Tensor | None) -> None:
    """The first device's new z and z_prev to every other device, every replica restarted from z
    (w_j ← z; v and the row optimizers' state kept) and zbuf ← ``mean_buf`` (when not None)."""
    s0 = states[0]
    for s in states:
        if s is not s0:
            s.z.copy_(s0.z.to(s.torch_device))
            s.z_prev.copy_(s0.z_prev.to(s.torch_device))
        s.w.copy_(s.z.expand_as(s.w))
        if mean_buf is not None:
            s.zbuf.copy_(mean_buf.to(s.torch_device))
