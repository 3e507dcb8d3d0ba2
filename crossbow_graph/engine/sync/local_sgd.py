"""Local SGD: periodic model averaging (Stich 2019, "Local SGD Converges Fast and Communicates
Little"; PyTorch's ``PeriodicModelAverager``; torchft's ``LocalSGD``; docs/design-overview.md §2)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ...errors import is_count
from ._reduce import restart_from_z
from .base import SyncAlgorithm, SyncContext, SyncRound, SyncState

if TYPE_CHECKING:
    from ..state.flat import DeviceState

__all__ = ["LocalSGD"]


@dataclass(frozen=True, kw_only=True)
class LocalSGD(SyncAlgorithm):
    """Local SGD: every H rounds, after the learners' steps, z ← (1/k)·Σ_j w_j over all k learners
    (every process) and every replica restarts from z (w_j ← z), its optimizer state kept; in
    between each learner takes its own optimizer's steps alone (α = 0). Float buffers are
    averaged into the central buffers and stay per replica. It is DiLoCo with an outer SGD of
    lr 1 and no momentum, without the outer optimizer. It runs on the inline executor.

    Attributes:
        sync_every: H, rounds between averagings (an integer ≥ 1).

    Raises:
        ValueError: ``sync_every`` not an integer ≥ 1."""

    sync_every: int

    def __post_init__(self) -> None:
        if not is_count(self.sync_every):
            raise ValueError(f"LocalSGD(sync_every={self.sync_every!r}): H, rounds between "
                             "averagings, must be an integer ≥ 1, e.g. sync_every=16")

    def with_alpha(self, alpha: float | None) -> "LocalSGD":
        raise ValueError(f"alpha={alpha!r} with sync=LocalSGD(...): local SGD pulls no replica "
                         "toward z (α = 0); z is the replicas' mean every H rounds")

    def local_update(self, ctx: SyncContext, env: SyncRound, state: DeviceState, r0: int, r1: int,
                     *, losses: list[torch.Tensor] | None = None,
                     out: torch.Tensor | None = None) -> tuple[torch.Tensor | None, Any]:
        """The learners' local steps (no correction); in a round that synchronises the rows'
        Σ_j w_j ``[P]`` after them."""
        acc, faulty = super().local_update(ctx, env, state, r0, r1, losses=losses, out=out)
        if env.synchronise:
            acc = state.w[r0:r1].sum(dim=0)  # [P]
        return acc, faulty

    @torch.no_grad()
    def global_update(self, ctx: SyncContext, env: SyncRound, accs: list[torch.Tensor],
                      bufs: list[torch.Tensor]) -> None:
        """z ← Σ_d acc_d / k (all-reduced under torchrun), z_prev ← the old z, the devices copy
        z, every replica restarts from z; float buffers averaged into zbuf."""
        s0 = ctx.states[0]
        summed = ctx.transport.sum(accs, bufs, env)
        s0.z_prev.copy_(s0.z)
        s0.z.copy_(torch.div(summed.total, summed.k))
        restart_from_z(ctx.states, summed.mean_buf)

    def summary_rule(self, num_learners: int, sync_state: SyncState | None = None) -> str:
        return f"LocalSGD(z ← mean w, every {self.sync_every} round(s))"

    def short_fit_warning(self, rounds: int, rounds_done: int) -> str | None:
        return self._fewer_rounds_than_h(rounds, rounds_done, "is never averaged")
