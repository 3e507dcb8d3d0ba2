"""The protocol every synchronisation algorithm implements, ``SyncAlgorithm``; what the engine
gives it once per plan, ``SyncContext``, and once per round, ``SyncRound`` (the round's
environment); the per-plan runtime state it binds, ``SyncState`` (docs/design-overview.md §2,
"Where the algorithms live")."""

from __future__ import annotations

import abc
import dataclasses
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch

from ..learning.faults import FaultMonitor

if TYPE_CHECKING:
    from ...kernels.protocol import SMAKernels
    from ..state.flat import DeviceState
    from ..state.hyper import Hyper
    from ..state.optim import LocalOptimizer
    from ..transport.transports import Transport

__all__ = ["SyncAlgorithm", "SyncContext", "SyncRound", "SyncState", "single_learner_central"]


class SyncRound(Protocol):
    """What an algorithm reads of a round (the engine's ``RoundEnv``, engine/rounds/env.py)."""

    round_index: int
    k: int  # the learners of every process
    synchronise: bool  # the round ends with a global sync
    alpha: float  # α of the round's local updates (``hyper.alpha``)
    hyper: Hyper  # the round's hyper-parameters (η, μ_l, λ, α, μ_z): one snapshot
    max_divergence: float | None  # ‖ŵ_j − z‖/‖z‖ above which a replica is reset (None: off)
    on_device: bool  # find faulty rows without a host read (CUDA streams and graphs)


@dataclasses.dataclass(frozen=True, eq=False)
class SyncContext:
    """What an algorithm's updates use of the plan, given once: ``states`` (one DeviceState per
    device: w, v, g ``[m, P]``, z, z_prev ``[P]``, buf ``[m, Q]``, zbuf ``[Q]``), ``kernels``
    (``SMAKernels``), ``optimizer`` (the ``LocalOptimizer``: which step runs; its settings in
    force come with the round, ``SyncRound.hyper``), ``transport`` (how sums cross devices and
    processes, engine/transport/transports.py) and ``state`` (the algorithm's ``SyncState``)."""

    states: list[DeviceState]
    kernels: SMAKernels
    optimizer: LocalOptimizer
    transport: Transport
    state: SyncState


