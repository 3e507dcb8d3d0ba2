"""Learner worker processes on the CPU: the process executor (docs/design-overview.md §2 overlap, §5).

The learner groups of ``worker_groups`` (contiguous rows ``r0 … r1−1`` of one device's replicas,
at most one per core) run in as many processes: group 0 in this process (the coordinator), the
others in forked workers. The flat buffers ``w, v, g, buf, z, z_prev, zbuf`` (and the replicas'
integer buffers) live in shared memory, so every process sees the same numbers, and so do the
messages: each worker has a ``_Mailbox`` of small shared arrays and semaphores (no pipe, no
pickling on the hot path). Per round t this process writes t and each worker's sample indices
into the worker's mailbox and releases its ``go`` semaphore; the worker fetches its samples from
its forked copy of the dataset and learns, as this process learns group 0. When z_t is ready
this process writes lr, α, whether to synchronise and the optimizer's settings to a shared
control block and releases each worker's semaphore; every group applies its rows' local update
(the correction with z_t) and writes its partial sum of corrections. The last worker then waits
until every group has written its own (the ``parts`` semaphore) and runs the global sync of round
t (``Scheduler.global_sync``: z_{t+1} on every device), unless a group failed or every learner
was faulty (z is then untouched and this process raises); under torchrun this process runs it
instead, since it owns the all-reduce. Each worker answers with its losses and timestamps (an
error's text alone goes through a pipe). When the next round's samples are known and no hook
writes the replicas, each group starts learning round t+1 right after its local update of round
t, so learning overlaps the global sync and the hooks, and learner j's round t+1 waits only for
its own correction; the worker that runs the global sync runs it before its own next learning
(one core per process: the sync takes some process's time, and that one has no hooks to run).
Every process has one intra-op thread (fork safety, see ``_worker_main``), but for a coordinator
without workers. Each worker seeds torch's CPU generator, Python's ``random`` and NumPy's global
RNG every round from (fit seed, round, rank, worker) before it fetches (``seed_host_rngs``): a
Dataset's augmentation draws differ between processes, and reproduce (also after a resume).
Fused learners get one group per device: vmap draws a group's dropout masks at once, from one
seed, so a device split over processes would draw other masks than the inline executor.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import random
import time
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import torch

from ..compiler.tasks import TaskKind
from ..config import SGD
from ..errors import TaskError
from ._learners import learn_group, learner_seed, rows, seed_host_rngs
from .inputs import split_inputs

if TYPE_CHECKING:
    from .scheduler import Scheduler

__all__ = ["ProcessExecutor", "worker_groups", "fork_available", "available_cores", "choose_onednn",
           "CPU_CONV_CHOICES"]

CPU_CONV_CHOICES = ("auto", "onednn", "aten")
BIG_STEP_S = 0.3  # choose_onednn: a learner step slower than this is not measured (oneDNN)

_POLL_S = 0.5          # how often a blocked wait checks that the other side is alive
ERROR_TEXT_MAX = 8000  # characters of a worker's error text kept in a TaskError
_OK, _ERROR, _CANCELLED = 1, 2, 3  # a worker's answer (_Mailbox.reply[0])
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


_ONEDNN_CHOICES: dict[tuple, bool] = {}  # choose_onednn's measurements in this process


def choose_onednn(scheduler: "Scheduler", fetch: Callable[[torch.Tensor], Any]) -> bool:
    """Whether the worker processes run convolutions with oneDNN (else ATen's own kernels).

    ``scheduler.cpu_conv``: ``"onednn"`` or ``"aten"`` decide; ``"auto"`` (default) measures
    one learner's forward and backward at b in this process, single-threaded (as a worker runs),
    on a copy of the model and the dataset's first b samples: each library MEASURE_REPS times,
    interleaved, each time the fastest step of at least MEASURE_STEPS steps and MEASURE_S
    seconds (but at most 5·MEASURE_S seconds after one step, for a slow model); ATen is chosen
    only if its fastest step was at least 5% faster. The choice is kept
    per scheduler and b, and in this process per (model class, parameters, b, input shapes), so
    that plans of the same model (the auto-tuner's, a benchmark's) run the same kernels. A model
    whose first step takes more than BIG_STEP_S gets oneDNN unmeasured (measuring would cost
    seconds, and large models run faster with oneDNN). Neither torch's RNG nor any replica is
    touched. Which library wins depends on the model and b (docs/runtime.md has a table).
    The two libraries round differently, so two fits that chose differently agree to float
    tolerance, not bit for bit; set ``cpu_conv`` to fix the choice.

    Raises:
        ValueError: ``scheduler.cpu_conv`` is not one of CPU_CONV_CHOICES.
    """
    if scheduler.cpu_conv not in CPU_CONV_CHOICES:
        raise ValueError(f"scheduler.cpu_conv={scheduler.cpu_conv!r}: use one of {CPU_CONV_CHOICES}")
    if scheduler.cpu_conv != "auto":
        return scheduler.cpu_conv == "onednn"
    b = scheduler.settings.batch_size
    cached = scheduler._onednn_choice.get(b)
    if cached is not None:
        return cached
    import copy

    state = scheduler.states[0]
    with torch.random.fork_rng(devices=[]), _host_rngs_kept():  # as if never fetched
        batch = fetch(torch.arange(b))
    args, kwargs, target = split_inputs(batch)
    shapes = tuple((tuple(t.shape), t.dtype) for t in (*args, *kwargs.values(), target)
                   if isinstance(t, torch.Tensor))
    key = (type(state.template).__qualname__, state.params.size, state.buffers.size, b, shapes)
    choice = _ONEDNN_CHOICES.get(key)
    if choice is None:
        model = copy.deepcopy(state.template).train()
        saved_threads, saved_onednn = torch.get_num_threads(), torch.backends.mkldnn.enabled
        try:
            torch.set_num_threads(1)
            with torch.random.fork_rng(devices=[]):
                best = _step_seconds(model, scheduler.loss_fn, args, kwargs, target)
        except Exception:  # noqa: BLE001 - a failing model fails in its first round, as a TaskError
            return True
        finally:
            torch.set_num_threads(saved_threads)
            torch.backends.mkldnn.enabled = saved_onednn
        choice = _ONEDNN_CHOICES[key] = not best[False] < 0.95 * best[True]
    scheduler._onednn_choice[b] = choice
    return choice


MEASURE_REPS, MEASURE_STEPS, MEASURE_S = 3, 5, 0.02  # choose_onednn's measurement


@contextlib.contextmanager
def _host_rngs_kept():
    """Restore Python's ``random`` and NumPy's global RNG states on exit."""
    py, npy = random.getstate(), np.random.get_state()
    try:
        yield
    finally:
        random.setstate(py)
        np.random.set_state(npy)


def _step_seconds(model, loss_fn, args, kwargs, target) -> dict[bool, float]:
    """The fastest forward + backward step, keyed by oneDNN on/off (see choose_onednn); a
    model slower than BIG_STEP_S gets ``{True: 0.0, False: inf}`` after one step."""
    best = {True: float("inf"), False: float("inf")}
    for _ in range(MEASURE_REPS):
        for onednn in (True, False):
            torch.backends.mkldnn.enabled = onednn
            start = time.perf_counter()
            loss_fn(model(*args, **kwargs), target).backward()  # warm-up
            end = time.perf_counter()
            if onednn and end - start > BIG_STEP_S:  # a large model: oneDNN, unmeasured
                return {True: 0.0, False: float("inf")}
            steps, t0 = 0, end  # ≥ MEASURE_STEPS steps and MEASURE_S, ≤ 5·MEASURE_S (≥ 1 step)
            while steps < 1 or ((steps < MEASURE_STEPS or end - t0 < MEASURE_S)
                                and end - t0 < 5 * MEASURE_S):
                start = time.perf_counter()
                loss_fn(model(*args, **kwargs), target).backward()
                end = time.perf_counter()
                best[onednn] = min(best[onednn], end - start)
                steps += 1
    return best


class _Mailbox:
    """One worker's messages in shared memory: two slots of (round, sample indices), written by
    the coordinator, and one answer (status, round, six timestamps, faulty rows, losses), written
    by the worker; each direction is announced by a semaphore release, which also orders the
    memory accesses. Two slots are enough: the coordinator writes round t + 2 only after the
    worker answered round t, and the worker reads round t + 1's slot before it answers round t + 1.

    Args:
        ctx: the multiprocessing context (fork).
        n_indices: sample indices per round, (r1 − r0)·b.
        n_rows: the worker's replicas, r1 − r0.
        loss_dtype: of the losses (the masters': float64 for a float64 model, else float32).
    """

    def __init__(self, ctx, n_indices: int, n_rows: int,
                 loss_dtype: torch.dtype = torch.float32) -> None:
        self.go, self.done = ctx.Semaphore(0), ctx.Semaphore(0)
        self.indices = torch.zeros(2, n_indices, dtype=torch.int64).share_memory_().numpy()
        self.head = torch.zeros(3, dtype=torch.int64).share_memory_().numpy()  # rounds; stop
        # status, round, ta, tb, tc, td, g0, g1, number of faulty rows, the faulty rows
        self.reply = torch.zeros(9 + n_rows, dtype=torch.int64).share_memory_().numpy()
        self._losses = torch.zeros(n_rows, dtype=loss_dtype).share_memory_()
        self.losses = self._losses.numpy()
        self.sent = self.taken = 0  # slots written (coordinator), read (worker)

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

    def answer(self, status: int, round_index: int, spans=(0,) * 6, faulty=(), losses=()) -> None:
        """Worker: the round's answer, then ``done``. ``spans``: learn start and end, local
        update start and end, global sync start and end (0, 0 when the worker ran none)."""
        r = self.reply
        r[0], r[1] = status, round_index
        r[2:8] = spans
        r[8] = len(faulty)
        r[9:9 + len(faulty)] = faulty
        for i, x in enumerate(losses):
            self.losses[i] = float(x)
        self.done.release()

    def read(self) -> tuple:
        """Coordinator, after ``done`` was acquired: (status, spans, faulty rows, losses [n_rows])."""
        r = self.reply
        return (int(r[0]), tuple(int(x) for x in r[2:8]), [int(x) for x in r[9:9 + int(r[8])]],
                self._losses.clone())


class ProcessExecutor:
    """The coordinator's side of the process executor (see the module docstring).

    Learner group 0 (``worker_groups``) runs in this process; groups 1 … n−1 in forked worker
    processes, the last of which also runs the global sync when this process need not (no
    torchrun all-reduce).

    Args:
        scheduler: the Scheduler (its states, tasks, loss, mode, kernels).
        fetch: sample indices ``[n]`` → collated batch; inherited by the forked workers.
        seed: seeds each worker's RNG (dropout) differently.
    """

    def __init__(self, scheduler: "Scheduler", fetch: Callable[[torch.Tensor], Any], *,
                 seed: int) -> None:
        self.sched, self.fetch = scheduler, fetch
        states = scheduler.states
        # fused learners: a device's replicas in one program, whose dropout masks depend on the
        # group (vmap draws them for the whole group at once), hence one group per device
        cores = 1 if scheduler.settings.learner_mode == "fused" else available_cores()
        self.groups = worker_groups([s.m for s in states], cores)
        n = len(self.groups)
        threads = 1  # forked children cannot start OpenMP teams (see _worker_main)
        self.onednn = choose_onednn(scheduler, fetch)
        for s in states:
            s.share_memory()
        p_size, q_size = states[0].params.size, states[0].buffers.size
        self.acc_parts = torch.zeros(n, p_size, dtype=states[0].z.dtype).share_memory_()  # [n, P]
        self.buf_snaps = [s.buf.clone().share_memory_() for s in states]        # [m, Q] per device
        # per group, written before it releases ``parts``: faulty rows, failed (1) or not
        self.part_info = torch.zeros(n, 2, dtype=torch.int64).share_memory_()
        self._part_info_np = self.part_info.numpy()
        self.global_task = next(t for t in scheduler.order if t.kind is TaskKind.GLOBAL_SYNC)
        self.learn_ids, self.local_ids = {}, {}
        for t in scheduler.order:
            if t.kind is TaskKind.LEARN:
                d = scheduler._device_index[t.device]
                self.learn_ids[(d, t.replicas[0] - sum(s.m for s in states[:d]))] = t
            elif t.kind is TaskKind.LOCAL_SYNC:
                self.local_ids[scheduler._device_index[t.device]] = t
        ctx = mp.get_context("fork")
        self.sems, self.conns, self.procs, self.mail = [], [], [], []
        self.firsts = [sum(s.m for s in states[:d]) for d in range(len(states))]
        self.device_rows = [[w for w, g in enumerate(self.groups) if g[0] == d]
                            for d in range(len(states))]
        # lr, α, synchronise, cancel, μ_l, nesterov, λ of the round being released
        self.ctrl = torch.zeros(7, dtype=torch.float64).share_memory_()
        self._ctrl_np = self.ctrl.numpy()  # a view: writes go to the shared block
        self.ahead: tuple[int, torch.Tensor] | None = None  # the speculative round, if any
        # the last worker runs the global sync (after every group's ``parts`` release) unless
        # this process must all-reduce (torchrun) or there is no worker
        self.sync_worker = n - 1 if scheduler.comm is None and n >= 2 else None
        self.parts = ctx.Semaphore(0)
        d0, r0, r1 = self.groups[0]
        self.own_keep = states[d0].buf[r0:r1].clone() if q_size else None  # restored on cancel
        self.own_losses: list[torch.Tensor] = []
        self.own_error: tuple[str, str] | None = None  # (task id, text) of a failed own step
        self.own_learn_span = (0, 0)  # start and end (ns) of group 0's last learning
        self.z_ready_ns = 0  # when the z of the next local update became final (perf_counter_ns)
        self.main_threads = torch.get_num_threads()
        parent = os.getpid()
        try:
            for wid, (d, r0, r1) in enumerate(self.groups):
                if wid == 0:  # run here
                    for x in (self.sems, self.conns, self.mail, self.procs):
                        x.append(None)
                    continue
                sem = ctx.Semaphore(0)
                here, there = ctx.Pipe(duplex=False)  # an error's text, worker → here
                mail = _Mailbox(ctx, (r1 - r0) * scheduler.settings.batch_size, r1 - r0, states[d].z.dtype)
                learn_tasks = [self.learn_ids[(d, r)] for r in range(r0, r1)]
                proc = ctx.Process(
                    target=_worker_main, name=f"crossbow-learner-{wid}", daemon=True,
                    args=(scheduler, wid, self, there, mail, sem,
                          seed * 1_000_003 + 7919 * (wid + 1), threads, parent,
                          [t.id for t in learn_tasks], self.local_ids[d].id))
                proc.start()
                there.close()
                self.sems.append(sem)
                self.conns.append(here)
                self.mail.append(mail)
                self.procs.append(proc)
        except BaseException:
            self.close()
            raise
        if n > 1:  # one intra-op thread here too: the workers have the other cores
            torch.set_num_threads(1)

    @property
    def workers(self) -> range:
        return range(1, len(self.groups))

    def _group_indices(self, indices: torch.Tensor, wid: int) -> torch.Tensor:
        """Group ``wid``'s part of a round's sample indices ``[k·b]``: ``[(r1 − r0)·b]``, int64."""
        d, r0, r1 = self.groups[wid]
        b = self.sched.settings.batch_size
        return indices[(self.firsts[d] + r0) * b:(self.firsts[d] + r1) * b].to(torch.int64)

    def _send_go(self, round_index: int, indices: torch.Tensor) -> None:
        for wid in self.workers:
            self.mail[wid].post(round_index, self._group_indices(indices, wid).numpy())

    def _release(self, *, lr: float, alpha: float, synchronise: bool, cancel: bool) -> None:
        opt = self.sched.settings.optimizer
        self._ctrl_np[:] = (lr, alpha, float(synchronise), float(cancel), opt.momentum,
                            float(opt.nesterov), opt.weight_decay)  # no tensor per round
        for wid in self.workers:
            self.sems[wid].release()

    # -- group 0, in this process ---------------------------------------------------------------

    def _own_learn(self, round_index: int, indices: torch.Tensor) -> None:
        """Group 0's forward and backward for round ``round_index`` (as ``_worker_main``)."""
        sched = self.sched
        d, r0, r1 = self.groups[0]
        state = sched.states[d]
        if self.own_keep is not None:
            self.own_keep.copy_(state.buf[r0:r1])
        ids = [self.learn_ids[(d, r)].id for r in range(r0, r1)]
        start = time.perf_counter_ns()
        saved = torch.backends.mkldnn.enabled
        torch.backends.mkldnn.enabled = self.onednn  # as the workers (choose_onednn)
        try:
            batch = self.fetch(self._group_indices(indices, 0))
            self.own_losses, self.own_error = _learn_rows(sched, d, r0, r1, batch, round_index, ids)
        except Exception as exc:  # the fetch; raised as a TaskError once the workers have answered
            self.own_losses, self.own_error = [], (ids[0], f"{type(exc).__name__}: {exc}")
        finally:
            torch.backends.mkldnn.enabled = saved
            self.own_learn_span = (start, time.perf_counter_ns())  # its end: waiting for z begins

    def _own_local(self, synchronise: bool) -> list[int]:
        """Group 0's local update with z_t; its partial sum and buffers for the global sync."""
        sched = self.sched
        d, r0, r1 = self.groups[0]
        state, faulty = sched.states[d], []
        if self.own_error is None:
            try:
                _, faulty = sched.local_update_rows(state, r0, r1, lr=sched.settings.lr, alpha=sched.alpha,
                                                    synchronise=synchronise, optimizer=sched.optimizer,
                                                    out=self.acc_parts[0], losses=self.own_losses)
                if self.buf_snaps[d].shape[1]:
                    self.buf_snaps[d][r0:r1].copy_(state.buf[r0:r1])
            except Exception as exc:
                self.own_error = (self.local_ids[d].id, f"{type(exc).__name__}: {exc}")
        if synchronise and self.sync_worker is not None:
            self._part_info_np[0] = (len(faulty), int(self.own_error is not None))
            self.parts.release()
        return faulty

    # -- rounds ---------------------------------------------------------------------------------

    def cancel_ahead(self) -> None:
        """Cancel the speculative round being learned (restoring the replicas' buffers)."""
        if self.ahead is None:
            return
        round_index, _ = self.ahead
        self.ahead = None
        self._release(lr=0.0, alpha=0.0, synchronise=False, cancel=True)
        d, r0, r1 = self.groups[0]
        if self.own_keep is not None:
            self.sched.states[d].buf[r0:r1].copy_(self.own_keep)
        self.own_error = None
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
        """
        sched = self.sched
        if self.ahead is not None and (self.ahead[0] != round_index
                                       or not torch.equal(self.ahead[1], indices)):
            self.cancel_ahead()
        learned = self.ahead is not None  # group 0 learned this round in the previous call
        if not learned:
            self._send_go(round_index, indices)
            self._own_learn(round_index, indices)
        self.ahead = None
        ta, tb = self.own_learn_span  # group 0 has waited for z_t since it finished learning
        tc = time.perf_counter_ns()
        self._release(lr=sched.settings.lr, alpha=sched.alpha, synchronise=synchronise, cancel=False)
        own_faulty = self._own_local(synchronise)
        td = time.perf_counter_ns()
        own = (self.own_losses, self.own_error)
        if next_indices is not None:
            self._send_go(round_index + 1, next_indices)
            self._own_learn(round_index + 1, next_indices)
            self.ahead = (round_index + 1, next_indices)
            if sched.timeline is not None:
                d, r0, r1 = self.groups[0]
                sched.timeline.span(f"learn:d{d}:r{r0}-{r1 - 1}", *self.own_learn_span,
                                    lane=self._lane(0), round_index=round_index + 1)
        spans, faults, failure = [(ta, tb, tc, td, 0, 0)], [(self.groups[0][0], own_faulty)], None
        if own[1] is not None:
            failure = ("error", *own[1])
        losses = [torch.stack(own[0]) if own[0] else torch.zeros(0)]
        for wid in self.workers:
            reply = self._recv(wid, round_index)
            if reply[0] == "error" and failure is None:
                failure = reply
            elif reply[0] == "ok":
                losses.append(reply[1])
                spans.append(reply[2])
                faults.append((self.groups[wid][0], reply[3]))
        if failure is not None:
            task = next(t for t in sched.order if t.id == failure[1])
            self.close()
            sched._workers = None
            raise sched.task_error(task, round_index, failure[2])
        for part in losses:
            sched.losses.extend(part.unbind())
        for s in sched.states:
            s.first_step = [False] * s.m
        for d, faulty in faults:  # raises DivergenceError when every learner failed
            sched.faults.record(sched.states[d], faulty, round_index=round_index,
                                num_learners=sched.num_learners, rank=sched.rank)
        g0 = g1 = time.perf_counter_ns()
        if synchronise:
            if self.sync_worker is None:
                self._global_sync(round_index)
                g1 = time.perf_counter_ns()
            else:
                g0, g1 = spans[-1][4], spans[-1][5]
        local_s = sum(td - tc for _, _, tc, td, _, _ in spans) / len(spans) / 1e9
        # a group's wait counts as synchronisation only until z_t was final (the previous
        # global sync's end); after that it waits for this process's release (hooks, bookkeeping)
        z_ready = self.z_ready_ns
        waits = [(tb, max(tb, min(tc, z_ready))) for _, tb, tc, _, _, _ in spans]
        waited_s = sum(z - tb for tb, z in waits) / len(spans) / 1e9 + local_s
        sched.sync_seconds += (g1 - g0) / 1e9 + local_s
        # the sync worker's learners do not learn while it runs the global sync: exposed too
        sync_in_worker = (g1 - g0) / len(spans) / 1e9 if synchronise and self.sync_worker else 0.0
        sched.sync_exposed_seconds += waited_s + sync_in_worker
        if synchronise:
            self.z_ready_ns = g1
        if sched.timeline is not None:
            if synchronise:
                lane = "coordinator" if self.sync_worker is None else self._lane(self.sync_worker)
                sched.timeline.span(self.global_task.id, g0, g1, lane=lane, round_index=round_index)
            for wid, (ta, tb, tc, td, _, _) in enumerate(spans):
                d, r0, r1 = self.groups[wid]
                lane = self._lane(wid)
                if wid or not learned:  # group 0's speculative learning has its span already
                    sched.timeline.span(f"learn:d{d}:r{r0}-{r1 - 1}", ta, tb, lane=lane,
                                        round_index=round_index)
                z_at = waits[wid][1]
                sched.timeline.span("wait for z", tb, z_at, lane=lane, round_index=round_index)
                if tc > z_at:
                    sched.timeline.span("wait for release", z_at, tc, lane=lane,
                                        round_index=round_index)
                sched.timeline.span(self.local_ids[d].id, tc, td, lane=lane, round_index=round_index)

    def _lane(self, wid: int) -> str:
        d, r0, r1 = self.groups[wid]
        who = "coordinator" if wid == 0 else f"worker {wid}"
        return f"{who} (d{d} r{r0}-{r1 - 1})"

    def flush(self) -> None:
        """Nothing is in flight between rounds (z is final when run_round returns)."""

    def _global_sync(self, round_index: int) -> None:
        sched = self.sched
        for d, s in enumerate(sched.states):
            mine = self.device_rows[d]
            s.acc = self.acc_parts[mine[0]] if len(mine) == 1 else self.acc_parts[mine].sum(dim=0)
        sched._synchronise = True
        try:
            sched.global_sync(self.global_task, buffers=self.buf_snaps)
        except TaskError:  # already names the task and round (DistributedError)
            raise
        except Exception as exc:
            raise sched.task_error(self.global_task, round_index, f"{type(exc).__name__}: {exc}") from exc

    def close(self) -> None:
        """Cancel the speculative round, stop every worker (join, then terminate, then kill)."""
        try:
            if self.ahead is not None and all(p.is_alive() for p in self.procs if p is not None):
                self.cancel_ahead()
        except Exception:  # noqa: BLE001 - a dead worker: it is killed below
            pass
        finally:
            self.ahead = None
            for mail in self.mail:
                if mail is not None:
                    mail.stop()
            for proc in self.procs:
                if proc is None:
                    continue
                proc.join(timeout=5)
                if proc.is_alive():
                    proc.terminate()
                    proc.join(timeout=2)
                if proc.is_alive():
                    proc.kill()
                    proc.join(timeout=2)
            for conn in self.conns:
                if conn is not None:
                    conn.close()
            self.conns, self.procs, self.mail = [], [], []
            torch.set_num_threads(self.main_threads)

    def _recv(self, wid: int, round_index: int):
        """Worker ``wid``'s answer: ("ok", losses [n], spans, faulty rows), ("cancelled",) or
        ("error", task id, text)."""
        mail, proc = self.mail[wid], self.procs[wid]
        deadline = time.monotonic() + ROUND_TIMEOUT_S
        while not mail.done.acquire(timeout=_POLL_S):
            if not proc.is_alive() or time.monotonic() > deadline:
                d, r0, _ = self.groups[wid]
                task = self.learn_ids[(d, r0)]
                why = (f"worker process {proc.pid} exited with code {proc.exitcode}"
                       if not proc.is_alive() else f"no answer within {ROUND_TIMEOUT_S} s")
                raise self.sched.task_error(task, round_index, why)
        status, spans, faulty, losses = mail.read()
        if status == _OK:
            return "ok", losses, spans, faulty
        if status == _CANCELLED:
            return ("cancelled",)
        return self.conns[wid].recv()


def _learn_rows(sched: "Scheduler", d: int, r0: int, r1: int, batch: Any, round_index: int,
                learn_ids: list[str]) -> tuple[list[torch.Tensor], tuple[str, str] | None]:
    """Rows ``r0 … r1−1`` of device ``d`` learn round ``round_index`` on ``batch`` (their
    (r1 − r0)·b samples), in this process, in the scheduler's learner mode, each replica's RNG
    seeded by ``learner_seed``. Returns (the losses, None) or ([], (failing task id, error text)).
    """
    b, state = sched.settings.batch_size, sched.states[d]
    first = sched.learner_offset + sum(s.m for s in sched.states[:d])  # global index of row 0
    task_id, losses = learn_ids[0], []
    try:
        if sched.settings.learner_mode == "fused":
            return learn_group(state, r0, r1, batch, sched.loss_fn, b, "fused", sched.fused[d],
                               rng_seed=learner_seed(sched.seed, round_index, first + r0)), None
        for r in range(r0, r1):
            task_id = learn_ids[r - r0]
            mine = rows(batch, (r - r0) * b, (r - r0 + 1) * b)
            losses += learn_group(state, r, r + 1, mine, sched.loss_fn, b, "per_replica", None,
                                  rng_seed=learner_seed(sched.seed, round_index, first + r))
        return losses, None
    except Exception as exc:  # the caller reports it as a TaskError naming the task
        return [], (task_id, f"{type(exc).__name__}: {exc}")


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
                 seed: int, threads: int, parent: int, learn_ids: list[str], local_id: str) -> None:
    """The loop of worker ``wid`` (forked: it shares the scheduler's state, the dataset and the
    executor's shared blocks).

    Per round: take (round, indices) from the mailbox; learn; wait for the semaphore (z ready);
    read lr, α, synchronise, cancel and the optimizer's μ_l, Nesterov, λ from ``ex.ctrl``; if
    cancelled (a speculative round that will not run) restore the float buffers and answer
    "cancelled", else apply the local update, write the group's partial sum of corrections, and
    (in a synchronising round) announce it on ``ex.parts``; the sync worker instead waits for
    every other group's and runs the global sync (skipped when a group failed or every learner
    was faulty: the coordinator then raises, with z untouched). Then answer with the losses,
    timestamps and faulty rows. Every round consumes exactly one semaphore release.
    """
    # GNU OpenMP cannot start a thread team in a forked child of a process that used one: the
    # team barrier waits forever for threads that do not exist here. So a worker runs one
    # intra-op thread: ATen then never enters an OpenMP region, and oneDNN (left on, torch's
    # default) creates its own single-threaded primitives, because its primitive cache is keyed
    # by the thread count. Whether oneDNN or ATen's own convolutions run is measured
    # (choose_onednn). Parallelism comes from the workers.
    torch.set_num_threads(threads)
    torch.backends.mkldnn.enabled = ex.onednn  # choose_onednn
    torch.manual_seed(seed)
    d, r0, r1 = ex.groups[wid]
    state = sched.states[d]
    keep = state.buf[r0:r1].clone() if state.buf.shape[1] else None  # restored on cancel
    acc_part, buf_snap = ex.acc_parts[wid], ex.buf_snaps[d] if state.buf.shape[1] else None
    info, others = ex._part_info_np, len(ex.groups) - 1
    syncs = ex.sync_worker == wid
    rank = sched.comm.rank if sched.comm is not None else 0
    try:
        while True:
            if not _wait(lambda: mail.go.acquire(timeout=_POLL_S), parent):
                return
            msg = mail.take()
            if msg is None:
                return
            round_index, idx = msg
            ta = time.perf_counter_ns()
            seed_host_rngs(sched.seed, round_index, rank, wid, torch_cpu=True)  # for the fetch
            if keep is not None:
                keep.copy_(state.buf[r0:r1])
            try:
                losses, failed = _learn_rows(sched, d, r0, r1, ex.fetch(idx), round_index, learn_ids)
            except Exception as exc:  # the fetch
                losses, failed = [], (learn_ids[0], f"{type(exc).__name__}: {exc}")
            task_id, error = failed if failed is not None else (learn_ids[0], None)
            tb = time.perf_counter_ns()
            if not _wait(lambda: sem.acquire(timeout=_POLL_S), parent):
                return
            tc = time.perf_counter_ns()
            lr, alpha, synchronise, cancel, momentum, nesterov, weight_decay = ex.ctrl.tolist()
            if cancel:
                if keep is not None:
                    state.buf[r0:r1].copy_(keep)
                mail.answer(_CANCELLED, round_index)
                continue
            faulty = []
            if error is None:
                try:
                    task_id = local_id
                    optimizer = SGD(lr=lr, momentum=momentum, nesterov=bool(nesterov),
                                    weight_decay=weight_decay)
                    _, faulty = sched.local_update_rows(state, r0, r1, lr=lr, alpha=alpha,
                                                        synchronise=bool(synchronise),
                                                        optimizer=optimizer, out=acc_part,
                                                        losses=losses)
                    if buf_snap is not None:
                        buf_snap[r0:r1].copy_(state.buf[r0:r1])
                except Exception as exc:
                    error = f"{type(exc).__name__}: {exc}"
            td = time.perf_counter_ns()
            g0 = g1 = 0
            if synchronise and ex.sync_worker is not None:
                if not syncs:
                    info[wid] = (len(faulty), int(error is not None))
                    ex.parts.release()
                else:
                    for _ in range(others):  # every other group's partial sum (ours is written)
                        if not _wait(lambda: ex.parts.acquire(timeout=_POLL_S), parent):
                            return
                    info[wid] = (len(faulty), int(error is not None))
                    if not info[:, 1].any() and int(info[:, 0].sum()) < sched.num_learners:
                        g0 = time.perf_counter_ns()
                        try:
                            ex._global_sync(round_index)
                        except Exception as exc:  # a TaskError already: keep what it wraps
                            cause = exc.__cause__ or exc
                            if error is None:
                                task_id, error = ex.global_task.id, f"{type(cause).__name__}: {cause}"
                        g1 = time.perf_counter_ns()
            if error is not None:  # the answer first: the coordinator then reads the pipe
                mail.answer(_ERROR, round_index)
                conn.send(("error", task_id, _shorten(error)))
                continue
            mail.answer(_OK, round_index, (ta, tb, tc, td, g0, g1), faulty, losses)
    except (KeyboardInterrupt, EOFError, BrokenPipeError):
        return

