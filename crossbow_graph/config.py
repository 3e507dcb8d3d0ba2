"""Typed configuration: the optimiser and the synchronisation strategy (docs/design-overview.md §2),
the learner modes, and ``Adjustment``, one change of the run-time settings (§5, Run settings)."""

from __future__ import annotations

import math
import numbers
import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Literal, get_args

import torch

from .errors import check_flag, is_count

__all__ = ["SGD", "SMA", "SSGD", "DiLoCo", "Adjustment", "LearnerMode", "LEARNER_MODES"]

LearnerMode = Literal["per_replica", "fused"]  # engine/fused.py: the same mathematics, two programs
LEARNER_MODES = get_args(LearnerMode)


def _check_number(owner: str, name: str, value: object, example: str) -> None:
    """TypeError unless ``value`` is a real number (not a bool, not a string)."""
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return
    hint = example
    if isinstance(value, str):
        try:
            hint = f"{name}={float(value)!r}"  # '0.1' → lr=0.1
        except ValueError:
            pass
    raise TypeError(f"{owner}({name}={value!r}): must be a number, got {type(value).__name__}; "
                    f"e.g. {hint}")


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
        ValueError: a value outside its range.
    """

    lr: float = 0.01
    momentum: float = 0.9
    nesterov: bool = False
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        for name, example in (("lr", "lr=0.01"), ("momentum", "momentum=0.9"),
                              ("weight_decay", "weight_decay=5e-4")):
            _check_number("SGD", name, getattr(self, name), example)
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
class SMA:
    """Synchronous model averaging (CROSSBOW, Koliousis et al. 2019, §3; docs/design-overview.md §2).

    Attributes:
        alpha: α, the pull of every replica toward the central average model z; ``None`` means
            1/k, re-derived whenever the number of learners k changes. With k > 1 it must lie in
            (0, 1]; with k = 1 it is not used (the single replica is the central model).
        central_momentum: μ_z, the momentum of the central model's update, in [0, 1).
        sync_every: τ, rounds between synchronisations (≥ 1); between them learners only step.

    Raises:
        TypeError: α or μ_z not a number.
        ValueError: a value outside its range, τ not an integer (α is checked against k by
            ``compile``).
    """

    alpha: float | None = None
    central_momentum: float = 0.9
    sync_every: int = 1

    def __post_init__(self) -> None:
        if self.alpha is not None:
            _check_number("SMA", "alpha", self.alpha, "alpha=0.25, or alpha=None for 1/k")
        _check_number("SMA", "central_momentum", self.central_momentum, "central_momentum=0.9")
        if self.alpha is not None and not 0 < self.alpha <= 1:
            raise ValueError(
                f"SMA(alpha={self.alpha}): α must be in (0, 1]; use alpha=None for 1/k"
            )
        if not 0 <= self.central_momentum < 1:
            raise ValueError(
                f"SMA(central_momentum={self.central_momentum}): μ_z must be in [0, 1), e.g. 0.9"
            )
        if not is_count(self.sync_every):
            raise ValueError(f"SMA(sync_every={self.sync_every!r}): must be an integer ≥ 1")

    def alpha_for(self, num_learners: int) -> float:
        """α for k = ``num_learners`` learners: the configured value, or 1/k; 0 when k = 1."""
        if num_learners == 1:
            return 0.0
        return 1.0 / num_learners if self.alpha is None else self.alpha


@dataclass(frozen=True, kw_only=True)
class SSGD:
    """Synchronous SGD, the large-batch baseline (docs/design-overview.md §2, "other sync strategies").

    Every round each of the k learners computes the gradient of its own batch of b samples; the
    gradients are averaged over all k learners (the all-reduce of S-SGD) and the same SGD step
    (the ``optimizer``'s lr, momentum, Nesterov, weight decay) is applied to every replica, so all
    replicas and z stay identical (z = w) and training equals ``torch.optim.SGD`` on one batch of
    k·b samples (for models without batch-dependent layers; BatchNorm statistics stay per replica).

    It has no settings: it synchronises every round (``sync_every`` = 1) and has no α or μ_z.
    It runs on the inline executor (``executor="auto"`` resolves to it); the process executor's
    workers apply their rows' step themselves, before a global gradient exists.
    """

    sync_every: ClassVar[int] = 1
    central_momentum: ClassVar[float] = 0.0

    def alpha_for(self, num_learners: int) -> float:
        """SSGD pulls nothing toward z: 0 for any k (the replicas are z)."""
        return 0.0


#: DiLoCo's outer optimizer (Douillard et al. 2023, §2): Nesterov SGD, lr 0.7, momentum 0.9.
DILOCO_OUTER = functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)


@dataclass(frozen=True, kw_only=True)
class DiLoCo:
    """DiLoCo: local training with an outer optimizer over z every H rounds (Douillard et al.
    2023, "DiLoCo: Distributed Low-Communication Training of Language Models", Algorithm 1;
    docs/design-overview.md §2, "Outer optimizers").

    Between synchronisations every replica takes its own optimizer's steps (the ``optimizer`` of
    ``compile``, e.g. AdamW) with no pull toward z (α = 0). Every H-th round, after the learners'
    steps, the pseudo-gradient Δ = z − (1/k)·Σ_j w_j (over all k learners, every process) is the
    gradient of the outer optimizer over z: ``z.grad = Δ; outer.step()``; then every replica
    restarts from z (w_j ← z) and keeps its optimizer state. Float buffers (BatchNorm) are
    averaged into the central buffers as under SMA and stay per replica.

    Attributes:
        sync_every: H, rounds between outer steps (an integer ≥ 1).
        outer_optimizer: a callable that builds a ``torch.optim.Optimizer`` from a list of
            parameters; it is called once, by ``compile``, with ``[z]`` (a leaf tensor ``[P]``
            sharing the first device's central model). Default: Nesterov SGD, lr 0.7, momentum
            0.9 (``DILOCO_OUTER``); ``functools.partial(torch.optim.SGD, lr=1.0)`` is local SGD
            (periodic model averaging).

    Raises:
        ValueError: ``sync_every`` not an integer ≥ 1.
        TypeError: ``outer_optimizer`` not callable, or an optimizer instance instead of a
            factory (``compile`` raises TypeError/ValueError when calling it fails or does not
            return a torch.optim optimizer over ``[z]``).
    """

    sync_every: int
    outer_optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer] = DILOCO_OUTER
    central_momentum: ClassVar[float] = 0.0  # SMA's μ_z has no role: the outer optimizer moves z

    def __post_init__(self) -> None:
        if not is_count(self.sync_every):
            raise ValueError(f"DiLoCo(sync_every={self.sync_every!r}): H, rounds between outer "
                             "steps, must be an integer ≥ 1, e.g. sync_every=16")
        factory = self.outer_optimizer
        if isinstance(factory, torch.optim.Optimizer):
            raise TypeError(f"DiLoCo(outer_optimizer={type(factory).__name__}(...)): pass a "
                            "factory that builds the optimizer from z's parameters, not an "
                            "optimizer, e.g. functools.partial(torch.optim.SGD, lr=0.7, "
                            "momentum=0.9, nesterov=True)")
        if not callable(factory):
            raise TypeError(f"DiLoCo(outer_optimizer={factory!r}): must be callable as "
                            "outer_optimizer(params) -> torch.optim.Optimizer, e.g. "
                            "functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)")

    def alpha_for(self, num_learners: int) -> float:
        """DiLoCo pulls nothing toward z between its outer steps: 0 for any k."""
        return 0.0


@dataclass(frozen=True, kw_only=True)
class Adjustment:
    """One decision: the settings to change from the next round on (None: unchanged).

    Attributes:
        lr: learning rate η (> 0).
        batch_size: b, samples per learner per round (≥ 1); the task graph is re-planned and the
            memory bound re-checked.
        alpha: SMA α in (0, 1] (the pull toward z); ``"auto"`` restores 1/k.
        sync_every: τ, rounds between synchronisations (≥ 1).
        replicas_per_device: m (≥ 1; new replicas are cloned from z, ``Plan.set_replicas``).
        learner_mode: ``"per_replica"`` or ``"fused"`` (``LEARNER_MODES``).
        reset_replicas: put every replica at z with zero momentum (float buffers from zbuf).

    Raises:
        ValueError: a value outside its range, an unknown learner mode.
    """

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
            raise ValueError(f"Adjustment(alpha={self.alpha}): α must be in (0, 1], or 'auto' for 1/k")
        if self.learner_mode is not None and self.learner_mode not in LEARNER_MODES:
            raise ValueError(f"Adjustment(learner_mode={self.learner_mode!r}): use one of {LEARNER_MODES}")

    def changes(self) -> dict[str, Any]:
        """The fields that are set, as a dict."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v not in (None, False)}
