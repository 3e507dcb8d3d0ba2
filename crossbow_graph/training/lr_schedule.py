"""A torch.optim LR scheduler driving a fit, ``fit(lr_scheduler=...)`` (docs/optimizers.md, Schedules;
docs/reliability.md, Resuming with other settings; docs/design-overview.md §5, Run settings)."""

from __future__ import annotations

import copy
import math
import warnings
from typing import TYPE_CHECKING, Any, Literal, get_args

import torch

from .hooks import FitContext, Hook

if TYPE_CHECKING:
    from .fit_plan import FitPlan
    from ..engine.settings import RunSettings
    from .history import EpochRecord, EvalRecord

__all__ = ["LRSchedulerHook", "LRInterval", "LR_INTERVALS", "check_lr_scheduler", "probe_lrs",
           "rounds_left", "schedule_end"]

LRInterval = Literal["epoch", "round", "batch"]
LR_INTERVALS = get_args(LRInterval)
PROBE_STEPS = 200_000  # the most steps a copy of a scheduler is stepped to see where it goes


def check_lr_scheduler(plan: "FitPlan", scheduler: Any, interval: str,
                       steps: int | None = None) -> None:
    """Check ``fit(lr_scheduler=..., lr_scheduler_interval=...)`` before any round; ``steps``:
    the steps the fit will take per round or per batch (None: unknown, e.g. the auto-tuner
    changes k).

    Raises:
        TypeError: not a torch.optim LR scheduler (or a scheduler class, not an instance).
        ValueError: built over another optimizer than the plan's, an unknown interval, or a
            OneCycleLR stepped per round or batch with fewer steps left than the fit takes."""
    if interval not in LR_INTERVALS:
        raise ValueError(f"lr_scheduler_interval={interval!r}: use 'epoch', 'round' or 'batch'")
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau
    if not isinstance(scheduler, (torch.optim.lr_scheduler.LRScheduler, plateau)):
        got = (f"the class {scheduler.__name__}: build one over plan.optimizer"
               if isinstance(scheduler, type) else type(scheduler).__name__)
        raise TypeError(f"lr_scheduler must be a torch.optim.lr_scheduler scheduler built over "
                        f"plan.optimizer, e.g. OneCycleLR(plan.optimizer, max_lr=0.1, "
                        f"total_steps=...), got {got}")
    if scheduler.optimizer is not plan.settings.optimizer.optimizer:
        raise ValueError(
            f"lr_scheduler is built over another optimizer ({type(scheduler.optimizer).__name__} "
            f"at {id(scheduler.optimizer):#x}) than the plan's; build it over the optimizer given "
            f"to compile, or over plan.optimizer (with crossbow_graph.SGD the plan builds its own)")
    one_cycle = isinstance(scheduler, torch.optim.lr_scheduler.OneCycleLR)
    if one_cycle and interval != "epoch" and steps is not None:
        left = scheduler.total_steps - scheduler.last_epoch
        if steps > left:
            what = "rounds" if interval == "round" else "batches of b"
            raise ValueError(f"lr_scheduler OneCycleLR has {left} steps left (total_steps="
                             f"{scheduler.total_steps}) but the fit runs {steps} {what}; build it "
                             f"with total_steps={steps + scheduler.last_epoch} or fewer epochs")


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


def probe_lrs(scheduler: Any, steps: int) -> list[float] | None:
    """The first param group's lr after each of the next ``steps`` steps of ``scheduler``,
    ``[steps]``, its own state untouched: a LambdaLR's from its first lambda, ``base_lr·λ(t)``;
    any other's by stepping a copy (its optimizer's parameters shared, not copied; its lambdas,
    if any, called). None when ``steps`` exceeds ``PROBE_STEPS``."""
    if steps > PROBE_STEPS:
        return None
    start = scheduler.last_epoch
    if type(scheduler) is torch.optim.lr_scheduler.LambdaLR:
        base, rule = float(scheduler.base_lrs[0]), scheduler.lr_lambdas[0]
        return [base * float(rule(start + t)) for t in range(1, steps + 1)]
    shared = {id(p): p for g in scheduler.optimizer.param_groups for p in g["params"]}
    probe = copy.deepcopy(scheduler, memo=shared)
    out = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(steps):
            probe.step()
            out.append(float(probe.optimizer.param_groups[0]["lr"]))
    return out


