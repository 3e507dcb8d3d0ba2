"""How far a plan has trained: ``FitProgress`` (``Plan.progress``)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

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
        losses: the learners' losses of the epoch's rounds so far (0-dim tensors, in the rounds'
            order; the epoch's training loss is their finite mean)."""

    epochs_done: int = 0
    rounds_done: int = 0
    round_in_epoch: int = 0
    position_in_epoch: int = 0
    train_seconds: float = 0.0
    losses: list[torch.Tensor] = dataclasses.field(default_factory=list)

    def start_epoch(self) -> None:
        """An epoch starts (or goes on, after a resume in its middle: its losses kept)."""
        if self.position_in_epoch == 0:
            self.losses = []

    def start_round(self) -> None:
        """A round starts: it counts in ``rounds_done`` while it runs and its hooks see it."""
        self.rounds_done += 1

    def end_round(self, round_in_epoch: int, position_in_epoch: int,
                  losses: list[torch.Tensor]) -> None:
        """A round of the epoch ended, at its ``round_in_epoch``-th round and sample
        ``position_in_epoch`` of its order, with its learners' ``losses``."""
        self.round_in_epoch, self.position_in_epoch = round_in_epoch, position_in_epoch
        self.losses.extend(losses)

    def end_epoch(self, seconds: float) -> None:
        """An epoch ended after ``seconds`` of training: the next starts at its beginning."""
        self.train_seconds += seconds
        self.epochs_done += 1
        self.round_in_epoch = self.position_in_epoch = 0

    def state_dict(self) -> dict[str, Any]:
        """The fields by name (the keys of a checkpoint's plan state); ``losses`` as one CPU
        tensor ``[n]``."""
        state = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "losses"}
        state["losses"] = torch.stack(self.losses).cpu() if self.losses else torch.zeros(0)
        return state

    def load_state_dict(self, state: dict[str, Any], device: torch.device | None = None) -> None:
        """Restore the fields from ``state`` (a checkpoint's plan state: its other keys ignored),
        the losses on ``device``."""
        for f in dataclasses.fields(self):
            if f.name != "losses":
                setattr(self, f.name, state[f.name])
        self.losses = [x.to(device) for x in state["losses"].unbind()]
