"""The replica auto-tuner: measured throughput → replicas per device and learner mode
(CROSSBOW §4.4; docs/runtime.md, the auto-tuner; docs/design-overview.md §5)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Callable

from ..errors import check_flag, is_count
from ..training.history import AutotuneRecord
from ..training.hooks import FitContext
from .autotune_rule import Decision, Measurement, Setting, TuningRule, sub_window_rates
from ..config import Adjustment
from .policy_base import Policy

__all__ = ["AutoTune", "AutoTuner"]


@dataclass(frozen=True, kw_only=True)
class AutoTune:
    """Settings of the replica auto-tuner (docs/runtime.md, the auto-tuner).

    Attributes:
        threshold: relative throughput change that counts (0.10 = 10 %), > 0.
        warmup_rounds: rounds ignored after every change, ≥ 1.
        warmup_s: and at least this many training seconds, ≥ 0.
        window_s: a measurement window is the fewest whole rounds lasting at least this many
            training seconds, > 0.
        min_window_rounds: and at least this many rounds, ≥ 1.
        sub_windows: sub-windows per window, whose samples/s give its median and its interval, ≥ 1.
        max_replicas: most replicas per device, whatever the memory allows, ≥ 1.
        try_other_mode: also measure the other learner mode (per-replica / fused).
        reprobe: re-probe m when throughput drifts while holding.
        windows: windows of each configuration measured, pooled, before a step is decided, ≥ 1.
        repeats: windows measured again while a step's outcome is open, ≥ 0.

    Raises:
        ValueError: a value outside its range.
        TypeError: ``try_other_mode`` or ``reprobe`` not True or False."""

    threshold: float = 0.10
    warmup_rounds: int = 10
    warmup_s: float = 0.5
    window_s: float = 1.0
    min_window_rounds: int = 10
    sub_windows: int = 16
    max_replicas: int = 16
    try_other_mode: bool = True
    reprobe: bool = True
    repeats: int = 2
    windows: int = 2

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
        for name in ("try_other_mode", "reprobe"):
            check_flag(name, getattr(self, name), "AutoTune")
        if not is_count(self.sub_windows):
            raise ValueError(f"AutoTune(sub_windows={self.sub_windows!r}): must be a whole number "
                             "≥ 1, e.g. 16")
        if not is_count(self.windows):
            raise ValueError(f"AutoTune(windows={self.windows!r}): must be a whole number ≥ 1, "
                             "e.g. 2")
        if not is_count(self.repeats, minimum=0):
            raise ValueError(f"AutoTune(repeats={self.repeats!r}): must be a whole number ≥ 0, "
                             "e.g. 2")


class AutoTuner(Policy):
    """The auto-tuner as a policy (``Plan.autotuner`` with ``compile(replicas="auto")``, or
    ``AutoReplicas``): it measures windows and applies its ``TuningRule``'s decisions through
    ``Plan.adjust``; its rule's state is checkpointed.

    Args:
        config: the AutoTune settings.
        clock: ``clock(ctx) -> seconds``; default the fit's training seconds.

    Attributes:
        rule: the TuningRule (``phase``: ``"grow"``, ``"mode"`` or ``"hold"``).
        decisions: every AutotuneRecord over the plan's life."""

    def __init__(self, config: AutoTune = AutoTune(), *,
                 clock: Callable[[FitContext], float] | None = None) -> None:
        self.config = config
        self.clock = clock or (lambda ctx: ctx.train_seconds)
        self.rule = TuningRule(threshold=config.threshold, repeats=config.repeats,
                               reprobe=config.reprobe, try_other_mode=config.try_other_mode,
                               windows=config.windows)
        self.decisions: list[AutotuneRecord] = []
        self._restart_window(warm=False)

    def state_dict(self) -> dict:
        return self.rule.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.rule.load_state_dict(state)

    @property
    def phase(self) -> str:
        """The rule's phase: ``"grow"``, ``"mode"`` or ``"hold"``."""
        return self.rule.phase

    # -- measurement ----------------------------------------------------------------------------

    def _restart_window(self, *, warm: bool, now: float | None = None) -> None:
        """A new window: at once if ``warm``, else after a warm-up (a change, a new fit)."""
        self._warming = not warm
        self._rounds = 0
        self._t0 = self._last = now  # the window's (warm) or the warm-up's start; None: next round
        self._round_samples: list[int] = []
        self._round_seconds: list[float] = []

    def before_fit(self, ctx: FitContext) -> None:
        self._restart_window(warm=False)  # workers start again: warm up again
        self.rule.forget_open()  # a window of an earlier fit decides nothing

    def after_round(self, ctx: FitContext) -> None:
        c = self.config
        now = self.clock(ctx)
        self._rounds += 1
        if self._t0 is None:
            self._t0 = self._last = now
        if self._warming:
            if self._rounds < c.warmup_rounds or now - self._t0 < c.warmup_s:
                return
            self._restart_window(warm=True, now=now)
            return
        self._round_samples.append(ctx.round_samples)
        self._round_seconds.append(now - self._last)
        self._last = now
        if now - self._t0 < c.window_s or self._rounds < c.min_window_rounds:
            return
        window = Measurement(sub_window_rates(self._round_samples, self._round_seconds,
                                              c.sub_windows))
        changed = self._decide(ctx, window)
        self._restart_window(warm=not changed, now=now)

    # -- the rule -------------------------------------------------------------------------------

    def bound(self, plan) -> int:
        """Most replicas per device: ``max_replicas`` and the memory bound of the plan."""
        mem_bound = plan.max_replicas_per_device
        return min(self.config.max_replicas, mem_bound if mem_bound is not None else 10**9)

    def _decide(self, ctx: FitContext, window: Measurement) -> bool:
        """Act on one window's measurement; returns whether the configuration changed."""
        plan = ctx.plan
        at = Setting(plan.settings.replicas_per_device, plan.settings.learner_mode, plan.settings.batch_size)
        decision = self.rule.decide(window, at, bound=self.bound(plan),
                                    fused_ok=plan.fused_failure is None)
        if not decision.steps:
            return False
        records = []
        for action, m2, mode2 in decision.steps:
            if action == "skip_mode":
                warnings.warn(f"the auto-tuner keeps learner_mode='per_replica': fused learners "
                              f"cannot run this model ({plan.fused_failure})", stacklevel=2)
            records.append(self._record(ctx, decision, at, action, m2, mode2))
        m2, mode2 = decision.steps[-1][1], decision.steps[-1][2]
        if (m2, mode2) == (at.m, at.mode):
            return False
        if m2 != at.m:
            plan.adjust(Adjustment(replicas_per_device=m2))
        if mode2 != at.mode:
            plan.adjust(Adjustment(learner_mode=mode2))
        self.record(ctx, {"replicas_per_device": m2, "learner_mode": mode2},
                    ", ".join(f"{r.action} at {r.samples_per_s:,.0f} samples/s" for r in records))
        return True

    def _record(self, ctx: FitContext, decision: Decision, at: Setting, action: str, m2: int,
                mode2: str) -> AutotuneRecord:
        measured = decision.measured
        rec = AutotuneRecord(round=ctx.plan.progress.rounds_done, replicas_per_device=at.m,
                             learner_mode=at.mode, samples_per_s=measured.samples_per_s,
                             samples_per_s_low=measured.low, samples_per_s_high=measured.high,
                             windows=measured.windows, action=action,
                             next_replicas_per_device=m2, next_learner_mode=mode2)
        self.decisions.append(rec)
        ctx.history.autotune.append(rec)
        return rec
