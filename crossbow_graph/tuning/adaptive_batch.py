"""``AdaptiveBatchSize``: b kept at a fraction of the measured gradient noise scale, η following
the batch (docs/policies.md, "Policy API")."""

from __future__ import annotations

import dataclasses
import math
import statistics
import weakref
from typing import Any, Callable
from dataclasses import dataclass, field

import torch

from ..errors import PlanError, is_count
from ..training.hooks import FitContext
from .policy_base import Policy

__all__ = ["AdaptiveBatchSize", "Pace", "MIN_BATCH_SIZE", "lr_power"]


MIN_BATCH_SIZE = 4  # AdaptiveBatchSize's default lower bound (or the starting b, if smaller)

# optimizers whose step is normalised by the gradient's second moment: η scales by the square root
ADAPTIVE = (torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.NAdam,
            torch.optim.RAdam, torch.optim.RMSprop, torch.optim.Adagrad, torch.optim.Adadelta,
            torch.optim.Adafactor)


def lr_power(optimizer: torch.optim.Optimizer) -> float:
    """The power p of a batch-size factor f applied to η (η ← η·f^p): 1/2 for ``ADAPTIVE``
    optimizers, else 1."""
    return 0.5 if isinstance(optimizer, ADAPTIVE) else 1.0


_SCALE_LR = {None: "none", False: "none", True: "linear", "none": "none", "linear": "linear",
             "gain": "gain"}


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# AdaptiveBatchSize's arguments, in the order they are checked → (valid?, what a value must be)
_ARGUMENTS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "min_batch_size": (lambda v: v is None or is_count(v),
                       "must be an integer ≥ 1, or None for 4 (or the starting b, if smaller)"),
    "max_batch_size": (is_count, "must be an integer ≥ 1 (samples per learner, e.g. 128)"),
    "factor": (lambda v: v > 1, "must be > 1, e.g. 2"),
    "epoch_overhead": (lambda v: _number(v) and 0 < v < math.inf,
                       "must be a number > 0 (the extra epochs over E_min allowed, e.g. 0.125)"),
    "cooldown_epochs": (lambda v: v > 0, "must be > 0 (epochs of samples between changes, e.g. "
                        "0.25; a small value such as 0.01 leaves settle_windows to pace the changes)"),
    "shrink": (lambda v: isinstance(v, bool),
               "must be True or False (on the CLI: shrink=true or shrink=false)"),
    "settle_windows": (lambda v: v is None or is_count(v), "must be an integer ≥ 1, or None for "
                       "⌈1/(1 − ema)⌉ of the MetricsMonitor"),
    "min_speedup": (lambda v: v is None or (_number(v) and 0 <= v < 10), "must be a number in "
                    "[0, 10) (a fraction, e.g. 0.1 for 10 %), or None to keep every growth"),
    "speed_windows": (is_count, "must be an integer ≥ 1"),
    "scale_lr": (lambda v: v is None or isinstance(v, bool) or v in _SCALE_LR,
                 "must be 'gain' (default), 'linear' (or True) or 'none' (or False, None)"),
    "reference_batch": (lambda v: v is None or is_count(v), "must be an integer ≥ 1 (samples per "
                        "round, k·b), or None for k·b at the fit's start"),
    "gain_windows": (is_count, "must be an integer ≥ 1"),
}


@dataclass
class Pace:
    """Where ``AdaptiveBatchSize`` stands in a fit (a checkpoint keeps it).

    Attributes:
        wait: samples still to wait before the next change.
        windows: windows that updated the noise-scale EMAs since the start or the last change.
        speeds: samples/s of the windows at the current setting, after its first (warm-up) one.
        trial: a growth on trial (the b, samples/s and setting before it), or None.
        setting: ``[b, k, m, τ]`` of the last window (speeds compare alike), or None.
        gain_windows_seen: windows of this fit whose estimate entered the EMAs.
        noise: ``(B_noise,)`` of the newest window with an estimate, or None."""

    wait: float = 0.0
    windows: int = 0
    speeds: list[float] = field(default_factory=list)
    trial: dict | None = None
    setting: list[int] | None = None
    gain_windows_seen: int = 0
    noise: tuple | None = None

    @classmethod
    def from_state(cls, state: dict) -> "Pace":
        """The pace a ``state_dict`` holds (the keys a checkpoint's entry has)."""
        noise = state.get("noise")
        return cls(state["wait"], state.get("windows", 0), list(state.get("speeds", [])),
                   state.get("trial"), state.get("setting"), state.get("gain_windows_seen", 0),
                   None if noise is None else tuple(noise))

    def observe(self, setting: list[int], samples_per_s: float) -> None:
        """A new window at ``setting`` and its samples/s: its speed counts at an unchanged
        setting; after a change of b, k, m or τ (by any policy) or in a new fit it is the warm-up
        (the re-plan, the workers' ramp-up) and starts the speeds anew, and a growth on trial
        whose setting another policy changed gets no verdict."""
        if setting != self.setting:
            self.setting, self.speeds = setting, []
            if self.trial is not None and self.trial["setting"] != setting:
                self.trial = None
        else:
            self.speeds.append(samples_per_s)


