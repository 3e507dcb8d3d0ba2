"""The task graph as the program of a round, and the interpreter that runs it one method per
task kind (docs/runtime.md, "The interpreter"; docs/design-overview.md §3, §5)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import networkx as nx

from ...compiler.tasks import Task, TaskKind
from ...errors import PlanError, TaskError

__all__ = ["RoundInterpreter", "RoundProgram", "task_error", "cause_text"]

# the closed vocabulary, one interpreter method each (compared by identity: an Enum hashes in Python)
_LEARN, _LOCAL_SYNC, _GLOBAL_SYNC = TaskKind.LEARN, TaskKind.LOCAL_SYNC, TaskKind.GLOBAL_SYNC
assert set(TaskKind) == {_LEARN, _LOCAL_SYNC, _GLOBAL_SYNC}, "every TaskKind needs a method"


def task_error(task: Task, round_index: int, what: str) -> TaskError:
    """The TaskError for ``task`` failing in round ``round_index`` with ``what``."""
    return TaskError(
        f"task '{task.id}' ({task.kind.name} on {task.device or 'all devices'}) failed "
        f"in round {round_index}: {what}",
        task_id=task.id, device=str(task.device), round_index=round_index,
    )


def cause_text(err: TaskError) -> str:
    """What a TaskError of ``run_task`` wraps, as ``"Type: message"`` (to re-raise it elsewhere)."""
    cause = err.__cause__ or err
    return f"{type(cause).__name__}: {cause}"


class RoundInterpreter:
    """Runs tasks by kind, one method per TaskKind (subclasses implement them); each method
    gets the task and the round's ``RoundEnv`` (engine/rounds/backend.py)."""

    def run(self, tasks: Iterable[Task], env: Any) -> None:
        """Run ``tasks`` in the given order (a topological order of the task graph)."""
        for task in tasks:
            self.run_task(task, env)

    def run_task(self, task: Task, env: Any) -> None:
        """Run one task with the method of its kind: ``learn``, ``local_sync`` or ``global_sync``.

        Raises:
            TaskError: the task failed (names the task, its device and ``env.round_index``); a
                TaskError raised by the method itself passes unchanged."""
        kind = task.kind
        try:
            if kind is _LEARN:
                self.learn(task, env)
            elif kind is _LOCAL_SYNC:
                self.local_sync(task, env)
            else:
                self.global_sync(task, env)
        except TaskError:
            raise
        except Exception as exc:
            raise task_error(task, env.round_index, f"{type(exc).__name__}: {exc}") from exc

    def learn(self, task: Task, env: Any) -> None:
        """LEARN: forward and backward of ``task.replicas[0]``."""
        raise NotImplementedError

    def local_sync(self, task: Task, env: Any) -> None:
        """LOCAL_SYNC: the local update and correction sum of ``task.replicas``."""
        raise NotImplementedError

    def global_sync(self, task: Task, env: Any) -> None:
        """GLOBAL_SYNC: the sum of the devices' corrections and the update of z."""
        raise NotImplementedError


