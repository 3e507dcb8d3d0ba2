"""SMA, synchronous model averaging (CROSSBOW, Koliousis et al. 2019, §3; docs/design-overview.md
§2): every τ rounds each replica is pulled toward the central average model z by α, and z moves
by the sum of the corrections with momentum μ_z."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, ClassVar

import torch

from ...errors import check_number, is_count
from ._reduce import global_sum, mean_buffers, sum_on
from .base import SyncAlgorithm, SyncContext, SyncState

if TYPE_CHECKING:
    from ..state import DeviceState

__all__ = ["SMA"]


@dataclass(frozen=True, kw_only=True)
class SMA(SyncAlgorithm):
    """Synchronous model averaging (CROSSBOW, Koliousis et al. 2019, §3; docs/design-overview.md §2).

    Local update w_j ← step(w_j) − c_j, c_j = α·(ŵ_j − z); global z ← z + Σ_j c_j + μ_z·(z − z_prev).

    Attributes:
        alpha: α, the pull of every replica toward the central average model z; ``None`` means
            1/k, re-derived whenever the number of learners k changes. With k > 1 it must lie in
            (0, 1]; with k = 1 it is not used (the single replica is the central model).
        central_momentum: μ_z, the momentum of the central model's update, in [0, 1).
        sync_every: τ, rounds between synchronisations (≥ 1); between them learners only step.
        scale_lr: SMA's η rule (docs/design-overview.md §2, "How α, μ_z and η follow k"): each
            round steps every learner at the lr its optimizer and scheduler set × √min(k, 16),
            the factor moved linearly over a quarter epoch of samples after every change of k
            (at the first fit, and when ``Plan.adjust``, the auto-tuner or a policy changes m);
            the optimizer's lr is not written. ``False``: the lr as set, at every k.

    Raises:
        TypeError: α or μ_z not a number; ``scale_lr`` not a bool.
        ValueError: a value outside its range, τ not an integer (α is checked against k by
            ``compile``).
    """

    executors: ClassVar[tuple[str, ...]] = ("inline", "process")
    waits_for_global: ClassVar[bool] = False
    cuda_graphs: ClassVar[bool] = True
    adjustable: ClassVar[tuple[str, ...]] = ("alpha", "sync_every")

    alpha: float | None = None
    central_momentum: float = 0.9
    sync_every: int = 1
    scale_lr: bool = True

    def __post_init__(self) -> None:
        if self.alpha is not None:
            check_number("SMA", "alpha", self.alpha, "alpha=0.25, or alpha=None for 1/k")
        check_number("SMA", "central_momentum", self.central_momentum, "central_momentum=0.9")
        if self.alpha is not None and not 0 < self.alpha <= 1:
            raise ValueError(
                f"SMA(alpha={self.alpha}): α must be in (0, 1]; use alpha=None for 1/k"
            )
        if not 0 <= self.central_momentum < 1:
            raise ValueError(
                f"SMA(central_momentum={self.central_momentum}): μ_z must be in [0, 1), e.g. 0.9"
            )
        if not isinstance(self.scale_lr, bool):
            raise TypeError(f"SMA(scale_lr={self.scale_lr!r}): must be True (η × √min(k, 16)) "
                            f"or False (the optimizer's lr at every k)")
        if not is_count(self.sync_every):
            raise ValueError(f"SMA(sync_every={self.sync_every!r}): must be an integer ≥ 1")

    def alpha_for(self, num_learners: int) -> float:
        """α for k = ``num_learners`` learners: the configured value, or 1/k; 0 when k = 1."""
        if num_learners == 1:
            return 0.0
        return 1.0 / num_learners if self.alpha is None else self.alpha

    @property
    def scales_lr(self) -> bool:
        """``scale_lr``: SMA's η rule (training/sma_lr.py)."""
        return self.scale_lr

    def with_alpha(self, alpha: float | None) -> "SMA":
        """This SMA with α = ``alpha`` (None: 1/k); ValueError outside (0, 1]."""
        return replace(self, alpha=alpha)

    def kernel_facts(self, num_learners: int) -> dict[str, float | int]:
        """The correction when k > 1 (with and without it when τ > 1), the central update."""
        return {"num_learners": num_learners, "sync_every": self.sync_every,
                "central_momentum": self.central_momentum}

    def global_update(self, ctx: SyncContext, sync_state: SyncState, accs: list[torch.Tensor],
                      bufs: list[torch.Tensor]) -> None:
        """C = Σ_d acc_d (each the device's Σ_j c_j; under torchrun all-reduced over the ranks),
        then z ← z + C + μ_z(z − z_prev) on every device; zbuf ← the mean of the replicas' float
        buffers. With one learner z ← w_0 (and zbuf its buffers).

        With CPU devices and no torchrun, the kernel backend's ``central_update_shared`` (the C
        kernels'; the others decline) does the sum, the update and the devices' copies of z in
        one pass."""
        states = ctx.states
        if ctx.num_learners == 1:  # the single replica is the central model
            s = states[0]
            s.z_prev.copy_(s.z)
            s.z.copy_(s.w[0])
            s.zbuf.copy_(bufs[0][0])
            return
        mu_z = self.central_momentum
        hyper = ctx.graph_hyper(states[0])
        if hyper is not None:  # a graph round: μ_z from its device tensor (one device)
            mu_z = hyper.central(mu_z)
        mean_buf = _central_update(ctx, accs, bufs, mu_z, self.alpha_for)
        if mean_buf is None:
            mean_buf = mean_buffers(bufs, states[0].torch_device)
        if mean_buf is not None:
            for s in states:
                s.zbuf.copy_(mean_buf)

    def summary_rule(self, num_learners: int, sync_state: SyncState | None = None) -> str:
        alpha = self.alpha_for(num_learners)
        shown = "— (one learner: nothing to average)" if not alpha and num_learners == 1 \
            else f"{alpha:.4g}"
        return f"SMA(α={shown}, μ_z={self.central_momentum}, every {self.sync_every} round(s))"


