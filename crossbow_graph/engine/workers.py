"""Learner worker processes on the CPU: the process executor (docs/design-overview.md §2 overlap, §5).

The learner groups of ``worker_groups`` (contiguous rows ``r0 … r1−1`` of one device's replicas, at
most one per core) run in as many processes: group 0 in this process (the coordinator), the others
in forked workers. Each runs its share of the task graph, its GroupProgram, assigned once when the
executor starts (``group_programs``): the LEARN tasks of its rows, its part of their LOCAL_SYNC and,
in one of them, the GLOBAL_SYNC. The flat buffers ``w, v, g, buf, z, z_prev, zbuf`` (and the
replicas' integer buffers) live in shared memory, so every process sees the same numbers, and so do
the messages: each worker has a ``_Mailbox`` of small shared arrays and semaphores (no pipe, no
pickling on the hot path). Per round t this process writes t and each worker's sample indices into
the worker's mailbox and releases its ``go`` semaphore; the worker fetches its samples from its
forked copy of the dataset (or receives its rows of the round a DataLoader loaded here:
engine/shipping.py) and learns, as this process learns group 0. When z_t is ready this
process writes α, whether to synchronise and the optimizer's param groups' settings (η, momentum,
betas, ...: ``RunSettings.hyper_vector``) to a shared control block
and releases each worker's semaphore; every group runs its part of the LOCAL_SYNC (the correction
with z_t) and writes its partial sum of corrections. The worker the graph places the GLOBAL_SYNC in
(the one with the last LOCAL_SYNC part: for a compiled graph the last worker) then waits until every
group has written its own (the ``parts`` semaphore) and runs it for round t
(``Scheduler.sync_central``: z_{t+1} on every device), unless a group failed or every learner was
faulty (z is then untouched and this process raises); under torchrun this process runs it instead,
since it owns the all-reduce. Each worker answers with its losses and timestamps (``Spans``; an
error's text alone goes through a pipe). When the next round's samples are known and no hook writes
the replicas, each group starts learning round t+1 right after its local update of round t, so
learning overlaps the global sync and the hooks, and learner j's round t+1 waits only for its own
correction; the worker that runs the global sync runs it before its own next learning (one core per
process: the sync takes some process's time, and that one has no hooks to run). Every process has
one intra-op thread (fork safety, see ``_worker_main``), but for a coordinator without workers. Each
worker seeds torch's CPU generator, Python's ``random`` and NumPy's global RNG every round from (fit
seed, round, rank, worker) before it fetches (``seed_host_rngs``): a Dataset's augmentation draws
differ between processes, and reproduce (also after a resume). Fused learners get one group per
device: vmap draws a group's dropout masks at once, from one seed, so a device split over processes
would draw other masks than the inline executor.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, NamedTuple

import torch

from ..compiler.tasks import Task, TaskKind
from ..errors import TaskError
from .conv_choice import choose_onednn
from .learners import learn_group, learner_seed, rows, seed_host_rngs
from .shipping import BatchPipe
from .interpreter import RoundInterpreter, RoundProgram, cause_text, task_error

if TYPE_CHECKING:
    from .scheduler import Scheduler

__all__ = ["ProcessExecutor", "GroupProgram", "group_programs", "Reply", "Spans", "worker_groups",
           "fork_available", "available_cores"]

FORK_WARNING = r"This process .*is multi-threaded, use of fork\(\) may lead to deadlocks"  # 3.12

_POLL_S = 0.5          # how often a blocked wait checks that the other side is alive
ERROR_TEXT_MAX = 8000  # characters of a worker's error text kept in a TaskError
_OK, _ERROR, _CANCELLED = 1, 2, 3  # a worker's answer (_Mailbox.reply[Reply.STATUS])
ROUND_TIMEOUT_S = 600  # the longest this process waits for one worker's round


def available_cores() -> int:
    """Logical CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def fork_available() -> bool:
    """Whether worker processes can be forked (Linux, macOS): they inherit the dataset."""
    return "fork" in mp.get_all_start_methods()


