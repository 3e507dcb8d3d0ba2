"""A torch.optim LR scheduler driving a fit, ``fit(lr_scheduler=...)`` (docs/optimizers.md, Schedules;
docs/reliability.md, Resuming with other settings; docs/design-overview.md §5, Run settings)."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any, Literal, get_args

import torch

from .hooks import FitContext, Hook

if TYPE_CHECKING:
    from ..api import Plan
    from ..engine.settings import RunSettings
    from .history import EpochRecord, EvalRecord

__all__ = ["LRSchedulerHook", "LRInterval", "LR_INTERVALS", "check_lr_scheduler", "rounds_left", "schedule_end"]

LRInterval = Literal["epoch", "round"]
LR_INTERVALS = get_args(LRInterval)


def check_lr_scheduler(plan: "Plan", scheduler: Any, interval: str,
                       rounds: int | None = None) -> None:
    """Check ``fit(lr_scheduler=..., lr_scheduler_interval=...)`` before any round; ``rounds``:
    the rounds the fit will run (None: unknown, e.g. the auto-tuner changes k).

    Raises:
        TypeError: not a torch.optim LR scheduler (or a scheduler class, not an instance).
        ValueError: built over another optimizer than the plan's, an unknown interval, or a
            OneCycleLR stepped per round with fewer steps left than the fit's rounds.
    """
    if interval not in LR_INTERVALS:
        raise ValueError(f"lr_scheduler_interval={interval!r}: use 'epoch' or 'round'")
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau
    if not isinstance(scheduler, (torch.optim.lr_scheduler.LRScheduler, plateau)):
        got = (f"the class {scheduler.__name__}: build one over plan.optimizer"
               if isinstance(scheduler, type) else type(scheduler).__name__)
        raise TypeError(f"lr_scheduler must be a torch.optim.lr_scheduler scheduler built over "
                        f"plan.optimizer, e.g. OneCycleLR(plan.optimizer, max_lr=0.1, "
                        f"total_steps=...), got {got}")
    if scheduler.optimizer is not plan.optimizer:
        raise ValueError(
            f"lr_scheduler is built over another optimizer ({type(scheduler.optimizer).__name__} "
            f"at {id(scheduler.optimizer):#x}) than the plan's; build it over the optimizer given "
            f"to compile, or over plan.optimizer (with crossbow_graph.SGD the plan builds its own)")
    one_cycle = isinstance(scheduler, torch.optim.lr_scheduler.OneCycleLR)
    if one_cycle and interval == "round" and rounds is not None:
        left = scheduler.total_steps - scheduler.last_epoch
        if rounds > left:
            raise ValueError(f"lr_scheduler OneCycleLR has {left} steps left (total_steps="
                             f"{scheduler.total_steps}) but the fit runs {rounds} rounds; build it "
                             f"with total_steps={rounds + scheduler.last_epoch} or fewer epochs")


def schedule_end(scheduler: Any) -> tuple[int, str, str | None] | None:
    """Where a scheduler's schedule ends: (its ``last_epoch`` there, the setting that says so,
    that setting's name or None), or None for a schedule without an end (docs/optimizers.md,
    Schedules)."""
    lr = torch.optim.lr_scheduler
    if isinstance(scheduler, lr.OneCycleLR):
        return scheduler.total_steps - 1, f"total_steps={scheduler.total_steps}", "total_steps"
    if isinstance(scheduler, lr.CosineAnnealingLR):
        return scheduler.T_max, f"T_max={scheduler.T_max}", "T_max"
    if isinstance(scheduler, (lr.LinearLR, lr.ConstantLR, lr.PolynomialLR)):
        return scheduler.total_iters, f"total_iters={scheduler.total_iters}", "total_iters"
    if isinstance(scheduler, lr.MultiStepLR) and scheduler.milestones:
        last = max(scheduler.milestones)
        return last, f"its last milestone at step {last}", None
    if isinstance(scheduler, lr.SequentialLR):
        milestones, schedulers = scheduler._milestones, scheduler._schedulers  # torch's own
        inner = schedule_end(schedulers[-1])
        if inner is not None:
            last = milestones[-1] if milestones else 0
            return (last + inner[0], f"its {type(schedulers[-1]).__name__} from step {last} "
                    f"with {inner[1]}", None)
    return None


def rounds_left(plan: "Plan", num_samples: int, end_epoch: int) -> int:
    """The rounds a fit still runs if k and b stay: ⌊(N − position)/(k·b)⌋ in the current epoch
    and ⌊N/(k·b)⌋ in each later one before ``end_epoch``."""
    if plan.epochs_done >= end_epoch:
        return 0
    per_round = plan.num_learners * plan.batch_size
    later = end_epoch - plan.epochs_done - 1
    return (num_samples - plan.position_in_epoch) // per_round + later * (num_samples // per_round)


class LRSchedulerHook(Hook):
    """Steps a torch.optim LR scheduler once per round or epoch of a fit through
    ``RunSettings.step_lr_schedule`` (docs/optimizers.md, Schedules).

    Args:
        scheduler: a ``torch.optim.lr_scheduler`` scheduler over ``Plan.optimizer``.
        interval: ``"epoch"`` or ``"round"`` (ReduceLROnPlateau steps after each evaluation).
        settings: the plan's RunSettings, where the scheduler is added until the fit ends; None
            for a subclass that adds its own at ``before_fit``.
    """

    mutates_replicas = False  # η only: the param groups, read by every learner's next update
    decides = False  # the same schedule on every rank

    def __init__(self, scheduler: Any, interval: str = "epoch", *,
                 settings: "RunSettings | None" = None) -> None:
        self.scheduler = scheduler
        self.interval = interval
        self.settings = settings
        self._evaluated = self._warned = self._held = False
        self._resumed = False  # load_state_dict ran: before_fit keeps the loaded ``_evaluated``
        self._shape = (0, 0)  # (k, b) of the rounds when last checked
        if settings is not None:
            settings.add_lr_schedule(scheduler)

    @property
    def plateau(self) -> bool:
        """Whether the scheduler is a ReduceLROnPlateau (stepped with a loss after evaluations)."""
        return isinstance(self.scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)

    def _lrs(self) -> list[float]:
        return [float(g["lr"]) for g in self.scheduler.optimizer.param_groups]

    def _step(self, *args: float) -> None:
        if not self._past_its_end():
            self.settings.step_lr_schedule(self.scheduler, *args)

    def _past_its_end(self) -> bool:
        """Whether a OneCycleLR has taken all its ``total_steps``; it then holds its
        last η, with a UserWarning once per fit."""
        sched = self.scheduler
        if not isinstance(sched, torch.optim.lr_scheduler.OneCycleLR) or \
                sched.last_epoch < sched.total_steps:
            return False
        if not self._held:
            self._held = True
            warnings.warn(f"lr_scheduler OneCycleLR has taken all its total_steps="
                          f"{sched.total_steps} steps; η stays at its last value "
                          f"{self._lrs()[0]:.3g} for the rest of the fit (the rounds outnumber "
                          "the steps it was built for: k·b fell mid-fit, or the epochs are more; "
                          "docs/optimizers.md, Schedules)", UserWarning, stacklevel=3)
        return True

    @property
    def factors(self) -> list[float]:
        """Per param group, the product F of the policies' η factors composed with the schedule."""
        return self.settings.lr_factors(self.scheduler)

    def before_fit(self, ctx: FitContext) -> None:
        if not self._resumed:  # a resumed fit's epoch ends as the checkpoint's run's would
            self._evaluated = False
        self._resumed = False
        self._shape = self._round_shape(ctx)
        self._warned = self._held = False
        self._warn_if_unfinished(ctx, start=True)

    def after_fit(self, ctx: FitContext) -> None:
        self.settings.drop_lr_schedule(self.scheduler)

    def after_round(self, ctx: FitContext) -> None:
        if self.interval == "round" and not self.plateau:
            self._step()
            shape = self._round_shape(ctx)
            if shape != self._shape:  # k or b changed (the auto-tuner, a policy)
                self._shape = shape
                self._warn_if_unfinished(ctx, start=False)

    @staticmethod
    def _round_shape(ctx: FitContext) -> tuple[int, int]:
        return ctx.plan.num_learners, ctx.plan.batch_size

    def _warn_if_unfinished(self, ctx: FitContext, start: bool) -> None:
        """A UserWarning (once per fit) when the schedule cannot reach its end in the steps the
        fit has left: its rounds at the current k·b, or its epochs (module docstring)."""
        end, plan, n = schedule_end(self.scheduler), ctx.plan, ctx.num_samples
        if end is None or self.plateau or self._warned or not n:
            return
        per_round = self.interval == "round"
        steps = rounds_left(plan, n, ctx.end_epoch) if per_round \
            else max(0, ctx.end_epoch - plan.epochs_done)
        last, (stop, setting, name) = self.scheduler.last_epoch, end
        if stop - last <= steps:
            return
        self._warned = True
        k, b = plan.num_learners, plan.batch_size
        what = (f"lr_scheduler {type(self.scheduler).__name__} reaches its end ({setting}) "
                f"{stop - last} steps from now, but ")
        if not per_round:
            fix = f"build it with {name}={last + steps}" if name else "shorten it"
            warnings.warn(what + f"this fit steps it {steps} more times (once per epoch); it "
                          f"stops at step {last + steps}; {fix} or train more epochs",
                          UserWarning, stacklevel=2)
            return
        rounds = (f"rounds of k·b = {k} × {b} = {k * b} samples ({n // (k * b)} an epoch of {n} "
                  "samples)")
        when = (f"this fit runs {steps} {rounds}" if start else
                f"k·b changed at round {plan.rounds_done}, and {steps} {rounds} are left")
        fix = f"size it in rounds ({name}={last + steps}), " if start and name else ""
        warnings.warn(what + f"{when}, one step each; it stops at step {last + steps}; {fix}"
                      "step it per epoch (lr_scheduler_interval='epoch') or make it a LambdaLR "
                      "of the samples trained, which spans the fit whatever k and b do "
                      "(docs/optimizers.md, Schedules)", UserWarning, stacklevel=2)

    def after_eval(self, ctx: FitContext, record: "EvalRecord") -> None:
        if self.plateau:
            self._evaluated = True
            self._step(float(record.test_loss))

    def after_epoch(self, ctx: FitContext, record: "EpochRecord") -> None:
        if self.plateau:
            if not self._evaluated and record.train_loss is not None:
                self._step(float(record.train_loss))
        elif self.interval == "epoch":
            self._step()

    def state_dict(self) -> dict[str, Any]:
        """The scheduler's state, its factors F and the groups' η in force ("written")."""
        return {"scheduler": self.scheduler.state_dict(), "evaluated": self._evaluated,
                "factors": self.factors, "written": self._lrs()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict()``; this scheduler's ``base_lrs`` where they differ from the
        saved ones (module docstring), with a UserWarning."""
        changed: dict[int, tuple[float, float]] = {}
        saved = _keep_new_bases(state["scheduler"], self.scheduler.state_dict(), changed)
        self.scheduler.load_state_dict(saved)
        self._evaluated, self._resumed = state["evaluated"], True
        if "factors" in state:
            self.settings.set_lr_factors(self.scheduler, state["factors"])
        written = list(state.get("written", self._lrs()))  # the checkpoint's η in force
        self.settings.load_group_settings([  # the checkpoint's η on this fit's base
            {"lr": written[i] * changed[i][1] / changed[i][0]} if changed.get(i, (0,))[0] else {}
            for i in range(len(written))])
        if changed:
            warnings.warn(
                f"resuming LR scheduler {type(self.scheduler).__name__} at its position "
                f"(last_epoch={self.scheduler.last_epoch}) with this fit's base learning rates: "
                f"it was built over other ones than the checkpoint's "
                f"({_bases(self.scheduler.state_dict())} now, {_bases(state['scheduler'])} in the "
                "checkpoint); η follows the schedule of this fit's from its next step",
                UserWarning, stacklevel=2)


def _keep_new_bases(saved: Any, fresh: Any, changed: dict[int, tuple[float, float]]) -> Any:
    """``saved`` with every ``base_lrs`` entry (nested too) from ``fresh``; ``changed`` gets
    ``group index: (old base, new base)`` where they differ."""
    if isinstance(saved, dict) and isinstance(fresh, dict):
        out = {}
        for key, value in saved.items():
            new = fresh.get(key)
            if key == "base_lrs" and isinstance(value, list) and isinstance(new, list) \
                    and len(new) == len(value):
                for i, (a, b) in enumerate(zip(value, new)):
                    if a != b:
                        changed.setdefault(i, (float(a), float(b)))
                out[key] = list(new)
            else:
                out[key] = _keep_new_bases(value, new, changed) if key in fresh else value
        return out
    if isinstance(saved, list) and isinstance(fresh, list) and len(saved) == len(fresh):
        return [_keep_new_bases(a, b, changed) for a, b in zip(saved, fresh)]
    return saved


def _bases(state: dict[str, Any]) -> list[Any]:
    """Every ``base_lrs`` list in a scheduler's ``state_dict``, nested ones too."""
    found = [state["base_lrs"]] if isinstance(state.get("base_lrs"), list) else []
    for child in state.get("_schedulers", []) or []:
        if isinstance(child, dict):
            found += _bases(child)
    return found[0] if len(found) == 1 else found
