"""A fit's state, one dataclass (``FitState``), made before its first round
(``FitState.prepare``), with the epoch being run (``EpochState``) (docs/api.md, How a fit runs)."""

from __future__ import annotations

import signal
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ..engine.learning.learners import seed_host_rngs
from ..engine.learning.threads import IntraOpThreads
from ..engine.rounds.env import RoundResult
from ..engine.rounds.timeline import Timeline
from ..errors import TrainingInterrupted
from .checkpoint import CheckpointHook
from .data import BatchSchedule
from .fit_data import FitData, tokens_per_sample
from .fit_eval import FitEvaluation, mean_loss
from .fit_hooks import checkpoints, fit_hooks
from .history import EpochRecord, History
from .hooks import FitContext, FitHooks, Hook
from .options import FitOptions
from .run_lock import DirectoryLock
from .run_setup import run_setup
from .signals import StopSignal, interruption
from .sma_lr import SMALRRule

if TYPE_CHECKING:
    from ..engine.rounds.runner import RoundRunner
    from .fit_plan import FitPlan

__all__ = ["FitState", "EpochState"]


@dataclass(eq=False)
class EpochState:
    """One epoch of a fit (or the rest of one after a resume).

    Attributes:
        epoch: its index over the plan's life; order: its sample order.
        position: samples of the order used; rounds_run: its rounds done.
        sync0: the synchronisation clock (seconds, exposed seconds) at its start.
        acc: z's accuracy at its last evaluation (None: none yet).
        bar: its progress bar; start: ``perf_counter`` when its clock last (re)started.
        seconds: its training seconds so far; samples: the samples this fit trained in it.
        agree: under torchrun, rank 0's settings are agreed before the next round (hooks ran)."""

    epoch: int
    order: torch.Tensor
    position: int
    rounds_run: int
    sync0: tuple[float, float]
    acc: float | None
    bar: Any
    start: float
    seconds: float = 0.0
    samples: int = 0
    agree: bool = False

    def record(self, plan: FitPlan, comm: Any, history: History) -> EpochRecord:
        """The epoch's EpochRecord, once it ended (one all-reduce of the loss under torchrun);
        its tokens/s from ``history``'s tokens per sample."""
        clock, losses = plan.rounds.clock, plan.progress.losses
        losses = torch.stack(losses) if losses else torch.zeros(1)
        sync_s, exposed_s = clock.sync_s - self.sync0[0], clock.exposed_s - self.sync0[1]
        rate = self.samples / max(self.seconds, 1e-9)
        return EpochRecord(
            epoch=plan.progress.epochs_done, rounds=self.rounds_run,
            train_loss=mean_loss(comm, losses, plan.progress.rounds_done - 1),
            test_accuracy=self.acc, samples_per_s=rate, tokens_per_s=history.per_token(rate),
            train_seconds=plan.progress.train_seconds,
            replicas_per_device=plan.settings.replicas_per_device,
            learner_mode=plan.settings.learner_mode,
            sync_unhidden_share=min(1.0, exposed_s / sync_s) if sync_s > 0 else None,
            samples=self.position)  # the epoch's, also those before a resume in its middle


