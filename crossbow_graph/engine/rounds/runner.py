"""``RoundRunner``: what a fit uses of the engine that runs a plan's rounds (the Scheduler is
one; training/fit_plan.py names it) (docs/design-overview.md §1, §5)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import networkx as nx
import torch

from .context import FitRun, SyncClock
from .env import RoundResult

if TYPE_CHECKING:
    from ..learning.faults import FaultEvent
    from ..sync.base import SyncState
    from ..transport.transports import Transport

__all__ = ["RoundRunner"]


class RoundRunner(Protocol):
    """The rounds of one plan, as a fit drives them.

    Attributes:
        clock: the synchronisation seconds so far (and the rounds learned ahead).
        fault_masks: per device, its last local sync's fault mask on the device (streams), or None.
        learning_ahead: whether the next round's learning is in flight (worker processes).
        sync_state: the sync algorithm's runtime state (DiLoCo's outer optimizer).
        transport: how the global sync's sums cross devices and processes."""

    clock: SyncClock
    fault_masks: list[torch.Tensor | None]
    learning_ahead: bool
    sync_state: SyncState
    transport: Transport

    def graph_record(self) -> dict[str, Any] | None:
        """The CUDA-graph rounds so far, or None without them."""

    def begin_fit(self, fit: FitRun) -> None:
        """A fit starts: its data functions, seed, clipping and timeline."""

    def run_round(self, round_index: int, batch: Any = None, *, synchronise: bool,
                  indices: torch.Tensor | None = None,
                  next_indices: torch.Tensor | None = None) -> RoundResult:
        """Run one round (its indices ``[k·b]``) and return its result."""

    def collect(self) -> tuple[list[FaultEvent], list[Any]]:
        """The fault events and membership changes found since the last result."""

    def share_last_faults(self, round_index: int) -> None:
        """Under torchrun at a fit's end: the faults since the last global sync to every rank."""

    def prefetch(self, round_index: int, indices: torch.Tensor, b: int) -> None:
        """Load the next round's batch now and copy it to the devices ahead (where it can)."""

    def flush(self) -> None:
        """Complete the work in flight (the host sees every round so far)."""

    def join(self) -> None:
        """Order the caller's stream after the work so far, without a host wait."""

    def end_fit(self) -> None:
        """The fit ends: the work in flight completes, worker processes stop."""

    def close_workers(self) -> None:
        """Stop the worker processes (they restart at the next round)."""

    def reset_replicas(self, rows: list[list[int]], *, round_index: int | None = None) -> None:
        """Put the replicas ``rows`` (per device) at z; with ``round_index`` as its faults."""

    def set_max_divergence(self, value: float | None) -> None:
        """The fault test's divergence threshold from the next round on (None: off)."""

    def set_task_graph(self, task_graph: nx.DiGraph) -> None:
        """Run a re-planned task graph from the next round on."""

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of the rounds' records."""

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """Restore ``state_dict()``."""
