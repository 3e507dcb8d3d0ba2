"""The replica auto-tuner's decisions from measured throughput: numbers in, steps out, no clock
and no plan (docs/runtime.md, "The auto-tuner"; the notch: McGill, Tukey and Larsen,
"Variations of box plots", The American Statistician 32(1), 1978)."""

from __future__ import annotations

import functools
import math
import statistics
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import numpy as np

__all__ = ["Measurement", "exceeds", "verdict", "sub_window_rates", "Setting", "Decision",
           "TuningRule", "NOTCH"]

NOTCH = 1.58  # the box plot's notch: median ± 1.58·IQR/√n (McGill, Tukey and Larsen 1978)
HELD_FIRST = 2  # windows that form the reference before holding compares with it
DRIFT_WINDOWS = 3  # windows in a row off the reference, on one side, that re-probe
HELD_WINDOWS = 8  # while holding, the reference pools the last this many windows that were not off


@dataclass(frozen=True)
class Measurement:
    """Throughput of one configuration: ``rates`` (samples/s of each sub-window, pooled windows
    one after the other) from ``windows`` windows whose medians are ``window_medians``
    (default: the median of ``rates``)."""

    rates: tuple[float, ...]
    windows: int = 1
    window_medians: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        assert self.rates and self.windows >= 1, "a measurement needs a sub-window"
        if not self.window_medians:
            object.__setattr__(self, "window_medians", (statistics.median(self.rates),))

    @property
    def samples_per_s(self) -> float:
        """The median of the sub-windows' samples/s."""
        return statistics.median(self.rates)

    @property
    def spread(self) -> float:
        """Half the width of the median's interval, samples/s: max(1.58·IQR/√n over the n
        sub-windows, half the range of the windows' medians)."""
        n = len(self.rates)
        notch = 0.0
        if n > 1:
            q1, _, q3 = statistics.quantiles(self.rates, n=4, method="inclusive")
            notch = NOTCH * (q3 - q1) / math.sqrt(n)
        between = (max(self.window_medians) - min(self.window_medians)) / 2
        return max(notch, between)

    @property
    def low(self) -> float:
        """The lower end of the median's interval, samples/s."""
        return self.samples_per_s - self.spread

    @property
    def high(self) -> float:
        """The upper end of the median's interval, samples/s."""
        return self.samples_per_s + self.spread

    def pooled(self, other: "Measurement") -> "Measurement":
        """This measurement and ``other`` (of the same configuration) as one."""
        return Measurement(self.rates + other.rates, self.windows + other.windows,
                           self.window_medians + other.window_medians)

    def as_list(self) -> list:
        """``[rates, windows, window medians]`` as plain data (checkpoints)."""
        return [list(self.rates), self.windows, list(self.window_medians)]

    @classmethod
    def from_list(cls, saved: Sequence) -> "Measurement":
        """The inverse of ``as_list``."""
        medians = tuple(float(r) for r in saved[2]) if len(saved) > 2 else ()
        return cls(tuple(float(r) for r in saved[0]), int(saved[1]), medians)


def sub_window_rates(samples: Sequence[int], seconds: Sequence[float], parts: int) -> tuple[float, ...]:
    """samples/s of ``parts`` (at most one per round) consecutive runs of a window's rounds, as
    equal in rounds as can be, from each round's ``samples`` and training ``seconds``."""
    runs = np.array_split(np.arange(len(samples)), min(parts, len(samples)))  # the first runs longer
    return tuple(sum(samples[i] for i in run) / sum(seconds[i] for i in run) for run in runs)


def exceeds(a: Measurement, b: Measurement, threshold: float) -> bool:
    """median(a) > (1 + ``threshold``)·median(b) and ``a.low > b.high``."""
    return a.samples_per_s > (1 + threshold) * b.samples_per_s and a.low > b.high


def verdict(new: Measurement, ref: Measurement, threshold: float) -> str:
    """``"gain"`` (``exceeds``), ``"open"`` (``new.high`` still reaches the threshold) or
    ``"none"``."""
    if exceeds(new, ref, threshold):
        return "gain"
    return "open" if new.high > (1 + threshold) * ref.samples_per_s else "none"


class Setting(NamedTuple):
    """The configuration a window measured: replicas per device, learner mode, batch size."""

    m: int
    mode: str
    batch_size: int


