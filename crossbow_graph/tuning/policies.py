"""Hyper-parameter policies: hooks that read the monitored metrics and change the plan through
``Policy.adjust`` (docs/policies.md; docs/design-overview.md §5, Policies; Mai et al., "Taming
Hyper-parameters in Deep Learning Systems", ACM SIGOPS OSR 53(1) 2019; KungFu, OSDI 2020).
This module exports the built-in policies with ``Policy`` (policy_base.py) and
``AdaptiveBatchSize`` (adaptive_batch.py)."""

from __future__ import annotations

import math
from typing import Any

import torch

from ..config import Adjustment
from ..training.history import PolicyRecord
from ..training.hooks import FitContext
from ..training.lr_schedule import LRSchedulerHook
from .adaptive_batch import AdaptiveBatchSize
from .autotune import AutoTune, AutoTuner
from .policy_base import Policy

__all__ = ["Adjustment", "PolicyRecord", "Policy", "AutoReplicas",
           "AdaptiveBatchSize", "StepLR", "MultiStepLR", "CosineLR", "DivergenceGuard",
           "POLICIES", "parse_policy"]


# -- AutoReplicas --------------------------------------------------------------------------------


class AutoReplicas(AutoTuner):
    """The replica auto-tuner (tuning/autotune.py ``AutoTuner``, CROSSBOW §4.4) as a policy, the
    one ``compile(replicas="auto")`` attaches (use one or the other); ``config``: AutoTune settings,
    or keyword arguments that build one."""

    def __init__(self, config: AutoTune | None = None, **kwargs: Any) -> None:
        super().__init__(config or AutoTune(**kwargs))


# -- learning-rate schedules ---------------------------------------------------------------------


class _EpochSchedule(LRSchedulerHook, Policy):
    """A torch.optim LR scheduler over ``plan.optimizer`` stepped once per epoch through the fit's
    LR mechanism (training/lr_schedule.py), so that before epoch e it has taken e steps; a drop of η
    with ``reset_on_drop`` resets every replica to z (docs/policies.md, LR schedules)."""

    reset_default = True
    max_steps: int | None = None  # steps after which η holds (CosineLR: T)

    def __init__(self, *, reset_on_drop: bool | None = None) -> None:
        LRSchedulerHook.__init__(self, None, "epoch")
        self.reset_on_drop = self.reset_default if reset_on_drop is None else reset_on_drop
        self.steps = 0  # the scheduler's steps (the plan's epoch it has reached)
        self._pending: dict | None = None  # a checkpoint's state, for the scheduler not yet built

    def torch_scheduler(self, optimizer: torch.optim.Optimizer):
        """This schedule as a torch.optim.lr_scheduler over ``optimizer``, stepped per epoch."""
        raise NotImplementedError

    def state_dict(self) -> dict:
        if self.scheduler is None:
            return self._pending or {}
        return dict(LRSchedulerHook.state_dict(self), steps=self.steps)

    def load_state_dict(self, state: dict) -> None:
        self._forget()
        self._pending = dict(state)  # the scheduler is built over the plan at its next epoch

    def _forget(self) -> None:
        if self.scheduler is not None:
            self.settings.drop_lr_schedule(self.scheduler)
        self.scheduler = None

    def before_fit(self, ctx: FitContext) -> None:
        if self.scheduler is not None and self.scheduler.optimizer is not ctx.plan.settings.optimizer.optimizer:
            self._forget()  # another plan

    def before_epoch(self, ctx: FitContext) -> None:
        old = ctx.plan.settings.lr
        if self.scheduler is None:
            self._build(ctx.plan.settings)
        target = ctx.epoch if self.max_steps is None else min(ctx.epoch, self.max_steps)
        while self.steps < target:
            self._step(ctx)
            self.steps += 1
        self._changed(ctx, old)

    def _build(self, settings) -> None:
        """The torch scheduler over the plan's optimizer, at the pending checkpoint's state."""
        state, self._pending, self.settings = self._pending, None, settings
        self.scheduler = settings.new_lr_schedule(self.torch_scheduler, keep_lr=state is not None)
        self.steps = 0 if state is None else int(state.get("steps") or 0)
        if state is not None and "scheduler" in state:
            LRSchedulerHook.load_state_dict(self, state)
        elif state is not None:  # an older checkpoint's: the steps taken, η in force restored
            for part in _chained(self.scheduler):  # a chain's schedulers, each at the steps
                part.last_epoch = self.steps

    def after_epoch(self, ctx: FitContext, record) -> None:
        """Nothing: the schedule steps at the epochs' starts."""

    def after_fit(self, ctx: FitContext) -> None:
        """Nothing: the schedule stays added to the plan's settings for the policy's next fit."""

    def _changed(self, ctx: FitContext, old: float) -> None:
        """Record η's change from ``old``; at a drop with ``reset_on_drop``, reset the replicas."""
        new = ctx.plan.settings.lr
        if math.isclose(old, new, rel_tol=1e-12):
            return
        changes = {"lr": new}
        if new < old and self.reset_on_drop and ctx.plan.num_learners > 1:
            changes.update(ctx.plan.adjust(Adjustment(reset_replicas=True)))
        self.record(ctx, changes, f"epoch {ctx.epoch}: η {old:g} → {new:g}" +
                    (", replicas reset to z" if "reset_replicas" in changes else ""))


