"""Disjoint batches for every learner from one seeded order per epoch (docs/design-overview.md §6)."""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset, default_collate

__all__ = ["BatchSchedule", "as_dataset", "make_fetch"]


def as_dataset(data: Any, what: str = "train_dataset") -> Dataset:
    """Accept a torch Dataset or a DataLoader (its dataset is used; batches are drawn by the plan).

    Raises:
        TypeError: neither a Dataset nor a DataLoader.
        ValueError: the dataset is empty.
    """
    if isinstance(data, DataLoader):
        data = data.dataset
    if not hasattr(data, "__getitem__") or not hasattr(data, "__len__"):
        raise TypeError(f"{what} must be a torch Dataset (with __getitem__ and __len__) or a "
                        f"DataLoader, got {type(data).__name__}")
    if len(data) == 0:
        raise ValueError(f"{what} is empty (0 samples); pass a dataset with at least one batch "
                         "per learner")
    return data


class BatchSchedule:
    """Which samples every learner gets in every round.

    One order per epoch: ``randperm(N)`` from a generator seeded with ``(seed, epoch)``, or the
    dataset's own order with ``shuffle=False``. Rounds consume the order from a cursor: a round of
    k learners takes the next k·b positions, learner j (device-major) the positions
    ``[pos + j·b, pos + (j+1)·b)``; a last partial round is dropped. With a fixed k, round t is
    positions ``[(t·k + j)·b, (t·k + j + 1)·b)``. k and b are the caller's, given with every
    round (the auto-tuner adds and removes replicas, policies change b, between rounds): the
    cursor keeps every batch of an epoch disjoint.

    Args:
        num_samples: N.
        shuffle: shuffle each epoch.
        seed: the seed of the orders.
    """

    def __init__(self, num_samples: int, *, shuffle: bool, seed: int) -> None:
        self.num_samples = num_samples
        self.shuffle = shuffle
        self.seed = seed

    def rounds_per_epoch(self, num_learners: int, batch_size: int) -> int:
        """Full rounds of k = ``num_learners`` learners × b = ``batch_size`` samples in an epoch."""
        return self.num_samples // (num_learners * batch_size)

    def order(self, epoch: int) -> torch.Tensor:
        """The sample order of ``epoch``, ``[N]`` int64."""
        if not self.shuffle:
            return torch.arange(self.num_samples)
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.num_samples, generator=gen)

    def next_round(self, order: torch.Tensor, position: int, num_learners: int,
                   batch_size: int) -> torch.Tensor | None:
        """Sample indices ``[k·b]`` of the round of k = ``num_learners`` learners × b =
        ``batch_size`` samples that starts at ``position`` of ``order``, or None when fewer than
        k·b samples are left in the epoch."""
        n = num_learners * batch_size
        if position + n > len(order):
            return None
        return order[position:position + n]

    def round_indices(self, order: torch.Tensor, t: int, num_learners: int, batch_size: int,
                      first: int = 0, count: int | None = None) -> torch.Tensor:
        """Sample indices of round t (of k = ``num_learners`` learners × b = ``batch_size``
        samples every round) for learners ``first … first+count−1``, ``[count·b]``."""
        k, b = num_learners, batch_size
        count = k - first if count is None else count
        start = (t * k + first) * b
        return order[start:start + count * b]


def make_fetch(dataset: Dataset) -> Callable[[torch.Tensor], Any]:
    """A function from sample indices ``[n]`` to one collated batch ``(inputs, target)``.

    TensorDatasets are gathered with one index per tensor; any other Dataset is read item by item
    and collated with ``torch.utils.data.default_collate``.
    """
    if isinstance(dataset, TensorDataset):
        tensors = dataset.tensors
        return lambda idx: [t[idx] for t in tensors]
    return lambda idx: default_collate([_sample(dataset, int(i)) for i in idx])


def _sample(dataset: Dataset, i: int) -> Any:
    """``dataset[i]``; ValueError naming the index when it is None (default_collate's own error
    names neither the index nor the cause)."""
    sample = dataset[i]
    if sample is None:
        raise ValueError(f"the dataset's sample {i} is None, not an (inputs, target) pair; make "
                         "__getitem__ return a pair such as (image, label) for every index")
    return sample
