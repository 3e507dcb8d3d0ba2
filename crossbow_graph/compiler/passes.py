"""Compiler passes: functions task graph → task graph, run with the verifier between them
(docs/compiler.md §4; the task graph: docs/design-overview.md §3)."""

from __future__ import annotations

import dataclasses
from typing import Callable

import networkx as nx
import torch

from .analysis import ModelAnalysis, cublas_workspace_bytes, estimate_memory
from .tasks import Cost, Task, TaskKind
from .trace import ModelGraph
from .verify import verify_task_graph

__all__ = [
    "empty_task_graph",
    "place_replicas",
    "insert_sync",
    "annotate_costs",
    "learner_memory_bytes",
    "build_task_graph",
    "PASSES",
]


# oneDNN without AVX-512 runs the backward of a convolution whose kernel overhangs its input (a
# 3 × 3 kernel over a 2 × 2 map) with 4 × its weight bytes of scratch beside the weight gradient
# (measured: 9 MiB of weights, 36 MiB of scratch, at b = 8 and 32; docs/compiler.md §3)
ONEDNN_OVERHANG_SCRATCH = 4


def empty_task_graph(*, devices: list[str], replicas_per_device: int, batch_size: int) -> nx.DiGraph:
    """A task graph with no tasks yet, carrying the plan's shape as graph attributes."""
    graph = nx.DiGraph()
    graph.graph.update(devices=list(devices), replicas_per_device=replicas_per_device,
                       batch_size=batch_size)
    return graph


def place_replicas(graph: nx.DiGraph) -> nx.DiGraph:
    """Placement: a LEARN ``learn:d{d}:r{r}`` per replica, replica j on device j // m."""
    out = _copy_graph(graph)
    m = out.graph["replicas_per_device"]
    for d, device in enumerate(out.graph["devices"]):
        for r in range(m):
            j = d * m + r
            task = Task(id=f"learn:d{d}:r{r}", kind=TaskKind.LEARN, device=device, replicas=(j,))
            out.add_node(task.id, task=task)
    return out


def insert_sync(graph: nx.DiGraph) -> nx.DiGraph:
    """A LOCAL_SYNC per device after its LEARNs and one GLOBAL_SYNC after them."""
    out = _copy_graph(graph)
    glob = Task(id="global_sync", kind=TaskKind.GLOBAL_SYNC, device=None,
                replicas=tuple(range(len(out.graph["devices"]) * out.graph["replicas_per_device"])))
    learns = [out.nodes[n]["task"] for n in list(out.nodes)
              if out.nodes[n]["task"].kind is TaskKind.LEARN]
    for d, device in enumerate(out.graph["devices"]):
        mine = [t for t in learns if t.device == device]
        local = Task(id=f"local_sync:d{d}", kind=TaskKind.LOCAL_SYNC, device=device,
                     replicas=tuple(j for t in mine for j in t.replicas))
        out.add_node(local.id, task=local)
        for t in mine:
            out.add_edge(t.id, local.id)
    out.add_node(glob.id, task=glob)
    for d in range(len(out.graph["devices"])):
        out.add_edge(f"local_sync:d{d}", glob.id)
    return out


def learner_memory_bytes(model_graph: ModelGraph, batch_size: int, replicas_per_device: int = 1) -> int:
    """Estimated bytes of one learner at batch b, m learners per device (``estimate_memory``)."""
    return estimate_memory(model_graph.analysis, batch_size, replicas_per_device).total