def _central_update(ctx: SyncContext, accs: list[torch.Tensor], bufs: list[torch.Tensor],
                    mu_z: float | torch.Tensor, alpha_for) -> torch.Tensor | None:
    """z ← z + Σ_d acc_d + μ_z(z − z_prev) on every device; returns the mean buffers over all k
    replicas when the torchrun all-reduce carried them, else None.

    Under torchft (``ctx.ft``) each group sends Σ_j (ŵ_j − z), its corrections over the α it
    used, and the sum over the live groups' k learners is scaled by ``alpha_for(k)``: with α =
    1/k, z + Σ c_j is the mean of the live learners' ŵ_j (μ_z = 0), whichever group died or
    joined in the round."""
    states: list[DeviceState] = ctx.states
    on_cpu = all(s.torch_device.type == "cpu" for s in states)
    # CPU devices share one memory: Σ acc_d, the update and z's copies in one pass
    if on_cpu and ctx.comm is None and ctx.ft is None and ctx.kernels.central_update_shared(
            [s.z for s in states], [s.z_prev for s in states], accs, central_momentum=mu_z):
        return None
    home, mean_buf = states[0].torch_device, None
    if ctx.ft is not None:
        total, mean_buf, k = global_sum(ctx, accs, bufs, scale=1.0 / ctx.alpha)
        total.mul_(alpha_for(k))
    else:
        total = sum_on(accs, home)
    if ctx.comm is not None and ctx.ft is None:  # under torchft the group's ranks summed above
        total, mean_buf = ctx.all_reduce_sums(total, bufs, home)
    # CPU logical devices share one memory: update z once and copy it (same numbers)
    for s in states[:1] if on_cpu else states:
        ctx.kernels.central_update(s.z, s.z_prev, total.to(s.torch_device), central_momentum=mu_z)
    if on_cpu:
        for s in states[1:]:
            s.z.copy_(states[0].z)
            s.z_prev.copy_(states[0].z_prev)
    return mean_buf
