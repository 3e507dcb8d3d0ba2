"""The user's DataLoader, honoured: its collate_fn, worker processes, pinning and seeds, on the
plan's batches (docs/design-overview.md §6; docs/runtime.md, Your DataLoader).

The plan decides which samples every learner gets (``BatchSchedule``), the DataLoader how they
are loaded: ``check_loader`` refuses a sampler or batch sampler; ``RoundLoader`` runs a DataLoader
with the user's loading settings whose sampler yields learner j's b indices of round t, so that
its workers load whole rounds ahead while the learners train."""

from __future__ import annotations

import random
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator, Literal

import numpy as np
import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, RandomSampler, Sampler

from ..engine.data.batches import LearnerBatches
from .collate import collate, plain_batch
from .data import (LearnerFetch, collate_of, device_fetch, make_fetch, read_samples,
                   yields_every_sample)

if TYPE_CHECKING:
    from .fit_plan import FitPlan

__all__ = ["BatchSource", "RoundLoader", "batch_source", "check_loader", "fit_shuffle",
           "seed_learner_batch"]

_LOADER_TAG = 0x4C4F4144  # "LOAD": keeps these seeds apart from seed_host_rngs' (engine/learning/learners.py)


def check_loader(loader: DataLoader, batch_size: int, what: str = "train_dataset",
                 stacklevel: int = 2) -> None:
    """Refuse a DataLoader whose settings choose the samples, which the plan does (docs/runtime.md,
    Your DataLoader).

    A ``SequentialSampler`` or plain ``RandomSampler`` is accepted: the order is
    ``fit(shuffle=, seed=)``'s, by default the DataLoader's ``shuffle`` (``fit_shuffle``).
    ``batch_size`` and ``drop_last`` are not used; a ``batch_size`` other than b is a
    ``UserWarning`` (once per call) that says b is used and how to silence it.

    Raises:
        ValueError: a ``batch_sampler``, ``batch_size=None`` (single samples), or a sampler
            other than those two (e.g. ``WeightedRandomSampler``, ``DistributedSampler``); the
            message says what the plan does instead and the fix."""
    plan_draws = (f"the plan draws every learner's batch of b = {batch_size} itself (disjoint "
                  "batches from one seeded order per epoch, fit(shuffle=, seed=); under torchrun "
                  "it shards the samples across the ranks too)")
    batches = loader.batch_sampler
    if loader.batch_size is None and batches is not None:
        raise ValueError(f"{what} is a DataLoader with a batch_sampler "
                         f"({type(batches).__name__}), but {plan_draws}; pass "
                         "DataLoader(dataset, batch_size=..., collate_fn=..., num_workers=...) "
                         "without batch_sampler")
    if loader.batch_size is None:
        raise ValueError(f"{what} is a DataLoader with batch_size=None, which loads single "
                         f"samples without collating them, but the learners take batches: "
                         f"{plan_draws}; give it a batch_size (b is the plan's) and, if "
                         "needed, a collate_fn")
    if not yields_every_sample(loader) or type(batches) is not BatchSampler:
        raise ValueError(f"{what} is a DataLoader with a sampler ({type(loader.sampler).__name__}), "
                         f"but {plan_draws}, so it cannot follow the sampler; pass the DataLoader "
                         "without it (its shuffle=True or False is honoured), and to weight or select samples give "
                         "a dataset that does (e.g. a torch.utils.data.Subset)")
    if loader.batch_size != batch_size:
        warnings.warn(f"{what} is a DataLoader with batch_size={loader.batch_size}, but every "
                      f"learner takes batches of the plan's b = {batch_size} (compile(batch_size=)"
                      ", or what a policy set), and its batch_size is not used; pass "
                      f"DataLoader(..., batch_size={batch_size}) to silence this warning",
                      UserWarning, stacklevel=stacklevel)


