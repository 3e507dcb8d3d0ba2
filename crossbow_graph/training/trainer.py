"""The training loop of ``Plan.fit``: epochs, rounds, hooks (docs/api.md, How a fit runs;
docs/design-overview.md §2, §6)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch
from tqdm.auto import tqdm

from ..engine.rounds.context import FitRun
from ..engine.rounds.env import RoundResult
from ..engine.rounds.timeline import Timeline
from ..errors import DivergenceError, warn_caller
from .checkpoint import CheckpointHook
from .fit_data import rank_rows
from .fit_eval import finite_mean
from .fit_state import EpochState, FitState
from .history import History
from .hooks import FitContext, Hook
from .options import FitOptions
from .rank_sync import agree_settings, agreed_stop

if TYPE_CHECKING:
    from .fit_plan import FitPlan

__all__ = ["Trainer"]


class Trainer:
    """Runs ``Plan.fit``: ``Trainer(plan, train_dataset, eval_dataset, options, hooks=...,
    metrics=...).run()`` (docs/api.md, How a fit runs).

    Args:
        plan: the plan to train (what a fit reads of it: training/fit_plan.py ``FitPlan``).
        train_dataset: a Dataset of ``(inputs, target)`` samples, or a DataLoader.
        eval_dataset: evaluated with z ``options.evals_per_epoch`` times per epoch, or None.
        options: the fit's FitOptions (already checked).
        hooks: the hooks that run first: the plan's auto-tuner (if any), then ``options.hooks``.
        metrics: the fit's MetricsMonitor, or None.

    ``run`` raises what ``Plan.fit`` documents; the fit's state is ``fit`` (``FitState``)."""

    def __init__(self, plan: FitPlan, train_dataset: Any, eval_dataset: Any, options: FitOptions,
                 *, hooks: list[Hook], metrics: Hook | None) -> None:
        self.plan, self.options = plan, options
        self.first_hooks, self.metrics = hooks, metrics
        self.train_dataset, self.eval_dataset = train_dataset, eval_dataset
        self.comm = plan.comm
        self.main = self.comm is None or self.comm.is_main  # rank 0 logs, checkpoints, evaluates
        self.fit: FitState | None = None

    # -- the fit ------------------------------------------------------------------------------

    def run(self) -> History:
        """Prepare the fit, then run its epochs (``_train``) with SIGTERM handled and the fit's
        intra-op threads set (engine/learning/threads.py); release the checkpoint directory's
        lock. Returns the History; a signal's stop raises TrainingInterrupted."""
        try:  # the fit's state is kept as soon as it holds the checkpoint directory's lock
            self.fit = FitState.prepare(self.plan, self.train_dataset, self.eval_dataset,
                                        self.options, self.first_hooks, self.metrics, main=self.main)
            if self.options.checkpoint_dir is not None:
                self.fit.add_checkpoints(self.plan, self.options, main=self.main)
            unstable = self.plan.settings.sync.stability_warning(self.plan.num_learners)
            if unstable is not None:  # the settings the fit runs with, a resume's included
                warn_caller(unstable)
            with self.fit.stop_signal, self.fit.threads:
                self._train()
        finally:
            if self.fit is not None and self.fit.lock is not None:
                self.fit.lock.release()
        if self.fit.interrupted is not None:
            raise self.fit.interrupted
        return self.fit.history

    def _train(self) -> None:
        """The hooks' before_fit, the epochs up to ``end_epoch`` or a stop and the hooks'
        after_fit, inside the engine's fit (worker processes); under torchrun compare z at the
        end."""
        fit, comm, rounds = self.fit, self.comm, self.plan.rounds
        fit.timeline = Timeline() if self.options.trace is not None else None
        fit.sync0 = (rounds.clock.sync_s, rounds.clock.exposed_s)
        source = fit.data.source
        rounds.begin_fit(FitRun(source.fetch, source.load, self.options.seed,
                                self.options.max_grad_norm, fit.timeline))
        try:
            self._start_fit()
            while self.plan.progress.epochs_done < fit.end_epoch and not self.run_epoch():
                pass
            self._finish_fit()
            if comm is not None:
                comm.check_z(self.plan.states[0].z, self.plan.progress.rounds_done - 1)
        except BaseException as exc:
            _resume_after_divergence(exc, fit.saver, self.options.checkpoint_dir)
            if fit.epoch is not None:
                fit.epoch.bar.close()  # what reports the error writes on a line of its own
            if comm is not None:
                comm.close()  # the others see this rank gone at once instead of at their timeout
            raise
        finally:
            rounds.end_fit()
            fit.data.close()
            self.fit.sync_totals(self.plan.rounds)
            if fit.timeline is not None:
                fit.timeline.save(self.options.trace)

    def _start_fit(self) -> None:
        """The FitContext, the hooks' before_fit, and what the rounds read of the hooks."""
        plan, fit, comm = self.plan, self.fit, self.comm
        n = fit.schedule.num_samples
        fit.speculate = fit.hooks.overlap
        fit.ctx = FitContext(plan=plan, history=fit.history, train_seconds=plan.progress.train_seconds,
                             rounds_per_epoch=n // (plan.num_learners * plan.settings.batch_size),
                             end_epoch=fit.end_epoch, num_samples=n, metrics=self.metrics)
        fit.hooks.before_fit(fit.ctx)
        plan.rounds.collect()  # the faults found before the fit's rounds are not the fit's
        # rank 0's decisions are broadcast after every round's hooks, and before a round when hooks
        # ran since (epoch boundaries, evaluations) or when a hook of any rank acts in before_round
        fit.pre_round = comm is not None and comm.any_rank(fit.hooks.acts_before_rounds(), -1)
        fit.decides = comm is not None and comm.any_rank(fit.hooks.decide(), -1)

    def _finish_fit(self) -> None:
        """Every rank's last faults into the History, the sync totals, the hooks' after_fit."""
        plan, comm = self.plan, self.comm
        if comm is not None:  # faults since the last sync reach every rank (one flag all-reduce)
            plan.rounds.share_last_faults(plan.progress.rounds_done - 1)
        self.fit.record(RoundResult([], *plan.rounds.collect()))  # a hook's, last round
        self.fit.sync_totals(self.plan.rounds)
        self.fit.hooks.after_fit(self.fit.ctx)

    # -- an epoch -----------------------------------------------------------------------------

    def run_epoch(self) -> bool:
        """One epoch (or the rest of a resumed one): its rounds, then its record and the hooks'
        after_epoch. Returns whether the fit stops (target accuracy reached, or a hook's stop)."""
        self._start_epoch()
        while self.run_round():
            pass
        self._end_epoch()
        return self.fit.history.target_reached or self.fit.ctx.stop

    def _start_epoch(self) -> None:
        """The hooks' before_epoch, the epoch's order, evaluation points, progress bar and clock."""
        plan, fit = self.plan, self.fit
        progress, ctx, n = plan.progress, fit.ctx, fit.schedule.num_samples
        ctx.epoch, ctx.round_in_epoch = progress.epochs_done, progress.round_in_epoch
        ctx.rounds_per_epoch = n // (plan.num_learners * plan.settings.batch_size)
        fit.hooks.before_epoch(ctx)
        epoch, position = progress.epochs_done, progress.position_in_epoch  # > 0: resumed in it
        order = fit.schedule.order(epoch)
        fit.data.source.start_epoch(order, position, epoch, progress.rounds_done)
        progress.start_epoch()
        acc = fit.evals.start_epoch(n, position, progress.rounds_done - progress.round_in_epoch)
        bar = tqdm(total=n, initial=position, desc=f"epoch {epoch + 1}", unit="sample",
                   unit_scale=True, disable=not (self.options.progress and self.main),
                   leave=False, dynamic_ncols=True)
        clock = plan.rounds.clock
        fit.epoch = EpochState(epoch, order, position, progress.round_in_epoch,
                               (clock.sync_s, clock.exposed_s), acc, bar, time.perf_counter(),
                               agree=self.comm is not None)  # after_epoch and before_epoch ran

    def _end_epoch(self) -> None:
        """Stop the epoch's clock, count the epoch in the plan, record it, run after_epoch."""
        plan, fit, e = self.plan, self.fit, self.fit.epoch
        e.seconds += time.perf_counter() - e.start
        e.bar.close()
        plan.rounds.flush()
        fit.ctx.epoch_complete = fit.schedule.next_round(
            e.order, e.position, plan.num_learners, plan.settings.batch_size) is None
        plan.progress.end_epoch(e.seconds)
        fit.history.epochs.append(e.record(plan, self.comm, fit.history))
        fit.ctx.train_seconds = plan.progress.train_seconds
        fit.hooks.after_epoch(fit.ctx, fit.history.epochs[-1])

    # -- a round ------------------------------------------------------------------------------

    def run_round(self) -> bool:
        """One round: the hooks' before_round, rank 0's settings (torchrun), the next k·b samples
        (k and b read from the run settings once), the engine's round and its result, the hooks'
        after_round, an evaluation when due. Returns whether the epoch goes on."""
        plan, fit, e = self.plan, self.fit, self.fit.epoch
        fit.hooks.before_round(fit.ctx)
        if e.agree or fit.pre_round:  # rank 0's decisions (m, mode, lr, α) apply to this round
            agree_settings(self.comm, plan, False, plan.progress.rounds_done)
            e.agree = False
        k, b = plan.num_learners, plan.settings.batch_size
        fit.ctx.rounds_per_epoch = fit.schedule.rounds_per_epoch(k, b)
        indices = fit.schedule.next_round(e.order, e.position, k, b)
        if indices is None:
            return False
        e.position += len(indices)
        upcoming = fit.schedule.next_round(e.order, e.position, k, b)  # if k and b stay
        result = self._learn_round(indices, upcoming)
        self._after_round(indices, result)
        fit.ctx.stop = fit.ctx.stop or fit.stop_signal.received is not None
        stop = agreed_stop(plan, self.comm, fit.ctx, fit.decides)
        reached = fit.evals.due(e.position, last=upcoming is None) and self.evaluate()
        if fit.saver is not None:  # after the round's evaluation: a resume misses none
            fit.saver.save_if_due(fit.ctx)
        if stop:
            fit.stop_for_signal(plan, self.comm, announce=self.main)
        if stop or reached:
            return False
        if fit.data.source.copies_ahead and upcoming is not None and \
                (plan.num_learners, plan.settings.batch_size) == (k, b):
            plan.rounds.prefetch(plan.progress.rounds_done, rank_rows(plan, upcoming), b)
        return True

    def _learn_round(self, indices: torch.Tensor, upcoming: torch.Tensor | None) -> RoundResult:
        """The engine's round on ``indices`` (``upcoming``: the next round's, learned ahead where
        it may be), the torchrun checksum of z when due, the round's progress and record."""
        plan, fit, e, comm = self.plan, self.fit, self.fit.epoch, self.comm
        plan.progress.start_round()
        # η of this round (first param group): SMA's η rule sets its factor (training/sma_lr.py)
        fit.history.lr.append(plan.settings.optimizer.round_lr if fit.lr_rule is None
                              else fit.lr_rule.apply(plan, fit.history))
        t = plan.progress.rounds_done - 1
        # a round whose gradients a hook reads (the noise scale) does not overlap the next
        ahead = fit.speculate and not fit.hooks.wants_gradients(plan.progress.rounds_done)
        result = plan.rounds.run_round(
            t, synchronise=plan.progress.rounds_done % plan.settings.sync_every == 0,
            indices=rank_rows(plan, indices),
            next_indices=rank_rows(plan, upcoming) if ahead else None)
        if comm is not None and plan.progress.rounds_done % comm.settings.checksum_every == 0:
            plan.rounds.join()  # the checksum reads z after the round's global sync
            comm.check_z(plan.states[0].z, t)
        e.rounds_run += 1
        e.samples += len(indices)
        plan.progress.end_round(e.rounds_run, e.position, result.losses)
        e.bar.update(len(indices))
        self.fit.record(result)
        return result

    def _after_round(self, indices: torch.Tensor, result: RoundResult) -> None:
        """The round's context (indices, losses, training seconds so far) and the hooks'
        after_round."""
        fit, e = self.fit, self.fit.epoch
        if not fit.hooks.hooks:
            return
        ctx = fit.ctx
        ctx.round_in_epoch = e.rounds_run
        ctx.batch_indices = indices
        ctx.round_samples = len(indices)
        ctx.round_losses = result.losses
        ctx.round_loss = finite_mean(torch.stack(result.losses))
        ctx.train_seconds = self.plan.progress.train_seconds + e.seconds + time.perf_counter() - e.start
        fit.hooks.after_round(ctx)

    def evaluate(self) -> bool:
        """z's evaluation (``FitEvaluation.measure``), off the training clock, and the hooks'
        after_eval. Returns whether ``target_accuracy`` or ``target_loss`` is reached."""
        fit, e = self.fit, self.fit.epoch
        n = fit.schedule.num_samples
        e.seconds += time.perf_counter() - e.start  # evaluation is not training time
        trained = self.plan.progress.train_seconds + e.seconds
        record = fit.evals.measure(e.epoch + e.position / n, trained, e.position)
        e.acc = acc = record.test_accuracy
        e.bar.set_postfix(acc=f"{acc:.4f}" if acc is not None else "-",
                          samples_per_s=f"{e.samples / e.seconds:,.0f}")
        fit.ctx.train_seconds = trained
        fit.hooks.after_eval(fit.ctx, record)
        e.agree = self.comm is not None
        e.start = time.perf_counter()
        return fit.evals.reached(record)


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
