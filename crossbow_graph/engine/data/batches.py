"""A round's samples collated per learner (``LearnerBatches``) or split by device
(``DeviceParts``) (docs/runtime.md, "Your DataLoader")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

__all__ = ["DeviceParts", "LearnerBatches", "batch_tensors", "map_tensors", "single", "to_device", "rows",
           "flat_pair"]


@dataclass
class LearnerBatches:
    """Learner j's batch, as the collate_fn returned it for its b = ``batch_size`` samples, at
    ``batches[j]`` (device-major)."""

    batches: list[Any]
    batch_size: int

    def rows(self, start: int, stop: int) -> "LearnerBatches":
        """The learners of sample rows ``[start, stop)`` (multiples of b)."""
        b = self.batch_size
        assert start % b == 0 and stop % b == 0, (start, stop, b)
        return LearnerBatches(self.batches[start // b:stop // b], b)

    def stacked(self) -> Any:
        """The batches concatenated along dimension 0 (what fused learners take). Raises
        ValueError when they differ in structure or in a shape past dimension 0."""
        if len(self.batches) == 1:
            return self.batches[0]
        flat = [tree_flatten(batch) for batch in self.batches]
        spec = flat[0][1]
        if any(s != spec for _, s in flat):
            raise ValueError("fused learners stack the learners' batches, but the collate_fn "
                             "returned batches of different structure (learner_mode='per_replica' "
                             "takes them)")
        leaves = []
        for column in zip(*(leaves_ for leaves_, _ in flat)):
            if not all(isinstance(x, torch.Tensor) for x in column):
                leaves.append(column[0])
                continue
            shapes = {tuple(x.shape[1:]) for x in column}
            if len(shapes) > 1:
                raise ValueError(
                    f"fused learners stack the learners' batches, but the collate_fn returned "
                    f"tensors of per-sample shapes {sorted(shapes)} for the learners of one "
                    "group (it pads each batch to its own length; learner_mode='per_replica' "
                    "takes them, and a collate_fn that pads to one fixed length can be fused)")
            leaves.append(torch.cat(column))
        return tree_unflatten(leaves, spec)


@dataclass
class DeviceParts:
    """A round's batch split by device: ``parts[d]`` holds device d's learners' rows (a collated
    batch of ``m_d·b`` rows or a ``LearnerBatches``), every tensor on device d."""

    parts: list[Any]


def batch_tensors(batch: Any) -> list[torch.Tensor]:
    """Every tensor of a collated batch, a ``LearnerBatches`` or a ``DeviceParts``."""
    if isinstance(batch, DeviceParts):
        return [t for part in batch.parts for t in batch_tensors(part)]
    if isinstance(batch, LearnerBatches):
        return [t for b in batch.batches for t in batch_tensors(b)]
    return [t for t in tree_flatten(batch)[0] if isinstance(t, torch.Tensor)]


def single(batch: Any) -> Any:
    """The one learner's batch of a ``LearnerBatches`` of one learner; any other batch as it is."""
    if isinstance(batch, LearnerBatches):
        assert len(batch.batches) == 1, len(batch.batches)
        return batch.batches[0]
    return batch


def map_tensors(batch: Any, fn) -> Any:
    """``fn`` applied to every tensor of a collated batch or of a ``LearnerBatches``."""
    if isinstance(batch, LearnerBatches):
        return LearnerBatches([map_tensors(b, fn) for b in batch.batches], batch.batch_size)
    return tree_map(lambda t: fn(t) if isinstance(t, torch.Tensor) else t, batch)


def to_device(batch: Any, device: torch.device) -> Any:
    """Every tensor of a collated batch on ``device`` (non-blocking copies from pinned memory)."""
    return map_tensors(batch, lambda t: t.to(device, non_blocking=True))


def flat_pair(batch: Any) -> bool:
    """A list or tuple of tensors (the usual collated ``(inputs, target)``): sliced without
    tree_map, which costs tens of µs per call, per learner and round."""
    return type(batch) in (list, tuple) and all(type(t) is torch.Tensor for t in batch)


def rows(batch: Any, start: int, stop: int) -> Any:
    """Rows ``[start, stop)`` of every tensor of a collated batch (views, same device); of a
    ``LearnerBatches``, the learners of those rows."""
    if isinstance(batch, LearnerBatches):
        return batch.rows(start, stop)
    if flat_pair(batch):
        return type(batch)([t[start:stop] for t in batch])
    return tree_map(lambda t: t[start:stop] if isinstance(t, torch.Tensor) else t, batch)