def fit_shuffle(data: Any, shuffle: bool | None) -> bool:
    """Whether a fit shuffles every epoch: ``fit(shuffle=)`` as given; None: a DataLoader's own
    setting (its sampler a ``RandomSampler``: ``DataLoader(shuffle=True)``; a
    ``SequentialSampler``, ``shuffle=False``, its default: the dataset's order), else True."""
    if shuffle is not None:
        return shuffle
    if isinstance(data, DataLoader):
        return isinstance(data.sampler, RandomSampler)
    return True


def seed_learner_batch(fit_seed: int, epoch: int, position: int) -> None:
    """Seed Python's ``random``, NumPy's global RNG and torch's CPU generator from (fit seed,
    epoch, position) (``numpy.random.SeedSequence``) before the learner batch
    ``order[position:position + b]`` is read in a DataLoader worker: augmentation draws depend on
    the fit's seed and the batch alone (docs/runtime.md, Your DataLoader)."""
    words = np.random.SeedSequence([fit_seed % 2**64, epoch, position,
                                    _LOADER_TAG]).generate_state(4)
    random.seed(int.from_bytes(words.tobytes(), "little"))
    np.random.seed(words)
    torch.default_generator.manual_seed(int.from_bytes(words[:2].tobytes(), "little"))


def _as_is(item: Any) -> Any:
    """The DataLoader's collate_fn: an item is already a collated learner batch."""
    return item


class _LearnerBatchView(Dataset):
    """The dataset as the DataLoader's workers read it: a key ``(epoch, position, indices)`` →
    ``(position, collate_fn(samples))`` (detached and dense, ``plain_batch``), read after
    ``seed_learner_batch``. Other attributes are the user's ``dataset``'s, for a worker_init_fn
    that reads ``get_worker_info().dataset``."""

    def __init__(self, dataset: Dataset, collate_fn: Callable[[list], Any] | None,
                 seed: int) -> None:
        self.dataset, self.collate_fn, self.seed = dataset, collate_fn, seed

    def __getitem__(self, key: tuple[int, int, list[int]]) -> tuple[int, Any]:
        epoch, position, idx = key
        seed_learner_batch(self.seed, epoch, position)
        if self.collate_fn is None and hasattr(self.dataset, "get_batch"):
            return position, self.dataset.get_batch(torch.tensor(idx))  # reads a batch at once
        samples = read_samples(self.dataset, idx)
        if self.collate_fn is None:
            return position, collate(samples)
        return position, plain_batch(self.collate_fn(samples))

    def __len__(self) -> int:
        return len(self.dataset)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("dataset", "collate_fn", "seed"):
            raise AttributeError(name)  # not set yet (unpickling in a spawned worker)
        return getattr(self.dataset, name)


class _BatchKeys(Sampler):
    """The DataLoader's sampler: the keys ``(epoch, q, order[q:q+b])`` of this process's learner
    batches from ``position`` of the epoch's ``order`` on, in the order the rounds take them
    (docs/runtime.md, "Your DataLoader"); set by ``RoundLoader`` before each ``iter``."""

    def __init__(self) -> None:
        self.order = torch.zeros(0, dtype=torch.int64)
        self.epoch = self.position = self.num_learners = self.batch_size = 0
        self.rank, self.world_size = 0, 1

    def __iter__(self) -> Iterator[tuple[int, int, list[int]]]:
        b, e = self.batch_size, self.epoch
        k = self.num_learners if self.world_size > 1 else 1  # one process: batch after batch
        n = k * b * self.world_size  # one round of every rank's learners
        end = self.position + (len(self.order) - self.position) // n * n
        for p in range(self.position, end, n):
            for q in range(p + self.rank * k * b, p + (self.rank + 1) * k * b, b):
                yield e, q, self.order[q:q + b].tolist()