class Decision(NamedTuple):
    """``steps`` (action, next m, next mode) decided on a window, the last one the configuration
    to run, and the (pooled) measurement they rest on."""

    steps: list[tuple[str, int, str]]
    measured: Measurement


class TuningRule:
    """The auto-tuner's state machine: grow m while each step gains, try the other learner mode,
    hold, re-probe on a drift (docs/runtime.md, "The auto-tuner").

    Args:
        threshold: relative gain that counts (0.10 = 10 %).
        repeats: more windows of a configuration whose outcome is open, pooled.
        windows: windows of each configuration, pooled, before a step is decided (≥ 1).
        reprobe: re-probe after ``DRIFT_WINDOWS`` held windows in a row off on one side.
        try_other_mode: measure the other learner mode once, after growing.

    Attributes:
        phase: ``"grow"``, ``"confirm"``, ``"mode"`` or ``"hold"``.
        best: (Measurement, m, mode) of the best configuration so far, or None.
        held: the pooled held windows that holding compares with, or None."""

    def __init__(self, *, threshold: float, repeats: int, reprobe: bool,
                 try_other_mode: bool, windows: int = 1) -> None:
        self.threshold, self.repeats, self.windows = threshold, repeats, windows
        self.reprobe, self.try_other_mode = reprobe, try_other_mode
        self.phase = "grow"
        self.best: tuple[Measurement, int, str] | None = None
        self.held: Measurement | None = None
        self.mode_tried = False
        self._last_side = 0  # the previous hold window: +1 above, −1 below the held one, 0 neither
        self._off = 0  # hold windows in a row off the reference on that side
        self._open: tuple[Measurement, Setting] | None = None  # a window whose outcome was open
        self._held_windows: list[Measurement] = []  # the windows pooled into ``held``
        # a configuration that read faster than ``best``, and the phase it came from: ``best`` is
        # measured again before it counts (phase "confirm")
        self._candidate: tuple[Measurement, Setting, str] | None = None

    def forget_open(self) -> None:
        """Drop a window left open (a new fit: its workers start again)."""
        self._open = None

    def decide(self, window: Measurement, at: Setting, *, bound: int, fused_ok: bool) -> Decision:
        """The steps after ``window``, measured at ``at``, with at most ``bound`` replicas per
        device and ``fused_ok`` whether fused learners can run the model."""
        if self.phase == "hold":
            return self._hold(window, at)
        measured = window
        if self._open is not None and self._open[1] == at:  # the same configuration once more
            measured = self._open[0].pooled(window)
        self._open = None
        if measured.windows < self.windows:  # too few windows of this configuration yet
            self._open = (measured, at)
            return Decision([], measured)
        if self.phase == "confirm":
            return Decision(self._confirm(measured, bound, fused_ok), measured)
        if self.phase == "mode":
            return Decision(self._mode(measured, at, bound, fused_ok), measured)
        return Decision(self._grow_or_settle(measured, at, bound, fused_ok), measured)

    def _again(self, measured: Measurement, at: Setting) -> list[tuple[str, int, str]] | None:
        """Measure ``at`` once more, if repeats are left: the step ``repeat``."""
        if measured.windows >= self.windows + self.repeats:
            return None
        self._open = (measured, at)
        return [("repeat", at.m, at.mode)]

    def _grow_or_settle(self, measured: Measurement, at: Setting, bound: int,
                        fused_ok: bool) -> list[tuple[str, int, str]]:
        if self.best is None:  # the first configuration measured: the reference
            self.best = (measured, at.m, at.mode)
            return self._grow(at.m, at.mode, bound, fused_ok)
        v = verdict(measured, self.best[0], self.threshold)
        if v == "gain":
            return self._to_confirm(measured, at, "grow")
        if v == "open" and (again := self._again(measured, at)) is not None:
            return again
        return [("remove", self.best[1], at.mode)] + self._settle(self.best[1], at.mode, fused_ok)

    def _mode(self, measured: Measurement, at: Setting, bound: int,
              fused_ok: bool) -> list[tuple[str, int, str]]:
        self.mode_tried = True
        v = verdict(measured, self.best[0], 0.0)  # faster beyond both spreads
        if v == "gain":
            return self._to_confirm(measured, at, "mode")
        if v == "open" and (again := self._again(measured, at)) is not None:
            return again
        self.phase, self.held = "hold", None
        return [("revert_mode", at.m, self.best[2])]

    def _to_confirm(self, measured: Measurement, at: Setting,
                    came_from: str) -> list[tuple[str, int, str]]:
        """``at`` read faster than ``best``: measure ``best`` again before it counts (A B A)."""
        self._candidate, self.phase = (measured, at, came_from), "confirm"
        return [("confirm", self.best[1], self.best[2])]

    def _confirm(self, again: Measurement, bound: int,
                 fused_ok: bool) -> list[tuple[str, int, str]]:
        """The candidate counts if it also beats ``best`` measured ``again``."""
        (cand, at, came_from), self._candidate = self._candidate, None
        theta = self.threshold if came_from == "grow" else 0.0
        m, mode = self.best[1], self.best[2]
        if exceeds(cand, again, theta):
            self.best, self.phase = (cand, at.m, at.mode), "grow"
            step = "add" if came_from == "grow" else "keep_mode"
            return [(f"confirmed_{step}", at.m, at.mode)] + self._grow(at.m, at.mode, bound,
                                                                       fused_ok)
        self.best = (again, m, mode)
        if came_from == "mode":
            self.phase, self.held = "hold", None
            return [("revert_mode", m, mode)]
        return [("unconfirmed", m, mode)] + self._settle(m, mode, fused_ok)

    def _hold(self, window: Measurement, at: Setting) -> Decision:
        if self.held is None or len(self._held_windows) < HELD_FIRST:
            # the first windows held: the reference, measured afresh
            self._held_windows = [window] if self.held is None else self._held_windows + [window]
            self.held = functools.reduce(Measurement.pooled, self._held_windows)
            self._last_side, self._off = 0, 0
            return Decision([], window)
        side = (exceeds(window, self.held, self.threshold)
                - exceeds(self.held, window, self.threshold))
        self._off = self._off + 1 if side != 0 and side == self._last_side else int(side != 0)
        self._last_side = side
        drifted = self.reprobe and self._off >= DRIFT_WINDOWS
        if side == 0:  # a window like the held ones joins the reference (the last HELD_WINDOWS)
            self._held_windows = (self._held_windows + [window])[-HELD_WINDOWS:]
            self.held = functools.reduce(Measurement.pooled, self._held_windows)
        if not drifted:
            return Decision([], window)
        # re-probe from a fresh window of this configuration (the two that drifted were picked
        # for being off), then grow from it
        self.phase, self.best, self.held = "grow", None, None
        return Decision([("drift", at.m, at.mode)], window)

    def _grow(self, m: int, mode: str, bound: int, fused_ok: bool) -> list[tuple[str, int, str]]:
        if m + 1 <= bound:
            return [("add", m + 1, mode)]
        return [("bound", m, mode)] + self._settle(m, mode, fused_ok)

    def _settle(self, m: int, mode: str, fused_ok: bool) -> list[tuple[str, int, str]]:
        other = "fused" if mode == "per_replica" else "per_replica"
        if self.try_other_mode and not self.mode_tried:
            if other == "fused" and not fused_ok:
                self.mode_tried = True  # vmap cannot run the model: per_replica it stays
                self.phase, self.held = "hold", None
                return [("skip_mode", m, mode)]
            self.phase = "mode"
            return [("try_mode", m, other)]
        self.phase, self.held = "hold", None
        return [("hold", m, mode)]

    def state_dict(self) -> dict:
        """The rule's state as plain data."""
        best = None if self.best is None else [self.best[0].as_list(), self.best[1], self.best[2]]
        cand = None if self._candidate is None else [
            self._candidate[0].as_list(), list(self._candidate[1]), self._candidate[2]]
        return {"phase": self.phase, "best": best, "mode_tried": self.mode_tried,
                "held": None if self.held is None else self.held.as_list(), "candidate": cand}

    def load_state_dict(self, state: dict) -> None:
        """Restore ``state_dict()``."""
        best, held = state["best"], state["held"]
        self.phase, self.mode_tried = state["phase"], state["mode_tried"]
        self.best = None if best is None else (Measurement.from_list(best[0]), best[1], best[2])
        self.held = None if held is None else Measurement.from_list(held)
        cand = state.get("candidate")
        self._candidate = None if cand is None else (
            Measurement.from_list(cand[0]), Setting(*cand[1]), cand[2])
