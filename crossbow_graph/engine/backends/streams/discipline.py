"""The inline executor's streams and events on CUDA devices — learner streams ``L``, sync
streams ``S_d``, the global stream ``G``, copy streams ``C_d``, the caller's ``D`` — and what
each waits for (``CudaStreams.WAITS``; docs/runtime.md, "Streams on CUDA")."""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from typing import Any, Iterator

import torch

from ...data.batches import DeviceParts, batch_tensors, map_tensors

__all__ = ["StreamOps", "CudaStreams", "STREAM_KINDS", "STREAM_POOL"]

STREAM_KINDS = ("learn", "local", "global")


class StreamOps:
    """torch.cuda's streams and events, as ``CudaStreams`` uses them."""

    def new_stream(self, device: torch.device, priority: int = 0) -> Any:
        """A stream from torch's pool of ``STREAM_POOL`` streams of ``priority`` on ``device``
        (the pool is reused round-robin: more streams than that alias earlier ones)."""
        return torch.cuda.Stream(device=device, priority=priority)

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
        """``tensor`` in pinned memory (a copy unless pinned already)."""
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
STREAM_POOL = 32  # streams per priority and device in torch's pool (c10/cuda/CUDAStream.cpp)
SYNC_PRIORITY = -1  # the sync, global and copy streams: another pool than the learners'


class CudaStreams:
    """Streams and events of the inline executor over the plan's DeviceStates ``states``, through
    ``ops`` (``StreamOps``, or a RaceRecorder on CPU devices).

    Attributes:
        delay: stream kind (``"learn"``, ``"local"``, ``"global"``, ``"copy"``) → GPU cycles it
            sleeps before its work, every round (race probes; empty in training).
        captured: the rounds run into a CUDA graph: no timing events, no ``keep_alive``."""

    WAITS = {  # what each kind of stream waits for before its work of a round (the discipline)
        "learn": ("start", "batch copy", "own local sync", "global sync (S-SGD, DiLoCo)"),
        "local": ("start", "learners", "global sync"),  # start_t also with no learners
        "global": ("every local sync",),
    }

    def __init__(self, states, ops: StreamOps = CUDA_OPS) -> None:
        self.states, self.ops = states, ops
        self.delay: dict[str, int] = {}
        self.captured = False
        self.groups: dict[tuple[int, int], Any] = {}  # (device, first row) → learner stream
        self.sync_stream = [ops.new_stream(s.torch_device, SYNC_PRIORITY) for s in states]
        self.global_stream = ops.new_stream(states[0].torch_device, SYNC_PRIORITY)
        self._learner_streams: list[list[Any]] = [[] for _ in states]  # per device, ≤ STREAM_POOL
        self.origin = [self._event(ops.current(s.torch_device), timing=True) for s in states]
        self.default: list[Any] = [ops.current(s.torch_device) for s in states]  # D per device
        self.start: list[Any] = [None] * len(states)  # start_t per device (on D)
        self.copy_stream: dict[int, Any] = {}  # device → C_d, made at its first copy
        self.copied: list[Any] = [None] * len(states)  # the round's batch copy, per device (on C_d)
        self.learned: list[list[Any]] = [[] for _ in states]  # this round's learner events
        self.local_done: list[Any] = [None] * len(states)
        self.global_done: list[Any] = []  # on G and on the other devices' S_d
        self.spans: list[tuple[str, str, int, Any, Any]] = []  # (task, kind, device, start, end)

    def _learner_stream(self, d: int) -> Any:
        """A new learner group's stream on device d: a new one while the device has fewer than
        ``STREAM_POOL``, else the existing ones in turn (shared on purpose, as the pool would
        share them by accident: those groups run one after another on it)."""
        made = self._learner_streams[d]
        if len(made) < STREAM_POOL:
            made.append(self.ops.new_stream(self.states[d].torch_device))
            return made[-1]
        return made[sum(1 for key in self.groups if key[0] == d) % STREAM_POOL]

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
        """Copy each host tensor of ``parts[d]`` (device d's rows) to device d on ``C_d``;
        returns the copies and, per device, the event after its copy."""
        moved, events = [], []
        for d, part in enumerate(parts):
            device = self.states[d].torch_device
            stream = self.copy_stream.get(d)
            if stream is None:
                stream = self.copy_stream[d] = self.ops.new_stream(device, SYNC_PRIORITY)
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
        """``start_t`` on every device's ``D``; ``copied``: ``copy_in``'s events, or None."""
        self._batch_leaves = batch_tensors(batch) if batch is not None else []
        self.copied = list(copied) if copied is not None else [None] * len(self.states)
        self.default = [self.ops.current(s.torch_device) for s in self.states]
        for d, stream in enumerate(self.default):
            self.start[d] = self._event(stream)
            self.learned[d] = []

    @contextmanager
    def learn(self, task: Any, d: int, r0: int, *, after_global: bool) -> Iterator[None]:
        """Context: a learner group's work on its stream ``L`` (``after_global``: it waits for the
        last global sync too, ``SyncAlgorithm.waits_for_global``)."""
        stream = self.groups.get((d, r0))
        if stream is None:
            stream = self.groups[d, r0] = self._learner_stream(d)
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
        """Context: a device's local sync on ``S_d``."""
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
        """Context: the global sync on ``G`` (each other device's part on its ``S_d``)."""
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
        """Every device's ``D`` waits for its learners of the round, not for the syncs."""
        for d, stream in enumerate(self.default):
            self._wait_all(stream, self.learned[d])

    def join(self) -> None:
        """Every device's ``D`` waits for every stream's last event (no host wait)."""
        last = [*self.local_done, *self.global_done, *(e for ev in self.learned for e in ev)]
        for s in self.states:
            self._wait_all(self.ops.current(s.torch_device), last)

    def seal(self) -> None:
        """``join``, then forget every event, so that a capture waits for no event outside it."""
        self.join()
        self.local_done = [None] * len(self.states)
        self.global_done = []
        self.learned = [[] for _ in self.states]

    def take_spans(self, *, block: bool) -> list[tuple[str, str, int, float, float]]:
        """Take (task id, kind, device, start ms, end ms since the streams were made) of the timed
        tasks done so far (with ``block``: of every one, waiting for the GPU)."""
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
