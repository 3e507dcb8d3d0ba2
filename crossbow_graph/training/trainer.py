"""The training loop of ``Plan.fit``: rounds, evaluation, time-to-accuracy (docs/design-overview.md §2, §6)."""

from __future__ import annotations

import numbers
import time
from typing import TYPE_CHECKING, Any

import torch
from tqdm.auto import tqdm

from ..engine._learners import seed_host_rngs
from ..engine.timeline import Timeline
from ..errors import is_count
from .checkpoint import CheckpointHook, load_plan_state_dict, plan_state_dict
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
    trace: str | None = None,
    policies: list[Hook] = (),
    metrics: Hook | None = None,
) -> History:
    """Run ``Plan.fit`` (see its docstring for the arguments and errors).

    Rounds take the next k·b samples of the epoch's order (``BatchSchedule.next_round``), with k
    read before every round, so hooks (the auto-tuner) may change the replicas between rounds and
    every batch of an epoch stays disjoint (b too is read before every round: policies may change
    it). A MetricsMonitor (every ``metrics_every`` rounds) runs after the other hooks and before
    the ``policies``, which run last but for logging and checkpoints. A resumed fit starts at the
    saved sample position of its epoch. Worker processes, if any, live for the fit. Torch's RNG
    is seeded with ``seed``, Python's ``random`` and NumPy's from it (``seed_host_rngs``), before
    a resume restores the checkpoint's states.

    Under torchrun (``plan.comm``) every rank draws the same round of k·b indices and keeps its own
    learners' rows (rank r: global learners r·k_r …, ``_mine``); only rank 0 shows progress,
    writes logs and checkpoints, evaluates and runs the auto-tuner; every rank runs the fit's
    hooks, and rank 0's m, learner mode, lr, α, batch size, sync interval and stop are then
    broadcast and applied on every rank (``Comm.agree_settings``: after each round's hooks, and
    before a round when hooks ran since); z is compared across ranks every ``checksum_every``
    rounds and at the end; every rank's faults reach every rank's History (engine/faults.py,
    at each global sync and at the end) (docs/distributed.md).

    The epoch's ``train_loss`` and the hooks' ``round_loss`` are the means of the learners'
    finite losses: a faulty replica's NaN/Inf loss is left out, as the replica is.
    """
    if not is_count(epochs):
        raise ValueError(f"epochs={epochs!r}: must be an integer ≥ 1")
    _check_fit_args(seed, target_accuracy, evals_per_epoch, eval_batch_size)
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
    comm = plan.comm
    if comm is not None:
        comm.agree({"train samples": len(train), "epochs": epochs, "shuffle": shuffle, "seed": seed,
                    "evals_per_epoch": evals_per_epoch, "target_accuracy": target_accuracy,
                    "checkpoint_every": checkpoint_every, "resume": resume,
                    "rounds done": plan.rounds_done,
                    "eval samples": None if eval_dataset is None else len(eval_dataset)}, "the fit")
        progress = progress and comm.is_main
    main = comm is None or comm.is_main
    schedule = BatchSchedule(len(train), k, b, shuffle=shuffle, seed=seed)
    # a dataset that gathers whole batches at once (e.g. vectorised augmentation) provides get_batch
    fetch = train.get_batch if hasattr(train, "get_batch") else make_fetch(train)
    check_first_batch(plan, train, fetch, schedule.round_indices(schedule.order(0), 0, 0, 1))
    if eval_dataset is not None:  # its first b samples, as evaluation will read them
        evals = as_dataset(eval_dataset, "eval_dataset")
        check_first_batch(plan, evals, make_fetch(evals), torch.arange(min(b, len(evals))),
                          what="eval_dataset")
    torch.manual_seed(seed)
    # Python's and NumPy's too (a Dataset's augmentation); worker processes reseed every round
    seed_host_rngs(seed, plan.rounds_done, comm.rank if comm is not None else 0, 0)
    history = History(target_accuracy=target_accuracy)
    hooks = list(hooks)
    if metrics is not None:
        hooks.append(metrics)
    hooks += list(policies)
    end_epoch = plan.epochs_done + epochs
    if log_dir is not None and main:
        hooks.append(MetricsLogger(log_dir))
    if checkpoint_dir is not None:  # last: it saves what the other hooks did in the round
        saver = CheckpointHook(checkpoint_dir, schedule, hooks, every_rounds=checkpoint_every) \
            if main else None
        resumed = resume and main and saver.resume(plan, history) is not None
        if comm is not None and resume:
            resumed = _share_resumed(plan, comm, resumed)
        if resumed:
            end_epoch = epochs  # a resumed run finishes the epochs of the run it continues
        if saver is not None:
            hooks.append(saver)
    timeline = Timeline() if trace is not None else None
    sched = plan.scheduler
    sync0 = (sched.sync_seconds, sched.sync_exposed_seconds)
    sched.begin_fit(fetch, seed=seed, timeline=timeline)

    def sync_totals() -> None:  # before after_fit, so that hooks (history.json) see them
        history.sync_seconds = sched.sync_seconds - sync0[0]
        history.sync_exposed_seconds = sched.sync_exposed_seconds - sync0[1]

    try:
        _epochs(plan, schedule, history, hooks, end_epoch, eval_dataset, target_accuracy,
                evals_per_epoch, eval_batch_size, progress, sync_totals)
        if comm is not None:
            comm.check_z(plan.states[0].z, plan.rounds_done - 1)
    except BaseException:
        if comm is not None:
            comm.close()  # the others see this rank gone at once instead of at their timeout
        raise
    finally:
        sched.end_fit()
        sync_totals()
        if timeline is not None:
            timeline.save(trace)
    return history


