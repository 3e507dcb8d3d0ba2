"""``AdaptiveBatchSize``: b kept at a fraction of the measured gradient noise scale, η following
the batch (docs/policies.md, "Policy API")."""

from __future__ import annotations

import math
import statistics
import weakref

import torch

from ..errors import PlanError, is_count
from ..training.hooks import FitContext
from .policy_base import Policy

__all__ = ["AdaptiveBatchSize", "MIN_BATCH_SIZE", "lr_power"]


MIN_BATCH_SIZE = 4  # AdaptiveBatchSize's default lower bound (or the starting b, if smaller)

# optimizers whose step is normalised by the gradient's second moment: η scales by the square root
ADAPTIVE = (torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.NAdam,
            torch.optim.RAdam, torch.optim.RMSprop, torch.optim.Adagrad, torch.optim.Adadelta,
            torch.optim.Adafactor)


def lr_power(optimizer: torch.optim.Optimizer) -> float:
    """The power p of a batch-size factor f applied to η (η ← η·f^p): 1/2 for ``ADAPTIVE``
    optimizers, else 1."""
    return 0.5 if isinstance(optimizer, ADAPTIVE) else 1.0


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
            (``fit(metrics_every=None)``), or with k = 1 learner and no replica auto-tuner.
    """

    min_learners = 2  # the two-batch noise-scale estimate (or the replica auto-tuner)

    def __init__(self, *, min_batch_size: int | None = None, max_batch_size: int = 128,
                 factor: float = 2.0, epoch_overhead: float = 0.125, cooldown_epochs: float = 0.25,
                 settle_windows: int | None = 3, scale_lr: bool | str = "gain",
                 reference_batch: int | None = None, gain_windows: int = 3,
                 shrink: bool = True, min_speedup: float | None = None,
                 speed_windows: int = 2) -> None:
        if min_batch_size is not None and not is_count(min_batch_size):
            raise ValueError(f"AdaptiveBatchSize(min_batch_size={min_batch_size!r}): must be an "
                             "integer ≥ 1, or None for 4 (or the starting b, if smaller)")
        if not is_count(max_batch_size):
            raise ValueError(f"AdaptiveBatchSize(max_batch_size={max_batch_size!r}): must be an "
                             "integer ≥ 1 (samples per learner, e.g. 128)")
        if max_batch_size < (min_batch_size or 1):
            raise ValueError(f"AdaptiveBatchSize(max_batch_size={max_batch_size}): must be ≥ "
                             f"min_batch_size={min_batch_size}")
        if not factor > 1:
            raise ValueError(f"AdaptiveBatchSize(factor={factor}): must be > 1, e.g. 2")
        if not (isinstance(epoch_overhead, (int, float)) and not isinstance(epoch_overhead, bool)
                and 0 < epoch_overhead < math.inf):
            raise ValueError(f"AdaptiveBatchSize(epoch_overhead={epoch_overhead!r}): must be a "
                             "number > 0 (the extra epochs over E_min allowed, e.g. 0.125)")
        if not cooldown_epochs > 0:
            raise ValueError(f"AdaptiveBatchSize(cooldown_epochs={cooldown_epochs}): must be > 0 "
                             "(epochs of samples between changes, e.g. 0.25; a small value such as "
                             "0.01 leaves settle_windows to pace the changes)")
        if not isinstance(shrink, bool):
            raise ValueError(f"AdaptiveBatchSize(shrink={shrink!r}): must be True or False "
                             "(on the CLI: shrink=true or shrink=false)")
        if settle_windows is not None and not is_count(settle_windows):
            raise ValueError(f"AdaptiveBatchSize(settle_windows={settle_windows!r}): must be an "
                             "integer ≥ 1, or None for ⌈1/(1 − ema)⌉ of the MetricsMonitor")
        if min_speedup is not None and (isinstance(min_speedup, bool)
                                        or not isinstance(min_speedup, (int, float))
                                        or not 0 <= min_speedup < 10):
            raise ValueError(f"AdaptiveBatchSize(min_speedup={min_speedup!r}): must be a number in "
                             "[0, 10) (a fraction, e.g. 0.1 for 10 %), or None to keep every growth")
        if not is_count(speed_windows):
            raise ValueError(f"AdaptiveBatchSize(speed_windows={speed_windows!r}): must be an "
                             "integer ≥ 1")
        modes = {None: "none", False: "none", True: "linear", "none": "none", "linear": "linear",
                 "gain": "gain"}
        if scale_lr is None or isinstance(scale_lr, bool) or scale_lr in modes:
            scale_lr = modes[scale_lr]
        else:
            raise ValueError(f"AdaptiveBatchSize(scale_lr={scale_lr!r}): must be 'gain' (default), "
                             "'linear' (or True) or 'none' (or False, None)")
        if reference_batch is not None and not is_count(reference_batch):
            raise ValueError(f"AdaptiveBatchSize(reference_batch={reference_batch!r}): must be an "
                             "integer ≥ 1 (samples per round, k·b), or None for k·b at the fit's start")
        if not is_count(gain_windows):
            raise ValueError(f"AdaptiveBatchSize(gain_windows={gain_windows!r}): must be an integer ≥ 1")
        self.min_batch_size, self.max_batch_size = min_batch_size, max_batch_size
        self.factor, self.cooldown_epochs = factor, cooldown_epochs
        self.epoch_overhead = epoch_overhead
        self.settle_windows = settle_windows
        self.scale_lr, self.shrink = scale_lr, shrink
        self.reference_batch, self.gain_windows = reference_batch, gain_windows
        self._given = {"min": min_batch_size, "reference": reference_batch}  # None: derived per plan
        self.gain = 1.0  # the gain r in the plan's η now
        self._gain_windows_seen = 0  # windows of this fit whose estimate entered the EMAs
        self._noise: tuple | None = None  # (B_noise,) of the newest window with an estimate
        self._plan = None  # weak reference to the plan of the last fit
        self.min_speedup, self.speed_windows = min_speedup, speed_windows
        self._seen = None  # the MetricRecord last acted on
        self._wait = 0.0  # samples still to wait
        self._windows = 0  # windows that updated the EMAs since the start or the last change
        self._speeds: list[float] = []  # samples/s of the windows at the current setting, after
        # its first (warm-up) window
        self._trial: dict | None = None  # a growth on trial: the b and samples/s before it
        self._setting: list[int] | None = None  # [b, k, m, τ] of the last window: speeds compare alike
        self._resumed = False  # load_state_dict ran: before_fit keeps the loaded state

    def state_dict(self) -> dict:
        return {"min": self.min_batch_size, "max": self.max_batch_size, "wait": self._wait,
                "windows": self._windows, "speeds": list(self._speeds), "trial": self._trial,
                "setting": self._setting, "reference_batch": self.reference_batch,
                "gain": self.gain, "gain_windows_seen": self._gain_windows_seen,
                "noise": None if self._noise is None else list(self._noise)}

    def load_state_dict(self, state: dict) -> None:
        self.min_batch_size, self.max_batch_size, self._wait = state["min"], state["max"], state["wait"]
        self.reference_batch = state.get("reference_batch", self.reference_batch)
        self.gain = state.get("gain", 1.0)
        self._gain_windows_seen = state.get("gain_windows_seen", 0)
        noise = state.get("noise")
        self._noise = None if noise is None else tuple(noise)
        self._windows = state.get("windows", 0)
        self._speeds = list(state.get("speeds", []))
        self._trial, self._setting = state.get("trial"), state.get("setting")
        self._resumed = True  # before_fit keeps this state

    def _cooldown_samples(self, ctx: FitContext) -> float:
        return self.cooldown_epochs * ctx.num_samples

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
            self.gain, self._trial, self._noise = 1.0, None, None
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
            self._wait, self._windows, self._gain_windows_seen = 0.0, 0, 0
            self._speeds, self._setting = [], None
        self._resumed = False
        self._seen = mon.last
        self._into_bounds(ctx)

    def _into_bounds(self, ctx: FitContext) -> None:
        """Move a starting b outside the bounds to the nearer bound."""
        b = ctx.plan.settings.batch_size
        inside = min(max(b, self.min_batch_size or 1), self.max_batch_size)
        if inside == b:
            return
        try:
            self.adjust(ctx, batch_size=inside,
                        reason=f"start b = {b} outside the bounds {self.min_batch_size}…"
                               f"{self.max_batch_size}")
        except PlanError:  # the bound does not fit the memory budget: stay
            return
        self._changed(ctx)

    def _judge_growth(self, ctx: FitContext) -> bool:
        """Judge a growth on trial once ``speed_windows`` windows ran at the new b; True: b
        was returned."""
        trial = self._trial
        if trial is None or len(self._speeds) < self.speed_windows:
            return False
        self._trial = None
        after = statistics.median(self._speeds)
        gain = after / trial["speed"] - 1
        if gain > self.min_speedup:
            return False
        b, b0 = ctx.plan.settings.batch_size, trial["batch_size"]
        lr, r = self._lr_for(ctx, b0)  # relative to η now: keeps drops made since the growth
        try:
            self.adjust(ctx, batch_size=b0, lr=lr,
                        reason=f"b = {b} ran at {after:,.0f} samples/s, {gain:+.1%} against "
                               f"{trial['speed']:,.0f} at b = {b0} (needs > {self.min_speedup:.0%}): "
                               f"back to b = {b0}, the new max_batch_size")
        except PlanError:  # b0 ran before; only a changed memory budget refuses it: stay, no growth
            self.max_batch_size = b
            return False
        self.max_batch_size, self.gain = b0, r
        self._changed(ctx)
        return True

    def _changed(self, ctx: FitContext) -> None:
        self._wait = self._cooldown_samples(ctx)
        self._windows = 0  # the speeds restart at the next window, whose setting differs

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
        if self.scale_lr != "gain" or self._gain_windows_seen < self.gain_windows or self._noise is None:
            return None, self.gain
        gain = self.gain_at(plan.num_learners * b, self._noise[0])
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
        self._wait -= ctx.round_samples
        mon = self.metrics(ctx)  # never None: before_fit refused a fit without one
        if mon.last is None or mon.last is self._seen:
            return
        self._seen = mon.last
        if mon.last.grad_sq_ema is not None:
            self._gain_windows_seen += 1
            self._noise = (mon.last.noise_scale,)
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
        if setting != self._setting:  # b, k, m or τ changed (by this policy or another), or a
            # new fit: this first window at the setting includes the re-plan and the workers'
            # ramp-up, so it is the warm-up and not measured
            self._setting, self._speeds = setting, []
            if self._trial is not None and self._trial["setting"] != setting:
                self._trial = None  # another policy changed the setting on trial: no verdict
        else:
            self._speeds.append(rec.samples_per_s)
        if self._judge_growth(ctx):
            return
        if mon.last.grad_sq_ema is None:  # no estimate entered the EMAs (k = 1, non-finite, warm-up)
            return
        self._windows += 1
        ns = mon.last.noise_scale  # None while EMA(|G|²) ≤ 0
        if (ns is None or self._wait > 0 or self._trial is not None
                or self._windows < self.windows_to_settle(mon.ema)):
            return
        plan = ctx.plan
        b = plan.settings.batch_size
        b2 = self.target(b, ns, plan.num_learners)
        if b2 == b or (b2 > b and self.min_speedup is not None
                       and len(self._speeds) < self.speed_windows):  # no baseline yet: wait
            return
        lr, gain = self._lr_for(ctx, b2)
        try:
            self.adjust(ctx, batch_size=b2, lr=lr,
                        reason=f"noise scale {ns:,.1f} samples vs k·b={plan.num_learners}×{b} after "
                               f"{self._windows} windows (bounds {self.min_batch_size}…"
                               f"{self.max_batch_size})")
        except PlanError:
            self.max_batch_size = b  # the memory bound: stay
            return
        self.gain = gain
        if b2 > b and self.min_speedup is not None:
            self._trial = {"batch_size": b, "speed": statistics.median(self._speeds),
                           "setting": [b2, plan.num_learners, plan.settings.replicas_per_device,
                                       plan.settings.sync.sync_every]}
        self._changed(ctx)
