"""Disjoint batches for every learner from one seeded order per epoch (docs/design-overview.md §6)."""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.utils.data import (DataLoader, Dataset, IterableDataset, RandomSampler, SequentialSampler,
                              TensorDataset, default_collate, default_convert)

from ..engine.data.batches import LearnerBatches
from ..engine.settings import RunSettings
from .collate import collate, plain_batch

__all__ = ["BatchSchedule", "CollateFetch", "DeviceFetch", "LearnerFetch", "as_dataset", "collate_of",
           "device_fetch", "make_fetch", "read_samples", "yields_every_sample"]


def as_dataset(data: Any, what: str = "train_dataset") -> Dataset:
    """Accept a torch Dataset or a DataLoader (its dataset; the plan draws the batches).

    Raises:
        TypeError: neither a Dataset nor a DataLoader (a tensor, or a tuple of tensors: the
            message says to wrap them in a TensorDataset).
        ValueError: the dataset is empty, or an IterableDataset (no indices to draw from)."""
    if isinstance(data, DataLoader):
        data = data.dataset
    _refuse_tensors(data, what)
    if isinstance(data, IterableDataset):
        raise ValueError(f"{what} is an IterableDataset ({type(data).__name__}): the plan draws "
                         "each learner's samples by index from one seeded order per epoch, and an "
                         "IterableDataset has no indices; give a map-style Dataset (__getitem__ "
                         "and __len__)")
    if not hasattr(data, "__getitem__") or not hasattr(data, "__len__"):
        raise TypeError(f"{what} must be a torch Dataset (with __getitem__ and __len__) or a "
                        f"DataLoader, got {type(data).__name__}")
    if len(data) == 0:
        raise ValueError(f"{what} is empty (0 samples); pass a dataset with at least one batch "
                         "per learner")
    return data


def _refuse_tensors(data: Any, what: str) -> None:
    """TypeError for a tensor, or a tuple or list of tensors, given where a Dataset goes (they
    index, but their items are rows, not ``(inputs, target)`` samples)."""
    if isinstance(data, torch.Tensor):
        raise TypeError(f"{what} is a Tensor of shape {list(data.shape)}, not a Dataset of "
                        "(inputs, target) samples; wrap it with its targets: TensorDataset(X, Y)")
    if isinstance(data, (tuple, list)) and data and all(isinstance(t, torch.Tensor) for t in data):
        shapes = ", ".join(str(list(t.shape)) for t in data[:3]) + (", …" if len(data) > 3 else "")
        raise TypeError(f"{what} is a {type(data).__name__} of {len(data)} tensors ({shapes}), "
                        "not a Dataset; wrap it: TensorDataset(X, Y), whose samples are the "
                        "pairs (X[i], Y[i])")


class BatchSchedule:
    """Which samples every learner gets in every round.

    One order per epoch (``randperm(N)`` seeded with ``(seed, epoch)``, or the dataset's order
    with ``shuffle=False``), consumed from a cursor: a round of k learners takes the next k·b
    positions, learner j (device-major) ``[pos + j·b, pos + (j+1)·b)``; a last partial round is
    dropped. k and b come with every round (they change between rounds), and the cursor keeps
    every batch of an epoch disjoint.

    Args:
        num_samples: N.
        shuffle: shuffle each epoch.
        seed: the seed of the orders."""

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


def collate_of(data: Any) -> Callable[[list], Any] | None:
    """A DataLoader's collate_fn unless it is ``default_collate`` (the plan's own collation,
    training/collate.py ``collate``, a superset, replaces it) or ``default_convert`` (what
    ``batch_size=None`` sets: samples left uncollated); None for a Dataset."""
    if isinstance(data, DataLoader) and data.collate_fn not in (default_collate, default_convert):
        return data.collate_fn
    return None


def yields_every_sample(loader: DataLoader) -> bool:
    """Whether the DataLoader's sampler yields every sample of its dataset once: a
    ``SequentialSampler`` or a plain ``RandomSampler`` (what ``shuffle=False``/``True`` make)."""
    sampler = loader.sampler
    return type(sampler) is SequentialSampler or (
        type(sampler) is RandomSampler and not sampler.replacement
        and sampler.num_samples == len(loader.dataset))


