"""Executes a plan's task graph round after round, like an interpreter (DESIGN.md §1, §5).

One method per task kind (``learn``, ``local_sync``, ``global_sync``); a failure is re-raised as a
TaskError naming the task, its device and the round (STYLE.md rule 3).
"""

from __future__ import annotations

from typing import Any, Callable

import networkx as nx
import torch
from torch.utils._pytree import tree_map

from ..compiler.tasks import Task, TaskKind
from ..config import SGD, SMA
from ..errors import TaskError
from .data import split_inputs
from .faults import FaultMonitor
from .sma import TorchSMAKernels
from .state import DeviceState

__all__ = ["Scheduler"]


class Scheduler:
    """Runs rounds of SMA over the devices' replicas.

    Args:
        task_graph: the plan's task graph (one round).
        states: one DeviceState per device, in the plan's device order.
        loss_fn: ``loss_fn(output, target) -> scalar tensor``.
        optimizer: the local SGD settings.
        sync: the SMA settings.
        batch_size: b, samples per learner per round.
    """

    def __init__(self, task_graph: nx.DiGraph, states: list[DeviceState], loss_fn: Callable,
                 optimizer: SGD, sync: SMA, batch_size: int) -> None:
        self.batch_size = batch_size
        self.kernels = TorchSMAKernels()  # the SMA update backend: local_update, central_update
        self.states = states
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        self.sync = sync
        self.lr = optimizer.lr
        device_index = {s.name: d for d, s in enumerate(states)}
        self._device_index = device_index
        self.order: list[Task] = [
            task_graph.nodes[n]["task"]
            for n in nx.lexicographical_topological_sort(task_graph, key=_task_sort_key(task_graph))
        ]
        self.losses: list[torch.Tensor] = []
        self.faults = FaultMonitor()  # NaN/Inf replicas: reset from z, left out of the sum
        self.round_index = 0

    @property
    def num_learners(self) -> int:
        return sum(s.m for s in self.states)

    @property
    def alpha(self) -> float:
        return self.sync.alpha_for(self.num_learners)

    def run_round(self, round_index: int, batch: Any, *, synchronise: bool) -> None:
        """Run every task of one round.

        Args:
            round_index: the global round number t (for error messages).
            batch: the round's collated samples, ``k·b`` along dimension 0, learner j's at
                ``[j·b, (j+1)·b)``.
            synchronise: whether this round ends with a synchronisation (every τ-th round).
        """
        self._batch = batch
        self._synchronise = synchronise
        self.round_index = round_index
        for task in self.order:
            try:
                getattr(self, task.kind.value)(task)
            except TaskError:
                raise
            except Exception as exc:
                raise TaskError(
                    f"task '{task.id}' ({task.kind.name} on {task.device or 'all devices'}) failed "
                    f"in round {round_index}: {type(exc).__name__}: {exc}",
                    task_id=task.id, device=str(task.device), round_index=round_index,
                ) from exc

    # -- one method per task kind -------------------------------------------------------------

    def learn(self, task: Task) -> None:
        """Forward and backward of one replica on its own batch; gradients land in ``g[j]``."""
        j = task.replicas[0]
        d = self._device_index[task.device]
        state = self.states[d]
        r = j - sum(s.m for s in self.states[:d])
        if r == 0:
            state.g.zero_()
        b = self.batch_size
        mine = tree_map(lambda t: t[j * b:(j + 1) * b].to(state.torch_device, non_blocking=True)
                        if isinstance(t, torch.Tensor) else t, self._batch)
        args, kwargs, target = split_inputs(mine)
        out = state.replicas[r](*args, **kwargs)
        loss = self.loss_fn(out, target)
        if not (isinstance(loss, torch.Tensor) and loss.dim() == 0):
            raise ValueError(
                f"loss_fn must return a scalar tensor, got "
                f"{tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__}; "
                "reduce it, e.g. with reduction='mean'"
            )
        loss.backward()
        self.losses.append(loss.detach())

    def local_sync(self, task: Task) -> None:
        """Local SGD step and correction of every replica on the device, and their sum acc_d."""
        state = self.states[self._device_index[task.device]]
        opt = self.optimizer
        faulty = self.faults.check(state, round_index=self.round_index, num_learners=self.num_learners)
        state.acc = self.kernels.local_update(
            state.w, state.v, state.g, state.z if self._synchronise else None,
            lr=self.lr, momentum=opt.momentum, nesterov=opt.nesterov,
            weight_decay=opt.weight_decay, alpha=self.alpha if self._synchronise else 0.0,
            first_step=state.first_step[0],
        )
        self.faults.finish(state, faulty)
        state.first_step = [False] * state.m

    def global_sync(self, task: Task) -> None:
        """C = Σ_d acc_d, then z ← z + C + μ_z(z − z_prev) on every device; buffers averaged."""
        if not self._synchronise:
            return
        states = self.states
        if self.num_learners == 1:  # the single replica is the central model
            s = states[0]
            s.z_prev.copy_(s.z)
            s.z.copy_(s.w[0])
            s.zbuf.copy_(s.buf[0])
            return
        home = states[0].torch_device
        total = None
        for s in states:
            acc = s.acc.to(home)
            total = acc if total is None else total.add_(acc)
        mean_buf = None
        if states[0].buf.shape[1]:
            mean_buf = torch.cat([s.buf.to(home) for s in states]).mean(dim=0)
        for s in states:
            self.kernels.central_update(s.z, s.z_prev, total.to(s.torch_device),
                               central_momentum=self.sync.central_momentum)
            if mean_buf is not None:
                s.zbuf.copy_(mean_buf)



def _task_sort_key(graph: nx.DiGraph):
    rank = {TaskKind.LEARN: 0, TaskKind.LOCAL_SYNC: 1, TaskKind.GLOBAL_SYNC: 2}

    def key(n: str) -> tuple:
        task: Task = graph.nodes[n]["task"]
        return (task.device or "~", rank[task.kind], n)

    return key