def _check_fit_args(seed: Any, target_accuracy: Any, evals_per_epoch: Any,
                    eval_batch_size: Any) -> None:
    """TypeError/ValueError for ``fit``'s scalar arguments, before anything runs."""
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed={seed!r}: must be an integer, e.g. seed=0")
    if target_accuracy is not None:
        if isinstance(target_accuracy, bool) or not isinstance(target_accuracy, numbers.Real):
            raise TypeError(f"target_accuracy={target_accuracy!r}: must be a fraction in (0, 1], "
                            "e.g. 0.99, or None")
        if not 0 < target_accuracy <= 1:
            guess = (f"; did you mean {target_accuracy / 100:g}?"
                     if 10 <= target_accuracy <= 100 else "")
            raise ValueError(f"target_accuracy={target_accuracy!r}: must be a fraction in (0, 1] "
                             f"of the eval_dataset's samples, e.g. 0.99{guess}")
    if not is_count(evals_per_epoch):
        raise ValueError(f"evals_per_epoch={evals_per_epoch!r}: must be an integer ≥ 1 "
                         "(evaluations of z per epoch), e.g. 1")
    if not is_count(eval_batch_size):
        raise ValueError(f"eval_batch_size={eval_batch_size!r}: must be an integer ≥ 1, e.g. 1000")


def _share_resumed(plan: "Plan", comm, resumed: bool) -> bool:
    """Rank 0 resumed from its checkpoint: every rank takes its plan state (the other ranks'
    replicas restart as copies of rank 0's). Returns whether rank 0 resumed."""
    state = comm.broadcast_object(plan_state_dict(plan) if resumed else None, -1)
    if state is not None and not comm.is_main:
        load_plan_state_dict(plan, state)
    return state is not None


def _share_faults(plan: "Plan", comm) -> None:
    """At the fit's end: the faults found since the last global sync (τ > 1) reach every rank
    (``FaultMonitor.share``, after one all-reduce of a flag; DivergenceError as at a sync)."""
    faults, t = plan.scheduler.faults, plan.rounds_done - 1
    if comm.any_rank(bool(faults.pending), t):
        faults.share(comm, t, plan.num_learners)


def _mine(plan: "Plan", indices: torch.Tensor | None) -> torch.Tensor | None:
    """This rank's rows of a round's indices ``[k·b]``: rank r's learners are the global learners
    r·k_r … (r+1)·k_r − 1 (k_r = k / world size); all of them in a single process."""
    comm = plan.comm
    if comm is None or indices is None:
        return indices
    per_rank = len(indices) // comm.world_size
    return indices[comm.rank * per_rank:(comm.rank + 1) * per_rank]