def make_fetch(dataset: Dataset, collate_fn: Callable[[list], Any] | None = None
               ) -> Callable[[torch.Tensor], Any]:
    """A function from sample indices ``[n]`` to one collated batch ``(inputs, target)``: with
    ``collate_fn`` (a DataLoader's) the samples read item by item and collated by it; else a
    TensorDataset gathered with one index per tensor (detached, sparse rows made dense), any other
    Dataset read item by item and collated by ``training.collate.collate``."""
    if collate_fn is not None:
        return CollateFetch(dataset, collate_fn)
    if isinstance(dataset, TensorDataset):
        tensors = [_gatherable(t) for t in dataset.tensors]
        if all(t.layout is torch.strided for t in tensors):
            return lambda idx: [t[idx] for t in tensors]
        return lambda idx: [t[idx] if t.layout is torch.strided else
                            t.index_select(0, idx).to_dense() for t in tensors]
    return lambda idx: collate([_sample(dataset, int(i)) for i in idx])


def _gatherable(t: torch.Tensor) -> torch.Tensor:
    """A TensorDataset's tensor as its rows are gathered: detached (data, not a parameter), a
    sparse CSR/CSC/BSR tensor as COO (whose ``index_select`` gathers rows; made dense per
    batch)."""
    t = t.detach()
    return t if t.layout in (torch.strided, torch.sparse_coo) else t.to_sparse_coo()


class DeviceFetch:
    """Sample indices ``[n]`` → ``[t[indices] for t in tensors]`` gathered on ``device`` with
    ``index_select`` on the caller's current stream, from tensors moved there once: the same
    samples, in the same order, as ``make_fetch``. The epoch's order goes to the device once
    (``start_epoch``); other indices go from a pinned host tensor, non-blocking.

    Args:
        tensors: the TensorDataset's tensors, ``[N, ...]`` each.
        device: where they live from now on (a CUDA device; a CPU device runs the same path)."""

    def __init__(self, tensors: tuple[torch.Tensor, ...], device: torch.device) -> None:
        self.device = device
        self.tensors = [t.detach().to(device) for t in tensors]  # data: no graph through it
        self.pinned = device.type == "cuda"
        self._order: tuple[torch.Tensor, torch.Tensor] | None = None  # (host [N], device [N])

    def __call__(self, indices: torch.Tensor) -> list[torch.Tensor]:
        return self.gather(self.on_device(indices))

    def start_epoch(self, order: torch.Tensor) -> None:
        """Copy the epoch's sample order ``[N]`` to the device (one copy per epoch)."""
        self._order = (order, self._copied(order))

    def on_device(self, indices: torch.Tensor) -> torch.Tensor:
        """``indices [n]`` on the device: a view of the epoch's order there when they are a
        slice of it (what ``BatchSchedule.next_round`` returns), else a copy."""
        if self._order is not None and indices.dim() == 1 and indices.stride() == (1,):
            host, device_order = self._order
            at = indices.storage_offset() - host.storage_offset()
            if (indices.untyped_storage().data_ptr() == host.untyped_storage().data_ptr()
                    and 0 <= at <= len(host) - len(indices)):
                return device_order[at:at + len(indices)]
        return self._copied(indices)

    def gather(self, indices: torch.Tensor, out: list[torch.Tensor] | None = None
               ) -> list[torch.Tensor]:
        """``[t[indices] for t in tensors]`` for ``indices [n]`` on the device; into ``out``
        (tensors of those shapes) when given."""
        if out is None:
            return [t.index_select(0, indices) for t in self.tensors]
        for t, o in zip(self.tensors, out):
            torch.index_select(t, 0, indices, out=o)
        return out

    def _copied(self, indices: torch.Tensor) -> torch.Tensor:
        idx = indices.to(torch.int64)
        if self.pinned and idx.device.type == "cpu":
            idx = torch.empty(idx.shape, dtype=torch.int64, pin_memory=True).copy_(idx)
        return idx.to(self.device, non_blocking=True)


