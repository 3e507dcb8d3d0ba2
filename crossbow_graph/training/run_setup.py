"""What a run was set up with (``run_setup``, stored in every checkpoint), and which settings a
resumed fit continues with, value by value (``SettingsChoice``; docs/reliability.md, Resuming
with other settings)."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

from ..config import Adjustment

if TYPE_CHECKING:
    from .fit_plan import FitPlan

__all__ = ["SettingsChoice", "run_setup", "restore_settings", "restore_outer_settings"]

_MISSING = object()


def _plain(value: Any) -> Any:
    """A group setting as a plain, comparable value (tuples as lists); _MISSING for others
    (tensors, callables)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (tuple, list)) and all(isinstance(x, (bool, int, float)) for x in value):
        return list(value)
    return _MISSING


def _plain_groups(param_groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: p for k, v in g.items() if k != "params" and (p := _plain(v)) is not _MISSING}
            for g in param_groups]


def run_setup(plan: "FitPlan") -> dict[str, Any]:
    """The plan's run settings now, as plain values: ``optimizer`` (per param group, its
    settings but the parameters), ``batch_size``, ``alpha``, ``sync_every``, ``learner_mode``,
    ``central_momentum``, ``centre_rate`` (None: the algorithm's rule, or none),
    ``share_second_moment`` (SMA's; None for the others), ``outer`` (the groups of the sync
    algorithm's state, DiLoCo's outer optimizer's, or None)."""
    s, outer = plan.settings, plan.rounds.sync_state.param_groups
    return {"optimizer": _plain_groups(s.optimizer.optimizer.param_groups),
            "batch_size": s.batch_size, "alpha": s.alpha, "sync_every": s.sync_every,
            "learner_mode": s.learner_mode, "central_momentum": s.sync.central_momentum,
            "centre_rate": getattr(s.sync, "centre_rate", None),
            "share_second_moment": getattr(s.sync, "share_second_moment", None),
            "outer": _plain_groups(outer) if outer else None}


class SettingsChoice:
    """Chooses, value by value, between a checkpoint's settings and this fit's (docs/reliability.md,
    Resuming with other settings), and warns once with every value that differs.

    Args:
        mine: this fit's set-up (``RunRecord.setup``), or None: the checkpoint's values, no warning.
        theirs: the set-up of the run that wrote the checkpoint, None for an older checkpoint."""

    def __init__(self, mine: dict[str, Any] | None, theirs: dict[str, Any] | None) -> None:
        self.mine, self.theirs = mine, theirs
        self.ours: list[str] = []   # this fit's set-up won
        self.kept: list[str] = []   # an older checkpoint's value kept over this fit's

    def pick(self, name: str, now: Any, saved: Any, path: tuple) -> Any:
        """The value to continue with for setting ``name``: ``now`` is this plan's value,
        ``saved`` the checkpoint's in force, ``path`` the keys of the setting in a set-up."""
        if self.mine is None:
            return saved
        if self.theirs is None:
            if _plain(saved) != _plain(now):
                self.kept.append(f"{name} {saved!r} (this fit's: {now!r})")
            return saved
        mine, theirs = _lookup(self.mine, path), _lookup(self.theirs, path)
        if mine is _MISSING or theirs is _MISSING or mine == theirs:
            return saved
        self.ours.append(f"{name} {_show(mine)} (the checkpoint's run was set up with "
                         f"{_show(theirs)}; {saved!r} in force at the checkpoint)")
        return tuple(mine) if isinstance(saved, tuple) else mine

    def warn(self, source: str) -> None:
        """One UserWarning naming every value that differs and which won."""
        if self.ours:
            warnings.warn(
                f"resuming from {source}: this fit is set up with other settings than the run "
                f"that wrote it, and this fit's win: {'; '.join(self.ours)}. Everything else (the "
                "other settings with a policy's or LR scheduler's changes, the optimizer state) "
                "continues from the checkpoint (docs/reliability.md, Resuming with other "
                "settings)", UserWarning, stacklevel=2)
        if self.kept:
            warnings.warn(
                f"resuming from {source}, which records no set-up (an older checkpoint): its "
                f"settings are kept where they differ from this fit's: {'; '.join(self.kept)}. A "
                "hook's before_fit, which runs after the resume, can change them "
                "(plan.adjust, plan.optimizer.param_groups)", UserWarning, stacklevel=2)


def _lookup(setup: dict[str, Any], path: tuple) -> Any:
    node: Any = setup
    for key in path:
        if isinstance(node, dict) and key in node:
            node = node[key]
        elif isinstance(node, list) and isinstance(key, int) and key < len(node):
            node = node[key]
        else:
            return _MISSING
    return node


def _show(value: Any) -> str:
    return "auto (the default rule)" if value is None else repr(value)


def restore_settings(plan: "FitPlan", sd: dict[str, Any], choice: SettingsChoice) -> None:
    """b, α, τ, every param group's settings and the learner mode of a ``plan_state_dict``,
    as ``choice`` picks them, through ``Plan.adjust`` (before the tensors are copied: a change
    of b re-plans, which resets the fault monitor). A state without one of them (an older
    checkpoint) keeps the plan's."""
    settings, changes = plan.settings, {}
    for key in ("batch_size", "alpha", "sync_every", "learner_mode"):
        if key not in sd or (key == "alpha" and "alpha" not in plan.settings.sync.adjustable):
            continue
        now = getattr(settings, key)
        value = choice.pick(key, now, sd[key], (key,))
        if value != now:
            changes[key] = "auto" if key == "alpha" and value is None else value
    if "optimizer" in sd:  # every group's settings (η, momentum, betas, ...) as chosen
        groups = plan.settings.optimizer.optimizer.param_groups
        settings.load_group_settings([
            {k: choice.pick(f"{k} (param group {i})", g.get(k), v, ("optimizer", i, k))
             for k, v in saved.items()} for i, (g, saved) in enumerate(zip(groups, sd["optimizer"]["groups"]))])
    elif "lr" in sd and sd["lr"] != settings.lr:
        changes["lr"] = sd["lr"]
    for key in ("central_momentum", "centre_rate", "share_second_moment"):  # not adjustable: this
        now = getattr(settings.sync, key, None)  # fit's value stands, a change named in the warning
        theirs = _MISSING if choice.theirs is None else _lookup(choice.theirs, (key,))
        choice.pick(key, now, now if theirs is _MISSING else theirs, (key,))  # theirs was in force
    if changes:
        plan.adjust(Adjustment(**changes))


def restore_outer_settings(plan: "FitPlan", choice: SettingsChoice) -> None:
    """After DiLoCo's outer optimizer loaded a checkpoint's state (its groups' settings
    included): each group setting ``choice`` picks from this fit's set-up."""
    for i, g in enumerate(plan.rounds.sync_state.param_groups):
        for k, v in list(g.items()):
            path = ("outer", i, k)
            if k == "params" or _plain(v) is _MISSING:
                continue
            now = v if choice.mine is None else _lookup(choice.mine, path)
            g[k] = choice.pick(f"outer optimizer {k} (param group {i})",
                               v if now is _MISSING else now, v, path)
