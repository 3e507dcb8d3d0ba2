"""SMA, synchronous model averaging (CROSSBOW, Koliousis et al. 2019, §3; docs/design-overview.md
§2): every τ rounds each replica is pulled toward the central average model z by α, and z moves
by the sum of the corrections (or its share γ) with momentum μ_z."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, ClassVar

import torch

from ...errors import check_flag, check_number, is_count
from ..state.optim import SHARED_SECOND_MOMENT
from .base import SyncAlgorithm, SyncContext, SyncRound, SyncState, single_learner_central

if TYPE_CHECKING:
    from ..state.optim import LocalOptimizer
    from ...kernels.protocol import SMAKernels

__all__ = ["SMA", "CentralMomentum", "pull_bound", "centre_bound", "PULL_SHARE", "PULL_FLOOR"]

PULL_SHARE = 0.8  # SMA's default α and β: this share of their stability bounds (design §2)
PULL_FLOOR = 0.5  # the default α's least value: above it z takes a share of C (design §2)


def pull_bound(num_learners: int, central_momentum: float) -> float:
    """2(1 + μ_z)/(1 + k + μ_z): at or above it SMA's pull alone makes the replicas' distance to z
    grow (docs/design-overview.md §2, "The pull's stability bound"); 0.212 at k = 16, μ_z = 0.9."""
    return 2 * (1 + central_momentum) / (1 + num_learners + central_momentum)


def centre_bound(alpha: float, central_momentum: float) -> float:
    """(1 + μ_z)(2 − α): the bound on z's rate β at any k (design §2); 2.85 at α = 0.5."""
    return (1 + central_momentum) * (2 - alpha)


