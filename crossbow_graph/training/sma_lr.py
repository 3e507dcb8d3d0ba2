"""SMA's η rule: every learner steps at the lr its optimizer and scheduler set × s(k),
s(k) = √min(k, K_SAT), the factor moved linearly over a quarter epoch of samples after every
change of the number of learners k (docs/design-overview.md §2, "How α, μ_z and η follow k").

The factor is ``LocalOptimizer.lr_factor`` (engine/state/optim.py), applied by a round's
``Hyper.of`` without writing the groups' lr (the user's η₁); every change of k, and of α or β
alone, is a ``LRRuleRecord`` in ``History.lr_rule``."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .fit_plan import FitPlan
    from .history import History

__all__ = ["K_SAT", "RAMP_EPOCHS", "LRRuleRecord", "SMALRRule", "lr_factor_for"]

K_SAT = 16  # k·b = 256 at b = 16: W1's gradient noise scale, past which η stops growing
RAMP_EPOCHS = 0.25  # the ramp after a change of k, in epochs of samples


def lr_factor_for(num_learners: int) -> float:
    """s(k) = √min(k, K_SAT): 1.0 exactly at k = 1."""
    return math.sqrt(min(num_learners, K_SAT))


@dataclass
class LRRuleRecord:
    """One application of SMA's η rule: at the start of round ``round`` (0-based; ``epoch``),
    with k = ``num_learners`` learners, α = ``alpha`` and z's rate β = ``centre_rate``
    (``SMA.centre_rate_for``), the factor on the optimizer's lr moves linearly from
    ``factor_from`` to ``factor_to`` = √min(k, 16) over ``ramp_samples`` training samples (0: at
    once); a change of α or β alone has the factor in force at both ends and 0."""

    round: int
    epoch: float
    num_learners: int
    alpha: float
    factor_from: float
    factor_to: float
    ramp_samples: int
    centre_rate: float | None = None  # None: a record that predates β's


class SMALRRule:
    """The rule's state on a plan (``RunSettings.lr_rule``), kept across fits and in
    checkpoints: the k it last saw and the ramp in force (from ``origin`` at sample ``start``
    to ``target``); ``apply`` sets the plan's factor before every round of a fit."""

    def __init__(self) -> None:
        self.k: int | None = None
        self.pull: tuple[float, float] | None = None  # (α, β) of the last round
        self.start, self.origin, self.target = 0, 1.0, 1.0
        self.num_samples = self.ramp_samples = 1

    @staticmethod
    def for_fit(plan: "FitPlan", num_samples: int) -> "SMALRRule | None":
        """The plan's rule for a fit over ``num_samples`` (N) samples per epoch (a ramp of
        ``RAMP_EPOCHS``·N samples), or None: a sync algorithm without the rule or with
        ``scale_lr=False`` (``SyncAlgorithm.scales_lr``)."""
        settings = plan.settings
        if not settings.sync.scales_lr:
            return None
        if settings.lr_rule is None:
            settings.lr_rule = SMALRRule()
        rule = settings.lr_rule
        rule.num_samples, rule.ramp_samples = num_samples, max(1, round(RAMP_EPOCHS * num_samples))
        return rule

    def apply(self, plan: "FitPlan", history: "History") -> float:
        """Set ``plan``'s factor for the round about to run and return that round's η
        (the optimizer's lr × the factor). A change of k is recorded in ``history.lr_rule``
        and begins a ramp where the factor is off its new target (so does the plan's first
        round: the factor is 1 at compile); a change of α or β alone (``Adjustment(alpha=...)``)
        is recorded with the factor in force as both ends and no ramp (one under way goes on)."""
        local, sync = plan.settings.optimizer, plan.settings.sync
        k = plan.num_learners
        done = plan.progress.epochs_done * self.num_samples + plan.progress.position_in_epoch
        pull = (plan.settings.alpha_for(k), sync.centre_rate_for(k))
        moves, ends = False, (local.lr_factor, local.lr_factor)
        record = self.pull is not None and pull != self.pull  # α or β changed at this k
        if k != self.k:  # a change of k, or the plan's first round
            first, self.k, target = self.k is None, k, lr_factor_for(k)
            self.start, self.origin, self.target = done, local.lr_factor, target
            moves = target != local.lr_factor
            record, ends = moves or not first, (self.origin, target)
        self.pull = pull
        if record:
            history.lr_rule.append(LRRuleRecord(
                round=plan.progress.rounds_done - 1, epoch=done / self.num_samples, num_learners=k,
                alpha=pull[0], factor_from=ends[0], factor_to=ends[1],
                ramp_samples=self.ramp_samples if moves else 0, centre_rate=pull[1]))
        frac = min(1.0, (done - self.start) / self.ramp_samples)
        local.lr_factor = self.target if frac >= 1.0 else \
            self.origin + (self.target - self.origin) * frac
        return local.round_lr

    def state_dict(self, plan: "FitPlan") -> dict:
        """The ramp, the factor in force and the last round's (α, β), for a checkpoint."""
        return {"k": self.k, "start": self.start, "origin": self.origin, "target": self.target,
                "factor": plan.settings.optimizer.lr_factor,
                "pull": None if self.pull is None else list(self.pull)}

    @staticmethod
    def load_state_dict(plan: "FitPlan", state: dict | None) -> None:
        """Restore ``state_dict``'s ramp and factor on ``plan`` (None: a checkpoint without
        one, which leaves the plan's; a plan without the rule keeps the factor 1)."""
        if state is None or not plan.settings.sync.scales_lr:
            return
        rule = plan.settings.lr_rule = plan.settings.lr_rule or SMALRRule()
        rule.k, rule.start = state["k"], state["start"]
        rule.origin, rule.target = state["origin"], state["target"]
        plan.settings.optimizer.lr_factor = state["factor"]
        pull = state.get("pull")  # absent from older checkpoints: no record until the next change
        rule.pull = None if pull is None else tuple(pull)
