"""Hooks into the training loop: what logging, checkpoints, the auto-tuner and policies plug into.

A Hook's methods run at round, epoch and fit boundaries (docs/design-overview.md §5, Policies): every change
they make to the plan takes effect at a round boundary, identically on every device. ``FitHooks``
is a fit's hooks in calling order, and checks what they declare.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from ..errors import HookError

if TYPE_CHECKING:
    from ..api import Plan
    from .history import EpochRecord, EvalRecord, History

__all__ = ["Hook", "FitContext", "FitHooks"]


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
        num_samples: N, samples of the training data per epoch.
        metrics: the fit's MetricsMonitor (tuning/metrics.py; updated before the policies run),
            None with ``fit(metrics_every=None)``.
        round_loss: mean training loss of the last round's learners, NaN/Inf (faulty) ones
            left out (a 0-dim tensor, lazily synchronised), None before the first round.
        round_losses: the last round's losses per learner (0-dim tensors, device-major).
        train_seconds: training wall seconds so far (evaluation excluded).
        stop: set True to end the fit after the current round.
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
    """Base class: override any of the methods; each is called with the FitContext.

    What a hook declares (the defaults are those of a hook that declares nothing):

    * ``mutates_replicas`` (True): the hook may write the replicas' state (w, v, g, buf, z)
      other than through the plan's methods (``adjust``, ``set_replicas``, ``set_learner_mode``,
      ``scheduler.reset_replicas``, which cancel a round learned ahead first), or reads what
      learning moves (g, buf) after a round. When every hook of a fit declares False, worker
      processes learn round t+1 while the hooks of round t run (engine/workers.py); a hook that
      declares False and writes w, v or z while they do raises HookError (``FitHooks``).
    * ``wants_gradients(rounds_done)`` (False): whether the hook reads the learners' gradients g
      after the round that makes the plan's round count ``rounds_done``; that round then runs
      without learning the next one ahead.
    * ``state_dict()`` / ``load_state_dict(state)``: the hook's state in checkpoints. The
      default ``{}`` means no state: nothing is written, and ``load_state_dict`` is not called.
    * ``decides`` (True): under torchrun the hook may change a setting or stop the fit from
      what its rank sees, so rank 0's settings and stop are broadcast after every round; when
      no hook of any rank declares True they are every ``engine.comm.AGREE_EVERY_ROUNDS``
      rounds (and after evaluations and epochs). False: it decides the same on every rank (an
      LR schedule) or nothing.
    """

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
    """A fit's hooks in calling order, called together: each method calls that method of every
    hook, in order.

    While worker processes learn a round ahead (``Scheduler.learning_ahead``), a hook declaring
    ``mutates_replicas = False`` must leave w, v and z alone: their version counters
    (``Tensor._version``, moved by every in-place write in this process) are compared around
    each of its calls, and a change raises HookError naming the hook (writes through ``.data``
    or NumPy views are not seen).

    Args:
        hooks: the hooks, in calling order.
    """

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
    sched = ctx.plan.scheduler
    if hook.mutates_replicas or not sched.learning_ahead:
        method(ctx, *args)
        return
    before = _versions(ctx.plan)
    method(ctx, *args)
    if sched.learning_ahead and _versions(ctx.plan) != before:
        name = type(hook).__name__
        raise HookError(
            f"{name}.{method.__name__} wrote the replicas (w, v or z) after round "
            f"{ctx.plan.rounds_done - 1} while worker processes learned round "
            f"{ctx.plan.rounds_done} from them, but {name} declares mutates_replicas = False; "
            f"set mutates_replicas = True on {name} (the rounds then run one after the other), "
            "or change the replicas through plan.adjust(...) or plan.scheduler.reset_replicas"
            "(...), which cancel the round learned ahead (docs/runtime.md, Hooks)")


def _versions(plan: "Plan") -> list[int]:
    """The version counters of every device's ``w``, ``v`` and ``z``."""
    return [t._version for s in plan.states for t in (s.w, s.v, s.z)]
