"""A learner group's share of the task graph and the worker process that runs it
(docs/runtime.md, "Worker processes")."""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ..compiler.tasks import Task, TaskKind
from ..errors import TaskError
from .backend import RoundEnv
from .interpreter import RoundInterpreter, RoundProgram, cause_text
from .learners import learn_group, learner_seed, rows, seed_host_rngs
from .mailbox import CANCELLED, ERROR, OK, POLL_S, Answer, Mailbox, Spans, shorten, wait_alive

if TYPE_CHECKING:
    from .scheduler import Scheduler
    from .workers import ProcessExecutor

__all__ = ["GroupProgram", "group_programs", "LearnerGroup", "worker_main", "account_round",
           "trace_round"]


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


class LearnerGroup(RoundInterpreter):
    """Learner group ``wid``'s share of every round (its GroupProgram) in the process that runs
    it: group 0 in the coordinator, the others in their worker (``worker_main``).

    ``learn_round`` runs its LEARN tasks, ``local_round`` its part of the LOCAL_SYNC (with z_t),
    ``run_global`` the GLOBAL_SYNC where the graph places it. A failed task is kept in ``error``
    (task id, text) until every group has answered; the coordinator then raises it.
    """

    def __init__(self, ex: "ProcessExecutor", wid: int, mail: "Mailbox | None" = None) -> None:
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
        self.d = d
        self.env = RoundEnv(0, None, False, 0.0, losses={d: []})  # the round being run
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
        env = self.env = RoundEnv(round_index, None, False, 0.0,
                                  losses={self.d: [None] * (self.r1 - self.r0)})
        if self.keep is not None:
            self.keep.copy_(self.state.buf[self.r0:self.r1])
        if not self.program.learn:
            return
        try:
            if batch is None:
                batch = self.pipe.receive() if self.pipe is not None else self.ex.fetch(indices)
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
        if self.mode == "fused":
            run = self.program.fused_runs.get(task.id)
            if run is None:
                return
            a, b = run
        else:
            a, b = self.sched.program.rows[task.id]
        sched, bs = self.sched, self.sched.batch_size
        mine = rows(env.batch, (a - self.r0) * bs, (b - self.r0) * bs)
        env.losses[self.d][a - self.r0:b - self.r0] = learn_group(
            self.state, a, b, mine, sched.loss_fn, bs, self.mode, self.fused,
            rng_seed=learner_seed(sched.seed, env.round_index, self.first + a),
            max_grad_norm=sched.max_grad_norm)

    def local_round(self, round_index: int, *, alpha: float, synchronise: bool) -> None:
        """Run the group's part of its LOCAL_SYNC (z_t is final), unless its learning failed;
        the optimizer's settings are those now in this process's ``settings.optimizer``."""
        env = self.env
        env.round_index, env.alpha, env.synchronise = round_index, alpha, synchronise
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
        env.accs[self.d], self.faulty = self.sched.sync.local_update(
            self.sched, self.state, a, b, alpha=env.alpha, synchronise=env.synchronise,
            losses=env.losses[self.d][a - r0:b - r0], out=self.acc_part)
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
            if not wait_alive(lambda: ex.parts.acquire(timeout=POLL_S), parent):
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
        self.run_task(self.program.global_sync, RoundEnv(round_index, None, True, 0.0))

    def global_sync(self, task: Task, env: RoundEnv) -> None:
        self.ex.sync_central()

    def cancel(self) -> None:
        """The speculative round will not run: restore the rows' float buffers."""
        if self.keep is not None:
            self.state.buf[self.r0:self.r1].copy_(self.keep)
        self.error = None


