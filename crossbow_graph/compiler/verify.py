"""The verifier that runs between compiler passes (docs/design-overview.md §3; docs/contributing.md rule 2)."""

from __future__ import annotations

import networkx as nx

from ..errors import PlanError
from .analysis import MEMORY_PARTS
from .tasks import Task, TaskKind

__all__ = ["verify_task_graph"]


def verify_task_graph(graph: nx.DiGraph, *, stage: str = "", memory_budget_bytes: int | None = None) -> None:
    """Check ``graph`` after the pass ``stage`` against the rules of docs/compiler.md §4 (order,
    ownership, one sync per replica, ``memory_budget_bytes`` per device, None: no bound).
    Raises PlanError at the first violation, naming the pass and the task (for memory: the device,
    its LEARN tasks and the estimate's arithmetic)."""
    where = f"task graph after pass '{stage}'" if stage else "task graph"
    tasks = _tasks(graph, where)
    learn_of = _learners(tasks, where)
    locals_ = [t for t in tasks.values() if t.kind is TaskKind.LOCAL_SYNC]
    globals_ = [t for t in tasks.values() if t.kind is TaskKind.GLOBAL_SYNC]
    if locals_ or globals_:
        _syncs(graph, tasks, learn_of, locals_, globals_, where)
    mem = graph.graph.get("memory_per_learner_bytes")
    if mem is not None and memory_budget_bytes is not None:
        for device in graph.graph["devices"]:
            mine = sorted(t.id for t in tasks.values() if t.kind is TaskKind.LEARN and t.device == device)
            if len(mine) * mem > memory_budget_bytes:
                raise PlanError(_memory_message(graph, device, mine, mem, memory_budget_bytes))


def _tasks(graph: nx.DiGraph, where: str) -> dict[str, Task]:
    """Node id → its Task; each on one of the plan's devices, and no cycle."""
    devices = graph.graph["devices"]
    tasks: dict[str, Task] = {}
    for n, data in graph.nodes(data=True):
        task = data.get("task")
        if not isinstance(task, Task) or task.id != n:
            raise PlanError(f"{where}: node '{n}' has no Task with that id")
        if task.device is not None and task.device not in devices:
            raise PlanError(f"{where}: task '{n}' is on device '{task.device}', "
                            f"which is not one of the plan's devices {devices}")
        tasks[n] = task
    if not nx.is_directed_acyclic_graph(graph):
        cycle = nx.find_cycle(graph)
        raise PlanError(f"{where}: cycle through task '{cycle[0][0]}': {cycle}")
    return tasks


def _learners(tasks: dict[str, Task], where: str) -> dict[int, str]:
    """Replica j → its LEARN task's id: each LEARN task owns one replica, each replica one task."""
    learn_of: dict[int, str] = {}
    for t in tasks.values():
        if t.kind is TaskKind.LEARN:
            if len(t.replicas) != 1:
                raise PlanError(f"{where}: LEARN task '{t.id}' must own exactly one replica, "
                                f"has {t.replicas}")
            j = t.replicas[0]
            if j in learn_of:
                raise PlanError(f"{where}: replica {j} has two LEARN tasks, "
                                f"'{learn_of[j]}' and '{t.id}'")
            learn_of[j] = t.id
    return learn_of


def _syncs(graph: nx.DiGraph, tasks: dict[str, Task], learn_of: dict[int, str],
           locals_: list[Task], globals_: list[Task], where: str) -> None:
    """Every replica in one LOCAL_SYNC on its LEARN task's device, after it; one GLOBAL_SYNC
    after every LOCAL_SYNC."""
    covered: dict[int, str] = {}
    for t in locals_:
        for j in t.replicas:
            if j in covered:
                raise PlanError(f"{where}: replica {j} is covered by two LOCAL_SYNC tasks, "
                                f"'{covered[j]}' and '{t.id}'")
            covered[j] = t.id
            learn = learn_of.get(j)
            if learn is None:
                raise PlanError(f"{where}: LOCAL_SYNC '{t.id}' covers replica {j}, "
                                "which has no LEARN task")
            if tasks[learn].device != t.device:
                raise PlanError(f"{where}: LOCAL_SYNC '{t.id}' on {t.device} covers "
                                f"replica {j}, which learns on {tasks[learn].device}")
            if not graph.has_edge(learn, t.id):
                raise PlanError(f"{where}: LOCAL_SYNC '{t.id}' does not depend on '{learn}'")
    for j, learn in learn_of.items():
        if j not in covered:
            raise PlanError(f"{where}: replica {j} (task '{learn}') is covered by no LOCAL_SYNC task")
    if len(globals_) != 1:
        raise PlanError(f"{where}: expected one GLOBAL_SYNC task, found {len(globals_)}")
    for t in locals_:
        if not graph.has_edge(t.id, globals_[0].id):
            raise PlanError(f"{where}: GLOBAL_SYNC does not depend on '{t.id}'")


def _memory_message(graph: nx.DiGraph, device: str, learns: list[str], mem: int, budget: int) -> str:
    """The arithmetic of a memory overflow: parts per learner, the total, how many fit."""
    m = len(learns)
    mib = 2**20
    parts = graph.graph.get("memory") or {}
    shared = parts.get("flat_share", 0) * m
    own = mem - parts.get("flat_share", 0)
    fit = max(0, (budget - shared) // own) if own > 0 else 0
    detail = ""
    if parts:
        names = MEMORY_PARTS
        shown = [n for n in names if parts.get(n) or n in parts and n != "library"]  # library: CUDA
        detail = " (" + " + ".join(f"{n} {parts[n] / mib:.3g}" for n in shown) + \
            f" MiB at batch {parts.get('batch_size')})"
    advice = (f"at most {fit} replica(s) fit: lower the replicas per device to {fit} or the batch "
              "size, or raise memory_budget") if fit else \
        "not even one replica fits: lower the batch size or raise memory_budget"
    return (f"{m} replicas × {mem / mib:.3g} MiB per learner{detail} = {m * mem / mib:.3g} MiB "
            f"exceed the {budget / mib:.3g} MiB budget of {device} (tasks {', '.join(learns)}); "
            + advice)
