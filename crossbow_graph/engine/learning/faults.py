"""Numerical faults: NaN or Inf in a replica, found at the local synchronisation, the replica
reset from z (docs/reliability.md, "Numerical faults"; docs/design-overview.md §2)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from collections import Counter
from typing import Any, Callable, Sequence

import torch

from ...errors import DivergenceError
from ...kernels.protocol import SMAKernels
from ..state.flat import DeviceState

__all__ = ["FaultEvent", "FaultMonitor"]

log = logging.getLogger("crossbow_graph.faults")


@dataclass(kw_only=True)
class FaultEvent:
    """One replica reset because of a NaN/Inf loss or gradient (or divergence from z).

    Attributes:
        round: the global round index t in which the fault was found.
        device: the device name, e.g. ``"cpu:0"``.
        replica: the replica's index on that device (0 … m−1).
        rank: the torchrun rank of the replica's process (0 in a single process)."""

    round: int
    device: str
    replica: int
    rank: int = 0


class FaultMonitor:
    """Finds and contains non-finite replicas; one per plan's engine.

    Attributes:
        events: every FaultEvent since the plan's task graph was last made, in order (under
            torchrun this rank's as they are found, the other ranks' as they are shared).
        pending: this rank's events not yet shared with the other ranks (torchrun only)."""

    def __init__(self) -> None:
        self.events: list[FaultEvent] = []
        self.pending: list[FaultEvent] = []
        self._taken = 0  # events handed out by ``take_new``
        self._streak = _Streak()  # this process's replicas
        self._shared = _Streak()  # every rank's, under torchrun

    def new_plan(self) -> None:
        """A new task graph: its events start afresh; this rank's unshared ones go on."""
        self.events, self._taken = [], 0
        self._streak, self._shared = _Streak(), _Streak()

    def take_new(self) -> list[FaultEvent]:
        """The events recorded since the last call (a round's result)."""
        new = self.events[self._taken:]
        self._taken = len(self.events)
        return new

    def restore(self, events: list[FaultEvent]) -> None:
        """The events of a checkpoint, as handed out already."""
        self.events, self._taken = list(events), len(events)

    @staticmethod
    def find(state: DeviceState, r0: int, r1: int, *, max_divergence: float | None,
             kernels: SMAKernels, losses: Sequence[torch.Tensor] | None,
             on_device: bool) -> list[int] | torch.Tensor:
        """``find_and_reset`` (the faulty rows' indices), or with ``on_device``
        ``find_and_reset_masked`` (their mask ``[r1 − r0]`` on the device, no host read)."""
        if on_device:
            return FaultMonitor.find_and_reset_masked(state, r0, r1, max_divergence, losses)
        return FaultMonitor.find_and_reset(state, r0, r1, max_divergence, kernels, losses)

    @staticmethod
    def reset_found(state: DeviceState, r0: int, faulty: list[int] | torch.Tensor) -> None:
        """Reset again the rows ``find`` found (after a step that moved them): ``reset`` of the
        indices, or ``reset_masked`` of the mask from row ``r0``."""
        if isinstance(faulty, list):
            FaultMonitor.reset(state, faulty)
        else:
            FaultMonitor.reset_masked(state, r0, faulty)

    @staticmethod
    @torch.no_grad()
    def find_and_reset(state: DeviceState, r0: int, r1: int,
                       max_divergence: float | None = None, kernels: SMAKernels | None = None,
                       losses: Sequence[torch.Tensor] | None = None) -> list[int]:
        """Test replicas ``r0 … r1−1`` (NaN/Inf in ``g[r0:r1] [n, P]`` or in ``losses``, n 0-dim
        tensors; ‖ŵ_j − z‖/‖z‖ above ``max_divergence``) and reset the faulty ones from z
        (docs/reliability.md, "Numerical faults"). ``kernels``: its ``nonfinite_rows``, if
        any, tests the rows.

        Returns:
            The faulty replicas' indices on the device (empty when all are finite)."""
        listed = kernels.nonfinite_rows(state.g[r0:r1]) if kernels is not None else None
        loss = torch.stack(list(losses)).float() if losses else None  # [n]
        if max_divergence is None:
            if listed is None:
                total = state.g[r0:r1].sum() if loss is None else state.g[r0:r1].sum() + loss.sum()
                if bool(torch.isfinite(total)):  # a NaN or Inf anywhere makes it non-finite
                    return []
            elif listed == [] and (loss is None or bool(torch.isfinite(loss.sum()))):
                return []
        if listed is not None:
            faulty = torch.zeros(r1 - r0, dtype=torch.bool)
            faulty[listed] = True
        else:
            faulty = ~torch.isfinite(state.g[r0:r1].sum(dim=1))  # [n]
        if loss is not None:
            faulty |= ~torch.isfinite(loss).to(faulty.device)
        if max_divergence is not None:
            faulty |= _far_from_z(state, r0, r1, max_divergence)
        if not bool(faulty.any()):
            return []
        rows = (faulty.nonzero().flatten() + r0).tolist()
        FaultMonitor.reset(state, rows)
        state.g[rows] = 0.0
        return rows

    @staticmethod
    @torch.no_grad()
    def find_and_reset_masked(state: DeviceState, r0: int, r1: int,
                              max_divergence: float | None = None,
                              losses: Sequence[torch.Tensor] | None = None) -> torch.Tensor:
        """``find_and_reset`` without a host read (CUDA streams, graphs): the same rows and values,
        but a row optimizer's state (``reset_masked``).

        Returns:
            The faulty rows' mask ``[n]`` bool, on the device (the caller reads it a round late)."""
        g = state.g[r0:r1]
        bad = ~torch.isfinite(g.sum(dim=1))  # [n]
        if losses:
            bad |= ~torch.isfinite(torch.stack(list(losses)).float()).to(bad.device)
        if max_divergence is not None:
            bad |= _far_from_z(state, r0, r1, max_divergence)
        FaultMonitor.reset_masked(state, r0, bad)
        g.masked_fill_(bad[:, None], 0.0)
        return bad

    @staticmethod
    @torch.no_grad()
    def reset_masked(state: DeviceState, r0: int, bad: torch.Tensor) -> None:
        """``reset`` of the rows ``r0 + i`` where ``bad [n]`` is True, without a host read; a row
        optimizer's state is made fresh when the host reads the mask, a round later."""
        r1 = r0 + len(bad)
        keep = ~bad[:, None]
        w = state.w[r0:r1]
        torch.where(keep, w, state.z, out=w)
        state.v[r0:r1].masked_fill_(bad[:, None], 0.0)
        if state.buf.shape[1]:
            buf = state.buf[r0:r1]
            torch.where(keep, buf, state.zbuf, out=buf)

    @staticmethod
    @torch.no_grad()
    def reset(state: DeviceState, rows: list[int]) -> None:
        """Put replicas ``rows`` at the device's z, with zero momentum (a row optimizer's state
        fresh: engine/state/optim.py) and the central buffers."""
        if not rows:
            return
        state.w[rows] = state.z
        state.v[rows] = 0.0
        if state.optim_rows is not None:
            state.optim_rows.reset(rows)
        if state.buf.shape[1]:
            state.buf[rows] = state.zbuf

    def record(self, state: DeviceState, rows: list[int], *, round_index: int, num_learners: int,
               rank: int | None = None,
               settled_z: Callable[[], torch.Tensor] | None = None) -> None:
        """Log and keep one FaultEvent per faulty replica of ``state`` in round ``round_index``.

        ``rank``: this process's torchrun rank, None in a single process. Under torchrun the
        events are also kept in ``pending`` until ``share`` and the messages name the rank.
        ``settled_z``: returns ``state.z`` once no stream writes it any more (CUDA streams), for
        the DivergenceError's finiteness check; default ``state.z`` as it is.

        Raises:
            DivergenceError: as ``_Streak`` finds, of this process's learners (under torchrun
                ``share`` counts every rank's)."""
        if not rows:
            return
        where = _where(state.name, rank)
        for r in rows:
            event = FaultEvent(round=round_index, device=state.name, replica=r, rank=rank or 0)
            self.events.append(event)
            if rank is not None:
                self.pending.append(event)
            log.warning(_FAULT, round_index, r, where)
        rounds = self._streak.add(round_index, [(state.name, r) for r in rows], num_learners)
        if rounds:
            raise _diverged(num_learners, rounds, f"last on {where}",
                            settled_z or state.z, task_id=f"local_sync:{state.name}",
                            device=state.name, round_index=round_index)

    def share(self, comm: Any, round_index: int, num_learners: int,
              z: torch.Tensor | Callable[[], torch.Tensor]) -> None:
        """Under torchrun, every rank in the same round: every rank's ``pending`` events reach
        every rank (one all-gather over ``comm``) and join ``events``. ``z [P]`` (or a function
        returning it): its finiteness goes in a DivergenceError's message.

        Raises:
            DivergenceError: on every rank alike, as ``_Streak`` finds over every rank's
                learners; before z is updated.
            DistributedError: a peer died or did not answer."""
        gathered = comm.all_gather_object(self.pending, "the all-gather of the ranks' faults",
                                          round_index)
        self.pending = []
        for r, events in enumerate(gathered):
            if r == comm.rank:
                continue
            self.events.extend(events)
            for e in events if comm.is_main else ():
                log.warning(_FAULT, e.round, e.replica, _where(e.device, e.rank))
        by_round: dict[int, list[tuple]] = {}
        for events in gathered:
            for e in events:
                by_round.setdefault(e.round, []).append((e.rank, e.device, e.replica))
        for t in sorted(by_round):
            rounds = self._shared.add(t, by_round[t], num_learners)
            if rounds:
                ranks = ", ".join(str(r) for r in sorted(self._shared.ranks()))
                raise _diverged(num_learners, rounds, f"on ranks {ranks}", z,
                                task_id="global_sync", device=f"rank {comm.rank}", round_index=t)


