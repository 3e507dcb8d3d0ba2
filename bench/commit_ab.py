"""Speed of one checkout against another, interleaved A B A B in one run (BENCHMARKS.md).

    python bench/commit_ab.py BEFORE_DIR AFTER_DIR [--reps 3] [--seconds 2] [--out FILE]

BEFORE_DIR and AFTER_DIR are two checkouts of crossbow_graph (``git worktree add DIR COMMIT``).
Each measurement is a fresh Python process that imports the package from its checkout:

- ``train``: the default ``crossbow-graph train`` (LeNet-5, real MNIST, to 99 % test accuracy),
  its final training samples/s;
- ``b8``: the b = 8 throughput grid of bench/throughput.py, LeNet-5 on MNIST, k ∈ {1, 2, 4, 8, 16}
  learners × {per_replica, fused}, steady-state samples/s of each cell (``--seconds`` each);
- ``process_lr``: the process executor on 2 devices × 2 learners at b = 16 with a torch
  OneCycleLR stepped per round, samples/s, and how many rounds were learned ahead (the overlap).

Prints, per measurement, the medians over the repetitions and the ratio AFTER / BEFORE; writes the
raw numbers as JSON to ``--out`` (default bench/runs/commit_ab-<UTC time>.json, not committed).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

__all__ = ["main"]

_GRID = r"""
import json, sys, time, torch
import crossbow_graph as cg
sys.path.insert(0, "bench")
from throughput import crossbow_rate
data = cg.datasets.mnist(train=True)
out = {}
for mode in ("per_replica", "fused"):
    for k in (1, 2, 4, 8, 16):
        out[f"{mode} k={k}"] = crossbow_rate(data, 8, k, mode, SECONDS)
print("RESULT", json.dumps(out))
"""

_PROCESS_LR = r"""
import json, time, torch
import torch.nn.functional as F
import crossbow_graph as cg
data = cg.datasets.mnist(train=True)
torch.manual_seed(0)
plan = cg.compile(cg.models.lenet5(), (data.images[:2],), F.cross_entropy, batch_size=16,
                  replicas=2, devices=2, executor="process", optimizer=cg.SGD(lr=0.01, momentum=0.9))
if hasattr(plan, "scheduler") and hasattr(plan.scheduler, "cpu_conv") and not hasattr(cg, "CompileOptions"):
    plan.scheduler.cpu_conv = "aten"
rounds = 600
sched = torch.optim.lr_scheduler.OneCycleLR(plan.optimizer, max_lr=0.05, total_steps=3 * rounds + 10)
n = rounds * 4 * 16
sub = torch.utils.data.TensorDataset(data.images[:n], data.labels[:n])
plan.fit(sub, 1, progress=False, lr_scheduler=sched, lr_scheduler_interval="round")  # warm-up
t0 = time.perf_counter()
plan.fit(sub, 2, progress=False, lr_scheduler=sched, lr_scheduler_interval="round")
rate = n / (time.perf_counter() - t0)
engine = getattr(plan, "rounds", None) or plan.scheduler  # the engine, as each checkout names it
ahead = engine.clock.learned_ahead if hasattr(engine, "clock") else engine.rounds_learned_ahead
print("RESULT", json.dumps({"samples/s": rate, "rounds_learned_ahead": ahead}))
"""


def _run(checkout: str, what: str, seconds: float) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": os.path.abspath(checkout)}
    if what == "train":
        with tempfile.TemporaryDirectory() as ckpt:
            proc = subprocess.run([sys.executable, "-m", "crossbow_graph", "train", "--checkpoint-dir", ckpt],
                                  cwd=checkout, env=env, capture_output=True, text=True, check=True)
        m = re.search(r"final test accuracy .* ([\d,]+) samples/s", proc.stdout)
        if not m:
            raise RuntimeError(f"no final line from train in {checkout}:\n{proc.stdout[-2000:]}")
        return {"samples/s": float(m.group(1).replace(",", ""))}
    code = _GRID.replace("SECONDS", repr(seconds)) if what == "b8" else _PROCESS_LR
    proc = subprocess.run([sys.executable, "-c", code], cwd=checkout, env=env,
                          capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"{what} failed in {checkout}:\n{proc.stderr[-3000:]}")
    line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULT "))
    return {k: v for k, v in json.loads(line[7:]).items() if v is not None}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before")
    parser.add_argument("after")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=2.0, help="seconds per b = 8 grid cell")
    parser.add_argument("--only", nargs="*", default=["train", "b8", "process_lr"])
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    raw: dict[str, dict[str, list[dict]]] = {w: {"before": [], "after": []} for w in args.only}
    for rep in range(args.reps):
        for what in args.only:
            for side in ("before", "after"):
                r = _run(getattr(args, side), what, args.seconds)
                raw[what][side].append(r)
                print(f"rep {rep + 1} {what:10s} {side:6s} " + "  ".join(f"{k} {v:,.0f}" for k, v in r.items()),
                      flush=True)
    summary = {}
    print(f"\n{'measurement':28s} {'before':>10s} {'after':>10s} {'after/before':>13s}")
    for what, sides in raw.items():
        for key in sides["before"][0]:
            b = statistics.median(r[key] for r in sides["before"])
            a = statistics.median(r[key] for r in sides["after"])
            summary[f"{what} {key}"] = {"before": b, "after": a, "ratio": a / b if b else None}
            print(f"{what + ' ' + key:28s} {b:10,.0f} {a:10,.0f} {a / b if b else float('nan'):13.3f}")
    cells = [v["ratio"] for k, v in summary.items() if k.startswith("b8 ") and v["ratio"]]
    if cells:
        print(f"{'b8 grid, median of cell ratios':28s} {'':10s} {'':10s} {statistics.median(cells):13.3f}")
    out = args.out or os.path.join("bench", "runs",
                                   f"commit_ab-{dt.datetime.now(dt.timezone.utc):%Y%m%dT%H%M%S}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w", encoding="utf-8") as f:
        json.dump({"before": os.path.abspath(args.before), "after": os.path.abspath(args.after),
                   "reps": args.reps, "summary": summary, "raw": raw}, f, indent=1)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
