"""A plan's run: what it was set up with and the checkpoints it wrote or resumed
(``RunRecord``, ``Plan.run_record``; docs/reliability.md, Checkpoints)."""

from __future__ import annotations

import os
from typing import Any, Callable

__all__ = ["RunRecord"]


class RunRecord:
    """A plan's run (``Plan.run_record``): its set-up, and per checkpoint directory the newest
    checkpoint it wrote or resumed from there (what makes a directory's checkpoints its own).

    Attributes:
        setup: ``run_setup`` at the start of the plan's first fit (None before it)."""

    def __init__(self) -> None:
        self.setup: dict[str, Any] | None = None
        self._newest: dict[str, tuple[str, int, int]] = {}

    def begin_fit(self, setup: Callable[[], dict[str, Any]]) -> None:
        """Take the set-up (``setup()``: training/run_setup.py ``run_setup``) at the plan's first
        fit (before a resume); later fits keep it."""
        if self.setup is None:
            self.setup = setup()

    @staticmethod
    def _identity(path: str) -> tuple[str, tuple[str, int, int]]:
        st = os.stat(path)
        return (os.path.realpath(os.path.dirname(os.path.abspath(path))),
                (os.path.basename(path), st.st_ino, st.st_mtime_ns))

    def saw(self, path: str) -> None:
        """``path`` is this run's newest checkpoint in its directory (written or resumed)."""
        directory, ident = self._identity(path)
        self._newest[directory] = ident

    def owns(self, path: str) -> bool:
        """Whether ``path`` is the checkpoint this run last wrote or resumed in its directory."""
        directory, ident = self._identity(path)
        return self._newest.get(directory) == ident

