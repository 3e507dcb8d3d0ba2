"""The run settings: the values a policy or the auto-tuner may change while a plan trains
(docs/design-overview.md §5, Run settings).

One ``RunSettings`` object per plan holds them (``Plan.settings``); the scheduler, its fused
programs, the worker processes, the torchrun agreement, the metrics, the policies and the
checkpoints read them from there, so there is one copy of each. Only
``tuning.policy_base.apply_adjustment`` (reached through ``Plan.adjust(Adjustment(...))``) writes
them, between rounds: it also re-plans the task graph, resizes the replicas and restarts worker
processes where a change needs it. ``settings_view`` gives other objects read-only attributes
that forward to the settings (``Plan.batch_size``, ``Scheduler.lr``, ...).
"""

from __future__ import annotations

import operator

from ..config import LEARNER_MODES
from .optim import LocalOptimizer
from .sync.base import SyncAlgorithm

__all__ = ["RunSettings", "settings_view"]


class RunSettings:
    """The settings in force from the next round on.

    Attributes:
        optimizer: the local optimiser (engine/optim.py ``LocalOptimizer``): the user's
            torch.optim optimizer, whose param groups hold the hyper-parameters in force (an LR
            scheduler over it changes them between rounds).
        sync: the synchronisation algorithm (engine/sync/: ``SMA`` with the α and τ in force,
            μ_z fixed; ``DiLoCo`` with the H in force; ``SSGD()``; ...).
        batch_size: b, samples per learner per round (≥ 1).
        replicas_per_device: m, replicas on every device (≥ 1; k = G·m over every process).
        learner_mode: ``"per_replica"`` or ``"fused"`` (engine/fused.py).
        lr: η, the first param group's learning rate in force (≥ 0), applied to the mean loss
            of a learner's b samples; setting it scales every group's lr by the same factor.
        alpha: SMA α in (0, 1], the pull of each replica toward z, or None: 1/k (re-derived when
            k changes); None for the algorithms without α. ``sync.alpha``.
        sync_every: τ, rounds between synchronisations (≥ 1; 1 under SSGD). ``sync.sync_every``.

    Who changes them: ``tuning.policy_base.apply_adjustment`` only (``Plan.adjust``, which
    ``Plan.set_replicas``, ``Plan.set_learner_mode``, the auto-tuner, ``Comm.agree_settings`` and
    checkpoint resumes call); every other module reads them.

    Raises:
        ValueError: an unknown learner mode; setting α under an algorithm without α (e.g.
            SSGD, DiLoCo) or τ other than 1 under SSGD (``SyncAlgorithm.with_alpha``,
            ``with_sync_every``).
    """

    __slots__ = ("optimizer", "sync", "batch_size", "replicas_per_device", "learner_mode")

    def __init__(self, *, optimizer: LocalOptimizer, sync: SyncAlgorithm, batch_size: int,
                 replicas_per_device: int, learner_mode: str) -> None:
        if learner_mode not in LEARNER_MODES:
            raise ValueError(f"learner_mode={learner_mode!r}: use one of {LEARNER_MODES}")
        self.optimizer = optimizer
        self.sync = sync
        self.batch_size = batch_size
        self.replicas_per_device = replicas_per_device
        self.learner_mode = learner_mode

    @property
    def lr(self) -> float:
        """η in force: the first param group's learning rate (``optimizer.lr``)."""
        return self.optimizer.lr

    @lr.setter
    def lr(self, value: float) -> None:
        self.optimizer.scale_lr(value)

    @property
    def alpha(self) -> float | None:
        """SMA α in force, None for 1/k (and for the algorithms without α)."""
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
        """α used for k = ``num_learners`` learners (``SMA.alpha_for``: α, or 1/k; 0 when k = 1;
        0 for the algorithms without α)."""
        return self.sync.alpha_for(num_learners)

    def __repr__(self) -> str:
        return (f"RunSettings(lr={self.lr!r}, batch_size={self.batch_size!r}, "
                f"alpha={self.alpha!r}, sync_every={self.sync_every!r}, "
                f"replicas_per_device={self.replicas_per_device!r}, "
                f"learner_mode={self.learner_mode!r})")


def settings_view(name: str, doc: str) -> property:
    """A read-only attribute ``name`` that reads ``self.settings.<name>`` (a RunSettings).

    Assigning it raises AttributeError naming the way to change it: ``Plan.adjust``.
    """

    def refuse(self, value) -> None:
        raise AttributeError(
            f"{type(self).__name__}.{name} is read-only (it reads the plan's RunSettings); change "
            f"the run settings between rounds with plan.adjust(crossbow_graph.Adjustment(...)), "
            f"e.g. Adjustment(lr=0.05, batch_size=32, alpha=0.25, sync_every=2, "
            f"replicas_per_device=2, learner_mode='fused')")

    return property(operator.attrgetter(f"settings.{name}"), refuse, doc=doc)  # C-speed read
