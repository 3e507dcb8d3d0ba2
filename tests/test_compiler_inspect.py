"""Inspection: summary, JSON round-trip, DOT, PNG, and the inspect CLI."""

from __future__ import annotations

import json
import shutil
import sys
import textwrap

import pytest

import crossbow_graph as cg
from crossbow_graph import cli, models
from crossbow_graph.compiler.inspect import PlanView, from_json

from _plans import make_plan

needs_dot = pytest.mark.skipif(shutil.which("dot") is None, reason="graphviz 'dot' not installed")


@pytest.fixture(scope="module")
def plan():
    return make_plan(models.lenet5, seed=None, input_shape=(1, 28, 28), batch_size=16, optimizer=None,
                     devices=["cpu:0", "cpu:1"], replicas=3)


def test_summary_has_a_row_per_device_with_replicas_tasks_flops_and_memory(plan):
    text = plan.summary()
    mem = plan.task_graph.graph["memory_per_learner_bytes"]
    learn_gflop = 3 * (16 * 3 * 852_370 + 4 * 61_706) / 1e9
    local_gflop = 8 * 3 * 61_706 / 1e9
    for device in ("cpu:0", "cpu:1"):
        row = next(line for line in text.splitlines() if line.startswith(device)).split()
        assert row[1:4] == ["3", "3", "1"]
        assert float(row[4]) == pytest.approx(learn_gflop + local_gflop, abs=1e-4)
        assert float(row[5]) == pytest.approx(3 * mem / 2**20, abs=0.01)
    assert "2 device(s) × 3 replica(s) = 6 learners, batch 16" in text
    assert "61,706 trainable parameters" in text and "α=0.5, β=2.28" in text
    settings = json.loads(plan.to_json())["settings"]  # resolved: γ = β/(k·α) = 2.28/(6·0.5)
    assert settings["alpha"] == 0.5 and settings["centre_gain"] == pytest.approx(0.76, rel=1e-12)
    assert "GLOBAL_SYNC 'global_sync': all-reduce of 246,824 bytes" in text


def test_json_round_trip_keeps_every_task_edge_and_the_summary(plan):
    text = plan.to_json()
    doc = json.loads(text)
    assert doc["schema"] == "crossbow_graph.plan/2"
    assert set(doc["tasks"][0]) == {"id", "kind", "device", "replicas", "cost", "meta"}
    assert set(doc["tasks"][0]["cost"]) == {"flops", "bytes"}
    assert sorted(t["kind"] for t in doc["tasks"]) == ["global_sync"] + ["learn"] * 6 + ["local_sync"] * 2
    view = cg.Plan.from_json(text)
    assert isinstance(view, PlanView)
    assert set(view.task_graph.edges) == set(plan.task_graph.edges)
    for n in plan.task_graph:
        assert view.task_graph.nodes[n]["task"] == plan.task_graph.nodes[n]["task"]
    assert view.task_graph.graph == plan.task_graph.graph
    assert view.summary() == plan.summary()
    assert view.to_json() == text
    assert (view.devices, view.replicas_per_device, view.num_learners, view.batch_size) == (
        ["cpu:0", "cpu:1"], 3, 6, 16)


def test_a_plan_1_document_still_loads(plan):
    """Schema plan/1 also listed buffer names per task and a cost in seconds that was never set."""
    doc = json.loads(plan.to_json())
    doc["schema"] = "crossbow_graph.plan/1"
    for t in doc["tasks"]:
        t.update(inputs=["w[0]"], outputs=["g[0]"])
        t["cost"]["seconds"] = None
    view = from_json(json.dumps(doc))
    assert view.summary() == plan.summary() and view.to_json() == plan.to_json()


def test_a_loaded_plan_cannot_train(plan):
    view = cg.Plan.from_json(plan.to_json())
    with pytest.raises(cg.PlanError, match=r"fit\(\) needs training state.*crossbow_graph.compile"):
        view.fit(None, 1)
    with pytest.raises(cg.PlanError, match=r"evaluate\(\) needs training state"):
        view.evaluate(None)


