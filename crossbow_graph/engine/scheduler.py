"""Runs a plan's task graph round after round: the run settings read once per round into the
round's ``RoundEnv``, the round run by the backend chosen for it, its ``RoundResult`` handed back
(docs/runtime.md, "Backends"; docs/design-overview.md §1, §2, §5)."""

from __future__ import annotations

import copy
from typing import Any

import networkx as nx
import torch

from ..kernels.protocol import SMAKernels
from ..kernels.torch_ref import TorchSMAKernels
from .backends.process.conv_choice import CpuConv
from .executors import Executor, Executors
from .learning.faults import FaultEvent, FaultMonitor
from .learning.fused import FusedProgram
from .rounds.context import FitRun, RunContext, SyncClock
from .rounds.env import RoundEnv, RoundResult
from .settings import RunSettings
from .state.flat import DeviceState
from .sync.base import SyncContext, SyncState
from .transport.host import TransportHost
from .transport.transports import InProcess, Transport

__all__ = ["Scheduler"]


class Scheduler:
    """Runs a plan's rounds (this module's docstring): what a fit uses of the engine.

    Args:
        task_graph: the plan's task graph (one round).
        states: one DeviceState per device, in the plan's device order.
        loss_fn: ``loss_fn(output, target) -> scalar tensor``.
        settings: the plan's RunSettings (engine/settings.py): read once per round.
        executor: ``"auto"``, ``"inline"`` or ``"process"`` (docs/runtime.md, "Executors").
        kernels: the SMA update backend (None: torch's).
        transport: how the global sync's sums cross devices and processes (None: this process's).
        comm, round_graph: torchrun's ``Comm``, a ``RoundGraph`` (CUDA-graph rounds); or None.
        cpu_conv: the worker processes' convolutions: ``"auto"``, ``"onednn"`` or ``"aten"``.

    Attributes:
        ctx: what every backend shares (``RunContext``); executors: the backends and the choice
            between them; max_divergence: the fault test's threshold (None: off).

    Raises:
        ValueError: an unknown ``executor``, or ``"process"`` with a CUDA device; TypeError or
            ValueError: the sync algorithm cannot bind these states."""

    def __init__(self, task_graph: nx.DiGraph, states: list[DeviceState], loss_fn: Any,
                 settings: RunSettings, *, executor: Executor = "auto",
                 kernels: SMAKernels | None = None, transport: Transport | None = None,
                 comm: Any = None, cpu_conv: CpuConv = "auto", round_graph: Any = None) -> None:
        self.settings = settings
        transport = transport or InProcess(shared_memory=all(s.torch_device.type == "cpu"
                                                             for s in states))
        sync_state: SyncState = settings.sync.bind(states)  # raises TypeError, ValueError
        sync = SyncContext(states, kernels or TorchSMAKernels(), settings.optimizer, transport,
                           sync_state)
        self.ctx = ctx = RunContext(states, loss_fn, [FusedProgram(_structure(s), loss_fn)
                                                      for s in states], sync, comm, cpu_conv)
        transport.attach(TransportHost(
            states, loss_fn, sync_state, describe_sync=lambda: self.settings.sync.describe(sync_state),
            pending_faults=lambda: len(ctx.faults.pending)))
        self.executors = Executors(ctx, executor, round_graph)  # raises ValueError
        self.max_divergence: float | None = None
        self._changes_seen = 0  # membership changes handed out
        self.set_task_graph(task_graph)

    # -- what the plan shares with its rounds --------------------------------------------------

    @property
    def states(self) -> list[DeviceState]:
        return self.ctx.states

    @property
    def kernels(self) -> SMAKernels:
        """The SMA update kernels' backend (kernels/select.py)."""
        return self.ctx.sync.kernels

    @property
    def transport(self) -> Transport:
        """How the global sync's sums cross devices and processes (chosen when the plan is built)."""
        return self.ctx.sync.transport

    @property
    def sync_state(self) -> SyncState:
        """The sync algorithm's runtime state (``SyncAlgorithm.bind``: DiLoCo's outer optimizer)."""
        return self.ctx.sync.state

    @property
    def faults(self) -> FaultMonitor:
        return self.ctx.faults

    @property
    def clock(self) -> SyncClock:
        """The synchronisation seconds so far and the rounds learned ahead."""
        return self.ctx.clock

    @property
    def fault_masks(self) -> list[torch.Tensor | None]:
        """Per device, its last local sync's fault mask on the device (CUDA streams), or None."""
        return self.ctx.fault_masks

    @property
    def num_learners(self) -> int:
        """k, learners of every process (every rank has the same m per device)."""
        return self.ctx.num_learners

    # -- configuration ------------------------------------------------------------------------

    def set_task_graph(self, task_graph: nx.DiGraph) -> None:
        """Adopt a (re-compiled) task graph; the states must already have its replica counts.

        Raises:
            PlanError: a graph the backends cannot run (``RoundProgram.of`` names the task)."""
        self.executors.process.close()
        self.task_graph = task_graph
        self.ctx.adopt(task_graph)  # raises PlanError
        self.executors.replan()

    def resolved_executor(self) -> str:
        """The executor that runs the next round: ``"inline"`` or ``"process"``."""
        return self.executors.resolved(self.settings.sync)

    def graph_record(self) -> dict[str, Any] | None:
        """The CUDA-graph rounds so far (``RoundGraph.record``), or None without them."""
        graph = self.executors.round_graph
        return graph.record() if graph is not None else None

    # -- fit boundaries -----------------------------------------------------------------------

    def begin_fit(self, fit: FitRun) -> None:
        """Prepare a fit: its data functions, seed, clipping and timeline (``FitRun``)."""
        self.ctx.fit = fit

    def end_fit(self) -> None:
        """Finish the work in flight and stop any worker processes."""
        try:
            for backend in self.executors.made:
                backend.finish()
        finally:
            self.close_workers()
            self.ctx.batch_ahead.drop()

    def flush(self) -> None:
        """Complete the work in flight: z, zbuf and the replicas reflect every round so far on
        the host too, and the faults of those rounds are recorded."""
        for backend in self.executors.made:
            backend.flush()

    def join(self) -> None:
        """Order the caller's default stream after every stream's work so far, without a host
        wait (docs/runtime.md, "Streams on CUDA"); nothing without streams."""
        for backend in self.executors.made:
            backend.join()

    def close_workers(self) -> None:
        """Stop the worker processes (cancelling a speculative round); the next round restarts them."""
        self.executors.process.close()

    @property
    def learning_ahead(self) -> bool:
        """Whether worker processes learn the next round now (a speculative round in flight)."""
        return self.executors.process.learning_ahead

    def reset_replicas(self, rows: list[list[int]], *, round_index: int | None = None) -> None:
        """Put the replicas ``rows`` (per device) at z between rounds; with ``round_index`` each
        is a FaultEvent of that round."""
        self.flush()
        self.close_workers()
        for state, r in zip(self.states, rows):
            FaultMonitor.reset(state, r)
            if round_index is not None:
                self.faults.record(state, r, round_index=round_index, num_learners=self.num_learners)

    def set_max_divergence(self, value: float | None) -> None:
        """Set ``max_divergence`` (None: off) from the next round on; worker processes restart."""
        self.close_workers()  # forked workers read the threshold when they start
        self.max_divergence = value

    # -- rounds ---------------------------------------------------------------------------------

    def run_round(self, round_index: int, batch: Any = None, *, synchronise: bool,
                  indices: torch.Tensor | None = None,
                  next_indices: torch.Tensor | None = None) -> RoundResult:
        """Run every task of one round and return its result.

        Args:
            round_index: the global round number t.
            batch: the round's collated samples, ``k·b`` along dimension 0 (learner j's at
                ``[j·b, (j+1)·b)``), or a ``LearnerBatches``; or None with ``indices``.
            synchronise: whether this round ends with a synchronisation.
            indices: the round's sample indices ``[k·b]`` (fetched or loaded by the fit).
            next_indices: the next round's indices when nothing writes the replicas between the
                rounds (the process backend learns it ahead); else None.

        Raises:
            TaskError: a task failed (names the task, its device and the round)."""
        env = self.round_env(round_index, batch, synchronise)
        backend = self.executors.choose(env.sync, indices_only=indices is not None and batch is None)
        backend.run_round(env, indices, next_indices)
        self.settings.mark_stepped()
        return RoundResult(env.learned, *self.collect())

    def round_env(self, round_index: int, batch: Any, synchronise: bool) -> RoundEnv:
        """Round ``round_index``'s environment: k, b, the learner mode, the sync algorithm and the
        hyper-parameters in force, read once from the run settings (``RunSettings.hyper``: α for
        the learners the transport says the round averages)."""
        s, k = self.settings, self.num_learners
        return RoundEnv(round_index, batch, synchronise, k, s.batch_size, s.learner_mode, s.sync,
                        s.hyper(self.transport.live_learners(k)), self.max_divergence)

    def collect(self) -> tuple[list[FaultEvent], list[Any]]:
        """The fault events and membership changes found since the last result (a flush between
        rounds may find a round's late faults)."""
        changes = self.transport.membership
        new, self._changes_seen = changes[self._changes_seen:], len(changes)
        return self.faults.take_new(), new

    def share_last_faults(self, round_index: int) -> None:
        """Under torchrun, at a fit's end: the faults found since the last global sync (τ > 1)
        reach every rank (``FaultMonitor.share``, after one all-reduce of a flag;
        DivergenceError as at a sync)."""
        comm, faults = self.ctx.comm, self.faults
        if comm.any_rank(bool(faults.pending), round_index):
            faults.share(comm, round_index, self.num_learners, self.states[0].z)

    def prefetch(self, round_index: int, indices: torch.Tensor, b: int) -> None:
        """Load round ``round_index``'s batch of ``indices [k·b]`` (b per learner) now and copy it
        to the devices ahead (the streams backend only; ``RunContext.batch_ahead``)."""
        if self.resolved_executor() == "inline":
            self.executors.inline.prefetch(round_index, indices, b)

    # -- what a checkpoint keeps ----------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The runs' records a resume continues: the fault events of the plan's task graph, the
        transport's membership (torchft) and the measured convolution libraries per b."""
        return {"faults": list(self.faults.events), "fault_tolerance": self.transport.state_dict(),
                "cpu_conv_choices": dict(self.ctx.onednn_choices)}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """Restore ``state_dict()`` (the events as reported already)."""
        self.faults.restore(saved["faults"])
        self.transport.load_state_dict(saved.get("fault_tolerance"))
        self._changes_seen = len(self.transport.membership)
        self.ctx.onednn_choices.update(saved.get("cpu_conv_choices", {}))


def _structure(state: DeviceState):
    return copy.deepcopy(state.template).to(state.torch_device).train()
