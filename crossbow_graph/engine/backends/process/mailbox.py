"""The process backend's shared-memory messages (a worker's ``Mailbox``) and how the replicas
split into learner groups (``worker_groups``) (docs/runtime.md, "Worker processes")."""

from __future__ import annotations

import multiprocessing as mp
import os
from typing import Callable, NamedTuple

import torch

from ...data.shipping import BatchPipe
from ...learning.threads import available_cores

__all__ = ["Mailbox", "Answer", "Reply", "Spans", "worker_groups", "fork_available",
           "available_cores", "wait_alive", "shorten", "POLL_S", "OK", "ERROR", "CANCELLED"]

POLL_S = 0.5           # how often a blocked wait checks that the other side is alive
ERROR_TEXT_MAX = 8000  # characters of a worker's error text kept in a TaskError
OK, ERROR, CANCELLED = 1, 2, 3  # a worker's answer (Mailbox.reply[Reply.STATUS])

def fork_available() -> bool:
    """Whether worker processes can be forked (Linux, macOS): they inherit the dataset."""
    return "fork" in mp.get_all_start_methods()


def worker_groups(replicas_per_device: list[int], cores: int) -> list[tuple[int, int, int]]:
    """Split every device's replicas into contiguous groups, one per worker process.

    Each device gets ``min(m, max(1, cores // G))`` workers (G devices) and its m replicas are
    spread over them as evenly as possible, larger groups first.

    Returns:
        ``(device index, r0, r1)`` per worker, device-major."""
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


class Reply:
    """The slots of a worker's answer (``Mailbox.reply``, int64): its status and round, the six
    timestamps of ``Spans`` (ns; the slice ``SPANS``), the number of faulty rows, then the faulty
    rows. (Plain ints, not an IntEnum: they are read a dozen times per round.)"""

    STATUS = 0
    ROUND = 1
    LEARN_START = 2
    LEARN_END = 3
    LOCAL_START = 4
    LOCAL_END = 5
    GLOBAL_START = 6
    GLOBAL_END = 7
    N_FAULTY = 8
    FAULTY = 9
    SPANS = slice(LEARN_START, GLOBAL_END + 1)


class Spans(NamedTuple):
    """One group's timestamps of a round (``time.perf_counter_ns``): its learning, its local
    update (from its release on) and the global sync it ran (0, 0 when it ran none)."""

    learn_start: int
    learn_end: int
    local_start: int
    local_end: int
    global_start: int = 0
    global_end: int = 0


class Answer(NamedTuple):
    """Group ``wid``'s answer of a round: its losses ``[n]``, Spans and faulty rows."""

    wid: int
    losses: torch.Tensor
    spans: Spans
    faulty: list[int]


class Mailbox:
    """One worker's messages in shared memory: two slots of (round, sample indices), one answer
    (``Reply``; the losses), a semaphore each way; with ``shipped`` also its rows of each round's
    batch (``batches``: engine/data/shipping.py). docs/runtime.md, "Executors".

    Args:
        ctx: the multiprocessing context (fork).
        n_indices: sample indices per round, (r1 − r0)·b.
        n_rows: the worker's replicas, r1 − r0.
        n_losses: the losses it answers per round (its LEARN tasks).
        loss_dtype: of the losses (the masters': float64 for a float64 model, else float32).
        shipped: whether the coordinator loads the rounds and sends the batches."""

    def __init__(self, ctx, n_indices: int, n_rows: int, n_losses: int,
                 loss_dtype: torch.dtype = torch.float32, shipped: bool = False) -> None:
        self.go, self.done = ctx.Semaphore(0), ctx.Semaphore(0)
        self.indices = torch.zeros(2, n_indices, dtype=torch.int64).share_memory_().numpy()
        self.head = torch.zeros(3, dtype=torch.int64).share_memory_().numpy()  # rounds; stop
        self.reply = torch.zeros(Reply.FAULTY + n_rows, dtype=torch.int64).share_memory_().numpy()
        self._losses = torch.zeros(n_losses, dtype=loss_dtype).share_memory_()
        self.losses = self._losses.numpy()
        self.sent = self.taken = 0  # slots written (coordinator), read (worker)
        self.batches = BatchPipe(ctx) if shipped else None  # the shipped rounds' batches

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

    def answer(self, status: int, round_index: int, spans: Spans = Spans(0, 0, 0, 0),
               faulty=(), losses=()) -> None:
        """Worker: the round's answer, then ``done``."""
        r = self.reply
        r[Reply.STATUS], r[Reply.ROUND] = status, round_index
        r[Reply.SPANS] = spans
        r[Reply.N_FAULTY] = len(faulty)
        r[Reply.FAULTY:Reply.FAULTY + len(faulty)] = faulty
        for i, x in enumerate(losses):
            self.losses[i] = float(x)
        self.done.release()

    def read(self) -> tuple[int, Spans, list[int], torch.Tensor]:
        """Coordinator, after ``done`` was acquired: (status, Spans, faulty rows, losses [n_losses])."""
        r = self.reply
        n = int(r[Reply.N_FAULTY])
        return (int(r[Reply.STATUS]), Spans(*(int(x) for x in r[Reply.SPANS])),
                [int(x) for x in r[Reply.FAULTY:Reply.FAULTY + n]], self._losses.clone())




def shorten(text: str) -> str:
    """An error text cut to ERROR_TEXT_MAX characters (its start and end), for the message."""
    if len(text) <= ERROR_TEXT_MAX:
        return text
    half = ERROR_TEXT_MAX // 2
    return f"{text[:half]} […{len(text) - 2 * half:,} characters cut…] {text[-half:]}"


def wait_alive(ready: Callable[[], bool], parent: int) -> bool:
    """Block until ``ready()`` (it blocks up to POLL_S itself); False if the parent died."""
    while not ready():
        if os.getppid() != parent:
            return False
    return True
