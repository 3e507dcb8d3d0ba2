"""Runs a plan's task graph round after round through one of the execution backends
(docs/runtime.md, "Backends"; docs/design-overview.md §1, §2, §5)."""

from __future__ import annotations

import copy
from typing import Any, Callable, Literal, get_args

import networkx as nx
import torch

from ..compiler.tasks import Task, TaskKind
from ..kernels.protocol import SMAKernels
from ..kernels.torch_ref import TorchSMAKernels
from .backend import Backend
from .conv_choice import CpuConv
from .faults import FaultMonitor
from .fused import FusedProgram
from .graphs import GraphBackend
from .inline import InlineBackend
from .interpreter import RoundProgram
from .local_update import all_reduce_sums, local_update_rows
from .optim import LocalOptimizer
from .prefetch import BatchPrefetch
from .settings import RunSettings, settings_view
from .state import DeviceState
from .stream_backend import StreamsBackend
from .streams import CUDA_OPS, CudaStreams
from .sync.base import SyncState
from .workers import ProcessBackend, available_cores, fork_available

__all__ = ["Scheduler", "Executor", "EXECUTORS"]

Executor = Literal["auto", "inline", "process"]
EXECUTORS = get_args(Executor)


class Scheduler:
    """Runs rounds over the devices' replicas through a backend (engine/backend.py); what every
    backend shares lives here, and it is the sync algorithms' ``SyncContext``.

    Args:
        task_graph: the plan's task graph (one round).
        states: one DeviceState per device, in the plan's device order.
        loss_fn: ``loss_fn(output, target) -> scalar tensor``.
        settings: the plan's RunSettings (engine/settings.py).
        executor: ``"auto"``, ``"inline"`` or ``"process"`` (docs/runtime.md, "Executors").
        kernels: the SMA update backend (None: torch's); comm: torchrun's ``Comm`` or None.
        ft: under ``Distributed(fault_tolerant=True)``, the group's ``engine.ft.FaultTolerantSync``.
        cpu_conv: the worker processes' convolutions: ``"auto"``, ``"onednn"`` or ``"aten"``.
        round_graph: a ``graphs.RoundGraph`` (CUDA-graph rounds), or None.

    Raises:
        ValueError: an unknown ``executor``, or ``"process"`` with a CUDA device; TypeError or
            ValueError: the sync algorithm cannot bind these states.

    Attributes: docs/runtime.md, "Backends".
    """

    lr = settings_view("lr", "η in force (read-only: ``settings.lr``).")
    batch_size = settings_view("batch_size", "b in force (read-only: ``settings.batch_size``).")
    learner_mode = settings_view("learner_mode", "The learner mode in force (read-only).")
    optimizer = settings_view("optimizer", "The local optimiser, its groups' settings in force "
                              "(read-only; engine/optim.py LocalOptimizer).")
    sync = settings_view("sync", "The sync algorithm, its α, τ (H) in force (read-only; "
                         "engine/sync/).")

    def __init__(self, task_graph: nx.DiGraph, states: list[DeviceState], loss_fn: Callable,
                 settings: RunSettings, *, executor: Executor = "auto",
                 kernels: SMAKernels | None = None, comm: Any = None, cpu_conv: CpuConv = "auto",
                 round_graph: Any = None, ft: Any = None) -> None:
        if executor not in EXECUTORS:
            raise ValueError(f"executor={executor!r}: use one of {EXECUTORS}")
        if executor == "process" and any(s.torch_device.type != "cpu" for s in states):
            raise ValueError("executor='process' runs CPU devices only; use 'inline' (CUDA streams) "
                             "or 'auto' for CUDA devices")
        self.settings = settings
        self.kernels: SMAKernels = kernels if kernels is not None else TorchSMAKernels()
        self.states, self.loss_fn, self.executor, self.comm = states, loss_fn, executor, comm
        self.ft = ft  # the global sync spans torchft's live groups
        self.max_divergence: float | None = None
        self.max_grad_norm: float | None = None
        self.losses: list[torch.Tensor] = []
        self.sync_seconds = self.sync_exposed_seconds = 0.0
        self.rounds_learned_ahead = self.seed = self.round_index = 0
        self.timeline = None
        self.fetch_fn: Callable | None = None  # begin_fit's fetch and load
        self.load_fn: Callable | None = None
        self.fused_programs = [FusedProgram(_clone_structure(s), loss_fn, settings) for s in states]
        self.batch_ahead = BatchPrefetch()
        self.fault_masks: list[torch.Tensor | None] = [None] * len(states)
        self._resolved: tuple[int, str] | None = None  # (k, executor) cache
        self.cpu_conv = cpu_conv
        self.onednn_choices: dict[int, bool] = {}  # b → oneDNN or not (conv_choice.choose_onednn)
        self.sync_state: SyncState = settings.sync.bind(states)  # raises TypeError, ValueError
        self._stream_ops: Any = None
        self._round_graph = round_graph
        self.process = ProcessBackend(self)
        self._inline: InlineBackend | None = None
        self.backend: Backend = self.process  # the backend of the round being run (or last run)
        self.set_task_graph(task_graph)

    # -- configuration ------------------------------------------------------------------------

    def set_task_graph(self, task_graph: nx.DiGraph) -> None:
        """Adopt a (re-compiled) task graph; the states must already have its replica counts.

        Raises:
            PlanError: a graph the backends cannot run (``RoundProgram.of`` names the task).
        """
        self.close_workers()
        self.task_graph = task_graph
        self.program = RoundProgram.of(task_graph, [s.name for s in self.states],
                                       [s.m for s in self.states])  # raises PlanError
        self.order: list[Task] = list(self.program.tasks)
        self.fused_runs: dict[str, tuple[int, int]] = {}  # fused learners: lead task → rows
        for d in range(len(self.states)):
            self.fused_runs.update(self.program.learn_runs(
                [t for t in self.order if t.kind is TaskKind.LEARN and self.program.device[t.id] == d]))
        pending = self.faults.pending if hasattr(self, "faults") else []
        self.faults = FaultMonitor()  # NaN/Inf replicas: reset from z, left out of the sum
        self.faults.pending = pending  # torchrun: this rank's faults not yet shared go on
        if self._inline is not None:
            self._inline.close()  # the new graph's streams start after the old ones' work
        self.batch_ahead.drop()  # split for the old graph's devices and rows
        if self._round_graph is not None:
            self._round_graph.clear()  # other tasks, other buffers: new graphs

    @property
    def stream_ops(self) -> Any:
        """The streams' ``StreamOps`` (None: torch.cuda on CUDA devices); setting it re-chooses."""
        return self._stream_ops

    @stream_ops.setter
    def stream_ops(self, ops: Any) -> None:
        self._stream_ops = ops
        self._drop_inline()

    @property
    def round_graph(self) -> Any:
        """A ``graphs.RoundGraph`` capturing the rounds, or None. Setting it re-chooses."""
        return self._round_graph

    @round_graph.setter
    def round_graph(self, graph: Any) -> None:
        self._round_graph = graph
        self._drop_inline()

    def _drop_inline(self) -> None:
        if self._inline is not None:
            self._inline.close()
            self._inline = None

    def inline_backend(self) -> InlineBackend:
        """The backend of in-process rounds: on CUDA streams (or ``stream_ops``), captured in
        CUDA graphs with ``round_graph``, else plain inline; made at first use."""
        if self._inline is None:
            ops = self._stream_ops
            if ops is None and any(s.torch_device.type == "cuda" for s in self.states):
                ops = CUDA_OPS
            if ops is None:
                self._inline = InlineBackend(self)
            elif self._round_graph is not None:
                self._inline = GraphBackend(self, ops, self._round_graph)
            else:
                self._inline = StreamsBackend(self, ops)
        return self._inline

    @property
    def num_learners(self) -> int:
        """k, learners of every process (every rank has the same m per device)."""
        return sum(s.m for s in self.states) * (self.comm.world_size if self.comm else 1)

    @property
    def learner_offset(self) -> int:
        """Global index of this process's first learner (rank · local learners)."""
        return sum(s.m for s in self.states) * self.comm.rank if self.comm else 0

    @property
    def rank(self) -> int | None:
        """This process's torchrun rank, None in a single process."""
        return self.comm.rank if self.comm else None

    @property
    def alpha(self) -> float:
        """α of the next round's local updates: ``settings.alpha``, or 1/k; 0 when k = 1."""
        live = self.ft.live_learners if self.ft is not None else None  # torchft: last sync's k
        return self.settings.sync.alpha_for(live or self.num_learners)

    def resolved_executor(self) -> str:
        """The executor that runs the next round: ``"inline"`` or ``"process"``."""
        if self.executor != "auto":
            return self.executor
        if "process" not in self.sync.executors:  # e.g. a global sync that writes every w
            return "inline"
        k = self.num_learners
        if self._resolved is None or self._resolved[0] != k:
            cpu = all(s.torch_device.type == "cpu" for s in self.states)
            self._resolved = (k, "process" if (cpu and available_cores() >= 2 and k >= 2
                                               and fork_available()) else "inline")
        return self._resolved[1]

    # -- fit boundaries -----------------------------------------------------------------------

    def begin_fit(self, fetch: Callable[[torch.Tensor], Any], *, seed: int = 0, timeline=None,
                  load: Callable[[int, torch.Tensor], Any] | None = None,
                  max_grad_norm: float | None = None) -> None:
        """Prepare a fit: ``fetch`` maps sample indices ``[n]`` to a collated batch (in any
        process); ``load``, if given, maps (round t, its indices ``[k·b]``) to the round's batch
        in this process, once per round in round order; ``max_grad_norm``: the per-learner
        gradient clipping, or None."""
        self.fetch_fn, self.load_fn = fetch, load
        self.seed = seed
        self.max_grad_norm = max_grad_norm
        self.timeline = timeline

    def load_batch(self, round_index: int, indices: torch.Tensor) -> Any:
        """Round ``round_index``'s batch of the samples ``indices [k·b]``, in this process."""
        return self.fetch_fn(indices) if self.load_fn is None else self.load_fn(round_index, indices)

    def end_fit(self) -> None:
        """Finish the work in flight and stop any worker processes."""
        try:
            self.flush()
            if self._inline is not None:
                self._inline.finish()
        finally:
            self.close_workers()
            self.batch_ahead.drop()
            self.fetch_fn = self.load_fn = None

    def flush(self) -> None:
        """Complete the work in flight: z, zbuf and the replicas reflect every round so far on
        the host too, and the faults of those rounds are recorded."""
        self.process.flush()
        if self._inline is not None:
            self._inline.flush()

    def join(self) -> None:
        """Order the caller's default stream after every stream's work so far, without a host
        wait (docs/runtime.md, "Streams on CUDA"); nothing without streams."""
        if self._inline is not None:
            self._inline.join()

    def close_workers(self) -> None:
        """Stop the worker processes (cancelling a speculative round); the next round restarts them."""
        self.process.close()

    @property
    def learning_ahead(self) -> bool:
        """Whether worker processes learn the next round now (a speculative round in flight)."""
        return self.process.learning_ahead

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
                  next_indices: torch.Tensor | None = None) -> None:
        """Run every task of one round.

        Args:
            round_index: the global round number t.
            batch: the round's collated samples, ``k·b`` along dimension 0 (learner j's at
                ``[j·b, (j+1)·b)``), or a ``LearnerBatches``; or None with ``indices``.
            synchronise: whether this round ends with a synchronisation.
            indices: the round's sample indices ``[k·b]`` (fetched or loaded after begin_fit).
            next_indices: the next round's indices when nothing writes the replicas between the
                rounds (the process backend learns it ahead); else None.

        Raises:
            TaskError: a task failed (names the task, its device and the round).
        """
        self.round_index = round_index
        if indices is not None and batch is None and self.resolved_executor() == "process":
            self.backend = self.process
        else:
            self.close_workers()
            self.backend = self.inline_backend()
        self.backend.run_round(round_index, batch, synchronise, indices, next_indices)
        self.settings.mark_stepped()

    def prefetch(self, round_index: int, indices: torch.Tensor) -> None:
        """Load round ``round_index``'s batch of ``indices [k·b]`` now and copy it to the
        devices ahead (the streams backend only; ``batch_ahead``)."""
        if self.resolved_executor() == "inline":
            self.inline_backend().prefetch(round_index, indices)

    @property
    def cuda_streams(self) -> CudaStreams | None:
        """The in-process rounds' CudaStreams (engine/streams.py), or None."""
        return self.inline_backend().cuda_streams

    def _streams(self) -> CudaStreams | None:
        return self.cuda_streams

    # -- SyncContext (engine/sync/base.py) ------------------------------------------------------

    def local_update_rows(self, state: DeviceState, r0: int, r1: int, *, alpha: float,
                          synchronise: bool, optimizer: LocalOptimizer,
                          out: torch.Tensor | None = None,
                          losses: list[torch.Tensor] | None = None, on_device: bool = False
                          ) -> tuple[torch.Tensor | None, Any]:
        """``local_update.local_update_rows`` of this scheduler."""
        return local_update_rows(self, state, r0, r1, alpha=alpha, synchronise=synchronise,
                                 optimizer=optimizer, out=out, losses=losses, on_device=on_device)

    def graph_hyper(self, state: DeviceState) -> Any:
        """In a CUDA-graph round's body, the device's ``DeviceHyper``, else None."""
        return self.backend.graph_hyper(state)

    def sync_central(self, accs: list[torch.Tensor], buffers: list[torch.Tensor] | None = None) -> None:
        """The sync algorithm's global update (``SyncAlgorithm.global_update``) of the sums
        ``accs`` (acc_d ``[P]`` in device order) and the buffers ``[m, Q]`` per device
        (default: the live ``buf``), on the global stream."""
        bufs = buffers if buffers is not None else [s.buf for s in self.states]
        with self.backend.on_stream("global", "global_sync"):
            self.sync.global_update(self, self.sync_state, accs, bufs)

    def all_reduce_sums(self, total: torch.Tensor, bufs: list[torch.Tensor], home: torch.device
                        ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``local_update.all_reduce_sums`` of this scheduler (under torchrun)."""
        return all_reduce_sums(self, total, bufs, home)


def _clone_structure(state: DeviceState):
    return copy.deepcopy(state.template).to(state.torch_device).train()
