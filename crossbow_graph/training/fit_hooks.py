"""The hooks of one fit in calling order, and its checkpoints (docs/api.md, How a fit runs;
docs/reliability.md, Checkpoints)."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

from ..errors import CheckpointError
from .checkpoint import CheckpointHook
from .data import BatchSchedule
from .history import History
from .hooks import Hook
from .lr_schedule import LRSchedulerHook, check_lr_scheduler
from .metrics_log import MetricsLogger
from .options import FitOptions
from .run_lock import DirectoryLock

if TYPE_CHECKING:
    from .fit_plan import FitPlan

__all__ = ["fit_hooks", "checkpoints"]


def fit_hooks(plan: "FitPlan", options: FitOptions, schedule: BatchSchedule, first: list[Hook],
              metrics: Hook | None, *, main: bool, batches_per_epoch: int) -> list[Hook]:
    """``first`` (the auto-tuner, the user's hooks), ``metrics``, the policies, the LR
    scheduler (``batches_per_epoch``: a plain loop's batches of b per epoch,
    ``FitData.batches_per_epoch``), the logger (``main`` only): the fit's hooks but its
    checkpoints.

    Raises:
        ValueError: an LR scheduler that does not fit the fit (training/lr_schedule.py)."""
    hooks = list(first)
    if metrics is not None:
        hooks.append(metrics)
    hooks += list(options.policies)
    if options.lr_scheduler is not None:
        known = not options.resume and plan.autotuner is None and not options.policies
        interval = options.lr_scheduler_interval
        steps = (batches_per_epoch if interval == "batch" else
                 schedule.rounds_per_epoch(plan.num_learners, plan.settings.batch_size)) * options.epochs
        check_lr_scheduler(plan, options.lr_scheduler, interval,
                           steps if known or interval == "batch" else None)
        hooks.append(LRSchedulerHook(options.lr_scheduler, interval, settings=plan.settings,
                                     batches_per_epoch=batches_per_epoch))
    _warn_if_no_outer_step(plan, schedule, options.epochs)
    if options.log_dir is not None and main:
        hooks.append(MetricsLogger(options.log_dir))
    return hooks


def checkpoints(plan: "FitPlan", options: FitOptions, schedule: BatchSchedule, hooks: list[Hook],
                history: History, *, main: bool) -> tuple[CheckpointHook, DirectoryLock | None, bool]:
    """The CheckpointHook (it comes last, after ``hooks``: it saves what they did in the round),
    the checkpoint directory's lock (``main`` holds it), and whether the fit resumed from its
    newest checkpoint (``options.resume``). Under torchrun rank 0 writes and reads the files.

    Raises:
        CheckpointError: as ``Plan.fit`` documents it (under torchrun the group is closed first)."""
    saver = CheckpointHook(options.checkpoint_dir, schedule, hooks,
                           every_rounds=options.checkpoint_every, writer=main)
    try:
        lock = saver.claim(plan, options.resume)
    except CheckpointError:
        if plan.comm is not None:
            plan.comm.close()  # the other ranks see rank 0 gone at once, not at their timeout
        raise
    try:
        resumed = options.resume and saver.resume(plan, history) is not None
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    return saver, lock, resumed


def _warn_if_no_outer_step(plan: "FitPlan", schedule: BatchSchedule, epochs: int) -> None:
    """The sync algorithm's warning (to the caller of ``Plan.fit``) when the fit is too short
    for z to move (``SyncAlgorithm.short_fit_warning``)."""
    rounds = schedule.rounds_per_epoch(plan.num_learners, plan.settings.batch_size) * epochs
    message = plan.settings.sync.short_fit_warning(rounds, plan.progress.rounds_done)
    if message is not None:
        warnings.warn(message, stacklevel=7)  # the caller of Plan.fit
