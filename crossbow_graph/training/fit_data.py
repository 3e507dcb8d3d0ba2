"""The data side of a fit: the datasets' checks, the epochs' order, how rounds are read
(docs/api.md, How a fit runs; docs/runtime.md, Your DataLoader)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import DataLoader

from .data import BatchSchedule, as_dataset, collate_of, make_fetch
from .evaluation import eval_samples
from .loader import BatchSource, batch_source, check_loader, fit_shuffle
from .options import FitOptions
from .validate import check_eval_dataset, check_first_batch

if TYPE_CHECKING:
    from .fit_plan import FitPlan

__all__ = ["FitData", "rank_rows", "tokens_per_sample"]


class FitData:
    """A fit's training and evaluation data.

    Attributes:
        train: the training Dataset (a DataLoader's dataset).
        shuffle: whether every epoch is shuffled (``fit_shuffle``: ``fit(shuffle=)``, or a
            DataLoader's own).
        batches_per_epoch: the steps of a plain loop's epoch over the data: a DataLoader's
            ``len``, a Dataset's ⌈N/b⌉ (an LR schedule's ``"batch"`` interval).
        schedule: the epochs' order (training/data.py ``BatchSchedule``), after ``open``.
        source: the fit's one BatchSource (training/loader.py), after ``open``.

    Raises:
        ValueError: ``target_accuracy`` or ``target_loss`` without an eval_dataset, fewer
            samples than one round."""

    def __init__(self, plan: "FitPlan", train_dataset: Any, eval_dataset: Any,
                 options: FitOptions) -> None:
        self.plan, self.options = plan, options
        self.train_dataset, self.eval_dataset = train_dataset, eval_dataset
        if options.target_accuracy is not None and eval_dataset is None:
            raise ValueError("target_accuracy needs an eval_dataset to measure z's accuracy on")
        if options.target_loss is not None and eval_dataset is None:
            raise ValueError("target_loss needs an eval_dataset to measure z's test loss on; give "
                             "fit(eval_dataset=...), e.g. datasets.fortunes('val')")
        self.train = as_dataset(train_dataset)
        self.shuffle = fit_shuffle(train_dataset, options.shuffle)
        self.batches_per_epoch = len(train_dataset) if isinstance(train_dataset, DataLoader) \
            else -(-len(self.train) // plan.settings.batch_size)
        k, b = plan.num_learners, plan.settings.batch_size
        if isinstance(train_dataset, DataLoader):
            check_loader(train_dataset, b, stacklevel=7)  # the caller of Plan.fit
        if len(self.train) < k * b:
            raise ValueError(
                f"train_dataset has {len(self.train)} samples, fewer than one round of {k} "
                f"learners × {b} samples = {k * b}; lower the batch size or the replicas, or add data"
            )
        self.source: BatchSource | None = None

    def agree(self, comm: Any) -> None:
        """Under torchrun: every rank runs the same fit (``Comm.agree``; DistributedError)."""
        opts, plan = self.options, self.plan
        comm.agree({"train samples": len(self.train), "epochs": opts.epochs,
                    "shuffle": self.shuffle, "seed": opts.seed,
                    "evals_per_epoch": opts.evals_per_epoch,
                    "target_accuracy": opts.target_accuracy, "target_loss": opts.target_loss,
                    "max_grad_norm": opts.max_grad_norm,
                    "checkpoint_every": opts.checkpoint_every, "resume": opts.resume,
                    "rounds done": plan.progress.rounds_done,
                    "eval samples": None if self.eval_dataset is None else len(self.eval_dataset)},
                   "the fit")

    def open(self) -> None:
        """The order, the BatchSource (training/loader.py ``batch_source``: resident on the
        device, a DataLoader's, or fetched on the host), the first batches' checks, z's BatchNorm
        re-estimation data.

        Raises:
            ValueError: a first batch that does not fit the plan (training/validate.py), or
                ``data_on_device=True`` for data not a TensorDataset."""
        opts, plan = self.options, self.plan
        self.schedule = BatchSchedule(len(self.train), shuffle=self.shuffle, seed=opts.seed)
        self.source = batch_source(self.train_dataset, self.train, plan, seed=opts.seed,
                                   data_on_device=opts.data_on_device)
        self._check_first_batches()
        plan.central.recalibration.use(self.source.fetch, len(self.train),
                                  batches=opts.bn_recalibration_batches, seed=opts.seed)

    def close(self) -> None:
        """Stop the DataLoader's workers, if any."""
        if self.source is not None:
            self.source.close()

    def _check_first_batches(self) -> None:
        """The first learner's first training batch and the first b samples of the
        eval_dataset, as evaluation reads them, fit the plan (``check_first_batch``)."""
        plan, b = self.plan, self.plan.settings.batch_size
        first = self.schedule.next_round(self.schedule.order(0), 0, 1, b)
        check_first_batch(plan, self.train, self.source.host_fetch, first)
        if self.eval_dataset is not None:
            check_eval_dataset(plan, self.eval_dataset)


def rank_rows(plan: "FitPlan", indices: torch.Tensor | None) -> torch.Tensor | None:
    """This rank's rows of a round's indices ``[k·b]``: rank r's learners are the global learners
    r·k_r … (r+1)·k_r − 1 (k_r = k / world size); all of them in a single process."""
    comm = plan.comm
    if comm is None or indices is None:
        return indices
    per_rank = len(indices) // comm.world_size
    return indices[comm.rank * per_rank:(comm.rank + 1) * per_rank]


def tokens_per_sample(train_dataset: Any) -> int | None:
    """Tokens one training sample predicts: the ``block_size`` of a ``datasets.TextDataset``
    (also under a DataLoader or ``torch.utils.data.Subset``), else None (no tokens counted)."""
    data = train_dataset.dataset if isinstance(train_dataset, DataLoader) else train_dataset
    while isinstance(data, torch.utils.data.Subset):
        data = data.dataset
    size = getattr(data, "block_size", None)
    return size if isinstance(size, int) and not isinstance(size, bool) and size > 0 else None
