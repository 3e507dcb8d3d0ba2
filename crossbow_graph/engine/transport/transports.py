"""The transports a sync algorithm sums and broadcasts through: one object per plan, chosen when
the plan is built (``choose_transport``) — the devices of one process (``InProcess``; CPU devices
share one memory), torchrun's ranks (``Torchrun``) or torchft's replica groups (``Torchft``) —
so that an algorithm never asks which one it runs over (docs/design-overview.md §2, §5;
docs/distributed.md)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Protocol

import torch

from .host import TransportHost

if TYPE_CHECKING:
    from ..state.flat import DeviceState
    from .comm import Comm
    from .ft import FaultTolerantSync

__all__ = ["Transport", "InProcess", "Torchrun", "Torchft", "Summed", "CentralStep",
           "TransportHost", "RoundFacts", "choose_transport", "sum_on", "mean_buffers"]


class RoundFacts(Protocol):
    """What a transport reads of the round it sums for (a ``RoundEnv``)."""

    round_index: int
    k: int  # the learners of every process
    alpha: float  # α of the round's local updates


@dataclass(frozen=True)
class Summed:
    """A global sum: ``total`` ``[P]`` on the first device, the replicas' mean float buffers
    ``mean_buf`` ``[Q]`` over the k learners (None without float buffers), and ``k``, the
    learners whose contributions the sum holds."""

    total: torch.Tensor
    mean_buf: torch.Tensor | None
    k: int


class CentralStep(Protocol):
    """An algorithm's update of the central model from a global sum (``central_update``)."""

    def apply(self, z: torch.Tensor, z_prev: torch.Tensor, total: torch.Tensor) -> None:
        """Update one device's ``z``, ``z_prev`` ``[P]`` from the sum ``total`` ``[P]``."""

    def apply_shared(self, zs: list[torch.Tensor], z_prevs: list[torch.Tensor],
                     parts: list[torch.Tensor]) -> bool:
        """Sum ``parts``, ``apply`` it to ``zs[0]`` and copy it to every device in one pass, where
        the devices share one memory; False, doing nothing, where no such pass exists."""


def sum_on(accs: list[torch.Tensor], home: torch.device) -> torch.Tensor:
    """Σ_d acc_d ``[P]`` on ``home`` (never writes an acc_d; with one device it may be acc_0)."""
    total = None
    for acc in accs:
        acc = acc.to(home)
        total = acc if total is None else total + acc
    return total


def mean_buffers(bufs: list[torch.Tensor], home: torch.device) -> torch.Tensor | None:
    """The mean over every replica of the devices' float buffers ``[m_d, Q]``, ``[Q]`` on
    ``home``; None without float buffers."""
    if not bufs[0].shape[1]:
        return None
    return torch.cat([bb.to(home) for bb in bufs]).mean(dim=0)


class Transport:
    """How the global sync's sums cross devices and processes (this module's docstring).

    Attributes:
        shared_memory: the devices share one memory (logical CPU devices): the central update runs
            once and is copied to the other devices.
        in_graph: its sums may run inside a CUDA graph (nothing on the host).
        weighs_live: its sum is over the live learners (torchft), weighted by ``per_learner``
            of their k."""

    in_graph = False
    weighs_live = False

    def __init__(self, *, shared_memory: bool) -> None:
        self.shared_memory = shared_memory
        self.host: TransportHost | None = None
        self._fault_count: torch.Tensor | None = None

    def attach(self, host: TransportHost) -> None:
        """Serve ``host`` (the engine of one plan) from now on."""
        self.host = host

    def take_fault_count(self) -> torch.Tensor | None:
        """The ranks' count of unshared fault events the last sum carried (1 element, on the
        device; torchrun), once; else None."""
        count, self._fault_count = self._fault_count, None
        return count

    def live_learners(self, k: int) -> int:
        """The learners the next round's α is for: ``k`` (torchft: the last sync's)."""
        return k

    def sum(self, accs: list[torch.Tensor], bufs: list[torch.Tensor], env: RoundFacts, *,
            per_learner: Callable[[int], float] | None = None) -> Summed:
        """Σ of the devices' accumulators ``accs`` (``[P]`` each) over every learner of the round
        and the mean of the float buffers ``bufs`` (``[m_d, Q]`` per device). ``per_learner``:
        each learner's term holds the factor ``env.alpha`` = ``per_learner(env.k)``; a sum over
        another k of learners than ``env.k`` (torchft) holds ``per_learner(k)`` instead."""
        raise NotImplementedError

    def central_update(self, states: list[DeviceState], accs: list[torch.Tensor],
                       bufs: list[torch.Tensor], env: RoundFacts, step: CentralStep, *,
                       per_learner: Callable[[int], float] | None = None) -> torch.Tensor | None:
        """``step`` applied to every device's central model from the sum of ``accs``; returns the
        mean float buffers ``[Q]`` (None without float buffers)."""
        summed = self.sum(accs, bufs, env, per_learner=per_learner)
        self.apply(states, step, summed.total)
        return summed.mean_buf

    def apply(self, states: list[DeviceState], step: CentralStep, total: torch.Tensor) -> None:
        """``step.apply`` on every device's z, or once and copied where the devices share memory
        (the same numbers)."""
        for s in states[:1] if self.shared_memory else states:
            step.apply(s.z, s.z_prev, total.to(s.torch_device))
        if self.shared_memory:
            for s in states[1:]:
                s.z.copy_(states[0].z)
                s.z_prev.copy_(states[0].z_prev)

    # -- what a run keeps of it -------------------------------------------------------------

    @property
    def membership(self) -> list[Any]:
        """The membership changes of its syncs so far (torchft's replica groups), else empty."""
        return []

    def describe(self) -> str | None:
        """A line for the plan summary, or None."""
        return None

    def state_dict(self) -> dict[str, Any] | None:
        """What a checkpoint keeps of it (None: nothing)."""
        return None

    def load_state_dict(self, saved: dict[str, Any] | None) -> None:
        """Restore ``state_dict()``."""