def test_from_json_rejects_bad_documents_with_the_reason(plan):
    doc = json.loads(plan.to_json())
    with pytest.raises(ValueError, match="schema is 'other/1', expected 'crossbow_graph.plan/2'"):
        from_json(json.dumps({**doc, "schema": "other/1"}))
    bad = json.loads(plan.to_json())
    bad["tasks"][0]["kind"] = "teach"
    with pytest.raises(ValueError, match=r"task #0 \('learn:d0:r0'\) is malformed"):
        from_json(json.dumps(bad))
    cut = json.loads(plan.to_json())
    cut["edges"] = [e for e in cut["edges"] if e != ["learn:d0:r1", "local_sync:d0"]]
    with pytest.raises(cg.PlanError, match="after pass 'from_json': LOCAL_SYNC 'local_sync:d0' "
                                           "does not depend on 'learn:d0:r1'"):
        from_json(json.dumps(cut))
    with pytest.raises(ValueError, match="not a plan JSON document"):
        from_json("{")


def test_dot_has_a_cluster_per_device_and_every_task(plan):
    dot = plan.to_dot()
    assert dot.count("subgraph cluster_") == 2
    assert 'label="cpu:0: 3 replica(s)' in dot and 'label="cpu:1: 3 replica(s)' in dot
    for n in plan.task_graph:
        assert f'"{n}"' in dot
    assert '"local_sync:d1" -> "global_sync"' in dot
    cluster0 = dot[dot.index("subgraph cluster_d0"):dot.index("subgraph cluster_d1")]
    assert '"learn:d0:r2"' in cluster0 and '"learn:d1:r0"' not in cluster0
    assert '"global_sync"' not in cluster0


def test_dot_quotes_names_with_quotes_and_backslashes(plan, tmp_path, monkeypatch):
    doc = json.loads(plan.to_json())
    doc["graph"]["model"]["name"] = 'my "net" \\ v2'
    dot = from_json(json.dumps(doc)).to_dot()
    assert 'label="my \\"net\\" \\\\ v2: 2 device(s)' in dot
    if shutil.which("dot") is not None:
        assert from_json(json.dumps(doc)).draw(tmp_path / "q.svg").read_text().count("<svg") == 1
    monkeypatch.setenv("PATH", str(tmp_path))  # no graphviz 'dot' on PATH
    with pytest.raises(RuntimeError, match="install graphviz"):
        plan.draw(tmp_path / "plan.png")


@needs_dot
def test_draw_writes_a_png(plan, tmp_path):
    path = plan.draw(tmp_path / "plan.png")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    with pytest.raises(ValueError, match="use a .png, .svg or .pdf"):
        plan.draw(tmp_path / "plan.gif")


@needs_dot
def test_cli_inspect_resnet32_acceptance(tmp_path, capsys):
    js, png = tmp_path / "g.json", tmp_path / "g.png"
    assert cli.main(["inspect", "--model", "resnet32", "--devices", "2", "--replicas", "3",
                     "--batch-size", "16", "--json", str(js), "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert "CifarResNet, 2 device(s) × 3 replica(s) = 6 learners" in out
    kinds = [t["kind"] for t in json.loads(js.read_text())["tasks"]]
    assert (kinds.count("learn"), kinds.count("local_sync"), kinds.count("global_sync")) == (6, 2, 1)
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_cli_inspect_a_user_model_needs_an_input_shape(tmp_path, monkeypatch, capsys):
    (tmp_path / "usermodels.py").write_text(textwrap.dedent("""
        from torch import nn
        def tiny():
            return nn.Sequential(nn.Flatten(), nn.Linear(12, 5))
        def shaped():
            m = tiny()
            m.input_shape = (3, 4)
            return m
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    assert cli.main(["inspect", "--model", "usermodels:tiny"]) == 2
    assert "its input shape is unknown; pass --input-shape" in capsys.readouterr().err
    assert cli.main(["inspect", "--model", "usermodels:tiny", "--input-shape", "3,4",
                     "--dot", "t.dot"]) == 0
    out = capsys.readouterr().out
    assert "65 trainable parameters" in out
    # compile's default optimizer, with its numbers
    assert "optimizer: SGD(lr=0.01, momentum=0.9, nesterov=False, weight_decay=0.0)" in out
    assert "cluster_d0" in (tmp_path / "t.dot").read_text()
    assert cli.main(["inspect", "--model", "usermodels:shaped", "--devices", "2"]) == 0
    assert cli.main(["inspect", "--model", "usermodels:nothing"]) == 2
    assert "cannot load it" in capsys.readouterr().err
    sys.modules.pop("usermodels", None)


def test_cli_inspect_memory_budget_error_exits_2(capsys):
    assert cli.main(["inspect", "--model", "lenet5", "--replicas", "4", "--batch-size", "64",
                     "--memory-budget", "10"]) == 2
    err = capsys.readouterr().err
    assert "crossbow-graph inspect: error: 4 replicas ×" in err and "budget of" in err