def _chained(scheduler) -> list:
    """The schedulers a ChainedScheduler steps, else ``[scheduler]``."""
    if isinstance(scheduler, torch.optim.lr_scheduler.ChainedScheduler):
        return list(scheduler._schedulers)  # torch's own
    return [scheduler]


class StepLR(_EpochSchedule):
    """η = η₀·γ^⌊e/step⌋: torch.optim.lr_scheduler.StepLR stepped per epoch.

    Args:
        step_epochs: epochs between drops (≥ 1). gamma: factor per drop, in (0, 1].
        reset_on_drop: reset every replica to z when η drops (default True)."""

    def __init__(self, step_epochs: int = 2, gamma: float = 0.1, **kw: Any) -> None:
        super().__init__(**kw)
        if step_epochs < 1 or not 0 < gamma <= 1:
            raise ValueError(f"StepLR(step_epochs={step_epochs}, gamma={gamma}): need step ≥ 1 "
                             "and gamma in (0, 1]")
        self.step_epochs, self.gamma = step_epochs, gamma

    def torch_scheduler(self, optimizer):
        return torch.optim.lr_scheduler.StepLR(optimizer, step_size=self.step_epochs, gamma=self.gamma)


class MultiStepLR(_EpochSchedule):
    """η = η₀·w(e)·γ^(number of milestones ≤ e), with linear warm-up
    w(e) = s + (1 − s)·min(e, W)/W: torch's LinearLR(start_factor=s, total_iters=W) chained with
    MultiStepLR(milestones, γ), stepped per epoch (W = 0: MultiStepLR alone).

    Args:
        milestones: epochs at which η is multiplied by γ (increasing).
        gamma: factor per milestone, in (0, 1].
        warmup_epochs: W ≥ 0. warmup_start: s in (0, 1].
        reset_on_drop: reset every replica to z when η drops (default True)."""

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


class CosineLR(_EpochSchedule):
    """η = η_min + (η₀ − η_min)(1 + cos(π·e/T))/2 for e ≤ T, then η_min:
    torch.optim.lr_scheduler.CosineAnnealingLR(T_max=T, eta_min) stepped per epoch up to T (torch's
    then rises again, periodically, where this one holds η_min).

    Args:
        epochs: T ≥ 1. eta_min: floor ≥ 0.
        reset_on_drop: reset every replica to z when η drops (default False: it drops every
            epoch)."""

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
    """Reset replicas that diverge from z or whose loss explodes (docs/policies.md,
    DivergenceGuard); resets are FaultEvents, and every learner failing in one round, or each
    twice in rounds that all had one, raises DivergenceError (engine/learning/faults.py).

    Args:
        max_divergence: threshold on ‖ŵ_j − z‖/‖z‖ (> 0); None: only the loss check.
        loss_factor: threshold on loss / median loss (> 1); None: only the divergence check."""

    def __init__(self, *, max_divergence: float | None = 1.0, loss_factor: float | None = 10.0) -> None:
        if max_divergence is not None and not max_divergence > 0:
            raise ValueError(f"DivergenceGuard(max_divergence={max_divergence}): must be > 0")
        if loss_factor is not None and not loss_factor > 1:
            raise ValueError(f"DivergenceGuard(loss_factor={loss_factor}): must be > 1")
        self.max_divergence, self.loss_factor = max_divergence, loss_factor
        self._first_loss: float | None = None

    def before_fit(self, ctx: FitContext) -> None:
        self._first_loss = None
        ctx.plan.rounds.set_max_divergence(self.max_divergence)

    def after_fit(self, ctx: FitContext) -> None:
        ctx.plan.rounds.set_max_divergence(None)

    @torch.no_grad()
    def after_round(self, ctx: FitContext) -> None:
        losses = ctx.round_losses
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
        plan = ctx.plan
        t = plan.progress.rounds_done - 1
        done = {(e.device, e.replica) for e in ctx.history.faults if e.round == t}  # reset already
        rows_of = []
        j0 = 0
        for s in plan.states:
            rows_of.append([r for r in range(s.m) if bool(bad[j0 + r]) and (s.name, r) not in done])
            j0 += s.m
        if any(rows_of):  # a round learned ahead from the bad replica is cancelled
            plan.rounds.reset_replicas(rows_of, round_index=t)


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
        ValueError: an unknown name or argument, naming the known ones."""
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
