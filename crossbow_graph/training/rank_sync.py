"""What the ranks of a torchrun fit agree on between rounds: rank 0's settings and stop
(``agree_settings``, ``agreed_stop``), the faults found since the last global sync
(``share_last_faults``) (docs/distributed.md)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from ..config import Adjustment
from ..engine.transport.comm import AGREE_EVERY_ROUNDS

if TYPE_CHECKING:
    from .fit_plan import FitPlan
    from .hooks import FitContext

__all__ = ["agree_settings", "agreed_stop"]


def agree_settings(comm: Any, plan: FitPlan, stop: bool, round_index: int) -> bool:
    """Apply rank 0's m, learner mode, lr, α, batch size and sync interval τ on every rank;
    returns rank 0's ``stop``.

    Hooks that decide (auto-tuner, policies) run on rank 0; a change they make reaches the
    other ranks at the same round boundary, applied through ``plan.adjust`` as one
    ``Adjustment`` of the values that differ (as a policy's).

    Raises:
        DistributedError: a peer died or did not answer."""
    settings = plan.settings
    alpha = settings.alpha
    mine = [float(settings.replicas_per_device), float(settings.learner_mode == "fused"),
            settings.lr, math.nan if alpha is None else alpha, float(stop),
            float(settings.batch_size), float(settings.sync_every)]
    m, fused, lr, alpha0, stop0, b0, tau0 = comm.broadcast_floats(mine, round_index)
    if comm.is_main:
        return stop
    alpha0 = None if math.isnan(alpha0) else alpha0
    theirs = {"batch_size": int(b0), "sync_every": int(tau0), "replicas_per_device": int(m),
              "learner_mode": "fused" if fused else "per_replica", "lr": lr, "alpha": alpha0}
    changes = {k: v for k, v in theirs.items() if v != getattr(settings, k)}
    if "alpha" in changes and alpha0 is None:
        changes["alpha"] = "auto"  # Adjustment: None is "unchanged", "auto" the default rule
    if changes:  # nothing to build or apply in the usual round without a decision
        plan.adjust(Adjustment(**changes))
    return bool(stop0)


def agreed_stop(plan: FitPlan, comm: Any, ctx: FitContext, decides: bool) -> bool:
    """Whether every rank stops after this round: under torchrun rank 0's settings and stop are
    agreed after every round when a hook of some rank ``decides``, else every
    ``AGREE_EVERY_ROUNDS`` rounds (a signal's stop waits for that round)."""
    if comm is None:
        return ctx.stop
    rounds_done = plan.progress.rounds_done
    if not decides and rounds_done % AGREE_EVERY_ROUNDS:
        return False
    ctx.stop = agree_settings(comm, plan, ctx.stop, rounds_done - 1)
    return ctx.stop
