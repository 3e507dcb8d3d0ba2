"""How far a plan has trained: ``FitProgress`` (``Plan.progress``)."""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["FitProgress"]


@dataclasses.dataclass
class FitProgress:
    """A plan's progress over all its fits. The fit loop (training/trainer.py) writes it, and a
    checkpoint restores it (``load_state_dict``); ``Plan.epochs_done``, ``rounds_done``,
    ``round_in_epoch``, ``position_in_epoch`` and ``train_seconds`` read it.

    Attributes:
        epochs_done: complete epochs.
        rounds_done: rounds run (counted as a round starts).
        round_in_epoch: rounds done in an unfinished epoch (a resumed fit starts there).
        position_in_epoch: samples of the unfinished epoch's order used so far.
        train_seconds: training seconds of the complete epochs (evaluation excluded).
    """

    epochs_done: int = 0
    rounds_done: int = 0
    round_in_epoch: int = 0
    position_in_epoch: int = 0
    train_seconds: float = 0.0

    def start_round(self) -> None:
        """A round starts: it counts in ``rounds_done`` while it runs and its hooks see it."""
        self.rounds_done += 1

    def end_round(self, round_in_epoch: int, position_in_epoch: int) -> None:
        """A round of the epoch ended, at its ``round_in_epoch``-th round and sample
        ``position_in_epoch`` of its order."""
        self.round_in_epoch, self.position_in_epoch = round_in_epoch, position_in_epoch

    def end_epoch(self, seconds: float) -> None:
        """An epoch ended after ``seconds`` of training: the next starts at its beginning."""
        self.train_seconds += seconds
        self.epochs_done += 1
        self.round_in_epoch = self.position_in_epoch = 0

    def state_dict(self) -> dict[str, Any]:
        """The fields by name (the keys of a checkpoint's plan state)."""
        return dataclasses.asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the fields from ``state`` (a checkpoint's plan state: its other keys ignored)."""
        for f in dataclasses.fields(self):
            setattr(self, f.name, state[f.name])
