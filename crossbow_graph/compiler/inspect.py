"""Inspection of a plan's task graph and settings: summary, JSON, DOT, PNG and ``PlanView``
(docs/compiler.md §5)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import networkx as nx

from ..errors import PlanError
from .analysis import MEMORY_PARTS
from .passes import build_task_graph
from .tasks import Cost, Task, TaskKind
from .trace import trace_model
from .verify import verify_task_graph

__all__ = ["SCHEMA", "Inspectable", "PlanView", "summary", "to_json", "from_json", "to_dot", "draw",
           "inspect_model", "optimizer_text"]

#: The ``schema`` field of every JSON document ``to_json`` writes.
SCHEMA = "crossbow_graph.plan/2"
#: Schemas ``from_json`` reads: plan/1 also listed buffer names per task and ``cost.seconds``,
#: which nothing read (they are ignored).
READABLE_SCHEMAS = (SCHEMA, "crossbow_graph.plan/1")

_MIB = 2**20
#: How each tracer's analysis is named in the summary (compiler/trace.py, docs/compiler.md §1).
_TRACERS = {"transformers.fx": "transformers' fx trace",
            "eager": "one measured eager forward: matrix products, convolutions, attention",
            "none": "no analysis: FLOPs and activations unknown"}
_COLORS = {TaskKind.LEARN: "#dbe9f6", TaskKind.LOCAL_SYNC: "#fde9c8", TaskKind.GLOBAL_SYNC: "#f6d3d3"}


def _tasks(graph: nx.DiGraph) -> list[Task]:
    return [graph.nodes[n]["task"] for n in graph.nodes]


def optimizer_text(opt: dict[str, Any]) -> str:
    """``AdamW(lr=0.001, ...)``: the class, its first group's numbers, the number of groups."""
    groups = opt.get("groups") or [{}]
    name = str(opt.get("class", "SGD")).rsplit(".", 1)[-1]
    shown = ("lr", "momentum", "betas", "nesterov", "weight_decay", "eps", "alpha")
    args = ", ".join(f"{k}={groups[0][k]}" for k in shown if k in groups[0])
    more = f"; {len(groups)} param groups" if len(groups) > 1 else ""
    return f"{name}({args}){more}"


def summary(graph: nx.DiGraph, settings: dict[str, Any] | None = None) -> str:
    """Lines of a text table per device of ``graph`` (annotated): replicas, tasks, GFLOP per
    round, memory in MiB; then the global sync; ``settings`` (optimizer, sync, ``sync_rule``: the
    sync algorithm's ``summary_rule``, α) in the header."""
    g = graph.graph
    devices, m, b = list(g["devices"]), int(g["replicas_per_device"]), int(g["batch_size"])
    k = len(devices) * m
    model = g.get("model", {})
    mem = int(g.get("memory_per_learner_bytes", 0))
    parts = g.get("memory", {})
    lines = [
        f"crossbow_graph plan: {model.get('name', '?')}, {len(devices)} device(s) × {m} replica(s) "
        f"= {k} learners, batch {b} per learner ({k * b} samples per round)",
    ]
    if model:
        lines.append(
            f"model: {model['num_trainable']:,} trainable parameters of {model['num_parameters']:,}, "
            f"{model['num_buffers']:,} buffer scalars; forward "
            f"{model['forward_flops_per_sample'] / 1e6:,.2f} MFLOP/sample, training step "
            f"{model['train_flops_per_sample'] / 1e6:,.2f} MFLOP/sample"
            + (f" (from {_TRACERS.get(model['tracer'], model['tracer'])})"
               if model.get("tracer", "torch.fx") != "torch.fx" else ""))
        if model.get("untraced"):  # no fx graph: why, and what inspection lost
            lines.append(f"trace: {model['untraced']}. Inspection is approximate: "
                         f"{model.get('lost', '')}")
    if parts:
        names = MEMORY_PARTS
        shown = [n for n in names if parts.get(n) or n in parts and n != "library"]  # library: CUDA
        lines.append(f"memory per learner ≈ {mem / _MIB:.2f} MiB = "
                     + " + ".join(f"{n} {parts[n] / _MIB:.2f}" for n in shown))
    if settings:
        opt, sync = settings.get("optimizer", {}), settings.get("sync", {})
        fields = ", ".join(f"{key}={value}" for key, value in sync.items() if key != "name")
        rule = settings.get("sync_rule") or f"{sync.get('name', 'SMA')}({fields})"  # summary_rule
        lines.append(f"sync: {rule}; optimizer: {optimizer_text(opt)}")
    header = f"{'device':<10}{'replicas':>9}{'LEARN':>7}{'LOCAL_SYNC':>12}{'GFLOP/round':>13}{'memory MiB':>12}"
    lines += [header, "-" * len(header)]
    tasks = _tasks(graph)
    total_flops = 0
    for device in devices:
        mine = [t for t in tasks if t.device == device]
        learns = [t for t in mine if t.kind is TaskKind.LEARN]
        n_local = sum(1 for t in mine if t.kind is TaskKind.LOCAL_SYNC)
        replicas = sorted(j for t in learns for j in t.replicas)
        flops = sum(t.cost.flops for t in mine)
        total_flops += flops
        lines.append(f"{device:<10}{len(replicas):>9}{len(learns):>7}{n_local:>12}"
                     f"{flops / 1e9:>13.4f}{len(learns) * mem / _MIB:>12.2f}")
    for t in tasks:
        if t.kind is TaskKind.GLOBAL_SYNC:
            total_flops += t.cost.flops
            lines.append(f"{'(global)':<10}{len(t.replicas):>9}{'':>7}{'':>12}{t.cost.flops / 1e9:>13.4f}"
                         f"{'':>12}  GLOBAL_SYNC '{t.id}': all-reduce of "
                         f"{4 * model.get('num_trainable', 0):,} bytes per device")
    lines.append(f"{'total':<10}{k:>9}{'':>7}{'':>12}{total_flops / 1e9:>13.4f}"
                 f"{k * mem / _MIB:>12.2f}")
    return "\n".join(lines)