@dataclass(frozen=True)
class RoundProgram:
    """A task graph as the executors run it (``RoundProgram.of``), computed once per graph.

    Attributes:
        tasks: every task in topological order (ties broken by device, kind, then id).
        device: task id → index of its device in the plan's device order (LEARN, LOCAL_SYNC).
        rows: task id → the rows ``(a, b)`` of its device's flat buffers: ``(r, r + 1)`` for a
            LEARN of replica j = first[d] + r, the contiguous run of its replicas for a LOCAL_SYNC.
        first: per device, the global index of its replica 0 in this process.
        global_sync: the GLOBAL_SYNC task.
        synced: the devices with a LOCAL_SYNC, in order (whose sums acc_d the global sync adds)."""

    tasks: tuple[Task, ...]
    device: dict[str, int]
    rows: dict[str, tuple[int, int]]
    first: tuple[int, ...]
    global_sync: Task
    synced: tuple[int, ...]

    @classmethod
    def of(cls, graph: nx.DiGraph, devices: Sequence[str], replicas: Sequence[int]) -> "RoundProgram":
        """Read ``graph`` for a process whose devices ``devices`` hold ``replicas`` replicas each.

        Raises:
            PlanError: the graph is one the executors cannot run (names the task): a task on a
                device the plan does not have, a LEARN of a replica its device does not hold, a
                LOCAL_SYNC whose replicas are not a contiguous run of its device's, two
                LOCAL_SYNC tasks on one device, no LOCAL_SYNC at all, or not exactly one
                GLOBAL_SYNC."""
        order = tuple(graph.nodes[n]["task"]
                      for n in nx.lexicographical_topological_sort(graph, key=_sort_key(graph)))
        index = {name: d for d, name in enumerate(devices)}
        first = tuple(sum(replicas[:d]) for d in range(len(devices)))
        device, rows, synced, globals_ = {}, {}, [], []
        for task in order:
            if task.kind is TaskKind.GLOBAL_SYNC:
                globals_.append(task)
                continue
            d = index.get(task.device)
            if d is None:
                raise PlanError(f"task '{task.id}' runs on {task.device!r}, which is not one of this "
                                f"process's devices {list(devices)}")
            device[task.id] = d
            rows[task.id] = _rows(task, first[d], replicas[d])
            if task.kind is TaskKind.LOCAL_SYNC:
                if d in synced:
                    raise PlanError(f"task '{task.id}' is a second LOCAL_SYNC on {task.device}; the "
                                    "executors run one per device (its sum is the device's acc_d)")
                synced.append(d)
        if len(globals_) != 1 or not synced:
            found = f"{len(globals_)} GLOBAL_SYNC and {len(synced)} LOCAL_SYNC tasks"
            raise PlanError(f"the task graph has {found}; the executors run exactly one "
                            "GLOBAL_SYNC and at least one LOCAL_SYNC per round (compiler pass "
                            "insert_sync adds them)")
        return cls(tasks=order, device=device, rows=rows, first=first, global_sync=globals_[0],
                   synced=tuple(sorted(synced)))

    def learn_runs(self, learns: Sequence[Task]) -> dict[str, tuple[int, int]]:
        """For fused learners, which run contiguous rows as one program: the LEARN tasks
        ``learns`` (of one device) split into runs of contiguous rows; returns the first task of
        each run (in the order of ``learns``) → the run's rows ``(a, b)``. The other tasks of a
        run have nothing left to do."""
        spans = sorted((self.rows[t.id][0], i) for i, t in enumerate(learns))
        runs: dict[str, tuple[int, int]] = {}
        k = 0
        while k < len(spans):
            end = k + 1
            while end < len(spans) and spans[end][0] == spans[end - 1][0] + 1:
                end += 1
            lead = learns[min(i for _, i in spans[k:end])]
            runs[lead.id] = (spans[k][0], spans[end - 1][0] + 1)
            k = end
        return runs


def _rows(task: Task, first: int, m: int) -> tuple[int, int]:
    """The rows (a, b) of its device that a LEARN or LOCAL_SYNC task works on."""
    local = [j - first for j in task.replicas]
    if not local or any(not 0 <= r < m for r in local):
        raise PlanError(f"task '{task.id}' covers replicas {list(task.replicas)}, but {task.device} "
                        f"holds replicas {first}…{first + m - 1}")
    a, b = min(local), max(local) + 1
    if sorted(local) != list(range(a, b)):
        raise PlanError(f"task '{task.id}' covers replicas {list(task.replicas)}, not a contiguous "
                        f"run of {task.device}'s replicas; the executors update contiguous rows")
    return a, b


def _sort_key(graph: nx.DiGraph):
    rank = {TaskKind.LEARN: 0, TaskKind.LOCAL_SYNC: 1, TaskKind.GLOBAL_SYNC: 2}

    def key(n: str) -> tuple:
        task: Task = graph.nodes[n]["task"]
        return (task.device or "~", rank[task.kind], n)

    return key
