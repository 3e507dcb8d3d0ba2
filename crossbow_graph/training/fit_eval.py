"""A fit's evaluations of z: when they are due, their records, the target accuracy
(docs/api.md, How a fit runs)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from .history import EvalRecord, History
from .options import FitOptions

if TYPE_CHECKING:
    from ..api import Plan

__all__ = ["FitEvaluation", "finite_mean", "mean_loss"]


class FitEvaluation:
    """The evaluations of one fit: ``options.evals_per_epoch`` evaluation points per epoch, in
    samples of the epoch's order; under torchrun rank 0 evaluates and broadcasts the result."""

    def __init__(self, plan: "Plan", eval_dataset: Any, options: FitOptions,
                 history: History) -> None:
        self.plan, self.eval_dataset, self.options, self.history = plan, eval_dataset, options, history
        self.points: list[int] = []
        self.next = 0

    def start_epoch(self, num_samples: int, position: int, first_round: int) -> float | None:
        """The epoch's evaluation points (sample positions) and the next one after ``position``;
        returns z's accuracy at the epoch's last evaluation so far (one before a resume in its
        middle: after the plan's round ``first_round``, where the epoch began), or None."""
        evals = self.options.evals_per_epoch
        self.points = [num_samples * i // evals for i in range(1, evals + 1)]
        self.next = sum(1 for p in self.points if p <= position)
        done = self.history.evals
        return done[-1].test_accuracy if done and done[-1].round > first_round else None

    def due(self, position: int, last: bool) -> bool:
        """Whether ``position`` passed the next evaluation point (or the epoch's ``last`` round
        ran) with an eval_dataset; passes the points reached."""
        points = self.points
        due = self.next < len(points) and (position >= points[self.next] or last)
        if not due or self.eval_dataset is None:
            return False
        while self.next < len(points) and (position >= points[self.next] or last):
            self.next += 1
        return True

    def measure(self, epoch: float, train_seconds: float) -> EvalRecord:
        """z's accuracy and loss, recorded in the History at ``epoch`` (fractional) after
        ``train_seconds`` of training."""
        plan = self.plan
        acc, test_loss = self._evaluate()
        self.history.evals.append(EvalRecord(epoch=epoch, round=plan.rounds_done,
                                             train_seconds=train_seconds, test_accuracy=acc,
                                             test_loss=test_loss,
                                             test_extras=dict(plan.last_eval_extras)))
        return self.history.evals[-1]

    def reached_before(self) -> bool:
        """Whether an evaluation already in the History (a resumed run's) reached
        ``target_accuracy``: the run it continues had stopped there."""
        target = self.options.target_accuracy
        return target is not None and any(e.test_accuracy is not None and e.test_accuracy >= target
                                          for e in self.history.evals)

    def reached(self, record: EvalRecord) -> bool:
        """Whether ``record`` reaches ``target_accuracy``; records the time and epochs to it."""
        target, acc = self.options.target_accuracy, record.test_accuracy
        if target is None or acc is None or acc < target:
            return False
        self.history.time_to_accuracy_s = record.train_seconds
        self.history.epochs_to_accuracy = record.epoch
        return True

    def _evaluate(self) -> tuple[float | None, float]:
        """``Plan.evaluate`` without its data check (the fit checked eval_dataset at its start)."""
        plan, comm, opts = self.plan, self.plan.comm, self.options
        acc, loss = (0.0, 0.0) if comm is not None and not comm.is_main else plan.central.evaluate(
            self.eval_dataset, batch_size=opts.eval_batch_size, metric_fn=opts.metric_fn,
            check=False)
        if comm is None:
            return acc, loss
        acc, loss = comm.broadcast_floats([float("nan") if acc is None else acc, loss],
                                          plan.rounds_done - 1)
        return (None if acc != acc else acc), loss


def finite_mean(losses: torch.Tensor) -> torch.Tensor:
    """The mean of the finite entries of ``losses [n]``, 0-dim, NaN when none is, without a host
    read (a faulty replica's NaN/Inf loss is left out, as the replica is: engine/faults.py)."""
    finite = torch.isfinite(losses)
    return torch.where(finite, losses, 0.0).sum() / finite.sum()


def mean_loss(comm: Any, losses: torch.Tensor, round_index: int) -> float:
    """The mean of the finite ``losses [n]`` over every rank (one all-reduce under torchrun)."""
    if comm is None:
        return float(finite_mean(losses))
    finite = torch.isfinite(losses)
    total, count = comm.sum_floats([float(losses[finite].sum()), float(finite.sum())], round_index)
    return total / count if count else float("nan")
