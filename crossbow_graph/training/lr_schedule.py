"""A torch.optim LR scheduler driving a fit (docs/design-overview.md §5, Run settings).

``fit(lr_scheduler=sched, lr_scheduler_interval="epoch" | "round")`` takes any
``torch.optim.lr_scheduler`` built over the plan's optimizer (``Plan.optimizer``: the optimizer
given to ``compile``): OneCycleLR, SequentialLR of LinearLR warm-up and CosineAnnealingLR,
MultiStepLR, ReduceLROnPlateau, ... ``LRSchedulerHook`` steps it at the end of every round or
epoch (ReduceLROnPlateau: after each evaluation of z, with z's test loss; without an evaluation
set, at the end of each epoch with its training loss). The scheduler writes the param groups'
``lr`` (and momentum or betas, e.g. OneCycleLR's ``cycle_momentum``); every learner reads them at
the next round (worker processes through the control block, engine/workers.py), so all learners
see the same η at the same round, and so do all torchrun ranks (each steps its own scheduler on
the same rounds). Its state is checkpointed with the fit (a hook's ``state_dict``).

A policy's η change composes with the schedule as a factor: when a policy (AdaptiveBatchSize's
gain or batch-size rule, a user's ``Policy.adjust(lr=...)``) has moved a group's ``lr`` away from
the value the scheduler last wrote, the hook keeps the ratio f as that group's factor. Before each
step it hands the scheduler its own value (``lr / F``, F the product of the factors), steps it and
writes ``F ×`` the new value: the η in force is F · schedule(t) for every scheduler, closed-form
(LambdaLR, OneCycleLR, CosineAnnealingLR) or chainable (MultiStepLR, ReduceLROnPlateau), where a
closed-form scheduler alone would overwrite the policy's change at its next step. The factors are
checkpointed with the scheduler.

A resumed fit restores the scheduler's state (its position, ``last_epoch``) from the checkpoint,
but where this fit's scheduler was built over other learning rates than the checkpoint's (its
``base_lrs``, also those of the schedulers inside a SequentialLR or ChainedScheduler, differ) it
keeps its own, and a group's η in force becomes the checkpoint's scaled by new base / old base,
with a warning naming both: the user set the run up anew, as for the param groups' settings
(training/run_setup.py; docs/reliability.md, Resuming with other settings).
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

import torch

from .hooks import FitContext, Hook

if TYPE_CHECKING:
    from ..api import Plan
    from .history import EpochRecord, EvalRecord

__all__ = ["LRSchedulerHook", "LR_INTERVALS", "check_lr_scheduler"]

LR_INTERVALS = ("epoch", "round")


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


class LRSchedulerHook(Hook):
    """Steps a torch.optim LR scheduler once per round or epoch of a fit (module docstring).

    Args:
        scheduler: a ``torch.optim.lr_scheduler`` scheduler over ``Plan.optimizer``.
        interval: ``"epoch"`` or ``"round"`` (ignored by ReduceLROnPlateau, which steps after
            each evaluation).
    """

    def __init__(self, scheduler: Any, interval: str = "epoch") -> None:
        self.scheduler = scheduler
        self.interval = interval
        self.plateau = isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
        self._evaluated = False
        self._factors = [1.0] * len(scheduler.optimizer.param_groups)  # F per group: the
        # policies' changes, composed
        self._written = self._lrs()  # each group's lr when the hook last looked

    def _lrs(self) -> list[float]:
        return [float(g["lr"]) for g in self.scheduler.optimizer.param_groups]

    def _take_policy_changes(self) -> None:
        """Fold a policy's change of a group's lr since the hook last looked into its factor F."""
        lrs = self._lrs()
        for i, (lr, was) in enumerate(zip(lrs, self._written)):
            if lr != was and was != 0:
                self._factors[i] *= lr / was
        self._written = lrs

    def _step(self, *args: float) -> None:
        self._take_policy_changes()
        groups = self.scheduler.optimizer.param_groups
        for g, f in zip(groups, self._factors):  # the scheduler steps from its own value
            if f != 1.0:
                g["lr"] = float(g["lr"]) / f
        with warnings.catch_warnings():  # the plan, not the user, steps the optimizer
            warnings.filterwarnings("ignore", message=r".*(lr_scheduler\.step\(\)|optimizer\.step\(\)).*")
            self.scheduler.step(*args)
        for g, f in zip(groups, self._factors):
            if f != 1.0:
                g["lr"] = float(g["lr"]) * f
        self._written = self._lrs()

    @property
    def factors(self) -> list[float]:
        """Per param group, the product F of the policies' η factors composed with the schedule."""
        self._take_policy_changes()
        return list(self._factors)

    def before_fit(self, ctx: FitContext) -> None:
        self._evaluated = False
        self._take_policy_changes()  # e.g. a change made between fits

    def after_round(self, ctx: FitContext) -> None:
        if self.interval == "round" and not self.plateau:
            self._step()

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
        return {"scheduler": self.scheduler.state_dict(), "evaluated": self._evaluated,
                "factors": self.factors, "written": list(self._written)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict()``; this scheduler's ``base_lrs`` where they differ from the
        saved ones (module docstring), with a UserWarning."""
        changed: dict[int, tuple[float, float]] = {}
        saved = _keep_new_bases(state["scheduler"], self.scheduler.state_dict(), changed)
        self.scheduler.load_state_dict(saved)
        self._evaluated = state["evaluated"]
        self._factors = list(state.get("factors", self._factors))
        self._written = list(state.get("written", self._lrs()))
        groups = self.scheduler.optimizer.param_groups
        for i, (old, new) in changed.items():  # the checkpoint's η on this fit's base
            if old:
                groups[i]["lr"] = self._written[i] * new / old
            self._written[i] = float(groups[i]["lr"])  # not a policy's change to fold into F
        if changed:
            warnings.warn(
                f"resuming LR scheduler {type(self.scheduler).__name__} at its position "
                f"(last_epoch={self.scheduler.last_epoch}) with this fit's base learning rates: "
                f"it was built over other ones than the checkpoint's "
                f"({_bases(self.scheduler.state_dict())} now, {_bases(state['scheduler'])} in the "
                "checkpoint); η follows the schedule of this fit's from its next step",
                UserWarning, stacklevel=2)


def _keep_new_bases(saved: Any, fresh: Any, changed: dict[int, tuple[float, float]]) -> Any:
    """``saved`` (a scheduler's ``state_dict``) with every ``base_lrs`` entry, nested ones too,
    taken from ``fresh``; ``changed`` gets ``group index: (old base, new base)`` where the two
    differ (the first list that differs)."""
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
