"""The execution backends' protocol, ``Backend``, and a round's values, ``RoundEnv``
(docs/runtime.md, "Backends"; docs/design-overview.md §5)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ContextManager

import torch

if TYPE_CHECKING:
    from .scheduler import Scheduler
    from .state import DeviceState

__all__ = ["Backend", "RoundEnv", "NULL_CONTEXT"]


class _Null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


NULL_CONTEXT = _Null()


@dataclass(eq=False)
class RoundEnv:
    """One round's values, passed from task to task.

    Attributes:
        round_index: the round t.
        batch: the round's samples (``k·b`` rows, or ``DeviceParts``, or a group's rows).
        synchronise: whether the round ends with a synchronisation.
        alpha: α of the round's local updates.
        losses: device → its rows' losses of the round (0-dim tensors; None: not learned).
        accs: device → acc_d ``[P]``, its LOCAL_SYNC's sum of corrections (None: no sync).
        learned: the losses in learning order (the scheduler's epoch list, or a graph's).
        copied: per device, the event after the copy of a batch copied ahead, or None.
    """

    round_index: int
    batch: Any
    synchronise: bool
    alpha: float
    losses: dict[int, list[Any]] = field(default_factory=dict)
    accs: dict[int, torch.Tensor | None] = field(default_factory=dict)
    learned: list[torch.Tensor] = field(default_factory=list)
    copied: list[Any] | None = None

    @classmethod
    def of(cls, round_index: int, batch: Any, synchronise: bool, alpha: float,
           states: list["DeviceState"], learned: list[torch.Tensor]) -> "RoundEnv":
        """A round's environment over ``states``, every row not yet learned."""
        return cls(round_index, batch, synchronise, alpha,
                   losses={d: [None] * s.m for d, s in enumerate(states)}, learned=learned)


class Backend:
    """Runs a Scheduler's rounds (engine/inline.py, stream_backend.py, graphs.py, workers.py);
    these defaults are a host backend's: no streams, nothing in flight between rounds.

    Attributes:
        sched: the Scheduler (what every backend shares: states, program, settings, faults).
    """

    def __init__(self, sched: "Scheduler") -> None:
        self.sched = sched

    def run_round(self, round_index: int, batch: Any, synchronise: bool,
                  indices: torch.Tensor | None, next_indices: torch.Tensor | None) -> None:
        """Run every task of round ``round_index`` (``Scheduler.run_round``'s arguments).

        Raises:
            TaskError: a task failed.
        """
        raise NotImplementedError

    def prefetch(self, round_index: int, indices: torch.Tensor) -> None:
        """Start loading round ``round_index``'s batch early (nothing here)."""

    def flush(self) -> None:
        """Complete the work in flight (nothing here)."""

    def join(self) -> None:
        """Order the caller's stream after the work so far (nothing here)."""

    def finish(self) -> None:
        """End of a fit: ``flush``, and every fault still to record is recorded."""
        self.flush()

    def close(self) -> None:
        """Release what the backend holds (processes, streams); it may run rounds again."""

    @property
    def learning_ahead(self) -> bool:
        """Whether the next round's learning is in flight."""
        return False

    @property
    def cuda_streams(self) -> Any:
        """The CudaStreams the rounds run on, or None."""
        return None

    def on_stream(self, kind: str, label: Any, d: int = 0, r0: int = 0) -> ContextManager:
        """The context issuing a task's work of ``kind`` on its stream (none here)."""
        return NULL_CONTEXT

    def graph_hyper(self, state: "DeviceState") -> Any:
        """In a CUDA-graph round's body, the device's ``DeviceHyper``, else None."""
        return None

    def share_faults(self, count: torch.Tensor) -> None:
        """Under torchrun, after the all-reduce: ``count`` (1 element) is the ranks' number of
        fault events not yet shared; share them now if it is > 0 (``FaultMonitor.share``)."""
        sched = self.sched
        if count.item() > 0:
            sched.faults.share(sched.comm, sched.round_index, sched.num_learners, sched.states[0].z)
