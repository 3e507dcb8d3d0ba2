"""Hyper-parameter policies: hooks that read the monitored metrics and change the plan
(docs/design-overview.md §5, Policies; Mai et al., "Taming Hyper-parameters in Deep Learning
Systems", ACM SIGOPS OSR 53(1) 2019; KungFu, OSDI 2020).

A ``Policy`` is a Hook. It reads ``ctx.extra["metrics"]`` (the fit's ``MetricsMonitor``, updated
every N rounds before the policies run) and ``ctx.history``, and changes the plan only through
one narrow interface, ``Policy.adjust(ctx, lr=..., batch_size=..., alpha=..., sync_every=...,
replicas_per_device=..., learner_mode=..., reset_replicas=...)``: it builds one ``Adjustment`` (plain data: the
decision) and applies it with ``Plan.adjust``. Hooks run between rounds, so a change takes effect
at the next round, on every device at once (the devices share one scheduler). With several
processes the ``Adjustment`` is what is broadcast from rank 0 before it is applied: the decision
is taken in one place. Every applied adjustment is kept in ``History.policy``.

The interface: ``Policy`` and ``apply_adjustment`` are in tuning/policy_base.py, ``Adjustment``
in config.py, ``PolicyRecord`` in training/history.py, ``AdaptiveBatchSize`` in
tuning/adaptive_batch.py; this module exports them with the other built-in policies.

Built-in policies: ``AutoReplicas`` (the replica auto-tuner of tuning/autotune.py as a policy),
``AdaptiveBatchSize`` (b toward the gradient noise scale), ``StepLR`` / ``MultiStepLR`` (with
warm-up) / ``CosineLR`` (torch.optim.lr_scheduler's StepLR, MultiStepLR chained with LinearLR,
CosineAnnealingLR, stepped per epoch as policies; a drop resets every replica to z, as the
CROSSBOW reference code does) and ``DivergenceGuard`` (a replica that diverges from z or whose
loss explodes is reset from z; z is never poisoned).
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch

from ..config import Adjustment
from ..engine.faults import FaultMonitor
from ..training.history import PolicyRecord
from ..training.hooks import FitContext
from .adaptive_batch import AdaptiveBatchSize
from .autotune import AutoTune, AutoTuner
from .policy_base import Policy, apply_adjustment

__all__ = ["Adjustment", "apply_adjustment", "PolicyRecord", "Policy", "AutoReplicas",
           "AdaptiveBatchSize", "StepLR", "MultiStepLR", "CosineLR", "DivergenceGuard",
           "POLICIES", "parse_policy"]


# -- AutoReplicas --------------------------------------------------------------------------------


class AutoReplicas(Policy):
    """The replica auto-tuner (tuning/autotune.py, CROSSBOW §4.4) as a policy.

    Wraps an ``AutoTuner``: after a warm-up, every measurement window of whole rounds, add a
    replica per device while samples/s rise by more than ``threshold`` and beyond the windows'
    spread, else undo the last one and hold; never beyond the memory bound. Its decisions go to ``History.autotune`` and, when m or
    the learner mode changes, to ``History.policy``. (``compile(replicas="auto")`` attaches the
    same tuner by itself; use one or the other.)

    Args:
        config: the AutoTune settings; keyword arguments build one instead (``threshold=0.1``...).
    """

    def __init__(self, config: AutoTune | None = None, **kwargs: Any) -> None:
        self.tuner = AutoTuner(config or AutoTune(**kwargs))

    def state_dict(self) -> dict:
        return self.tuner.rule.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.tuner.rule.load_state_dict(state)

    def before_fit(self, ctx: FitContext) -> None:
        self.tuner.before_fit(ctx)

    def after_round(self, ctx: FitContext) -> None:
        before = (ctx.plan.replicas_per_device, ctx.plan.learner_mode)
        n = len(self.tuner.decisions)
        self.tuner.after_round(ctx)
        after = (ctx.plan.replicas_per_device, ctx.plan.learner_mode)
        if after != before:
            d = self.tuner.decisions[n:]
            ctx.history.policy.append(PolicyRecord(
                round=ctx.plan.rounds_done, epoch=ctx.epoch, policy="AutoReplicas",
                changes={"replicas_per_device": after[0], "learner_mode": after[1]},
                reason=", ".join(f"{r.action} at {r.samples_per_s:,.0f} samples/s" for r in d)))


# -- learning-rate schedules ---------------------------------------------------------------------


class _ShadowSchedule:
    """A torch.optim.lr_scheduler over a one-tensor optimizer at lr ``base``, stepped on demand:
    ``factor_at(e)`` steps it to e steps (at most ``max_steps``; it never steps back) and gives
    η(e)/η₀."""

    def __init__(self, make, base: float, max_steps: int | None) -> None:
        self.base, self.max_steps, self.steps = base, max_steps, 0
        self.scheduler = make(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=base))

    def factor_at(self, epoch: int) -> float:
        cap = epoch if self.max_steps is None else min(epoch, self.max_steps)
        with warnings.catch_warnings():  # the shadow optimizer never steps
            warnings.filterwarnings("ignore", message=r".*lr_scheduler\.step\(\).*")
            while self.steps < cap:
                self.scheduler.step()
                self.steps += 1
        return float(self.scheduler.optimizer.param_groups[0]["lr"]) / self.base


class _LRSchedule(Policy):
    """A torch.optim.lr_scheduler stepped once per epoch, as a policy: at every epoch start η is
    multiplied by factor(e)/factor(e−1) (e = 0-based epoch index), factor(e) the ratio of the
    torch scheduler's η after e steps to its η₀ (the plan's lr at the first fit). Alone,
    η = η₀·factor(e); other policies' changes of η, such as AdaptiveBatchSize's, compose. The
    torch scheduler (``torch_scheduler``) runs over a one-tensor shadow optimizer at lr η₀, so it
    never writes the plan's param groups: the change goes through ``Policy.adjust`` (every group's
    η is scaled by the same factor), and when η drops and ``reset_on_drop``, every replica is reset
    to z (CROSSBOW reference behaviour). For any other torch scheduler, or one stepped per round,
    pass it to ``fit(lr_scheduler=...)``."""

    reset_default = True
    max_steps: int | None = None  # steps after which η holds (CosineLR: T)

    def __init__(self, *, reset_on_drop: bool | None = None) -> None:
        self.reset_on_drop = self.reset_default if reset_on_drop is None else reset_on_drop
        self.base_lr: float | None = None
        self._applied = 1.0  # factor(e) in force
        self._shadow: _ShadowSchedule | None = None  # the torch scheduler, at the epoch in force

    def torch_scheduler(self, optimizer: torch.optim.Optimizer):
        """This schedule as a torch.optim.lr_scheduler over ``optimizer``, stepped per epoch."""
        raise NotImplementedError

    def _new_shadow(self, base_lr: float) -> _ShadowSchedule:
        return _ShadowSchedule(self.torch_scheduler, base_lr, self.max_steps)

    def factor(self, epoch: int) -> float:
        """factor(e) = η(e)/η₀ of the torch scheduler stepped e times (0-based epoch ``epoch``)."""
        return self._new_shadow(self.base_lr or 1.0).factor_at(epoch)

    def lr_at(self, epoch: int) -> float:
        """η in epoch ``epoch`` (0-based), this schedule alone."""
        return self.base_lr * self.factor(epoch)

    def state_dict(self) -> dict:
        return {"base_lr": self.base_lr, "applied": self._applied,
                "steps": None if self._shadow is None else self._shadow.steps}

    def load_state_dict(self, state: dict) -> None:
        self.base_lr, self._applied = state["base_lr"], state["applied"]
        self._shadow = None
        if self.base_lr is not None and state.get("steps") is not None:
            self._shadow = self._new_shadow(self.base_lr)
            self._shadow.factor_at(state["steps"])  # the same torch state, replayed

    def before_fit(self, ctx: FitContext) -> None:
        if self.base_lr is None:
            self.base_lr = float(ctx.plan.settings.lr)
            self._applied = 1.0
        if self._shadow is None:
            self._shadow = self._new_shadow(self.base_lr)

    def before_epoch(self, ctx: FitContext) -> None:
        # multiplicative, like torch's chained schedulers: composes with AdaptiveBatchSize's
        # scaling of η (η is multiplied by factor(e)/factor(e−1), not overwritten)
        f = self._shadow.factor_at(ctx.epoch)
        old = float(ctx.plan.settings.lr)
        new = old * f / self._applied
        self._applied = f
        if math.isclose(old, new, rel_tol=1e-12):
            return
        drop = new < old and self.reset_on_drop and ctx.plan.num_learners > 1
        self.adjust(ctx, lr=new, reset_replicas=drop,
                    reason=f"epoch {ctx.epoch}: η {old:g} → {new:g}" + (", replicas reset to z" if drop else ""))


class StepLR(_LRSchedule):
    """η = η₀·γ^⌊e/step⌋: torch.optim.lr_scheduler.StepLR stepped per epoch.

    Args:
        step_epochs: epochs between drops (≥ 1). gamma: factor per drop, in (0, 1].
        reset_on_drop: reset every replica to z when η drops (default True).
    """

    def __init__(self, step_epochs: int = 2, gamma: float = 0.1, **kw: Any) -> None:
        super().__init__(**kw)
        if step_epochs < 1 or not 0 < gamma <= 1:
            raise ValueError(f"StepLR(step_epochs={step_epochs}, gamma={gamma}): need step ≥ 1 "
                             "and gamma in (0, 1]")
        self.step_epochs, self.gamma = step_epochs, gamma

    def torch_scheduler(self, optimizer):
        return torch.optim.lr_scheduler.StepLR(optimizer, step_size=self.step_epochs, gamma=self.gamma)


class MultiStepLR(_LRSchedule):
    """η = η₀·w(e)·γ^(number of milestones ≤ e), with linear warm-up
    w(e) = s + (1 − s)·min(e, W)/W: torch's LinearLR(start_factor=s, total_iters=W) chained with
    MultiStepLR(milestones, γ), stepped per epoch (W = 0: MultiStepLR alone).

    Args:
        milestones: epochs at which η is multiplied by γ (increasing).
        gamma: factor per milestone, in (0, 1].
        warmup_epochs: W ≥ 0. warmup_start: s in (0, 1].
        reset_on_drop: reset every replica to z when η drops (default True).
    """

    def __init__(self, milestones: tuple[int, ...] = (3, 4), gamma: float = 0.1, *,
                 warmup_epochs: int = 0, warmup_start: float = 0.25, **kw: Any) -> None:
        super().__init__(**kw)
        ms = list(milestones)
        if ms != sorted(ms) or not 0 < gamma <= 1 or warmup_epochs < 0 or not 0 < warmup_start <= 1:
            raise ValueError(f"MultiStepLR(milestones={ms}, gamma={gamma}, warmup_epochs="
                             f"{warmup_epochs}, warmup_start={warmup_start}): milestones must "
                             "increase, gamma and warmup_start lie in (0, 1], warmup_epochs ≥ 0")
        self.milestones, self.gamma = ms, gamma
        self.warmup_epochs, self.warmup_start = warmup_epochs, warmup_start

    def torch_scheduler(self, optimizer):
        steps = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=self.milestones,
                                                     gamma=self.gamma)
        if not self.warmup_epochs:
            return steps
        warm = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=self.warmup_start,
                                                 total_iters=self.warmup_epochs)
        return torch.optim.lr_scheduler.ChainedScheduler([warm, steps])


class CosineLR(_LRSchedule):
    """η = η_min + (η₀ − η_min)(1 + cos(π·e/T))/2 for e ≤ T, then η_min:
    torch.optim.lr_scheduler.CosineAnnealingLR(T_max=T, eta_min) stepped per epoch up to T (torch's
    then rises again, periodically, where this one holds η_min).

    Args:
        epochs: T ≥ 1. eta_min: floor ≥ 0.
        reset_on_drop: reset every replica to z when η drops (default False: it drops every
            epoch).
    """

    reset_default = False

    def __init__(self, epochs: int = 5, eta_min: float = 0.0, **kw: Any) -> None:
        super().__init__(**kw)
        if epochs < 1 or eta_min < 0:
            raise ValueError(f"CosineLR(epochs={epochs}, eta_min={eta_min}): need epochs ≥ 1, eta_min ≥ 0")
        self.epochs, self.eta_min = epochs, eta_min
        self.max_steps = epochs

    def torch_scheduler(self, optimizer):
        return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=self.epochs,
                                                          eta_min=self.eta_min)


# -- DivergenceGuard -----------------------------------------------------------------------------


class DivergenceGuard(Policy):
    """Reset replicas that diverge from z or whose loss explodes; z is never poisoned.

    Two checks, both on top of engine/faults.py (which already resets replicas with NaN/Inf
    gradients before the local update, so that their correction is zero):

    * before the local update of every round, a replica with ‖ŵ_j − z‖/‖z‖ > ``max_divergence``
      (or NaN) is reset from z the same way: its correction, the only way a replica reaches z,
      is zero, so it is left out of that round's average (``Scheduler.max_divergence``; one more
      reduction over ``w [m, P]`` per device per round);
    * after every round, a replica whose loss is NaN/Inf, or above both ``loss_factor`` × the
      median of the round's losses and the fit's first-round mean loss (so that the ordinary
      spread of small losses near convergence is not taken for an explosion), is reset from z
      (w ← z, v ← 0, buffers ← zbuf) before the next round.

    Resets are FaultEvents in ``History.faults``; every learner failing in one round raises
    DivergenceError (engine/faults.py).

    Args:
        max_divergence: threshold on ‖ŵ_j − z‖/‖z‖ (> 0); None: only the loss check.
        loss_factor: threshold on loss / median loss (> 1); None: only the divergence check.
    """

    def __init__(self, *, max_divergence: float | None = 1.0, loss_factor: float | None = 10.0) -> None:
        if max_divergence is not None and not max_divergence > 0:
            raise ValueError(f"DivergenceGuard(max_divergence={max_divergence}): must be > 0")
        if loss_factor is not None and not loss_factor > 1:
            raise ValueError(f"DivergenceGuard(loss_factor={loss_factor}): must be > 1")
        self.max_divergence, self.loss_factor = max_divergence, loss_factor
        self._first_loss: float | None = None

    def before_fit(self, ctx: FitContext) -> None:
        self._first_loss = None
        ctx.plan.scheduler.close_workers()  # forked workers read the threshold when they start
        ctx.plan.scheduler.max_divergence = self.max_divergence

    def after_fit(self, ctx: FitContext) -> None:
        ctx.plan.scheduler.max_divergence = None

    @torch.no_grad()
    def after_round(self, ctx: FitContext) -> None:
        losses = ctx.extra.get("round_losses")
        if self.loss_factor is None or not losses or len(losses) != ctx.plan.num_learners:
            return
        loss = torch.stack([x.detach().float().cpu() for x in losses])  # [k], device-major
        finite = torch.isfinite(loss)
        med = loss[finite].median() if bool(finite.any()) else torch.tensor(float("nan"))
        if self._first_loss is None and bool(finite.any()):
            self._first_loss = float(loss[finite].mean())
        floor = self._first_loss if self._first_loss is not None else 0.0
        bad = ~finite | ((loss > self.loss_factor * med.abs().clamp_min(1e-12)) & (loss > floor))
        if not bool(bad.any()):
            return
        plan, sched = ctx.plan, ctx.plan.scheduler
        t = plan.rounds_done - 1
        done = {(e.device, e.replica) for e in sched.faults.events if e.round == t}  # reset already
        rows_of = []
        j0 = 0
        for s in plan.states:
            rows_of.append([r for r in range(s.m) if bool(bad[j0 + r]) and (s.name, r) not in done])
            j0 += s.m
        if not any(rows_of):
            return
        sched.flush()
        sched.close_workers()  # a speculative round learned from the bad replica: cancel it
        for s, rows in zip(plan.states, rows_of):
            FaultMonitor.reset(s, rows)
            sched.faults.record(s, rows, round_index=t, num_learners=plan.num_learners)


# -- by name (the CLI's --policy NAME[:ARGS]) ----------------------------------------------------

POLICIES: dict[str, type[Policy]] = {
    "auto_replicas": AutoReplicas, "adaptive_batch": AdaptiveBatchSize, "step_lr": StepLR,
    "multistep_lr": MultiStepLR, "cosine_lr": CosineLR, "divergence_guard": DivergenceGuard,
}


def _value(text: str) -> Any:
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    if low == "none":
        return None
    if "/" in text:
        return tuple(_value(t) for t in text.split("/"))
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def parse_policy(spec: str) -> Policy:
    """A policy from ``NAME[:KEY=VALUE,...]``, e.g. ``adaptive_batch:max_batch_size=128`` or
    ``multistep_lr:milestones=3/4,warmup_epochs=1`` (tuples with ``/``).

    Raises:
        ValueError: an unknown name or argument, naming the known ones.
    """
    name, _, args = spec.partition(":")
    cls = POLICIES.get(name.strip().lower().replace("-", "_"))
    if cls is None:
        raise ValueError(f"--policy {spec!r}: unknown policy {name!r}; known: {', '.join(POLICIES)}")
    kwargs = {}
    for item in filter(None, args.split(",")):
        key, eq, val = item.partition("=")
        if not eq:
            raise ValueError(f"--policy {spec!r}: arguments are KEY=VALUE, got {item!r}")
        kwargs[key.strip().replace("-", "_")] = _value(val.strip())
    try:
        return cls(**kwargs)
    except TypeError as exc:
        raise ValueError(f"--policy {spec!r}: {exc}") from exc
