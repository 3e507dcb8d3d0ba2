"""Stream discipline of the inline executor on CUDA devices (docs/runtime.md "Streams").

Every learner group of a device has its own stream ``L``; each device has a sync stream ``S_d`` for
its LOCAL_SYNC; the GLOBAL_SYNC runs on a global stream ``G`` on the first device (and, for its
copies to and from another device d, on ``S_d``). The default stream ``D`` is the caller's: the
trainer's batch gather and transfer, evaluation, checkpoints, ``Plan.set_replicas`` and policies
reset or read state on it. A round's batch copied ahead (``copy_in``, engine/prefetch.py) is
copied on each device's copy stream ``C_d`` while the round before runs. Every round:

1. ``begin_round``: an event ``start_t`` on each device's ``D`` after the round's batch is there.
2. A learner group on ``L`` waits for ``start_t``, for its device's copy of the round's batch
   (if copied ahead), and for its device's last local sync (its own
   correction; under a sync algorithm whose global sync writes every w, S-SGD's or DiLoCo's,
   also for the last global sync: ``SyncAlgorithm.waits_for_global``), then
   reads w[j] and its batch (kept alive for ``L`` with ``record_stream``) and writes g[j] and
   buf[j].
3. The local sync on ``S_d`` waits for every learner group of the device in this round (and so
   for ``start_t``) and for the last global sync (z, zbuf: the update's pull and a fault's reset read them);
   it writes w, v, g of its rows, their sum acc_d and, in a round that synchronises, a snapshot
   of the rows' float buffers (the global sync reads the snapshot, so round t+1's BatchNorm
   forward may update buf meanwhile). Event ``local_done_t[d]``.
4. The global sync on ``G`` waits for every ``local_done_t``; with several devices
   each device d's part (its acc_d's copy out, z's copy in) runs on ``S_d``, which is current on d
   while ``G`` is current on the first device (a copy between devices runs on the source device's
   current stream). Events ``global_done_t`` on ``G`` and on each such ``S_d``.
5. ``end_round``: ``D`` waits for the round's learners (their losses are read there), never
   for a sync inside a round, so the global sync of round t overlaps the learning of round
   t+1 (learners wait for their own local sync only). ``join`` (``Scheduler.flush``) makes ``D`` wait for every stream's last event:
   whatever the caller reads or writes on ``D`` afterwards is ordered after the rounds so far, and
   the next round's streams are ordered after it by ``start_t``.

``StreamOps`` is the one place that touches ``torch.cuda``'s streams and events; a
``RaceRecorder`` (engine/race_check.py) stands in for it on CPU devices, running the same
discipline on simulated streams and reporting every pair of unordered accesses, so the ordering is
tested without a GPU. A round captured in a CUDA graph (engine/graphs.py) runs the same
discipline with ``captured`` set and between two ``seal``s, so that every event it waits for is
its own. ``delay`` makes one kind of stream sleep at the start of its work
(``torch.cuda._sleep``): the GPU acceptance script's race probes (bench/gpu_acceptance.sh).
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from typing import Any, Iterator

import torch

from .batches import DeviceParts, batch_tensors, map_tensors

__all__ = ["StreamOps", "CudaStreams", "STREAM_KINDS", "host_resident", "is_host_resident"]

STREAM_KINDS = ("learn", "local", "global")

_HOST_RESIDENT: set[int] = set()  # storages that stay in host memory on a GPU run too


def host_resident(t: torch.Tensor) -> torch.Tensor:
    """Mark a CPU tensor that is host bookkeeping on a GPU run too (a row optimizer's ages): the
    host reads and writes it at once, with no stream order, so a RaceRecorder leaves it out."""
    _HOST_RESIDENT.add(t.untyped_storage().data_ptr())
    return t


def is_host_resident(t: torch.Tensor) -> bool:
    return t.untyped_storage().data_ptr() in _HOST_RESIDENT


class StreamOps:
    """torch.cuda's streams and events, as ``CudaStreams`` uses them (a ``RaceRecorder``
    implements the same methods on CPU devices)."""

    def new_stream(self, device: torch.device) -> Any:
        return torch.cuda.Stream(device=device)

    def new_event(self, timing: bool = False) -> Any:
        return torch.cuda.Event(enable_timing=timing)

    def current(self, device: torch.device) -> Any:
        """The stream current on ``device`` (the caller's ``D`` outside ``use``)."""
        return torch.cuda.current_stream(device)

    def record(self, event: Any, stream: Any) -> None:
        event.record(stream)

    def wait(self, stream: Any, event: Any) -> None:
        stream.wait_event(event)

    def use(self, stream: Any):
        """Context: ``stream`` current on its device (and its device current)."""
        return torch.cuda.stream(stream)

    def keep_alive(self, tensor: torch.Tensor, stream: Any) -> None:
        """The caching allocator keeps ``tensor``'s memory until ``stream``'s work so far is done."""
        tensor.record_stream(stream)

    def stage(self, tensor: torch.Tensor) -> torch.Tensor:
        """A host tensor as a non-blocking copy to a device reads it: in pinned memory (a copy,
        unless it is pinned already)."""
        return tensor if tensor.is_pinned() else tensor.pin_memory()

    def synchronize(self, devices=()) -> None:
        """The host waits for every stream of each of ``devices`` (default: the current one)."""
        for device in devices or [None]:
            torch.cuda.synchronize(device)

    def done(self, event: Any) -> bool:
        return event.query()

    def wait_host(self, event: Any) -> None:
        event.synchronize()

    def elapsed_ms(self, start: Any, end: Any) -> float:
        return start.elapsed_time(end)

    def sleep(self, cycles: int) -> None:
        torch.cuda._sleep(cycles)


CUDA_OPS = StreamOps()


class CudaStreams:
    """Streams and events of the inline executor (this module's docstring: the discipline).

    Args:
        states: the plan's DeviceStates, in device order.
        ops: ``StreamOps`` (CUDA) or a RaceRecorder (CPU devices, tests).

    Attributes:
        delay: stream kind (``"learn"``, ``"local"``, ``"global"``, or ``"copy"``: the copy
            streams) → GPU cycles that kind of stream sleeps before its work, every round (race
            probes; empty in training).
        captured: the rounds run into a CUDA graph (engine/graphs.py): no timing events or
            spans, no ``keep_alive`` (a graph's tensors are static).
    """

    WAITS = {  # what each kind of stream waits for before its work of a round (the discipline)
        "learn": ("start", "batch copy", "own local sync", "global sync (S-SGD, DiLoCo)"),
        "local": ("learners", "global sync"),  # after start_t through the learners
        "global": ("every local sync",),
    }

    def __init__(self, states, ops: StreamOps = CUDA_OPS) -> None:
        self.states, self.ops = states, ops
        self.delay: dict[str, int] = {}
        self.captured = False
        self.groups: dict[tuple[int, int], Any] = {}  # (device, first row) → learner stream
        self.sync_stream = [ops.new_stream(s.torch_device) for s in states]
        self.global_stream = ops.new_stream(states[0].torch_device)
        self.origin = [self._event(ops.current(s.torch_device), timing=True) for s in states]
        self.default: list[Any] = [ops.current(s.torch_device) for s in states]  # D per device
        self.start: list[Any] = [None] * len(states)  # start_t per device (on D)
        self.copy_stream: dict[int, Any] = {}  # device → C_d, made at its first copy
        self.copied: list[Any] = [None] * len(states)  # the round's batch copy, per device (on C_d)
        self.learned: list[list[Any]] = [[] for _ in states]  # this round's learner events
        self.local_done: list[Any] = [None] * len(states)
        self.global_done: list[Any] = []  # on G and on the other devices' S_d
        self.spans: list[tuple[str, str, int, Any, Any]] = []  # (task, kind, device, start, end)

    def _event(self, stream: Any, timing: bool = False) -> Any:
        event = self.ops.new_event(timing)
        self.ops.record(event, stream)
        return event

    def _wait_all(self, stream: Any, events) -> None:
        for event in events:
            if event is not None:
                self.ops.wait(stream, event)

    def _wait_rules(self, kind: str, stream: Any, d: int, after_global: bool = False) -> None:
        """``stream`` (of ``kind``, on device d) waits for the events ``WAITS[kind]`` names."""
        for rule in self.WAITS[kind]:
            if rule == "start":
                events = [self.start[d]]
            elif rule == "batch copy":
                events = [self.copied[d]]
            elif rule == "own local sync":
                events = [self.local_done[d]]
            elif rule == "every local sync":
                events = self.local_done
            elif rule == "learners":
                events = self.learned[d]
            elif rule == "global sync" or (rule == "global sync (S-SGD, DiLoCo)" and after_global):
                events = self.global_done
            else:
                continue
            self._wait_all(stream, events)

    def _begin(self, kind: str, stream: Any) -> Any:
        """At the start of a task's work on ``stream``: the race probe's sleep, a timing event."""
        if kind in self.delay:
            with self.ops.use(stream):
                self.ops.sleep(self.delay[kind])
        return None if self.captured else self._event(stream, timing=True)

    def _end(self, task: Any, kind: str, d: int, stream: Any, start: Any) -> Any:
        end = self._event(stream, timing=start is not None)
        if start is not None:
            self.spans.append((task, kind, d, start, end))
        return end

    def copy_in(self, parts: list[Any]) -> tuple[DeviceParts, list[Any]]:
        """A round's batch copied ahead: each host tensor of ``parts[d]`` (device d's rows, as
        ``DeviceParts`` holds them) staged in pinned memory and copied to device d with a
        non-blocking copy on its copy stream ``C_d``; tensors already on a GPU stay as they are.
        Returns the copies and, per device, the event after its copy (``begin_round``'s
        ``copied``: the round's learners wait for it)."""
        moved, events = [], []
        for d, part in enumerate(parts):
            device = self.states[d].torch_device
            stream = self.copy_stream.get(d)
            if stream is None:
                stream = self.copy_stream[d] = self.ops.new_stream(device)
            with self.ops.use(stream):
                if "copy" in self.delay:
                    self.ops.sleep(self.delay["copy"])
                moved.append(map_tensors(part, lambda t: self._copy(t, device)))
            events.append(self._event(stream))
        return DeviceParts(moved), events

    def _copy(self, t: torch.Tensor, device: torch.device) -> torch.Tensor:
        if t.device.type != "cpu":
            return t
        host = self.ops.stage(t)
        out = torch.empty_like(host, device=device)
        return out.copy_(host, non_blocking=True)

    def begin_round(self, batch: Any, copied: list[Any] | None = None) -> None:
        """Step 1: ``start_t`` on every device's ``D``, after whatever the caller issued there (the
        round's batch included); ``copied``: per device, the event after its copy of the batch
        (``copy_in``), or None."""
        self._batch_leaves = batch_tensors(batch) if batch is not None else []
        self.copied = list(copied) if copied is not None else [None] * len(self.states)
        self.default = [self.ops.current(s.torch_device) for s in self.states]
        for d, stream in enumerate(self.default):
            self.start[d] = self._event(stream)
            self.learned[d] = []

    @contextmanager
    def learn(self, task: Any, d: int, r0: int, *, after_global: bool) -> Iterator[None]:
        """Step 2: a learner group's work on its stream (``after_global``: the sync algorithm's
        ``waits_for_global``: e.g. S-SGD's and DiLoCo's, whose global sync writes every
        replica)."""
        stream = self.groups.get((d, r0))
        if stream is None:
            stream = self.groups[d, r0] = self.ops.new_stream(self.states[d].torch_device)
        self._wait_rules("learn", stream, d, after_global=after_global)
        for t in self._batch_leaves if not self.captured else ():
            if t.device == self.states[d].torch_device:
                self.ops.keep_alive(t, stream)
        start = self._begin("learn", stream)
        try:  # the end event even when the work fails: a failed capture joins every stream
            with self.ops.use(stream):
                yield
        finally:
            self.learned[d].append(self._end(task, "learn", d, stream, start))

    @contextmanager
    def local(self, task: Any, d: int) -> Iterator[None]:
        """Step 3: a device's local sync on ``S_d``."""
        stream = self.sync_stream[d]
        self._wait_rules("local", stream, d)
        start = self._begin("local", stream)
        try:
            with self.ops.use(stream):
                yield
        finally:
            self.local_done[d] = self._end(task, "local", d, stream, start)

    def keep_for_global(self, tensors) -> None:
        """Tensors a local sync allocated (acc_d, the buffer snapshot) stay alive for ``G``."""
        for t in tensors if not self.captured else ():
            if t is not None:
                self.ops.keep_alive(t, self.global_stream)

    @contextmanager
    def global_(self, task: Any) -> Iterator[None]:
        """Step 4: the global sync on ``G`` (and each other device's part on its ``S_d``)."""
        G = self.global_stream
        self._wait_rules("global", G, 0)
        others = [(d, self.sync_stream[d]) for d in range(1, len(self.states))]
        for d, stream in others:  # ordered after its own local sync: the same stream
            self._wait_rules("global", stream, d)
        start = self._begin("global", G)
        try:
            with ExitStack() as stack:
                for _, stream in others:
                    stack.enter_context(self.ops.use(stream))
                stack.enter_context(self.ops.use(G))  # last: the first device is current
                yield
        finally:
            self.global_done = [self._end(task, "global", 0, G, start)]
            self.global_done += [self._event(stream) for _, stream in others]

    def end_round(self) -> None:
        """Step 5: every device's ``D`` waits for its learners of the round (the losses, which the
        caller reads there), not for the syncs."""
        for d, stream in enumerate(self.default):
            self._wait_all(stream, self.learned[d])

    def join(self) -> None:
        """Step 5: every device's ``D`` waits for every stream's last event (no host wait)."""
        last = [*self.local_done, *self.global_done, *(e for ev in self.learned for e in ev)]
        for s in self.states:
            self._wait_all(self.ops.current(s.torch_device), last)

    def seal(self) -> None:
        """``join``, then forget every event: what runs next on ``D`` (a round captured in a CUDA
        graph, or after it) is ordered after the work so far and waits for no event of it (a
        capture must not wait for an event recorded outside it, nor eager work for one inside)."""
        self.join()
        self.local_done = [None] * len(self.states)
        self.global_done = []
        self.learned = [[] for _ in self.states]

    def take_spans(self, *, block: bool) -> list[tuple[str, str, int, float, float]]:
        """(task id, kind, device, start, end) of the timed tasks, start and end in GPU
        milliseconds since the streams were made (on that device), in issue order, up to the first whose end event is not done yet (with
        ``block``: every one, waiting for the GPU); they are forgotten."""
        n = 0
        for *_, end in self.spans:
            if block:
                self.ops.wait_host(end)
            elif not self.ops.done(end):
                break
            n += 1
        taken, self.spans = self.spans[:n], self.spans[n:]
        ms = self.ops.elapsed_ms
        return [(task, kind, d, ms(self.origin[d], a), ms(self.origin[d], b))
                for task, kind, d, a, b in taken]
