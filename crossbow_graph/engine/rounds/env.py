"""A round's environment and its result: every value a round needs, read once from the run
settings as the round starts, passed from task to task as torch.fx's Interpreter passes ``env``
(``RoundEnv``); what a round hands back (``RoundResult``) (docs/design-overview.md §5)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from ..learning.faults import FaultEvent
    from ..state.hyper import Hyper
    from ..sync.base import SyncAlgorithm

__all__ = ["RoundEnv", "RoundResult"]


@dataclass(eq=False)
class RoundEnv:
    """One round's values (what ``SyncRound`` names is what the sync algorithms read).

    Attributes:
        round_index: the round t.
        batch: the round's samples (``k·b`` rows, or ``DeviceParts``, or a group's rows).
        synchronise: whether the round ends with a synchronisation.
        k: the learners of every process; b: samples per learner; learner_mode: the learners'.
        sync: the sync algorithm in force (its α and τ).
        hyper: the round's hyper-parameters, one snapshot (``Hyper``: η per param group, μ_l,
            λ, α, μ_z); in a CUDA graph's body their device tensors.
        max_divergence: ‖ŵ_j − z‖/‖z‖ above which a replica is reset (None: off).
        on_device: faults are found without a host read (CUDA streams and graphs).
        losses: device → its rows' losses of the round (0-dim tensors; None: not learned).
        accs: device → acc_d ``[P]``, its LOCAL_SYNC's accumulator (None: no sync).
        learned: the losses in learning order (what the round hands back).
        copied: per device, the event after the copy of a batch copied ahead, or None."""

    round_index: int
    batch: Any
    synchronise: bool
    k: int
    b: int
    learner_mode: str
    sync: SyncAlgorithm
    hyper: Hyper
    max_divergence: float | None = None
    on_device: bool = False
    losses: dict[int, list[Any]] = field(default_factory=dict)
    accs: dict[int, torch.Tensor | None] = field(default_factory=dict)
    learned: list[torch.Tensor] = field(default_factory=list)
    copied: list[Any] | None = None

    @property
    def alpha(self) -> float:
        """α of the round's local updates (``hyper.alpha``)."""
        return self.hyper.alpha

    def unlearned(self, replicas: list[int]) -> "RoundEnv":
        """This environment with every row of devices holding ``replicas`` rows not yet learned
        (its own ``losses``)."""
        self.losses = {d: [None] * m for d, m in enumerate(replicas)}
        return self


@dataclass
class RoundResult:
    """What a round hands back (``Scheduler.run_round``).

    Attributes:
        losses: the learners' losses of the round, in learning order (0-dim tensors).
        faults: the fault events found while it ran (on CUDA streams those of the round before,
            read a round late), in order.
        membership: the changes of the replica groups' membership its global sync saw (torchft)."""

    losses: list[torch.Tensor]
    faults: list[FaultEvent]
    membership: list[Any]
