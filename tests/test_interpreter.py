"""The task graph is the program: a compiler pass that edits it changes what both executors run
(engine/rounds/interpreter.py), and a graph they cannot run is a PlanError naming the task."""

from __future__ import annotations

import dataclasses
import multiprocessing

import pytest
import torch

import crossbow_graph as cg
from crossbow_graph.compiler import passes
from crossbow_graph.compiler.tasks import TaskKind

from _plans import TinyNet, make_plan, tiny_data
from _reference import batches_of, flat, reference_sma

TOL = dict(rtol=1e-5, atol=1e-6)
LR, MOMENTUM, MU_Z, B = 0.05, 0.9, 0.9, 4


def _without_replica(j: int):
    """A compiler pass: replica j gets no LEARN task and is left out of its LOCAL_SYNC."""

    def freeze(graph, model_graph):
        out = graph.copy()
        out.remove_node(next(n for n, t in out.nodes(data="task")
                             if t.kind is TaskKind.LEARN and t.replicas == (j,)))
        for n, t in list(out.nodes(data="task")):
            if t.kind is TaskKind.LOCAL_SYNC and j in t.replicas:
                rest = tuple(r for r in t.replicas if r != j)
                out.nodes[n]["task"] = dataclasses.replace(t, replicas=rest)
        return out

    return freeze


@pytest.mark.distributed  # the process executor forks worker processes
@pytest.mark.parametrize("devices,replicas,frozen,mode", [
    (1, 3, 2, "per_replica"),  # the worker's group has no task: the coordinator runs the global sync
    (2, 2, 0, "per_replica"),  # device 0's LOCAL_SYNC covers row 1 only
    (2, 2, 0, "fused"),        # device 0's fused program runs row 1 only
])
def test_a_pass_that_removes_a_replicas_tasks_changes_what_both_executors_run(
        monkeypatch, devices, replicas, frozen, mode):
    rounds, k = 4, devices * replicas
    data = tiny_data(B * k * rounds)
    torch.manual_seed(0)
    # replica `frozen` neither learns nor is corrected (its samples go unused); α = 1/k counts it
    want_z, want_w = reference_sma(TinyNet(), batches_of(data, B), k=k, rounds=rounds, lr=LR,
                                   momentum=MOMENTUM, central_momentum=MU_Z, frozen=(frozen,))
    unedited = make_plan(devices=devices, replicas=replicas, learner_mode=mode, executor="inline")
    unedited.fit(data, 1, shuffle=False, progress=False)
    monkeypatch.setattr(passes, "PASSES", passes.PASSES + (("freeze", _without_replica(frozen)),))
    for executor in ("inline", "process"):
        plan = make_plan(devices=devices, replicas=replicas, learner_mode=mode, executor=executor)
        assert f"learn:d0:r{frozen % replicas}" not in plan.task_graph  # the pass ran
        w0 = plan.replica_weights()[frozen].clone()
        plan.fit(data, 1, shuffle=False, progress=False)
        assert plan.rounds.resolved_executor() == executor
        assert torch.equal(plan.replica_weights()[frozen], w0)  # it never learned
        torch.testing.assert_close(plan.central_weights(), flat(want_z), **TOL)
        torch.testing.assert_close(plan.replica_weights(), torch.stack([flat(r) for r in want_w]), **TOL)
        assert not torch.allclose(plan.central_weights(), unedited.central_weights(), **TOL)
    assert multiprocessing.active_children() == []


@pytest.mark.parametrize("executor", ["inline", "process"])
def test_a_graph_the_executors_cannot_run_is_a_plan_error_naming_the_task(monkeypatch, executor):
    # without replica 1's tasks, the LOCAL_SYNC of 0, 1, 2 covers 0 and 2: the verifier accepts
    # it, but the executors update contiguous rows
    monkeypatch.setattr(passes, "PASSES", passes.PASSES + (("freeze", _without_replica(1)),))
    with pytest.raises(cg.PlanError, match=r"task 'local_sync:d0' covers replicas \[0, 2\], not a "
                                           r"contiguous run of cpu:0's replicas"):
        make_plan(replicas=3, executor=executor)
