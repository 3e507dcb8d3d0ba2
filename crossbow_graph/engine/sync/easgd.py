"""EASGD, elastic averaging SGD (Zhang, Choromanska and LeCun 2015, "Deep learning with Elastic
Averaging SGD", synchronous EASGD, eqs. 5–6; docs/design-overview.md §2): each replica is pulled
toward the centre z by α, and z moves toward the replicas by its own centre rate β."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

import torch

from ...errors import check_number, is_count
from .base import SyncAlgorithm, SyncContext, SyncRound, SyncState, single_learner_central

__all__ = ["EASGD"]


@dataclass(frozen=True, kw_only=True)
class EASGD(SyncAlgorithm):
    """Elastic averaging SGD, synchronous (Zhang et al. 2015, eqs. 5–6).

    Every τ rounds, from the pre-step weights ŵ_j: w_j ← ŵ_j + Δ_j − α·(ŵ_j − z) (the elastic
    pull, SMA's correction) and z ← z + β·((1/k)·Σ_j ŵ_j − z), i.e. z + β/(k·α)·Σ_j c_j. With
    β = k·α it is SMA with μ_z = 0; the paper's default is β = 0.9, α = β/k. With k = 1 the
    single replica is the central model (as with SMA).

    Attributes:
        alpha: α, the moving rate of the replicas toward z, in (0, 1]; None: β/k.
        centre_rate: β, the moving rate of z toward the replicas' mean, in (0, 1].
        sync_every: τ, rounds between elastic updates (≥ 1); between them learners only step.

    Raises:
        TypeError: α or β not a number.
        ValueError: α or β outside (0, 1], τ not an integer ≥ 1."""

    executors: ClassVar[tuple[str, ...]] = ("inline", "process")
    waits_for_global: ClassVar[bool] = False  # its global update writes z alone
    adjustable: ClassVar[tuple[str, ...]] = ("alpha", "sync_every")

    alpha: float | None = None
    centre_rate: float = 0.9
    sync_every: int = 1

    def __post_init__(self) -> None:
        for name, value in (("alpha", self.alpha), ("centre_rate", self.centre_rate)):
            if value is None and name == "alpha":
                continue
            check_number("EASGD", name, value, f"{name}=0.5")
            if not 0 < value <= 1:
                raise ValueError(f"EASGD({name}={value}): a moving rate must be in (0, 1], e.g. "
                                 f"{name}=0.5" + (", or alpha=None for β/k" if name == "alpha" else ""))
        if not is_count(self.sync_every):
            raise ValueError(f"EASGD(sync_every={self.sync_every!r}): must be an integer ≥ 1")

    def alpha_for(self, num_learners: int) -> float:
        """α for k = ``num_learners``: the configured value, or β/k; 0 when k = 1."""
        if num_learners == 1:
            return 0.0
        return self.centre_rate / num_learners if self.alpha is None else self.alpha

    def centre_gain(self, num_learners: int) -> float:
        """γ = β/(k·α), the share of the corrections' sum that moves z; 1 when k = 1."""
        if num_learners == 1:
            return 1.0
        return self.centre_rate / (num_learners * self.alpha_for(num_learners))

    def with_alpha(self, alpha: float | None) -> "EASGD":
        """This EASGD with α = ``alpha`` (None: β/k); ValueError outside (0, 1]."""
        return replace(self, alpha=alpha)

    def kernel_facts(self, num_learners: int) -> dict[str, float | int]:
        """The correction when k > 1 (with and without it when τ > 1); z moves without momentum."""
        return {"num_learners": num_learners, "sync_every": self.sync_every,
                "central_momentum": 0.0}

    @torch.no_grad()
    def global_update(self, ctx: SyncContext, env: SyncRound, accs: list[torch.Tensor],
                      bufs: list[torch.Tensor]) -> None:
        """C = Σ_d acc_d over the k learners the sum holds (each c_j = α·(ŵ_j − z)), then
        z ← z + β/(k·α)·C on every device; zbuf ← the replicas' mean float buffers. With one
        learner z ← w_0 (and zbuf its buffers)."""
        states = ctx.states
        if env.k == 1:
            single_learner_central(states, bufs)
            return
        summed = ctx.transport.sum(accs, bufs, env, per_learner=self.alpha_for)
        ctx.transport.apply(states, _CentrePull(self.centre_gain(summed.k)), summed.total)
        if summed.mean_buf is not None:
            for s in states:
                s.zbuf.copy_(summed.mean_buf.to(s.torch_device))

    def summary_rule(self, num_learners: int, sync_state: SyncState | None = None) -> str:
        alpha = self.alpha_for(num_learners)
        shown = "— (one learner: nothing to average)" if num_learners == 1 else f"{alpha:.4g}"
        return (f"EASGD(α={shown}, β={self.centre_rate}, every {self.sync_every} round(s))")


@dataclass(frozen=True)
class _CentrePull:
    """z_prev ← z, z ← z + ``rate``·C: EASGD's centre update from the sum C, as a transport's
    ``CentralStep``."""

    rate: float

    def apply(self, z: torch.Tensor, z_prev: torch.Tensor, total: torch.Tensor) -> None:
        z_prev.copy_(z)
        z.add_(total, alpha=self.rate)

    def apply_shared(self, zs: list[torch.Tensor], z_prevs: list[torch.Tensor],
                     parts: list[torch.Tensor]) -> bool:
        return False