class AdaptiveBatchSize(Policy):
    """Keep the round's B = k·b in (c·B_noise/``factor``, c·B_noise], c = ``epoch_overhead``,
    within [``min_batch_size``, ``max_batch_size``], with η times the gain
    r = (1 + B_noise/B₀)/(1 + B_noise/B) (docs/policies.md, "Policy API"; McCandlish et
    al. 2018, eqs. 2.7 and 2.11; AdaScale, Johnson et al. 2020).

    Args:
        min_batch_size: smallest b (≥ 1); None: 4, or the b the fit starts with if smaller.
        max_batch_size: largest b (≥ min).
        factor: multiplicative step of b (> 1).
        epoch_overhead: c > 0: E ≤ (1 + c)·E_min.
        cooldown_epochs: epochs of samples to wait after a change (> 0).
        settle_windows: metrics windows that updated the noise-scale EMAs to wait at the start
            and after a change (≥ 1); None: ⌈1/(1 − ema)⌉ of the fit's MetricsMonitor.
        scale_lr: ``"gain"``: η·r; ``"linear"`` (True): η times each change's factor;
            ``"none"`` (False): η kept. Adaptive optimizers take the square root (``lr_power``).
        reference_batch: B₀, samples per round at which the fit's η is right (≥ 1); None: k·b
            at the fit's start.
        gain_windows: windows with a noise-scale estimate before the gain first applies (≥ 1).
        shrink: also divide b by ``factor`` when k·b > c·B_noise.
        min_speedup: keep a growth of b only if samples/s rose by more than this fraction, else
            return to the previous b, the new ``max_batch_size``; None: keep every growth.
        speed_windows: windows at the new b (after one warm-up window) whose median samples/s
            decides (≥ 1).

    Raises:
        ValueError: an argument out of range; at the start of a fit without a metrics monitor
            (``fit(metrics_every=None)``), or with k = 1 learner and no replica auto-tuner."""

    min_learners = 2  # the two-batch noise-scale estimate (or the replica auto-tuner)

    def __init__(self, *, min_batch_size: int | None = None, max_batch_size: int = 128,
                 factor: float = 2.0, epoch_overhead: float = 0.125, cooldown_epochs: float = 0.25,
                 settle_windows: int | None = 3, scale_lr: bool | str = "gain",
                 reference_batch: int | None = None, gain_windows: int = 3,
                 shrink: bool = True, min_speedup: float | None = None,
                 speed_windows: int = 2) -> None:
        arguments = {name: value for name, value in locals().items() if name != "self"}
        for name, (valid, rule) in _ARGUMENTS.items():
            if not valid(arguments[name]):
                raise ValueError(f"AdaptiveBatchSize({name}={arguments[name]!r}): {rule}")
        if max_batch_size < (min_batch_size or 1):
            raise ValueError(f"AdaptiveBatchSize(max_batch_size={max_batch_size}): must be ≥ "
                             f"min_batch_size={min_batch_size}")
        for name, value in arguments.items():
            setattr(self, name, value)
        self.scale_lr = _SCALE_LR[scale_lr]
        self._given = {"min": min_batch_size, "reference": reference_batch}  # None: derived per plan
        self.gain = 1.0  # the gain r in the plan's η now
        self.pace = Pace()
        self._plan = None  # weak reference to the plan of the last fit
        self._seen = None  # the MetricRecord last acted on
        self._resumed = False  # load_state_dict ran: before_fit keeps the loaded state

    def state_dict(self) -> dict:
        return {"min": self.min_batch_size, "max": self.max_batch_size,
                "reference_batch": self.reference_batch, "gain": self.gain,
                **dataclasses.asdict(self.pace)}

    def load_state_dict(self, state: dict) -> None:
        self.min_batch_size, self.max_batch_size = state["min"], state["max"]
        self.reference_batch = state.get("reference_batch", self.reference_batch)
        self.gain = state.get("gain", 1.0)
        self.pace = Pace.from_state(state)
        self._resumed = True  # before_fit keeps this state

    def windows_to_settle(self, ema: float) -> int:
        """Windows to wait at the start and after a change, for an EMA decay ``ema`` in [0, 1)."""
        if self.settle_windows is not None:
            return self.settle_windows
        return max(1, math.ceil(1 / (1 - ema) - 1e-9))

    def before_fit(self, ctx: FitContext) -> None:
        mon = self.metrics(ctx)  # a monitor reused from the last fit still holds its last window
        if mon is None:
            raise ValueError("AdaptiveBatchSize reads the gradient noise scale from the fit's "
                             "metrics monitor, and this fit has none (fit(metrics_every=None), or "
                             "--metrics-every 0 on the CLI): leave metrics_every at its default "
                             "(50) or pass a cg.MetricsMonitor")
        plan = ctx.plan
        if plan.num_learners < 2 and plan.autotuner is None:
            raise ValueError("AdaptiveBatchSize reads the gradient noise scale from the two-batch "
                             "estimate over k ≥ 2 learners, and this plan has k = 1: compile with "
                             "devices=2 or replicas=2 (on the CLI: --devices 2 or --replicas 2)")
        if self._plan is not None and self._plan() is not plan and not self._resumed:
            # another plan: its η holds no gain of ours, and derived bounds are re-derived
            self.gain, self.pace.trial, self.pace.noise = 1.0, None, None
            self.min_batch_size, self.reference_batch = self._given["min"], self._given["reference"]
        self._plan = weakref.ref(plan)
        if self.min_batch_size is None:
            self.min_batch_size = min(MIN_BATCH_SIZE, plan.settings.batch_size, self.max_batch_size)
        if self.reference_batch is None:  # η is taken as right for the batch the fit starts with
            self.reference_batch = plan.num_learners * plan.settings.batch_size
        if not self._resumed:
            # a new fit restarts the settle count, the gain's wait and the speed windows (the
            # workers restart); a growth still on trial from the last fit on this plan is judged
            # in this one
            self.pace = Pace(trial=self.pace.trial, noise=self.pace.noise)
        self._resumed = False
        self._seen = mon.last
        self._into_bounds(ctx)

    def _into_bounds(self, ctx: FitContext) -> None:
        """Move a starting b outside the bounds to the nearer bound."""
        b = ctx.plan.settings.batch_size
        inside = min(max(b, self.min_batch_size or 1), self.max_batch_size)
        if inside == b:
            return
        self._move(ctx, refused_max=None, batch_size=inside,
                   reason=f"start b = {b} outside the bounds {self.min_batch_size}…"
                          f"{self.max_batch_size}")  # refused: the bound does not fit, stay

    def _judge_growth(self, ctx: FitContext) -> bool:
        """Judge a growth on trial once ``speed_windows`` windows ran at the new b; True: b
        was returned."""
        trial = self.pace.trial
        if trial is None or len(self.pace.speeds) < self.speed_windows:
            return False
        self.pace.trial = None
        after = statistics.median(self.pace.speeds)
        gain = after / trial["speed"] - 1
        if gain > self.min_speedup:
            return False
        b, b0 = ctx.plan.settings.batch_size, trial["batch_size"]
        lr, r = self._lr_for(ctx, b0)  # relative to η now: keeps drops made since the growth
        # b0 ran before: only a changed memory budget refuses it (stay, no growth)
        if not self._move(ctx, refused_max=b, batch_size=b0, lr=lr,
                          reason=f"b = {b} ran at {after:,.0f} samples/s, {gain:+.1%} against "
                          f"{trial['speed']:,.0f} at b = {b0} (needs > {self.min_speedup:.0%}): "
                          f"back to b = {b0}, the new max_batch_size"):
            return False
        self.max_batch_size, self.gain = b0, r
        return True

    def _move(self, ctx: FitContext, *, refused_max: int | None, reason: str, **changes) -> bool:
        """Apply ``changes`` (b, η) and restart the wait and the settle count; False, with
        ``max_batch_size`` ← ``refused_max`` (None: kept), when the memory budget refuses b."""
        try:
            self.adjust(ctx, reason=reason, **changes)
        except PlanError:
            self.max_batch_size = refused_max or self.max_batch_size
            return False
        self.pace.wait, self.pace.windows = self.cooldown_epochs * ctx.num_samples, 0
        return True

    def gain_at(self, batch: int, noise_scale: float | None) -> float:
        """The gain r = (1 + B_noise/B₀)/(1 + B_noise/B) of η at B = ``batch`` samples per
        round, B₀ = ``reference_batch`` (``noise_scale`` None: B_noise → ∞, r = B/B₀)."""
        ref = self.reference_batch
        if noise_scale is None:
            return batch / ref
        ns = max(noise_scale, 0.0)  # a negative tr Σ EMA: no measured noise, r = 1
        return (1 + ns / ref) / (1 + ns / batch)

    def _lr_for(self, ctx: FitContext, b: int) -> tuple[float | None, float]:
        """η for moving to batch size ``b`` now (None: unchanged) and the gain it carries."""
        plan = ctx.plan
        lr, power = plan.settings.lr, lr_power(plan.settings.optimizer.optimizer)
        if self.scale_lr == "linear":
            return lr * (b / plan.settings.batch_size) ** power, self.gain
        if self.scale_lr != "gain" or self.pace.gain_windows_seen < self.gain_windows or self.pace.noise is None:
            return None, self.gain
        gain = self.gain_at(plan.num_learners * b, self.pace.noise[0])
        return lr * (gain / self.gain) ** power, gain

    def target(self, b: int, noise_scale: float, k: int = 1) -> int:
        """The next b for the current b, B_noise (samples) and k learners: one ``factor`` step
        toward k·b ∈ (c·B_noise/factor, c·B_noise], c = ``epoch_overhead``, in bounds."""
        lo, hi = self.min_batch_size or 1, self.max_batch_size
        room = self.epoch_overhead * noise_scale
        if self.factor * k * b <= room and b < hi:
            return min(hi, max(lo, int(round(b * self.factor))))
        if self.shrink and k * b > room and b > lo:
            return max(lo, min(hi, int(round(b / self.factor))))
        return b

    def after_round(self, ctx: FitContext) -> None:
        self.pace.wait -= ctx.round_samples
        mon = self.metrics(ctx)  # never None: before_fit refused a fit without one
        if mon.last is None or mon.last is self._seen:
            return
        self._seen = mon.last
        if mon.last.grad_sq_ema is not None:
            self.pace.gain_windows_seen += 1
            self.pace.noise = (mon.last.noise_scale,)
        self._resize(ctx, mon)
        if self.scale_lr == "gain" and mon.last.grad_sq_ema is not None:
            lr, gain = self._lr_for(ctx, ctx.plan.settings.batch_size)
            if lr is not None and gain != self.gain:
                ns, batch = mon.last.noise_scale, ctx.plan.num_learners * ctx.plan.settings.batch_size
                self.adjust(ctx, lr=lr, reason=f"gain {gain:.3f}: B_noise "
                            f"{'∞' if ns is None else f'{ns:,.0f}'} samples, k·b = {batch}, "
                            f"reference {self.reference_batch}")
                self.gain = gain

    def _resize(self, ctx: FitContext, mon) -> None:
        """The batch-size rule on the new window ``mon.last`` (and the growth on trial)."""
        rec = mon.last  # the window's own settings (a policy before this one may have changed the plan)
        setting = [rec.batch_size, rec.num_learners, rec.replicas_per_device, rec.sync_every]
        self.pace.observe(setting, rec.samples_per_s)
        if self._judge_growth(ctx):
            return
        if mon.last.grad_sq_ema is None:  # no estimate entered the EMAs (k = 1, non-finite, warm-up)
            return
        self.pace.windows += 1
        ns = mon.last.noise_scale  # None while EMA(|G|²) ≤ 0
        if (ns is None or self.pace.wait > 0 or self.pace.trial is not None
                or self.pace.windows < self.windows_to_settle(mon.ema)):
            return
        plan = ctx.plan
        b = plan.settings.batch_size
        b2 = self.target(b, ns, plan.num_learners)
        if b2 == b or (b2 > b and self.min_speedup is not None
                       and len(self.pace.speeds) < self.speed_windows):  # no baseline yet: wait
            return
        lr, gain = self._lr_for(ctx, b2)
        if not self._move(ctx, refused_max=b, batch_size=b2, lr=lr,  # refused: the memory bound
                          reason=f"noise scale {ns:,.1f} samples vs k·b={plan.num_learners}×{b} "
                          f"after {self.pace.windows} windows (bounds {self.min_batch_size}…"
                          f"{self.max_batch_size})"):
            return
        self.gain = gain
        if b2 > b and self.min_speedup is not None:
            self.pace.trial = {"batch_size": b, "speed": statistics.median(self.pace.speeds),
                               "setting": [b2, plan.num_learners, plan.settings.replicas_per_device,
                                           plan.settings.sync.sync_every]}