def _evaluate(plan: "Plan", eval_dataset: Any, batch_size: int) -> tuple[float | None, float]:
    """z's test accuracy and loss; under torchrun rank 0 evaluates and broadcasts them."""
    comm = plan.comm
    if comm is None:
        return plan.evaluate(eval_dataset, batch_size=batch_size)
    acc, loss = plan.evaluate(eval_dataset, batch_size=batch_size) if comm.is_main else (0.0, 0.0)
    acc, loss = comm.broadcast_floats([float("nan") if acc is None else acc, loss],
                                      plan.rounds_done - 1)
    return (None if acc != acc else acc), loss


def _finite_mean(losses: torch.Tensor) -> torch.Tensor:
    """The mean of the finite entries of ``losses [n]``, 0-dim, NaN when none is, without a host
    read: a faulty replica's NaN/Inf loss is left out, as the replica is left out of the round's
    average (engine/faults.py)."""
    finite = torch.isfinite(losses)
    return torch.where(finite, losses, 0.0).sum() / finite.sum()


def _mean_loss(comm, losses: torch.Tensor, plan: "Plan") -> float:
    """The epoch's mean training loss over the learners of every rank (one all-reduce under
    torchrun), NaN/Inf losses (faulty replicas') left out."""
    if comm is None:
        return float(_finite_mean(losses))
    finite = torch.isfinite(losses)
    total, count = comm.sum_floats([float(losses[finite].sum()), float(finite.sum())],
                                   plan.rounds_done - 1)
    return total / count if count else float("nan")