def _task_to_dict(t: Task) -> dict[str, Any]:
    return {"id": t.id, "kind": t.kind.value, "device": t.device, "replicas": list(t.replicas),
            "cost": {"flops": t.cost.flops, "bytes": t.cost.bytes}, "meta": t.meta}


def to_json(graph: nx.DiGraph, settings: dict[str, Any] | None = None, *, indent: int | None = 2) -> str:
    """The task graph and ``settings`` as a JSON document of schema ``crossbow_graph.plan/2``
    (docs/compiler.md, "JSON schema crossbow_graph.plan/2"). Raises TypeError for a value that is
    not JSON-serialisable."""
    doc = {
        "schema": SCHEMA,
        "graph": dict(graph.graph),
        "settings": settings or {},
        "tasks": [_task_to_dict(t) for t in _tasks(graph)],
        "edges": [[u, v] for u, v in graph.edges],
    }
    return json.dumps(doc, indent=indent, ensure_ascii=False)


def _load(text: str) -> tuple[nx.DiGraph, dict[str, Any]]:
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not a plan JSON document: {exc}") from exc
    if not isinstance(doc, dict) or doc.get("schema") not in READABLE_SCHEMAS:
        found = doc.get("schema") if isinstance(doc, dict) else type(doc).__name__
        raise ValueError(f"not a plan JSON document: schema is {found!r}, expected {SCHEMA!r}; "
                         "write it with plan.to_json()")
    for key in ("graph", "tasks", "edges"):
        if key not in doc:
            raise ValueError(f"plan JSON document lacks '{key}' (schema {SCHEMA}, docs/compiler.md)")
    graph = nx.DiGraph()
    graph.graph.update(doc["graph"])
    kinds = {k.value: k for k in TaskKind}
    for i, d in enumerate(doc["tasks"]):
        try:
            kind = kinds[d["kind"]]
            cost = Cost(flops=d["cost"]["flops"], bytes=d["cost"]["bytes"])
            task = Task(id=d["id"], kind=kind, device=d["device"], replicas=tuple(d["replicas"]),
                        cost=cost, meta=dict(d.get("meta", {})))
        except (KeyError, TypeError) as exc:
            raise ValueError(f"plan JSON document: task #{i} ('{d.get('id', '?')}') is malformed: "
                             f"{type(exc).__name__}: {exc}; kinds are {sorted(kinds)}") from exc
        graph.add_node(task.id, task=task)
    for u, v in doc["edges"]:
        if u not in graph or v not in graph:
            raise ValueError(f"plan JSON document: edge {u!r} → {v!r} names a task that is not listed")
        graph.add_edge(u, v)
    return graph, doc.get("settings", {})


