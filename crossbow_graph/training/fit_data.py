"""The data side of a fit: the datasets' checks, the epochs' order, how rounds are read
(docs/api.md, How a fit runs; docs/runtime.md, Your DataLoader)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import DataLoader

from .data import BatchSchedule, LearnerFetch, as_dataset, collate_of, device_fetch, make_fetch
from .evaluation import eval_samples
from .loader import RoundLoader, check_loader
from .options import FitOptions
from .validate import check_first_batch

if TYPE_CHECKING:
    from ..api import Plan

__all__ = ["FitData", "rank_rows"]


class FitData:
    """A fit's training and evaluation data.

    Attributes:
        train: the training Dataset (a DataLoader's dataset).
        schedule: the epochs' order (training/data.py ``BatchSchedule``), after ``open``.
        fetch: sample indices ``[n]`` → a collated batch, after ``open``.
        loader: the RoundLoader of a DataLoader with workers (or pinned memory for CUDA), or None.
        prefetch: whether host batches are copied to the devices one round ahead.

    Raises:
        ValueError: ``target_accuracy`` without an eval_dataset, fewer samples than one round.
    """

    def __init__(self, plan: "Plan", train_dataset: Any, eval_dataset: Any,
                 options: FitOptions) -> None:
        self.plan, self.options = plan, options
        self.train_dataset, self.eval_dataset = train_dataset, eval_dataset
        if options.target_accuracy is not None and eval_dataset is None:
            raise ValueError("target_accuracy needs an eval_dataset to measure z's accuracy on")
        self.train = as_dataset(train_dataset)
        k, b = plan.num_learners, plan.batch_size
        if isinstance(train_dataset, DataLoader):
            check_loader(train_dataset, b, stacklevel=6)  # the caller of Plan.fit
        if len(self.train) < k * b:
            raise ValueError(
                f"train_dataset has {len(self.train)} samples, fewer than one round of {k} "
                f"learners × {b} samples = {k * b}; lower the batch size or the replicas, or add data"
            )
        self.loader: RoundLoader | None = None

    def agree(self, comm: Any) -> None:
        """Under torchrun: every rank runs the same fit (``Comm.agree``; DistributedError)."""
        opts, plan = self.options, self.plan
        comm.agree({"train samples": len(self.train), "epochs": opts.epochs,
                    "shuffle": opts.shuffle, "seed": opts.seed,
                    "evals_per_epoch": opts.evals_per_epoch,
                    "target_accuracy": opts.target_accuracy,
                    "max_grad_norm": opts.max_grad_norm,
                    "checkpoint_every": opts.checkpoint_every, "resume": opts.resume,
                    "rounds done": plan.rounds_done,
                    "eval samples": None if self.eval_dataset is None else len(self.eval_dataset)},
                   "the fit")

    def open(self) -> None:
        """The order, the fetch and loader, the first batches' checks, the data on the device
        (``options.data_on_device``), z's BatchNorm re-estimation data.

        Raises:
            ValueError: a first batch that does not fit the plan (training/validate.py), or
                ``data_on_device=True`` for data not a TensorDataset.
        """
        opts, plan = self.options, self.plan
        self.schedule = BatchSchedule(len(self.train), shuffle=opts.shuffle, seed=opts.seed)
        self.fetch, self.loader = self._data_path()
        self._check_first_batches()
        resident = device_fetch(self.train_dataset, self.train, opts.data_on_device,
                                plan.states[0].torch_device)
        self.fetch = resident or self.fetch
        self.prefetch = resident is None
        plan.bn_recalibration.use(self.fetch, len(self.train), batches=opts.bn_recalibration_batches,
                                  seed=opts.seed)

    def close(self) -> None:
        """Stop the loader's workers, if any."""
        if self.loader is not None:
            self.loader.close()

    def _data_path(self) -> tuple[Any, RoundLoader | None]:
        """The fetch (indices → batch, in any process) and the RoundLoader, if one loads."""
        train, data = self.train, self.train_dataset
        collate = collate_of(data)
        if collate is not None:  # every learner's b samples collated on their own
            fetch = LearnerFetch(train, collate, self.plan.settings)
        elif hasattr(train, "get_batch"):  # whole batches at once (e.g. vectorised augmentation)
            fetch = train.get_batch
        else:
            fetch = make_fetch(train)
        cuda = any(s.torch_device.type == "cuda" for s in self.plan.states)
        loads = isinstance(data, DataLoader) and (data.num_workers > 0 or (data.pin_memory and cuda))
        return fetch, RoundLoader(data, self.plan, self.options.seed) if loads else None

    def _check_first_batches(self) -> None:
        """The first learner's first training batch and the first b samples of the
        eval_dataset, as evaluation reads them, fit the plan (``check_first_batch``)."""
        plan, b = self.plan, self.plan.batch_size
        first = self.schedule.next_round(self.schedule.order(0), 0, 1, b)
        check_first_batch(plan, self.train, self.fetch, first)
        if self.eval_dataset is not None:
            evals = eval_samples(self.eval_dataset)  # the samples evaluation scores
            check_first_batch(plan, evals, make_fetch(evals, collate_of(self.eval_dataset)),
                              torch.arange(min(b, len(evals))), what="eval_dataset")


def rank_rows(plan: "Plan", indices: torch.Tensor | None) -> torch.Tensor | None:
    """This rank's rows of a round's indices ``[k·b]``: rank r's learners are the global learners
    r·k_r … (r+1)·k_r − 1 (k_r = k / world size); all of them in a single process."""
    comm = plan.comm
    if comm is None or indices is None:
        return indices
    per_rank = len(indices) // comm.world_size
    return indices[comm.rank * per_rank:(comm.rank + 1) * per_rank]