class _Streak:
    """The faults of a run of rounds that each had one (every round tests): diverged when all k
    learners fail in one round, or each twice in the run (reset from z and faulty again)."""

    def __init__(self) -> None:
        self.rounds: dict[int, set] = {}  # round → the learner ids faulty in it
        self.times: Counter = Counter()  # learner id → its faults in the run

    def add(self, round_index: int, learners: list[tuple], num_learners: int) -> str | None:
        """Round ``round_index``'s faulty ``learners`` (ids); where it diverged, or None."""
        if self.rounds and not min(self.rounds) - 1 <= round_index <= max(self.rounds) + 1:
            self.rounds, self.times = {}, Counter()
        now = self.rounds.setdefault(round_index, set())
        for learner in set(learners) - now:
            now.add(learner)
            self.times[learner] += 1
        if len(now) >= num_learners:
            return f"in round {round_index}"
        if len(self.times) >= num_learners and min(self.times.values()) >= 2:
            return (f"in rounds {min(self.rounds)}–{max(self.rounds)}, twice each with no round "
                    "free of faults between: each reset from z and faulty again")
        return None

    def ranks(self) -> set[int]:  # of ``share``'s ids: (rank, device, replica)
        return {learner[0] for learner in self.times}


def _far_from_z(state: DeviceState, r0: int, r1: int, max_divergence: float) -> torch.Tensor:
    """Rows r0 … r1−1 with ‖ŵ_j − z‖ > max_divergence · ‖z‖, or NaN, ``[n]`` bool on the device."""
    dist = (state.w[r0:r1] - state.z).norm(dim=1)  # [n]
    return ~(dist <= max_divergence * state.z.norm().clamp_min(1e-12))