class RoundLoader:
    """Loads the plan's rounds through one DataLoader per fit with the user's loading settings,
    one item per learner batch (``_BatchKeys``); docs/runtime.md, "Your DataLoader".

    Args:
        loader: the user's DataLoader (``check_loader`` passed).
        plan: the Plan: b (``plan.batch_size``) and, under torchrun, the rank's learners.
        seed: the fit's seed (``seed_learner_batch``)."""

    def __init__(self, loader: DataLoader, plan: "FitPlan", seed: int) -> None:
        self.plan = plan
        self.keys = _BatchKeys()
        comm = plan.comm
        self.keys.rank, self.keys.world_size = (comm.rank, comm.world_size) if comm else (0, 1)
        generator = loader.generator
        if generator is None:
            generator = torch.Generator().manual_seed(seed)
        collate = collate_of(loader)
        extra = {"in_order": loader.in_order} if hasattr(loader, "in_order") else {}
        self.loader = DataLoader(
            _LearnerBatchView(loader.dataset, collate, seed), batch_size=None, sampler=self.keys,
            collate_fn=_as_is, num_workers=loader.num_workers, pin_memory=loader.pin_memory,
            timeout=loader.timeout, worker_init_fn=loader.worker_init_fn,
            multiprocessing_context=loader.multiprocessing_context, generator=generator,
            prefetch_factor=loader.prefetch_factor if loader.num_workers else None,
            persistent_workers=loader.persistent_workers,
            pin_memory_device=loader.pin_memory_device, **extra)
        self.iterator: Iterator | None = None
        self.expect: tuple[int, int, int] | None = None  # the iterator's next (q, k, b)
        self.starts: dict[int, int] = {}  # round → its position in the epoch's order
        self.waiting: dict[int, Any] = {}  # position → a batch that came before its turn

    def start_epoch(self, order: torch.Tensor, position: int, epoch: int, first_round: int) -> None:
        """A new epoch: its order ``[N]``, the position it starts at (> 0 when resumed in the
        middle), its number and the index of its first round."""
        self.keys.order, self.keys.epoch = order, epoch
        self.starts = {first_round: position}
        self._drop_iterator()

    def load(self, round_index: int, indices: torch.Tensor) -> LearnerBatches:
        """Round ``round_index``'s batches of this process's learners, whose samples are
        ``indices [k_r·b]`` (learner j's at ``[j·b, (j+1)·b)``), from the DataLoader's workers.
        Rounds are asked for in order (a round again when the one asked before was dropped)."""
        keys, b = self.keys, self.plan.settings.batch_size
        k = len(indices) // b
        position = self.starts[round_index]
        first = position + keys.rank * k * b  # this rank's first batch of the round
        assert torch.equal(keys.order[first:first + k * b], indices), "not the epoch order's"
        if self.expect is None or not self._continues(first, k, b):
            self._restart(position, k, b)
        batches = [self._item(q) for q in range(first, first + k * b, b)]
        after = position + len(indices) * keys.world_size
        self.expect = (after + keys.rank * k * b, k, b)
        self.starts = {t: p for t, p in self.starts.items() if t >= round_index}
        self.starts[round_index + 1] = after
        return LearnerBatches(batches, b)

    def _continues(self, first: int, k: int, b: int) -> bool:
        """Whether the iterator's next batches are the round's whose first is at ``first``."""
        q, k0, b0 = self.expect
        return q == first and b0 == b and (k0 == k or self.keys.world_size == 1)

    def _item(self, q: int) -> Any:
        """The learner batch at position ``q``, waiting for it if needed. The iterator holds every
        batch of the rounds ``load`` asks for: its keys run to the epoch's last full batch in one
        process, and to the last full round of its k under torchrun, where a new k restarts it."""
        while q not in self.waiting:
            item = next(self.iterator, None)
            assert item is not None, f"the DataLoader's keys ended before learner batch {q}"
            got, batch = item
            self.waiting[got] = batch
        return self.waiting.pop(q)

    def _restart(self, position: int, k: int, b: int) -> None:
        self._drop_iterator()
        keys = self.keys
        keys.position, keys.num_learners, keys.batch_size = position, k, b
        self.iterator = iter(self.loader)

    def _drop_iterator(self, stop: bool = False) -> None:
        """Forget the items in flight; without persistent workers (or with ``stop``), stop the
        workers now, not when the iterator is collected (an exception's traceback can hold it)."""
        if self.iterator is not None and (stop or not self.loader.persistent_workers):
            _stop_workers(self.iterator)
        self.iterator, self.expect, self.waiting = None, None, {}

    def close(self) -> None:
        """Stop the DataLoader's workers (persistent ones too, also when an exception came while
        ``iter`` restarted them): the fit is over."""
        kept = getattr(self.loader, "_iterator", None)  # torch's iterator of persistent workers
        self._drop_iterator(stop=True)
        if kept is not None:
            _stop_workers(kept)
        self.loader = None