def worker_main(sched: "Scheduler", wid: int, ex: ProcessExecutor, conn, mail: Mailbox, sem,
                 seed: int, threads: int, parent: int) -> None:
    """The loop of worker ``wid`` (forked: it shares the scheduler's state, the dataset and the
    executor's shared blocks): group ``wid``'s GroupProgram every round, one semaphore release
    per round (docs/runtime.md, "Executors")."""
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
    group = LearnerGroup(ex, wid, mail)
    rank = sched.comm.rank if sched.comm is not None else 0
    try:
        while wait_alive(lambda: mail.go.acquire(timeout=POLL_S), parent):
            msg = mail.take()
            if msg is None:
                return
            round_index, idx = msg
            ta = time.perf_counter_ns()
            seed_host_rngs(sched.seed, round_index, rank, wid, torch_cpu=True)  # for the fetch
            group.learn_round(round_index, idx)
            tb = time.perf_counter_ns()
            if not wait_alive(lambda: sem.acquire(timeout=POLL_S), parent):
                return
            tc = time.perf_counter_ns()
            ctrl = ex.ctrl.tolist()
            alpha, synchronise, cancel = ctrl[:3]
            if cancel:
                group.cancel()
                mail.answer(CANCELLED, round_index)
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
                mail.answer(ERROR, round_index)
                conn.send(("error", group.error[0], shorten(group.error[1])))
                continue
            mail.answer(OK, round_index, Spans(ta, tb, tc, td, g0, g1), group.faulty, group.losses)
    except (KeyboardInterrupt, EOFError, BrokenPipeError):
        return


def account_round(ex: "ProcessExecutor", answers: list[Answer], synchronise: bool, g0: int,
                  g1: int) -> list[int]:
    """Add the round's synchronisation seconds (``answers``' Spans; the global sync ran from g0 to
    g1 ns) to ``ex.sched``'s counters; returns per group when its wait for z ended (ns)."""
    sched, n = ex.sched, len(answers)
    local_s = sum(a.spans.local_end - a.spans.local_start for a in answers) / n / 1e9
    # a group's wait counts as synchronisation only until z_t was final (the previous
    # global sync's end); after that it waits for this process's release (hooks, bookkeeping)
    z_ready = ex.z_ready_ns
    z_at = [max(a.spans.learn_end, min(a.spans.local_start, z_ready)) for a in answers]
    waited_s = sum(z - a.spans.learn_end for a, z in zip(answers, z_at)) / n / 1e9 + local_s
    sched.sync_seconds += (g1 - g0) / 1e9 + local_s
    # the sync worker's learners do not learn while it runs the global sync: exposed too
    in_worker = (g1 - g0) / n / 1e9 if synchronise and ex.sync_worker is not None else 0.0
    sched.sync_exposed_seconds += waited_s + in_worker
    if synchronise:
        ex.z_ready_ns = g1
    return z_at


def trace_round(ex: "ProcessExecutor", round_index: int, answers: list[Answer], z_at: list[int],
                global_span: tuple[int, int] | None, learned: bool) -> None:
    """The round's spans on the timeline: per group its learning, its waits and its local
    sync part; the global sync in the lane of the process that ran it."""
    timeline = ex.sched.timeline
    if global_span is not None:
        lane = "coordinator" if ex.sync_worker is None else ex.lanes[ex.sync_worker]
        timeline.span(ex.sched.program.global_sync.id, *global_span, lane=lane,
                      round_index=round_index)
    for answer, z in zip(answers, z_at):
        s, lane, program = answer.spans, ex.lanes[answer.wid], ex.programs[answer.wid]
        if program.learn and (answer.wid or not learned):  # group 0's speculative learning
            timeline.span(ex.learn_names[answer.wid], s.learn_start, s.learn_end, lane=lane,
                          round_index=round_index)  # has its span already
        timeline.span("wait for z", s.learn_end, z, lane=lane, round_index=round_index)
        if s.local_start > z:
            timeline.span("wait for release", z, s.local_start, lane=lane,
                          round_index=round_index)
        if program.local is not None:
            timeline.span(program.local.id, s.local_start, s.local_end, lane=lane,
                          round_index=round_index)
