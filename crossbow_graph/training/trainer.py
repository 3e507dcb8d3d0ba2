"""The training loop of ``Plan.fit``: rounds, evaluation, time-to-accuracy (docs/design-overview.md §2, §6).

``Trainer.run`` prepares the fit (``_prepare``: checks, agreement under torchrun, seeds, hooks,
a resume) and runs its epochs; ``run_epoch`` runs rounds (``run_round``) until the epoch's order
is used up, evaluating z (``evaluate``) at the epoch's evaluation points, and records the epoch
(``record_epoch``). The fit's state (the epoch's position, rounds, samples, training seconds, the
next evaluation point) lives in the Trainer's fields between the phases.
"""

from __future__ import annotations

import signal
import time
import warnings
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from ..errors import CheckpointError
from ..engine.comm import AGREE_EVERY_ROUNDS
from ..engine.learners import seed_host_rngs
from ..engine.timeline import Timeline
from .checkpoint import CheckpointHook
from .data import BatchSchedule, as_dataset, collate_of, make_fetch
from .evaluation import eval_samples
from .history import EpochRecord, EvalRecord, History
from .hooks import FitContext, FitHooks, Hook
from .lr_schedule import LRSchedulerHook, check_lr_scheduler
from .loader import batch_source, check_loader
from .metrics_log import MetricsLogger
from .options import FitOptions
from .run_lock import DirectoryLock
from .signals import StopSignal, interruption
from .validate import check_first_batch

if TYPE_CHECKING:
    from ..api import Plan

__all__ = ["Trainer"]


