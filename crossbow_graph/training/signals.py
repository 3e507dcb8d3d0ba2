"""SIGTERM during a fit: finish the round, write a checkpoint, stop (docs/reliability.md, Stopping
a fit: SIGTERM and Ctrl-C, which gives the rules: a repeat within ``SAME_STOP_S`` seconds, exit
status 143, torchrun, the handlers restored after the fit; worker processes ignore SIGTERM)."""

from __future__ import annotations

import logging
import signal
import threading
import time
from typing import TYPE_CHECKING, Any

from ..errors import TrainingInterrupted

if TYPE_CHECKING:
    from .fit_plan import FitPlan

__all__ = ["StopSignal", "STOP_SIGNALS", "SAME_STOP_S", "interruption"]

log = logging.getLogger("crossbow_graph.trainer")

STOP_SIGNALS = (signal.SIGTERM,)
SAME_STOP_S = 5.0  # seconds after a stop signal in which the same signal again is the same stop


class StopSignal:
    """Notes SIGTERM while a fit runs (a context manager; module docstring).

    Outside the main thread (where Python cannot install handlers) it does nothing.

    Attributes:
        received: the signal number received, or None.
        consumed: the fit stopped for it (set by the Trainer); otherwise ``__exit__`` raises the
            signal again after restoring the previous handlers."""

    def __init__(self) -> None:
        self.received: int | None = None
        self.consumed = False
        self._first_s = 0.0  # time.monotonic() of the first signal
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> "StopSignal":
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        name, now = signal.Signals(signum).name, time.monotonic()
        if self.received is None:
            self.received, self._first_s = signum, now
            log.warning("%s received: the fit stops after the round in progress (writing a "
                        "checkpoint where it has a checkpoint_dir); send it again after %g s to "
                        "end the process at once", name, SAME_STOP_S)
            return
        if now - self._first_s < SAME_STOP_S:  # e.g. SLURM's and torchrun's agent's, to a rank
            log.info("%s received again %.2f s after the first: the same stop", name,
                     now - self._first_s)
            return
        previous = self._restore(signum)  # a second one acts as before the fit
        signal.signal(signum, previous)
        if callable(previous):
            previous(signum, frame)
        elif previous == signal.SIG_DFL:
            signal.raise_signal(signum)

    def _restore(self, signum: int) -> Any:
        previous = self._previous.get(signum)
        return signal.SIG_DFL if previous is None else previous

    def __exit__(self, *exc: Any) -> None:
        for sig in self._previous:
            signal.signal(sig, self._restore(sig))
        if self.received is not None and not self.consumed:
            signal.raise_signal(self.received)  # it came after the last round: act on it now


def interruption(plan: "FitPlan", signum: int, checkpoint: str | None, *,
                 announce: bool = True) -> TrainingInterrupted:
    """The TrainingInterrupted of a fit that stopped on ``signum`` after the plan's rounds done,
    its state in ``checkpoint`` (None: no checkpoint_dir); its message is logged (logger
    ``crossbow_graph.trainer``, WARNING: on stderr where logging is not configured) with
    ``announce``."""
    name = signal.Signals(signum).name
    saved = (f"checkpoint {checkpoint} holds its state; run the same fit with resume=True "
             "(crossbow-graph train --resume) to continue it" if checkpoint is not None else
             "it has no checkpoint_dir, so its state is in this process only")
    message = (f"the fit stopped on {name} after {plan.progress.rounds_done} rounds (round "
               f"{plan.progress.round_in_epoch} of epoch {plan.progress.epochs_done + 1}): {saved}")
    if announce:
        log.warning("%s", message)
    return TrainingInterrupted(message, signal_number=signum, rounds_done=plan.progress.rounds_done,
                               checkpoint=checkpoint)