_FAULT = ("round %d: replica %d on %s has NaN/Inf gradients or loss, or diverged; reset from the "
          "central model z and left out of the round's average")


def _where(device: str, rank: int | None) -> str:
    """``"cpu:0"`` in a single process, ``"cpu:0 of rank 1"`` under torchrun."""
    return device if rank is None else f"{device} of rank {rank}"


def _diverged(num_learners: int, rounds: str, where: str,
              z: torch.Tensor | Callable[[], torch.Tensor], *, task_id: str, device: str,
              round_index: int) -> DivergenceError:
    """The DivergenceError of round ``round_index`` (``rounds``: where, in words); it says
    whether ``z [P]`` (or what the function ``z`` returns) is finite (every replica is reset to
    z, so a non-finite z makes every learner fail)."""
    if callable(z):
        z = z()
    bad = int((~torch.isfinite(z)).sum())  # one read, on the way out
    if bad:
        state = (f"the central model z itself holds NaN/Inf ({bad} of {z.numel()} values), so "
                 "every replica reset to it fails too: something wrote NaN/Inf into z (a hook, a "
                 "policy or, under torchrun, another rank's z through the global sync; "
                 "Distributed(checksum_every=1) finds the round). Resume from a checkpoint whose "
                 "z is finite (fit(..., resume=True) takes the newest: move newer ones away)")
    else:
        state = ("the central model z is finite. Lower the learning rate (compile the plan "
                 "again with a lower lr: a resumed fit keeps the values it was set up with where "
                 "they differ from the checkpoint's run), check the loss for log(0) or division "
                 "by zero and the data for NaN, then resume (fit(..., resume=True) continues "
                 "from the newest healthy checkpoint)")
    return DivergenceError(
        f"training diverged: all {num_learners} replicas have NaN/Inf gradients {rounds} "
        f"(or a NaN/Inf loss, or diverged; {where}); {state}",
        task_id=task_id, device=device, round_index=round_index,
    )
