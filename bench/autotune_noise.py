"""The replica auto-tuner under load: the m it ends at, quiet and beside busy processes.

    python bench/autotune_noise.py [--runs 5] [--busy 2] [--epochs 1] [--train-samples N]

LeNet-5 on MNIST (``cg.datasets.mnist``), b = 8, one CPU device, ``replicas="auto"`` with the
default ``AutoTune``, SGD with momentum 0.9: each run is one fit of ``--epochs`` epochs. Runs
alternate quiet and busy (``--runs`` of each); a busy run has ``--busy`` CPU-bound processes
(``python -c 'while True: pass'``) beside it, started before the fit and killed after it. Prints
each run's final m, learner mode and number of decisions, and whether every busy run ended within
±1 of the quiet runs' median m; writes the runs (with every decision and its spread) and that
summary as JSON to ``--out`` (default bench/runs/autotune_noise-<UTC time>.json, not committed).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import crossbow_graph as cg  # noqa: E402

__all__ = ["busy_processes", "tuned_run", "summarise", "main"]

BUSY_LOOP = "while True: pass"


@contextmanager
def busy_processes(n: int):
    """``n`` CPU-bound Python processes for the duration of the block (terminated after)."""
    procs = [subprocess.Popen([sys.executable, "-c", BUSY_LOOP]) for _ in range(n)]
    try:
        time.sleep(0.5 if n else 0.0)  # let them reach the cores
        yield procs
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=10)


def tuned_run(data, epochs: int, seed: int) -> dict:
    """One fit with ``replicas="auto"`` at b = 8: the final m and mode and every decision."""
    torch.manual_seed(seed)
    plan = cg.compile(cg.models.lenet5(), (data.images[:1],),
                      torch.nn.functional.cross_entropy, batch_size=8, devices=1,
                      replicas="auto", optimizer=cg.SGD(lr=0.01, momentum=0.9))
    t0 = time.perf_counter()
    hist = plan.fit(data, epochs, progress=False, seed=seed, metrics_every=None)
    return {"final_m": plan.replicas_per_device, "final_mode": plan.learner_mode,
            "decisions": [vars(d) for d in hist.autotune], "wall_s": time.perf_counter() - t0,
            "samples_per_s": hist.epochs[-1].samples_per_s if hist.epochs else None}


def summarise(runs: list[dict]) -> dict:
    """Final m per condition, the quiet median and whether each busy run is within ±1 of it."""
    by = {c: [r["final_m"] for r in runs if r["condition"] == c] for c in ("quiet", "busy")}
    quiet_m = statistics.median(by["quiet"]) if by["quiet"] else None
    within = None if quiet_m is None else [abs(m - quiet_m) <= 1 for m in by["busy"]]
    return {"final_m": by, "quiet_median_m": quiet_m, "busy_within_1": within,
            "decisions": {c: [len(r["decisions"]) for r in runs if r["condition"] == c]
                          for c in ("quiet", "busy")},
            "met": bool(within) and all(within)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="runs of each condition")
    parser.add_argument("--busy", type=int, default=2, help="CPU-bound processes in a busy run")
    parser.add_argument("--epochs", type=int, default=1, help="epochs of each fit")
    parser.add_argument("--train-samples", type=int, default=None,
                        help="train on the first N samples only (a quick check; default: all)")
    parser.add_argument("--out", default=None, help="JSON path (default bench/runs/...)")
    args = parser.parse_args(argv)
    data = cg.datasets.mnist(train=True)
    if args.train_samples:
        data = cg.datasets.ImageDataset(data.images[:args.train_samples],
                                        data.labels[:args.train_samples], data.name)
    runs = []
    for i in range(args.runs):
        for condition, n in (("quiet", 0), ("busy", args.busy)):
            with busy_processes(n):
                run = tuned_run(data, args.epochs, seed=i)
            run.update(condition=condition, run=i)
            runs.append(run)
            print(f"{condition:5s} run {i}: m = {run['final_m']} ({run['final_mode']}), "
                  f"{len(run['decisions'])} decisions, {run['wall_s']:.1f} s", flush=True)
    summary = summarise(runs)
    print(f"final m, quiet: {summary['final_m']['quiet']}; beside {args.busy} busy processes: "
          f"{summary['final_m']['busy']}; every busy run within ±1 of the quiet median "
          f"{summary['quiet_median_m']}: {'yes' if summary['met'] else 'no'}")
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "runs",
                                   f"autotune_noise-{stamp}.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump({"command": " ".join(["python bench/autotune_noise.py", *(argv or sys.argv[1:])]),
                   "when": stamp, "cores": os.cpu_count(), "busy_processes": args.busy,
                   "epochs": args.epochs, "train_samples": args.train_samples,
                   "summary": summary, "runs": runs}, f, indent=1)
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