class Trainer:
    """Runs ``Plan.fit``: ``Trainer(plan, train_dataset, eval_dataset, options, hooks=...,
    metrics=...).run()``.

    Rounds take the next k·b samples of the epoch's order (``BatchSchedule.next_round``), with k
    and b read from the plan before every round, so hooks (the auto-tuner) may change the
    replicas between rounds and every batch of an epoch stays disjoint (policies may change b).
    A MetricsMonitor (``metrics``, every ``metrics_every`` rounds) runs after the other
    hooks and before the ``policies``, which run last but for logging and checkpoints. A resumed
    fit starts at the saved sample position of its epoch, in samples of the epoch's order, so a
    resume on another number of ranks (another k) continues the same order from there, k′·b
    samples a round. Worker processes, if any, live for the
    fit. Torch's RNG is seeded with ``seed``, Python's ``random`` and NumPy's from it
    (``seed_host_rngs``), before a resume restores the checkpoint's states. Training seconds
    count the rounds and their hooks, not evaluation.

    Under torchrun (``plan.comm``) every rank draws the same round of k·b indices and keeps its own
    learners' rows (rank r: global learners r·k_r …, ``_mine``); only rank 0 shows progress,
    writes logs and checkpoint files (gathering every rank's learners), evaluates and runs the
    auto-tuner; every rank runs the fit's
    hooks, and rank 0's m, learner mode, lr, α, batch size, sync interval and stop are then
    broadcast and applied on every rank (``Comm.agree_settings``: after each round's hooks when a
    hook ``decides``, else every ``AGREE_EVERY_ROUNDS`` rounds, and before a round when hooks ran
    since); z is compared across ranks every ``checksum_every``
    rounds and at the end; every rank's faults reach every rank's History (engine/faults.py,
    at each global sync and at the end) (docs/distributed.md).

    The rounds' samples come from one BatchSource per fit (training/loader.py ``batch_source``:
    resident on the device, a DataLoader's, or fetched on the host; docs/runtime.md, "Data
    paths"); host and DataLoader batches are copied to CUDA devices a round ahead
    (``Scheduler.prefetch``), when k and b stay.

    The epoch's ``train_loss`` and the hooks' ``round_loss`` are the means of the learners'
    finite losses: a faulty replica's NaN/Inf loss is left out, as the replica is.

    With a ``checkpoint_dir`` the writing rank holds the directory's lock for the whole fit
    (``CheckpointHook.claim``, training/run_lock.py). While the rounds run, SIGTERM (in the main
    thread) stops the fit at the end of the round in progress, after its hooks, with a checkpoint
    of that state, then ``run`` raises TrainingInterrupted (training/signals.py); under torchrun
    the stop is rank 0's, and every rank takes part in that checkpoint.

    Args:
        plan: the Plan to train.
        train_dataset: a torch Dataset of ``(inputs, target)`` samples, or a DataLoader (its
            collate_fn and loading settings are honoured, ``RoundLoader``; its sampler is not).
        eval_dataset: evaluated with z ``options.evals_per_epoch`` times per epoch, or None.
        options: the fit's FitOptions (already checked).
        hooks: the hooks that run first: the plan's auto-tuner (if any), then ``options.hooks``.
        metrics: the fit's MetricsMonitor (built by ``Plan.fit`` from ``options.metrics_every``),
            or None.

    The state between the phases: ``epoch``, its ``order`` and ``position`` (samples of the
    order used), ``rounds_run`` and ``samples_run`` in it, ``epoch_seconds`` (its training
    seconds up to ``start``, the clock's last start, ``time.perf_counter``), ``eval_points``
    (positions) and ``next_eval``, ``acc`` (the last test accuracy), ``agree`` (rank 0's
    settings to apply before the next round), ``monitor`` and ``faults_seen`` (the fault events
    already in the History).

    ``run`` raises what ``Plan.fit`` documents.
    """

    def __init__(self, plan: "Plan", train_dataset: Any, eval_dataset: Any, options: FitOptions,
                 *, hooks: list[Hook], metrics: Hook | None) -> None:
        self.plan, self.options = plan, options
        self.first_hooks, self.metrics = hooks, metrics
        self.train_dataset, self.eval_dataset = train_dataset, eval_dataset
        self.comm = plan.comm
        self.main = self.comm is None or self.comm.is_main  # rank 0 logs, checkpoints, evaluates

    # -- the fit ------------------------------------------------------------------------------

    def run(self) -> History:
        """Prepare the fit, then run its epochs (``_train``) with SIGTERM handled
        (training/signals.py); release the checkpoint directory's lock at the end. Returns the
        History; raises TrainingInterrupted when a signal stopped the fit."""
        self.lock: DirectoryLock | None = None
        self.saver: CheckpointHook | None = None
        self.stop_signal, self.interrupted = StopSignal(), None
        try:
            self._prepare()
            with self.stop_signal:
                self._train()
        finally:
            if self.lock is not None:
                self.lock.release()
        if self.interrupted is not None:
            raise self.interrupted
        return self.history

    def _train(self) -> None:
        """The epochs inside the scheduler's fit (worker processes); under torchrun compare z at
        the end."""
        trace, comm, sched = self.options.trace, self.comm, self.plan.scheduler
        self.timeline = Timeline() if trace is not None else None
        self.fit_sync0 = (sched.sync_seconds, sched.sync_exposed_seconds)
        sched.begin_fit(self.source.fetch, seed=self.options.seed, timeline=self.timeline,
                        load=self.source.load,
                        max_grad_norm=self.options.max_grad_norm)
        try:
            self._run_epochs()
            if comm is not None:
                comm.check_z(self.plan.states[0].z, self.plan.rounds_done - 1)
        except BaseException:
            if comm is not None:
                comm.close()  # the others see this rank gone at once instead of at their timeout
            raise
        finally:
            sched.end_fit()
            self.source.close()
            self._sync_totals()
            if self.timeline is not None:
                self.timeline.save(trace)

    def _prepare(self) -> None:
        """Everything before the first round: the data's checks, the ranks' agreement on the fit,
        the first batches' checks, the seeds, the hooks and a resume."""
        opts, plan = self.options, self.plan
        plan.run_record.begin_fit(plan)  # the set-up, at the plan's first fit (before a resume)
        self.train = self._check_datasets()
        self._agree_on_the_fit()
        self.schedule = BatchSchedule(len(self.train), shuffle=opts.shuffle, seed=opts.seed)
        self.source = batch_source(self.train_dataset, self.train, plan, seed=opts.seed,
                                   data_on_device=opts.data_on_device)  # raises ValueError
        self._check_first_batches()
        plan.bn_recalibration.use(self.source.fetch, len(self.train),
                                  batches=opts.bn_recalibration_batches,
                                  seed=opts.seed)  # z's BatchNorm statistics for evaluation
        torch.manual_seed(opts.seed)
        # Python's and NumPy's too (a Dataset's augmentation); worker processes reseed every round
        seed_host_rngs(opts.seed, plan.rounds_done, self.comm.rank if self.comm is not None else 0, 0)
        self.history = History(target_accuracy=opts.target_accuracy,
                               max_grad_norm=opts.max_grad_norm)
        self.hooks = FitHooks(self._fit_hooks())

    def _check_datasets(self) -> Any:
        """The training Dataset, after the checks that need the datasets (ValueError)."""
        plan = self.plan
        if self.options.target_accuracy is not None and self.eval_dataset is None:
            raise ValueError("target_accuracy needs an eval_dataset to measure z's accuracy on")
        train = as_dataset(self.train_dataset)
        k, b = plan.num_learners, plan.batch_size
        if isinstance(self.train_dataset, DataLoader):
            check_loader(self.train_dataset, b, stacklevel=6)  # the caller of Plan.fit
        if len(train) < k * b:
            raise ValueError(
                f"train_dataset has {len(train)} samples, fewer than one round of {k} learners × "
                f"{b} samples = {k * b}; lower the batch size or the replicas, or add data"
            )
        return train

    def _agree_on_the_fit(self) -> None:
        """Under torchrun: every rank runs the same fit (``Comm.agree``); only rank 0's progress
        bar shows."""
        opts, comm, eval_dataset = self.options, self.comm, self.eval_dataset
        self.progress = opts.progress
        if comm is None:
            return
        comm.agree({"train samples": len(self.train), "epochs": opts.epochs,
                    "shuffle": opts.shuffle, "seed": opts.seed,
                    "evals_per_epoch": opts.evals_per_epoch,
                    "target_accuracy": opts.target_accuracy,
                    "max_grad_norm": opts.max_grad_norm,
                    "checkpoint_every": opts.checkpoint_every, "resume": opts.resume,
                    "rounds done": self.plan.rounds_done,
                    "eval samples": None if eval_dataset is None else len(eval_dataset)}, "the fit")
        self.progress = opts.progress and comm.is_main

    def _check_first_batches(self) -> None:
        """The first learner's first batch of the training data and the first b samples of the
        eval_dataset, as evaluation reads them, fit the plan (``check_first_batch``)."""
        plan, b = self.plan, self.plan.batch_size
        first = self.schedule.next_round(self.schedule.order(0), 0, 1, b)
        check_first_batch(plan, self.train, self.source.host_fetch, first)
        if self.eval_dataset is not None:
            evals = eval_samples(self.eval_dataset)  # the samples evaluation scores
            check_first_batch(plan, evals, make_fetch(evals, collate_of(self.eval_dataset)),
                              torch.arange(min(b, len(evals))), what="eval_dataset")

    def _fit_hooks(self) -> list[Hook]:
        """The fit's hooks in calling order: ``first_hooks``, the metrics, the policies, the
        LR scheduler, the logger (rank 0), the checkpoints (last: they save what the others did in the round).
        Sets ``end_epoch``: the plan's epochs plus ``epochs``, or ``epochs`` when resumed."""
        opts = self.options
        hooks = list(self.first_hooks)
        if self.metrics is not None:
            hooks.append(self.metrics)
        hooks += list(opts.policies)
        if opts.lr_scheduler is not None:
            plan = self.plan
            known = not opts.resume and plan.autotuner is None and not opts.policies
            rounds = self.schedule.rounds_per_epoch(plan.num_learners, plan.batch_size) * opts.epochs
            check_lr_scheduler(plan, opts.lr_scheduler, opts.lr_scheduler_interval,
                               rounds if known else None)
            hooks.append(LRSchedulerHook(opts.lr_scheduler, opts.lr_scheduler_interval,
                                         settings=plan.settings))
        self.end_epoch = self.plan.epochs_done + opts.epochs
        _warn_if_no_outer_step(self.plan, self.schedule, opts.epochs)
        if opts.log_dir is not None and self.main:
            hooks.append(MetricsLogger(opts.log_dir))
        if opts.checkpoint_dir is not None:
            self._add_checkpoints(hooks)
        return hooks

    def _add_checkpoints(self, hooks: list[Hook]) -> None:
        """Append the CheckpointHook to ``hooks`` and resume from its newest checkpoint with
        ``options.resume`` (under torchrun every rank has one; rank 0's writes and reads the
        files and sends every rank its part, on any number of ranks)."""
        opts, plan = self.options, self.plan
        saver = CheckpointHook(opts.checkpoint_dir, self.schedule, hooks,
                               every_rounds=opts.checkpoint_every, writer=self.main)
        try:
            self.lock = saver.claim(plan, opts.resume)  # released by run
        except CheckpointError:
            if self.comm is not None:
                self.comm.close()  # the other ranks see rank 0 gone at once, not at their timeout
            raise
        if opts.resume and saver.resume(plan, self.history) is not None:
            self.end_epoch = opts.epochs  # a resumed run finishes the epochs of the run it continues
        hooks.append(saver)
        self.saver = saver

    def _sync_totals(self) -> None:
        """The fit's synchronisation seconds into the History (before after_fit, so that hooks,
        history.json, see them)."""
        sched, sync0 = self.plan.scheduler, self.fit_sync0
        self.history.sync_seconds = sched.sync_seconds - sync0[0]
        self.history.sync_exposed_seconds = sched.sync_exposed_seconds - sync0[1]
        if sched.round_graph is not None:
            self.history.cuda_graphs = sched.round_graph.record()

    def _run_epochs(self) -> None:
        """The hooks' before_fit, the epochs up to ``end_epoch`` or a stop, the hooks' after_fit."""
        self._start_fit()
        while self.plan.epochs_done < self.end_epoch:
            if self.run_epoch():
                break
        self._finish_fit()

    def _start_fit(self) -> None:
        """The FitContext, the hooks' before_fit, and what the rounds read of the hooks."""
        plan, hooks, comm, sched = self.plan, self.hooks, self.comm, self.plan.scheduler
        n = self.schedule.num_samples
        self.speculate = hooks.overlap
        self.ctx = ctx = FitContext(plan=plan, history=self.history,
                                    train_seconds=plan.train_seconds,
                                    rounds_per_epoch=n // (plan.num_learners * plan.batch_size),
                                    end_epoch=self.end_epoch, num_samples=n, metrics=self.metrics)
        hooks.before_fit(ctx)
        self.monitor, self.faults_seen = sched.faults, len(sched.faults.events)
        # rank 0's decisions are broadcast after every round's hooks, and before a round when hooks
        # ran since (epoch boundaries, evaluations) or when a hook of any rank acts in before_round
        self.pre_round = comm is not None and comm.any_rank(hooks.acts_before_rounds(), -1)
        self.decides = comm is not None and comm.any_rank(hooks.decide(), -1)

    def _finish_fit(self) -> None:
        """Every rank's last faults into the History, the sync totals, the hooks' after_fit."""
        plan, comm, sched, history = self.plan, self.comm, self.plan.scheduler, self.history
        if comm is not None:  # faults since the last sync reach every rank (one flag all-reduce)
            _share_faults(plan, comm)
        if sched.faults is self.monitor and len(sched.faults.events) > self.faults_seen:
            history.faults.extend(sched.faults.events[self.faults_seen:])  # a hook's, last round
        self._sync_totals()
        self.hooks.after_fit(self.ctx)

    # -- an epoch -----------------------------------------------------------------------------

    def run_epoch(self) -> bool:
        """One epoch (or the rest of a resumed one): its rounds, then its record and the hooks'
        after_epoch. Returns whether the fit stops (target accuracy reached, or a hook's stop)."""
        self._start_epoch()
        while self.run_round():
            pass
        self._end_epoch()
        return self.history.time_to_accuracy_s is not None or self.ctx.stop

    def _start_epoch(self) -> None:
        """The hooks' before_epoch, the epoch's order, evaluation points, progress bar and clock."""
        plan, ctx, sched = self.plan, self.ctx, self.plan.scheduler
        n = self.schedule.num_samples
        self.epoch = epoch = plan.epochs_done
        self.position = plan.position_in_epoch  # > 0 when resumed in the middle of an epoch
        self.rounds_run = plan.round_in_epoch
        ctx.epoch, ctx.round_in_epoch = epoch, self.rounds_run
        ctx.rounds_per_epoch = n // (plan.num_learners * plan.batch_size)
        self.hooks.before_epoch(ctx)
        self.agree = self.comm is not None  # after_epoch and before_epoch hooks ran
        self.order = self.schedule.order(epoch)
        self.source.start_epoch(self.order, self.position, epoch, plan.rounds_done)
        if self.position == 0:
            sched.losses = []
        self.epoch_sync0 = (sched.sync_seconds, sched.sync_exposed_seconds)
        self.epoch_seconds, self.acc, self.samples_run = 0.0, None, 0
        evals = self.options.evals_per_epoch
        self.eval_points = [n * i // evals for i in range(1, evals + 1)]
        self.next_eval = sum(1 for p in self.eval_points if p <= self.position)
        self.bar = tqdm(total=n, initial=self.position, desc=f"epoch {epoch + 1}", unit="sample",
                        unit_scale=True, disable=not self.progress, leave=False,
                        dynamic_ncols=True)
        self.start = time.perf_counter()

    def _end_epoch(self) -> None:
        """Stop the epoch's clock, count the epoch in the plan, record it, run after_epoch."""
        plan, ctx = self.plan, self.ctx
        self.epoch_seconds += time.perf_counter() - self.start
        self.bar.close()
        plan.scheduler.flush()
        ctx.epoch_complete = self.schedule.next_round(self.order, self.position, plan.num_learners,
                                                      plan.batch_size) is None
        plan.progress.end_epoch(self.epoch_seconds)
        self.record_epoch()
        ctx.train_seconds = plan.train_seconds
        self.hooks.after_epoch(ctx, self.history.epochs[-1])

    def record_epoch(self) -> None:
        """The epoch's EpochRecord into the History (one all-reduce of the loss under torchrun)."""
        plan, sched = self.plan, self.plan.scheduler
        losses = torch.stack(sched.losses) if sched.losses else torch.zeros(1)
        sync_s = sched.sync_seconds - self.epoch_sync0[0]
        exposed_s = sched.sync_exposed_seconds - self.epoch_sync0[1]
        self.history.epochs.append(EpochRecord(
            epoch=plan.epochs_done, rounds=self.rounds_run,
            train_loss=_mean_loss(self.comm, losses, plan), test_accuracy=self.acc,
            samples_per_s=self.samples_run / max(self.epoch_seconds, 1e-9),
            train_seconds=plan.train_seconds, replicas_per_device=plan.replicas_per_device,
            learner_mode=plan.learner_mode,
            sync_unhidden_share=min(1.0, exposed_s / sync_s) if sync_s > 0 else None,
            samples=self.samples_run,
        ))

    # -- a round ------------------------------------------------------------------------------

    def run_round(self) -> bool:
        """One round: the hooks' before_round, rank 0's settings (torchrun), the next k·b samples
        (k and b read from the plan now), the scheduler's round, faults, the hooks' after_round,
        an evaluation when due. Returns whether the epoch goes on."""
        plan, ctx, comm, sched = self.plan, self.ctx, self.comm, self.plan.scheduler
        self.hooks.before_round(ctx)
        if self.agree or self.pre_round:  # rank 0's decisions (m, mode, lr, α) apply to this round
            comm.agree_settings(plan, False, plan.rounds_done)
            self.agree = False
        k, b = plan.num_learners, plan.batch_size
        ctx.rounds_per_epoch = self.schedule.rounds_per_epoch(k, b)
        indices = self.schedule.next_round(self.order, self.position, k, b)
        if indices is None:
            return False
        self.position += len(indices)
        # if k and b stay, the next round's samples
        upcoming = self.schedule.next_round(self.order, self.position, k, b)
        n_losses = len(sched.losses)
        plan.progress.start_round()
        # a round whose gradients a hook reads (the noise scale) does not overlap the next
        ahead = self.speculate and not self.hooks.wants_gradients(plan.rounds_done)
        self.history.lr.append(plan.settings.lr)  # η of this round (first param group)
        sched.run_round(plan.rounds_done - 1,
                        synchronise=plan.rounds_done % plan.sync.sync_every == 0,
                        indices=_mine(plan, indices),
                        next_indices=_mine(plan, upcoming) if ahead else None)
        if comm is not None and plan.rounds_done % comm.settings.checksum_every == 0:
            sched.join()  # the checksum reads z after the round's global sync
            comm.check_z(plan.states[0].z, plan.rounds_done - 1)
        self.rounds_run += 1
        self.samples_run += len(indices)
        plan.progress.end_round(self.rounds_run, self.position)
        self.bar.update(len(indices))
        self._collect_faults()
        if self.hooks.hooks:
            self._after_round(indices, n_losses)
        ctx.stop = ctx.stop or self.stop_signal.received is not None
        if self._agreed_stop():
            self._stop_for_signal()
            return False
        if self._evaluate_if_due(last=upcoming is None):
            return False
        if self.source.copies_ahead and upcoming is not None and (plan.num_learners, plan.batch_size) == (k, b):
            sched.prefetch(plan.rounds_done, _mine(plan, upcoming))  # the next round's batch
        return True

    def _agreed_stop(self) -> bool:
        """Whether every rank stops after this round: under torchrun rank 0's settings and stop
        are agreed after every round when a hook of some rank ``decides``, else every
        ``AGREE_EVERY_ROUNDS`` rounds (a signal's stop waits for that round)."""
        plan, ctx = self.plan, self.ctx
        if self.comm is None:
            return ctx.stop
        if not self.decides and plan.rounds_done % AGREE_EVERY_ROUNDS:
            return False
        ctx.stop = self.comm.agree_settings(plan, ctx.stop, plan.rounds_done - 1)
        return ctx.stop

    def _stop_for_signal(self) -> None:
        """At a stop (agreed across ranks): if a signal (any rank's) caused it, a checkpoint of
        the state after this round (when the fit has a checkpoint_dir) and the
        TrainingInterrupted that ``run`` raises once the fit has ended."""
        signum = self.stop_signal.received
        if self.comm is not None:  # every rank is here in the same round
            signum = signal.SIGTERM if self.comm.any_rank(signum is not None,
                                                          self.plan.rounds_done - 1) else None
        if signum is None:
            return
        self.stop_signal.consumed = True
        path = self.saver.save_if_new(self.ctx) if self.saver is not None else None
        self.interrupted = interruption(self.plan, signum, path, announce=self.main)

    def _collect_faults(self) -> None:
        """The scheduler's new fault events into the History."""
        sched = self.plan.scheduler
        if sched.faults is not self.monitor:  # re-planned (replicas, batch size): a new monitor
            self.monitor, self.faults_seen = sched.faults, 0
        if len(sched.faults.events) > self.faults_seen:
            self.history.faults.extend(sched.faults.events[self.faults_seen:])
            self.faults_seen = len(sched.faults.events)
        if sched.ft is not None and len(sched.ft.membership) > len(self.history.membership):
            self.history.membership.extend(sched.ft.membership[len(self.history.membership):])

    def _after_round(self, indices: torch.Tensor, n_losses: int) -> None:
        """The round's context (indices, losses, training seconds so far) and the hooks'
        after_round."""
        plan, ctx, sched = self.plan, self.ctx, self.plan.scheduler
        ctx.round_in_epoch = self.rounds_run
        ctx.batch_indices = indices
        ctx.round_samples = len(indices)
        ctx.round_losses = sched.losses[n_losses:]
        ctx.round_loss = _finite_mean(torch.stack(sched.losses[n_losses:]))
        ctx.train_seconds = plan.train_seconds + self.epoch_seconds + time.perf_counter() - self.start
        self.hooks.after_round(ctx)

    def _evaluate_if_due(self, last: bool) -> bool:
        """Evaluate when the epoch's position passed its next evaluation point (or at its
        ``last`` round); returns whether the target accuracy is reached."""
        points = self.eval_points
        due = self.next_eval < len(points) and (self.position >= points[self.next_eval] or last)
        if not due or self.eval_dataset is None:
            return False
        while self.next_eval < len(points) and (self.position >= points[self.next_eval] or last):
            self.next_eval += 1
        return self.evaluate()

    def evaluate(self) -> bool:
        """z's accuracy and loss on the eval_dataset into the History and the hooks' after_eval,
        off the training clock. Returns whether ``target_accuracy`` is reached (and records the
        time and epochs to it)."""
        plan, history, n = self.plan, self.history, self.schedule.num_samples
        self.epoch_seconds += time.perf_counter() - self.start  # evaluation is not training time
        acc, test_loss = _evaluate(plan, self.eval_dataset, self.options.eval_batch_size,
                                   self.options.metric_fn)
        self.acc = acc
        trained = plan.train_seconds + self.epoch_seconds
        history.evals.append(EvalRecord(epoch=self.epoch + self.position / n,
                                        round=plan.rounds_done, train_seconds=trained,
                                        test_accuracy=acc, test_loss=test_loss,
                                        test_extras=dict(plan.last_eval_extras)))
        self.bar.set_postfix(acc=f"{acc:.4f}" if acc is not None else "-",
                             samples_per_s=f"{self.samples_run / self.epoch_seconds:,.0f}")
        self.ctx.train_seconds = trained
        self.hooks.after_eval(self.ctx, history.evals[-1])
        self.agree = self.comm is not None
        self.start = time.perf_counter()
        target = self.options.target_accuracy
        if target is not None and acc is not None and acc >= target:
            history.time_to_accuracy_s = trained
            history.epochs_to_accuracy = self.epoch + self.position / n
            return True
        return False


def _share_faults(plan: "Plan", comm) -> None:
    """At the fit's end: the faults found since the last global sync (τ > 1) reach every rank
    (``FaultMonitor.share``, after one all-reduce of a flag; DivergenceError as at a sync)."""
    faults, t = plan.scheduler.faults, plan.rounds_done - 1
    if comm.any_rank(bool(faults.pending), t):
        faults.share(comm, t, plan.num_learners, plan.states[0].z)


def _mine(plan: "Plan", indices: torch.Tensor | None) -> torch.Tensor | None:
    """This rank's rows of a round's indices ``[k·b]``: rank r's learners are the global learners
    r·k_r … (r+1)·k_r − 1 (k_r = k / world size); all of them in a single process."""
    comm = plan.comm
    if comm is None or indices is None:
        return indices
    per_rank = len(indices) // comm.world_size
    return indices[comm.rank * per_rank:(comm.rank + 1) * per_rank]


def _evaluate(plan: "Plan", eval_dataset: Any, batch_size: int,
              metric_fn: Callable[[Any, Any], Any] | None) -> tuple[float | None, float]:
    """z's test accuracy (or ``metric_fn``) and loss; under torchrun rank 0 evaluates and
    broadcasts them."""
    comm = plan.comm
    if comm is None:
        return plan.evaluate(eval_dataset, batch_size=batch_size, metric_fn=metric_fn)
    acc, loss = plan.evaluate(eval_dataset, batch_size=batch_size, metric_fn=metric_fn) \
        if comm.is_main else (0.0, 0.0)
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


def _warn_if_no_outer_step(plan, schedule: BatchSchedule, epochs: int) -> None:
    """The sync algorithm's warning when the fit is too short for z to move (e.g. DiLoCo: fewer
    rounds than H; ``SyncAlgorithm.short_fit_warning``)."""
    rounds = schedule.rounds_per_epoch(plan.num_learners, plan.batch_size) * epochs
    message = plan.sync.short_fit_warning(rounds, plan.rounds_done)
    if message is not None:
        warnings.warn(message, stacklevel=4)
