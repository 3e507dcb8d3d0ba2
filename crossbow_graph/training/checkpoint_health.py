"""Which checkpoints hold a healthy state (a sound loss window, ``LOSS_RATIO``), and the healthy one
a resume after ``DivergenceError`` continues from (docs/reliability.md, After a DivergenceError)."""

from __future__ import annotations

import math
import os
from typing import Any

import torch

__all__ = ["CheckpointHealth", "LOSS_RATIO", "SET_ASIDE_SUFFIX"]

LOSS_RATIO = 10.0  # a checkpoint whose window's loss exceeds this × the lowest is unhealthy
SET_ASIDE_SUFFIX = ".diverged"  # a checkpoint set aside at a DivergenceError


class CheckpointHealth:
    """The health of one run's checkpoints in one directory (module docstring); its state is
    saved in each checkpoint (``state_dict``) and restored by a resume.

    Attributes:
        files: ``(file name, its window's mean loss or None, the window sound, healthy)`` of
            the run's checkpoints in the directory, oldest first."""

    def __init__(self) -> None:
        self.first_loss: float | None = None  # the run's first round's mean loss
        self.lowest: float | None = None  # the lowest loss of a sound window
        self.files: list[tuple[str, float | None, bool, bool]] = []
        self._first: torch.Tensor | None = None  # the first round's loss, not read yet
        self._sum: torch.Tensor | None = None  # Σ finite round losses of the window, 0-dim
        self._count: torch.Tensor | None = None  # rounds of the window with a finite loss

    def see_round(self, round_loss: torch.Tensor) -> None:
        """Add a round's 0-dim mean loss to the window, on its device (no host read)."""
        loss = round_loss.detach().float()
        finite = torch.isfinite(loss)
        if self.first_loss is None and self._first is None:
            self._first = loss.clone()
        value = torch.where(finite, loss, 0.0)
        self._sum = value if self._sum is None else self._sum + value
        self._count = finite.float() if self._count is None else self._count + finite.float()

    def judge(self, name: str) -> None:
        """Judge the window that checkpoint ``name`` closes (one host read), and start the
        next."""
        self._next_window(name, *self._close_window())

    def _next_window(self, name: str, loss: float | None, sound: bool) -> None:
        """The newest checkpoint is healthy when it and this window are sound; ``name``'s
        window (``name`` "": the rounds since the newest checkpoint, at a DivergenceError)."""
        if self.files:
            last, last_loss, last_sound, _ = self.files[-1]
            self.files[-1] = (last, last_loss, last_sound, last_sound and sound)
        if name:
            self.files = [f for f in self.files if f[0] != name] + [(name, loss, sound, False)]

    def _close_window(self) -> tuple[float | None, bool]:
        """The window's mean loss (None: no finite one) and whether it is sound."""
        if self._first is not None:
            first = float(self._first)
            self.first_loss, self._first = (first if math.isfinite(first) else None), None
        count = 0.0 if self._count is None else float(self._count)
        loss = float(self._sum) / count if count else None
        self._sum = self._count = None
        reference = self.reference()
        if loss is None:  # no round, or none with a finite loss (a NaN in every learner)
            return None, True
        sound = reference is None or loss <= LOSS_RATIO * reference
        if sound:
            self.lowest = loss if self.lowest is None else min(self.lowest, loss)
        return loss, sound

    @property
    def healthy(self) -> str | None:
        """The newest checkpoint whose window and the next are sound (module docstring)."""
        return next((f[0] for f in reversed(self.files) if f[3]), None)

    def reference(self) -> float | None:
        """The lowest of the first round's loss and the healthy checkpoints' window losses."""
        known = [x for x in (self.first_loss, self.lowest) if x is not None]
        return min(known) if known else None

    def kept(self, names: list[str]) -> None:
        """Forget the files no longer in the directory (``names``: those left)."""
        self.files = [f for f in self.files if f[0] in names]

    def state_dict(self) -> dict[str, Any]:
        return {"first_loss": self.first_loss, "lowest": self.lowest,
                "files": [list(f) for f in self.files]}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Restore ``state_dict()`` (None: a checkpoint without it, which counts as healthy)."""
        if state is None:
            return
        self.first_loss, self.lowest = state["first_loss"], state["lowest"]
        self.files = [tuple(f) for f in state["files"]]
        self._first = None

    def set_aside(self, directory: str) -> str:
        """At a DivergenceError: rename this run's checkpoints newer than the newest healthy one
        (all of them when none is) to ``….pt.diverged``; returns what ``resume=True`` now does,
        for the error's message."""
        if not self.files:  # no checkpoint of this run yet (or resumed from one without health)
            return ""
        self._next_window("", *self._close_window())  # the rounds since the newest checkpoint
        names = [f[0] for f in self.files]
        keep = names.index(self.healthy) + 1 if self.healthy in names else 0
        aside = [f for f in self.files[keep:] if os.path.isfile(os.path.join(directory, f[0]))]
        for name, *_ in aside:
            path = os.path.join(directory, name)
            os.replace(path, path + SET_ASIDE_SUFFIX)
        self.files = self.files[:keep]
        said = ", ".join(f"{name}{SET_ASIDE_SUFFIX} (training loss {_num(loss)})"
                         for name, loss, *_ in aside)
        if keep:
            name, loss, *_ = self.files[-1]
            return (f"resume=True continues from {os.path.join(directory, name)}, the newest "
                    f"checkpoint whose training loss before and after it stayed within "
                    f"{LOSS_RATIO:g}× of the run's lowest ({_num(loss)}, lowest "
                    f"{_num(self.reference())})"
                    + (f"; the newer one(s), whose state was already on its way to diverging, "
                       f"are set aside as {said}" if aside else ""))
        return (f"no checkpoint of this run holds a healthy state (the training loss rose "
                f"above {LOSS_RATIO:g}× its first round's, {_num(self.first_loss)}, around each): "
                + (f"they are set aside as {said}, so " if aside else "")
                + "resume=True starts afresh")


def _num(x: float | None) -> str:
    return "unknown" if x is None else f"{x:.4g}"
