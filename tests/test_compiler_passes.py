"""Compiler passes and the verifier (docs/design-overview.md §3; docs/contributing.md
rule 2).

Each pass is tested on its own (structure, numbers, input left unchanged); each verifier check
is tested on a graph broken on purpose, and its message must name the offending task.
"""

from __future__ import annotations

import dataclasses

import networkx as nx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch
from torch.nn import functional as F

import crossbow_graph as cg
from crossbow_graph import models
from crossbow_graph.compiler import passes
from crossbow_graph.compiler.analysis import estimate_memory
from crossbow_graph.compiler.passes import (annotate_costs, build_task_graph, empty_task_graph,
                                            insert_sync, place_replicas)
from crossbow_graph.compiler.tasks import Task, TaskKind
from crossbow_graph.compiler.trace import trace_model
from crossbow_graph.compiler.verify import verify_task_graph

DEVICES = ["cpu:0", "cpu:1"]


@pytest.fixture(scope="module")
def lenet_graph():
    return trace_model(models.lenet5(), (torch.randn(2, 1, 28, 28),))


def _empty(m: int = 3, b: int = 16) -> nx.DiGraph:
    return empty_task_graph(devices=DEVICES, replicas_per_device=m, batch_size=b)


def _kinds(graph: nx.DiGraph) -> dict[str, list[Task]]:
    out: dict[str, list[Task]] = {}
    for n in graph:
        t = graph.nodes[n]["task"]
        out.setdefault(t.kind.name, []).append(t)
    return out


