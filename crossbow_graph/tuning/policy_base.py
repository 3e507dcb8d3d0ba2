"""The policy interface (docs/design-overview.md §5, Policies): ``Policy``, a Hook that changes the
plan between rounds only through ``Policy.adjust``, which builds one ``Adjustment`` (plain data:
the decision) and applies it with ``apply_adjustment``; every applied one is a ``PolicyRecord`` in
``History.policy``. The built-in policies are in tuning/policies.py and
tuning/adaptive_batch.py; ``crossbow_graph.tuning.policies`` exports all of these names.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ..compiler.passes import build_task_graph
from ..config import Adjustment
from ..engine.fused import fused_mode_message
from ..training.history import PolicyRecord
from ..training.hooks import FitContext, Hook

if TYPE_CHECKING:
    from ..api import Plan

__all__ = ["apply_adjustment", "Policy"]


@torch.no_grad()
def apply_adjustment(plan: "Plan", adj: Adjustment) -> dict[str, Any]:
    """Apply ``adj`` to ``plan`` between rounds; returns what actually changed.

    The one place that changes the plan's run settings (``plan.settings``, engine/settings.py):
    ``Plan.adjust`` calls it, and through it policies, the auto-tuner, ``Plan.set_replicas`` and
    ``Plan.set_learner_mode``, the torchrun agreement (``Comm.agree_settings``) and checkpoint
    resumes. A value equal to the one in force is no change.

    Order: batch size (re-plan, memory check), replicas (re-plan, memory check, replicas
    resized), learner mode, α, τ, lr, replica reset. Anything in flight is finished first; worker
    processes restart when b, m or the learner mode change or replicas are reset (a speculative
    round, learned from the old replicas, is cancelled).

    Raises:
        PlanError: the new b (or m) does not fit the memory budget; nothing is changed then.
        ValueError: α given with k = 1 (a single learner has no averaging); α or τ under SSGD;
            ``learner_mode="fused"`` for a model that torch.func.vmap cannot run
            (``Plan.fused_failure``; names ``"per_replica"``), before anything changes.
    """
    settings, sched, done = plan.settings, plan.scheduler, {}
    if adj.learner_mode == "fused" and settings.learner_mode != "fused" and plan.fused_failure:
        raise ValueError(fused_mode_message(type(plan.template).__name__, plan.fused_failure))
    if adj.batch_size is not None and adj.batch_size != settings.batch_size:
        _replan(plan, adj.batch_size, settings.replicas_per_device)
        done["batch_size"] = adj.batch_size
    if adj.replicas_per_device is not None and adj.replicas_per_device != settings.replicas_per_device:
        _replan(plan, settings.batch_size, adj.replicas_per_device)
        done["replicas_per_device"] = adj.replicas_per_device
    if adj.learner_mode is not None and adj.learner_mode != settings.learner_mode:
        sched.flush()
        sched.close_workers()
        settings.learner_mode = adj.learner_mode
        done["learner_mode"] = adj.learner_mode
    if adj.alpha is not None:
        alpha = None if adj.alpha == "auto" else float(adj.alpha)
        if alpha is not None and plan.num_learners == 1:
            raise ValueError("Adjustment(alpha=...) with k = 1 learner: there is no averaging")
        if alpha != settings.alpha:
            settings.alpha = alpha
            done["alpha"] = adj.alpha
    if adj.sync_every is not None and adj.sync_every != settings.sync_every:
        settings.sync_every = adj.sync_every
        done["sync_every"] = adj.sync_every
    if adj.lr is not None and adj.lr != settings.lr:
        settings.lr = float(adj.lr)
        done["lr"] = float(adj.lr)
    if adj.reset_replicas:
        sched.reset_replicas([list(range(s.m)) for s in plan.states])
        done["reset_replicas"] = True
    return done


def _replan(plan: "Plan", b: int, m: int) -> None:
    """Re-plan the learners for batch size ``b`` and ``m`` replicas per device (the compiler
    passes, the verifier and the memory check first: PlanError leaves everything unchanged), then
    resize the replicas (kept ones keep their state, new ones are cloned from z with zeroed
    momentum, ``DeviceState.resize``) and adopt the new task graph."""
    graph = build_task_graph(plan.model_graph, devices=plan.devices, replicas_per_device=m,
                             batch_size=b, memory_budget_bytes=plan.memory_budget,
                             verify=plan.verify)  # raises PlanError
    sched, settings = plan.scheduler, plan.settings
    sched.flush()
    sched.close_workers()
    if m != settings.replicas_per_device:
        for state in plan.states:
            state.resize(m)
    settings.batch_size, settings.replicas_per_device = b, m
    plan.task_graph = graph
    sched.set_task_graph(graph)


class Policy(Hook):
    """Base class of hyper-parameter policies: a Hook that changes the plan through ``adjust``.

    Override ``before_fit``, ``before_epoch``, ``before_round``, ``after_round``, ``after_eval``,
    ``after_epoch`` or ``after_fit`` (all get the FitContext); read ``self.metrics(ctx)`` (the
    fit's MetricsMonitor: ``.last`` is the newest MetricRecord, ``.noise_scale`` B_noise) and
    ``ctx.history``. A policy that writes replica state other than through ``adjust`` (or
    ``Scheduler.reset_replicas``) must set ``mutates_replicas = True`` (it turns off the
    overlap of the process executor). A policy that needs several learners sets
    ``min_learners`` (the CLI then trains 2 learners where neither ``--devices`` nor
    ``--replicas`` is given).
    """

    mutates_replicas = False
    min_learners = 1  # the fewest learners k the policy works with

    @staticmethod
    def metrics(ctx: FitContext):
        """The fit's MetricsMonitor (``ctx.metrics``), or None when ``fit(metrics_every=None)``."""
        return ctx.metrics

    def adjust(self, ctx: FitContext, *, reason: str = "", **changes: Any) -> dict[str, Any]:
        """Apply ``Adjustment(**changes)`` to ``ctx.plan`` from the next round on and record it in
        ``ctx.history.policy``; returns what changed (empty: nothing did).

        Raises:
            ValueError: a value outside its range (see Adjustment).
            PlanError: the new batch size or replicas exceed the memory budget.
        """
        done = ctx.plan.adjust(Adjustment(**changes))
        self.record(ctx, done, reason)
        return done

    def record(self, ctx: FitContext, changes: dict[str, Any], reason: str) -> None:
        """``changes`` (when any) as this policy's PolicyRecord in ``ctx.history.policy``."""
        if changes:
            ctx.history.policy.append(PolicyRecord(round=ctx.plan.rounds_done, epoch=ctx.epoch,
                                                   policy=type(self).__name__, changes=changes,
                                                   reason=reason))