class InProcess(Transport):
    """The devices of one process: their sum on the first device, k the round's learners; where
    the devices share one memory, the kernels' one-pass central update when they have one."""

    in_graph = True

    def sum(self, accs, bufs, env, *, per_learner=None) -> Summed:
        home = self.host.states[0].torch_device
        return Summed(sum_on(accs, home), mean_buffers(bufs, home), env.k)

    def central_update(self, states, accs, bufs, env, step, *, per_learner=None):
        if self.shared_memory and step.apply_shared(
                [s.z for s in states], [s.z_prev for s in states], accs):
            return mean_buffers(bufs, states[0].torch_device)
        return super().central_update(states, accs, bufs, env, step, per_learner=per_learner)


class Torchrun(Transport):
    """torchrun's ranks: this process's devices summed first, then one all-reduce over the ranks
    of ``[Σ acc, Σ buf, this rank's unshared fault events]`` (``Comm.all_reduce_sum_``); the
    events' count is taken by the backend that ran the sum (``take_fault_count``)."""

    def __init__(self, comm: Comm, *, shared_memory: bool) -> None:
        super().__init__(shared_memory=shared_memory)
        self.comm = comm

    def sum(self, accs, bufs, env, *, per_learner=None) -> Summed:
        host = self.host
        home = host.states[0].torch_device
        total = sum_on(accs, home)
        P, Q = total.shape[0], host.states[0].buf.shape[1]
        flat = torch.empty(P + Q + 1, dtype=total.dtype, device=home)  # [P + Q + 1]
        flat[:P].copy_(total)
        if Q:
            torch.sum(torch.cat([bb.to(home, total.dtype) for bb in bufs]), dim=0, out=flat[P:P + Q])
        flat[P + Q] = host.pending_faults()
        self.comm.all_reduce_sum_(flat, env.round_index, num_parameters=P)
        self._fault_count = flat[P + Q:]
        mean_buf = flat[P:P + Q].div_(env.k).to(host.states[0].buf.dtype) if Q else None
        return Summed(flat[:P], mean_buf, env.k)


class Torchft(Transport):
    """torchft's replica groups (``FaultTolerantSync``): a group's sum over its ranks, then over
    the live groups; k is the live groups' learners, and a sum of α-weighted terms is weighted
    for that k (with α = 1/k and μ_z = 0: the mean of the live learners)."""

    weighs_live = True

    def __init__(self, ft: FaultTolerantSync, *, shared_memory: bool) -> None:
        super().__init__(shared_memory=shared_memory)
        self.ft = ft

    def attach(self, host: TransportHost) -> None:
        super().attach(host)
        self.ft.attach(host)

    def live_learners(self, k: int) -> int:
        return self.ft.members.live_learners or k

    def sum(self, accs, bufs, env, *, per_learner=None) -> Summed:
        total = sum_on(accs, self.host.states[0].torch_device)
        scale = 1.0 / env.alpha if per_learner is not None else 1.0
        total, mean_buf, k = self.ft.all_reduce(total * scale, bufs, env.round_index)
        self._fault_count = self.ft.take_fault_count()
        if per_learner is not None:
            total.mul_(per_learner(k))
        return Summed(total, mean_buf, k)

    @property
    def membership(self) -> list[Any]:
        return self.ft.members.changes

    def describe(self) -> str | None:
        return self.ft.members.describe()

    def state_dict(self) -> dict[str, Any] | None:
        return self.ft.members.state_dict()

    def load_state_dict(self, saved: dict[str, Any] | None) -> None:
        if saved is not None:
            self.ft.members.load_state_dict(saved)


def choose_transport(*, on_cpu: bool, comm: Comm | None, ft: FaultTolerantSync | None) -> Transport:
    """The plan's transport: torchft's groups, torchrun's ranks, or this process's devices;
    ``on_cpu``: every device is a logical CPU device (one memory)."""
    if ft is not None:
        return Torchft(ft, shared_memory=on_cpu)
    if comm is not None:
        return Torchrun(comm, shared_memory=on_cpu)
    return InProcess(shared_memory=on_cpu)
