"""The next round's batch, copied to the devices one round ahead (docs/runtime.md, Data on the
device).

On CUDA devices, a batch the host gathers or collates (any dataset the plan does not keep on the
device, a DataLoader's) reaches the devices without the host waiting for a copy: while round t
runs, round t+1's batch is fetched, staged in pinned memory and copied to each device on its copy
stream (``CudaStreams.copy_in``); round t+1's learners wait for the copy's event (the ``"batch
copy"`` wait of ``CudaStreams.WAITS``). ``BatchPrefetch`` holds the one batch copied ahead and
gives it to the round whose samples it holds; any other round (k or b changed, a new epoch's
order) drops it.
"""

from __future__ import annotations

from typing import Any

import torch

from .batches import DeviceParts
from .learners import rows

__all__ = ["BatchPrefetch", "device_parts"]


class BatchPrefetch:
    """The batch copied ahead, for one round.

    Attributes:
        taken: rounds that took a batch copied ahead (since the Scheduler was made).
        dropped: batches copied ahead that no round took (their round's samples changed, or a
            re-plan or the fit's end came first).
    """

    def __init__(self) -> None:
        self._ahead: tuple[int, torch.Tensor, DeviceParts, list[Any]] | None = None
        self.taken = self.dropped = 0

    def put(self, round_index: int, indices: torch.Tensor, batch: DeviceParts,
            events: list[Any]) -> None:
        """Hold round ``round_index``'s batch of samples ``indices [k·b]``, copied on the copy
        streams (``events``: per device, the event after its copy)."""
        self.drop()
        self._ahead = (round_index, indices, batch, events)

    def take(self, round_index: int, indices: torch.Tensor) -> tuple[DeviceParts, list[Any]] | None:
        """The batch and events held for round ``round_index`` if its samples are ``indices``;
        else None (and what is held is dropped)."""
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return None
        t, held, batch, events = ahead
        if t != round_index or held.shape != indices.shape or not torch.equal(held, indices):
            self.dropped += 1
            return None
        self.taken += 1
        return batch, events

    def drop(self) -> None:
        """Forget the batch held, if any. Its device memory was allocated on the copy streams, so
        the caching allocator reuses it only after the copy (no wait is needed)."""
        if self._ahead is not None:
            self._ahead = None
            self.dropped += 1


def device_parts(batch: Any, bounds: list[tuple[int, int]]) -> list[Any]:
    """A round's batch split by device: device d's rows ``[bounds[d][0], bounds[d][1])`` (sample
    rows of a collated batch, or the learners of those rows of a ``LearnerBatches``)."""
    if len(bounds) == 1:
        return [batch]
    return [rows(batch, lo, hi) for lo, hi in bounds]
