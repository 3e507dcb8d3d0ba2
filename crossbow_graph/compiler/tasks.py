"""The closed task vocabulary of a plan (docs/design-overview.md §3): every field of a Task, and
what it means for each kind, is documented here and nowhere else."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

__all__ = ["TaskKind", "Task", "Cost"]


class TaskKind(enum.Enum):
    """What a task does in one round. Every Task field, by kind:

    =========== ====================== ================================ ================================
    kind        ``device``             ``replicas``                     reads → writes
    =========== ====================== ================================ ================================
    LEARN       the replica's device   one global replica index j       ``w[j]``, batch → ``g[j]``
    LOCAL_SYNC  the device it reduces  a contiguous run of its replicas ``w, v, g, z`` → ``w, v, acc_d``
    GLOBAL_SYNC ``None`` (all devices) every replica                    every ``acc_d``, ``z`` → ``z``
    =========== ====================== ================================ ================================

    The steps: docs/design-overview.md §2; how the backends run a graph: docs/runtime.md."""

    LEARN = "learn"
    LOCAL_SYNC = "local_sync"
    GLOBAL_SYNC = "global_sync"


@dataclass(kw_only=True)
class Cost:
    """A task's cost per round: ``flops`` (multiply-add = 2), ``bytes`` read plus written."""

    flops: int = 0
    bytes: int = 0


@dataclass(kw_only=True)
class Task:
    """One node of the task graph of a round.

    Attributes:
        id: unique, readable name (``"learn:d0:r1"``, ``"local_sync:d1"``, ``"global_sync"``).
        kind: the TaskKind (its docstring gives each field's meaning per kind).
        device: the device name (``"cpu:0"``, ``"cuda:1"``), ``None`` for GLOBAL_SYNC.
        replicas: global replica indices j this task touches (device-major order).
        cost: the cost estimate (shown by ``summary`` and the JSON; not read by the executors).
        meta: extra data that compiler passes attach (never new fields)."""

    id: str
    kind: TaskKind
    device: str | None
    replicas: tuple[int, ...]
    cost: Cost = field(default_factory=Cost)
    meta: dict[str, Any] = field(default_factory=dict)
