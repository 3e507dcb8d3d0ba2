"""A learner group's share of the task graph, what the groups of one executor share (their
shared memory and the round's facts: ``Crew``), and the group that runs its share in its
process (docs/runtime.md, "Worker processes")."""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ....compiler.tasks import Task, TaskKind
from ....errors import TaskError
from ...data.batches import rows
from ...learning.learners import learn_group, learner_seed
from ...rounds.context import RunContext
from ...rounds.env import RoundEnv
from ...rounds.interpreter import RoundInterpreter, RoundProgram, cause_text
from ...state.hyper import Hyper
from .mailbox import POLL_S, Mailbox, wait_alive

__all__ = ["GroupProgram", "group_programs", "Crew", "LearnerGroup"]


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
        fused_runs: for fused learners, ``RoundProgram.learn_runs(learn)``."""

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


class Crew:
    """What the learner groups of one executor share, in every process (the workers are forked
    with it).

    Args:
        ctx: the plan's RunContext.
        groups: ``(device, r0, r1)`` per group (``worker_groups``); programs: their GroupPrograms.
        template: the executor's round facts (a RoundEnv: b, learner mode, k, the sync
            algorithm, max_divergence), fixed while the workers live.
        global_update: the backend's (``Backend.global_update``).
        onednn: whether the groups' convolutions run on oneDNN (``choose_onednn``).

    Attributes (shared memory): ``acc_parts [n, P]`` (each group's partial sum), ``buf_snaps``
    (``[m, Q]`` per device, the buffers' snapshots), ``part_info [n, 2]`` (per group: faulty
    rows, failed) with the semaphore ``parts``, and ``release`` (float64: what each release
    carries, synchronise, cancel and the round's ``Hyper`` as numbers); ``sync_worker`` (the
    group running the GLOBAL_SYNC; None: the coordinator's)."""

    def __init__(self, ctx: RunContext, groups: list[tuple[int, int, int]],
                 programs: list[GroupProgram], template: RoundEnv,
                 global_update: Callable[[RoundEnv, list[torch.Tensor], list[torch.Tensor]], None],
                 *, onednn: bool) -> None:
        self.ctx, self.groups, self.programs, self.template = ctx, groups, programs, template
        self.global_update, self.onednn = global_update, onednn
        states, n = ctx.states, len(groups)
        self.acc_parts = torch.zeros(n, states[0].params.size, dtype=states[0].z.dtype).share_memory_()
        self.buf_snaps = [s.buf.clone().share_memory_() for s in states]  # [m, Q] per device
        self.part_info = torch.zeros(n, 2, dtype=torch.int64).share_memory_().numpy()
        self.parts = mp.get_context("fork").Semaphore(0)
        size = 2 + Hyper.vector_size(ctx.sync.optimizer)
        self.release = torch.zeros(size, dtype=torch.float64).share_memory_()
        self._release = self.release.numpy()  # a view: writes go to the shared block
        placed = next(w for w, p in enumerate(programs) if p.global_sync is not None)
        self.sync_worker = placed or None  # group 0: the coordinator
        # per device with a LOCAL_SYNC, the groups whose partial sums make up its acc_d
        self.device_parts = [[w for w, p in enumerate(programs) if p.local is not None
                              and groups[w][0] == d] for d in ctx.program.synced]

    def write_release(self, env: RoundEnv | None) -> None:
        """The coordinator: round ``env``'s synchronise and hyper-parameters for the workers,
        or (``env`` None) the cancel of the round learned ahead (no tensor per round)."""
        if env is None:
            self._release[:2] = (0.0, 1.0)
        else:
            self._release[:2] = (float(env.synchronise), 0.0)
            self._release[2:] = env.hyper.vector()

    def read_release(self, round_index: int) -> RoundEnv | None:
        """A worker: the round the coordinator released (its env from the ``template``), or None
        for a cancel."""
        values = self.release.tolist()
        if values[1]:
            return None
        hyper = Hyper.from_vector(values[2:], self.ctx.sync.optimizer)
        return dataclasses.replace(self.template, round_index=round_index,
                                   synchronise=bool(values[0]), hyper=hyper)

    def global_sync(self, env: RoundEnv) -> None:
        """The global update (``Backend.global_update``) of the groups' partial sums and the
        buffers' snapshots."""
        parts = self.acc_parts
        accs = [parts[g[0]] if len(g) == 1 else parts[g].sum(dim=0) for g in self.device_parts]
        self.global_update(env, accs, self.buf_snaps)


class LearnerGroup(RoundInterpreter):
    """Learner group ``wid``'s share of every round (its GroupProgram) in the process that runs
    it (group 0: the coordinator): ``learn_round`` (LEARN), ``local_round`` (its LOCAL_SYNC part),
    ``run_global`` (GLOBAL_SYNC). A failed task waits in ``error`` (task id, text) until every
    group has answered; the coordinator then raises it."""

    def __init__(self, crew: Crew, wid: int, mail: Mailbox | None = None) -> None:
        ctx = crew.ctx
        self.pipe = mail.batches if mail is not None else None  # a worker's shipped batches
        self.crew, self.ctx, self.wid, self.program = crew, ctx, wid, crew.programs[wid]
        d, self.r0, self.r1 = crew.groups[wid]
        self.state = state = ctx.states[d]
        self.first = ctx.learner_offset + ctx.program.first[d]  # global index of row 0
        q = state.buf.shape[1]
        self.keep = state.buf[self.r0:self.r1].clone() if q else None  # restored on cancel
        self.acc_part, self.buf_snap = crew.acc_parts[wid], crew.buf_snaps[d] if q else None
        self.d = d
        self.env = dataclasses.replace(crew.template, losses={d: []})  # the round being run
        self.error: tuple[str, str] | None = None
        self.faulty: list[int] = []

    @property
    def losses(self) -> list[torch.Tensor]:
        """The round's losses of the rows that learned, in row order (0-dim tensors)."""
        return [x for x in self.env.losses[self.d] if x is not None]

    def learn_round(self, round_index: int, indices: torch.Tensor, batch: Any = None) -> None:
        """Run the LEARN tasks of round ``round_index`` on the samples ``indices`` of the rows:
        ``batch`` if given, else the batch shipped to this worker (a load), else fetched here."""
        self.error, self.faulty = None, []
        env = self.env = dataclasses.replace(self.crew.template, round_index=round_index,
                                             losses={self.d: [None] * (self.r1 - self.r0)})
        if self.keep is not None:
            self.keep.copy_(self.state.buf[self.r0:self.r1])
        if not self.program.learn:
            return
        try:
            if batch is None:
                batch = self.pipe.receive() if self.pipe is not None else self.ctx.fit.fetch(indices)
            env.batch = batch
            self.run(self.program.learn, env)
        except TaskError as err:
            self.error = (err.task_id, cause_text(err))
        except Exception as exc:  # the fetch
            self.error = (self.program.learn[0].id, f"{type(exc).__name__}: {exc}")
        finally:
            env.batch = None

    def learn(self, task: Task, env: RoundEnv) -> None:
        """Forward and backward of the task's replica (fused: of its run of rows, at its first)."""
        if env.learner_mode == "fused":
            run = self.program.fused_runs.get(task.id)
            if run is None:
                return
            a, b = run
        else:
            a, b = self.ctx.program.rows[task.id]
        ctx, bs = self.ctx, env.b
        mine = rows(env.batch, (a - self.r0) * bs, (b - self.r0) * bs)
        env.losses[self.d][a - self.r0:b - self.r0] = learn_group(
            self.state, a, b, mine, ctx.loss_fn, bs, env.learner_mode, ctx.fused[self.d],
            rng_seed=learner_seed(ctx.fit.seed, env.round_index, self.first + a),
            max_grad_norm=ctx.fit.max_grad_norm)

    def local_round(self, released: RoundEnv) -> None:
        """Run the group's part of its LOCAL_SYNC of the round ``released`` (z_t is final; its
        synchronise and hyper-parameters), unless its learning failed."""
        env = self.env
        env.round_index, env.synchronise, env.hyper = (released.round_index, released.synchronise,
                                                       released.hyper)
        if self.error is None and self.program.local is not None:
            try:
                self.run_task(self.program.local, env)
            except TaskError as err:
                self.error = (err.task_id, cause_text(err))

    def local_sync(self, task: Task, env: RoundEnv) -> None:
        """Rows a … b−1 of the LOCAL_SYNC: the sync algorithm's local update
        (``SyncAlgorithm.local_update``), their sum of corrections into ``acc_parts[wid]``, and
        the group's buffers into the snapshot for the global sync."""
        (a, b), r0 = self.program.local_rows, self.r0
        env.accs[self.d], self.faulty = env.sync.local_update(
            self.ctx.sync, env, self.state, a, b, losses=env.losses[self.d][a - r0:b - r0],
            out=self.acc_part)
        if self.buf_snap is not None:
            self.buf_snap[r0:self.r1].copy_(self.state.buf[r0:self.r1])

    def announce(self) -> None:
        """Tell the sync worker that this group's part is written (and how it went)."""
        self.crew.part_info[self.wid] = (len(self.faulty), int(self.error is not None))
        self.crew.parts.release()

    def sync_round(self, parent: int) -> tuple[int, int] | None:
        """The sync worker, after its own part: wait for every other group's, then run the
        GLOBAL_SYNC unless a group failed or every learner was faulty (the coordinator then
        raises, z untouched). Returns its span (ns; (0, 0) if skipped), None if the parent died."""
        crew = self.crew
        for _ in range(len(crew.groups) - 1):
            if not wait_alive(lambda: crew.parts.acquire(timeout=POLL_S), parent):
                return None
        crew.part_info[self.wid] = (len(self.faulty), int(self.error is not None))
        if crew.part_info[:, 1].any() or int(crew.part_info[:, 0].sum()) >= self.env.k:
            return 0, 0
        g0 = time.perf_counter_ns()
        try:
            self.run_global()
        except TaskError as err:  # keep what it wraps: the coordinator names the task again
            if self.error is None:
                self.error = (err.task_id, cause_text(err))
        return g0, time.perf_counter_ns()

    def run_global(self) -> None:
        """Run the GLOBAL_SYNC of the round being run (raises TaskError)."""
        self.run_task(self.program.global_sync, self.env)

    def global_sync(self, task: Task, env: RoundEnv) -> None:
        self.crew.global_sync(env)

    def cancel(self) -> None:
        """The speculative round will not run: restore the rows' float buffers."""
        if self.keep is not None:
            self.state.buf[self.r0:self.r1].copy_(self.keep)
        self.error = None
