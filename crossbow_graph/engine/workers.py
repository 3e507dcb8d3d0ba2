"""The process backend: learner groups in forked worker processes on the CPU, flat buffers
and messages in shared memory, the next round's learning overlapping the global sync
(docs/runtime.md, "Worker processes"; docs/design-overview.md §2 overlap, §5)."""

from __future__ import annotations

import multiprocessing as mp
import os
import time
import warnings
from typing import TYPE_CHECKING, Any, Callable

import torch

from .backend import Backend
from .conv_choice import choose_onednn
from .groups import (GroupProgram, LearnerGroup, account_round, group_programs, trace_round,
                     worker_main)
from .interpreter import task_error
from .learners import rows
from .mailbox import (CANCELLED, OK, POLL_S, Answer, Mailbox, Reply, Spans, available_cores,
                      fork_available, worker_groups)

if TYPE_CHECKING:
    from .scheduler import Scheduler

__all__ = ["ProcessBackend", "ProcessExecutor", "GroupProgram", "group_programs", "Reply", "Spans",
           "worker_groups", "fork_available", "available_cores"]

FORK_WARNING = r"This process .*is multi-threaded, use of fork\(\) may lead to deadlocks"  # 3.12

ROUND_TIMEOUT_S = 600  # the longest this process waits for one worker's round


class ProcessExecutor:
    """The coordinator of the learner groups: group 0 in this process, groups 1 … n−1 in forked
    worker processes, each running its GroupProgram (docs/runtime.md, "Worker processes").

    Args:
        scheduler: the Scheduler.
        fetch: sample indices ``[n]`` → collated batch (the forked workers fetch too).
        seed: seeds each worker's RNG (dropout) differently.
        load: (round, indices ``[k·b]``) → the round's batch here; the workers then receive their
            rows (``Mailbox.batches``). None: they fetch.

    Attributes: ``groups`` (``(device, r0, r1)`` per group), ``programs`` (per group),
    ``sync_worker`` (the worker running the GLOBAL_SYNC; None: this process), ``closed``.
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
        self.own = LearnerGroup(self, 0)
        self.own_learn_span = (0, 0)  # start and end (ns) of group 0's last learning
        self.z_ready_ns = 0  # when the z of the next local update became final (perf_counter_ns)
        self.main_threads = torch.get_num_threads()
        self.closed = False
        self._start_workers(seed)
        if n > 1:  # one intra-op thread here too: the workers have the other cores
            torch.set_num_threads(1)

    def _start_workers(self, seed: int) -> None:
        """Fork a worker per group but group 0 (mailbox, release semaphore, error pipe)."""
        ctx, parent = mp.get_context("fork"), os.getpid()
        self.sems, self.conns, self.procs, self.mail = [None], [None], [None], [None]
        try:
            for wid in self.workers:
                d, r0, r1 = self.groups[wid]
                sem = ctx.Semaphore(0)
                here, there = ctx.Pipe(duplex=False)  # an error's text, worker → here
                mail = Mailbox(ctx, (r1 - r0) * self.sched.batch_size, r1 - r0,
                                len(self.programs[wid].learn), self.sched.states[d].z.dtype,
                                shipped=self.load is not None)
                proc = ctx.Process(
                    target=worker_main, name=f"crossbow-learner-{wid}", daemon=True,
                    args=(self.sched, wid, self, there, mail, sem,
                          seed * 1_000_003 + 7919 * (wid + 1), 1, parent))
                _start_forked(proc)
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
        """``Scheduler.sync_central`` of the groups' partial sums and buffer snapshots."""
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
        """Run round ``round_index`` on the samples ``indices [k·b]``; with ``next_indices`` start
        learning the next round (docs/runtime.md, "Overlap"). On return w, v, z, zbuf are final.

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
        answers = self._collect(round_index, Answer(0, losses, spans, faulty), error)
        self._record(round_index, answers)
        g0 = g1 = time.perf_counter_ns()
        if synchronise:
            if self.sync_worker is None:
                self.own.run_global(round_index)
                g1 = time.perf_counter_ns()
            else:
                ran = answers[self.sync_worker].spans
                g0, g1 = ran.global_start, ran.global_end
        z_at = account_round(self, answers, synchronise, g0, g1)
        if sched.timeline is not None:
            trace_round(self, round_index, answers, z_at, (g0, g1) if synchronise else None,
                        learned)

    def _learn(self, round_index: int, indices: torch.Tensor) -> bool:
        """Start round ``round_index``'s learning unless it runs ahead already (cancelled if its
        indices differ); returns whether it did."""
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

    def _collect(self, round_index: int, own: Answer, own_error: tuple[str, str] | None
                 ) -> list[Answer]:
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
                answers.append(Answer(wid, *reply[1:]))
        if failure is not None:
            self.close()
            raise task_error(self.tasks[failure[0]], round_index, failure[1])
        return answers

    def _record(self, round_index: int, answers: list[Answer]) -> None:
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

    def close(self) -> None:
        """Cancel the speculative round, stop every worker (join, then kill), also mid-round."""
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
        """Tell every worker to stop, wherever it waits (``go``, ``sem``, ``parts``)."""
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
        while not mail.done.acquire(timeout=POLL_S):
            if not proc.is_alive() or time.monotonic() > deadline:
                p = self.programs[wid]
                task = p.learn[0] if p.learn else p.local or self.sched.program.global_sync
                why = (f"worker process {proc.pid} exited with code {proc.exitcode}"
                       if not proc.is_alive() else f"no answer within {ROUND_TIMEOUT_S} s")
                raise task_error(task, round_index, why)
        status, spans, faulty, losses = mail.read()
        if status == OK:
            return "ok", losses, spans, faulty
        if status == CANCELLED:
            return ("cancelled",)
        return self.conns[wid].recv()



class ProcessBackend(Backend):
    """Runs a Scheduler's rounds on a ``ProcessExecutor``, started at the first round and again
    after ``close`` or a failed task.

    Attributes:
        executor: the running ProcessExecutor, or None.
    """

    def __init__(self, sched: "Scheduler") -> None:
        super().__init__(sched)
        self.executor: ProcessExecutor | None = None

    def run_round(self, round_index: int, batch: Any, synchronise: bool,
                  indices: torch.Tensor | None, next_indices: torch.Tensor | None) -> None:
        """Run round ``round_index`` on the samples ``indices`` (``batch`` is None)."""
        sched = self.sched
        if self.executor is None:
            self.executor = ProcessExecutor(sched, sched.fetch_fn, seed=sched.seed + round_index,
                                            load=sched.load_fn)
        try:
            self.executor.run_round(round_index, indices, synchronise, next_indices)
        finally:
            if self.executor.closed:  # a task failed: the executor stopped its workers
                self.executor = None

    @property
    def learning_ahead(self) -> bool:
        return self.executor is not None and self.executor.ahead is not None

    def close(self) -> None:
        """Stop the worker processes (cancelling a speculative round)."""
        if self.executor is not None:
            executor, self.executor = self.executor, None
            executor.close()


def _start_forked(proc: Any) -> None:
    """``proc.start()`` without Python 3.12's warning at a fork of a multi-threaded process. Our
    threads are torch's intra-op pool and helper threads; the worker takes no lock they may
    hold, starts no thread team in the fork (``worker_main`` sets one intra-op thread first) and
    multiprocessing ends it with ``os._exit``: the fork is safe."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", FORK_WARNING, DeprecationWarning)
        proc.start()
