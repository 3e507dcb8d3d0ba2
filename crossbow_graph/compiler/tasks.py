"""The closed task vocabulary of a plan (docs/design-overview.md §3)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

__all__ = ["TaskKind", "Task", "Cost"]


class TaskKind(enum.Enum):
    """What a task does in one round. Every Task field, by kind:

    ========== ======================== ======================================== ==========================
    kind       ``device``               ``replicas``                             ``inputs`` → ``outputs``
    ========== ======================== ======================================== ==========================
    LEARN      the replica's device     one global replica index j               ``w[j]``, batch → ``g[j]``
    LOCAL_SYNC the device it reduces    every replica j on that device           ``w, v, g, z`` → ``w, v, acc_d``
    GLOBAL_SYNC ``None`` (all devices)  every replica                            every ``acc_d``, ``z`` → ``z``
    ========== ======================== ======================================== ==========================

    LEARN: forward, backward (gradients into the device's flat ``g [m, P]``).
    LOCAL_SYNC: the local SGD step and the correction c_j = α(ŵ_j − z) of every replica on the
    device, and their sum acc_d (docs/design-overview.md §2, steps 1–2).
    GLOBAL_SYNC: C = Σ_d acc_d (all-reduce) and the central update of z on every device (step 3).
    """

    LEARN = "learn"
    LOCAL_SYNC = "local_sync"
    GLOBAL_SYNC = "global_sync"


@dataclass(kw_only=True)
class Cost:
    """A task's cost estimate, per round.

    Attributes:
        flops: floating-point operations (multiply-add = 2).
        bytes: bytes read plus written in memory.
        seconds: measured seconds per round, ``None`` until measured.
    """

    flops: int = 0
    bytes: int = 0
    seconds: float | None = None


@dataclass(kw_only=True)
class Task:
    """One node of the task graph of a round.

    Attributes:
        id: unique, readable name, e.g. ``"learn:d0:r1"``, ``"local_sync:d1"``, ``"global_sync"``.
        kind: the TaskKind (closed vocabulary; see its docstring for each field's meaning).
        device: the device name (``"cpu:0"``, ``"cuda:1"``), ``None`` for GLOBAL_SYNC.
        replicas: global replica indices j this task touches (device-major order).
        inputs: names of the buffers it reads.
        outputs: names of the buffers it writes.
        cost: the cost estimate.
        meta: extra data that compiler passes attach (never new fields).
    """

    id: str
    kind: TaskKind
    device: str | None
    replicas: tuple[int, ...]
    inputs: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ()
    cost: Cost = field(default_factory=Cost)
    meta: dict[str, Any] = field(default_factory=dict)
