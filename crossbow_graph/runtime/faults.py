"""Numerical faults: NaN or Inf in a replica, found at the local synchronisation (docs/design-overview.md §2).

Before every local update, ``FaultMonitor.find_and_reset`` (called by the scheduler's
``local_update_rows``, in this process or in a worker for its own rows) reduces the replicas'
gradients ``g [r0:r1, P]`` to one sum and tests it with ``isfinite``; only when it is not finite
are the row sums tested, to find the faulty rows (a non-finite element makes its row sum
non-finite; a row sum that overflows float32 means the replica diverged anyway). With the C kernel
backend (runtime/cpu_kernels.py) the rows are tested in C instead, element by element, in one read
of g (a finite row whose sum would overflow is then not faulty). A faulty replica j is reset
from the device's central model before the local update — ``w[j] ← z``, ``v[j] ← 0``,
``g[j] ← 0``, float buffers ``buf[j] ← zbuf`` — so its correction α·(w[j] − z) is exactly zero:
it is left out of the round's sum acc_d, and it starts the next round as a fresh copy of z. After
the update ``reset`` puts it back at z (the zero gradient still met weight decay). The faulty rows
go back to the coordinator, where ``record`` logs each (logger ``crossbow_graph.faults``) and keeps
it in ``events`` (the trainer copies them into ``History.faults``). If every learner of a round is
faulty, ``DivergenceError`` stops training.

By induction w, v and z stay finite: a replica is either healthy (finite w, g ⇒ finite update) or
reset to the finite z, so checking g alone suffices (a replica poisoned from outside, e.g. NaN
weights, yields a non-finite loss and gradient and is caught the same round).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import DivergenceError
from .state import DeviceState

__all__ = ["FaultEvent", "FaultMonitor"]

log = logging.getLogger("crossbow_graph.faults")


@dataclass(kw_only=True)
class FaultEvent:
    """One replica reset because of NaN/Inf.

    Attributes:
        round: the global round index t in which the fault was found.
        device: the device name, e.g. ``"cpu:0"``.
        replica: the replica's index on that device (0 … m−1).
    """

    round: int
    device: str
    replica: int


class FaultMonitor:
    """Finds and contains non-finite replicas; one per Scheduler.

    Attributes:
        events: every FaultEvent so far, in order.
    """

    def __init__(self) -> None:
        self.events: list[FaultEvent] = []
        self._round = -1
        self._faulty_in_round = 0

    @staticmethod
    @torch.no_grad()
    def find_and_reset(state: DeviceState, r0: int, r1: int,
                       max_divergence: float | None = None, kernels: Any = None) -> list[int]:
        """Test replicas ``r0 … r1−1`` of a device before their local update; reset the faulty ones.

        Cost: one reduction over ``g[r0:r1] [n, P]`` to one number and one host read (the row
        sums only when it is not finite). A faulty
        replica gets ``w ← z``, ``v ← 0``, ``g ← 0``, ``buf ← zbuf``, so its correction is zero.
        Worker processes call it for their own rows. With ``max_divergence`` (policies'
        DivergenceGuard) a replica with ‖ŵ_j − z‖/‖z‖ above it, or NaN, is faulty too (one more
        reduction over ``w[r0:r1]``). ``kernels``: the SMA backend; one with ``nonfinite_rows``
        (the C backend) tests the rows in one read of g instead.

        Returns:
            The faulty replicas' indices on the device (empty when all are finite).
        """
        rows_of = getattr(kernels, "nonfinite_rows", None)
        listed = rows_of(state.g[r0:r1]) if rows_of is not None else None
        if max_divergence is None:
            if listed == [] or (listed is None and bool(torch.isfinite(state.g[r0:r1].sum()))):
                return []  # a NaN or Inf anywhere makes the total non-finite: one reduction, one read
        if listed is not None:
            faulty = torch.zeros(r1 - r0, dtype=torch.bool)
            faulty[listed] = True
        else:
            faulty = ~torch.isfinite(state.g[r0:r1].sum(dim=1))  # [n]
        if max_divergence is not None:
            dist = (state.w[r0:r1] - state.z).norm(dim=1)  # [n]
            faulty |= ~(dist <= max_divergence * state.z.norm().clamp_min(1e-12))
        if not bool(faulty.any()):
            return []
        rows = (faulty.nonzero().flatten() + r0).tolist()
        FaultMonitor.reset(state, rows)
        state.g[rows] = 0.0
        return rows

    @staticmethod
    @torch.no_grad()
    def reset(state: DeviceState, rows: list[int]) -> None:
        """Put replicas ``rows`` at the device's z, with zero momentum and the central buffers."""
        if not rows:
            return
        state.w[rows] = state.z
        state.v[rows] = 0.0
        if state.buf.shape[1]:
            state.buf[rows] = state.zbuf

    def record(self, state: DeviceState, rows: list[int], *, round_index: int, num_learners: int) -> None:
        """Log and keep one FaultEvent per faulty replica of ``state`` in round ``round_index``.

        Raises:
            DivergenceError: every one of the round's k learners has been faulty.
        """
        if not rows:
            return
        if round_index != self._round:
            self._round, self._faulty_in_round = round_index, 0
        self._faulty_in_round += len(rows)
        for r in rows:
            self.events.append(FaultEvent(round=round_index, device=state.name, replica=r))
            log.warning("round %d: replica %d on %s has NaN/Inf gradients or diverged; reset from the central "
                        "model z and left out of the round's average", round_index, r, state.name)
        if self._faulty_in_round >= num_learners:
            raise DivergenceError(
                f"training diverged: all {num_learners} replicas have NaN/Inf gradients in round "
                f"{round_index} (last on {state.name}); the central model z and the last checkpoint "
                "are intact. Lower the learning rate, check the loss for log(0) or division by zero "
                "and the data for NaN, then resume from the last checkpoint (fit(..., resume=True))",
                task_id=f"local_sync:{state.name}", device=state.name, round_index=round_index,
            )
