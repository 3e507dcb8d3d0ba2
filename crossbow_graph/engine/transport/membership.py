"""The live membership of a fault-tolerant run's syncs: k of the last committed sync and every
change of the groups that took part (docs/distributed.md, "Fault tolerance: torchft replica
groups")."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

__all__ = ["Membership", "MembershipChange"]

_log = logging.getLogger("crossbow_graph.ft")


@dataclasses.dataclass(frozen=True)
class MembershipChange:
    """A sync whose live membership differs from the previous one's.

    Attributes:
        round_index: the round (0-based) whose global sync saw it.
        groups: replica groups in the sync (the Lighthouse quorum's participants).
        learners: k, learners of the groups that contributed (a group that just joined adds its
            learners from the next sync on).
        recovered: this group received its state from a peer in this quorum.
        failed_attempts: all-reduces discarded before this one (a group died or hung).
        seconds: wall seconds of this sync, from its first quorum to its commit (with failed
            attempts: the stall the failure cost this group)."""

    round_index: int
    groups: int
    learners: int
    recovered: bool = False
    failed_attempts: int = 0
    seconds: float = 0.0


class Membership:
    """The syncs' membership as one replica group sees it.

    Attributes:
        live_learners: k of the last committed sync (None before the first): α(k) of the next
            round's local updates.
        changes: every ``MembershipChange``, in order."""

    def __init__(self, replica_group: str, world_size: int, rank: int) -> None:
        self.replica_group, self.world_size, self.rank = replica_group, world_size, rank
        self.live_learners: int | None = None
        self.changes: list[MembershipChange] = []

    def record(self, round_index: int, groups: int, k: int, *, recovered: bool, failed: int,
               seconds: float) -> None:
        """A committed sync of round ``round_index`` over ``groups`` live groups and ``k``
        learners: a change (logged by rank 0) when it differs from the last one, was recovered or
        followed ``failed`` discarded attempts; k for the next round's α."""
        last = self.changes[-1] if self.changes else None
        if last is None or (last.groups, last.learners) != (groups, k) or failed or recovered:
            self.changes.append(MembershipChange(round_index, groups, k, recovered, failed, seconds))
            if self.rank == 0:  # one line per group, however many ranks it has
                _log.warning("replica group %s: round %d: %d live group(s), k = %d learners%s%s; "
                             "this sync took %.2f s", self.replica_group, round_index, groups, k,
                             " (recovered z from a peer)" if recovered else "",
                             f" after {failed} discarded all-reduce(s)" if failed else "", seconds)
        self.live_learners = k

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps: k of the last sync (α of the next round) and the changes."""
        return {"live_learners": self.live_learners,
                "membership": [dataclasses.asdict(c) for c in self.changes]}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """Restore ``state_dict()`` (a resumed group's first sync then uses the saved α; a group
        whose peers went on recovers z from them at that sync)."""
        self.live_learners = saved["live_learners"]
        self.changes = [MembershipChange(**c) for c in saved["membership"]]

    def describe(self) -> str:
        """The live membership for the plan summary."""
        name = f"fault-tolerant replica group {self.replica_group!r}" + (
            f" of {self.world_size} processes" if self.world_size > 1 else "")
        if not self.changes:
            return f"{name} (torchft): no sync yet"
        last = self.changes[-1]
        return (f"{name} (torchft): {last.groups} live group(s), k = {last.learners} learners "
                f"(round {last.round_index}); {len(self.changes)} membership change(s)")
