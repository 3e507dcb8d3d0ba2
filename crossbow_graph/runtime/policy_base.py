"""The policy interface (docs/design-overview.md §5, Policies): ``Policy``, a Hook that changes the
plan between rounds only through ``Policy.adjust``, which builds one ``Adjustment`` (plain data:
the decision) and applies it with ``apply_adjustment``; every applied one is a ``PolicyRecord`` in
``History.policy``. The built-in policies are in runtime/policies.py and
runtime/adaptive_batch.py; ``crossbow_graph.runtime.policies`` exports all of these names.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ..compiler.passes import build_task_graph
from ..errors import is_count
from .faults import FaultMonitor
from .hooks import FitContext, Hook

if TYPE_CHECKING:
    from ..api import Plan

__all__ = ["Adjustment", "apply_adjustment", "PolicyRecord", "Policy"]


@dataclass(frozen=True, kw_only=True)
class Adjustment:
    """One decision: the settings to change from the next round on (None: unchanged).

    Attributes:
        lr: learning rate η (> 0).
        batch_size: b, samples per learner per round (≥ 1); the task graph is re-planned and the
            memory bound re-checked.
        alpha: SMA α in (0, 1] (the pull toward z); ``"auto"`` restores 1/k.
        sync_every: τ, rounds between synchronisations (≥ 1).
        replicas_per_device: m (≥ 1; new replicas are cloned from z, ``Plan.set_replicas``).
        reset_replicas: put every replica at z with zero momentum (float buffers from zbuf).

    Raises:
        ValueError: a value outside its range.
    """

    lr: float | None = None
    batch_size: int | None = None
    alpha: float | str | None = None
    sync_every: int | None = None
    replicas_per_device: int | None = None
    reset_replicas: bool = False

    def __post_init__(self) -> None:
        if self.lr is not None and not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"Adjustment(lr={self.lr}): the learning rate must be finite and > 0")
        for name in ("batch_size", "sync_every", "replicas_per_device"):
            v = getattr(self, name)
            if v is not None and not is_count(v):
                raise ValueError(f"Adjustment({name}={v!r}): must be an integer ≥ 1")
        if self.alpha is not None and self.alpha != "auto" and not 0 < self.alpha <= 1:
            raise ValueError(f"Adjustment(alpha={self.alpha}): α must be in (0, 1], or 'auto' for 1/k")

    def changes(self) -> dict[str, Any]:
        """The fields that are set, as a dict."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v not in (None, False)}


@torch.no_grad()
def apply_adjustment(plan: "Plan", adj: Adjustment) -> dict[str, Any]:
    """Apply ``adj`` to ``plan`` between rounds; returns what actually changed.

    Order: batch size (re-plan, memory check), replicas, α, τ, lr, replica reset. Anything in
    flight is finished first; worker processes restart when b changes or replicas are reset (a
    speculative round, learned from the old replicas, is cancelled).

    Raises:
        PlanError: the new b (or m) does not fit the memory budget; nothing is changed then.
        ValueError: α given with k = 1 (a single learner has no averaging).
    """
    sched, done = plan.scheduler, {}
    if adj.batch_size is not None and adj.batch_size != plan.batch_size:
        b = adj.batch_size
        graph = build_task_graph(plan.model_graph, devices=plan.devices,
                                 replicas_per_device=plan.replicas_per_device, batch_size=b,
                                 memory_budget_bytes=plan.memory_budget,
                                 verify=plan._verify)  # raises PlanError
        sched.flush()
        sched.close_workers()
        plan.batch_size = sched.batch_size = b
        for fused in sched._fused:
            fused.batch_size = b
        plan.task_graph = graph
        sched.set_task_graph(graph)
        done["batch_size"] = b
    if adj.replicas_per_device is not None and adj.replicas_per_device != plan.replicas_per_device:
        plan.set_replicas(adj.replicas_per_device)
        done["replicas_per_device"] = adj.replicas_per_device
    sync = plan.sync
    if adj.alpha is not None:
        alpha = None if adj.alpha == "auto" else float(adj.alpha)
        if alpha is not None and plan.num_learners == 1:
            raise ValueError("Adjustment(alpha=...) with k = 1 learner: there is no averaging")
        if alpha != sync.alpha:
            sync = dataclasses.replace(sync, alpha=alpha)
            done["alpha"] = adj.alpha
    if adj.sync_every is not None and adj.sync_every != sync.sync_every:
        sync = dataclasses.replace(sync, sync_every=adj.sync_every)
        done["sync_every"] = adj.sync_every
    plan.sync = sched.sync = sync
    if adj.lr is not None and adj.lr != sched.lr:
        sched.lr = float(adj.lr)
        done["lr"] = float(adj.lr)
    if adj.reset_replicas:
        sched.flush()
        sched.close_workers()
        for s in plan.states:
            FaultMonitor.reset(s, list(range(s.m)))
        done["reset_replicas"] = True
    return done


@dataclass(kw_only=True)
class PolicyRecord:
    """One applied adjustment.

    Attributes:
        round: the plan's round count when it was decided (it applies from the next round).
        epoch: 0-based epoch index then.
        policy: the policy's class name.
        changes: what changed, e.g. ``{"batch_size": 32, "lr": 0.04}``.
        reason: the policy's own words, with the numbers it acted on.
    """

    round: int
    epoch: int
    policy: str
    changes: dict = field(default_factory=dict)
    reason: str = ""


class Policy(Hook):
    """Base class of hyper-parameter policies: a Hook that changes the plan through ``adjust``.

    Override ``before_fit``, ``before_epoch``, ``before_round``, ``after_round``, ``after_eval``,
    ``after_epoch`` or ``after_fit`` (all get the FitContext); read ``self.metrics(ctx)`` (the
    fit's MetricsMonitor: ``.last`` is the newest MetricRecord, ``.noise_scale`` B_noise) and
    ``ctx.history``. A policy that writes replica state directly must set
    ``mutates_replicas = True`` (it turns off the overlap of the process executor).
    """

    mutates_replicas = False

    @staticmethod
    def metrics(ctx: FitContext):
        """The fit's MetricsMonitor, or None when ``fit(metrics_every=None)``."""
        return ctx.extra.get("metrics")

    def adjust(self, ctx: FitContext, *, reason: str = "", **changes: Any) -> dict[str, Any]:
        """Apply ``Adjustment(**changes)`` to ``ctx.plan`` from the next round on and record it in
        ``ctx.history.policy``; returns what changed (empty: nothing did).

        Raises:
            ValueError: a value outside its range (see Adjustment).
            PlanError: the new batch size or replicas exceed the memory budget.
        """
        done = ctx.plan.adjust(Adjustment(**changes))
        if done:
            ctx.history.policy.append(PolicyRecord(round=ctx.plan.rounds_done, epoch=ctx.epoch,
                                                   policy=type(self).__name__, changes=done,
                                                   reason=reason))
        return done
