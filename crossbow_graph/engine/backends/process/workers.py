"""The worker processes of an executor: each forked with the ``Crew`` and runs one learner
group's share of every round (``worker_main``); ``Workers`` starts, answers and stops them
(docs/runtime.md, "Worker processes")."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
import warnings
from typing import Any

import torch

from ...learning.learners import seed_host_rngs
from ...rounds.interpreter import task_error
from .groups import Crew, LearnerGroup
from .mailbox import CANCELLED, ERROR, OK, POLL_S, Mailbox, Spans, shorten, wait_alive

__all__ = ["Workers", "worker_main", "ROUND_TIMEOUT_S"]

FORK_WARNING = r"This process .*is multi-threaded, use of fork\(\) may lead to deadlocks"  # 3.12

ROUND_TIMEOUT_S = 600  # the longest the coordinator waits for one worker's round


class Workers:
    """Groups 1 … n−1 of a ``Crew``, each in a forked worker process with its ``Mailbox``, a
    release semaphore and an error pipe.

    Args:
        crew: what the groups share.
        b: samples per learner (each worker's indices per round).
        seed: seeds each worker's RNG differently.
        shipped: whether the coordinator loads the rounds and sends the workers their rows."""

    def __init__(self, crew: Crew, *, b: int, seed: int, shipped: bool) -> None:
        ctx, parent = mp.get_context("fork"), os.getpid()
        self.crew = crew
        self.sems, self.conns, self.procs, self.mail = [None], [None], [None], [None]
        try:
            for wid in range(1, len(crew.groups)):
                d, r0, r1 = crew.groups[wid]
                sem = ctx.Semaphore(0)
                here, there = ctx.Pipe(duplex=False)  # an error's text, worker → here
                mail = Mailbox(ctx, (r1 - r0) * b, r1 - r0, len(crew.programs[wid].learn),
                               crew.ctx.states[d].z.dtype, shipped=shipped)
                proc = ctx.Process(target=worker_main, name=f"crossbow-learner-{wid}", daemon=True,
                                   args=(crew, wid, there, mail, sem,
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
    def ids(self) -> range:
        return range(1, len(self.crew.groups))

    def release(self) -> None:
        """Let every worker read the release (``Crew.write_release``)."""
        for wid in self.ids:
            self.sems[wid].release()

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs if p is not None)

    def recv(self, wid: int, round_index: int):
        """Worker ``wid``'s answer: ("ok", losses [n], Spans, faulty rows), ("cancelled",) or
        ("error", task id, text).

        Raises:
            TaskError: the worker exited, or gave no answer within ``ROUND_TIMEOUT_S``."""
        mail, proc = self.mail[wid], self.procs[wid]
        deadline = time.monotonic() + ROUND_TIMEOUT_S
        while not mail.done.acquire(timeout=POLL_S):
            if not proc.is_alive() or time.monotonic() > deadline:
                p = self.crew.programs[wid]
                task = p.learn[0] if p.learn else p.local or self.crew.ctx.program.global_sync
                why = (f"worker process {proc.pid} exited with code {proc.exitcode}"
                       if not proc.is_alive() else f"no answer within {ROUND_TIMEOUT_S} s")
                raise task_error(task, round_index, why)
        status, spans, faulty, losses = mail.read()
        if status == OK:
            return "ok", losses, spans, faulty
        if status == CANCELLED:
            return ("cancelled",)
        return self.conns[wid].recv()

    def close(self) -> None:
        """Stop every worker (join, then kill), wherever it waits."""
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

    def _wake_to_stop(self) -> None:
        """Tell every worker to stop, wherever it waits (``go``, ``sem``, ``parts``)."""
        crew = self.crew
        for mail in self.mail:
            if mail is not None:
                mail.stop()
        crew.write_release(None)  # cancel
        crew.part_info[:, 1] = 1
        for sem in self.sems:
            if sem is not None:
                sem.release()
        for _ in crew.groups:
            crew.parts.release()


def worker_main(crew: Crew, wid: int, conn, mail: Mailbox, sem, seed: int, threads: int,
                parent: int) -> None:
    """The loop of worker ``wid`` (forked: it shares the plan's state, the dataset and the
    crew's shared blocks): group ``wid``'s GroupProgram every round, one semaphore release per
    round (docs/runtime.md, "Executors")."""
    # GNU OpenMP cannot start a thread team in a forked child of a process that used one: the
    # team barrier waits forever for threads that do not exist here. So a worker runs one
    # intra-op thread: ATen then never enters an OpenMP region, and oneDNN (left on, torch's
    # default) creates its own single-threaded primitives, because its primitive cache is keyed
    # by the thread count. Whether oneDNN or ATen's own convolutions run is measured
    # (choose_onednn). Parallelism comes from the workers.
    torch.set_num_threads(threads)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the coordinator's to handle: it stops us
    torch.backends.mkldnn.enabled = crew.onednn  # choose_onednn
    torch.manual_seed(seed)
    group, ctx = LearnerGroup(crew, wid, mail), crew.ctx
    rank = ctx.rank or 0
    try:
        while wait_alive(lambda: mail.go.acquire(timeout=POLL_S), parent):
            msg = mail.take()
            if msg is None:
                return
            round_index, idx = msg
            ta = time.perf_counter_ns()
            seed_host_rngs(ctx.fit.seed, round_index, rank, wid, torch_cpu=True)  # for the fetch
            group.learn_round(round_index, idx)
            tb = time.perf_counter_ns()
            if not wait_alive(lambda: sem.acquire(timeout=POLL_S), parent):
                return
            tc = time.perf_counter_ns()
            released = crew.read_release(round_index)
            if released is None:  # cancelled
                group.cancel()
                mail.answer(CANCELLED, round_index)
                continue
            group.local_round(released)
            td = time.perf_counter_ns()
            span = _sync_part(group, released.synchronise, parent)
            if span is None:
                return
            g0, g1 = span
            if group.error is not None:  # the answer first: the coordinator then reads the pipe
                mail.answer(ERROR, round_index)
                conn.send(("error", group.error[0], shorten(group.error[1])))
                continue
            mail.answer(OK, round_index, Spans(ta, tb, tc, td, g0, g1), group.faulty, group.losses)
    except (KeyboardInterrupt, EOFError, BrokenPipeError):
        return


def _sync_part(group: LearnerGroup, synchronise: bool, parent: int) -> tuple[int, int] | None:
    """In a round that synchronises: the sync worker waits for every part and runs the
    GLOBAL_SYNC, another announces its part. Returns the span of the global sync this worker ran
    (ns; (0, 0): none), None if the parent died."""
    sync_worker = group.crew.sync_worker
    if synchronise and sync_worker == group.wid:
        return group.sync_round(parent)
    if synchronise and sync_worker is not None:
        group.announce()
    return 0, 0


def _start_forked(proc: Any) -> None:
    """``proc.start()`` without Python 3.12's warning at a fork of a multi-threaded process. Our
    threads are torch's intra-op pool and helper threads; the worker takes no lock they may
    hold, starts no thread team in the fork (``worker_main`` sets one intra-op thread first) and
    multiprocessing ends it with ``os._exit``: the fork is safe."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", FORK_WARNING, DeprecationWarning)
        proc.start()
