"""The next round's batch, copied to the devices on their copy streams one round ahead
(docs/runtime.md, "Data on the device")."""

from __future__ import annotations

from typing import Any

import torch

from .batches import DeviceParts, rows

__all__ = ["BatchPrefetch", "device_parts"]


class BatchPrefetch:
    """The one batch copied ahead, for the round whose samples it holds; ``taken`` counts the rounds
    that took one, ``dropped`` the batches no round took."""

    def __init__(self) -> None:
        self._ahead: tuple[int, torch.Tensor, DeviceParts, list[Any]] | None = None
        self.taken = self.dropped = 0

    def put(self, round_index: int, indices: torch.Tensor, batch: DeviceParts,
            events: list[Any]) -> None:
        """Hold round ``round_index``'s batch of ``indices [k·b]`` and its copies' ``events``."""
        self.drop()
        self._ahead = (round_index, indices, batch, events)

    def take(self, round_index: int, indices: torch.Tensor) -> tuple[DeviceParts, list[Any]] | None:
        """The batch and events held for round ``round_index`` with samples ``indices``, else None
        (and what is held is dropped)."""
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
        """Forget the batch held (reused once the copy streams are done with it)."""
        if self._ahead is not None:
            self._ahead = None
            self.dropped += 1


def device_parts(batch: Any, bounds: list[tuple[int, int]]) -> list[Any]:
    """A round's batch split by device: device d's sample rows ``[bounds[d][0], bounds[d][1])``."""
    if len(bounds) == 1:
        return [batch]
    return [rows(batch, lo, hi) for lo, hi in bounds]
