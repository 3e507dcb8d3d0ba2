"""The training loop of ``Plan.fit``: epochs, rounds, hooks (docs/api.md, How a fit runs;
docs/design-overview.md §2, §6)."""

from __future__ import annotations

import signal
import time
from typing import TYPE_CHECKING, Any

import torch
from tqdm.auto import tqdm

from ..engine.comm import AGREE_EVERY_ROUNDS
from ..engine.learners import seed_host_rngs
from ..engine.threads import IntraOpThreads
from ..engine.timeline import Timeline
from ..errors import DivergenceError
from .checkpoint import CheckpointHook
from .fit_data import FitData, rank_rows
from .fit_eval import FitEvaluation, finite_mean, mean_loss
from .fit_hooks import checkpoints, fit_hooks
from .history import EpochRecord, History
from .hooks import FitContext, FitHooks, Hook
from .options import FitOptions
from .run_lock import DirectoryLock
from .signals import StopSignal, interruption
from .sma_lr import SMALRRule

if TYPE_CHECKING:
    from ..api import Plan

__all__ = ["Trainer"]


class Trainer:
    """Runs ``Plan.fit``: ``Trainer(plan, train_dataset, eval_dataset, options, hooks=...,
    metrics=...).run()`` (docs/api.md, How a fit runs).

    Args:
        plan: the Plan to train.
        train_dataset: a Dataset of ``(inputs, target)`` samples, or a DataLoader.
        eval_dataset: evaluated with z ``options.evals_per_epoch`` times per epoch, or None.
        options: the fit's FitOptions (already checked).
        hooks: the hooks that run first: the plan's auto-tuner (if any), then ``options.hooks``.
        metrics: the fit's MetricsMonitor, or None.

    ``run`` raises what ``Plan.fit`` documents.
    """

    def __init__(self, plan: "Plan", train_dataset: Any, eval_dataset: Any, options: FitOptions,
                 *, hooks: list[Hook], metrics: Hook | None) -> None:
        self.plan, self.options = plan, options
        self.first_hooks, self.metrics = hooks, metrics
        self.train_dataset, self.eval_dataset = train_dataset, eval_dataset
        self.comm = plan.comm
        self.main = self.comm is None or self.comm.is_main  # rank 0 logs, checkpoints, evaluates
        self.bar: Any = None  # the epoch's tqdm bar, from the first epoch on

    # -- the fit ------------------------------------------------------------------------------

    def run(self) -> History:
        """Prepare the fit, then run its epochs (``_train``) with SIGTERM handled and the fit's
        intra-op threads set (engine/threads.py); release the checkpoint directory's lock. Returns
        the History; a signal's stop raises TrainingInterrupted, z left in the user's module."""
        self.lock: DirectoryLock | None = None
        self.saver: CheckpointHook | None = None
        self.stop_signal, self.interrupted = StopSignal(), None
        try:
            self._prepare()
            with self.stop_signal, self.threads:
                self._train()
        finally:
            if self.lock is not None:
                self.lock.release()
        if self.interrupted is not None:  # the user's module holds the last whole round's z
            self.plan.user_model.update(self.plan.central)
            raise self.interrupted
        return self.history

    def _train(self) -> None:
        """The epochs inside the scheduler's fit (worker processes); under torchrun compare z at
        the end."""
        trace, comm, sched = self.options.trace, self.comm, self.plan.scheduler
        self.timeline = Timeline() if trace is not None else None
        self.fit_sync0 = (sched.sync_seconds, sched.sync_exposed_seconds)
        source = self.data.source
        sched.begin_fit(source.fetch, seed=self.options.seed, timeline=self.timeline,
                        load=source.load,
                        max_grad_norm=self.options.max_grad_norm)
        try:
            self._run_epochs()
            if comm is not None:
                comm.check_z(self.plan.states[0].z, self.plan.rounds_done - 1)
        except BaseException as exc:
            _resume_after_divergence(exc, self.saver, self.options.checkpoint_dir)
            if self.bar is not None:
                self.bar.close()  # what reports the error writes on a line of its own
            if comm is not None:
                comm.close()  # the others see this rank gone at once instead of at their timeout
            raise
        finally:
            sched.end_fit()
            self.data.close()
            _sync_totals(self.history, self.plan.scheduler, self.fit_sync0)
            if self.timeline is not None:
                self.timeline.save(trace)

    def _prepare(self) -> None:
        """Everything before the first round: the data's checks, the ranks' agreement on the fit,
        the first batches' checks, the seeds, the hooks and a resume."""
        opts, plan, comm = self.options, self.plan, self.comm
        plan.run_record.begin_fit(plan)  # the set-up, at the plan's first fit (before a resume)
        self.data = FitData(plan, self.train_dataset, self.eval_dataset, opts)
        self.progress = opts.progress and (comm is None or comm.is_main)  # rank 0's bar only
        if comm is not None:
            self.data.agree(comm)
        self.data.open()
        self.schedule = self.data.schedule
        torch.manual_seed(opts.seed)
        # Python's and NumPy's too (a Dataset's augmentation); worker processes reseed every round
        seed_host_rngs(opts.seed, plan.rounds_done, comm.rank if comm is not None else 0, 0)
        self.threads = IntraOpThreads(opts.cpu_threads, [s.torch_device for s in plan.states],
                                      comm.local_world_size if comm is not None else 1)
        self.history = History(target_accuracy=opts.target_accuracy, max_grad_norm=opts.max_grad_norm,
                               cpu_threads=self.threads.count, free_cores=self.threads.free)
        self.evals = FitEvaluation(plan, self.eval_dataset, opts, self.history)
        self.lr_rule = SMALRRule.for_fit(plan, self.schedule.num_samples)
        hooks = fit_hooks(plan, opts, self.schedule, self.first_hooks, self.metrics, main=self.main,
                          batches_per_epoch=self.data.batches_per_epoch)
        self.end_epoch = plan.epochs_done + opts.epochs
        if opts.checkpoint_dir is not None:
            self.saver, self.lock, resumed = checkpoints(plan, opts, self.schedule, hooks,
                                                         self.history, main=self.main)
            hooks.append(self.saver)
            if resumed:  # a resumed run finishes the epochs of the run it continues (none
                # once it reached its target), with the intra-op threads it ran with
                self.end_epoch = plan.epochs_done if self.evals.reached_before() else opts.epochs
                self.history.cpu_threads = self.threads.keep(self.history.cpu_threads)
        self.hooks = FitHooks(hooks)

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
        _sync_totals(self.history, self.plan.scheduler, self.fit_sync0)
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
        self.data.source.start_epoch(self.order, self.position, epoch, plan.rounds_done)
        if self.position == 0:
            sched.losses = []
        self.epoch_sync0 = (sched.sync_seconds, sched.sync_exposed_seconds)
        self.epoch_seconds, self.samples_run = 0.0, 0
        self.acc = self.evals.start_epoch(n, self.position, plan.rounds_done - plan.round_in_epoch)
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
            train_loss=mean_loss(self.comm, losses, plan.rounds_done - 1), test_accuracy=self.acc,
            samples_per_s=self.samples_run / max(self.epoch_seconds, 1e-9),
            train_seconds=plan.train_seconds, replicas_per_device=plan.replicas_per_device,
            learner_mode=plan.learner_mode,
            sync_unhidden_share=min(1.0, exposed_s / sync_s) if sync_s > 0 else None,
            samples=self.position,  # the epoch's, also those before a resume in its middle
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
        # η of this round (first param group): SMA's η rule sets its factor (training/sma_lr.py)
        self.history.lr.append(plan.settings.optimizer.round_lr if self.lr_rule is None
                               else self.lr_rule.apply(plan, self.history))
        sched.run_round(plan.rounds_done - 1,
                        synchronise=plan.rounds_done % plan.sync.sync_every == 0,
                        indices=rank_rows(plan, indices),
                        next_indices=rank_rows(plan, upcoming) if ahead else None)
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
        stop = _agreed_stop(self.plan, self.comm, self.ctx, self.decides)
        reached = self.evals.due(self.position, last=upcoming is None) and self.evaluate()
        if self.saver is not None:  # after the round's evaluation: a resume misses none
            self.saver.save_if_due(ctx)
        if stop:
            self._stop_for_signal()
        if stop or reached:
            return False
        if self.data.source.copies_ahead and upcoming is not None and (plan.num_learners, plan.batch_size) == (k, b):
            sched.prefetch(plan.rounds_done, rank_rows(plan, upcoming))  # the next round's batch
        return True

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
        ctx.round_loss = finite_mean(torch.stack(sched.losses[n_losses:]))
        ctx.train_seconds = plan.train_seconds + self.epoch_seconds + time.perf_counter() - self.start
        self.hooks.after_round(ctx)

    def evaluate(self) -> bool:
        """z's evaluation (``FitEvaluation.measure``), off the training clock, and the hooks'
        after_eval. Returns whether ``target_accuracy`` is reached."""
        n = self.schedule.num_samples
        self.epoch_seconds += time.perf_counter() - self.start  # evaluation is not training time
        trained = self.plan.train_seconds + self.epoch_seconds
        record = self.evals.measure(self.epoch + self.position / n, trained)
        self.acc = acc = record.test_accuracy
        self.bar.set_postfix(acc=f"{acc:.4f}" if acc is not None else "-",
                             samples_per_s=f"{self.samples_run / self.epoch_seconds:,.0f}")
        self.ctx.train_seconds = trained
        self.hooks.after_eval(self.ctx, record)
        self.agree = self.comm is not None
        self.start = time.perf_counter()
        return self.evals.reached(record)


