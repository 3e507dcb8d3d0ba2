"""The run settings: the values a policy or the auto-tuner may change while a plan trains, one
object per plan, their only writer (docs/design-overview.md §5, Run settings)."""

from __future__ import annotations

import operator
import warnings
from typing import Any, Callable, Sequence

from ..config import LEARNER_MODES
from ..kernels.select import UpdateFacts
from .state.hyper import Hyper
from .state.optim import LocalOptimizer
from .sync.base import SyncAlgorithm

__all__ = ["RunSettings", "settings_view"]


class RunSettings:
    """The settings in force from the next round on.

    Attributes:
        optimizer: the local optimiser (engine/state/optim.py ``LocalOptimizer``): the user's
            torch.optim optimizer, whose param groups hold the hyper-parameters in force.
        sync: the synchronisation algorithm (engine/sync/) with the α, τ or H in force.
        batch_size: b, samples per learner per round (≥ 1).
        replicas_per_device: m, replicas on every device (≥ 1; k = G·m over every process).
        learner_mode: ``"per_replica"`` or ``"fused"`` (engine/learning/fused.py).
        lr: η, the first param group's learning rate in force (≥ 0), applied to the mean loss
            of a learner's b samples; setting it is a policy's change of η.
        alpha: ``sync.alpha`` (SMA's α, None: its default rule at each k; None without α).
        sync_every: ``sync.sync_every``, τ (≥ 1; 1 under SSGD).
        lr_rule: SMA's η rule's state (training/sma_lr.py ``SMALRRule``), None before a fit
            applies it; its factor is ``optimizer.lr_factor``.

    η_i = F_i · schedule_i(t) (docs/optimizers.md, Schedules). Only
    ``apply_adjustment`` (engine/adjust.py) and the methods below change them.

    Raises:
        ValueError: an unknown learner mode; setting α under an algorithm without α (e.g.
            SSGD, DiLoCo) or τ other than 1 under SSGD (``SyncAlgorithm.with_alpha``,
            ``with_sync_every``)."""

    __slots__ = ("optimizer", "sync", "batch_size", "replicas_per_device", "learner_mode",
                 "lr_rule", "_lr_factors")

    def __init__(self, *, optimizer: LocalOptimizer, sync: SyncAlgorithm, batch_size: int,
                 replicas_per_device: int, learner_mode: str) -> None:
        if learner_mode not in LEARNER_MODES:
            raise ValueError(f"learner_mode={learner_mode!r}: use one of {LEARNER_MODES}")
        self.optimizer = optimizer
        self.sync = sync
        self.batch_size = batch_size
        self.replicas_per_device = replicas_per_device
        self.learner_mode = learner_mode
        self.lr_rule: Any = None  # training/sma_lr.py SMALRRule
        self._lr_factors: dict[Any, list[float]] = {}  # LR schedule → its F per param group

    # -- η: the param groups' learning rates ------------------------------------------------------

    @property
    def lr(self) -> float:
        """η in force: the first param group's learning rate (``optimizer.lr``)."""
        return self.optimizer.lr

    @lr.setter
    def lr(self, value: float) -> None:
        """A policy's η: the first group's lr becomes ``value`` and every other group's is scaled
        by the same factor (their ratios kept); every LR schedule's F composes the change."""
        groups, old = self._groups, self._group_lrs()
        for g in groups:
            g["lr"] = value if old[0] == 0 else float(g["lr"]) * value / old[0]
        groups[0]["lr"] = float(value)
        self._compose(old, writer=None)

    @property
    def _groups(self) -> list[dict[str, Any]]:
        return self.optimizer.optimizer.param_groups

    def _group_lrs(self) -> list[float]:
        return [float(g["lr"]) for g in self._groups]

    def _compose(self, old: list[float], writer: Any) -> None:
        """Fold the write that moved the groups' lr from ``old`` into the F of every LR schedule
        but ``writer`` (the schedule that wrote, or None for a policy)."""
        new = self._group_lrs()
        for schedule, factors in self._lr_factors.items():
            if schedule is writer:
                continue
            for i, (was, now) in enumerate(zip(old, new)):
                if now != was and was != 0:
                    factors[i] *= now / was

    def add_lr_schedule(self, scheduler: Any) -> None:
        """Compose the steps of ``scheduler`` (a torch.optim LR scheduler over ``optimizer``)
        with the other writes of η from now on, starting at F = 1 in every group."""
        self._lr_factors[scheduler] = [1.0] * len(self._groups)

    def new_lr_schedule(self, make: Callable[[Any], Any], *, keep_lr: bool = False) -> Any:
        """``make(optimizer)``, a torch.optim LR scheduler built over the param groups (its
        construction may write them: LinearLR's ``start_factor``), added as a schedule;
        ``keep_lr``: the groups keep the lr they had (a schedule resumed from a checkpoint)."""
        old = self._group_lrs()
        scheduler = make(self.optimizer.optimizer)
        if keep_lr:
            self.load_group_settings([{"lr": lr} for lr in old])
        else:
            self._compose(old, writer=scheduler)
        self.add_lr_schedule(scheduler)
        return scheduler

    def drop_lr_schedule(self, scheduler: Any) -> None:
        """Stop composing ``scheduler``'s steps (the end of the fit that stepped it)."""
        self._lr_factors.pop(scheduler, None)

    def lr_factors(self, scheduler: Any) -> list[float]:
        """Per param group, the factor F of the added schedule ``scheduler``."""
        return list(self._lr_factors[scheduler])

    def set_lr_factors(self, scheduler: Any, factors: Sequence[float]) -> None:
        """Restore the factors of the added schedule ``scheduler`` (a checkpoint's)."""
        self._lr_factors[scheduler] = [float(f) for f in factors]

    def step_lr_schedule(self, scheduler: Any, *args: float) -> None:
        """One step of the added schedule ``scheduler`` (``args``: ReduceLROnPlateau's metric):
        η_i ← F_i · (its value stepped from η_i / F_i) in every group (class docstring)."""
        groups, factors, old = self._groups, self._lr_factors[scheduler], self._group_lrs()
        for g, f in zip(groups, factors):  # the scheduler steps from its own value
            if f != 1.0:
                g["lr"] = float(g["lr"]) / f
        with warnings.catch_warnings():  # the plan, not the user, steps the optimizer
            warnings.filterwarnings("ignore", message=r".*(lr_scheduler\.step\(\)|optimizer\.step\(\)).*")
            scheduler.step(*args)
        for g, f in zip(groups, factors):
            if f != 1.0:
                g["lr"] = float(g["lr"]) * f
        self._compose(old, writer=scheduler)

    def mark_stepped(self) -> None:
        """Record on the optimizer that a round stepped it, as its own ``step`` would (the flag
        torch's LR schedulers read): a scheduler the user steps between fits raises no warning
        that it steps before ``optimizer.step()``; the rounds ran those steps."""
        self.optimizer.optimizer._opt_called = True  # torch.optim.lr_scheduler's own flag

    def load_group_settings(self, saved: list[dict[str, Any]]) -> None:
        """Write ``saved`` (per param group, settings by key: a checkpoint's
        ``LocalOptimizer.group_settings()`` or part of it) into the param groups, as a restore:
        no schedule's F changes."""
        for g, s in zip(self._groups, saved):
            for k, v in s.items():
                g[k] = tuple(v) if isinstance(g.get(k), tuple) and isinstance(v, list) else v

    def hyper(self, num_learners: int) -> Hyper:
        """The snapshot a round reads (``Hyper``): the param groups in force, α for k =
        ``num_learners`` learners (``alpha_for``), μ_z and γ (``centre_gain``); taken once per
        round."""
        return Hyper.of(self.optimizer, alpha=self.sync.alpha_for(num_learners),
                        central_momentum=self.sync.central_momentum,
                        centre_gain=self.sync.centre_gain(num_learners))

    def update_facts(self, num_learners: int) -> UpdateFacts:
        """What selects the update kernels (kernels/select.py): the local optimizer's SGD flags
        and the sync algorithm's facts for k = ``num_learners`` learners (k, τ, μ_z)."""
        opt = self.optimizer.sgd()
        return UpdateFacts(momentum=opt.momentum, nesterov=opt.nesterov,
                           weight_decay=opt.weight_decay, local=self.optimizer.kernel,
                           **self.sync.kernel_facts(num_learners))

    # -- α, τ ---------------------------------------------------------------------------------------

    @property
    def alpha(self) -> float | None:
        """SMA α in force, None for its default rule (and for the algorithms without α)."""
        return self.sync.alpha

    @alpha.setter
    def alpha(self, value: float | None) -> None:
        self.sync = self.sync.with_alpha(value)

    @property
    def sync_every(self) -> int:
        """τ in force (``sync.sync_every``)."""
        return self.sync.sync_every

    @sync_every.setter
    def sync_every(self, value: int) -> None:
        self.sync = self.sync.with_sync_every(value)

    def alpha_for(self, num_learners: int) -> float:
        """α used for k = ``num_learners`` learners (``SMA.alpha_for``: α, or its default rule;
        0 when k = 1 and for the algorithms without α)."""
        return self.sync.alpha_for(num_learners)

    def __repr__(self) -> str:
        return (f"RunSettings(lr={self.lr!r}, batch_size={self.batch_size!r}, "
                f"alpha={self.alpha!r}, sync_every={self.sync_every!r}, "
                f"replicas_per_device={self.replicas_per_device!r}, "
                f"learner_mode={self.learner_mode!r})")


def settings_view(name: str, doc: str) -> property:
    """A read-only attribute ``name`` that reads ``self.settings.<name>`` (a RunSettings).

    Assigning it raises AttributeError naming the way to change it: ``Plan.adjust``."""

    def refuse(self, value) -> None:
        raise AttributeError(
            f"{type(self).__name__}.{name} is read-only (it reads the plan's RunSettings); change "
            f"the run settings between rounds with plan.adjust(crossbow_graph.Adjustment(...)), "
            f"e.g. Adjustment(lr=0.05, batch_size=32, alpha=0.25, sync_every=2, "
            f"replicas_per_device=2, learner_mode='fused')")

    return property(operator.attrgetter(f"settings.{name}"), refuse, doc=doc)  # C-speed read
