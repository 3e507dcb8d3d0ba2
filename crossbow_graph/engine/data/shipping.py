"""A round's batches from the coordinator to one worker process, through two shared-memory arenas
and one small message per round (docs/runtime.md, "Your DataLoader")."""

from __future__ import annotations

import math
import os
from typing import Any, Callable

import torch

from .batches import LearnerBatches

__all__ = ["BatchPipe", "BY_DESCRIPTOR_BYTES"]

BY_DESCRIPTOR_BYTES = 4 << 20  # a shared tensor this large goes by file descriptor, not copied
_ALIGN = 64                     # bytes: every tensor starts at a multiple (any dtype's alignment)
_MIN_ARENA = 1 << 16


class BatchPipe:
    """Coordinator → one worker (``ctx``: the fork context; made before the worker forks):
    ``send`` a round's batch, ``receive`` it, one call each per round, in order."""

    def __init__(self, ctx) -> None:
        self.reader, self.writer = ctx.Pipe(duplex=False)
        self.parent = os.getpid()  # the coordinator
        self.arenas: list[torch.Tensor | None] = [None, None]  # uint8, shared; per side
        self.sent = self.taken = 0

    def send(self, batch: Any) -> None:
        """Coordinator: the worker's batch of the next round (``LearnerBatches`` or collated)."""
        slot = self.sent % 2
        self.sent += 1
        learners = isinstance(batch, LearnerBatches)
        copies: list[tuple[torch.Tensor, int]] = []  # (tensor, offset) to copy into the arena
        size = 0

        def place(t: torch.Tensor) -> Any:
            nonlocal size
            nbytes = t.numel() * t.element_size()
            if nbytes >= BY_DESCRIPTOR_BYTES and t.is_shared():
                return t  # pickled: by file descriptor
            copies.append((t, size))
            where = _InArena(t.dtype, tuple(t.shape), size)
            size += -(-nbytes // _ALIGN) * _ALIGN
            return where

        packed = _pack(batch.batches if learners else batch, place)
        arena, new = self.arenas[slot], None
        if arena is None or arena.numel() < size:
            grown = max(_MIN_ARENA, 1 << math.ceil(math.log2(2 * max(1, size))))
            arena = new = self.arenas[slot] = torch.empty(grown, dtype=torch.uint8).share_memory_()
        for t, offset in copies:
            t = t.detach().contiguous().reshape(-1).view(torch.uint8)
            arena[offset:offset + t.numel()].copy_(t)
        self.writer.send((slot, new, packed, batch.batch_size if learners else None))

    def receive(self) -> Any:
        """Worker: the next round's batch, its tensors views of the arena valid until the
        message after next. Raises EOFError when the coordinator died before sending it."""
        while not self.reader.poll(0.5):
            if os.getppid() != self.parent:
                raise EOFError("the coordinator process exited before sending the round's batch")
        slot, new, packed, batch_size = self.reader.recv()
        self.taken += 1
        if new is not None:
            self.arenas[slot] = new
        batch = _unpack(packed, self.arenas[slot])
        return LearnerBatches(batch, batch_size) if batch_size is not None else batch

    def close(self) -> None:
        self.reader.close()
        self.writer.close()


class _InArena:
    """Where a tensor of the batch lies in the arena."""

    __slots__ = ("dtype", "shape", "offset")

    def __init__(self, dtype: torch.dtype, shape: tuple[int, ...], offset: int) -> None:
        self.dtype, self.shape, self.offset = dtype, shape, offset

    def __getstate__(self):
        return self.dtype, self.shape, self.offset

    def __setstate__(self, state) -> None:
        self.dtype, self.shape, self.offset = state

    def view_of(self, arena: torch.Tensor) -> torch.Tensor:
        n = math.prod(self.shape) * self.dtype.itemsize
        return arena[self.offset:self.offset + n].view(self.dtype).view(self.shape)


def _pack(x: Any, place: Callable[[torch.Tensor], Any]) -> Any:
    """``x`` with every tensor in its lists, tuples and dicts replaced by ``place(tensor)``."""
    if isinstance(x, torch.Tensor):
        return place(x)
    kind = type(x)
    if kind is list or kind is tuple:
        return kind([_pack(v, place) for v in x])
    if kind is dict:
        return {k: _pack(v, place) for k, v in x.items()}
    if isinstance(x, tuple) and hasattr(x, "_fields"):  # a namedtuple
        return kind(*(_pack(v, place) for v in x))
    return x


def _unpack(x: Any, arena: torch.Tensor) -> Any:
    """``_pack``'s inverse on the worker's side: placeholders → views of ``arena``."""
    kind = type(x)
    if kind is _InArena:
        return x.view_of(arena)
    if kind is list or kind is tuple:
        return kind([_unpack(v, arena) for v in x])
    if kind is dict:
        return {k: _unpack(v, arena) for k, v in x.items()}
    if isinstance(x, tuple) and hasattr(x, "_fields"):
        return kind(*(_unpack(v, arena) for v in x))
    return x