def library_workspace(devices: list[str], analysis: ModelAnalysis | None = None) -> int:
    """Bytes per learner that a kernel library holds beside the step's tensors on ``devices``
    (names): cuBLAS's workspace of the stream on a GPU; on a CPU whose oneDNN runs without
    AVX-512, the scratch of a convolution's backward whose kernel overhangs its input
    (``ONEDNN_OVERHANG_SCRATCH`` × its weight bytes, ``analysis.overhang_conv_weight_bytes``;
    docs/compiler.md §3); 0 otherwise or where the GPU cannot be queried."""
    if not devices:
        return 0
    if str(devices[0]).startswith("cpu"):
        if analysis is None or not torch.backends.mkldnn.is_available() \
                or not torch.backends.mkldnn.enabled \
                or torch.backends.cpu.get_cpu_capability().startswith("AVX512"):
            return 0
        return ONEDNN_OVERHANG_SCRATCH * analysis.overhang_conv_weight_bytes
    if not str(devices[0]).startswith("cuda") or not torch.cuda.is_available():
        return 0
    return cublas_workspace_bytes(torch.cuda.get_device_capability(devices[0]))


def annotate_costs(graph: nx.DiGraph, model_graph: ModelGraph) -> nx.DiGraph:
    """Cost annotation: each task's FLOPs and bytes per round, each LEARN's memory
    (``meta["memory_bytes"]``), and the graph attributes ``memory_per_learner_bytes``, ``memory``
    and ``model`` (docs/compiler.md §4)."""
    out = _copy_graph(graph)
    b = out.graph["batch_size"]
    m = out.graph["replicas_per_device"]
    analysis = model_graph.analysis
    p = analysis.num_trainable
    p4 = 4 * p
    est = estimate_memory(analysis, b, m, library_workspace=library_workspace(out.graph["devices"], analysis))
    out.graph["memory_per_learner_bytes"] = est.total
    out.graph["memory"] = est.as_dict()
    out.graph["model"] = {
        "name": model_graph.name,
        "num_trainable": p,
        "num_parameters": model_graph.num_parameters,
        "num_buffers": sum(x.numel for x in model_graph.buffers),
        "forward_flops_per_sample": analysis.forward_flops_per_sample,
        "train_flops_per_sample": analysis.train_flops_per_sample,
        "tracer": model_graph.tracer,
        "untraced": model_graph.untraced,
        "lost": model_graph.lost,
    }
    for n in out.nodes:
        task: Task = out.nodes[n]["task"]
        k = len(task.replicas)
        if task.kind is TaskKind.LEARN:
            task.cost = Cost(flops=analysis.train_step_flops(b), bytes=est.total)
            task.meta["memory_bytes"] = est.total
        elif task.kind is TaskKind.LOCAL_SYNC:
            task.cost = Cost(flops=8 * k * p, bytes=((3 * k + 1) + (2 * k + 1)) * p4)
        else:
            g = len(out.graph["devices"])
            task.cost = Cost(flops=4 * p, bytes=(g + 4) * p4)
    return out


def _copy_graph(graph: nx.DiGraph) -> nx.DiGraph:
    """A copy whose Tasks are copies too, so that a pass never changes its input graph."""
    out = graph.copy()
    for n in out.nodes:
        t: Task = out.nodes[n]["task"]
        out.nodes[n]["task"] = dataclasses.replace(t, cost=dataclasses.replace(t.cost),
                                                   meta=dict(t.meta))
    return out


PASSES: tuple[tuple[str, Callable[..., nx.DiGraph]], ...] = (
    ("place_replicas", lambda g, mg: place_replicas(g)),
    ("insert_sync", lambda g, mg: insert_sync(g)),
    ("annotate_costs", annotate_costs),
)


def build_task_graph(model_graph: ModelGraph, *, devices: list[str], replicas_per_device: int,
                     batch_size: int, memory_budget_bytes: int | None = None,
                     verify: bool = True) -> nx.DiGraph:
    """Run the compiler's passes with the verifier after each (unless ``verify=False``).
    Raises PlanError with the verifier's first violation (names the pass and the task)."""
    graph = empty_task_graph(devices=devices, replicas_per_device=replicas_per_device,
                             batch_size=batch_size)
    for name, pass_fn in PASSES:
        graph = pass_fn(graph, model_graph)
        if verify:
            verify_task_graph(graph, stage=name, memory_budget_bytes=memory_budget_bytes)
    return graph
