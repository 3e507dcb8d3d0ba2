"""What the GPU acceptance check's sections share (bench/gpu_acceptance.py runs them): a section's
result (``Section``), the small models and synthetic data, plans of them, the card's facts that
scale the targets, and the comparisons of a plan's state."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import TensorDataset

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's crossbow_graph

import crossbow_graph as cg  # noqa: E402

__all__ = ["Section", "BNNet", "synthetic", "model_of", "compile_plan", "device_of", "exact",
           "sync", "state_of", "bitwise_equal", "max_diff", "close", "child_timeout", "md_table",
           "fmt", "run_cell", "card_facts", "RTOL", "ATOL"]

RTOL, ATOL = 1e-4, 1e-5  # GPU against CPU, Triton against torch (TF32 off)


class BNNet(nn.Module):
    """conv(1→4, 3×3) → BatchNorm2d → ReLU → linear(4·6·6 → 4), inputs ``[N, 1, 8, 8]``."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4 * 6 * 6, 4)

    def forward(self, x):
        return self.fc(torch.relu(self.bn(self.conv(x))).flatten(1))


SHAPES = {"bnnet": ((1, 8, 8), 4), "lenet5": ((1, 28, 28), 10), "resnet32": ((3, 32, 32), 10)}


def model_of(name: str) -> nn.Module:
    return BNNet() if name == "bnnet" else cg.models.get_model(name)


def synthetic(name: str, n: int, device: torch.device, seed: int = 0) -> TensorDataset:
    """n samples for model ``name``: x ``[n, C, H, W]`` standard normal, y ``[n]`` class indices."""
    shape, classes = SHAPES[name]
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(n, *shape, generator=g), torch.randint(0, classes, (n,), generator=g)
    return TensorDataset(x.to(device), y.to(device))


def compile_plan(name: str, device: torch.device, *, m: int = 2, b: int = 8, **kw) -> cg.Plan:
    """A seeded plan of model ``name`` on ``device`` (m × b, SGD(0.05, momentum 0.9) unless
    given, the inline executor)."""
    torch.manual_seed(0)
    shape, _ = SHAPES[name]
    kw.setdefault("optimizer", cg.SGD(lr=0.05, momentum=0.9))
    return cg.compile(model_of(name), (torch.randn(2, *shape),), nn.functional.cross_entropy,
                      batch_size=b, devices=[device_name(device)], replicas=m,
                      executor="inline", **kw)


def device_name(device: torch.device) -> str:
    return f"cuda:{device.index or 0}" if device.type == "cuda" else "cpu:0"


def device_of(args) -> torch.device:
    """The section's device: the CPU in a smoke run, else cuda:0."""
    return torch.device("cpu") if args.smoke else torch.device("cuda", 0)


def exact() -> None:
    """fp32 as on the CPU: no TF32, deterministic cuDNN and algorithms (CUBLAS_WORKSPACE_CONFIG
    is set by the shell script before CUDA starts; a nondeterministic op warns)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.use_deterministic_algorithms(True, warn_only=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def state_of(plan: cg.Plan) -> dict[str, torch.Tensor]:
    """w ``[k, P]``, z ``[P]``, zbuf ``[Q]`` of the plan, on the CPU, after its work is done."""
    plan.scheduler.flush()
    return {"w": plan.replica_weights().cpu(), "z": plan.central_weights().cpu(),
            "zbuf": plan.states[0].zbuf.detach().cpu().clone()}


def bitwise_equal(a: dict, b: dict) -> bool:
    """Every tensor of ``a`` has the bits of ``b``'s (a NaN equals the same NaN)."""
    return all(a[k].shape == b[k].shape and a[k].dtype == b[k].dtype and
               torch.equal(a[k].contiguous().view(torch.uint8), b[k].contiguous().view(torch.uint8))
               for k in a)


def max_diff(a: dict, b: dict) -> float:
    return max(float((a[k].double() - b[k].double()).abs().max()) if a[k].numel() else 0.0 for k in a)


def close(a: dict, b: dict) -> bool:
    return all(torch.allclose(a[k].double(), b[k].double(), rtol=RTOL, atol=ATOL) for k in a)


def child_timeout(seconds: float, floor: float = 20.0) -> float | None:
    """A child process's limit: None (the shell's limit alone) when the section is not timed,
    else ``seconds`` but at least ``floor`` (two imports of torch and a CUDA start)."""
    return None if math.isinf(seconds) else max(floor, seconds)