def from_json(text: str, *, verify: bool = True) -> "PlanView":
    """The PlanView of a ``to_json`` document (schema ``/2`` or ``/1``), verified when ``verify``.

    Raises:
        ValueError: not a plan document, or a malformed task or edge (names the task).
        PlanError: the task graph fails the verifier (names the task)."""
    graph, settings = _load(text)
    if verify:
        verify_task_graph(graph, stage="from_json")
    return PlanView(graph, settings)


def _node_label(t: Task) -> str:
    if t.kind is TaskKind.LEARN:
        what = f"LEARN replica {t.replicas[0]}"
        mem = t.meta.get("memory_bytes")
        extra = f"\n{t.cost.flops / 1e9:.2f} GFLOP" + (f" · {mem / _MIB:.1f} MiB" if mem else "")
    elif t.kind is TaskKind.LOCAL_SYNC:
        what = f"LOCAL_SYNC replicas {t.replicas[0]}–{t.replicas[-1]}" if t.replicas else "LOCAL_SYNC"
        extra = f"\nmoves {t.cost.bytes / _MIB:.1f} MiB"
    else:
        what = f"GLOBAL_SYNC all-reduce over {len(t.replicas)} replicas"
        extra = f"\nmoves {t.cost.bytes / _MIB:.1f} MiB"
    return f"{t.id}\n{what}{extra}"


def _q(text: object) -> str:
    """``text`` as a double-quoted DOT ID."""
    s = str(text).replace("\\", "\\\\").replace('"', '\\"')
    return '"' + s.replace("\n", "\\n") + '"'


def _attrs(**attrs: object) -> str:
    return "[" + ", ".join(f"{k}={_q(v)}" for k, v in attrs.items()) + "]"


def _node_line(t: Task, indent: str) -> str:
    return f"{indent}{_q(t.id)} {_attrs(label=_node_label(t), fillcolor=_COLORS[t.kind])};"


def _dot_lines(graph: nx.DiGraph) -> list[str]:
    g = graph.graph
    devices, m = list(g["devices"]), int(g["replicas_per_device"])
    mem = int(g.get("memory_per_learner_bytes", 0))
    title = (f"{g.get('model', {}).get('name', 'plan')}: {len(devices)} device(s) × {m} replica(s), "
             f"batch {g['batch_size']}, one round")
    graph_attrs = _attrs(rankdir="TB", label=title, labelloc="t", fontname="Helvetica", fontsize=16,
                         compound="true", newrank="true", ordering="in")
    node_attrs = _attrs(shape="box", style="rounded,filled", fontname="Helvetica", fontsize=11)
    lines = ["digraph plan {", f"  graph {graph_attrs};", f"  node {node_attrs};"]
    tasks = _tasks(graph)
    for d, device in enumerate(devices):
        lines.append(f"  subgraph cluster_d{d} {{")
        cluster_attrs = _attrs(label=f"{device}: {m} replica(s), ≈{m * mem / _MIB:.1f} MiB",
                               style="rounded,filled", fillcolor="#f4f4f4", color="#888888",
                               fontname="Helvetica", fontsize=13)
        lines.append(f"    graph {cluster_attrs};")
        lines += [_node_line(t, "    ") for t in tasks if t.device == device]
        lines.append("  }")
    lines += [_node_line(t, "  ") for t in tasks if t.device is None or t.device not in devices]
    lines += [f"  {_q(u)} -> {_q(v)};" for u, v in graph.edges]
    return lines + ["}"]


def to_dot(graph: nx.DiGraph) -> str:
    """Graphviz DOT text of the task graph: a cluster per device, GLOBAL_SYNC outside them."""
    return "\n".join(_dot_lines(graph)) + "\n"


def draw(graph: nx.DiGraph, path: str | Path) -> Path:
    """Render the task graph with graphviz's ``dot`` to ``path`` (png, svg or pdf by suffix).
    Raises ValueError for another suffix, RuntimeError when ``dot`` is missing or fails."""
    path = Path(path)
    fmt = path.suffix.lstrip(".").lower() or "png"
    if fmt not in ("png", "svg", "pdf"):
        raise ValueError(f"draw('{path}'): use a .png, .svg or .pdf file name")
    dot = shutil.which("dot")
    if dot is None:
        raise RuntimeError(f"cannot run graphviz's 'dot' to draw {path}: it is not on PATH; install "
                           "graphviz (apt install graphviz) or render plan.to_dot() elsewhere")
    done = subprocess.run([dot, f"-T{fmt}"], input=to_dot(graph).encode("utf-8"),
                          capture_output=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"graphviz's 'dot' failed to draw {path}: "
                           f"{done.stderr.decode('utf-8', 'replace').strip()}")
    path.write_bytes(done.stdout)
    return path