def device_fetch(data: Any, dataset: Dataset, data_on_device: bool | str,
                 device: torch.device) -> DeviceFetch | None:
    """The fit's ``DeviceFetch`` when its training data lives on the plan's first device
    ``device``, else None (the host gathers or collates every round).

    ``data``: what ``fit`` was given; ``dataset``: its Dataset. ``data_on_device``: ``True`` moves
    a TensorDataset given as the Dataset itself; ``"auto"`` does so on a CUDA device when its
    tensors take at most a quarter of the free memory (``torch.cuda.mem_get_info``); ``False`` never.

    Raises:
        ValueError: ``data_on_device=True`` with data other than a TensorDataset of dense
            tensors (a DataLoader, a Dataset that reads its samples, one with ``get_batch``,
            sparse tensors)."""
    eligible = isinstance(dataset, TensorDataset) and not isinstance(data, DataLoader) \
        and not hasattr(dataset, "get_batch")
    sparse = eligible and any(t.layout is not torch.strided for t in dataset.tensors)
    if data_on_device is True and sparse:
        raise ValueError("data_on_device=True keeps a TensorDataset's tensors on the device and "
                         "gathers each round there into dense batches, but train_dataset holds "
                         "sparse tensors; pass data_on_device='auto' (the host gathers their rows "
                         "and makes them dense, batch by batch), or dense tensors (x.to_dense())")
    eligible = eligible and not sparse
    if data_on_device is True and not eligible:
        raise ValueError(
            f"data_on_device=True keeps a TensorDataset's tensors on the device and gathers each "
            f"round there, but train_dataset is a {type(data).__name__}"
            + (f" over a {type(dataset).__name__}" if isinstance(data, DataLoader) else "")
            + ", read sample by sample on the host; pass a TensorDataset(x, y) itself, or "
            "data_on_device='auto' (its batches are then copied to the device one round ahead)")
    if data_on_device is False or not eligible:
        return None
    if data_on_device == "auto":
        if device.type != "cuda":
            return None
        need = sum(t.numel() * t.element_size() for t in dataset.tensors if t.device != device)
        free, _ = torch.cuda.mem_get_info(device)
        if need > free / 4:
            return None
    return DeviceFetch(dataset.tensors, device)


def read_samples(dataset: Dataset, indices: list[int]) -> list[Any]:
    """``[dataset[i] for i in indices]``, or ``dataset.__getitems__(indices)`` where the dataset
    reads many samples at once (as a DataLoader's fetcher does)."""
    many = getattr(dataset, "__getitems__", None)
    if many:
        return many(indices)
    return [dataset[i] for i in indices]


class CollateFetch:
    """Sample indices ``[n]`` → ``collate_fn`` of the n samples (one batch; evaluation's).

    Args:
        dataset: the map-style dataset.
        collate_fn: a DataLoader's ``collate_fn``: a list of samples → ``(inputs, target)``."""

    def __init__(self, dataset: Dataset, collate_fn: Callable[[list], Any]) -> None:
        self.dataset, self.collate_fn = dataset, collate_fn

    def __call__(self, indices: torch.Tensor) -> Any:
        return plain_batch(self.collate_fn(read_samples(self.dataset, indices.tolist())))


class LearnerFetch:
    """Sample indices ``[n·b]`` of n learners → a ``LearnerBatches``: learner j's b samples
    ``indices[j·b:(j+1)·b]`` collated on their own (padded to its own longest sequence, say);
    b is the run settings' batch size when called.

    Args:
        dataset: the map-style dataset.
        collate_fn: the DataLoader's ``collate_fn``: a list of b samples → ``(inputs, target)``.
        settings: the plan's RunSettings (b)."""

    def __init__(self, dataset: Dataset, collate_fn: Callable[[list], Any],
                 settings: RunSettings) -> None:
        self.dataset, self.collate_fn, self.settings = dataset, collate_fn, settings

    def __call__(self, indices: torch.Tensor) -> LearnerBatches:
        b, idx = self.settings.batch_size, indices.tolist()
        return LearnerBatches([plain_batch(self.collate_fn(read_samples(self.dataset, idx[s:s + b])))
                               for s in range(0, len(idx), b)], b)


def _sample(dataset: Dataset, i: int) -> Any:
    """``dataset[i]``; ValueError naming the index when it is None (default_collate's own error
    names neither the index nor the cause)."""
    sample = dataset[i]
    if sample is None:
        raise ValueError(f"the dataset's sample {i} is None, not an (inputs, target) pair; make "
                         "__getitem__ return a pair such as (image, label) for every index")
    return sample
