"""The CUDA-streams backend: the inline backend's tasks issued on CUDA streams with events for
their dependencies, faults and timings read a round late (docs/runtime.md, "Streams on CUDA")."""

from __future__ import annotations

import time
from typing import Any, Callable

import torch

from ....compiler.tasks import Task
from ...data.prefetch import device_parts
from ...rounds.context import RunContext
from ...rounds.env import RoundEnv
from ...rounds.interpreter import RoundInterpreter
from ..inline import InlineBackend
from .discipline import CudaStreams, StreamOps

__all__ = ["StreamsBackend"]


class StreamsBackend(InlineBackend):
    """Runs rounds on ``CudaStreams`` through ``ops`` (``StreamOps`` on CUDA devices; the seam
    where crossbow_graph/testing's simulated streams run on CPU devices)."""

    def __init__(self, ctx: RunContext, ops: StreamOps) -> None:
        super().__init__(ctx)
        self.ops = ops
        self._cuda: CudaStreams | None = None
        self._origin_ns = 0
        self._late: list[tuple[int, int, int, torch.Tensor, Any]] = []  # (t, d, a, host, event)
        self._buf_snapshot: dict[int, torch.Tensor] = {}

    @property
    def cuda_streams(self) -> CudaStreams:
        """The streams, made at first use (again after ``drop_streams``)."""
        if self._cuda is None:
            self._cuda = CudaStreams(self.ctx.states, self.ops)
            self._origin_ns = time.perf_counter_ns()
        return self._cuda

    def drop_streams(self) -> None:
        """Forget the streams (a re-plan, a failed capture): the next round makes new ones."""
        self._cuda = None

    def run_env(self, env: RoundEnv) -> None:
        streams = self.cuda_streams
        env.on_device = True  # faults found without a host read, recorded a round late
        streams.begin_round(env.batch, env.copied)
        self.run(self.ctx.order, env)
        streams.end_round()  # the last round's fault flags and timings: done by now, or soon
        self.take_late_faults(block=False, before=env.round_index)
        self.take_spans(block=False)

    def run_task(self, task: Task, env: RoundEnv) -> None:
        RoundInterpreter.run_task(self, task, env)  # timed on the GPU by events (take_spans)

    def on_stream(self, kind: str, label: Any, env: RoundEnv, d: int = 0, r0: int = 0):
        streams = self._cuda
        if streams is None:
            return super().on_stream(kind, label, env, d, r0)
        label = (label, env.round_index)
        if kind == "learn":
            return streams.learn(label, d, r0, after_global=env.sync.waits_for_global)
        if kind == "local":
            return streams.local(label, d)
        return streams.global_(label)

    def after_local(self, env: RoundEnv, d: int, a: int, b: int, faulty: Any) -> None:
        """Snapshot the rows' buffers, keep acc_d alive for the global stream, note the fault
        mask."""
        self._snapshot_buffers(env, d, a, b)
        self._cuda.keep_for_global([env.accs[d], self._buf_snapshot.get(d)])
        if not isinstance(faulty, list):
            self._note_faults(d, a, faulty, env.round_index)

    def global_buffers(self) -> list[torch.Tensor]:
        return [self._buf_snapshot.get(d, s.buf) for d, s in enumerate(self.ctx.states)]

    def _snapshot_buffers(self, env: RoundEnv, d: int, a: int, b: int) -> None:
        """In a round that synchronises, copy rows a … b−1 of ``buf`` for the global sync (the
        next round's BatchNorm forward may update ``buf`` meanwhile)."""
        buf = self.ctx.states[d].buf
        if not (env.synchronise and buf.shape[1]):
            return
        snap = self._buf_snapshot.get(d)
        if snap is None or snap.shape != buf.shape:
            snap = self._buf_snapshot[d] = torch.empty_like(buf)
        snap[a:b].copy_(buf[a:b])

    def _note_faults(self, d: int, a: int, mask: torch.Tensor, round_index: int) -> None:
        """A local sync's fault mask ``[n]`` on the device: into ``fault_masks``, and to the host
        behind an event (recorded a round late)."""
        ctx = self.ctx
        state = ctx.states[d]
        full = ctx.fault_masks[d]
        if full is None or full.shape[0] != state.m:
            full = ctx.fault_masks[d] = torch.zeros(state.m, dtype=torch.bool, device=mask.device)
            self._cuda.ops.keep_alive(full, self._cuda.default[d])  # read there (the metrics)
        full[a:a + len(mask)].copy_(mask)
        if self.reads_masks_late:
            self.read_late(d, a, mask, self._cuda.sync_stream[d], round_index)

    reads_masks_late = True  # a graph round copies its masks after the replay instead

    def share_faults(self, count: torch.Tensor, round_index: int) -> None:
        self.read_late(-1, 0, count, self._cuda.global_stream, round_index)  # every rank: the same round

    def read_late(self, d: int, a: int, t: torch.Tensor, stream: Any, round_index: int) -> None:
        """Copy ``t`` (device d's fault mask from row a, or with d = −1 the ranks' fault count)
        to host memory behind an event on ``stream``."""
        pinned = t.device.type == "cuda"
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=pinned)
        host.copy_(t, non_blocking=pinned)
        event = self._cuda.ops.new_event()
        self._cuda.ops.record(event, stream)
        self._late.append((round_index, d, a, host, event))

    def take_late_faults(self, *, block: bool, before: int | None = None,
                         counts: bool = True) -> None:
        """Record the faults of the rounds before ``before`` (every round with ``block``);
        ``counts=False`` leaves the ranks' counts for later.

        Raises:
            DivergenceError: as ``FaultMonitor.record`` and ``FaultMonitor.share``."""
        ctx = self.ctx
        pending, self._late = self._late, []
        for i, (t, d, a, host, event) in enumerate(pending):
            if not block and t >= before:
                self._late += pending[i:]
                break
            if d < 0 and not counts:
                self._late.append(pending[i])
                continue
            self._cuda.ops.wait_host(event)
            if d < 0:  # the ranks' count of new faults of round t's all-reduce
                if host.item() > 0:
                    ctx.faults.share(ctx.comm, t, ctx.num_learners, self._settled_z(0))
                continue
            rows = [a + r for r in host.nonzero().flatten().tolist()]
            if rows and ctx.states[d].optim_rows is not None:
                ctx.states[d].optim_rows.reset(rows)  # their next step starts fresh
            ctx.faults.record(ctx.states[d], rows, round_index=t, num_learners=ctx.num_learners,
                              rank=ctx.rank, settled_z=self._settled_z(d))

    def _settled_z(self, d: int) -> Callable[[], torch.Tensor]:
        """Device d's z once every stream's work so far is done (read only for an error)."""
        def settled() -> torch.Tensor:
            self.join()
            self._cuda.ops.synchronize([s.torch_device for s in self.ctx.states])
            return self.ctx.states[d].z
        return settled

    def take_spans(self, *, block: bool) -> None:
        """The GPU times of the finished tasks into ``sync_seconds``, ``sync_exposed_seconds``
        (a global sync: the part no learner span overlaps) and the timeline."""
        ctx = self.ctx
        timeline = ctx.fit.timeline if ctx.fit is not None else None
        spans = self._cuda.take_spans(block=block)
        learning = [(t0, t1) for _, kind, _, t0, t1 in spans if kind == "learn"]
        for (task_id, round_index), kind, d, t0, t1 in spans:
            if kind != "learn":
                ctx.clock.sync_s += (t1 - t0) / 1e3
                hidden = sum(max(0.0, min(t1, b) - max(t0, a)) for a, b in learning) \
                    if kind == "global" else 0.0
                ctx.clock.exposed_s += max(0.0, t1 - t0 - hidden) / 1e3
            if timeline is not None:
                timeline.span(task_id, self._origin_ns + int(t0 * 1e6),
                                    self._origin_ns + int(t1 * 1e6), lane=f"{kind} stream",
                                    round_index=round_index)

    # -- between rounds -------------------------------------------------------------------------

    def prefetch(self, round_index: int, indices: torch.Tensor, b: int) -> None:
        """Load round ``round_index``'s batch now and copy each device's rows on its copy stream
        (``CudaStreams.copy_in``) into ``RunContext.batch_ahead``."""
        self.copy_ahead(round_index, indices, self.ctx.fit.load_batch(round_index, indices), b)

    def copy_ahead(self, round_index: int, indices: torch.Tensor, batch: Any, b: int) -> None:
        """Copy round ``round_index``'s loaded ``batch`` (of the samples ``indices``, b per
        learner) to the devices on their copy streams, into ``RunContext.batch_ahead``."""
        ctx = self.ctx
        first = ctx.program.first
        bounds = [(first[d] * b, (first[d] + s.m) * b) for d, s in enumerate(ctx.states)]
        ctx.batch_ahead.put(round_index, indices,
                            *self.cuda_streams.copy_in(device_parts(batch, bounds)))

    def join(self) -> None:
        if self._cuda is not None:
            self._cuda.join()

    def flush(self) -> None:
        """``join``, the host waits for the GPU, the faults and timings so far are recorded."""
        if self._cuda is not None:
            self.join()
            self._cuda.ops.synchronize([s.torch_device for s in self.ctx.states])
            self.take_late_faults(block=True, counts=False)
            self.take_spans(block=True)

    def finish(self) -> None:
        self.flush()
        if self._cuda is not None:  # every rank ends the fit: the last counts are shared
            self.take_late_faults(block=True)

    def close(self) -> None:
        """A re-plan: the work so far completes, the next round makes new streams."""
        if self._cuda is not None:
            self.flush()
        self._cuda = None