class Inspectable:
    """What a runnable plan (``api.Plan``) and a ``PlanView`` share: the inspection of their
    ``task_graph`` with the settings ``inspected_settings()`` gives (docs/compiler.md §5)."""

    task_graph: nx.DiGraph

    def inspected_settings(self) -> dict[str, Any]:
        """The optimizer and sync settings as plain data (the summary's and JSON's)."""
        return {}

    @property
    def devices(self) -> list[str]:
        """This process's device names."""
        return list(self.task_graph.graph["devices"])

    def summary(self) -> str:
        """A table per device: replicas, tasks, GFLOP per round, memory (MiB); then the totals."""
        return summary(self.task_graph, self.inspected_settings())

    def to_json(self, *, indent: int | None = 2) -> str:
        """The task graph as JSON, schema ``crossbow_graph.plan/2``."""
        return to_json(self.task_graph, self.inspected_settings(), indent=indent)

    def to_dot(self) -> str:
        """Graphviz DOT text of the task graph, devices as clusters."""
        return to_dot(self.task_graph)

    def draw(self, path: str | Path) -> Path:
        """Write a picture of the task graph (PNG, SVG or PDF by suffix).

        Raises:
            RuntimeError: graphviz's ``dot`` is not installed. ValueError: an unknown suffix."""
        return draw(self.task_graph, path)


class PlanView(Inspectable):
    """A plan's inspection surface without replicas (``Plan.from_json``, ``crossbow-graph
    inspect``): ``fit`` and ``evaluate`` raise PlanError.

    Attributes:
        task_graph: the annotated task graph (networkx.DiGraph, node attribute ``"task"``).
        settings: optimizer and SMA settings as plain data (may be empty).
        analysis: the model's ModelAnalysis when built from a model, None from JSON."""

    def __init__(self, task_graph: nx.DiGraph, settings: dict[str, Any] | None = None,
                 analysis: Any = None) -> None:
        self.task_graph = task_graph
        self.settings = dict(settings or {})
        self.analysis = analysis

    def inspected_settings(self) -> dict[str, Any]:
        return self.settings

    @property
    def replicas_per_device(self) -> int:
        return int(self.task_graph.graph["replicas_per_device"])

    @property
    def num_learners(self) -> int:
        return len(self.devices) * self.replicas_per_device

    @property
    def batch_size(self) -> int:
        return int(self.task_graph.graph["batch_size"])

    def _no_state(self, what: str):
        raise PlanError(f"{what}() needs training state, but this plan was loaded for inspection "
                        "(Plan.from_json or crossbow-graph inspect) and holds no replicas; build a "
                        "runnable plan with crossbow_graph.compile(model, example_inputs, loss_fn, ...)")

    def fit(self, *args: Any, **kwargs: Any):
        """Raises PlanError: an inspected plan cannot train (compile the model instead)."""
        self._no_state("fit")

    def evaluate(self, *args: Any, **kwargs: Any):
        """Raises PlanError: an inspected plan cannot evaluate (compile the model instead)."""
        self._no_state("evaluate")


def inspect_model(model: Any, example_inputs: tuple[Any, ...] | dict[str, Any], *,
                  devices: list[str], replicas_per_device: int, batch_size: int,
                  memory_budget_bytes: int | None = None, settings: dict[str, Any] | None = None,
                  concrete_args: dict[str, Any] | None = None, leaf_modules: tuple = ()) -> PlanView:
    """The PlanView of ``model`` traced and planned with the verifier, no replica allocated.
    Raises TraceError when the example inputs do not run through, PlanError for an unsound plan."""
    mg = trace_model(model, example_inputs, concrete_args=concrete_args, leaf_modules=leaf_modules)
    graph = build_task_graph(mg, devices=devices, replicas_per_device=replicas_per_device,
                             batch_size=batch_size, memory_budget_bytes=memory_budget_bytes)
    return PlanView(graph, settings, analysis=mg.analysis)
