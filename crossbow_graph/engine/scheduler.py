"""Executes a plan's task graph round after round, like an interpreter (docs/design-overview.md
§1, §2, §5).

The Scheduler is a RoundInterpreter (engine/interpreter.py): one method per task kind (``learn``,
``local_sync``, ``global_sync``), a failure re-raised as a TaskError naming the task, its device
and the round (docs/contributing.md rule 3). What runs is what the plan's task graph says
(``RoundProgram``, read once per graph): a replica without a LEARN task does not learn, a
LOCAL_SYNC updates the rows of its replicas, the GLOBAL_SYNC adds the sums of the devices that
have a LOCAL_SYNC.

Executors (``executor=``):

* ``"inline"``: every task in this process, in topological order. On CUDA each learner group
  runs on its own stream; events carry the dependencies (learn → local sync → global sync, and
  learner j's next round waits only for its own device's local sync), so the GPU overlaps the
  global sync of round t with the learning of round t+1.
* ``"process"``: CPU only. The device's learners are split into groups, one worker process per
  group (``engine.workers``); flat buffers live in shared memory; each group runs its share of
  the graph's tasks (its rows' LEARN tasks and part of their LOCAL_SYNC), and the process the
  graph places the GLOBAL_SYNC in sums the corrections and updates z while the others
  already learn the next round (the overlap of docs/design-overview.md §2; when every hook of the
  fit declares ``mutates_replicas = False``, else the rounds run one after the other).
* ``"auto"``: ``"process"`` when every device is a CPU device, the machine has ≥ 2 cores, k ≥ 2
  and fork is available (and the sync algorithm runs there, ``SyncAlgorithm.executors``: SMA;
  the others' global sync writes every replica); else ``"inline"`` (single-threaded learner
  processes run about twice as fast as one process, learners in Python threads slower: threads
  are not offered).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Literal, get_args

import networkx as nx
import torch

from ..compiler.tasks import Task, TaskKind
from ..kernels.protocol import SMAKernels
from ..kernels.torch_ref import TorchSMAKernels
from .batches import DeviceParts
from .conv_choice import CpuConv
from .learners import learn_group, learner_seed, rows
from .faults import FaultMonitor
from .fused import FusedProgram
from .interpreter import RoundInterpreter, RoundProgram
from .optim import LocalOptimizer
from .prefetch import BatchPrefetch, device_parts
from .streams import CUDA_OPS, CudaStreams
from .settings import RunSettings, settings_view
from .state import DeviceState
from .sync.base import SyncState
from .workers import ProcessExecutor, available_cores, fork_available

__all__ = ["Scheduler", "Executor", "EXECUTORS"]

Executor = Literal["auto", "inline", "process"]
EXECUTORS = get_args(Executor)


class Scheduler(RoundInterpreter):
    """Runs rounds over the devices' replicas: the task graph's tasks, one method per kind; the
    local and global syncs' work is the sync algorithm's (engine/sync/, ``settings.sync``).

    Args:
        task_graph: the plan's task graph (one round).
        states: one DeviceState per device, in the plan's device order.
        loss_fn: ``loss_fn(output, target) -> scalar tensor``.
        settings: the plan's RunSettings (engine/settings.py): η, b, α, τ, m, the learner mode
            and the optimiser and sync strategy, read from there every round.
        executor: ``"auto"``, ``"inline"`` or ``"process"`` (this module's docstring).
        kernels: the SMA update backend; None: the torch kernels.
        comm: under torchrun, this rank's ``engine.comm.Comm`` (the global sync spans the ranks).
        ft: with ``Distributed(fault_tolerant=True)``, this replica group's
            ``engine.ft.FaultTolerantSync`` (the global sync spans torchft's live groups).
        cpu_conv, round_graph: the attributes below.

    Attributes:
        settings: the RunSettings; ``lr``, ``batch_size``, ``learner_mode``, ``optimizer`` and
            ``sync`` are read-only views of it (``Plan.adjust`` changes them).
        kernels: the SMA update backend (a ``kernels.protocol.SMAKernels``).
        program: the task graph as it runs (``RoundProgram``: tasks in topological order, rows).
        losses: the learners' losses of the current epoch (0-dim tensors).
        sync_seconds, sync_exposed_seconds: synchronisation work so far, and the part of it that
            learners waited for (not hidden behind learning), in seconds.
        timeline: a ``Timeline`` receiving every task's span, or None.
        cpu_conv: the worker processes' convolution library: ``"auto"`` (measured once per b,
            ``engine.conv_choice.choose_onednn``), ``"onednn"`` or ``"aten"``.
        max_divergence: if set (policies' DivergenceGuard, ``set_max_divergence``), a replica
            with ‖ŵ_j − z‖/‖z‖ above it is reset from z before its local update, like a NaN/Inf
            one (engine/faults.py); worker processes read it when they start.
        rounds_learned_ahead: rounds whose learning the process executor started during the
            round before (the overlap) and kept, over the scheduler's life.
        max_grad_norm: the fit's ``max_grad_norm`` (``begin_fit``): every learner's gradient
            row clipped to that 2-norm before its local step (engine/clipping.py), or None;
            worker processes read it when they start.
        stream_ops: what issues the streams and events of the inline executor
            (engine/streams.py): None runs them on CUDA devices through ``torch.cuda``; a
            ``RaceRecorder`` (engine/race_check.py; ``RaceRecorder.attach``) runs the same
            discipline on CPU devices.
        fault_masks: per device, ``[m]`` bool: the replicas reset for NaN/Inf (or divergence) in
            the last round, on the device (None before the first local sync).
        sync_state: the sync algorithm's runtime state for this plan (``SyncAlgorithm.bind``,
            built here; engine/sync/): under ``DiLoCo(...)`` its outer optimizer over the first
            device's z (``OuterOptimizer``), for the others an empty ``SyncState``.
        batch_ahead: the batch copied to the devices one round ahead (``prefetch``;
            engine/prefetch.py ``BatchPrefetch``).
        round_graph: a ``graphs.RoundGraph`` that captures the inline executor's rounds in CUDA
            graphs and replays them (``compile(..., cuda_graphs=True)``), or None: eager rounds.
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
        self.kernels: SMAKernels = kernels if kernels is not None else TorchSMAKernels()  # the SMA update backend
        self.states = states
        self.loss_fn = loss_fn
        self.max_divergence: float | None = None
        self.max_grad_norm: float | None = None
        self.executor = executor
        self.losses: list[torch.Tensor] = []
        self.sync_seconds = 0.0
        self.sync_exposed_seconds = 0.0
        self.rounds_learned_ahead = 0
        self.timeline = None
        self.seed = 0
        self.comm = comm  # a engine.comm.Comm under torchrun: the global sync spans the ranks
        self.ft = ft  # a engine.ft.FaultTolerantSync: the global sync spans torchft's live groups
        self._fetch: Callable | None = None
        self._load: Callable | None = None  # begin_fit's load, if any
        self._round_losses: dict[int, list] = {}  # device → its replicas' losses of the round
        self._workers = None  # a workers.ProcessExecutor while one runs
        self._fused = [FusedProgram(_clone_structure(s), loss_fn, settings) for s in states]
        self._cuda: CudaStreams | None = None
        self.stream_ops = None
        self.batch_ahead = BatchPrefetch()
        self.fault_masks: list[torch.Tensor | None] = [None] * len(states)
        self._late_faults: list[tuple[int, int, int, torch.Tensor, object]] = []
        self._buf_snapshot: list[torch.Tensor | None] = [None] * len(states)
        self._resolved: tuple[int, str] | None = None  # (k, executor) cache
        self.cpu_conv = cpu_conv  # worker processes' convolutions: "auto", "onednn", "aten"
        self._onednn_choices: dict[int, bool] = {}  # b → measured choice (conv_choice.choose_onednn)
        self.sync_state: SyncState = settings.sync.bind(states)  # raises TypeError, ValueError
        self.round_graph = round_graph  # a graphs.RoundGraph: CUDA-graph rounds
        self._in_graph = False  # the round body runs as a graph captures it (graph_body)
        self._graph_losses: list[torch.Tensor] = []
        self.set_task_graph(task_graph)

    # -- configuration ------------------------------------------------------------------------

    def set_task_graph(self, task_graph: nx.DiGraph) -> None:
        """Adopt a (re-compiled) task graph; the states must already have its replica counts.

        Raises:
            PlanError: a graph the executors cannot run (``RoundProgram.of`` names the task).
        """
        self.close_workers()
        self.task_graph = task_graph
        self.program = RoundProgram.of(task_graph, [s.name for s in self.states],
                                       [s.m for s in self.states])  # raises PlanError
        self.order: list[Task] = list(self.program.tasks)
        self._fused_runs: dict[str, tuple[int, int]] = {}  # fused learners: lead task → rows
        for d in range(len(self.states)):
            self._fused_runs.update(self.program.learn_runs(
                [t for t in self.order if t.kind is TaskKind.LEARN and self.program.device[t.id] == d]))
        pending = self.faults.pending if hasattr(self, "faults") else []
        self.faults = FaultMonitor()  # NaN/Inf replicas: reset from z, left out of the sum
        self.faults.pending = pending  # torchrun: this rank's faults not yet shared go on
        if self._cuda is not None:
            self.flush()  # the new graph's streams start after the old ones' work
        self._cuda = None
        self.batch_ahead.drop()  # split for the old graph's devices and rows
        if self.round_graph is not None:
            self.round_graph.clear()  # other tasks, other buffers: new graphs

    @property
    def num_learners(self) -> int:
        """k, learners of every process (every rank has the same m per device, engine/comm.py)."""
        return sum(s.m for s in self.states) * (self.comm.world_size if self.comm else 1)

    @property
    def learner_offset(self) -> int:
        """Global index of this process's first learner (rank · local learners)."""
        return sum(s.m for s in self.states) * self.comm.rank if self.comm else 0

    @property
    def rank(self) -> int | None:
        """This process's torchrun rank, None in a single process (FaultMonitor.record)."""
        return self.comm.rank if self.comm else None

    @property
    def alpha(self) -> float:
        """α used in the next round's local updates: ``settings.alpha``, or 1/k; 0 when k = 1."""
        live = self.ft.live_learners if self.ft is not None else None  # torchft: last sync's k
        return self.settings.sync.alpha_for(live or self.num_learners)

    @property
    def fused_programs(self) -> list[FusedProgram]:
        """Per device, the FusedProgram its fused learners run (engine/fused.py)."""
        return self._fused

    @property
    def onednn_choices(self) -> dict[int, bool]:
        """b → whether worker processes run convolutions with oneDNN at batch b, as
        ``engine.conv_choice.choose_onednn`` measured it for this scheduler (it fills the dict)."""
        return self._onednn_choices

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
        process: forked workers fetch their own samples); ``load``, if given, maps (round t, its
        indices ``[k·b]``) to the round's batch in this process, called once per round in round
        order (a DataLoader's workers load it ahead): worker processes then receive their
        learners' batches from this process instead of fetching. ``max_grad_norm``: the fit's
        per-learner gradient clipping (``max_grad_norm``), or None."""
        self._fetch, self._load = fetch, load
        self.seed = seed
        self.max_grad_norm = max_grad_norm
        self.timeline = timeline

    def end_fit(self) -> None:
        """Finish the work in flight and stop any worker processes."""
        try:
            self.flush()
            if self._cuda is not None:  # every rank ends the fit: the last counts are shared
                self._take_late_faults(block=True)
        finally:
            self.close_workers()
            self.batch_ahead.drop()
            self._fetch = self._load = None

    def flush(self) -> None:
        """Complete the work still in flight, so that z, zbuf and the replicas reflect every round
        run so far on the host too: ``join``, then the host waits for the GPU; the faults of the
        rounds so far are recorded (the process executor finishes each round's global sync
        before ``run_round`` returns)."""
        if self._workers is not None:
            self._workers.flush()
        if self._cuda is not None:
            self.join()
            self._cuda.ops.synchronize([s.torch_device for s in self.states])
            self._take_late_faults(block=True, counts=False)
            self._take_spans(block=True)

    def join(self) -> None:
        """Order the caller's default stream after every stream's work so far, without waiting on
        the host (engine/streams.py step 5): what the caller then reads or writes there (z for
        an evaluation, the gradients for a metric) sees every round run so far. Nothing to do
        without CUDA streams."""
        if self._cuda is not None:
            self._cuda.join()

    def close_workers(self) -> None:
        """Stop the worker processes (cancelling a speculative round); the next round restarts them."""
        if self._workers is not None:
            workers, self._workers = self._workers, None
            workers.close()

    @property
    def learning_ahead(self) -> bool:
        """Whether worker processes learn the next round now (a speculative round in flight)."""
        return self._workers is not None and self._workers.ahead is not None

    def reset_replicas(self, rows: list[list[int]], *, round_index: int | None = None) -> None:
        """Put replicas at z between rounds (engine/faults.py ``FaultMonitor.reset``): per device,
        the rows in ``rows``; a speculative round, learned from the old replicas, is cancelled
        first. With ``round_index`` each is a FaultEvent of that round."""
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
            round_index: the global round number t (for error messages).
            batch: the round's collated samples, ``k·b`` along dimension 0, learner j's at
                ``[j·b, (j+1)·b)``, or a ``LearnerBatches`` (engine/batches.py); or None with
                ``indices`` (fetched, or loaded, after ``begin_fit``).
            synchronise: whether this round ends with a synchronisation (every τ-th round).
            indices: the round's sample indices ``[k·b]`` (learner j's at ``[j·b, (j+1)·b)``);
                worker processes fetch their own samples from them (or, with begin_fit's
                ``load``, receive their batches from this process).
            next_indices: the next round's indices when nothing will write the replicas between
                the rounds: worker processes start learning it while this process runs this
                round's global sync (the overlap); ignored by the inline executor.

        Raises:
            TaskError: a task failed (names the task, its device and the round).
        """
        self.round_index = round_index
        if indices is not None and batch is None and self.resolved_executor() == "process":
            if self._workers is None:
                self._workers = ProcessExecutor(self, self._fetch, seed=self.seed + round_index,
                                                load=self._load)
            try:
                self._workers.run_round(round_index, indices, synchronise, next_indices)
            finally:
                if self._workers.closed:  # a task failed: the executor stopped its workers
                    self._workers = None
            return
        self.close_workers()
        copied = None  # per device, the event after its copy of a batch copied ahead
        if batch is None:
            ahead = self.batch_ahead.take(round_index, indices)
            if ahead is not None:
                batch, copied = ahead
            else:
                batch = self._fetch(indices) if self._load is None else self._load(round_index, indices)
        if self.round_graph is not None and self._streams() is not None and \
                self.round_graph.run_round(self, round_index, batch, synchronise):
            return
        self._start_round(batch, synchronise)
        streams = self._streams()
        if streams is not None:
            streams.begin_round(batch, copied)
        self.run(self.order)
        if streams is not None:  # the last round's fault flags and timings: done by now, or soon
            streams.end_round()
            self._take_late_faults(block=False, before=round_index)
            self._take_spans(block=False)

    def _start_round(self, batch: Any, synchronise: bool) -> None:
        """What a round's tasks read besides the state: its batch, whether it synchronises, and
        per device its learners' losses (filled by ``learn``, read by the fault test)."""
        self._batch = batch
        self._round_losses = {d: [None] * s.m for d, s in enumerate(self.states)}
        self._synchronise = synchronise

    def prefetch(self, round_index: int, indices: torch.Tensor) -> None:
        """Fetch (or load) round ``round_index``'s batch of samples ``indices [k·b]`` now and copy
        each device's rows to it on its copy stream (``CudaStreams.copy_in``), while the rounds
        issued so far run; ``run_round`` of that round takes it if its indices are these
        (``batch_ahead``). Nothing without CUDA streams (the inline executor on CUDA devices, or
        ``stream_ops`` set), nor with CUDA-graph rounds (they copy each batch into static inputs)."""
        if self.resolved_executor() != "inline" or self._streams() is None or \
                self.round_graph is not None:
            return
        batch = self._fetch(indices) if self._load is None else self._load(round_index, indices)
        b, first = self.batch_size, self.program.first
        bounds = [(first[d] * b, (first[d] + s.m) * b) for d, s in enumerate(self.states)]
        self.batch_ahead.put(round_index, indices, *self._cuda.copy_in(device_parts(batch, bounds)))

    # -- CUDA-graph rounds (engine/graphs.py) ----------------------------------------------------

    @property
    def cuda_streams(self) -> CudaStreams | None:
        """The inline executor's streams (engine/streams.py), made at the first round on CUDA
        devices or with ``stream_ops`` set; None otherwise."""
        return self._streams()

    def drop_streams(self) -> None:
        """Forget the streams (after a failed capture): the next round makes new ones."""
        self._cuda = None

    def graph_body(self, batch: Any, synchronise: bool) -> list[torch.Tensor]:
        """One round's tasks as a CUDA graph captures them (``RoundGraph``): on the streams
        between two ``seal``s, the update kernels reading the hyper-parameters from the round
        graph's device tensors, no dropout seeding (the round graph seeds before), no host copy of
        the fault masks and no timing (``graph_epilogue`` does what follows a replay). Returns
        the learners' losses (0-dim tensors, in learning order)."""
        self._start_round(batch, synchronise)
        self._graph_losses = []
        self._in_graph = True
        try:
            self._cuda.begin_round(batch)
            self.run(self.order)
        finally:
            self._in_graph = False
            self._cuda.seal()  # every stream joins the caller's again
        return self._graph_losses

    def graph_epilogue(self, round_index: int, losses: list[torch.Tensor]) -> None:
        """After a graph round (or its eager warm-up): its losses (copies) into ``losses``, each
        device's fault mask to the host behind an event, the faults of the rounds before."""
        self.losses.extend(losses)
        for d, mask in enumerate(self.fault_masks):
            if mask is not None:
                self._read_late(d, 0, mask, self._cuda.ops.current(self.states[d].torch_device))
        # rounds t−1 and t stay queued: the host waits for round t−2's replay, not for t−1's
        self._take_late_faults(block=False, before=round_index - 1)

    def graph_hyper(self, state: DeviceState):
        """In a graph round's body, the device's hyper-parameter tensors (graphs.DeviceHyper),
        else None."""
        return self.round_graph.hyper_of(state) if self._in_graph else None

    def run_task(self, task: Task) -> None:
        """Run one task (``RoundInterpreter.run_task``), timed: its span goes to the timeline and
        a sync task's seconds to ``sync_seconds`` (all exposed: nothing runs beside it)."""
        t0 = time.perf_counter_ns()
        super().run_task(task)
        t1 = time.perf_counter_ns()
        if self._cuda is not None:
            return  # timed on the GPU by events (_take_spans)
        if task.kind is not TaskKind.LEARN:
            self.sync_seconds += (t1 - t0) / 1e9
            self.sync_exposed_seconds += (t1 - t0) / 1e9  # sequential: nothing is hidden
        if self.timeline is not None:
            self.timeline.span(task.id, t0, t1, lane="inline", round_index=self.round_index)

    # -- one method per task kind -------------------------------------------------------------

    def learn(self, task: Task) -> None:
        """Forward and backward of the task's replica on its own batch; gradients land in ``g[j]``.

        Fused learners run a device's LEARN tasks of contiguous rows as one program, at the
        first of them (``RoundProgram.learn_runs``); the others have nothing left to do.
        """
        d = self.program.device[task.id]
        if self.learner_mode == "fused":
            run = self._fused_runs.get(task.id)
            if run is None:
                return
            r0, r1 = run
        else:
            r0, r1 = self.program.rows[task.id]
        state, b, first = self.states[d], self.batch_size, self.program.first[d]
        batch, at = self._batch, first
        if isinstance(batch, DeviceParts):  # copied ahead: device d's rows, on device d
            batch, at = batch.parts[d], 0
        mine = rows(batch, (at + r0) * b, (at + r1) * b)
        seed = None if self._in_graph else \
            learner_seed(self.seed, self.round_index, self.learner_offset + first + r0)
        with self._on_stream("learn", task, d, r0):
            losses = learn_group(state, r0, r1, mine, self.loss_fn, b, self.learner_mode,
                                 self._fused[d], rng_seed=seed, max_grad_norm=self.max_grad_norm)
        (self._graph_losses if self._in_graph else self.losses).extend(losses)
        self._round_losses[d][r0:r1] = losses

    def local_sync(self, task: Task) -> None:
        """The sync algorithm's local update of the task's replicas (rows a … b−1 of its device):
        their local step (and SMA's correction), and the device's accumulator acc_d
        (``SyncAlgorithm.local_update``)."""
        d = self.program.device[task.id]
        a, b = self.program.rows[task.id]
        state = self.states[d]
        streams = self._cuda
        with self._on_stream("local", task, d):
            state.acc, faulty = self.sync.local_update(
                self, state, a, b, alpha=self.alpha, synchronise=self._synchronise,
                losses=self._round_losses[d][a:b], on_device=streams is not None)
            if streams is not None:
                self._snapshot_buffers(d, a, b)
                streams.keep_for_global([state.acc, self._buf_snapshot[d]])
                if not isinstance(faulty, list):
                    self._note_faults(d, a, faulty)
        if isinstance(faulty, list):
            self.fault_masks[d] = None
            self.faults.record(state, faulty, round_index=self.round_index,
                               num_learners=self.num_learners, rank=self.rank)

    def local_update_rows(self, state: DeviceState, r0: int, r1: int, *, alpha: float,
                          synchronise: bool, optimizer: LocalOptimizer,
                          out: torch.Tensor | None = None,
                          losses: list[torch.Tensor] | None = None, on_device: bool = False
                          ) -> tuple[torch.Tensor | None, list[int] | torch.Tensor]:
        """The learners' local update of rows ``r0 … r1−1`` (docs/design-overview.md §2, steps
        1–2; ``SyncAlgorithm.local_update`` calls it): the optimizer's step (the SGD kernels, or a
        row optimizer: engine/optim.py) with the hyper-parameters now in its param groups, and
        the correction α·(ŵ − z) in a round that synchronises (none with α = 0).

        Replicas with NaN/Inf gradients, or a NaN/Inf loss in ``losses`` (the rows' losses of
        the round, r1 − r0 0-dim tensors), are first reset from z and so left out of the sum
        (engine/faults.py). Worker processes call it for their own rows. ``out``: ``[P]`` to
        write the sum of corrections into (default: a new tensor). ``on_device``: the faulty rows
        are found and reset without a host read (``FaultMonitor.find_and_reset_masked``; the
        CUDA streams' path).

        Returns:
            (the rows' sum of corrections ``[P]``, None in a round without synchronisation;
            the faulty replicas' indices on the device, or with ``on_device`` their mask
            ``[r1 − r0]`` bool on the device).
        """
        if on_device:
            faulty = FaultMonitor.find_and_reset_masked(state, r0, r1, self.max_divergence, losses)
        else:
            faulty = FaultMonitor.find_and_reset(state, r0, r1, self.max_divergence, self.kernels,
                                                 losses)
        z = state.z if synchronise and alpha else None
        if optimizer.kernel:
            sgd = optimizer.sgd()
            hyper = self.graph_hyper(state)  # a graph round: device tensors, read at replay
            alpha_in = alpha if z is not None else 0.0
            args = hyper.local_args(sgd, alpha_in) if hyper is not None else dict(
                lr=sgd.lr, momentum=sgd.momentum, weight_decay=sgd.weight_decay, alpha=alpha_in)
            acc = self.kernels.local_update(
                state.w[r0:r1], state.v[r0:r1], state.g[r0:r1], z, nesterov=sgd.nesterov,
                first_step=all(state.first_step[r0:r1]),  # a new replica's momentum is zero: same maths
                out=out, **args)
            state.first_step[r0:r1] = [False] * (r1 - r0)
        else:
            acc = row_update(state, r0, r1, z, alpha, out)
        if on_device:
            FaultMonitor.reset_masked(state, r0, faulty)
        else:
            FaultMonitor.reset(state, faulty)  # back at z: the zero gradient still met weight decay
        return acc, faulty

    def global_sync(self, task: Task) -> None:
        """In a round that synchronises: ``sync_central`` of the sums acc_d of the devices that
        have a LOCAL_SYNC (``RoundProgram.synced``)."""
        if self._synchronise:
            snap = self._buf_snapshot if self._cuda is not None else None  # see _snapshot_buffers
            self.sync_central([self.states[d].acc for d in self.program.synced],
                              None if snap is None else [b if b is not None else s.buf
                                                         for b, s in zip(snap, self.states)])

    def sync_central(self, accs: list[torch.Tensor], buffers: list[torch.Tensor] | None = None) -> None:
        """The GLOBAL_SYNC's work, on the global stream: the sync algorithm's global update
        (``SyncAlgorithm.global_update``; SMA: C = Σ_d acc_d, then z ← z + C + μ_z(z − z_prev)
        on every device; buffers averaged).

        ``accs``: the sums acc_d ``[P]`` to add, in device order. ``buffers``: per device the
        replicas' float buffers ``[m, Q]`` to average (default: the live ``buf``; the process
        executor passes its groups' sums and the snapshots its workers took at the round's end).
        """
        bufs = buffers if buffers is not None else [s.buf for s in self.states]
        with self._on_stream("global", self._global_task):
            self.sync.global_update(self, self.sync_state, accs, bufs)

    def all_reduce_sums(self, total: torch.Tensor, bufs: list[torch.Tensor], home: torch.device
                        ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The hierarchical reduce's second level, under torchrun (``comm``): the process's sum
        ``total`` ``[P]``, its replicas' buffer sums and its count of fault events not yet shared,
        packed into one ``[P + Q + 1]`` tensor in the masters' dtype (float32, or float64 for a
        float64 model), all-reduced (sum) over the ranks; then the ranks' new faults if any rank
        has some (``FaultMonitor.share``: DivergenceError when a round's events cover all k
        learners, z untouched). Returns (C ``[P]``, the mean buffers over all k replicas ``[Q]``
        or None)."""
        P, Q = total.shape[0], self.states[0].buf.shape[1]
        flat = torch.empty(P + Q + 1, dtype=total.dtype, device=home)
        flat[:P].copy_(total)
        if Q:
            torch.sum(torch.cat([bb.to(home, total.dtype) for bb in bufs]), dim=0, out=flat[P:P + Q])
        flat[P + Q] = len(self.faults.pending)
        self.comm.all_reduce_sum_(flat, self.round_index, num_parameters=P)
        if self._cuda is None:
            if flat[P + Q].item() > 0:  # some rank found faults since the last sync
                self.faults.share(self.comm, self.round_index, self.num_learners,
                                  self.states[0].z)
        else:  # read a round late, at the same round on every rank (_take_late_faults)
            self._read_late(-1, 0, flat[P + Q:], self._cuda.global_stream)
        mean_buf = flat[P:P + Q].div_(self.num_learners).to(self.states[0].buf.dtype) if Q else None
        return flat[:P], mean_buf

    # -- CUDA streams (inline executor on GPUs; engine/streams.py) -----------------------------

    _global_task = ("global_sync", None)  # the span label of a global sync run outside a task

    def _streams(self) -> CudaStreams | None:
        """The streams of the inline executor: on CUDA devices, or with ``stream_ops`` set."""
        if self._cuda is None:
            ops = self.stream_ops
            if ops is None and any(s.torch_device.type == "cuda" for s in self.states):
                ops = CUDA_OPS
            if ops is not None:
                self._cuda = CudaStreams(self.states, ops)
                self._origin_ns = time.perf_counter_ns()
        return self._cuda

    def _on_stream(self, kind: str, task, d: int = 0, r0: int = 0):
        """The context that issues a task's work on its stream (nothing without streams)."""
        streams = self._cuda
        if streams is None:
            return _NULL
        label = (task.id if isinstance(task, Task) else task[0], self.round_index)
        if kind == "learn":
            return streams.learn(label, d, r0, after_global=self.sync.waits_for_global)
        if kind == "local":
            return streams.local(label, d)
        return streams.global_(label)

    def _snapshot_buffers(self, d: int, a: int, b: int) -> None:
        """In a round that synchronises, the local sync copies rows a … b−1 of ``buf`` for the
        global sync to read (round t+1's BatchNorm forward may update ``buf`` meanwhile)."""
        buf = self.states[d].buf
        if not (self._synchronise and buf.shape[1]):
            return
        snap = self._buf_snapshot[d]
        if snap is None or snap.shape != buf.shape:
            snap = self._buf_snapshot[d] = torch.empty_like(buf)
        snap[a:b].copy_(buf[a:b])

    def _note_faults(self, d: int, a: int, mask: torch.Tensor) -> None:
        """A local sync's fault mask ``[n]`` (on the device): kept in ``fault_masks`` and copied to
        the host behind an event, recorded a round late (``_take_late_faults``)."""
        state = self.states[d]
        full = self.fault_masks[d]
        if full is None or full.shape[0] != state.m:
            full = self.fault_masks[d] = torch.zeros(state.m, dtype=torch.bool, device=mask.device)
            self._cuda.ops.keep_alive(full, self._cuda.default[d])  # read there (the metrics)
        full[a:a + len(mask)].copy_(mask)
        if not self._in_graph:  # a graph round's mask goes to the host after it (graph_epilogue)
            self._read_late(d, a, mask, self._cuda.sync_stream[d])

    def _read_late(self, d: int, a: int, t: torch.Tensor, stream) -> None:
        """Copy ``t`` (a fault mask of device d's rows a …, or with d = −1 the all-reduced fault
        count) to host memory (pinned on CUDA) behind an event on ``stream``; the host reads it
        in ``_take_late_faults``."""
        pinned = t.device.type == "cuda"
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=pinned)
        host.copy_(t, non_blocking=pinned)
        event = self._cuda.ops.new_event()
        self._cuda.ops.record(event, stream)
        self._late_faults.append((self.round_index, d, a, host, event))

    def _take_late_faults(self, *, block: bool, before: int | None = None,
                          counts: bool = True) -> None:
        """Record the faults of the rounds before ``before`` (every round with ``block``): the host
        waits for each one's event, issued a round ago; under torchrun, share the ranks' faults
        when a round's all-reduced count says some rank has new ones (every rank at the same
        round; ``counts=False`` leaves those for later: a flush on one rank only, for a
        checkpoint). Raises DivergenceError as ``record`` and ``FaultMonitor.share``."""
        pending, self._late_faults = self._late_faults, []
        for i, (t, d, a, host, event) in enumerate(pending):
            if not block and t >= before:
                self._late_faults += pending[i:]
                break
            if d < 0 and not counts:
                self._late_faults.append(pending[i])
                continue
            self._cuda.ops.wait_host(event)
            if d < 0:  # the ranks' count of new faults of round t's all-reduce
                if host.item() > 0:
                    self.faults.share(self.comm, t, self.num_learners, self._settled_z(0))
                continue
            rows = [a + r for r in host.nonzero().flatten().tolist()]
            if rows and self.states[d].optim_rows is not None:
                self.states[d].optim_rows.reset(rows)  # their next step starts fresh
            self.faults.record(self.states[d], rows, round_index=t, num_learners=self.num_learners,
                               rank=self.rank, settled_z=self._settled_z(d))

    def _settled_z(self, d: int) -> Callable[[], torch.Tensor]:
        """A function returning device d's z once every stream's work so far is done (for a
        DivergenceError's message, read on the host only when one is raised)."""
        def settled() -> torch.Tensor:
            self.join()
            self._cuda.ops.synchronize([s.torch_device for s in self.states])
            return self.states[d].z
        return settled

    def _take_spans(self, *, block: bool) -> None:
        """The GPU times of the finished tasks into ``sync_seconds``, ``sync_exposed_seconds``
        (a local sync: all of it, learners wait for it; a global sync: the part no learner span
        overlaps) and the timeline."""
        spans = self._cuda.take_spans(block=block)
        learning = [(t0, t1) for _, kind, _, t0, t1 in spans if kind == "learn"]
        for (task_id, round_index), kind, d, t0, t1 in spans:
            if kind != "learn":
                self.sync_seconds += (t1 - t0) / 1e3
                hidden = sum(max(0.0, min(t1, b) - max(t0, a)) for a, b in learning) \
                    if kind == "global" else 0.0
                self.sync_exposed_seconds += max(0.0, t1 - t0 - hidden) / 1e3
            if self.timeline is not None:
                self.timeline.span(task_id, self._origin_ns + int(t0 * 1e6),
                                   self._origin_ns + int(t1 * 1e6), lane=f"{kind} stream",
                                   round_index=round_index)


class _Null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


_NULL = _Null()


@torch.no_grad()
def row_update(state: DeviceState, r0: int, r1: int, z: torch.Tensor | None, alpha: float,
               out: torch.Tensor | None) -> torch.Tensor | None:
    """A row optimizer's local update of rows r0 … r1−1 (engine/optim.py): c = α·(ŵ − z) from
    the pre-step weights, the optimizer's step, w ← w − c; returns Σ c ``[P]`` (in ``out``), or
    None without a correction (``z`` None)."""
    w = state.w[r0:r1]
    c = None
    if z is not None:
        c = torch.sub(w, z, out=state.optim_rows.scratch(w)).mul_(alpha)
    state.optim_rows.step(state, r0, r1)
    if c is None:
        return None
    w.sub_(c)
    return torch.sum(c, dim=0, out=out) if out is not None else c.sum(dim=0)


def _clone_structure(state: DeviceState):
    import copy

    return copy.deepcopy(state.template).to(state.torch_device).train()

