"""S-SGD, synchronous SGD, the large-batch baseline (docs/design-overview.md §2, "other sync
strategies"): the k learners' gradients averaged every round, one SGD step for every replica."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from ...errors import check_flag
from .base import SyncAlgorithm, SyncContext, SyncRound, SyncState

if TYPE_CHECKING:
    from ..state.flat import DeviceState
    from ..state.optim import LocalOptimizer

__all__ = ["SSGD"]


@dataclass(frozen=True, kw_only=True)
class SSGD(SyncAlgorithm):
    """Synchronous SGD, the large-batch baseline (docs/design-overview.md §2, "other sync strategies").

    Every round the k learners' gradients are averaged (S-SGD's all-reduce) and the same step of
    the ``optimizer`` is applied to every replica: replicas and z stay identical (z = w), as
    ``torch.optim.SGD`` on one batch of k·b samples (BatchNorm statistics stay per replica).

    τ = 1, no α or μ_z. It runs on the inline executor (the process executor's workers step
    before a global gradient exists); its local optimizer is SGD (the SGD kernels:
    ``crossbow_graph.SGD`` or a one-group torch.optim.SGD).

    Attributes:
        scale_lr: True: SMA's η rule, lr × √min(k, 16) ramped over a quarter epoch after every
            change of k (off by default). It is recorded in ``History.lr_rule``
            (training/sma_lr.py; docs/design-overview.md §2, "How α, μ_z and η follow k") and
            carries the lr tuned at k = 1 to k learners (docs/benchmarking.md, ResNet-20 on
            Fashion-MNIST). False: every round steps at the optimizer's lr, as plain PyTorch at
            one batch of k·b.

    Raises:
        TypeError: ``scale_lr`` not a bool."""

    adjustable: ClassVar[tuple[str, ...]] = ()
    fault_tolerant: ClassVar[bool] = False  # its global step is not a sum over groups
    across_processes: ClassVar[bool] = False  # its gradient sum stays in one process
    sync_every: ClassVar[int] = 1

    scale_lr: bool = False

    def __post_init__(self) -> None:
        check_flag("scale_lr", self.scale_lr, "SSGD")

    @property
    def scales_lr(self) -> bool:
        """``scale_lr``: SMA's η rule (training/sma_lr.py)."""
        return self.scale_lr

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

    def local_update(self, ctx: SyncContext, env: SyncRound, state: DeviceState, r0: int, r1: int,
                     *, losses: list[torch.Tensor] | None = None,
                     out: torch.Tensor | None = None) -> tuple[torch.Tensor, list[int]]:
        """The rows' gradient sum ``[P]``, in the masters' dtype; the step is global; no row is
        reset."""
        return state.g[r0:r1].sum(dim=0, dtype=state.w.dtype), []

    def global_update(self, ctx: SyncContext, env: SyncRound, accs: list[torch.Tensor],
                      bufs: list[torch.Tensor]) -> None:
        """ḡ = Σ_d acc_d / k (summed through ``ctx.transport``), one SGD step of replica 0 of
        device 0 with ḡ and the round's η, μ, λ (``env.hyper``), then every replica (w, v) and z
        on every device set to it; float buffers averaged."""
        states, h = ctx.states, env.hyper
        s0, summed = states[0], ctx.transport.sum(accs, bufs, env)
        ctx.kernels.local_update(
            s0.w[:1], s0.v[:1], (summed.total / env.k).unsqueeze(0), None, lr=h.lr,
            momentum=h.momentum, nesterov=h.nesterov, weight_decay=h.weight_decay, alpha=0.0,
            first_step=s0.first_step[0])
        w0, v0 = s0.w[0].clone(), s0.v[0].clone()  # [P]
        for s in states:
            s.w.copy_(w0.to(s.torch_device).expand_as(s.w))
            s.v.copy_(v0.to(s.torch_device).expand_as(s.v))
            s.first_step[:] = [False] * s.m
            s.z_prev.copy_(s.z)
            s.z.copy_(w0.to(s.torch_device))
            if summed.mean_buf is not None:
                s.zbuf.copy_(summed.mean_buf.to(s.torch_device))

    def summary_rule(self, num_learners: int, sync_state: SyncState | None = None) -> str:
        return (f"SSGD(one SGD step on the mean gradient of the {num_learners} learners, every "
                f"round{self._lr_rule_text(num_learners)})")
