"""Hooks into the training loop: what logging, checkpoints, the auto-tuner and policies plug into.

A Hook's methods run at round, epoch and fit boundaries (docs/design-overview.md §5, Policies): every change
they make to the plan takes effect at a round boundary, identically on every device.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..api import Plan
    from .history import EpochRecord, EvalRecord, History

__all__ = ["Hook", "FitContext"]


@dataclass(kw_only=True)
class FitContext:
    """What a hook sees of a running fit.

    Attributes:
        plan: the Plan being trained.
        history: the History being filled.
        epoch: 0-based index of the current epoch (over the plan's life).
        round_in_epoch: rounds completed in the current epoch.
        rounds_per_epoch: rounds in a full epoch.
        end_epoch: the epoch the fit ends before: it runs epochs ``epoch`` … ``end_epoch − 1``.
        round_loss: mean training loss of the last round's learners, NaN/Inf (faulty) ones
            left out (a 0-dim tensor, lazily synchronised), None before the first round.
        train_seconds: training wall seconds so far (evaluation excluded).
        stop: set True to end the fit after the current round.
        extra: free-form per-fit data hooks share.
        batch_indices: the last round's sample indices ``[k·b]`` (learner j's at
            ``[j·b, (j+1)·b)``), None before the first round.
        round_samples: samples of the last round (k·b at that round).
        epoch_complete: in ``after_epoch``, whether the epoch used its order up (fewer than one
            round of k·b samples left, whatever k and b were on the way); False when a target
            or ``stop`` cut it short.

    In ``after_round`` every task of the round has run (w, v, z, zbuf are final). A hook may
    change the plan between rounds (``plan.adjust(Adjustment(...))``, ``plan.set_replicas``,
    ``plan.set_learner_mode``; the run settings in force are ``plan.settings``). On CUDA, call
    ``ctx.plan.scheduler.flush()`` before reading buffers on the host (the Plan's own methods do).
    """

    plan: "Plan"
    history: "History"
    epoch: int = 0
    round_in_epoch: int = 0
    rounds_per_epoch: int = 0
    end_epoch: int = 0
    round_loss: Any = None
    train_seconds: float = 0.0
    stop: bool = False
    extra: dict[str, Any] = field(default_factory=dict)
    batch_indices: Any = None
    round_samples: int = 0
    epoch_complete: bool = False


class Hook:
    """Base class: override any of the methods; each is called with the FitContext.

    Attributes:
        mutates_replicas: True (the default) if the hook may write the replicas' state (w, v, g,
            buf, z) directly. When every hook of a fit sets it False, worker processes learn round
            t+1 while the hooks of round t run (changing the plan through its methods, such as
            ``adjust``, ``set_replicas`` or ``set_learner_mode``, stays safe: a speculative
            round whose replicas changed is cancelled and rolled back).
    """

    mutates_replicas: bool = True

    def before_fit(self, ctx: FitContext) -> None:
        """Once, before the first round of a fit."""

    def before_epoch(self, ctx: FitContext) -> None:
        """Before an epoch's first round."""

    def before_round(self, ctx: FitContext) -> None:
        """Before each round (a change made here applies to this round)."""

    def after_round(self, ctx: FitContext) -> None:
        """After each round, once every task of the round has run."""

    def after_eval(self, ctx: FitContext, record: "EvalRecord") -> None:
        """After each evaluation of z."""

    def after_epoch(self, ctx: FitContext, record: "EpochRecord") -> None:
        """After each epoch (also an epoch cut short by a target or ``ctx.stop``)."""

    def after_fit(self, ctx: FitContext) -> None:
        """Once, when the fit ends (normally or at the target)."""
