"""Typed configuration: the local optimiser (docs/design-overview.md §2), the learner modes, and
``Adjustment``, one change of the run-time settings (§5, Run settings). The synchronisation
algorithms (``SMA``, ``DiLoCo``, ...) are typed configuration too, with their work beside them:
engine/sync/."""

from __future__ import annotations

import math
import dataclasses
from dataclasses import dataclass
from typing import Any, Literal, get_args

from .errors import check_flag, check_number, is_count

__all__ = ["SGD", "Adjustment", "LearnerMode", "LEARNER_MODES"]

LearnerMode = Literal["per_replica", "fused"]  # engine/learning/fused.py: the same mathematics, two programs
LEARNER_MODES = get_args(LearnerMode)


@dataclass(frozen=True, kw_only=True)
class SGD:
    """Each learner's local optimiser, with torch.optim.SGD semantics (docs/design-overview.md §2, step 1).

    Attributes:
        lr: learning rate η (> 0), applied to the mean loss over the learner's batch of b samples.
        momentum: local momentum μ_l, in [0, 1).
        nesterov: Nesterov momentum (needs momentum > 0).
        weight_decay: L2 penalty λ (≥ 0), added to the gradient.

    Raises:
        TypeError: a value that is not a number (``nesterov``: not a bool).
        ValueError: a value outside its range."""

    lr: float = 0.01
    momentum: float = 0.9
    nesterov: bool = False
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        for name, example in (("lr", "lr=0.01"), ("momentum", "momentum=0.9"),
                              ("weight_decay", "weight_decay=5e-4")):
            check_number("SGD", name, getattr(self, name), example)
        check_flag("nesterov", self.nesterov, "SGD")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"SGD(lr={self.lr}): the learning rate must be > 0, e.g. lr=0.01")
        if not 0 <= self.momentum < 1:
            raise ValueError(f"SGD(momentum={self.momentum}): momentum must be in [0, 1), e.g. 0.9")
        if self.nesterov and self.momentum == 0:
            raise ValueError("SGD(nesterov=True) needs momentum > 0, as torch.optim.SGD does")
        if not self.weight_decay >= 0:
            raise ValueError(f"SGD(weight_decay={self.weight_decay}): weight decay must be ≥ 0")


@dataclass(frozen=True, kw_only=True)
class Adjustment:
    """One decision: the settings to change from the next round on (None: unchanged).

    Attributes:
        lr: learning rate η (> 0).
        batch_size: b, samples per learner per round (≥ 1); the task graph is re-planned and the
            memory bound re-checked.
        alpha: SMA α in (0, 1] (the pull toward z); ``"auto"`` restores the default rule.
        sync_every: τ, rounds between synchronisations (≥ 1).
        replicas_per_device: m (≥ 1; new replicas are cloned from z, ``Plan.set_replicas``).
        learner_mode: ``"per_replica"`` or ``"fused"`` (``LEARNER_MODES``).
        reset_replicas: put every replica at z with zero momentum (float buffers from zbuf).

    Raises:
        ValueError: a value outside its range, an unknown learner mode."""

    lr: float | None = None
    batch_size: int | None = None
    alpha: float | str | None = None
    sync_every: int | None = None
    replicas_per_device: int | None = None
    learner_mode: str | None = None
    reset_replicas: bool = False

    def __post_init__(self) -> None:
        if self.lr is not None and not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"Adjustment(lr={self.lr}): the learning rate must be finite and > 0")
        for name in ("batch_size", "sync_every", "replicas_per_device"):
            v = getattr(self, name)
            if v is not None and not is_count(v):
                raise ValueError(f"Adjustment({name}={v!r}): must be an integer ≥ 1")
        if self.alpha is not None and self.alpha != "auto" and not 0 < self.alpha <= 1:
            raise ValueError(f"Adjustment(alpha={self.alpha}): α must be in (0, 1], or 'auto' for "
                             "the default rule")
        if self.learner_mode is not None and self.learner_mode not in LEARNER_MODES:
            raise ValueError(f"Adjustment(learner_mode={self.learner_mode!r}): use one of {LEARNER_MODES}")

    def changes(self) -> dict[str, Any]:
        """The fields that are set, as a dict."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v not in (None, False)}