def _epochs(plan, schedule, history, hooks, end_epoch, eval_dataset, target_accuracy,
            evals_per_epoch, eval_batch_size, progress, sync_totals) -> None:
    n = schedule.num_samples
    comm = plan.comm
    sched = plan.scheduler
    speculate = all(not getattr(h, "mutates_replicas", True) for h in hooks)
    ctx = FitContext(plan=plan, history=history, train_seconds=plan.train_seconds,
                     rounds_per_epoch=n // (plan.num_learners * plan.batch_size))
    ctx.extra["num_samples"] = n  # N, samples per epoch
    for hook in hooks:
        hook.before_fit(ctx)
    monitor, faults_seen = sched.faults, len(sched.faults.events)
    measures = [h for h in hooks if hasattr(h, "wants_gradients")]
    # rank 0's decisions are broadcast after every round's hooks, and before a round when hooks ran
    # since (epoch boundaries, evaluations) or when a hook of any rank acts in before_round
    pre_round = comm is not None and comm.any_rank(
        any(type(h).before_round is not Hook.before_round for h in hooks), -1)
    while plan.epochs_done < end_epoch:
        epoch = plan.epochs_done
        position = plan.position_in_epoch  # > 0 when resumed in the middle of an epoch
        rounds_run = plan.round_in_epoch
        ctx.epoch, ctx.round_in_epoch = epoch, rounds_run
        ctx.rounds_per_epoch = n // (plan.num_learners * plan.batch_size)
        for hook in hooks:
            hook.before_epoch(ctx)
        agree = comm is not None  # after_epoch and before_epoch hooks ran
        order = schedule.order(epoch)
        if position == 0:
            sched.losses = []
        sync0 = (sched.sync_seconds, sched.sync_exposed_seconds)
        epoch_seconds, acc, samples_run = 0.0, None, 0
        eval_points = [n * i // evals_per_epoch for i in range(1, evals_per_epoch + 1)]
        next_eval = sum(1 for p in eval_points if p <= position)
        bar = tqdm(total=n, initial=position, desc=f"epoch {epoch + 1}", unit="sample",
                   unit_scale=True, disable=not progress, leave=False, dynamic_ncols=True)
        start = time.perf_counter()
        while True:
            for hook in hooks:
                hook.before_round(ctx)
            if agree or pre_round:  # rank 0's decisions (m, mode, lr, α) apply to this round
                comm.agree_settings(plan, False, plan.rounds_done)
                agree = False
            schedule.num_learners, schedule.batch_size = plan.num_learners, plan.batch_size
            ctx.rounds_per_epoch = schedule.rounds_per_epoch
            indices = schedule.next_round(order, position)
            if indices is None:
                break
            position += len(indices)
            upcoming = schedule.next_round(order, position)  # if k stays, the next round's samples
            n_losses = len(sched.losses)
            plan.rounds_done += 1
            # a round whose gradients a hook reads (the noise scale) does not overlap the next
            ahead = speculate and not any(h.wants_gradients(plan.rounds_done) for h in measures)
            sched.run_round(plan.rounds_done - 1,
                            synchronise=plan.rounds_done % plan.sync.sync_every == 0,
                            indices=_mine(plan, indices),
                            next_indices=_mine(plan, upcoming) if ahead else None)
            if comm is not None and plan.rounds_done % comm.settings.checksum_every == 0:
                comm.check_z(plan.states[0].z, plan.rounds_done - 1)
            rounds_run += 1
            samples_run += len(indices)
            plan.round_in_epoch, plan.position_in_epoch = rounds_run, position
            bar.update(len(indices))
            if sched.faults is not monitor:  # re-planned (replicas, batch size): a new monitor
                monitor, faults_seen = sched.faults, 0
            if len(sched.faults.events) > faults_seen:
                history.faults.extend(sched.faults.events[faults_seen:])
                faults_seen = len(sched.faults.events)
            if hooks:
                ctx.round_in_epoch = rounds_run
                ctx.batch_indices = indices
                ctx.round_samples = len(indices)
                ctx.extra["round_losses"] = sched.losses[n_losses:]
                ctx.round_loss = _finite_mean(torch.stack(sched.losses[n_losses:]))
                ctx.train_seconds = plan.train_seconds + epoch_seconds + time.perf_counter() - start
                for hook in hooks:
                    hook.after_round(ctx)
            if comm is not None:  # every rank, hooks or not: rank 0's decisions and stop
                ctx.stop = comm.agree_settings(plan, ctx.stop, plan.rounds_done - 1)
            if ctx.stop:
                break
            last = upcoming is None
            due = next_eval < len(eval_points) and (position >= eval_points[next_eval] or last)
            if not due or eval_dataset is None:
                continue
            while next_eval < len(eval_points) and (position >= eval_points[next_eval] or last):
                next_eval += 1
            epoch_seconds += time.perf_counter() - start  # evaluation is not training time
            acc, test_loss = _evaluate(plan, eval_dataset, eval_batch_size)
            trained = plan.train_seconds + epoch_seconds
            history.evals.append(EvalRecord(epoch=epoch + position / n, round=plan.rounds_done,
                                            train_seconds=trained, test_accuracy=acc,
                                            test_loss=test_loss))
            bar.set_postfix(acc=f"{acc:.4f}" if acc is not None else "-",
                            samples_per_s=f"{samples_run / epoch_seconds:,.0f}")
            ctx.train_seconds = trained
            for hook in hooks:
                hook.after_eval(ctx, history.evals[-1])
            agree = comm is not None
            start = time.perf_counter()
            if target_accuracy is not None and acc is not None and acc >= target_accuracy:
                history.time_to_accuracy_s = trained
                history.epochs_to_accuracy = epoch + position / n
                break
        epoch_seconds += time.perf_counter() - start
        bar.close()
        sched.flush()
        plan.train_seconds += epoch_seconds
        plan.epochs_done += 1
        plan.round_in_epoch = plan.position_in_epoch = 0
        losses = torch.stack(sched.losses) if sched.losses else torch.zeros(1)
        sync_s = sched.sync_seconds - sync0[0]
        exposed_s = sched.sync_exposed_seconds - sync0[1]
        history.epochs.append(EpochRecord(
            epoch=plan.epochs_done, rounds=rounds_run, train_loss=_mean_loss(comm, losses, plan),
            test_accuracy=acc, samples_per_s=samples_run / max(epoch_seconds, 1e-9),
            train_seconds=plan.train_seconds, replicas_per_device=plan.replicas_per_device,
            learner_mode=plan.learner_mode,
            sync_unhidden_share=min(1.0, exposed_s / sync_s) if sync_s > 0 else None,
            samples=samples_run,
        ))
        ctx.train_seconds = plan.train_seconds
        for hook in hooks:
            hook.after_epoch(ctx, history.epochs[-1])
        if history.time_to_accuracy_s is not None or ctx.stop:
            break
    if comm is not None:  # faults since the last sync reach every rank (one flag all-reduce)
        _share_faults(plan, comm)
    if sched.faults is monitor and len(sched.faults.events) > faults_seen:  # a hook's, last round
        history.faults.extend(sched.faults.events[faults_seen:])
    sync_totals()
    for hook in hooks:
        hook.after_fit(ctx)
