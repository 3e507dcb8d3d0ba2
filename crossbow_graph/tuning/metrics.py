"""Monitored metrics of a running fit: samples/s, loss, divergence and the gradient noise scale
B_noise per window (docs/policies.md, "Metrics"; McCandlish et al. 2018, appendix A.1)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import is_count
from ..training.history import MetricRecord
from ..training.hooks import FitContext, Hook

__all__ = ["NoiseScaleEstimate", "two_batch_estimate", "gradient_moments", "divergence",
           "MetricsMonitor"]


@dataclass(frozen=True, kw_only=True)
class NoiseScaleEstimate:
    """One two-batch estimate (McCandlish et al. 2018, eqs. A.1–A.3): ``grad_sq`` |G|² (may be
    < 0), ``trace_sigma`` tr Σ per sample, at ``small_batch`` b and ``large_batch`` B = k·b."""

    grad_sq: float
    trace_sigma: float
    small_batch: int
    large_batch: int

    @property
    def noise_scale(self) -> float:
        """B_simple = tr Σ / |G|² of this single estimate (inf when |G|² ≤ 0)."""
        return self.trace_sigma / self.grad_sq if self.grad_sq > 0 else math.inf


def two_batch_estimate(small_sq_mean: float, large_sq: float, b: int, k: int) -> NoiseScaleEstimate:
    """|G|² ≈ (B|G_B|² − b|G_b|²)/(B − b) and tr Σ ≈ (|G_b|² − |G_B|²)/(1/b − 1/B), B = k·b,
    from ``small_sq_mean`` = mean_j |g_j|² and ``large_sq`` = |mean_j g_j|² over k small
    batches of b samples. Raises ValueError when k < 2."""
    if k < 2:
        raise ValueError(f"the two-batch noise-scale estimator needs k ≥ 2 learners, got k={k}")
    big = k * b
    grad_sq = (big * large_sq - b * small_sq_mean) / (big - b)
    trace = (small_sq_mean - large_sq) / (1.0 / b - 1.0 / big)
    return NoiseScaleEstimate(grad_sq=grad_sq, trace_sigma=trace, small_batch=b, large_batch=big)


@torch.no_grad()
def gradient_moments(states, exclude: set[tuple[int, int]] = frozenset()) -> tuple[float, float, int]:
    """(mean_j |g_j|², |mean_j g_j|², k used) over every device's ``g [m, P]``, in float32,
    leaving out the ``(device index, replica)`` pairs in ``exclude``."""
    return _moments_of(moment_sums(states, _excluded(states, exclude)))


def _excluded(states, exclude: set[tuple[int, int]]) -> list[torch.Tensor]:
    """Per device, ``[m]`` bool: the replicas ``exclude``'s ``(device index, replica)`` pairs name."""
    return [torch.tensor([(d, r) in exclude for r in range(s.m)]) for d, s in enumerate(states)]


@torch.no_grad()
def moment_sums(states, faulty: list[torch.Tensor | None]) -> torch.Tensor:
    """``[Σ_j |g_j|², |Σ_j g_j|², n]`` float64 on the first device (no host read) over every
    device's ``g [m, P]``, leaving out the rows ``faulty[d] [m]`` (bool or None) marks."""
    home = states[0].torch_device
    total, sq, n = None, None, None
    for s, bad in zip(states, faulty):
        ok = torch.ones(s.m, device=s.torch_device) if bad is None else \
            (~bad).to(s.torch_device, torch.float32)  # [m]
        g = s.g.float() * ok[:, None]  # [m, P]: a faulty row's g is zero already; the mask counts
        part = torch.stack([(g * g).sum(), ok.sum()]).to(home, torch.float64)
        rows = g.sum(dim=0).to(home)
        total = rows if total is None else total + rows
        sq, n = (part[0], part[1]) if sq is None else (sq + part[0], n + part[1])
    return torch.stack([sq, total.double().dot(total.double()), n])


def _moments_of(sums: torch.Tensor) -> tuple[float, float, int]:
    """``moment_sums``' tensor as (mean_j |g_j|², |mean_j g_j|², n) on the host (one read)."""
    sq, large, n = sums.tolist()
    n = int(round(n))
    if n == 0:
        return 0.0, 0.0, 0
    return sq / n, large / (n * n), n


@torch.no_grad()
def divergence(states) -> torch.Tensor:
    """‖w_j − z‖ / ‖z‖ (‖w_j − z‖ when z = 0) per replica, ``[k]`` float32 on the CPU."""
    out = []
    for s in states:
        z = s.z
        znorm = float(z.norm()) or 1.0
        out.append((s.w - z).norm(dim=1).float().cpu() / znorm)
    return torch.cat(out)


