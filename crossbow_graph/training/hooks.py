"""Hooks into the training loop at round, epoch and fit boundaries (docs/runtime.md, Overlap;
docs/design-overview.md §5, Policies); ``FitHooks``: a fit's hooks in calling order."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from ..errors import HookError

if TYPE_CHECKING:
    from .fit_plan import FitPlan
    from .history import EpochRecord, EvalRecord, History

__all__ = ["Hook", "FitContext", "FitHooks"]


@dataclass(kw_only=True)
class FitContext:
    """What a hook sees of a running fit (docs/design-overview.md §5, Policies).

    Attributes:
        plan: the Plan being trained (what a fit reads of it: training/fit_plan.py ``FitPlan``);
            history: the History being filled.
        epoch: 0-based index of the current epoch (over the plan's life).
        round_in_epoch: rounds completed in it; rounds_per_epoch: rounds in a full epoch.
        end_epoch: the epoch the fit ends before.
        num_samples: N, training samples per epoch.
        metrics: the fit's MetricsMonitor (tuning/metrics.py), or None.
        round_loss: 0-dim mean loss of the last round's finite learner losses, None before a round.
        round_losses: the last round's losses per learner (0-dim tensors, device-major).
        train_seconds: training wall seconds so far (evaluation excluded).
        stop: set True to end the fit after the current round.
        batch_indices: the last round's sample indices ``[k·b]`` (learner j's at ``[j·b, (j+1)·b)``).
        round_samples: samples of the last round (k·b).
        epoch_complete: in ``after_epoch``, whether the epoch used its order up."""

    plan: "FitPlan"
    history: "History"
    epoch: int = 0
    round_in_epoch: int = 0
    rounds_per_epoch: int = 0
    end_epoch: int = 0
    num_samples: int = 0
    metrics: Any = None
    round_loss: Any = None
    round_losses: list[Any] = field(default_factory=list)
    train_seconds: float = 0.0
    stop: bool = False
    batch_indices: Any = None
    round_samples: int = 0
    epoch_complete: bool = False


class Hook:
    """Base class: override any of the methods; each is called with the FitContext. A hook
    declares ``mutates_replicas`` (default True), ``wants_gradients(rounds_done)`` (default False),
    ``decides`` (default True) and its checkpointed ``state_dict()`` / ``load_state_dict(state)``
    (default ``{}``: none); what they mean: docs/runtime.md, Overlap."""

    mutates_replicas: bool = True
    decides: bool = True

    def wants_gradients(self, rounds_done: int) -> bool:
        """Whether this hook reads g after the round that makes ``rounds_done`` rounds."""
        return False

    def state_dict(self) -> dict[str, Any]:
        """The hook's state for a checkpoint; ``{}``: none."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict()``'s state (a resumed fit, before ``before_fit``)."""

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


class FitHooks:
    """A fit's hooks in calling order: each method calls that method of every hook.

    Raises:
        HookError: a hook declaring ``mutates_replicas = False`` wrote w, v or z while a round was
            learned ahead (docs/runtime.md, Overlap)."""

    def __init__(self, hooks: list[Hook]) -> None:
        self.hooks = hooks

    @property
    def overlap(self) -> bool:
        """Whether every hook declares ``mutates_replicas = False``: rounds may be learned ahead."""
        return not any(h.mutates_replicas for h in self.hooks)

    def wants_gradients(self, rounds_done: int) -> bool:
        """Whether some hook reads g after the round that makes ``rounds_done`` rounds."""
        return any(h.wants_gradients(rounds_done) for h in self.hooks)

    def decide(self) -> bool:
        """Whether some hook declares ``decides``."""
        return any(h.decides for h in self.hooks)

    def acts_before_rounds(self) -> bool:
        """Whether some hook overrides ``before_round``."""
        return any(type(h).before_round is not Hook.before_round for h in self.hooks)

    def before_fit(self, ctx: FitContext) -> None:
        for hook in self.hooks:
            hook.before_fit(ctx)

    def before_epoch(self, ctx: FitContext) -> None:
        for hook in self.hooks:
            hook.before_epoch(ctx)

    def before_round(self, ctx: FitContext) -> None:
        for hook in self.hooks:
            _checked(hook, hook.before_round, ctx)

    def after_round(self, ctx: FitContext) -> None:
        for hook in self.hooks:
            _checked(hook, hook.after_round, ctx)

    def after_eval(self, ctx: FitContext, record: "EvalRecord") -> None:
        for hook in self.hooks:
            _checked(hook, hook.after_eval, ctx, record)

    def after_epoch(self, ctx: FitContext, record: "EpochRecord") -> None:
        for hook in self.hooks:
            hook.after_epoch(ctx, record)

    def after_fit(self, ctx: FitContext) -> None:
        for hook in self.hooks:
            hook.after_fit(ctx)


def _checked(hook: Hook, method: Callable[..., None], ctx: FitContext, *args: Any) -> None:
    """``method(ctx, *args)`` of ``hook``; HookError if the hook declares
    ``mutates_replicas = False`` but wrote w, v or z while a round is learned ahead."""
    rounds = ctx.plan.rounds
    if hook.mutates_replicas or not rounds.learning_ahead:
        method(ctx, *args)
        return
    before = _versions(ctx.plan)
    method(ctx, *args)
    if rounds.learning_ahead and _versions(ctx.plan) != before:
        name = type(hook).__name__
        raise HookError(
            f"{name}.{method.__name__} wrote the replicas (w, v or z) after round "
            f"{ctx.plan.progress.rounds_done - 1} while worker processes learned round "
            f"{ctx.plan.progress.rounds_done} from them, but {name} declares mutates_replicas = "
            f"False; set mutates_replicas = True on {name} (the rounds then run one after the "
            "other), or change the replicas through plan.adjust(...) or "
            "plan.rounds.reset_replicas(...), which cancel the round learned ahead "
            "(docs/runtime.md, Hooks)")


def _versions(plan: "FitPlan") -> list[int]:
    """The version counters of every device's ``w``, ``v`` and ``z``."""
    return [t._version for s in plan.states for t in (s.w, s.v, s.z)]
