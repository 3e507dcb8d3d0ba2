"""What a fit reports: per-epoch and per-evaluation records (docs/design-overview.md §5, metrics)."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field

__all__ = ["EpochRecord", "EvalRecord", "AutotuneRecord", "MetricRecord", "PolicyRecord", "History"]


@dataclass(kw_only=True)
class EpochRecord:
    """One epoch.

    Attributes:
        epoch: 1-based epoch number.
        rounds: rounds run in the epoch.
        samples: training samples of those rounds (Σ over rounds of k·b).
        train_loss: mean training loss over the epoch's learner batches.
        test_accuracy: z's accuracy on the eval dataset at the epoch's end (in [0, 1]), or None.
        samples_per_s: training samples per second of training time (evaluation excluded).
        tokens_per_s: ``samples_per_s`` × ``History.tokens_per_sample``; None without tokens.
        train_seconds: cumulative training wall seconds at the end of the epoch.
        replicas_per_device, learner_mode: m and the learner mode at the end of the epoch.
        sync_unhidden_share: the share of the epoch's sync seconds learners waited for, in
            [0, 1]; None when no sync ran."""

    epoch: int
    rounds: int
    train_loss: float
    test_accuracy: float | None
    samples_per_s: float
    train_seconds: float
    replicas_per_device: int
    learner_mode: str = "per_replica"
    sync_unhidden_share: float | None = None
    samples: int = 0
    tokens_per_s: float | None = None


@dataclass(kw_only=True)
class EvalRecord:
    """One evaluation of z: ``epoch`` as a fraction (2.5 = half-way through the third epoch);
    ``test_extras``: the other scalar entries of a dict that ``loss_fn`` returns, averaged over
    the samples (rank 0's under torchrun); ``samples``: training samples run before it (this
    fit's, with those of the run a resume continues); ``test_perplexity``: exp(test_loss), the
    perplexity per token when the loss is a mean cross-entropy (``models.lm_loss``), inf when
    that overflows."""

    epoch: float
    round: int
    train_seconds: float
    test_accuracy: float
    test_loss: float
    test_extras: dict[str, float] = field(default_factory=dict)
    samples: int = 0
    test_perplexity: float | None = None

    def __post_init__(self) -> None:
        if self.test_perplexity is None and self.test_loss is not None:
            self.test_perplexity = _exp(self.test_loss)


def _exp(loss: float) -> float:
    """exp(loss), inf past the float range, NaN for NaN."""
    try:
        return math.exp(loss)
    except OverflowError:
        return math.inf


@dataclass(kw_only=True)
class AutotuneRecord:
    """One decision of the replica auto-tuner (docs/runtime.md, the auto-tuner's decisions).

    Attributes:
        round: the plan's round count when the decision was taken.
        replicas_per_device, learner_mode: the configuration measured.
        samples_per_s: its median throughput over the window, training samples per second.
        samples_per_s_low, samples_per_s_high: the spread of that median.
        windows: measurement windows of this configuration pooled for the decision.
        action: ``"add"``, ``"confirm"``, ``"confirmed_add"``, ``"confirmed_keep_mode"``,
            ``"unconfirmed"``, ``"remove"``, ``"bound"``, ``"try_mode"``, ``"revert_mode"``,
            ``"skip_mode"``, ``"hold"``, ``"drift"`` or ``"repeat"``.
        next_replicas_per_device, next_learner_mode: the configuration after the decision."""

    round: int
    replicas_per_device: int
    learner_mode: str
    samples_per_s: float
    samples_per_s_low: float
    samples_per_s_high: float
    windows: int
    action: str
    next_replicas_per_device: int
    next_learner_mode: str


@dataclass(kw_only=True)
class MetricRecord:
    """One metrics window (every ``MetricsMonitor.every`` rounds; docs/policies.md, Metrics).

    Attributes:
        round: the plan's round count at the end of the window; epoch: fractional epoch then.
        samples_per_s: training samples per training second; train_loss: mean learner loss.
        lr, batch_size, replicas_per_device, num_learners, alpha, sync_every: η, b, m, k, α, τ.
        divergence_mean, divergence_max: mean and max over replicas of ‖w_j − z‖ / ‖z‖.
        grad_sq, trace_sigma: the window's estimates of |G|² and tr Σ (None: k = 1).
        grad_sq_ema, trace_sigma_ema: their bias-corrected EMAs (None in warm-up windows).
        noise_scale: B_noise = trace_sigma_ema / grad_sq_ema, samples (or None).
        test_accuracy: z's accuracy at the last evaluation inside the window, else None."""

    round: int
    epoch: float
    samples_per_s: float
    train_loss: float
    lr: float
    batch_size: int
    replicas_per_device: int
    num_learners: int
    alpha: float
    sync_every: int
    divergence_mean: float
    divergence_max: float
    grad_sq: float | None = None
    trace_sigma: float | None = None
    grad_sq_ema: float | None = None
    trace_sigma_ema: float | None = None
    noise_scale: float | None = None
    test_accuracy: float | None = None


@dataclass(kw_only=True)
class PolicyRecord:
    """One applied adjustment.

    Attributes:
        round: the plan's round count when it was decided (it applies from the next round).
        epoch: 0-based epoch index then.
        policy: the policy's class name.
        changes: what changed, e.g. ``{"batch_size": 32, "lr": 0.04}``.
        reason: the policy's own words, with the numbers it acted on."""

    round: int
    epoch: int
    policy: str
    changes: dict = field(default_factory=dict)
    reason: str = ""


@dataclass(kw_only=True)
class History:
    """Everything a fit measured.

    Attributes:
        epochs: one EpochRecord per completed epoch.
        evals: every evaluation of z.
        target_accuracy: the requested target, if any.
        max_grad_norm: the 2-norm every learner's gradient was clipped to, None: not clipped.
        time_to_accuracy_s: training seconds when z first reached the target (None if never).
        epochs_to_accuracy: epochs (fractional) at that point.
        target_loss: the requested test-loss target (``fit(target_loss=)``), if any.
        time_to_loss_s: training seconds when z's test loss first reached ``target_loss``
            (None if never); epochs_to_loss, samples_to_loss: epochs and samples then.
        tokens_per_sample: tokens one training sample predicts: the training dataset's
            ``block_size`` (``datasets.TextDataset``), else None; tokens = samples × it.
        faults: every replica reset for NaN/Inf (engine/learning/faults.py FaultEvent; under
            torchrun every rank's).
        autotune: every decision of the replica auto-tuner, in order.
        sync_seconds: synchronisation work during the fit (local and global syncs), seconds.
        sync_exposed_seconds: the part of it learners waited for (not hidden), seconds.
        metrics: one MetricRecord per metrics window (``fit(metrics_every=N)``).
        policy: every adjustment a policy applied (a PolicyRecord each).
        lr: η of every round run (the first group's lr × the η rule's factor,
            training/sma_lr.py).
        lr_rule: every application of SMA's η rule (``LRRuleRecord``), in order; empty without the
            rule (``SMA(scale_lr=False)``, ``SSGD()``, the other algorithms).
        cuda_graphs: with ``compile(cuda_graphs=True)``, ``{"captures", "replays",
            "eager_rounds": {reason: rounds}}`` (``RoundGraph.record``); else empty.
        cpu_threads: torch's intra-op threads during the fit (``fit(cpu_threads=)``).
        free_cores: the cores other processes left free at its start, from which
            ``cpu_threads="auto"`` chose (engine/learning/threads.py); None: not measured.
        membership: under ``Distributed(fault_tolerant=True)`` every change of the live replica
            groups (engine/transport/ft.py ``MembershipChange``), in order."""

    epochs: list[EpochRecord] = field(default_factory=list)
    evals: list[EvalRecord] = field(default_factory=list)
    target_accuracy: float | None = None
    max_grad_norm: float | None = None
    time_to_accuracy_s: float | None = None
    epochs_to_accuracy: float | None = None
    target_loss: float | None = None
    time_to_loss_s: float | None = None
    epochs_to_loss: float | None = None
    samples_to_loss: int | None = None
    tokens_per_sample: int | None = None
    faults: list = field(default_factory=list)
    autotune: list[AutotuneRecord] = field(default_factory=list)
    sync_seconds: float = 0.0
    sync_exposed_seconds: float = 0.0
    metrics: list = field(default_factory=list)
    policy: list = field(default_factory=list)
    lr: list[float] = field(default_factory=list)
    lr_rule: list = field(default_factory=list)
    cuda_graphs: dict = field(default_factory=dict)
    membership: list = field(default_factory=list)
    cpu_threads: int = 0
    free_cores: float | None = None

    @property
    def sync_unhidden_share(self) -> float | None:
        """Share of synchronisation time not hidden behind learning, in [0, 1]
        (None: no sync; docs/runtime.md, Overlap)."""
        if self.sync_seconds <= 0:
            return None
        return min(1.0, self.sync_exposed_seconds / self.sync_seconds)

    def per_token(self, samples_per_s: float) -> float | None:
        """``samples_per_s`` × ``tokens_per_sample`` (tokens/s), None without tokens."""
        return samples_per_s * self.tokens_per_sample if self.tokens_per_sample else None

    @property
    def tokens_to_loss(self) -> int | None:
        """Training tokens when z first reached ``target_loss`` (``samples_to_loss`` ×
        ``tokens_per_sample``), None if never or without tokens."""
        if self.samples_to_loss is None or self.tokens_per_sample is None:
            return None
        return self.samples_to_loss * self.tokens_per_sample

    @property
    def target_reached(self) -> bool:
        """Whether z reached ``target_accuracy`` or ``target_loss`` (the fit stopped there)."""
        return self.time_to_accuracy_s is not None or self.time_to_loss_s is not None

    @property
    def final_accuracy(self) -> float | None:
        """The last evaluated test accuracy of z, or None."""
        return self.evals[-1].test_accuracy if self.evals else None

    def to_dict(self) -> dict:
        out = asdict(self)
        out["sync_unhidden_share"] = self.sync_unhidden_share
        out["tokens_to_loss"] = self.tokens_to_loss
        return out

    def save_json(self, path: str) -> None:
        """Write the history as JSON to ``path``."""
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=2)
