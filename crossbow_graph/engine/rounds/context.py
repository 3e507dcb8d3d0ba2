"""What every backend shares of a plan's engine, ``RunContext``: the devices' states, the round's
program, the learners' programs, the sync algorithm's context, the faults and the clocks; a
fit's constants, ``FitRun`` (docs/design-overview.md §5; docs/runtime.md, "Backends"). A
backend reads these and a round's ``RoundEnv``, never the Scheduler."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import networkx as nx
import torch

from ...compiler.tasks import Task, TaskKind
from ..data.prefetch import BatchPrefetch
from ..learning.faults import FaultMonitor
from .interpreter import RoundProgram

if TYPE_CHECKING:
    from ..learning.fused import FusedProgram
    from ..state.flat import DeviceState
    from ..sync.base import SyncContext
    from .timeline import Timeline

__all__ = ["RunContext", "FitRun", "SyncClock"]


@dataclass(eq=False)
class SyncClock:
    """Seconds spent synchronising (``sync_s``) and the part of them no learning hid
    (``exposed_s``), and the rounds the process backend learned ahead (``learned_ahead``)."""

    sync_s: float = 0.0
    exposed_s: float = 0.0
    learned_ahead: int = 0


@dataclass(frozen=True, eq=False)
class FitRun:
    """A fit's constants (``Scheduler.begin_fit``).

    Attributes:
        fetch: sample indices ``[n]`` → a collated batch (in any process).
        load: (round t, its indices ``[k·b]``) → the round's batch in this process, once per
            round in round order; None: ``fetch``.
        seed: the fit's seed (each learner's dropout seed is a function of it, the round and j).
        max_grad_norm: the per-learner gradient clipping, or None.
        timeline: the fit's Timeline (``fit(trace=)``), or None."""

    fetch: Callable[[torch.Tensor], Any]
    load: Callable[[int, torch.Tensor], Any] | None = None
    seed: int = 0
    max_grad_norm: float | None = None
    timeline: Timeline | None = None

    def load_batch(self, round_index: int, indices: torch.Tensor) -> Any:
        """Round ``round_index``'s batch of the samples ``indices [k·b]``, in this process."""
        return self.fetch(indices) if self.load is None else self.load(round_index, indices)


@dataclass(eq=False)
class RunContext:
    """What every backend shares (this module's docstring).

    Attributes:
        states: one DeviceState per device, in the plan's device order.
        loss_fn: ``loss_fn(output, target) -> scalar``.
        fused: per device, its FusedProgram (fused learners).
        sync: the sync algorithm's ``SyncContext`` (states, kernels, optimizer, transport, its
            runtime state).
        comm: torchrun's ``Comm``, or None.
        cpu_conv: the worker processes' convolutions (``"auto"``, ``"onednn"``, ``"aten"``);
            onednn_choices: b → oneDNN or not, measured (a checkpoint keeps them).
        faults: the NaN/Inf replicas found so far (``FaultMonitor``).
        clock: the synchronisation seconds (``SyncClock``).
        batch_ahead: the batch copied to the devices a round ahead.
        fault_masks: per device, its last local sync's fault mask on the device (streams), or None.
        program, order, fused_runs: the task graph as a round runs it (``adopt``): the
            ``RoundProgram``, its tasks in order, and the fused learners' runs (lead task → rows).
        fit: the fit's ``FitRun`` between ``begin_fit`` and ``end_fit``, else None."""

    states: list[DeviceState]
    loss_fn: Callable
    fused: list[FusedProgram]
    sync: SyncContext
    comm: Any = None
    cpu_conv: str = "auto"
    onednn_choices: dict[int, bool] = field(default_factory=dict)
    faults: FaultMonitor = field(default_factory=FaultMonitor)
    clock: SyncClock = field(default_factory=SyncClock)
    batch_ahead: BatchPrefetch = field(default_factory=BatchPrefetch)
    fault_masks: list[torch.Tensor | None] = field(default_factory=list)
    program: RoundProgram | None = None
    order: list[Task] = field(default_factory=list)
    fused_runs: dict[str, tuple[int, int]] = field(default_factory=dict)
    fit: FitRun | None = None

    def adopt(self, task_graph: nx.DiGraph) -> None:
        """Run ``task_graph`` from the next round on (the states have its replica counts).

        Raises:
            PlanError: a graph the backends cannot run (``RoundProgram.of`` names the task)."""
        self.program = RoundProgram.of(task_graph, [s.name for s in self.states],
                                       [s.m for s in self.states])  # raises PlanError
        self.order = list(self.program.tasks)
        self.fused_runs = {}
        for d in range(len(self.states)):
            self.fused_runs.update(self.program.learn_runs(
                [t for t in self.order if t.kind is TaskKind.LEARN and self.program.device[t.id] == d]))
        self.fault_masks = [None] * len(self.states)
        self.faults.new_plan()  # NaN/Inf replicas: reset from z, left out of the sum
        self.batch_ahead.drop()  # split for the old graph's devices and rows

    @property
    def on_cpu(self) -> bool:
        """Every device is a logical CPU device (one memory)."""
        return all(s.torch_device.type == "cpu" for s in self.states)

    @property
    def rank(self) -> int | None:
        """This process's torchrun rank, None in a single process."""
        return self.comm.rank if self.comm else None

    @property
    def learner_offset(self) -> int:
        """Global index of this process's first learner (rank · local learners)."""
        return sum(s.m for s in self.states) * self.comm.rank if self.comm else 0

    @property
    def num_learners(self) -> int:
        """k, learners of every process (every rank has the same m per device)."""
        return sum(s.m for s in self.states) * (self.comm.world_size if self.comm else 1)
