"""The one writer of the run settings while a plan trains: an ``Adjustment`` applied between
rounds, re-planning and resizing where b or m change (docs/design-overview.md §5, Run
settings)."""

from __future__ import annotations

from typing import Any, Callable

import networkx as nx
import torch

from ..config import Adjustment
from ..errors import warn_caller
from .learning.fused import fused_mode_message
from .scheduler import Scheduler

__all__ = ["apply_adjustment"]


@torch.no_grad()
def apply_adjustment(rounds: Scheduler, adj: Adjustment, *,
                     replan: Callable[[int, int], nx.DiGraph],
                     fused_failure: Callable[[], str | None], model_name: str) -> dict[str, Any]:
    """Apply ``adj`` to the run settings of ``rounds`` (the plan's Scheduler) between rounds
    (``Plan.adjust``'s body); returns what actually changed (a value equal to the one in force is
    no change). ``replan(b, m)``: the task graph for b and m (compiler passes, memory check);
    ``fused_failure()``: why fused learners cannot run the model (``model_name``), or None.

    Order: b, m (each re-planned and checked), learner mode, α, τ, lr, replica reset. What is in
    flight finishes first; worker processes restart when b, m or the mode change or replicas are
    reset (a speculative round is cancelled).

    Raises:
        PlanError: the new b (or m) does not fit the memory budget; nothing is changed then.
        ValueError: α given with k = 1 (a single learner has no averaging); α or τ under SSGD;
            ``learner_mode="fused"`` for a model that torch.func.vmap cannot run (names
            ``"per_replica"``), before anything changes."""
    settings, done = rounds.settings, {}
    stable = settings.sync.stability_warning(rounds.num_learners) is None
    if adj.learner_mode == "fused" and settings.learner_mode != "fused" and fused_failure():
        raise ValueError(fused_mode_message(model_name, fused_failure()))
    if adj.batch_size is not None and adj.batch_size != settings.batch_size:
        _replan(rounds, replan, adj.batch_size, settings.replicas_per_device)
        done["batch_size"] = adj.batch_size
    if adj.replicas_per_device is not None and adj.replicas_per_device != settings.replicas_per_device:
        _replan(rounds, replan, settings.batch_size, adj.replicas_per_device)
        done["replicas_per_device"] = adj.replicas_per_device
    if adj.learner_mode is not None and adj.learner_mode != settings.learner_mode:
        rounds.flush()
        rounds.close_workers()
        settings.learner_mode = adj.learner_mode
        done["learner_mode"] = adj.learner_mode
    if adj.alpha is not None:
        alpha = None if adj.alpha == "auto" else float(adj.alpha)
        if alpha is not None and rounds.num_learners == 1:
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
        rounds.reset_replicas([list(range(s.m)) for s in rounds.states])
        done["reset_replicas"] = True
    unstable = settings.sync.stability_warning(rounds.num_learners)
    if unstable is not None and stable and done.keys() & {"alpha", "replicas_per_device"}:
        warn_caller(unstable)  # once per move from stable to unstable
    return done


def _replan(rounds: Scheduler, replan: Callable[[int, int], nx.DiGraph], b: int, m: int) -> None:
    """Re-plan the learners for batch size ``b`` and ``m`` replicas per device (the compiler
    passes, the verifier and the memory check first: PlanError leaves everything unchanged), then
    resize the replicas (kept ones keep their state, new ones are cloned from z with zeroed
    momentum, ``DeviceState.resize``) and adopt the new task graph."""
    graph = replan(b, m)  # raises PlanError
    settings = rounds.settings
    rounds.flush()
    rounds.close_workers()
    if m != settings.replicas_per_device:
        for state in rounds.states:
            state.resize(m)
    settings.batch_size, settings.replicas_per_device = b, m
    rounds.set_task_graph(graph)