def rounds_left(plan: "FitPlan", num_samples: int, end_epoch: int) -> int:
    """The rounds a fit still runs if k and b stay: ⌊(N − position)/(k·b)⌋ in the current epoch
    and ⌊N/(k·b)⌋ in each later one before ``end_epoch``."""
    if plan.progress.epochs_done >= end_epoch:
        return 0
    per_round = plan.num_learners * plan.settings.batch_size
    later = end_epoch - plan.progress.epochs_done - 1
    return (num_samples - plan.progress.position_in_epoch) // per_round + later * (num_samples // per_round)


class LRSchedulerHook(Hook):
    """Steps a torch.optim LR scheduler once per epoch, round or batch of b of a fit through
    ``RunSettings.step_lr_schedule`` (module docstring; docs/optimizers.md, Schedules).

    Args:
        scheduler: a ``torch.optim.lr_scheduler`` scheduler over ``Plan.optimizer``.
        interval: ``"epoch"``, ``"round"`` or ``"batch"`` (ReduceLROnPlateau steps after each
            evaluation).
        settings: the plan's RunSettings, where the scheduler is added until the fit ends; None
            for a subclass that adds its own at ``before_fit``.
        batches_per_epoch: L, the batches of b a plain loop takes per epoch (the training
            DataLoader's ``len``; a Dataset: ⌈N/b⌉): the steps of an epoch with ``"batch"``, and
            what a schedule stepped per round is probed against."""

    mutates_replicas = False  # η only: the param groups, read by every learner's next update
    decides = False  # the same schedule on every rank

    def __init__(self, scheduler: Any, interval: str = "epoch", *,
                 settings: "RunSettings | None" = None, batches_per_epoch: int = 0) -> None:
        self.scheduler = scheduler
        self.interval = interval
        self.settings = settings
        self.batches_per_epoch = batches_per_epoch
        self._evaluated = self._warned = self._held = False
        self._resumed = False  # load_state_dict ran: before_fit keeps the loaded ``_evaluated``
        self._shape = (0, 0)  # (k, b) of the rounds when last checked
        self._epoch_steps = 0  # steps taken in the current epoch ("batch")
        if settings is not None:
            settings.add_lr_schedule(scheduler)

    @property
    def plateau(self) -> bool:
        """Whether the scheduler is a ReduceLROnPlateau (stepped with a loss after evaluations)."""
        return isinstance(self.scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)

    def _lrs(self) -> list[float]:
        return [float(g["lr"]) for g in self.scheduler.optimizer.param_groups]

    def _step(self, ctx: FitContext, *args: float) -> None:
        if not self._past_its_end():
            self.settings.step_lr_schedule(self.scheduler, *args)
            self._check_lrs(ctx)

    def _check_lrs(self, ctx: FitContext) -> None:
        """ValueError when the scheduler set a learning rate below 0 (or NaN): a negative η
        climbs the loss (``SGD(lr=)`` refuses one); raised before any round trains at it."""
        bad = [(i, lr) for i, lr in enumerate(self._lrs()) if not lr >= 0]
        if not bad:
            return
        i, lr = bad[0]
        plan = ctx.plan
        raise ValueError(
            f"lr_scheduler {type(self.scheduler).__name__} set lr={lr:.6g} for param group {i} "
            f"at its step {self.scheduler.last_epoch}, before round {plan.progress.rounds_done} (epoch "
            f"{plan.progress.epochs_done + 1}): a negative learning rate climbs the loss; make "
            "the schedule's factor ≥ 0 at every step, e.g. LambdaLR(plan.optimizer, lambda "
            "step: max(0.0, 1 - step / total_steps))")

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
        self._check_lrs(ctx)  # the factor at the scheduler's current step (LambdaLR's at 0)
        self._warn_if_unfinished(ctx, start=True)
        self._warn_if_short_of_the_batches(ctx)

    def after_fit(self, ctx: FitContext) -> None:
        self.settings.drop_lr_schedule(self.scheduler)

    def before_epoch(self, ctx: FitContext) -> None:
        if ctx.round_in_epoch == 0:  # a new epoch (a resumed one goes on with its count)
            self._epoch_steps = 0

    def after_round(self, ctx: FitContext) -> None:
        if self.plateau or self.interval == "epoch":
            return
        if self.interval == "batch":
            for _ in range(self._batch_steps_due(ctx)):
                self._step(ctx)
            return
        self._step(ctx)
        shape = self._round_shape(ctx)
        if shape != self._shape:  # k or b changed (the auto-tuner, a policy)
            self._shape = shape
            self._warn_if_unfinished(ctx, start=False)
            self._warn_if_short_of_the_batches(ctx)

    def _batch_steps_due(self, ctx: FitContext) -> int:
        """Steps to take after a round with ``"batch"``: the epoch's L steps spread over its
        rounds in proportion to the samples trained, ⌊L·p/e⌋ at position p of an epoch that
        ends at position e if k·b stays (all L at its last round)."""
        plan, n, total = ctx.plan, ctx.num_samples, self.batches_per_epoch
        p, per_round = plan.progress.position_in_epoch, plan.num_learners * plan.settings.batch_size
        end = p + (n - p) // per_round * per_round
        due = max(0, (total * p // end if end else total) - self._epoch_steps)
        self._epoch_steps += due
        return due

    @staticmethod
    def _round_shape(ctx: FitContext) -> tuple[int, int]:
        return ctx.plan.num_learners, ctx.plan.settings.batch_size

    def _warn_if_unfinished(self, ctx: FitContext, start: bool) -> None:
        """A UserWarning (once per fit) when the schedule cannot reach its end in the steps the
        fit has left: its rounds at the current k·b, or its epochs (module docstring)."""
        end, plan, n = schedule_end(self.scheduler), ctx.plan, ctx.num_samples
        if end is None or self.plateau or self._warned or not n:
            return
        per_round = self.interval == "round"
        steps = rounds_left(plan, n, ctx.end_epoch) if per_round else self._steps_left(ctx)
        last, (stop, setting, name) = self.scheduler.last_epoch, end
        if stop - last <= steps:
            return
        self._warned = True
        k, b = plan.num_learners, plan.settings.batch_size
        what = (f"lr_scheduler {type(self.scheduler).__name__} reaches its end ({setting}) "
                f"{stop - last} steps from now, but ")
        if not per_round:
            each = ("once per epoch" if self.interval == "epoch" else
                    f"once per batch of b, {self.batches_per_epoch} an epoch")
            fix = f"build it with {name}={last + steps}" if name else "shorten it"
            warnings.warn(what + f"this fit steps it {steps} more times ({each}); it stops at "
                          f"step {last + steps}; {fix} or train more epochs",
                          UserWarning, stacklevel=2)
            return
        rounds = (f"rounds of k·b = {k} × {b} = {k * b} samples ({n // (k * b)} an epoch of {n} "
                  "samples)")
        when = (f"this fit runs {steps} {rounds}" if start else
                f"k·b changed at round {plan.progress.rounds_done}, and {steps} {rounds} are left")
        fix = f"size it in rounds ({name}={last + steps}), " if start and name else ""
        warnings.warn(what + f"{when}, one step each; it stops at step {last + steps}; {fix}"
                      "step it per batch of b (lr_scheduler_interval='batch': a schedule sized "
                      "in len(DataLoader) steps, as a plain loop sizes it, then ends with the "
                      "fit whatever k is) or per epoch (lr_scheduler_interval='epoch') "
                      "(docs/optimizers.md, Schedules)", UserWarning, stacklevel=2)

    def _steps_left(self, ctx: FitContext) -> int:
        """Steps left in the fit: its epochs (``"epoch"``), or L per epoch less those taken in
        the current one (``"batch"``)."""
        epochs = max(0, ctx.end_epoch - ctx.plan.progress.epochs_done)
        if self.interval == "epoch":
            return epochs
        return self.batches_per_epoch * epochs - self._epoch_steps

    def _warn_if_short_of_the_batches(self, ctx: FitContext) -> None:
        """At the start and when k or b changes, for a schedule stepped per round whose end is
        no setting (LambdaLR, MultiplicativeLR, ...): with k > 1 the R rounds left are fewer than
        the L batches of b a plain loop takes; a UserWarning (once per fit) when η after R steps
        differs from η after L and the schedule goes lower than where the fit leaves it
        (``probe_lrs``; docs/optimizers.md, Schedules). A schedule sized in rounds, which ends
        at its lowest η there, is not warned."""
        plan, n = ctx.plan, ctx.num_samples
        if self.interval != "round" or self.plateau or schedule_end(self.scheduler) is not None \
                or not n or not self.batches_per_epoch or self._warned:
            return
        rounds = rounds_left(plan, n, ctx.end_epoch)
        done = self.batches_per_epoch * plan.progress.position_in_epoch // n
        batches = self.batches_per_epoch * max(0, ctx.end_epoch - plan.progress.epochs_done) - done
        lrs = probe_lrs(self.scheduler, batches) if 0 < rounds < batches else None
        if lrs is None:
            return
        at_end, at_batches, lowest = lrs[rounds - 1], lrs[-1], min(lrs)
        scale = max(abs(v) for v in lrs) or 1.0
        if math.isclose(at_end, at_batches, rel_tol=1e-6, abs_tol=1e-9 * scale) \
                or at_end <= lowest + 1e-9 * scale:
            return
        self._warned = True
        k, b, f = plan.num_learners, plan.settings.batch_size, self.factors[0]
        warnings.warn(
            f"lr_scheduler {type(self.scheduler).__name__}, stepped once per round, takes "
            f"{rounds} more steps in this fit (rounds of k·b = {k} × {b} = {k * b} samples) and "
            f"leaves η at {f * at_end:.3g}; stepped once per batch of b, as a plain loop over the "
            f"DataLoader steps it ({batches} batches, {self.batches_per_epoch} an epoch), it "
            f"would go on to η = {f * at_batches:.3g}: a schedule sized in len(DataLoader) steps "
            "(e.g. num_training_steps = epochs · len(loader)) does not finish; step it per batch "
            f"(lr_scheduler_interval='batch') or size it in rounds ({rounds}) "
            "(docs/optimizers.md, Schedules)", UserWarning, stacklevel=2)

    def after_eval(self, ctx: FitContext, record: "EvalRecord") -> None:
        if self.plateau:
            self._evaluated = True
            self._step(ctx, float(record.test_loss))

    def after_epoch(self, ctx: FitContext, record: "EpochRecord") -> None:
        if self.plateau:
            if not self._evaluated and record.train_loss is not None:
                self._step(ctx, float(record.train_loss))
        elif self.interval == "epoch":
            self._step(ctx)

    def state_dict(self) -> dict[str, Any]:
        """The scheduler's state, its factors F, the groups' η in force ("written") and the
        steps taken in the current epoch ("epoch_steps", ``"batch"``)."""
        return {"scheduler": self.scheduler.state_dict(), "evaluated": self._evaluated,
                "factors": self.factors, "written": self._lrs(), "epoch_steps": self._epoch_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict()``; this scheduler's ``base_lrs`` where they differ from the
        saved ones (module docstring), with a UserWarning."""
        changed: dict[int, tuple[float, float]] = {}
        saved = _keep_new_bases(state["scheduler"], self.scheduler.state_dict(), changed)
        self.scheduler.load_state_dict(saved)
        self._evaluated, self._resumed = state["evaluated"], True
        self._epoch_steps = int(state.get("epoch_steps", 0))
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