def worker_groups(replicas_per_device: list[int], cores: int) -> list[tuple[int, int, int]]:
    """Split every device's replicas into contiguous groups, one per worker process.

    Each device gets ``min(m, max(1, cores // G))`` workers (G devices) and its m replicas are
    spread over them as evenly as possible, larger groups first.

    Returns:
        ``(device index, r0, r1)`` per worker, device-major.
    """
    per_device = max(1, cores // len(replicas_per_device))
    groups = []
    for d, m in enumerate(replicas_per_device):
        n = min(m, per_device)
        r0 = 0
        for i in range(n):
            size = m // n + (1 if i < m % n else 0)
            groups.append((d, r0, r0 + size))
            r0 += size
    return groups


class Reply:
    """The slots of a worker's answer (``_Mailbox.reply``, int64): its status and round, the six
    timestamps of ``Spans`` (ns; the slice ``SPANS``), the number of faulty rows, then the faulty
    rows. (Plain ints, not an IntEnum: they are read a dozen times per round.)"""

    STATUS = 0
    ROUND = 1
    LEARN_START = 2
    LEARN_END = 3
    LOCAL_START = 4
    LOCAL_END = 5
    GLOBAL_START = 6
    GLOBAL_END = 7
    N_FAULTY = 8
    FAULTY = 9
    SPANS = slice(LEARN_START, GLOBAL_END + 1)


class Spans(NamedTuple):
    """One group's timestamps of a round (``time.perf_counter_ns``): its learning, its local
    update (from its release on) and the global sync it ran (0, 0 when it ran none)."""

    learn_start: int
    learn_end: int
    local_start: int
    local_end: int
    global_start: int = 0
    global_end: int = 0


class _Answer(NamedTuple):
    """Group ``wid``'s answer of a round: its losses ``[n]``, Spans and faulty rows."""

    wid: int
    losses: torch.Tensor
    spans: Spans
    faulty: list[int]


class _Mailbox:
    """One worker's messages in shared memory: two slots of (round, sample indices), written by
    the coordinator, and one answer (``Reply``: status, round, Spans, faulty rows; and the losses),
    written by the worker; each direction is announced by a semaphore release, which also orders
    the memory accesses. Two slots are enough: the coordinator writes round t + 2 only after the
    worker answered round t, and the worker reads round t + 1's slot before it answers round t + 1.
    With ``shipped`` the coordinator also sends the worker its rows of each round's batch
    (``batches``: engine/shipping.py).

    Args:
        ctx: the multiprocessing context (fork).
        n_indices: sample indices per round, (r1 − r0)·b.
        n_rows: the worker's replicas, r1 − r0.
        n_losses: the losses it answers per round (its LEARN tasks).
        loss_dtype: of the losses (the masters': float64 for a float64 model, else float32).
        shipped: whether the coordinator loads the rounds and sends the batches.
    """

    def __init__(self, ctx, n_indices: int, n_rows: int, n_losses: int,
                 loss_dtype: torch.dtype = torch.float32, shipped: bool = False) -> None:
        self.go, self.done = ctx.Semaphore(0), ctx.Semaphore(0)
        self.indices = torch.zeros(2, n_indices, dtype=torch.int64).share_memory_().numpy()
        self.head = torch.zeros(3, dtype=torch.int64).share_memory_().numpy()  # rounds; stop
        self.reply = torch.zeros(Reply.FAULTY + n_rows, dtype=torch.int64).share_memory_().numpy()
        self._losses = torch.zeros(n_losses, dtype=loss_dtype).share_memory_()
        self.losses = self._losses.numpy()
        self.sent = self.taken = 0  # slots written (coordinator), read (worker)
        self.batches = BatchPipe(ctx) if shipped else None  # the shipped rounds' batches

    def post(self, round_index: int, indices) -> None:
        """Coordinator: round ``round_index``'s sample indices (an int64 array) to the worker."""
        slot = self.sent % 2
        self.indices[slot] = indices
        self.head[slot] = round_index
        self.sent += 1
        self.go.release()

    def take(self) -> tuple[int, torch.Tensor] | None:
        """Worker, after ``go`` was acquired: (round, indices [n]), or None to stop."""
        if self.head[2]:
            return None
        slot = self.taken % 2
        self.taken += 1
        return int(self.head[slot]), torch.from_numpy(self.indices[slot].copy())

    def stop(self) -> None:
        self.head[2] = 1
        self.go.release()

    def answer(self, status: int, round_index: int, spans: Spans = Spans(0, 0, 0, 0),
               faulty=(), losses=()) -> None:
        """Worker: the round's answer, then ``done``."""
        r = self.reply
        r[Reply.STATUS], r[Reply.ROUND] = status, round_index
        r[Reply.SPANS] = spans
        r[Reply.N_FAULTY] = len(faulty)
        r[Reply.FAULTY:Reply.FAULTY + len(faulty)] = faulty
        for i, x in enumerate(losses):
            self.losses[i] = float(x)
        self.done.release()

    def read(self) -> tuple[int, Spans, list[int], torch.Tensor]:
        """Coordinator, after ``done`` was acquired: (status, Spans, faulty rows, losses [n_losses])."""
        r = self.reply
        n = int(r[Reply.N_FAULTY])
        return (int(r[Reply.STATUS]), Spans(*(int(x) for x in r[Reply.SPANS])),
                [int(x) for x in r[Reply.FAULTY:Reply.FAULTY + n]], self._losses.clone())


@dataclass(frozen=True)
class GroupProgram:
    """One learner group's share of a round's task graph (``group_programs``), in the graph's
    topological order.

    Attributes:
        learn: the LEARN tasks of the group's rows (a replica without one does not learn).
        local: the LOCAL_SYNC of the group's device when it covers rows of the group, else None:
            the group runs its part, rows ``local_rows``, and writes their sum of corrections.
        local_rows: ``(a, b)``, those rows of the device (``(0, 0)`` without a part).
        global_sync: the GLOBAL_SYNC when this group's process runs it, else None.
        fused_runs: for fused learners, ``RoundProgram.learn_runs(learn)``.
    """

    learn: tuple[Task, ...]
    local: Task | None
    local_rows: tuple[int, int]
    global_sync: Task | None
    fused_runs: dict[str, tuple[int, int]]


def group_programs(program: RoundProgram, groups: list[tuple[int, int, int]], *,
                   coordinator_syncs: bool) -> list[GroupProgram]:
    """Assign a round's tasks (``program``, in topological order) to the learner groups
    ``groups`` (``worker_groups``): a LEARN to the group of its replica's row; a LOCAL_SYNC to
    every group of its device that holds some of its rows (each runs its part); the GLOBAL_SYNC
    to the group that runs the last part of the last LOCAL_SYNC in that order (its process has
    every other part by then), or to group 0 (this process) with ``coordinator_syncs`` (torchrun:
    this process owns the all-reduce)."""
    owner = {(d, r): wid for wid, (d, r0, r1) in enumerate(groups) for r in range(r0, r1)}
    learns: list[list[Task]] = [[] for _ in groups]
    parts: list[tuple[Task | None, tuple[int, int]]] = [(None, (0, 0))] * len(groups)
    last = 0
    for task in program.tasks:
        if task.kind is TaskKind.LEARN:
            learns[owner[(program.device[task.id], program.rows[task.id][0])]].append(task)
        elif task.kind is TaskKind.LOCAL_SYNC:
            a, b = program.rows[task.id]
            for wid, (d, r0, r1) in enumerate(groups):
                if d == program.device[task.id] and max(a, r0) < min(b, r1):
                    parts[wid] = (task, (max(a, r0), min(b, r1)))
                    last = wid
    sync = 0 if coordinator_syncs else last
    return [GroupProgram(learn=tuple(learns[w]), local=parts[w][0], local_rows=parts[w][1],
                         global_sync=program.global_sync if w == sync else None,
                         fused_runs=program.learn_runs(learns[w])) for w in range(len(groups))]


class _Group(RoundInterpreter):
    """Learner group ``wid``'s share of every round (its GroupProgram) in the process that runs
    it: group 0 in the coordinator, the others in their worker (``_worker_main``).

    ``learn_round`` runs its LEARN tasks, ``local_round`` its part of the LOCAL_SYNC (with z_t),
    ``run_global`` the GLOBAL_SYNC where the graph places it. A failed task is kept in ``error``
    (task id, text) until every group has answered; the coordinator then raises it.
    """

    def __init__(self, ex: "ProcessExecutor", wid: int, mail: "_Mailbox | None" = None) -> None:
        sched = ex.sched
        self.pipe = mail.batches if mail is not None else None  # a worker's shipped batches
        self.ex, self.sched, self.wid, self.program = ex, sched, wid, ex.programs[wid]
        d, self.r0, self.r1 = ex.groups[wid]
        self.state = state = sched.states[d]
        self.mode, self.fused = sched.learner_mode, sched.fused_programs[d]
        self.first = sched.learner_offset + sched.program.first[d]  # global index of row 0
        q = state.buf.shape[1]
        self.keep = state.buf[self.r0:self.r1].clone() if q else None  # restored on cancel
        self.acc_part, self.buf_snap = ex.acc_parts[wid], ex.buf_snaps[d] if q else None
        self.batch: Any = None
        self.row_losses: list[torch.Tensor | None] = []
        self.error: tuple[str, str] | None = None
        self.faulty: list[int] = []
        self.release: tuple = ()  # (α, synchronise) of the local update

    @property
    def losses(self) -> list[torch.Tensor]:
        """The round's losses of the rows that learned, in row order (0-dim tensors)."""
        return [x for x in self.row_losses if x is not None]

    def learn_round(self, round_index: int, indices: torch.Tensor, batch: Any = None) -> None:
        """Run the LEARN tasks of round ``round_index`` on the samples ``indices`` of the rows:
        ``batch`` if given, else the batch shipped to this worker (a load), else fetched here."""
        self.round_index, self.error, self.faulty = round_index, None, []
        self.row_losses = [None] * (self.r1 - self.r0)
        if self.keep is not None:
            self.keep.copy_(self.state.buf[self.r0:self.r1])
        if not self.program.learn:
            return
        try:
            if batch is None:
                batch = self.pipe.receive() if self.pipe is not None else self.ex.fetch(indices)
            self.batch = batch
            self.run(self.program.learn)
        except TaskError as err:
            self.error = (err.task_id, cause_text(err))
        except Exception as exc:  # the fetch
            self.error = (self.program.learn[0].id, f"{type(exc).__name__}: {exc}")
        finally:
            self.batch = None

    def learn(self, task: Task) -> None:
        """Forward and backward of the task's replica (fused: of its run of rows, at its first)."""
        if self.mode == "fused":
            run = self.program.fused_runs.get(task.id)
            if run is None:
                return
            a, b = run
        else:
            a, b = self.sched.program.rows[task.id]
        sched, bs = self.sched, self.sched.batch_size
        mine = rows(self.batch, (a - self.r0) * bs, (b - self.r0) * bs)
        self.row_losses[a - self.r0:b - self.r0] = learn_group(
            self.state, a, b, mine, sched.loss_fn, bs, self.mode, self.fused,
            rng_seed=learner_seed(sched.seed, self.round_index, self.first + a),
            max_grad_norm=sched.max_grad_norm)

    def local_round(self, round_index: int, *, alpha: float, synchronise: bool) -> None:
        """Run the group's part of its LOCAL_SYNC (z_t is final), unless its learning failed;
        the optimizer's settings are those now in this process's ``settings.optimizer``."""
        self.round_index, self.release = round_index, (alpha, synchronise)
        if self.error is None and self.program.local is not None:
            try:
                self.run_task(self.program.local)
            except TaskError as err:
                self.error = (err.task_id, cause_text(err))

    def local_sync(self, task: Task) -> None:
        """Rows a … b−1 of the LOCAL_SYNC: the sync algorithm's local update
        (``SyncAlgorithm.local_update``), their sum of corrections into ``acc_parts[wid]``, and
        the group's buffers into the snapshot for the global sync."""
        alpha, synchronise = self.release
        (a, b), r0 = self.program.local_rows, self.r0
        _, self.faulty = self.sched.sync.local_update(
            self.sched, self.state, a, b, alpha=alpha, synchronise=synchronise,
            losses=self.row_losses[a - r0:b - r0], out=self.acc_part)
        if self.buf_snap is not None:
            self.buf_snap[r0:self.r1].copy_(self.state.buf[r0:self.r1])

    def announce(self) -> None:
        """Tell the sync worker that this group's part is written (and how it went)."""
        self.ex.part_info[self.wid] = (len(self.faulty), int(self.error is not None))
        self.ex.parts.release()

    def sync_round(self, round_index: int, parent: int) -> tuple[int, int] | None:
        """The sync worker, after its own part: wait for every other group's, then run the
        GLOBAL_SYNC unless a group failed or every learner was faulty (the coordinator then
        raises, z untouched). Returns its span (ns; (0, 0) if skipped), None if the parent died."""
        ex = self.ex
        for _ in range(len(ex.groups) - 1):
            if not _wait(lambda: ex.parts.acquire(timeout=_POLL_S), parent):
                return None
        ex.part_info[self.wid] = (len(self.faulty), int(self.error is not None))
        if ex.part_info[:, 1].any() or int(ex.part_info[:, 0].sum()) >= self.sched.num_learners:
            return 0, 0
        g0 = time.perf_counter_ns()
        try:
            self.run_global(round_index)
        except TaskError as err:  # keep what it wraps: the coordinator names the task again
            if self.error is None:
                self.error = (err.task_id, cause_text(err))
        return g0, time.perf_counter_ns()

    def run_global(self, round_index: int) -> None:
        """Run the GLOBAL_SYNC of round ``round_index`` (raises TaskError)."""
        self.round_index = round_index
        self.run_task(self.program.global_sync)

    def global_sync(self, task: Task) -> None:
        self.ex.sync_central()

    def cancel(self) -> None:
        """The speculative round will not run: restore the rows' float buffers."""
        if self.keep is not None:
            self.state.buf[self.r0:self.r1].copy_(self.keep)
        self.error = None


class ProcessExecutor:
    """The coordinator's side of the process executor (see the module docstring).

    Learner group 0 (``worker_groups``) runs in this process, groups 1 … n−1 in forked worker
    processes; each runs its GroupProgram, computed here once from the scheduler's
    ``RoundProgram``.

    Args:
        scheduler: the Scheduler (its states, program, loss, mode, kernels).
        fetch: sample indices ``[n]`` → collated batch; inherited by the forked workers.
        seed: seeds each worker's RNG (dropout) differently.
        load: (round, indices ``[k·b]``) → the round's batch, loaded in this process: each worker
            then receives its rows of it (``_Mailbox.batches``) instead of fetching them.

    Attributes:
        groups: ``(device index, r0, r1)`` per learner group.
        programs: per group, its share of the task graph (GroupProgram).
        sync_worker: the worker that runs the GLOBAL_SYNC, None when this process runs it.
        closed: whether the workers are stopped (``close``; a failed task stops them).
    """

    def __init__(self, scheduler: "Scheduler", fetch: Callable[[torch.Tensor], Any], *,
                 seed: int, load: Callable[[int, torch.Tensor], Any] | None = None) -> None:
        self.sched, self.fetch, self.load = scheduler, fetch, load
        self.own_batch: Any = None  # with a load: group 0's rows of the round it starts
        states, program = scheduler.states, scheduler.program
        # fused learners: a device's replicas in one program, whose dropout masks depend on the
        # group (vmap draws them for the whole group at once), hence one group per device
        cores = 1 if scheduler.settings.learner_mode == "fused" else available_cores()
        self.groups = worker_groups([s.m for s in states], cores)
        n = len(self.groups)
        self.programs = group_programs(program, self.groups,
                                       coordinator_syncs=scheduler.comm is not None)
        placed = next(w for w, p in enumerate(self.programs) if p.global_sync is not None)
        self.sync_worker = placed or None  # group 0: this process
        self.onednn = choose_onednn(scheduler, fetch)
        for s in states:
            s.share_memory()
        self.acc_parts = torch.zeros(n, states[0].params.size, dtype=states[0].z.dtype).share_memory_()
        self.buf_snaps = [s.buf.clone().share_memory_() for s in states]        # [m, Q] per device
        # per group, written before it releases ``parts``: faulty rows, failed (1) or not
        self.part_info = torch.zeros(n, 2, dtype=torch.int64).share_memory_().numpy()
        self.parts = mp.get_context("fork").Semaphore(0)
        # per device with a LOCAL_SYNC, the groups whose partial sums make up its acc_d
        self.device_parts = [[w for w, p in enumerate(self.programs) if p.local is not None
                              and self.groups[w][0] == d] for d in program.synced]
        self.stepped = [(states[g[0]], *p.local_rows) for g, p in zip(self.groups, self.programs)
                        if p.local is not None]  # rows whose next local update is not the first
        self.tasks = {t.id: t for t in program.tasks}
        self.lanes = [f"{'coordinator' if w == 0 else f'worker {w}'} (d{d} r{r0}-{r1 - 1})"
                      for w, (d, r0, r1) in enumerate(self.groups)]
        self.learn_names = [f"learn:d{d}:r{r0}-{r1 - 1}" for d, r0, r1 in self.groups]
        # α, synchronise, cancel of the round being released, then the optimizer's hyper_vector
        self.ctrl = torch.zeros(3 + scheduler.settings.optimizer.hyper_size(),
                                dtype=torch.float64).share_memory_()
        self._ctrl_np = self.ctrl.numpy()  # a view: writes go to the shared block
        self.ahead: tuple[int, torch.Tensor] | None = None  # the speculative round, if any
        self.own = _Group(self, 0)
        self.own_learn_span = (0, 0)  # start and end (ns) of group 0's last learning
        self.z_ready_ns = 0  # when the z of the next local update became final (perf_counter_ns)
        self.main_threads = torch.get_num_threads()
        self.closed = False
        self._start_workers(seed)
        if n > 1:  # one intra-op thread here too: the workers have the other cores
            torch.set_num_threads(1)

    def _start_workers(self, seed: int) -> None:
        """Fork one worker process per group but group 0, each with its mailbox, release
        semaphore and error pipe."""
        ctx, parent = mp.get_context("fork"), os.getpid()
        self.sems, self.conns, self.procs, self.mail = [None], [None], [None], [None]
        try:
            for wid in self.workers:
                d, r0, r1 = self.groups[wid]
                sem = ctx.Semaphore(0)
                here, there = ctx.Pipe(duplex=False)  # an error's text, worker → here
                mail = _Mailbox(ctx, (r1 - r0) * self.sched.batch_size, r1 - r0,
                                len(self.programs[wid].learn), self.sched.states[d].z.dtype,
                                shipped=self.load is not None)
                proc = ctx.Process(
                    target=_worker_main, name=f"crossbow-learner-{wid}", daemon=True,
                    args=(self.sched, wid, self, there, mail, sem,
                          seed * 1_000_003 + 7919 * (wid + 1), 1, parent))
                with warnings.catch_warnings():
                    # Python >= 3.12 warns at any fork of a process with several threads. Ours
                    # are torch's intra-op pool and helper threads; the worker takes no lock
                    # they may hold, starts no thread team in the fork (_worker_main sets one
                    # intra-op thread first) and multiprocessing ends it with os._exit: the fork is safe.
                    warnings.filterwarnings("ignore", FORK_WARNING, DeprecationWarning)
                    proc.start()
                there.close()
                self.sems.append(sem)
                self.conns.append(here)
                self.mail.append(mail)
                self.procs.append(proc)
        except BaseException:
            self.close()
            raise

    @property
    def workers(self) -> range:
        return range(1, len(self.groups))

    def _group_rows(self, wid: int) -> tuple[int, int]:
        """Group ``wid``'s sample rows ``[start, stop)`` of a round's ``k·b``."""
        d, r0, r1 = self.groups[wid]
        b, first = self.sched.batch_size, self.sched.program.first[d]
        return (first + r0) * b, (first + r1) * b

    def _group_indices(self, indices: torch.Tensor, wid: int) -> torch.Tensor:
        """Group ``wid``'s part of a round's sample indices ``[k·b]``: ``[(r1 − r0)·b]``, int64."""
        return indices[slice(*self._group_rows(wid))].to(torch.int64)

    def _send_go(self, round_index: int, indices: torch.Tensor) -> None:
        """Post the round's indices to every worker; with a load, ship each its rows of the round."""
        batch = self.load(round_index, indices) if self.load is not None else None
        for wid in self.workers:
            self.mail[wid].post(round_index, self._group_indices(indices, wid).numpy())
        if batch is not None:
            for wid in self.workers:
                if self.programs[wid].learn:
                    self.mail[wid].batches.send(rows(batch, *self._group_rows(wid)))
            self.own_batch = rows(batch, *self._group_rows(0))

    def _release(self, *, alpha: float, synchronise: bool, cancel: bool) -> None:
        self._ctrl_np[:3] = (alpha, float(synchronise), float(cancel))  # no tensor per round
        self._ctrl_np[3:] = self.sched.settings.hyper_vector()
        for wid in self.workers:
            self.sems[wid].release()

    def _own_learn(self, round_index: int, indices: torch.Tensor) -> None:
        """Group 0's LEARN tasks of round ``round_index``, with the workers' convolutions."""
        start = time.perf_counter_ns()
        saved = torch.backends.mkldnn.enabled
        torch.backends.mkldnn.enabled = self.onednn  # as the workers (choose_onednn)
        try:
            self.own.learn_round(round_index, self._group_indices(indices, 0), self.own_batch)
        finally:
            self.own_batch = None
            torch.backends.mkldnn.enabled = saved
            self.own_learn_span = (start, time.perf_counter_ns())  # its end: waiting for z begins

    def sync_central(self) -> None:
        """The GLOBAL_SYNC's work on the groups' results: per device with a LOCAL_SYNC the sum of
        its groups' partial sums, and the buffers they snapshotted (``Scheduler.sync_central``)."""
        parts = self.acc_parts
        accs = [parts[g[0]] if len(g) == 1 else parts[g].sum(dim=0) for g in self.device_parts]
        self.sched.sync_central(accs, buffers=self.buf_snaps)

    # -- rounds ---------------------------------------------------------------------------------

    def cancel_ahead(self) -> None:
        """Cancel the speculative round being learned (restoring the replicas' buffers)."""
        if self.ahead is None:
            return
        round_index, _ = self.ahead
        self.ahead = None
        self._release(alpha=0.0, synchronise=False, cancel=True)
        self.own.cancel()
        for wid in self.workers:
            self._recv(wid, round_index)  # "cancelled" (or the error of a round that never was)

    def run_round(self, round_index: int, indices: torch.Tensor, synchronise: bool,
                  next_indices: torch.Tensor | None = None) -> None:
        """Run one round, and start the next one's learning if it is known.

        ``next_indices``: the next round's sample indices, if no hook will touch the replicas in
        between: every group learns it right after its local update of this round, while the
        global sync of this round (and the hooks) run; the next ``run_round`` releases its
        local updates, or cancels it if its indices differ (the replicas changed). On return
        every task of the round has run: w, v, z, zbuf are final (only g and buf may already move
        for the speculative round).

        Raises:
            TaskError: a group's task failed (names the task, its device and the round; the
                workers are stopped), or DivergenceError: every learner was faulty.
        """
        sched = self.sched
        learned = self._learn(round_index, indices)
        ta, tb = self.own_learn_span  # group 0 has waited for z_t since it finished learning
        tc = time.perf_counter_ns()
        self._release(alpha=sched.alpha, synchronise=synchronise, cancel=False)
        self.own.local_round(round_index, alpha=sched.alpha, synchronise=synchronise)
        if synchronise and self.sync_worker is not None:
            self.own.announce()
        spans = Spans(ta, tb, tc, time.perf_counter_ns())
        own, error, faulty = self.own.losses, self.own.error, self.own.faulty  # before round t+1
        if next_indices is not None:
            self._learn_ahead(round_index + 1, next_indices)
        losses = torch.stack(own) if own else torch.zeros(0)
        answers = self._collect(round_index, _Answer(0, losses, spans, faulty), error)
        self._record(round_index, answers)
        g0 = g1 = time.perf_counter_ns()
        if synchronise:
            if self.sync_worker is None:
                self.own.run_global(round_index)
                g1 = time.perf_counter_ns()
            else:
                ran = answers[self.sync_worker].spans
                g0, g1 = ran.global_start, ran.global_end
        z_at = self._account(answers, synchronise, g0, g1)
        if sched.timeline is not None:
            self._trace(round_index, answers, z_at, (g0, g1) if synchronise else None, learned)

    def _learn(self, round_index: int, indices: torch.Tensor) -> bool:
        """Start round ``round_index``'s learning in every group unless the previous call did (a
        speculative round, cancelled here if its indices differ); returns whether it had."""
        if self.ahead is not None and (self.ahead[0] != round_index
                                       or not torch.equal(self.ahead[1], indices)):
            self.cancel_ahead()
        learned = self.ahead is not None  # group 0 learned this round in the previous call
        if learned:
            self.sched.rounds_learned_ahead += 1
        else:
            self._send_go(round_index, indices)
            self._own_learn(round_index, indices)
        self.ahead = None
        return learned

    def _learn_ahead(self, round_index: int, indices: torch.Tensor) -> None:
        """Start the next round's learning now (the overlap with this round's global sync)."""
        self._send_go(round_index, indices)
        self._own_learn(round_index, indices)
        self.ahead = (round_index, indices)
        if self.sched.timeline is not None and self.programs[0].learn:
            self.sched.timeline.span(self.learn_names[0], *self.own_learn_span, lane=self.lanes[0],
                                     round_index=round_index)

    def _collect(self, round_index: int, own: _Answer, own_error: tuple[str, str] | None
                 ) -> list[_Answer]:
        """Every group's answer of round ``round_index`` (group 0's: ``own``), in group order.

        Raises:
            TaskError: some group's task failed (the first one's; the workers are stopped).
        """
        answers, failure = [own], own_error
        for wid in self.workers:
            reply = self._recv(wid, round_index)
            if reply[0] == "error" and failure is None:
                failure = reply[1:]
            elif reply[0] == "ok":
                answers.append(_Answer(wid, *reply[1:]))
        if failure is not None:
            self.close()
            raise task_error(self.tasks[failure[0]], round_index, failure[1])
        return answers

    def _record(self, round_index: int, answers: list[_Answer]) -> None:
        """The groups' losses and faults into the scheduler; raises DivergenceError when every
        learner was faulty."""
        sched = self.sched
        for answer in answers:
            sched.losses.extend(answer.losses.unbind())
        for state, a, b in self.stepped:
            state.first_step[a:b] = [False] * (b - a)
        for answer in answers:
            sched.faults.record(sched.states[self.groups[answer.wid][0]], answer.faulty,
                                round_index=round_index, num_learners=sched.num_learners,
                                rank=sched.rank)

    def _account(self, answers: list[_Answer], synchronise: bool, g0: int, g1: int) -> list[int]:
        """Add the round's synchronisation seconds to the scheduler's counters; returns per
        group when its wait stopped being one for z (see below)."""
        sched, n = self.sched, len(answers)
        local_s = sum(a.spans.local_end - a.spans.local_start for a in answers) / n / 1e9
        # a group's wait counts as synchronisation only until z_t was final (the previous
        # global sync's end); after that it waits for this process's release (hooks, bookkeeping)
        z_ready = self.z_ready_ns
        z_at = [max(a.spans.learn_end, min(a.spans.local_start, z_ready)) for a in answers]
        waited_s = sum(z - a.spans.learn_end for a, z in zip(answers, z_at)) / n / 1e9 + local_s
        sched.sync_seconds += (g1 - g0) / 1e9 + local_s
        # the sync worker's learners do not learn while it runs the global sync: exposed too
        in_worker = (g1 - g0) / n / 1e9 if synchronise and self.sync_worker is not None else 0.0
        sched.sync_exposed_seconds += waited_s + in_worker
        if synchronise:
            self.z_ready_ns = g1
        return z_at

    def _trace(self, round_index: int, answers: list[_Answer], z_at: list[int],
               global_span: tuple[int, int] | None, learned: bool) -> None:
        """The round's spans on the timeline: per group its learning, its waits and its local
        sync part; the global sync in the lane of the process that ran it."""
        timeline = self.sched.timeline
        if global_span is not None:
            lane = "coordinator" if self.sync_worker is None else self.lanes[self.sync_worker]
            timeline.span(self.sched.program.global_sync.id, *global_span, lane=lane,
                          round_index=round_index)
        for answer, z in zip(answers, z_at):
            s, lane, program = answer.spans, self.lanes[answer.wid], self.programs[answer.wid]
            if program.learn and (answer.wid or not learned):  # group 0's speculative learning
                timeline.span(self.learn_names[answer.wid], s.learn_start, s.learn_end, lane=lane,
                              round_index=round_index)  # has its span already
            timeline.span("wait for z", s.learn_end, z, lane=lane, round_index=round_index)
            if s.local_start > z:
                timeline.span("wait for release", z, s.local_start, lane=lane,
                              round_index=round_index)
            if program.local is not None:
                timeline.span(program.local.id, s.local_start, s.local_end, lane=lane,
                              round_index=round_index)

    def flush(self) -> None:
        """Nothing is in flight between rounds (z is final when run_round returns)."""

    def close(self) -> None:
        """Cancel the speculative round, stop every worker (join, then kill): prompt also when
        this process left a round half-way (a KeyboardInterrupt), with workers waiting for it."""
        self.closed = True
        try:
            if self.ahead is not None and all(p.is_alive() for p in self.procs if p is not None):
                self.cancel_ahead()
        except Exception:  # noqa: BLE001 - a dead worker: it is killed below
            pass
        finally:
            self.ahead = None
            self._wake_to_stop()
            for proc in self.procs:
                if proc is None:
                    continue
                proc.join(timeout=5)
                if proc.is_alive():  # workers ignore SIGTERM (signal.SIGTERM is the fit's)
                    proc.kill()
                    proc.join(timeout=2)
            for conn in self.conns:
                if conn is not None:
                    conn.close()
            for pipe in (m.batches for m in self.mail if m is not None and m.batches is not None):
                pipe.close()
            self.conns, self.procs, self.mail = [], [], []
            torch.set_num_threads(self.main_threads)

    def _wake_to_stop(self) -> None:
        """Tell every worker to stop, wherever it waits: for its next round (``go``), for this
        round's release (``sem``: it cancels the round) or, the sync worker, for the other
        groups' parts (marked failed: it skips the global sync)."""
        for mail in self.mail:
            if mail is not None:
                mail.stop()
        self._ctrl_np[2] = 1.0  # cancel
        self.part_info[:, 1] = 1
        for sem in self.sems:
            if sem is not None:
                sem.release()
        for _ in self.groups:
            self.parts.release()

    def _recv(self, wid: int, round_index: int):
        """Worker ``wid``'s answer: ("ok", losses [n], Spans, faulty rows), ("cancelled",) or
        ("error", task id, text)."""
        mail, proc = self.mail[wid], self.procs[wid]
        deadline = time.monotonic() + ROUND_TIMEOUT_S
        while not mail.done.acquire(timeout=_POLL_S):
            if not proc.is_alive() or time.monotonic() > deadline:
                p = self.programs[wid]
                task = p.learn[0] if p.learn else p.local or self.sched.program.global_sync
                why = (f"worker process {proc.pid} exited with code {proc.exitcode}"
                       if not proc.is_alive() else f"no answer within {ROUND_TIMEOUT_S} s")
                raise task_error(task, round_index, why)
        status, spans, faulty, losses = mail.read()
        if status == _OK:
            return "ok", losses, spans, faulty
        if status == _CANCELLED:
            return ("cancelled",)
        return self.conns[wid].recv()


def _shorten(text: str) -> str:
    """An error text cut to ERROR_TEXT_MAX characters (its start and end), for the message."""
    if len(text) <= ERROR_TEXT_MAX:
        return text
    half = ERROR_TEXT_MAX // 2
    return f"{text[:half]} […{len(text) - 2 * half:,} characters cut…] {text[-half:]}"


def _wait(ready: Callable[[], bool], parent: int) -> bool:
    """Block until ``ready()`` (it blocks up to _POLL_S itself); False if the parent died."""
    while not ready():
        if os.getppid() != parent:
            return False
    return True


def _worker_main(sched: "Scheduler", wid: int, ex: ProcessExecutor, conn, mail: _Mailbox, sem,
                 seed: int, threads: int, parent: int) -> None:
    """The loop of worker ``wid`` (forked: it shares the scheduler's state, the dataset and the
    executor's shared blocks), which runs group ``wid``'s GroupProgram every round.

    Per round: take (round, indices) from the mailbox; run the LEARN tasks; wait for the
    semaphore (z_t ready); read α, synchronise, cancel and the optimizer's param groups' settings
    from ``ex.ctrl``; if cancelled (a speculative round that will not run) restore the float
    buffers and answer "cancelled", else run the group's part of the LOCAL_SYNC (its partial sum
    of corrections) and, in a synchronising round, announce it on ``ex.parts``, or in the sync
    worker wait for every other group's and run the GLOBAL_SYNC (``_Group.sync_round``). Then
    answer with the losses, Spans and faulty rows (an error's text through the pipe). Every
    round consumes exactly one semaphore release.
    """
    # GNU OpenMP cannot start a thread team in a forked child of a process that used one: the
    # team barrier waits forever for threads that do not exist here. So a worker runs one
    # intra-op thread: ATen then never enters an OpenMP region, and oneDNN (left on, torch's
    # default) creates its own single-threaded primitives, because its primitive cache is keyed
    # by the thread count. Whether oneDNN or ATen's own convolutions run is measured
    # (choose_onednn). Parallelism comes from the workers.
    torch.set_num_threads(threads)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the coordinator's to handle: it stops us
    torch.backends.mkldnn.enabled = ex.onednn  # choose_onednn
    torch.manual_seed(seed)
    group = _Group(ex, wid, mail)
    rank = sched.comm.rank if sched.comm is not None else 0
    try:
        while _wait(lambda: mail.go.acquire(timeout=_POLL_S), parent):
            msg = mail.take()
            if msg is None:
                return
            round_index, idx = msg
            ta = time.perf_counter_ns()
            seed_host_rngs(sched.seed, round_index, rank, wid, torch_cpu=True)  # for the fetch
            group.learn_round(round_index, idx)
            tb = time.perf_counter_ns()
            if not _wait(lambda: sem.acquire(timeout=_POLL_S), parent):
                return
            tc = time.perf_counter_ns()
            ctrl = ex.ctrl.tolist()
            alpha, synchronise, cancel = ctrl[:3]
            if cancel:
                group.cancel()
                mail.answer(_CANCELLED, round_index)
                continue
            sched.settings.load_hyper_vector(ctrl[3:])  # this process's copy
            group.local_round(round_index, alpha=alpha, synchronise=bool(synchronise))
            td = time.perf_counter_ns()
            g0 = g1 = 0
            if synchronise and ex.sync_worker == wid:
                span = group.sync_round(round_index, parent)
                if span is None:
                    return
                g0, g1 = span
            elif synchronise and ex.sync_worker is not None:
                group.announce()
            if group.error is not None:  # the answer first: the coordinator then reads the pipe
                mail.answer(_ERROR, round_index)
                conn.send(("error", group.error[0], _shorten(group.error[1])))
                continue
            mail.answer(_OK, round_index, Spans(ta, tb, tc, td, g0, g1), group.faulty, group.losses)
    except (KeyboardInterrupt, EOFError, BrokenPipeError):
        return
