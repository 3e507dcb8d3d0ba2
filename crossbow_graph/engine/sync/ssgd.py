"""S-SGD, synchronous SGD, the large-batch baseline (docs/design-overview.md §2, "other sync
strategies"): the k learners' gradients averaged every round, one SGD step for every replica."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from ._reduce import mean_buffers, sum_on
from .base import SyncAlgorithm, SyncContext, SyncState

if TYPE_CHECKING:
    from ..optim import LocalOptimizer
    from ..state import DeviceState

__all__ = ["SSGD"]


@dataclass(frozen=True, kw_only=True)
class SSGD(SyncAlgorithm):
    """Synchronous SGD, the large-batch baseline (docs/design-overview.md §2, "other sync strategies").

    Every round each of the k learners computes the gradient of its own batch of b samples; the
    gradients are averaged over all k learners (the all-reduce of S-SGD) and the same SGD step
    (the ``optimizer``'s lr, momentum, Nesterov, weight decay) is applied to every replica, so all
    replicas and z stay identical (z = w) and training equals ``torch.optim.SGD`` on one batch of
    k·b samples (for models without batch-dependent layers; BatchNorm statistics stay per replica).

    It has no settings: it synchronises every round (``sync_every`` = 1) and has no α or μ_z.
    It runs on the inline executor (``executor="auto"`` resolves to it); the process executor's
    workers apply their rows' step themselves, before a global gradient exists. Its local
    optimizer is SGD (the SGD kernels: ``crossbow_graph.SGD`` or a one-group torch.optim.SGD).
    """

    adjustable: ClassVar[tuple[str, ...]] = ()
    fault_tolerant: ClassVar[bool] = False  # its global step is not a sum over groups
    sync_every: ClassVar[int] = 1

    def with_alpha(self, alpha: float | None) -> "SSGD":
        raise ValueError(f"alpha={alpha!r} with sync=SSGD(): S-SGD has no α (its replicas are z)")

    def with_sync_every(self, sync_every: int) -> "SSGD":
        raise ValueError(f"sync_every={sync_every!r} with sync=SSGD(): S-SGD synchronises every round")

    def check_optimizer(self, optimizer: LocalOptimizer) -> None:
        """ValueError unless the SGD kernels run the local optimizer (the global step is SGD's)."""
        if not optimizer.kernel:
            raise ValueError(f"sync=SSGD() steps with SGD only; got optimizer="
                             f"{type(optimizer.optimizer).__name__}: use crossbow_graph.SGD(...) or "
                             f"torch.optim.SGD with one param group, or sync=SMA()")

    def kernel_facts(self, num_learners: int) -> dict[str, Any]:
        return {"num_learners": num_learners, "sync_every": 1, "central_momentum": 0.0}

    def local_update(self, ctx: SyncContext, state: DeviceState, r0: int, r1: int, *,
                     alpha: float, synchronise: bool,
                     losses: list[torch.Tensor] | None = None, on_device: bool = False,
                     out: torch.Tensor | None = None) -> tuple[torch.Tensor, list[int]]:
        """The rows' gradient sum ``[P]``, in the masters' dtype; the step is global; no row is
        reset."""
        return state.g[r0:r1].sum(dim=0, dtype=state.w.dtype), []

    def global_update(self, ctx: SyncContext, sync_state: SyncState, accs: list[torch.Tensor],
                      bufs: list[torch.Tensor]) -> None:
        """ḡ = Σ_d acc_d / k, one SGD step of replica 0 of device 0 with ḡ, then every replica
        (w, v) and z on every device set to it; float buffers averaged.

        Raises:
            ValueError: under torchrun (the gradient sum is not all-reduced across ranks).
        """
        if ctx.comm is not None:
            raise ValueError("sync=SSGD() runs in one process for now (its gradient sum is not "
                             "all-reduced across torchrun ranks); use SMA under torchrun")
        states, home = ctx.states, ctx.states[0].torch_device
        s0, opt = states[0], ctx.optimizer.sgd()  # a kernel optimizer (check_optimizer)
        total = sum_on(accs, home)
        ctx.kernels.local_update(
            s0.w[:1], s0.v[:1], (total / ctx.num_learners).unsqueeze(0), None, lr=opt.lr,
            momentum=opt.momentum, nesterov=opt.nesterov, weight_decay=opt.weight_decay,
            alpha=0.0, first_step=s0.first_step[0])
        w0, v0 = s0.w[0].clone(), s0.v[0].clone()  # [P]
        mean_buf = mean_buffers(bufs, home)
        for s in states:
            s.w.copy_(w0.to(s.torch_device).expand_as(s.w))
            s.v.copy_(v0.to(s.torch_device).expand_as(s.v))
            s.first_step[:] = [False] * s.m
            s.z_prev.copy_(s.z)
            s.z.copy_(w0.to(s.torch_device))
            if mean_buf is not None:
                s.zbuf.copy_(mean_buf.to(s.torch_device))

    def summary_rule(self, num_learners: int, sync_state: SyncState | None = None) -> str:
        return f"SSGD(one SGD step on the mean gradient of the {num_learners} learners, every round)"