def _resume_after_divergence(exc: BaseException, saver: CheckpointHook | None,
                             directory: str | None) -> None:
    """At a DivergenceError (``exc``) of a fit with checkpoints: those after the newest healthy
    one set aside, and the message says which one a resume continues from
    (training/checkpoint_health.py)."""
    if not isinstance(exc, DivergenceError) or saver is None:
        return
    note = saver.set_aside_unhealthy()
    if note:
        exc.args = (f"{exc}. With checkpoint_dir={directory!r}: {note}",)


def _share_faults(plan: "Plan", comm) -> None:
    """At the fit's end: the faults found since the last global sync (τ > 1) reach every rank
    (``FaultMonitor.share``, after one all-reduce of a flag; DivergenceError as at a sync)."""
    faults, t = plan.scheduler.faults, plan.rounds_done - 1
    if comm.any_rank(bool(faults.pending), t):
        faults.share(comm, t, plan.num_learners, plan.states[0].z)


def _sync_totals(history: History, sched: Any, sync0: tuple[float, float]) -> None:
    """The fit's synchronisation seconds (since ``sync0``) and CUDA-graph counts into ``history``
    (before after_fit, so that hooks and history.json see them)."""
    history.sync_seconds = sched.sync_seconds - sync0[0]
    history.sync_exposed_seconds = sched.sync_exposed_seconds - sync0[1]
    if sched.round_graph is not None:
        history.cuda_graphs = sched.round_graph.record()


def _agreed_stop(plan: "Plan", comm: Any, ctx: FitContext, decides: bool) -> bool:
    """Whether every rank stops after this round: under torchrun rank 0's settings and stop are
    agreed after every round when a hook of some rank ``decides``, else every
    ``AGREE_EVERY_ROUNDS`` rounds (a signal's stop waits for that round)."""
    if comm is None:
        return ctx.stop
    if not decides and plan.rounds_done % AGREE_EVERY_ROUNDS:
        return False
    ctx.stop = comm.agree_settings(plan, ctx.stop, plan.rounds_done - 1)
    return ctx.stop