@dataclass(eq=False)
class FitState:
    """One fit's state, from ``Trainer.run``'s preparation to its end.

    Attributes:
        data: the training and evaluation data (``FitData``); schedule: the epochs' order.
        threads: the fit's intra-op threads; history: the History being filled.
        evals: the evaluations of z; hooks: the fit's hooks in calling order.
        end_epoch: the epoch the fit ends before; stop_signal: SIGTERM's handling.
        saver, lock: the checkpoints and the directory's lock (None without a checkpoint_dir).
        interrupted: the TrainingInterrupted a signal's stop raises once the fit has ended.
        timeline: the fit's Timeline (``trace=``), or None; sync0: the clock at its start.
        ctx: the hooks' FitContext; speculate: rounds may be learned ahead (no hook mutates
            the replicas); pre_round, decides: under torchrun, rank 0's settings are agreed
            before every round (a hook acts in before_round) and after every round (a hook
            decides).
        epoch: the epoch being run.
        lr_rule: SMA's η rule (training/sma_lr.py), None where the sync algorithm has none."""

    data: FitData
    schedule: BatchSchedule
    threads: IntraOpThreads
    history: History
    evals: FitEvaluation
    hooks: FitHooks
    end_epoch: int
    stop_signal: StopSignal
    saver: CheckpointHook | None = None
    lock: DirectoryLock | None = None
    interrupted: TrainingInterrupted | None = None
    timeline: Timeline | None = None
    sync0: tuple[float, float] = (0.0, 0.0)
    ctx: FitContext | None = None
    speculate: bool = False
    pre_round: bool = False
    decides: bool = False
    epoch: EpochState | None = None
    lr_rule: SMALRRule | None = None

    @classmethod
    def prepare(cls, plan: FitPlan, train_dataset: Any, eval_dataset: Any, options: FitOptions,
                first: list[Hook], metrics: Hook | None, *, main: bool) -> "FitState":
        """Everything before the first round but the checkpoints: the set-up's record, the data's
        checks, the ranks' agreement on the fit, the first batches' checks, the seeds, the
        threads, the History and the hooks (``first``: the auto-tuner and the user's)."""
        comm = plan.comm
        plan.run_record.begin_fit(lambda: run_setup(plan))  # at the first fit, before a resume
        data = FitData(plan, train_dataset, eval_dataset, options)
        if comm is not None:
            data.agree(comm)
        data.open()
        torch.manual_seed(options.seed)
        # Python's and NumPy's too (a Dataset's augmentation); worker processes reseed every round
        seed_host_rngs(options.seed, plan.progress.rounds_done, comm.rank if comm is not None else 0, 0)
        threads = IntraOpThreads(options.cpu_threads, [s.torch_device for s in plan.states],
                                 comm.local_world_size if comm is not None else 1)
        history = History(target_accuracy=options.target_accuracy,
                          max_grad_norm=options.max_grad_norm, cpu_threads=threads.count,
                          free_cores=threads.free, target_loss=options.target_loss,
                          tokens_per_sample=tokens_per_sample(train_dataset))
        evals = FitEvaluation(plan, eval_dataset, options, history)
        hooks = fit_hooks(plan, options, data.schedule, first, metrics, main=main,
                          batches_per_epoch=data.batches_per_epoch)
        return cls(data, data.schedule, threads, history, evals, FitHooks(hooks),
                   plan.progress.epochs_done + options.epochs, StopSignal(),
                   lr_rule=SMALRRule.for_fit(plan, data.schedule.num_samples))

    def add_checkpoints(self, plan: FitPlan, options: FitOptions, *, main: bool) -> None:
        """The checkpoints, after every other hook; with ``resume`` the newest checkpoint
        restored, and the epochs of the run it continues (none once it reached its target) run
        with the intra-op threads it ran with."""
        hooks = self.hooks.hooks
        self.saver, self.lock, resumed = checkpoints(plan, options, self.schedule, hooks,
                                                     self.history, main=main)
        hooks.append(self.saver)
        if resumed:
            self.end_epoch = (plan.progress.epochs_done if self.evals.reached_before()
                              else options.epochs)
            self.history.cpu_threads = self.threads.keep(self.history.cpu_threads)

    def record(self, result: RoundResult) -> None:
        """A round's fault events and membership changes into the History."""
        self.history.faults.extend(result.faults)
        self.history.membership.extend(result.membership)

    def sync_totals(self, rounds: RoundRunner) -> None:
        """The fit's synchronisation seconds and CUDA-graph counts into the History (before
        after_fit, so that hooks and history.json see them)."""
        self.history.sync_seconds = rounds.clock.sync_s - self.sync0[0]
        self.history.sync_exposed_seconds = rounds.clock.exposed_s - self.sync0[1]
        record = rounds.graph_record()
        if record is not None:
            self.history.cuda_graphs = record

    def stop_for_signal(self, plan: FitPlan, comm: Any, *, announce: bool) -> None:
        """At a stop (agreed across ranks): if a signal (any rank's) caused it, a checkpoint of
        the state after this round (when the fit has a checkpoint_dir) and the
        TrainingInterrupted that ``Trainer.run`` raises once the fit has ended."""
        signum = self.stop_signal.received
        if comm is not None:  # every rank is here in the same round
            signum = signal.SIGTERM if comm.any_rank(
                signum is not None, plan.progress.rounds_done - 1) else None
        if signum is None:
            return
        self.stop_signal.consumed = True
        path = self.saver.save_if_new(self.ctx) if self.saver is not None else None
        self.interrupted = interruption(plan, signum, path, announce=announce)