class MetricsMonitor(Hook):
    """Appends one MetricRecord per window of ``every`` rounds to ``History.metrics``, with
    B_noise = EMA(tr Σ)/EMA(|G|²) (docs/policies.md, "Metrics").

    Args:
        every: N, rounds per window (≥ 1).
        ema: decay of the bias-corrected moving averages of |G|² and tr Σ, in [0, 1).
        measure_rounds: R, the window's last R rounds (at most N) whose gradients are read and
            whose two-batch estimates are averaged (≥ 1).
        warmup_windows: windows ending within the plan's first ``warmup_windows·every`` rounds,
            recorded but kept out of the EMAs (≥ 0).
        window_samples: S, samples per window: ⌈S / (k·b)⌉ rounds within [R, N] (≥ 1); None:
            N rounds.

    Attributes:
        last: the newest MetricRecord (None before the first window).
        noise_scale: the newest B_noise estimate, samples (None before one exists).

    Raises:
        ValueError: ``every`` < 1, ``ema`` outside [0, 1), ``measure_rounds`` < 1,
            ``warmup_windows`` < 0 or ``window_samples`` < 1."""

    mutates_replicas = False

    def __init__(self, every: int = 50, *, ema: float = 0.9, measure_rounds: int = 10,
                 warmup_windows: int = 0, window_samples: int | None = None) -> None:
        if not is_count(every):
            raise ValueError(f"metrics_every={every!r}: must be an integer ≥ 1 (rounds per window)")
        if not 0 <= ema < 1:
            raise ValueError(f"MetricsMonitor(ema={ema}): the EMA decay must be in [0, 1), e.g. 0.9")
        if not is_count(measure_rounds):
            raise ValueError(f"MetricsMonitor(measure_rounds={measure_rounds!r}): must be an integer "
                             "≥ 1 (rounds per window whose gradients are read)")
        if not is_count(warmup_windows, minimum=0):
            raise ValueError(f"MetricsMonitor(warmup_windows={warmup_windows!r}): must be an integer "
                             "≥ 0 (the first windows of training kept out of the moving averages)")
        if window_samples is not None and not is_count(window_samples):
            raise ValueError(f"MetricsMonitor(window_samples={window_samples!r}): must be an integer "
                             "≥ 1 (samples per window), or None for windows of `every` rounds")
        self.every, self.ema, self.warmup_windows = every, ema, warmup_windows
        self.measure_rounds = min(measure_rounds, every)
        self.window_samples = window_samples
        self._plan = None  # the fit's plan (before_fit): its k·b sizes the window
        self.last: MetricRecord | None = None
        self._g2 = self._tr = 0.0     # biased EMAs
        self._weight = 0.0            # 1 − ema^n, the bias correction
        self._reset_window(0.0)
        self._acc: float | None = None
        self._resumed = False  # load_state_dict ran: before_fit keeps the loaded window

    # -- checkpointable state ----------------------------------------------------------------

    def state_dict(self) -> dict:
        self._take_pending()
        return {"g2": self._g2, "tr": self._tr, "weight": self._weight,
                "window": {"rounds": self._rounds, "samples": self._samples, "t0": self._t0,
                           "loss": None if self._loss is None else float(self._loss),
                           "acc": self._acc, "estimates": list(self._est)}}

    def load_state_dict(self, state: dict) -> None:
        """The EMAs and the unfinished window: a resumed fit measures the same rounds."""
        self._g2, self._tr, self._weight = state["g2"], state["tr"], state["weight"]
        w = state.get("window")
        if w is not None:
            self._rounds, self._samples, self._t0, self._acc = (w["rounds"], w["samples"], w["t0"],
                                                                w["acc"])
            self._loss = None if w["loss"] is None else torch.tensor(w["loss"])
            self._est = [tuple(e) for e in w.get("estimates", [])]
            self._resumed = True

    # -- the window ---------------------------------------------------------------------------

    def _reset_window(self, t0: float) -> None:
        self._rounds, self._samples, self._loss, self._t0 = 0, 0, None, t0
        self._est: list[tuple[float, float]] = []  # the window's (|G|², tr Σ) single-round estimates
        self._pending: list[tuple[torch.Tensor, int]] = []  # measured rounds not read yet

    def window_rounds(self, round_samples: int) -> int:
        """Rounds per window at ``round_samples`` = k·b samples per round."""
        if self.window_samples is None or round_samples < 1:
            return self.every
        return min(self.every, max(self.measure_rounds, -(-self.window_samples // round_samples)))

    def _length(self) -> int:
        """Rounds of the current window at the plan's k·b."""
        plan = self._plan
        return self.every if plan is None else self.window_rounds(plan.num_learners * plan.settings.batch_size)

    def _measured(self, round_in_window: int) -> bool:
        """Whether round ``round_in_window`` (1 … length) is among the last ``measure_rounds``."""
        return round_in_window > self._length() - self.measure_rounds

    def wants_gradients(self, rounds_done: int) -> bool:
        """Whether the round that makes the plan's round count ``rounds_done`` is measured."""
        return self._measured(self._rounds + 1)

    def _measure(self, ctx: FitContext) -> None:
        """Append this round's two-batch estimate (if k ≥ 2 and it is finite) to the window's."""
        plan = ctx.plan
        k, b = plan.num_learners, plan.settings.batch_size
        if k < 2:
            return
        rounds = plan.rounds
        rounds.join()  # the default stream reads g after the round's syncs; the host does not wait
        states = plan.states
        if any(m is not None for m in rounds.fault_masks):  # the streams' path: on the device
            faulty = list(rounds.fault_masks)
        else:
            this_round = plan.progress.rounds_done - 1
            rank = plan.comm.rank if plan.comm is not None else 0  # the events hold every rank's
            faulty = _excluded(states, {(d, e.replica) for d, s in enumerate(states)
                                        for e in ctx.history.faults if e.round == this_round
                                        and e.device == s.name and e.rank == rank})
        self._pending.append((moment_sums(states, faulty), b))  # read at the window's end

    def _take_pending(self) -> None:
        """Read the measured rounds' moments on the host into the window's finite estimates."""
        for sums, b in self._pending:
            small, large, n = _moments_of(sums)
            if n >= 2:
                est = two_batch_estimate(small, large, b, n)
                if math.isfinite(est.grad_sq) and math.isfinite(est.trace_sigma):
                    self._est.append((est.grad_sq, est.trace_sigma))
        self._pending = []

    @property
    def noise_scale(self) -> float | None:
        return self.last.noise_scale if self.last is not None else None

    def before_fit(self, ctx: FitContext) -> None:
        self._plan = ctx.plan
        if not self._resumed:  # a resumed fit continues the checkpoint's window
            self._reset_window(ctx.train_seconds)
        self._resumed = False

    def after_eval(self, ctx: FitContext, record) -> None:
        if self.last is not None and self.last.round == record.round:  # at a window's last round
            self.last.test_accuracy = record.test_accuracy
        else:
            self._acc = record.test_accuracy

    def after_round(self, ctx: FitContext) -> None:
        self._rounds += 1
        self._samples += ctx.round_samples
        loss = ctx.round_loss.detach().float()
        self._loss = loss if self._loss is None else self._loss + loss
        if self._measured(self._rounds):
            self._measure(ctx)
        if self._rounds < self._length():  # the monitor runs before the policies: this round's k·b
            return
        plan = ctx.plan
        plan.rounds.flush()  # the window's one host wait
        self._take_pending()
        states = plan.states
        k, b = plan.num_learners, plan.settings.batch_size
        g2 = tr = g2_ema = tr_ema = ns = None
        if self._est:
            g2 = sum(e[0] for e in self._est) / len(self._est)
            tr = sum(e[1] for e in self._est) / len(self._est)
            if plan.progress.rounds_done > self.warmup_windows * self.every:  # past the warm-up windows
                a = self.ema
                self._g2 = a * self._g2 + (1 - a) * g2
                self._tr = a * self._tr + (1 - a) * tr
                self._weight = a * self._weight + (1 - a)
                g2_ema, tr_ema = self._g2 / self._weight, self._tr / self._weight
                ns = tr_ema / g2_ema if g2_ema > 0 else None
        div = divergence(states)
        elapsed = max(ctx.train_seconds - self._t0, 1e-9)
        n_samples = ctx.rounds_per_epoch * k * b or 1
        self.last = MetricRecord(
            round=plan.progress.rounds_done,
            epoch=ctx.epoch + min(1.0, plan.progress.position_in_epoch / max(n_samples, 1)),
            samples_per_s=self._samples / elapsed,
            train_loss=float(self._loss) / self._rounds,
            lr=float(plan.settings.lr), batch_size=b, replicas_per_device=plan.settings.replicas_per_device,
            num_learners=k, alpha=float(plan.settings.alpha_for(k)), sync_every=plan.settings.sync_every,
            divergence_mean=float(div.mean()), divergence_max=float(div.max()),
            grad_sq=g2, trace_sigma=tr,
            grad_sq_ema=g2_ema, trace_sigma_ema=tr_ema, noise_scale=ns, test_accuracy=self._acc,
        )
        self._acc = None
        ctx.history.metrics.append(self.last)
        self._reset_window(ctx.train_seconds)
