"""The replica auto-tuner: measured throughput → replicas per device and learner mode
(docs/design-overview.md §5).

Reference rule (CROSSBOW §4.4): start at m = 1 per device; after a warm-up (in rounds and in
seconds: restarted worker processes need both), measure samples/s
over a window of whole rounds; if it rose by more than a threshold (default 10 %) over the best so
far, add a replica per device, otherwise (after a second window confirms it: ``AutoTune.confirm``)
remove the last one added and hold. Then try the other
learner mode at that m and keep the faster (growing further in it if it wins; fused only where
torch.func.vmap runs the model, ``Plan.fused_failure``, else a warning and per-replica). While holding,
re-probe when the throughput drifts by more than the threshold. Never beyond the memory bound
(the task graph's ``memory_per_learner_bytes`` against ``compile(memory_budget=...)``) or
``AutoTune.max_replicas``. Replicas change between rounds without losing state
(``Plan.set_replicas``: new replicas cloned from z with zeroed momentum, α re-derived for the new
k, the compiler passes re-run). Every decision goes to ``History.autotune``.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Callable

from ..errors import check_flag
from ..training.history import AutotuneRecord
from ..training.hooks import FitContext, Hook

__all__ = ["AutoTune", "AutoTuner"]


@dataclass(frozen=True, kw_only=True)
class AutoTune:
    """Settings of the replica auto-tuner.

    Attributes:
        threshold: relative throughput change that counts (0.10 = 10 %), > 0.
        warmup_rounds: rounds ignored after every change (worker start-up, caches), ≥ 1.
        warmup_s: and at least this many training seconds, ≥ 0. Forked worker processes take
            about half a second to reach their steady speed (first touches of the inherited
            memory, cold caches): LeNet-5 at b = 8 and 2 × 2 learners ran 7,500–8,000
            samples/s in the first 0.25 s after a change and 10,300 from 0.5 s on, so a window
            that began after 20 rounds (70 ms) read 2 × 2 only 0–7% above 2 × 1 instead of 12–15%.
        window_s: a measurement window is the fewest whole rounds lasting at least this many
            training seconds, > 0.
        min_window_rounds: and at least this many rounds, ≥ 1.
        max_replicas: most replicas per device, whatever the memory allows, ≥ 1.
        try_other_mode: also measure the other learner mode (per-replica / fused).
        reprobe: re-probe m when throughput drifts by more than ``threshold``, in the same
            direction, in two consecutive windows while holding.
        confirm: a step that gained ``threshold`` or less is measured over one more window, and
            the better of its two windows decides, before it is removed (one window on a busy
            host can read far below the configuration's speed).

    Raises:
        ValueError: a value outside its range.
        TypeError: ``try_other_mode``, ``reprobe`` or ``confirm`` not True or False.
    """

    threshold: float = 0.10
    warmup_rounds: int = 10
    warmup_s: float = 0.5
    window_s: float = 1.0
    min_window_rounds: int = 10
    max_replicas: int = 16
    try_other_mode: bool = True
    reprobe: bool = True
    confirm: bool = True

    def __post_init__(self) -> None:
        if not self.threshold > 0:
            raise ValueError(f"AutoTune(threshold={self.threshold}): must be > 0, e.g. 0.10")
        if self.warmup_rounds < 1 or self.min_window_rounds < 1:
            raise ValueError("AutoTune: warmup_rounds and min_window_rounds must be ≥ 1")
        if not self.warmup_s >= 0:
            raise ValueError(f"AutoTune(warmup_s={self.warmup_s}): must be ≥ 0 seconds")
        if not self.window_s > 0:
            raise ValueError(f"AutoTune(window_s={self.window_s}): must be > 0 seconds")
        if self.max_replicas < 1:
            raise ValueError(f"AutoTune(max_replicas={self.max_replicas}): must be ≥ 1")
        for name in ("try_other_mode", "reprobe", "confirm"):
            check_flag(name, getattr(self, name), "AutoTune")


class AutoTuner(Hook):
    """The auto-tuner as a Hook (``compile(replicas="auto")`` attaches one to the plan).

    Args:
        config: the AutoTune settings.
        clock: ``clock(ctx) -> seconds``; default the fit's training seconds (evaluation
            excluded). Tests pass a deterministic clock.

    Attributes:
        phase: ``"grow"``, ``"mode"`` (measuring the other learner mode) or ``"hold"``.
        decisions: every AutotuneRecord over the plan's life.
    """

    mutates_replicas = False  # changes the plan only through Plan.adjust (set_replicas, set_learner_mode)

    def __init__(self, config: AutoTune = AutoTune(), *,
                 clock: Callable[[FitContext], float] | None = None) -> None:
        self.config = config
        self.clock = clock or (lambda ctx: ctx.train_seconds)
        self.phase = "grow"
        self.best: tuple[float, int, str] | None = None  # (samples/s, m, mode)
        self.held: float | None = None
        self.mode_tried = False
        self._last_side = 0  # the previous hold window: +1 above, −1 below the band, 0 inside
        # the first window of a step being confirmed (confirm): (samples/s, m, mode, b)
        self._pending: tuple[float, int, str, int] | None = None
        self.decisions: list[AutotuneRecord] = []
        self._restart_window(warm=False)

    # -- measurement ----------------------------------------------------------------------------

    def _restart_window(self, *, warm: bool, now: float | None = None) -> None:
        """A new window: at once if ``warm``, else after a warm-up (a change, a new fit)."""
        self._warming = not warm
        self._rounds, self._samples = 0, 0
        self._t0 = now  # the window's (warm) or the warm-up's start; None: at the next round

    def before_fit(self, ctx: FitContext) -> None:
        self._restart_window(warm=False)  # workers start again: warm up again
        self._pending = None  # a window of an earlier fit confirms nothing

    def after_round(self, ctx: FitContext) -> None:
        c = self.config
        now = self.clock(ctx)
        self._rounds += 1
        if self._t0 is None:
            self._t0 = now
        if self._warming:
            if self._rounds < c.warmup_rounds or now - self._t0 < c.warmup_s:
                return
            self._restart_window(warm=True, now=now)
            return
        self._samples += ctx.round_samples
        elapsed = now - self._t0
        if elapsed < c.window_s or self._rounds < c.min_window_rounds:
            return
        changed = self._decide(ctx, self._samples / elapsed)
        self._restart_window(warm=not changed, now=now)

    # -- the rule -------------------------------------------------------------------------------

    def bound(self, plan) -> int:
        """Most replicas per device: ``max_replicas`` and the memory bound of the plan."""
        mem_bound = plan.max_replicas_per_device
        return min(self.config.max_replicas, mem_bound if mem_bound is not None else 10**9)

    def _decide(self, ctx: FitContext, rate: float) -> bool:
        """Act on one window's throughput; returns whether the configuration changed."""
        plan, theta = ctx.plan, self.config.threshold
        m, mode = plan.replicas_per_device, plan.learner_mode
        other = "fused" if mode == "per_replica" else "per_replica"
        steps: list[tuple[str, int, str]] = []
        if self.phase == "hold":
            side = (rate > self.held * (1 + theta)) - (rate < self.held * (1 - theta))
            drifted = self.config.reprobe and side != 0 and side == self._last_side
            self._last_side = side
            if not drifted:
                return False
            self.best, self.phase, self._last_side = None, "grow", 0
            steps.append(("drift", m, mode))
        if self.phase == "mode":
            self.mode_tried = True
            if rate > self.best[0]:
                self.best, self.phase = (rate, m, mode), "grow"
                steps.append(("keep_mode", m, mode))
                steps += self._grow(plan, m, mode, other)
            else:
                self.phase, self.held = "hold", self.best[0]
                steps.append(("revert_mode", m, self.best[2]))
        elif self.phase == "grow":
            # the confirming window (of the same configuration: another hook may have changed
            # it meanwhile): the better of the two windows counts
            now = (m, mode, plan.batch_size)
            second = self._pending is not None and self._pending[1:] == now
            if second:
                rate = max(rate, self._pending[0])
            self._pending = None
            if self.best is None or rate > self.best[0] * (1 + theta):
                self.best = (rate, m, mode)
                steps += self._grow(plan, m, mode, other)
            elif self.config.confirm and not second:
                self._pending = (rate, *now)  # measure this configuration once more, then decide
                return False
            else:
                steps.append(("remove", self.best[1], mode))
                steps += self._settle(plan, self.best[1], mode, other)
        for action, m2, mode2 in steps:
            self._record(ctx, rate, action, m, mode, m2, mode2)
        m2, mode2 = steps[-1][1], steps[-1][2]
        if m2 != m:
            plan.set_replicas(m2)
        if mode2 != mode:
            plan.set_learner_mode(mode2)
        return (m2, mode2) != (m, mode)

    def _grow(self, plan, m: int, mode: str, other: str) -> list[tuple[str, int, str]]:
        if m + 1 <= self.bound(plan):
            return [("add", m + 1, mode)]
        return [("bound", m, mode)] + self._settle(plan, m, mode, other)

    def _settle(self, plan, m: int, mode: str, other: str) -> list[tuple[str, int, str]]:
        if self.config.try_other_mode and not self.mode_tried:
            if other == "fused" and plan.fused_failure is not None:
                self.mode_tried = True  # vmap cannot run the model: per_replica it stays
                warnings.warn(f"the auto-tuner keeps learner_mode='per_replica': fused learners "
                              f"cannot run this model ({plan.fused_failure})", stacklevel=2)
                self.phase, self.held = "hold", self.best[0]
                return [("skip_mode", m, mode)]
            self.phase = "mode"
            return [("try_mode", m, other)]
        self.phase, self.held = "hold", self.best[0]
        return [("hold", m, mode)]

    def _record(self, ctx: FitContext, rate: float, action: str, m: int, mode: str, m2: int,
                mode2: str) -> None:
        rec = AutotuneRecord(round=ctx.plan.rounds_done, replicas_per_device=m, learner_mode=mode,
                             samples_per_s=rate, action=action, next_replicas_per_device=m2,
                             next_learner_mode=mode2)
        self.decisions.append(rec)
        ctx.history.autotune.append(rec)