def test_place_replicas_makes_one_learn_task_per_replica_device_major():
    g0 = _empty()
    g = place_replicas(g0)
    assert len(g0) == 0, "the pass must not change its input"
    learns = sorted(_kinds(g)["LEARN"], key=lambda t: t.replicas)
    assert [(t.id, t.device, t.replicas) for t in learns] == [
        (f"learn:d{j // 3}:r{j % 3}", DEVICES[j // 3], (j,)) for j in range(6)]
    assert g.number_of_edges() == 0
    verify_task_graph(g, stage="place_replicas")


def test_insert_sync_adds_a_local_sync_per_device_and_one_global_sync():
    placed = place_replicas(_empty())
    g = insert_sync(placed)
    assert len(placed) == 6, "the pass must not change its input"
    kinds = _kinds(g)
    assert [(t.id, t.device, t.replicas) for t in sorted(kinds["LOCAL_SYNC"], key=lambda t: t.id)] == [
        ("local_sync:d0", "cpu:0", (0, 1, 2)), ("local_sync:d1", "cpu:1", (3, 4, 5))]
    (glob,) = kinds["GLOBAL_SYNC"]
    assert glob.device is None and glob.replicas == tuple(range(6))
    assert set(g.edges) == {(f"learn:d{d}:r{r}", f"local_sync:d{d}") for d in range(2) for r in range(3)} | {
        ("local_sync:d0", "global_sync"), ("local_sync:d1", "global_sync")}
    verify_task_graph(g, stage="insert_sync")


def test_annotate_costs_by_hand(lenet_graph):
    synced = insert_sync(place_replicas(_empty(m=3, b=16)))
    g = annotate_costs(synced, lenet_graph)
    p = 61_706
    est = estimate_memory(lenet_graph.analysis, 16, 3)
    assert all(synced.nodes[n]["task"].cost.flops == 0 for n in synced), "input left unchanged"
    kinds = _kinds(g)
    for t in kinds["LEARN"]:
        assert t.cost.flops == 16 * 3 * 852_370 + 4 * p
        assert t.cost.bytes == t.meta["memory_bytes"] == est.total
    for t in kinds["LOCAL_SYNC"]:
        assert t.cost.flops == 8 * 3 * p and t.cost.bytes == (5 * 3 + 2) * 4 * p
    assert kinds["GLOBAL_SYNC"][0].cost.flops == 4 * p
    assert kinds["GLOBAL_SYNC"][0].cost.bytes == (2 + 4) * 4 * p
    assert g.graph["memory_per_learner_bytes"] == est.total
    assert g.graph["memory"] == est.as_dict()
    assert g.graph["model"]["num_trainable"] == p and g.graph["model"]["name"] == "LeNet5"


def test_compile_plan_has_the_passes_output(lenet_graph):
    plan = cg.compile(models.lenet5(), (torch.randn(2, 1, 28, 28),), F.cross_entropy,
                      batch_size=16, devices=["cpu:0", "cpu:1"], replicas=3)
    ref = build_task_graph(lenet_graph, devices=DEVICES, replicas_per_device=3, batch_size=16)
    assert set(plan.task_graph.edges) == set(ref.edges)
    for n in ref:
        assert plan.task_graph.nodes[n]["task"] == ref.nodes[n]["task"]


def test_the_verifier_runs_between_passes_and_names_the_pass(lenet_graph, monkeypatch):
    def drop_one_learn(graph, mg):
        out = graph.copy()
        out.remove_node("learn:d1:r2")
        return out

    monkeypatch.setattr(passes, "PASSES", passes.PASSES[:2] + (("drop_one_learn", drop_one_learn),))
    with pytest.raises(cg.PlanError, match=r"after pass 'drop_one_learn': LOCAL_SYNC 'local_sync:d1' "
                                           r"covers replica 5, which has no LEARN task"):
        build_task_graph(lenet_graph, devices=DEVICES, replicas_per_device=3, batch_size=16)
    g = build_task_graph(lenet_graph, devices=DEVICES, replicas_per_device=3, batch_size=16, verify=False)
    assert "learn:d1:r2" not in g


# -- every verifier check, on a graph broken on purpose ------------------------------------------

def _good() -> nx.DiGraph:
    return insert_sync(place_replicas(_empty(m=2, b=8)))


def _replace(g: nx.DiGraph, node: str, **changes) -> None:
    g.nodes[node]["task"] = dataclasses.replace(g.nodes[node]["task"], **changes)


def _no_task(g):
    g.add_node("stray")


def _wrong_id(g):
    _replace(g, "learn:d0:r1", id="learn:d0:r9")


def _unknown_device(g):
    _replace(g, "learn:d1:r0", device="cuda:7")


def _cycle(g):
    g.add_edge("global_sync", "learn:d0:r0")


def _two_replicas(g):
    _replace(g, "learn:d0:r1", replicas=(1, 2))


def _duplicate_learn(g):
    _replace(g, "learn:d1:r1", replicas=(2,))


def _double_cover(g):
    _replace(g, "local_sync:d1", replicas=(1, 2, 3))


def _cover_without_learn(g):
    _replace(g, "local_sync:d1", replicas=(2, 3, 9))


def _wrong_device_cover(g):
    _replace(g, "local_sync:d0", replicas=(0,))
    _replace(g, "local_sync:d1", replicas=(1, 2, 3))
    g.add_edge("learn:d0:r1", "local_sync:d1")


def _missing_learn_edge(g):
    g.remove_edge("learn:d0:r1", "local_sync:d0")


def _uncovered(g):
    _replace(g, "local_sync:d1", replicas=(2,))


def _two_globals(g):
    g.add_node("global_sync:2", task=Task(id="global_sync:2", kind=TaskKind.GLOBAL_SYNC,
                                          device=None, replicas=(0, 1, 2, 3)))


def _missing_global_edge(g):
    g.remove_edge("local_sync:d1", "global_sync")


@pytest.mark.parametrize("breaker, message", [
    (_no_task, "node 'stray' has no Task with that id"),
    (_wrong_id, "node 'learn:d0:r1' has no Task with that id"),
    (_unknown_device, "task 'learn:d1:r0' is on device 'cuda:7', which is not one of the plan's devices"),
    (_cycle, "cycle through task '"),
    (_two_replicas, "LEARN task 'learn:d0:r1' must own exactly one replica, has (1, 2)"),
    (_duplicate_learn, "replica 2 has two LEARN tasks, 'learn:d1:r0' and 'learn:d1:r1'"),
    (_double_cover, "replica 1 is covered by two LOCAL_SYNC tasks, 'local_sync:d0' and 'local_sync:d1'"),
    (_cover_without_learn, "LOCAL_SYNC 'local_sync:d1' covers replica 9, which has no LEARN task"),
    (_wrong_device_cover, "LOCAL_SYNC 'local_sync:d1' on cpu:1 covers replica 1, which learns on cpu:0"),
    (_missing_learn_edge, "LOCAL_SYNC 'local_sync:d0' does not depend on 'learn:d0:r1'"),
    (_uncovered, "replica 3 (task 'learn:d1:r1') is covered by no LOCAL_SYNC task"),
    (_two_globals, "expected one GLOBAL_SYNC task, found 2"),
    (_missing_global_edge, "GLOBAL_SYNC does not depend on 'local_sync:d1'"),
])
def test_each_verifier_check_names_the_offending_task(breaker, message):
    g = _good()
    verify_task_graph(g)
    breaker(g)
    with pytest.raises(cg.PlanError) as info:
        verify_task_graph(g, stage="test")
    assert "after pass 'test'" in str(info.value)
    assert message in str(info.value)


def test_memory_check_names_the_device_and_its_tasks(lenet_graph):
    g = annotate_costs(_good(), lenet_graph)
    mem = g.graph["memory_per_learner_bytes"]
    verify_task_graph(g, memory_budget_bytes=2 * mem)
    with pytest.raises(cg.PlanError, match=r"2 replicas × .* exceed the .* budget of cpu:0 "
                                           r"\(tasks learn:d0:r0, learn:d0:r1\); at most 1 replica"):
        verify_task_graph(g, memory_budget_bytes=2 * mem - 1)


@settings(max_examples=25, deadline=None)
@given(num_devices=st.integers(1, 5), m=st.integers(1, 6), b=st.integers(1, 64))
def test_any_plan_shape_verifies_and_survives_json(lenet_graph, num_devices, m, b):
    from crossbow_graph.compiler.inspect import from_json, to_json

    devices = [f"cpu:{i}" for i in range(num_devices)]
    g = build_task_graph(lenet_graph, devices=devices, replicas_per_device=m, batch_size=b)
    kinds = _kinds(g)
    assert (len(kinds["LEARN"]), len(kinds["LOCAL_SYNC"]), len(kinds["GLOBAL_SYNC"])) == (num_devices * m, num_devices, 1)
    assert sorted(j for t in kinds["LOCAL_SYNC"] for j in t.replicas) == list(range(num_devices * m))
    assert g.number_of_edges() == num_devices * m + num_devices
    back = from_json(to_json(g)).task_graph
    assert set(back.edges) == set(g.edges)
    assert all(back.nodes[n]["task"] == g.nodes[n]["task"] for n in g)