@dataclass(frozen=True, kw_only=True)
class SMA(SyncAlgorithm):
    """Synchronous model averaging (CROSSBOW, Koliousis et al. 2019, §3; docs/design-overview.md §2).

    Local update w_j ← step(w_j) − c_j, c_j = α·(ŵ_j − z); global z ← z + γ·Σ_j c_j +
    μ_z·(z − z_prev), γ = β/(k·α): z moves toward the replicas' mean at the rate β (CROSSBOW's
    update is β = k·α, γ = 1).

    Attributes:
        alpha: α, the pull of every replica toward z, in (0, 1]; ``None``: 0.8 of the pull's
            bound 2(1 + μ_z)/(1 + k + μ_z), at least 0.5 (0.52 at k = 4, 0.5 from k = 5).
        centre_rate: β, z's rate toward the replicas' mean, > 0; ``None``: k·α (CROSSBOW), and
            with ``alpha=None`` at most 0.8 of its bound (1 + μ_z)(2 − α) (2.28 from k = 5).
        central_momentum: μ_z, the momentum of the central model's update, in [0, 1).
        sync_every: τ, rounds between synchronisations (≥ 1); between them learners only step.
        scale_lr: SMA's η rule, every learner at its lr × √min(k, 16) ramped over a quarter
            epoch after every change of k (on by default, the optimizer's lr unwritten).
            ``False``: the lr as set. The rule: training/sma_lr.py, docs/design-overview.md §2,
            "How α, μ_z and η follow k".
        share_second_moment: with ``torch.optim.Adam`` or ``AdamW`` as the local optimiser, a
            device's learners step with one second moment, the moving average of the square of
            their mean gradient (at least their mean square over n²), each with its own first
            moment (design §2, "One second moment per device": each replica steps further, and
            at an lr its own v takes they can scatter); the inline executor only.

    Raises:
        TypeError: α, β or μ_z not a number; ``scale_lr`` or ``share_second_moment`` not a bool.
        ValueError: a value outside its range, τ not an integer (α is checked against k by
            ``compile``, and so is ``share_second_moment`` against the optimizer and executor)."""

    waits_for_global: ClassVar[bool] = False
    cuda_graphs: ClassVar[bool] = True
    adjustable: ClassVar[tuple[str, ...]] = ("alpha", "sync_every")

    alpha: float | None = None
    central_momentum: float = 0.9
    sync_every: int = 1
    scale_lr: bool = True
    centre_rate: float | None = None
    share_second_moment: bool = False

    def __post_init__(self) -> None:
        if self.alpha is not None:
            check_number("SMA", "alpha", self.alpha,
                         "alpha=0.25, or alpha=None for the default rule")
        check_number("SMA", "central_momentum", self.central_momentum, "central_momentum=0.9")
        if self.centre_rate is not None:
            check_number("SMA", "centre_rate", self.centre_rate,
                         "centre_rate=2.0, or centre_rate=None for k·α")
            if not 0 < self.centre_rate < math.inf:  # NaN fails too
                raise ValueError(f"SMA(centre_rate={self.centre_rate}): β must be a finite number "
                                 "> 0, e.g. 2.0, or None for k·α")
        if self.alpha is not None and not 0 < self.alpha <= 1:
            raise ValueError(
                f"SMA(alpha={self.alpha}): α must be in (0, 1]; use alpha=None for the default "
                "rule (0.8 of the pull's stability bound, at least 0.5)"
            )
        if not 0 <= self.central_momentum < 1:
            raise ValueError(
                f"SMA(central_momentum={self.central_momentum}): μ_z must be in [0, 1), e.g. 0.9"
            )
        check_flag("scale_lr", self.scale_lr, "SMA")
        check_flag("share_second_moment", self.share_second_moment, "SMA")
        if not is_count(self.sync_every):
            raise ValueError(f"SMA(sync_every={self.sync_every!r}): must be an integer ≥ 1")

    def alpha_for(self, num_learners: int) -> float:
        """α for k = ``num_learners``: as set, or ``PULL_SHARE`` × ``pull_bound`` but at least
        ``PULL_FLOOR``; 0 when k = 1."""
        if num_learners == 1:
            return 0.0
        if self.alpha is None:
            return max(PULL_SHARE * pull_bound(num_learners, self.central_momentum), PULL_FLOOR)
        return self.alpha

    def centre_rate_for(self, num_learners: int) -> float:
        """β at k learners: as set, else k·α (at most ``PULL_SHARE``·``centre_bound`` with the
        default α); 0 at k = 1."""
        if num_learners == 1:
            return 0.0
        if self.centre_rate is not None:
            return self.centre_rate
        alpha = self.alpha_for(num_learners)
        if self.alpha is not None:
            return num_learners * alpha
        return min(num_learners * alpha, PULL_SHARE * centre_bound(alpha, self.central_momentum))

    def centre_gain(self, num_learners: int) -> float:
        """γ = β/(k·α), the share of C that moves z; 1 when k = 1."""
        if num_learners == 1:
            return 1.0
        return self.centre_rate_for(num_learners) / (num_learners * self.alpha_for(num_learners))

    def stability_warning(self, num_learners: int) -> str | None:
        """Where β ≥ ``centre_bound`` (a user's α or β; design §2, the pull's stability bound)."""
        alpha, beta = self.alpha_for(num_learners), self.centre_rate_for(num_learners)
        bound = centre_bound(alpha, self.central_momentum)
        if num_learners == 1 or beta < bound:
            return None
        fix = ("set SMA(centre_rate=...) below it" if self.centre_rate is not None else
               "keep β below it with SMA(centre_rate=...), or use SMA's default rule (alpha=None, "
               "Adjustment(alpha=\"auto\"))")
        return (f"SMA with k = {num_learners} learners, α = {alpha:g}: z's rate β = {beta:.3g} "
                f"is at or above its stability bound (1 + μ_z)(2 − α) = {bound:.3g}, where z's "
                f"update stops converging (above it, diverges); {fix} (docs/design-overview.md §2)")

    @property
    def scales_lr(self) -> bool:
        """``scale_lr``: SMA's η rule (training/sma_lr.py)."""
        return self.scale_lr

    @property
    def shares_second_moment(self) -> bool:
        return self.share_second_moment

    @property
    def executors(self) -> tuple[str, ...]:  # type: ignore[override]
        return ("inline",) if self.share_second_moment else ("inline", "process")

    def check_executor(self, executor: str) -> None:
        if executor == "process" and self.share_second_moment:
            raise ValueError("SMA(share_second_moment=True) runs on the inline executor only: "
                             "the process executor steps a device's learners in several "
                             "workers, which cannot share one second moment; use "
                             "executor='inline' (or 'auto', which picks it)")

    def check_optimizer(self, optimizer: "LocalOptimizer") -> None:
        if not self.share_second_moment:
            return
        opt = optimizer.optimizer
        if type(opt) not in SHARED_SECOND_MOMENT:
            raise ValueError(f"SMA(share_second_moment=True) needs torch.optim.Adam or AdamW "
                             f"(exactly, not a subclass) as the local optimiser: their second "
                             f"moment is what is shared; got {type(opt).__name__} (compile's "
                             f"default is SGD): pass optimizer=torch.optim.AdamW("
                             f"model.parameters(), lr=...) to compile, or share_second_moment=False")
        for i, group in enumerate(opt.param_groups):
            for flag in ("amsgrad", "maximize"):
                if group.get(flag):
                    raise ValueError(f"SMA(share_second_moment=True): param group {i} sets "
                                     f"{flag}=True, which the shared step does not run; use "
                                     f"{flag}=False, or share_second_moment=False")

    def with_alpha(self, alpha: float | None) -> "SMA":
        """This SMA with α = ``alpha`` (None: the default rule); ValueError outside (0, 1]."""
        return replace(self, alpha=alpha)

    def kernel_facts(self, num_learners: int) -> dict[str, float | int]:
        """The correction when k > 1 (with and without it when τ > 1), the central update."""
        return {"num_learners": num_learners, "sync_every": self.sync_every,
                "central_momentum": self.central_momentum}

    def global_update(self, ctx: SyncContext, env: SyncRound, accs: list[torch.Tensor],
                      bufs: list[torch.Tensor]) -> None:
        """C = Σ_d acc_d over every learner (each acc_d the device's Σ_j c_j; summed through
        ``ctx.transport``), then z ← z + γ·C + μ_z(z − z_prev) on every device; zbuf ← the mean
        of the replicas' float buffers. With one learner z ← w_0 (and zbuf its buffers).

        Each c_j holds the factor α = ``alpha_for(k)``, and the step γ = ``centre_gain(k)``; a sum
        over another k of learners (torchft's live groups) is weighted by α·γ for that k
        (``Transport.sum``'s ``per_learner``) and the step takes it as it is."""
        states = ctx.states
        if env.k == 1:
            single_learner_central(states, bufs)
            return
        if ctx.transport.weighs_live:  # the sum holds γ of the live k (every group alike)
            step = CentralMomentum(ctx.kernels, env.hyper.central())
            per_learner = lambda k: self.alpha_for(k) * self.centre_gain(k)  # noqa: E731
        else:
            step = CentralMomentum(ctx.kernels, env.hyper.central(), env.hyper.gain())
            per_learner = self.alpha_for
        mean_buf = ctx.transport.central_update(states, accs, bufs, env, step,
                                                per_learner=per_learner)
        if mean_buf is not None:
            for s in states:
                s.zbuf.copy_(mean_buf)

    def summary_rule(self, num_learners: int, sync_state: SyncState | None = None) -> str:
        alpha = self.alpha_for(num_learners)
        shown = "— (one learner: nothing to average)" if not alpha and num_learners == 1 \
            else f"{alpha:.4g}"
        beta = "" if num_learners == 1 or self.centre_gain(num_learners) == 1 \
            else f", β={self.centre_rate_for(num_learners):.4g}"
        shared = ", one second moment per device" if self.share_second_moment else ""
        return (f"SMA(α={shown}{beta}, μ_z={self.central_momentum}, every {self.sync_every} round(s)"
                f"{self._lr_rule_text(num_learners)}{shared})")


@dataclass(frozen=True, eq=False)
class CentralMomentum:
    """SMA's central update z ← z + γ·C + μ_z·(z − z_prev), z_prev ← z (``kernels``'; μ_z, γ
    numbers or, in a CUDA graph, device tensors), as a transport's ``CentralStep``."""

    kernels: SMAKernels
    mu_z: float | torch.Tensor
    gain: float | torch.Tensor = 1.0

    @property
    def _scales(self) -> bool:  # γ ≠ 1: a device tensor, or a number other than 1
        return not (isinstance(self.gain, float) and self.gain == 1.0)

    def apply(self, z: torch.Tensor, z_prev: torch.Tensor, total: torch.Tensor) -> None:
        if self._scales:
            total = total * self.gain
        self.kernels.central_update(z, z_prev, total, central_momentum=self.mu_z)

    def apply_shared(self, zs: list[torch.Tensor], z_prevs: list[torch.Tensor],
                     parts: list[torch.Tensor]) -> bool:
        if self._scales:
            return False  # the parts' sum, then ``apply``
        return self.kernels.central_update_shared(zs, z_prevs, parts, central_momentum=self.mu_z)
