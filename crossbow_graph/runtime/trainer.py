"""The training loop of ``Plan.fit``: rounds, evaluation, time-to-accuracy (DESIGN.md §2, §6)."""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Any

import torch
from tqdm.auto import tqdm

from .checkpoint import CheckpointHook
from .data import BatchSchedule, as_dataset, make_fetch
from .history import EpochRecord, EvalRecord, History
from .hooks import FitContext, Hook
from .metrics_log import MetricsLogger
from .validate import check_first_batch

if TYPE_CHECKING:
    from ..api import Plan

__all__ = ["run_fit"]


def run_fit(
    plan: "Plan",
    train_dataset: Any,
    epochs: int,
    *,
    eval_dataset: Any,
    shuffle: bool,
    seed: int,
    target_accuracy: float | None,
    evals_per_epoch: int,
    eval_batch_size: int,
    progress: bool,
    hooks: list[Hook] = (),
    checkpoint_dir: str | None = None,
    checkpoint_every: int | None = None,
    resume: bool = False,
    log_dir: str | None = None,
) -> History:
    """Run ``Plan.fit`` (see its docstring for the arguments and errors)."""
    if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1:
        raise ValueError(f"epochs={epochs!r}: must be an integer ≥ 1")
    if target_accuracy is not None and eval_dataset is None:
        raise ValueError("target_accuracy needs an eval_dataset to measure z's accuracy on")
    train = as_dataset(train_dataset)
    k, b = plan.num_learners, plan.batch_size
    if len(train) < k * b:
        raise ValueError(
            f"train_dataset has {len(train)} samples, fewer than one round of {k} learners × "
            f"{b} samples = {k * b}; lower the batch size or the replicas, or add data"
        )
    if resume and checkpoint_dir is None:
        raise ValueError("resume=True needs checkpoint_dir, the directory to resume from")
    schedule = BatchSchedule(len(train), k, b, shuffle=shuffle, seed=seed)
    # a dataset that gathers whole batches at once (e.g. vectorised augmentation) provides get_batch
    fetch = train.get_batch if hasattr(train, "get_batch") else make_fetch(train)
    check_first_batch(plan, train, fetch, schedule.round_indices(schedule.order(0), 0, 0, 1))
    torch.manual_seed(seed)
    history = History(target_accuracy=target_accuracy)
    hooks = list(hooks)
    end_epoch = plan.epochs_done + epochs
    if log_dir is not None:
        hooks.append(MetricsLogger(log_dir))
    if checkpoint_dir is not None:  # last: it saves what the other hooks did in the round
        saver = CheckpointHook(checkpoint_dir, schedule, hooks, every_rounds=checkpoint_every)
        if resume and saver.resume(plan, history) is not None:
            end_epoch = epochs  # a resumed run finishes the epochs of the run it continues
        hooks.append(saver)
    rounds = schedule.rounds_per_epoch
    eval_points = sorted({math.ceil(rounds * i / evals_per_epoch) for i in range(1, evals_per_epoch + 1)})
    tau = plan.sync.sync_every
    ctx = FitContext(plan=plan, history=history, rounds_per_epoch=rounds,
                     train_seconds=plan.train_seconds)
    for hook in hooks:
        hook.before_fit(ctx)
    faults_seen = len(plan.scheduler.faults.events)
    while plan.epochs_done < end_epoch:
        epoch = plan.epochs_done
        first = plan.round_in_epoch  # > 0 when resumed in the middle of an epoch
        ctx.epoch, ctx.round_in_epoch = epoch, first
        for hook in hooks:
            hook.before_epoch(ctx)
        order = schedule.order(epoch)
        if first == 0:
            plan.scheduler.losses = []
        epoch_seconds, acc = 0.0, None
        bar = tqdm(total=rounds, initial=first, desc=f"epoch {epoch + 1}", unit="round",
                   disable=not progress, leave=False, dynamic_ncols=True)
        start = time.perf_counter()
        rounds_run = first
        for t in range(first, rounds):
            for hook in hooks:
                hook.before_round(ctx)
            batch = fetch(schedule.round_indices(order, t))
            n_losses = len(plan.scheduler.losses)
            plan.rounds_done += 1
            plan.scheduler.run_round(plan.rounds_done - 1, batch,
                                     synchronise=plan.rounds_done % tau == 0)
            rounds_run = plan.round_in_epoch = t + 1
            bar.update(1)
            if len(plan.scheduler.faults.events) > faults_seen:
                history.faults.extend(plan.scheduler.faults.events[faults_seen:])
                faults_seen = len(plan.scheduler.faults.events)
            if hooks:
                ctx.round_in_epoch = rounds_run
                ctx.round_loss = torch.stack(plan.scheduler.losses[n_losses:]).mean()
                ctx.train_seconds = plan.train_seconds + epoch_seconds + time.perf_counter() - start
                for hook in hooks:
                    hook.after_round(ctx)
                if ctx.stop:
                    break
            if rounds_run not in eval_points or eval_dataset is None:
                continue
            epoch_seconds += time.perf_counter() - start  # evaluation is not training time
            acc, test_loss = plan.evaluate(eval_dataset, batch_size=eval_batch_size)
            trained = plan.train_seconds + epoch_seconds
            history.evals.append(EvalRecord(epoch=epoch + rounds_run / rounds, round=plan.rounds_done,
                                            train_seconds=trained, test_accuracy=acc,
                                            test_loss=test_loss))
            bar.set_postfix(acc=f"{acc:.4f}" if acc is not None else "-",
                            samples_per_s=f"{(rounds_run - first) * k * b / epoch_seconds:,.0f}")
            ctx.train_seconds = trained
            for hook in hooks:
                hook.after_eval(ctx, history.evals[-1])
            start = time.perf_counter()
            if target_accuracy is not None and acc is not None and acc >= target_accuracy:
                history.time_to_accuracy_s = trained
                history.epochs_to_accuracy = epoch + rounds_run / rounds
                break
        epoch_seconds += time.perf_counter() - start
        bar.close()
        plan.train_seconds += epoch_seconds
        plan.epochs_done += 1
        plan.round_in_epoch = 0
        losses = torch.stack(plan.scheduler.losses) if plan.scheduler.losses else torch.zeros(1)
        history.epochs.append(EpochRecord(
            epoch=plan.epochs_done, rounds=rounds_run, train_loss=float(losses.mean()),
            test_accuracy=acc, samples_per_s=(rounds_run - first) * k * b / max(epoch_seconds, 1e-9),
            train_seconds=plan.train_seconds, replicas_per_device=plan.replicas_per_device,
        ))
        ctx.train_seconds = plan.train_seconds
        for hook in hooks:
            hook.after_epoch(ctx, history.epochs[-1])
        if history.time_to_accuracy_s is not None or ctx.stop:
            break
    for hook in hooks:
        hook.after_fit(ctx)
    return history
