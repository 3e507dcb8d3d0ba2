"""What a CUDA-graph round reads (engine/backends/graphs/capture.py): its batch in the form a graph takes
(``graph_batch``), host batches through pinned staging (``HostStaging``), device-resident data
gathered in the graph (``DeviceGather``) and the round's hyper-parameters as device tensors
(``DeviceHyper``, ``GraphHyper``) (docs/runtime.md, "CUDA-graph rounds")."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from ...data.batches import DeviceParts, LearnerBatches
from ...state.hyper import Hyper

__all__ = ["DeviceGather", "DeviceHyper", "GraphHyper", "HostStaging", "graph_batch"]


class DeviceHyper:
    """A device's run-time hyper-parameters as 0-dim float32 tensors (what the update kernels
    read in a graph): ``lr`` (η), ``momentum`` (μ_l), ``weight_decay`` (λ), ``alpha`` (α),
    ``central_momentum`` (μ_z), ``centre_gain`` (γ)."""

    NAMES = ("lr", "momentum", "weight_decay", "alpha", "central_momentum", "centre_gain")

    def __init__(self, device: torch.device) -> None:
        self.values = {n: torch.zeros((), dtype=torch.float32, device=device) for n in self.NAMES}
        self.written: dict[str, float] = {}  # the number each tensor holds

    def set(self, hyper: Hyper) -> None:
        """Write the round's numbers (``hyper``) that changed (on the current stream, before the
        round that reads them): a round whose η, μ_l, λ, α, μ_z, γ stay launches no kernel."""
        for name in self.NAMES:
            value = float(getattr(hyper, name))
            if self.written.get(name) != value:
                self.values[name].fill_(value)
                self.written[name] = value

    def view(self, hyper: Hyper) -> "GraphHyper":
        """``hyper`` as a graph's body reads it: these tensors for the kernels."""
        return GraphHyper(**{f.name: getattr(hyper, f.name) for f in dataclasses.fields(hyper)},
                          tensors=self.values)


@dataclass(frozen=True)
class GraphHyper(Hyper):
    """A round's ``Hyper`` inside a CUDA graph: the kernels get the device tensors (``tensors``,
    read at every replay), but the number 0 where the value is 0 (and γ the number 1 where it is 1: its
    branch compiled out; the graph's key has it)."""

    tensors: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)

    def kernel_args(self, correction: bool) -> dict[str, Any]:
        t = self.tensors
        return {"lr": t["lr"], **{n: t[n] if v != 0 else 0.0 for n, v in (
            ("momentum", self.momentum), ("weight_decay", self.weight_decay),
            ("alpha", self.alpha if correction else 0.0))}}

    def central(self) -> Any:
        return self.tensors["central_momentum"] if self.central_momentum != 0 else 0.0

    def gain(self) -> Any:
        return self.tensors["centre_gain"] if self.centre_gain != 1 else 1.0


class HostStaging:
    """Pinned host buffers through which a host batch reaches a graph's static inputs on the
    device, outside the capture: ``slots`` sets of buffers used in turn; before the host
    overwrites a set it waits (``ops.wait_host``) for the event after the copy that last read it
    (that of ``slots`` rounds before, done long since), so no replay reads a half-written batch.

    Args:
        ops: the streams' operations (``streams.StreamOps``, or a RaceRecorder on CPU devices)."""

    def __init__(self, ops: Any, slots: int = 2) -> None:
        self.ops, self.slots = ops, slots
        self.buffers: list[list[torch.Tensor]] = []  # per slot, one pinned buffer per leaf
        self.events: list[Any] = [None] * slots
        self.turn = 0

    def copy_in(self, statics: list[torch.Tensor], leaves: list[torch.Tensor], stream: Any) -> None:
        """Copy the host tensors ``leaves`` into ``statics`` (device tensors of their shapes) on
        ``stream`` through the next slot's pinned buffers."""
        slot = self.turn % self.slots
        self.turn += 1
        if self.events[slot] is not None:
            self.ops.wait_host(self.events[slot])
        if len(self.buffers) <= slot:
            self.buffers.append([self.ops.stage(torch.empty_like(t)) for t in leaves])
        with self.ops.use(stream):
            for buf, static, t in zip(self.buffers[slot], statics, leaves):
                buf.copy_(t)  # the host writes the pinned buffer
                static.copy_(buf, non_blocking=True)
        self.events[slot] = self.ops.new_event()
        self.ops.record(self.events[slot], stream)


@dataclass(eq=False)
class DeviceGather:
    """A round's batch of device-resident data before its gather: ``fetch`` (a
    ``training.data.DeviceFetch``) and the round's sample indices ``[k·b]`` on its device. A graph
    round gathers in the graph, from its static indices into its static inputs."""

    fetch: Any
    indices: torch.Tensor

    def batch(self) -> list[torch.Tensor]:
        """The gathered batch (an eager round's)."""
        return self.fetch.gather(self.indices)

    def specs(self) -> list[tuple[tuple[int, ...], torch.dtype, torch.device]]:
        """(shape, dtype, device) of each tensor of the batch."""
        n = len(self.indices)
        return [((n, *t.shape[1:]), t.dtype, t.device) for t in self.fetch.tensors]


def graph_batch(batch: Any) -> Any:
    """A round's batch as a graph round takes it: the one device's part of a ``DeviceParts``;
    a ``LearnerBatches`` (a DataLoader's learner batches) concatenated when it stacks into
    tensors of one shape per learner (``LearnerBatches.stacked``: learner j's rows at
    ``[j·b, (j+1)·b)``, what the learners take of a collated batch); any other batch as it is
    (``RoundGraph.why_not`` says why a graph cannot take it)."""
    if isinstance(batch, DeviceParts) and len(batch.parts) == 1:
        batch = batch.parts[0]
    if not isinstance(batch, LearnerBatches):
        return batch
    try:
        stacked = batch.stacked()
    except ValueError:  # ragged learner batches: per_replica learners take them eagerly
        return batch
    return stacked if all(isinstance(t, torch.Tensor) for t in tree_leaves(stacked)) else batch
