"""A data-race checker for the stream discipline on CPU devices: simulated streams and events,
every aten op's byte ranges read and written, and PyTorch's CUDA sanitizer's happens-before
relation (docs/runtime.md, "Streams on CUDA")."""

from __future__ import annotations

import itertools
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch.cuda._sanitizer import DEFAULT_STREAM_ID, StreamSynchronizations, zip_arguments
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from .frames import issuing_frame


__all__ = ["RaceRecorder", "Race"]

_SKIP = {torch.ops.aten.record_stream.default}
_HOST_READS = {torch.ops.aten._local_scalar_dense.default}  # .item(), bool(t): the host waits
# ops whose schema does not declare an in-place write they make: (op, its arguments written,
# the argument that must be True for the write)
_UNDECLARED = {torch.ops.aten.native_batch_norm.default: (("running_mean", "running_var"), "training")}


@dataclass(frozen=True)
class _Access:
    lo: int
    hi: int
    write: bool
    stream: int
    seq: int
    op: str
    where: str


@dataclass(frozen=True)
class Race:
    """Two unordered accesses of the same bytes (one a write), ``first`` issued before ``second``,
    each ``"<op> (read|write) on stream <id> at <file:line of crossbow_graph>"``."""

    first: str
    second: str

    def __str__(self) -> str:
        return f"{self.second} is not ordered after {self.first}"


class _Stream:
    def __init__(self, sid: int, device: torch.device, priority: int = 0) -> None:
        self.id, self.device, self.priority = sid, device, priority

    def __repr__(self) -> str:
        return f"stream {self.id}"


class _Event:
    def __init__(self, eid: int) -> None:
        self.id = eid


class RaceRecorder(TorchDispatchMode):
    """Simulated streams and events (the ``StreamOps`` methods) and the race check:
    ``with RaceRecorder().attach(plan.rounds) as rec: plan.fit(...)``, then ``rec.races`` (the
    first 50) and ``rec.accesses`` (recorded reads and writes)."""

    def __init__(self) -> None:
        super().__init__()
        self.syncs = StreamSynchronizations()
        self.races: list[Race] = []
        self.accesses = 0
        self.streams_made = 0
        self._ids = itertools.count(1)
        self._seq = 0
        self._current: list[_Stream] = []
        self._table: dict[int, list[_Access]] = {}
        self._alive: list[torch.UntypedStorage] = []
        self._host: set[int] = set()  # storages of host memory (``stage``): on no stream
        self._paused = False
        self._default = _Stream(DEFAULT_STREAM_ID, torch.device("cpu"))

    def attach(self, rounds: Any) -> "RaceRecorder":
        """Run the in-process rounds of ``rounds`` (a plan's Scheduler, ``plan.rounds``) on these
        simulated streams from its next round on (``Executors.use_stream_ops``, the seam);
        returns self."""
        rounds.executors.use_stream_ops(self)
        return self

    # -- StreamOps ------------------------------------------------------------------------------

    def new_stream(self, device: torch.device, priority: int = 0) -> _Stream:
        stream = _Stream(next(self._ids), device, priority)
        self.syncs.create_stream(stream.id)
        self.streams_made += 1
        return stream

    def new_event(self, timing: bool = False) -> _Event:
        event = _Event(next(self._ids))
        self.syncs.create_event(event.id)
        return event

    def current(self, device: torch.device) -> _Stream:
        return self._current[-1] if self._current else self._default

    def record(self, event: _Event, stream: _Stream) -> None:
        self.syncs.record_state(event.id, stream.id)

    def wait(self, stream: _Stream, event: _Event) -> None:
        self.syncs.stream_wait_for_event(stream.id, event.id)

    @contextmanager
    def use(self, stream: _Stream):
        self._current.append(stream)
        try:
            yield
        finally:
            self._current.pop()

    def keep_alive(self, tensor: torch.Tensor, stream: _Stream) -> None:
        pass

    def stage(self, tensor: torch.Tensor) -> torch.Tensor:
        """A host copy of ``tensor``, made by the host: neither it nor its accesses are recorded."""
        self._paused = True
        try:
            host = tensor.clone()
        finally:
            self._paused = False
        self._host.add(host.untyped_storage().data_ptr())
        self._alive.append(host.untyped_storage())  # its address is not reused while recording
        return host

    def synchronize(self, devices=()) -> None:
        self.syncs.sync_all_streams()

    def done(self, event: _Event) -> bool:
        return True

    def wait_host(self, event: _Event) -> None:
        self.syncs.all_streams_wait_for_event(event.id)

    def elapsed_ms(self, start: _Event, end: _Event) -> float:
        return 0.0

    def sleep(self, cycles: int) -> None:
        pass

    # -- recording ------------------------------------------------------------------------------

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _SKIP or self._paused:
            return func(*args, **kwargs)
        reads, writes = [], []
        named = dict((a.name, v) for a, v in zip_arguments(func._schema, args, kwargs))
        hidden, flag = _UNDECLARED.get(func, ((), None))
        hidden = hidden if flag is not None and named.get(flag) else ()
        for argument, value in zip_arguments(func._schema, args, kwargs):
            alias = argument.alias_info
            if alias is not None and not alias.is_write:
                continue  # a view: metadata only
            written = (alias is not None and alias.is_write) or argument.name in hidden
            target = writes if written else reads
            target.extend(t for t in tree_leaves(value) if isinstance(t, torch.Tensor))
        out = func(*args, **kwargs)
        for ret, value in zip(func._schema.returns, (out,)):
            if ret.alias_info is None:  # new memory (an alias output was counted as its input)
                writes.extend(t for t in tree_leaves(value) if isinstance(t, torch.Tensor))
        stream = self.current(torch.device("cpu"))
        self._seq += 1
        self.syncs.update_seq_num(stream.id, self._seq)
        where = issuing_frame(40)
        for tensors, write in ((reads, False), (writes, True)):
            for t in tensors:
                self._access(t, write, stream, str(func._schema.name), where)
        if func in _HOST_READS:
            self.syncs.all_streams_wait_for_stream(stream.id)
        return out

    def _access(self, t: torch.Tensor, write: bool, stream: _Stream, op: str, where: str) -> None:
        if t.device.type != "cpu" or t.numel() == 0 or t.is_sparse \
                or t.untyped_storage().data_ptr() in self._host:
            return
        storage = t.untyped_storage()
        self._alive.append(storage)
        size = t.element_size()
        lo = t.storage_offset() * size
        hi = lo + (1 + sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride()))) * size
        key = storage.data_ptr()
        access = _Access(lo, hi, write, stream.id, self._seq, op, where)
        self.accesses += 1
        kept = []
        for prev in self._table.get(key, []):
            if prev.hi <= lo or hi <= prev.lo or not (write or prev.write):
                kept.append(prev)
                continue
            if not self.syncs.is_ordered_after(stream.id, prev.seq, prev.stream):
                if len(self.races) < 50:
                    self.races.append(Race(_say(prev), _say(access)))
                kept.append(prev)
            elif not (write and lo <= prev.lo and prev.hi <= hi):
                kept.append(prev)  # a write ordered after an access it covers supersedes it
        kept.append(access)
        self._table[key] = kept


def _say(a: _Access) -> str:
    return f"{a.op} ({'write' if a.write else 'read'}) on stream {a.stream} at {a.where}"

