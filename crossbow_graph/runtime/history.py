"""What a fit reports: per-epoch and per-evaluation records (DESIGN.md §5, metrics)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

__all__ = ["EpochRecord", "EvalRecord", "History"]


@dataclass(kw_only=True)
class EpochRecord:
    """One epoch.

    Attributes:
        epoch: 1-based epoch number.
        rounds: rounds run in the epoch.
        train_loss: mean training loss over the epoch's learner batches.
        test_accuracy: accuracy of the central model z on the eval dataset at the end of the
            epoch (fraction in [0, 1]), None without one.
        samples_per_s: training samples per second of training time (evaluation excluded).
        train_seconds: cumulative training wall seconds at the end of the epoch.
        replicas_per_device: m during the epoch.
    """

    epoch: int
    rounds: int
    train_loss: float
    test_accuracy: float | None
    samples_per_s: float
    train_seconds: float
    replicas_per_device: int


@dataclass(kw_only=True)
class EvalRecord:
    """One evaluation of z: ``epoch`` as a fraction (2.5 = half-way through the third epoch)."""

    epoch: float
    round: int
    train_seconds: float
    test_accuracy: float
    test_loss: float


@dataclass(kw_only=True)
class History:
    """Everything a fit measured.

    Attributes:
        epochs: one EpochRecord per completed epoch.
        evals: every evaluation of z.
        target_accuracy: the requested target, if any.
        time_to_accuracy_s: training seconds when z first reached the target (None if never).
        epochs_to_accuracy: epochs (fractional) at that point.
        faults: every replica reset for NaN/Inf (runtime/faults.py FaultEvent: round, device,
            replica).
    """

    epochs: list[EpochRecord] = field(default_factory=list)
    evals: list[EvalRecord] = field(default_factory=list)
    target_accuracy: float | None = None
    time_to_accuracy_s: float | None = None
    epochs_to_accuracy: float | None = None
    faults: list = field(default_factory=list)

    @property
    def final_accuracy(self) -> float | None:
        """The last evaluated test accuracy of z, or None."""
        return self.evals[-1].test_accuracy if self.evals else None

    def to_dict(self) -> dict:
        return asdict(self)

    def save_json(self, path: str) -> None:
        """Write the history as JSON to ``path``."""
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=2)
