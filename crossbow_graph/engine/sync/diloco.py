"""DiLoCo: local training with an outer optimizer over z every H rounds (Douillard et al. 2023,
Algorithm 1; docs/design-overview.md §2, "Outer optimizers"; torchft's ``DiLoCo``)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch

from ...compiler.inspect import optimizer_text
from ...errors import is_count
from ._reduce import restart_from_z
from .base import SyncAlgorithm, SyncContext, SyncRound, SyncState
from .outer import OuterOptimizer

if TYPE_CHECKING:
    from ..state.flat import DeviceState

__all__ = ["DiLoCo", "DILOCO_OUTER"]

#: DiLoCo's outer optimizer (Douillard et al. 2023, §2): Nesterov SGD, lr 0.7, momentum 0.9.
DILOCO_OUTER = functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)


@dataclass(frozen=True, kw_only=True)
class DiLoCo(SyncAlgorithm):
    """DiLoCo: local training with an outer optimizer over z every H rounds (Douillard et al.
    2023, "DiLoCo: Distributed Low-Communication Training of Language Models", Algorithm 1;
    docs/design-overview.md §2, "Outer optimizers").

    Every H-th round: Δ = z − (1/k)·Σ_j w_j, ``z.grad = Δ; outer.step()``, then w_j ← z (each
    replica keeps its optimizer state); between them the replicas step alone (α = 0).

    Attributes:
        sync_every: H, rounds between outer steps (an integer ≥ 1).
        outer_optimizer: a callable that builds a ``torch.optim.Optimizer`` from a list of
            parameters; it is called once, by ``compile`` (``bind``), with ``[z]`` (a leaf
            tensor ``[P]`` sharing the first device's central model). Default: Nesterov SGD,
            lr 0.7, momentum 0.9 (``DILOCO_OUTER``); ``functools.partial(torch.optim.SGD,
            lr=1.0)`` is local SGD (periodic model averaging, ``LocalSGD`` up to rounding).

    Raises:
        ValueError: ``sync_every`` not an integer ≥ 1.
        TypeError: ``outer_optimizer`` not callable, or an optimizer instance instead of a
            factory (``compile`` raises TypeError/ValueError when calling it fails or does not
            return a torch.optim optimizer over ``[z]``)."""

    sync_every: int
    outer_optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer] = DILOCO_OUTER

    def __post_init__(self) -> None:
        if not is_count(self.sync_every):
            raise ValueError(f"DiLoCo(sync_every={self.sync_every!r}): H, rounds between outer "
                             "steps, must be an integer ≥ 1, e.g. sync_every=16")
        factory = self.outer_optimizer
        if isinstance(factory, torch.optim.Optimizer):
            raise TypeError(f"DiLoCo(outer_optimizer={type(factory).__name__}(...)): pass a "
                            "factory that builds the optimizer from z's parameters, not an "
                            "optimizer, e.g. functools.partial(torch.optim.SGD, lr=0.7, "
                            "momentum=0.9, nesterov=True)")
        if not callable(factory):
            raise TypeError(f"DiLoCo(outer_optimizer={factory!r}): must be callable as "
                            "outer_optimizer(params) -> torch.optim.Optimizer, e.g. "
                            "functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)")

    def with_alpha(self, alpha: float | None) -> "DiLoCo":
        raise ValueError(f"alpha={alpha!r} with sync=DiLoCo(...): DiLoCo pulls no replica "
                         "toward z (α = 0); its outer optimizer moves z every H rounds")

    def bind(self, states: list[DeviceState]) -> OuterOptimizer:
        """The outer optimizer over the first device's z (raises TypeError, ValueError:
        ``OuterOptimizer``)."""
        return OuterOptimizer(self.outer_optimizer, states[0].z)

    def local_update(self, ctx: SyncContext, env: SyncRound, state: DeviceState, r0: int, r1: int,
                     *, losses: list[torch.Tensor] | None = None,
                     out: torch.Tensor | None = None) -> tuple[torch.Tensor | None, Any]:
        """The learners' local steps (no correction); in a round that synchronises the rows'
        Σ_j (w_j − z) ``[P]`` after them."""
        acc, faulty = super().local_update(ctx, env, state, r0, r1, losses=losses, out=out)
        if env.synchronise:
            acc = torch.sub(state.w[r0:r1], state.z).sum(dim=0)  # [P]
        return acc, faulty

    @torch.no_grad()
    def global_update(self, ctx: SyncContext, env: SyncRound, accs: list[torch.Tensor],
                      bufs: list[torch.Tensor]) -> None:
        """Σ_d acc_d (all-reduced under torchrun: the same Δ on every rank, the same outer
        state) gives Δ = z − mean_j w_j = −Σ/k; the outer optimizer steps z with it, z_prev ←
        the old z, the devices copy z, every replica restarts from z with its optimizer state
        kept; float buffers averaged into zbuf. With one learner it is the same (Δ = z − w_0)."""
        s0 = ctx.states[0]
        summed = ctx.transport.sum(accs, bufs, env)
        s0.z_prev.copy_(s0.z)
        ctx.state.step(s0.z, torch.div(summed.total, -summed.k))  # Δ [P]
        restart_from_z(ctx.states, summed.mean_buf)

    def describe(self, sync_state: SyncState | None = None) -> dict[str, Any]:
        """H and the outer optimizer's class and groups (its factory, a callable, is not data)."""
        return {"name": "DiLoCo", "sync_every": self.sync_every,
                "outer_optimizer": sync_state.describe() if sync_state is not None else None}

    def summary_rule(self, num_learners: int, sync_state: SyncState | None = None) -> str:
        outer = (sync_state.describe() if sync_state is not None else None) or {}
        return (f"DiLoCo(outer {optimizer_text(outer)} on Δ = z − mean w, every "
                f"{self.sync_every} round(s))")

    def short_fit_warning(self, rounds: int, rounds_done: int) -> str | None:
        return self._fewer_rounds_than_h(rounds, rounds_done, "gets no outer step")