def _stop_workers(iterator: Iterator) -> None:
    """Stop a DataLoader iterator's worker processes, as its ``__del__`` does (idempotent)."""
    shutdown = getattr(iterator, "_shutdown_workers", None)  # multi-process iterators have it
    if shutdown is not None:
        shutdown()


Route = Literal["host", "loader", "resident"]


@dataclass(frozen=True)
class BatchSource:
    """How a fit's rounds get their samples, chosen once per fit (``batch_source``;
    docs/runtime.md, "Data paths").

    Attributes:
        route: ``"host"`` (gathered and collated on the host; worker processes fetch their own
            rows), ``"loader"`` (a user's DataLoader loads each round in this process; worker
            processes receive their rows), ``"resident"`` (a TensorDataset on the device,
            gathered there).
        fetch: sample indices ``[n]`` → collated batch, in any process.
        host_fetch: the same samples read on the host (the first batches' checks).
        loader: the RoundLoader of the ``"loader"`` route, else None."""

    route: Route
    fetch: Callable[[torch.Tensor], Any]
    host_fetch: Callable[[torch.Tensor], Any]
    loader: RoundLoader | None = None

    @property
    def load(self) -> Callable[[int, torch.Tensor], Any] | None:
        """(round t, indices ``[k·b]``) → the round's batch, in round order, or None."""
        return self.loader.load if self.loader is not None else None

    @property
    def copies_ahead(self) -> bool:
        """Whether the next round's batch is loaded and copied to the devices a round ahead
        (on CUDA streams): host and loader batches, not resident ones."""
        return self.route != "resident"

    def start_epoch(self, order: torch.Tensor, position: int, epoch: int, first_round: int) -> None:
        """The epoch's sample order from ``position`` on (``RoundLoader.start_epoch``; resident
        data: ``DeviceFetch.start_epoch``)."""
        if self.loader is not None:
            self.loader.start_epoch(order, position, epoch, first_round)
        elif self.route == "resident":
            self.fetch.start_epoch(order)

    def close(self) -> None:
        """Stop the DataLoader's workers, if any."""
        if self.loader is not None:
            self.loader.close()


def batch_source(data: Any, train: Dataset, plan: "FitPlan", *, seed: int,
                 data_on_device: bool | str) -> BatchSource:
    """The fit's BatchSource for ``data`` (what ``fit`` was given) over its Dataset ``train``:
    resident on the plan's first device (``device_fetch``), else loaded by a DataLoader with
    worker processes (or pinned memory for CUDA devices), else fetched on the host (a
    DataLoader's ``collate_fn`` per learner, a dataset's ``get_batch``, or default collation).

    Raises:
        ValueError: ``data_on_device=True`` with data other than a TensorDataset."""
    collate = collate_of(data)
    if collate is not None:  # every learner's b samples collated on their own
        host = LearnerFetch(train, collate, plan.settings)
    elif hasattr(train, "get_batch"):  # whole batches at once (e.g. vectorised augmentation)
        host = train.get_batch
    else:
        host = make_fetch(train)
    resident = device_fetch(data, train, data_on_device, plan.states[0].torch_device)
    if resident is not None:
        return BatchSource("resident", resident, host)
    cuda = any(s.torch_device.type == "cuda" for s in plan.states)
    if isinstance(data, DataLoader) and (data.num_workers > 0 or (data.pin_memory and cuda)):
        return BatchSource("loader", host, host, RoundLoader(data, plan, seed))
    return BatchSource("host", host, host)
