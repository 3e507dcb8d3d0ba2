"""The policy interface (docs/design-overview.md §5, Policies): ``Policy``, a Hook that changes the
plan between rounds only through ``Policy.adjust``, which builds one ``Adjustment`` (plain data:
the decision) and applies it with ``Plan.adjust`` (engine/adjust.py ``apply_adjustment``);
every applied one is a ``PolicyRecord`` in ``History.policy``. The built-in policies are in
tuning/policies.py and tuning/adaptive_batch.py; ``crossbow_graph.tuning.policies`` exports all
of these names."""

from __future__ import annotations

from typing import Any

from ..config import Adjustment
from ..training.history import PolicyRecord
from ..training.hooks import FitContext, Hook

__all__ = ["Policy"]


class Policy(Hook):
    """Base class of hyper-parameter policies: a Hook that changes the plan through ``adjust``.

    Override the hook methods (``before_fit`` … ``after_fit``, all given the FitContext); read
    ``self.metrics(ctx)`` (the fit's MetricsMonitor: ``.last``, ``.noise_scale``) and
    ``ctx.history``. A policy that writes replica state other than through ``adjust`` sets
    ``mutates_replicas = True`` (docs/runtime.md, Overlap); one that needs several learners sets
    ``min_learners`` (docs/policies.md)."""

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
            PlanError: the new batch size or replicas exceed the memory budget."""
        done = ctx.plan.adjust(Adjustment(**changes))
        self.record(ctx, done, reason)
        return done

    def record(self, ctx: FitContext, changes: dict[str, Any], reason: str) -> None:
        """``changes`` (when any) as this policy's PolicyRecord in ``ctx.history.policy``."""
        if changes:
            ctx.history.policy.append(PolicyRecord(round=ctx.plan.progress.rounds_done, epoch=ctx.epoch,
                                                   policy=type(self).__name__, changes=changes,
                                                   reason=reason))