class SyncState:
    """An algorithm's runtime state for one plan (``SyncAlgorithm.bind``); this one holds none.
    ``state_class``: the ``"class"`` of a checkpoint's ``"outer_optimizer"`` entry, None: none."""

    state_class: str | None = None

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The settings groups a resumed fit may choose anew (training/run_setup.py): none."""
        return []

    def state_dict(self) -> dict[str, Any]:
        """The state as CPU tensors and plain values (a checkpoint's entry)."""
        return {}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """Restore ``state_dict()``; ValueError when it does not fit."""

    def describe(self) -> dict[str, Any] | None:
        """The state's settings as plain data (inspection, the torchrun agreement), or None."""
        return None


class SyncAlgorithm(abc.ABC):
    """One synchronisation algorithm: its settings (a frozen dataclass's fields) and its work.

    Class attributes:
        executors: the executors it runs on (``"inline"``, ``"process"``); ``executor="auto"``
            picks the process executor only when it is among them.
        waits_for_global: on CUDA streams, a learner group's next round waits for the previous
            global sync (it writes every replica), not only for its own device's local sync.
        cuda_graphs: a CUDA graph may capture its rounds (its global sync reads nothing on the
            host and writes only z).
        adjustable: the settings ``Plan.adjust`` may change (``"alpha"``, ``"sync_every"``):
            ``with_alpha`` and ``with_sync_every`` raise ValueError for the others.
        alpha: α as set (None: the algorithm's default rule at each k); None for an algorithm
            without α.
        central_momentum: μ_z of the central update (0 where z moves otherwise).
        fault_tolerant: its global sync runs over torchft's replica groups
            (``Distributed(fault_tolerant=True)``, engine/transport/ft.py): its sum's k (the live
            groups' learners, ``Summed.k``) may differ from the round's.
        across_processes: it runs under torchrun (its global sum crosses the ranks).

    Attributes:
        sync_every: τ (or H), rounds between synchronisations (≥ 1)."""

    executors: ClassVar[tuple[str, ...]] = ("inline",)
    waits_for_global: ClassVar[bool] = True
    cuda_graphs: ClassVar[bool] = False
    adjustable: ClassVar[tuple[str, ...]] = ("sync_every",)
    alpha: ClassVar[float | None] = None
    central_momentum: ClassVar[float] = 0.0
    fault_tolerant: ClassVar[bool] = True
    across_processes: ClassVar[bool] = True
    sync_every: int

    # -- settings ---------------------------------------------------------------------------

    def alpha_for(self, num_learners: int) -> float:
        """α for k = ``num_learners`` learners: the pull of each replica toward z (none here)."""
        return 0.0

    def centre_gain(self, num_learners: int) -> float:
        """γ, the share of the corrections' sum that moves z (``SMA.centre_gain``): 1."""
        return 1.0

    def centre_rate_for(self, num_learners: int) -> float:
        """β, z's rate toward the replicas' mean: k·α·γ (0 for an algorithm without α)."""
        return num_learners * self.alpha_for(num_learners) * self.centre_gain(num_learners)

    @property
    def scales_lr(self) -> bool:
        """Whether the learners step at the lr × SMA's η factor √min(k, 16), ramped
        (training/sma_lr.py; docs/design-overview.md §2): SMA's and SSGD's ``scale_lr``, False
        here."""
        return False

    @property
    def shares_second_moment(self) -> bool:
        """Whether a device's Adam learners share one second moment (SMA's option): False here."""
        return False

    def with_alpha(self, alpha: float | None) -> "SyncAlgorithm":
        """This algorithm with α = ``alpha`` (None: its default rule), for ``Plan.adjust``.

        Raises:
            ValueError: the algorithm has no α."""
        raise ValueError(f"alpha={alpha!r} with sync={type(self).__name__}(...): it pulls no "
                         "replica toward z (α = 0)")

    def with_sync_every(self, sync_every: int) -> "SyncAlgorithm":
        """This algorithm synchronising every ``sync_every`` rounds, for ``Plan.adjust``."""
        return dataclasses.replace(self, sync_every=sync_every)

    # -- compile ----------------------------------------------------------------------------

    def check_executor(self, executor: str) -> None:
        """ValueError when ``executor`` (``compile``'s) is one this algorithm does not run on
        (an unknown name is the scheduler's error, ``EXECUTORS``)."""
        if executor in ("inline", "process") and executor not in self.executors:
            runs = " and ".join(self.executors)
            raise ValueError(f"sync={type(self).__name__}(...) runs on the {runs} executor only: "
                             "its global sync writes every replica, which the process executor's "
                             f"workers do not wait for; use executor={self.executors[0]!r} (or "
                             "'auto', which picks it)")

    def check_optimizer(self, optimizer: LocalOptimizer) -> None:
        """ValueError when the local optimizer is one this algorithm cannot step (any here)."""

    def bind(self, states: list[DeviceState]) -> SyncState:
        """The plan's runtime state of this algorithm, over its devices' ``states`` (none here)."""
        return SyncState()

    def kernel_facts(self, num_learners: int) -> dict[str, Any]:
        """What selects the update kernels a plan runs (kernels/select.py ``plan_kernels``):
        here no correction and no central update (``num_learners=1``)."""
        return {"num_learners": 1, "sync_every": self.sync_every, "central_momentum": 0.0}

    # -- rounds -----------------------------------------------------------------------------

    def local_update(self, ctx: SyncContext, env: SyncRound, state: DeviceState, r0: int, r1: int,
                     *, losses: list[torch.Tensor] | None = None,
                     out: torch.Tensor | None = None) -> tuple[torch.Tensor | None, Any]:
        """The LOCAL_SYNC's work on rows ``r0 … r1−1`` of ``state``: faulty replicas (NaN/Inf
        gradients or ``losses``, divergent ones) reset from z, then the local optimizer's step
        with the round's ``env.hyper`` and, in a round that synchronises with α > 0, the
        correction c_j = α·(ŵ_j − z) (docs/design-overview.md §2, steps 1–2).

        Args:
            losses: the rows' losses of the round (r1 − r0 0-dim tensors), for the fault test.
            out: ``[P]`` to write the rows' accumulator into, or None.

        Returns:
            (the rows' accumulator ``[P]`` for ``global_update`` (here Σ_j c_j), None in a round
            without one; the faulty replicas: their indices, or with ``env.on_device`` their mask
            ``[r1 − r0]`` on the device)."""
        faulty = FaultMonitor.find(state, r0, r1, max_divergence=env.max_divergence,
                                   kernels=ctx.kernels, losses=losses, on_device=env.on_device)
        z = state.z if env.synchronise and env.alpha else None
        if ctx.optimizer.kernel:
            acc = ctx.kernels.local_update(
                state.w[r0:r1], state.v[r0:r1], state.g[r0:r1], z, nesterov=env.hyper.nesterov,
                first_step=all(state.first_step[r0:r1]),  # a new replica's momentum is zero
                out=out, **env.hyper.kernel_args(z is not None))
            state.first_step[r0:r1] = [False] * (r1 - r0)
        else:
            acc = _rows_step(state, r0, r1, z, env.hyper, out, faulty)
        FaultMonitor.reset_found(state, r0, faulty)  # back at z: the zero gradient met weight decay
        return acc, faulty

    @abc.abstractmethod
    def global_update(self, ctx: SyncContext, env: SyncRound, accs: list[torch.Tensor],
                      bufs: list[torch.Tensor]) -> None:
        """The GLOBAL_SYNC's work (on the global stream): from the devices' accumulators
        ``accs`` (``[P]`` each, in device order) and the replicas' float buffers ``bufs``
        (``[m_d, Q]`` per device), summed through ``ctx.transport``, to the new z, z_prev, zbuf
        on every device (and, where the algorithm says so, every replica)."""

    # -- description ------------------------------------------------------------------------

    def describe(self, sync_state: SyncState | None = None) -> dict[str, Any]:
        """The algorithm as plain data (JSON, the torchrun agreement): its name, τ and fields."""
        return {"name": type(self).__name__, "sync_every": self.sync_every,
                **dataclasses.asdict(self)}

    def summary_rule(self, num_learners: int, sync_state: SyncState | None = None) -> str:
        """The plan summary's ``sync:`` text (compiler/inspect.py)."""
        return f"{type(self).__name__}(every {self.sync_every} round(s))"

    def _lr_rule_text(self, num_learners: int) -> str:
        """``summary_rule``'s note of the η rule at k = ``num_learners``: ", lr × √min(k, 16)"
        where ``scales_lr`` and k > 1, else empty."""
        return ", lr × √min(k, 16)" if self.scales_lr and num_learners > 1 else ""

    def stability_warning(self, num_learners: int) -> str | None:
        """A warning where z's update diverges at k = ``num_learners`` as set, or None."""
        return None

    def short_fit_warning(self, rounds: int, rounds_done: int) -> str | None:
        """A warning for a fit of ``rounds`` rounds after ``rounds_done`` that would leave z
        where it is, or None."""
        return None

    def _fewer_rounds_than_h(self, rounds: int, rounds_done: int, missed: str) -> str | None:
        """``short_fit_warning`` of an algorithm whose z moves only at its syncs, every H =
        ``sync_every`` rounds: z ``missed`` (e.g. "gets no outer step") in a fit that ends
        before round H."""
        H = self.sync_every
        if rounds_done + rounds >= H:
            return None
        return (f"{type(self).__name__}(sync_every={H}): this fit runs {rounds} rounds, fewer "
                f"than H, so the central model z (what evaluation and central_model() use) "
                f"{missed} and stays where it started; use sync_every ≤ {max(rounds, 1)} or "
                "train longer")



@torch.no_grad()
def _rows_step(state: DeviceState, r0: int, r1: int, z: torch.Tensor | None, hyper: Hyper,
               out: torch.Tensor | None, faulty: list[int] | torch.Tensor) -> torch.Tensor | None:
    """A row optimizer's local update of rows r0 … r1−1 (engine/state/optim.py): c = α·(ŵ − z)
    from the pre-step weights, the step with ``hyper.groups`` (``faulty``: ``FaultMonitor.find``'s
    rows, reset, their gradients zero), w ← w − c; returns Σ c ``[P]`` (in ``out``), or None
    without a correction (``z`` None)."""
    w = state.w[r0:r1]
    c = None
    if z is not None:
        c = torch.sub(w, z, out=state.optim_rows.scratch(w)).mul_(hyper.alpha)
    state.optim_rows.step(state, r0, r1, hyper.groups, faulty)
    if c is None:
        return None
    w.sub_(c)
    return torch.sum(c, dim=0, out=out) if out is not None else c.sum(dim=0)


def single_learner_central(states: list[DeviceState], bufs: list[list[torch.Tensor]]) -> None:
    """With k = 1 the single replica is the central model: z_prev ← z, z ← w_0, zbuf ← its
    float buffers (docs/design-overview.md §2)."""
    s = states[0]
    s.z_prev.copy_(s.z)
    s.z.copy_(s.w[0])
    s.zbuf.copy_(bufs[0][0])
