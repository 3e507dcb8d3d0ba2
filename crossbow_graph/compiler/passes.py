"""Compiler passes: each a function from task graph to task graph (DESIGN.md §3).

A task graph is a ``networkx.DiGraph`` of one round; node ``id`` has attribute ``task`` (a Task);
graph attributes: ``devices`` (list of device names), ``replicas_per_device`` (m),
``batch_size`` (b). The plan is periodic: learner j's next round depends on its own LOCAL_SYNC.
"""

from __future__ import annotations

import networkx as nx

from .tasks import Cost, Task, TaskKind
from .trace import ModelGraph

__all__ = [
    "empty_task_graph",
    "place_replicas",
    "insert_sync",
    "annotate_costs",
    "learner_memory_bytes",
]


def empty_task_graph(*, devices: list[str], replicas_per_device: int, batch_size: int) -> nx.DiGraph:
    """A task graph with no tasks yet, carrying the plan's shape as graph attributes."""
    graph = nx.DiGraph()
    graph.graph.update(devices=list(devices), replicas_per_device=replicas_per_device,
                       batch_size=batch_size)
    return graph


def place_replicas(graph: nx.DiGraph) -> nx.DiGraph:
    """Placement: one LEARN task per replica, device-major (replica j on device j // m)."""
    out = graph.copy()
    m = out.graph["replicas_per_device"]
    for d, device in enumerate(out.graph["devices"]):
        for r in range(m):
            j = d * m + r
            task = Task(id=f"learn:d{d}:r{r}", kind=TaskKind.LEARN, device=device, replicas=(j,),
                        inputs=(f"w[{j}]", f"batch[{j}]"), outputs=(f"g[{j}]",))
            out.add_node(task.id, task=task)
    return out


def insert_sync(graph: nx.DiGraph) -> nx.DiGraph:
    """Synchronisation insertion: a LOCAL_SYNC per device after its learners, one GLOBAL_SYNC."""
    out = graph.copy()
    glob = Task(id="global_sync", kind=TaskKind.GLOBAL_SYNC, device=None,
                replicas=tuple(range(len(out.graph["devices"]) * out.graph["replicas_per_device"])),
                inputs=tuple(f"acc[{d}]" for d in range(len(out.graph["devices"]))) + ("z",),
                outputs=("z", "z_prev"))
    learns = [out.nodes[n]["task"] for n in list(out.nodes)
              if out.nodes[n]["task"].kind is TaskKind.LEARN]
    for d, device in enumerate(out.graph["devices"]):
        mine = [t for t in learns if t.device == device]
        local = Task(id=f"local_sync:d{d}", kind=TaskKind.LOCAL_SYNC, device=device,
                     replicas=tuple(j for t in mine for j in t.replicas),
                     inputs=(f"w@d{d}", f"v@d{d}", f"g@d{d}", f"z@d{d}"),
                     outputs=(f"w@d{d}", f"v@d{d}", f"acc[{d}]"))
        out.add_node(local.id, task=local)
        for t in mine:
            out.add_edge(t.id, local.id)
    out.add_node(glob.id, task=glob)
    for d in range(len(out.graph["devices"])):
        out.add_edge(f"local_sync:d{d}", glob.id)
    return out


def learner_memory_bytes(model_graph: ModelGraph, batch_size: int) -> int:
    """Estimated memory of one learner at batch ``b``, in bytes.

    Parameters, gradients and momentum (3 × 4P bytes for fp32), buffers, and the activations kept
    for backward (every fx node's output at batch b, scaled from the example batch).
    """
    p_bytes = sum(p.numel * _itemsize(p.dtype) for p in model_graph.parameters)
    t_bytes = sum(p.numel * _itemsize(p.dtype) for p in model_graph.parameters if p.trainable)
    b_bytes = sum(b.numel * _itemsize(b.dtype) for b in model_graph.buffers)
    act = sum(meta["bytes"] for meta in model_graph.node_meta.values())
    act = act * batch_size // max(model_graph.example_batch, 1)
    return p_bytes + 2 * t_bytes + b_bytes + act


def annotate_costs(graph: nx.DiGraph, model_graph: ModelGraph) -> nx.DiGraph:
    """Cost annotation: bytes moved by each task per round, and memory per learner in ``meta``."""
    out = graph.copy()
    b = out.graph["batch_size"]
    p4 = 4 * model_graph.num_trainable
    mem = learner_memory_bytes(model_graph, b)
    out.graph["memory_per_learner_bytes"] = mem
    for n in out.nodes:
        task: Task = out.nodes[n]["task"]
        m = len(task.replicas)
        if task.kind is TaskKind.LEARN:
            flops = int(model_graph.meta.get("train_flops_per_sample", 0)) * b
            task.cost = Cost(flops=flops, bytes=mem)
            task.meta["memory_bytes"] = mem
        elif task.kind is TaskKind.LOCAL_SYNC:  # reads w, v, g, z; writes w, v, acc
            task.cost = Cost(flops=8 * m * model_graph.num_trainable,
                             bytes=((3 * m + 1) + (2 * m + 1)) * p4)
        else:  # reads every acc_d, z, z_prev; writes z, z_prev
            g = len(out.graph["devices"])
            task.cost = Cost(flops=4 * model_graph.num_trainable, bytes=(g + 4) * p4)
    return out


def _itemsize(dtype) -> int:
    import torch

    return torch.empty((), dtype=dtype).element_size()