def md_table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def fmt(x) -> str:
    """A rate with thousands separators, or — (None, NaN)."""
    return f"{x:,.0f}" if x is not None and x == x else "—"


def card_facts(work: Path) -> dict:
    """The env section's facts of the card (``env.json`` data ``card``: name, copy GB/s, µs per
    graph node, µs per eager launch), or {} when it has none (a smoke run, or env not run)."""
    path = work / "env.json"
    return json.loads(path.read_text()).get("data", {}).get("card", {}) if path.exists() else {}


class Section:
    """One section's result, written to ``work/<name>.json`` by ``write``: ``status`` (pass,
    fail, skip), ``key`` (one line), ``notes``, ``tables`` (title → markdown), ``data``; its
    ``targets`` (``target``) go into the summary's table of targets."""

    def __init__(self, name: str, work: Path) -> None:
        self.name, self.work = name, work
        self.failures: list[str] = []
        self.notes: list[str] = []
        self.tables: dict[str, str] = {}
        self.data: dict = {}
        self.key = ""
        self.skipped: str | None = None

    def check(self, ok: bool, what: str) -> bool:
        """Record ``what`` as a failure unless ``ok``."""
        if not ok:
            self.failures.append(what)
        return ok

    def target(self, name: str, value: float | None, target: float, *, unit: str, scale: str,
               gpu: bool, explain: str = "", at_most: bool = False) -> None:
        """A decisive target: ``value`` ≥ ``target`` (``at_most``: ≤) checked on a GPU, where a
        miss (or no value) fails the section; ``explain`` names the profiled system that says
        why (bench/acceptance_report.py puts its profile beside a miss). In a smoke run it is
        recorded as a check only a GPU can make."""
        measured = value is not None and value == value
        met = None if not gpu else measured and (value <= target if at_most else value >= target)
        self.data.setdefault("targets", []).append(
            {"name": name, "value": value, "target": target, "unit": unit, "scale": scale,
             "met": met, "at_most": at_most, "explain": explain})
        if gpu:
            self.check(bool(met), f"target missed: {name}: {fmt_value(value, unit)}, target "
                                  f"{'≤' if at_most else '≥'} {fmt_value(target, unit)} ({scale})")

    def flush(self) -> None:
        """Write the section's JSON as it stands (after each cell: a cut-short run keeps it)."""
        self.write(quiet=True)

    def write(self, quiet: bool = False) -> int:
        status = "fail" if self.failures else "skip" if self.skipped else "pass"
        notes = [f"FAIL: {f}" for f in self.failures] + self.notes
        if self.skipped:
            notes.append(f"skipped: {self.skipped}")
        doc = {"section": self.name, "status": status, "key": self.key, "notes": notes,
               "tables": self.tables, "data": self.data}
        (self.work / f"{self.name}.json").write_text(json.dumps(doc, indent=2, default=str))
        if not quiet:
            print(f"{self.name}: {status}" + "".join(f"\n  {n}" for n in notes), flush=True)
        return 1 if self.failures else 0


def fmt_value(value: float | None, unit: str) -> str:
    """``value`` in ``unit``: samples/s with separators, a ratio with ×, a share in %."""
    if value is None or value != value:
        return "—"
    return {"samples/s": f"{value:,.0f} samples/s", "×": f"{value:.2f}×",
            "%": f"{value:.0%}"}.get(unit, f"{value:.3g} {unit}")


def run_cell(sec: Section, cell: dict, label: str, run) -> None:
    """Run one measurement into ``cell[label]`` (samples/s) and write the section's JSON, so that
    a run cut short keeps every finished cell. A graph cell records its captures and replays and
    fails at zero replays or a failed capture."""
    try:
        out = run()
    except Exception as exc:
        sec.check(False, f"{cell['model']} b={cell['b']} {label}: {type(exc).__name__}: "
                         f"{str(exc)[:300]}")
        sec.flush()
        return
    if isinstance(out, dict):
        cell[label] = out["rate"]
        if out["replays"] is not None:
            cell[f"{label} graphs"] = f"{out['captures']} captured, {out['replays']} replayed"
            sec.check(out["replays"] > 0 and out["graph_failure"] is None,
                      f"{cell['model']} b={cell['b']} {label}: {out['replays']} replays, "
                      f"{out['captures']} captures (failure: {out['graph_failure']})")
    else:
        cell[label] = out
    sec.flush()
