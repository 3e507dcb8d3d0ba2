"""W1 (LeNet-5 / MNIST, target 99.0 %): epochs to the target with DiLoCo at H ∈ {1, 4, 16, 64}
beside SMA and local SGD, the same learners, inner optimizer and data.

Every run is the CLI's own plan (``cli.prepare_train``): ``crossbow-graph train --devices 2
--replicas 2 --batch-size 64`` (k = 4 learners, k·b = 256 samples per round, 234 rounds per
epoch), AdamW at the default η 0.008 with the OneCycle schedule over ``--epochs``, with the
variant's sync flags (``VARIANTS``):

* ``sma``: SMA, α = 1/k = 0.25, μ_z = 0.9, every round, at the lr as set
  (``--alpha 0.25 --no-scale-lr``);
* ``diloco-H`` (H = 1, 2, 4, …, 64): ``--sync diloco --sync-every H``, Nesterov outer SGD, lr 0.7,
  momentum 0.9;
* ``local-sgd-H``: ``--sync diloco --sync-every H --outer-lr 1 --outer-momentum 0``, periodic
  averaging (z the replicas' mean every H rounds).

    python bench/diloco_w1.py [--variants sma,diloco-1,diloco-4,diloco-16,diloco-64,local-sgd-4,local-sgd-16]
                              [--seeds 0 1] [--epochs 5] [--out bench/runs/diloco_w1.json]
                              [--summary bench/results/diloco_w1_summary.json]

Runs accumulate in ``--out`` (raw, not committed); a (variant, seed) already there is not run
again. The summary (committed) holds per variant the runs that reached 99.0 %, the median epochs
to it (a miss counts as +∞), the final and best accuracy, and one row per run. Epochs, not
seconds: timing on a shared machine is not a result (training seconds are recorded, not
summarised). Prints a markdown table. Not a test; nothing asserted.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time

from crossbow_graph.cli import build_parser, prepare_train

BASE = ["--devices", "2", "--replicas", "2", "--batch-size", "64"]


def _variants() -> dict[str, list[str]]:
    hs = (1, 2, 4, 8, 16, 32, 64)
    out = {"sma": ["--alpha", "0.25", "--no-scale-lr"]}  # 1/k at k = 4
    out.update({f"diloco-{h}": ["--sync", "diloco", "--sync-every", str(h)] for h in hs})
    out.update({f"local-sgd-{h}": ["--sync", "diloco", "--sync-every", str(h), "--outer-lr", "1",
                                   "--outer-momentum", "0"] for h in hs})
    return out


VARIANTS = _variants()
DEFAULT_VARIANTS = ("sma", "diloco-1", "diloco-4", "diloco-16", "diloco-64", "local-sgd-4",
                    "local-sgd-16")


def run(variant: str, *, epochs: int, seed: int) -> dict:
    """One fit of ``variant`` at ``seed``: its evaluations and epochs to 99.0 %."""
    argv = ["train", *BASE, "--epochs", str(epochs), "--seed", str(seed), "--quiet",
            *VARIANTS[variant]]
    plan, fit = prepare_train(build_parser().parse_args(argv))
    t0 = time.perf_counter()
    h = plan.fit(**fit)
    return {"variant": variant, "seed": seed, "argv": argv, "epochs_max": epochs,
            "reached": h.epochs_to_accuracy is not None, "epochs_to_accuracy": h.epochs_to_accuracy,
            "final_accuracy": h.final_accuracy,
            "best_accuracy": max((e.test_accuracy for e in h.evals), default=None),
            "rounds": plan.rounds_done, "train_seconds": plan.train_seconds,
            "wall_seconds": time.perf_counter() - t0,
            "evals": [{"epoch": e.epoch, "test_accuracy": e.test_accuracy} for e in h.evals]}


def summarise(rows: list[dict]) -> dict:
    """Per variant: runs reaching 99.0 %, median epochs (a miss as +∞; None if the median
    missed), median final accuracy; and one row per run."""
    out: dict = {"workload": "W1 LeNet-5/MNIST", "target": 0.99, "layout": " ".join(BASE),
                 "variants": {}, "runs": []}
    for variant in VARIANTS:
        mine = [r for r in rows if r["variant"] == variant]
        if not mine:
            continue
        epochs = sorted(r["epochs_to_accuracy"] if r["reached"] else math.inf for r in mine)
        med = statistics.median(epochs)
        out["variants"][variant] = {
            "argv": " ".join(VARIANTS[variant]), "seeds": sorted(r["seed"] for r in mine),
            "reached": f"{sum(r['reached'] for r in mine)}/{len(mine)}",
            "median_epochs_to_99": None if math.isinf(med) else round(med, 2),
            "epochs_to_99": [r["epochs_to_accuracy"] for r in sorted(mine, key=lambda r: r["seed"])],
            "final_accuracy": [round(r["final_accuracy"], 4) for r in sorted(mine, key=lambda r: r["seed"])],
            "best_accuracy": [round(r["best_accuracy"], 4) for r in sorted(mine, key=lambda r: r["seed"])],
        }
    for r in sorted(rows, key=lambda r: (list(VARIANTS).index(r["variant"]), r["seed"])):
        out["runs"].append({k: r[k] for k in ("variant", "seed", "reached", "epochs_to_accuracy",
                                              "final_accuracy", "best_accuracy", "rounds")})
    return out


def table(summary: dict) -> str:
    lines = ["| sync | flags | reached 99.0 % | epochs to 99.0 % (per seed; median) | final accuracy |",
             "|---|---|---|---|---|"]
    for variant, v in summary["variants"].items():
        per_seed = ", ".join("—" if e is None else f"{e:.2f}" for e in v["epochs_to_99"])
        med = "—" if v["median_epochs_to_99"] is None else f"{v['median_epochs_to_99']:.2f}"
        acc = ", ".join(f"{a:.2%}" for a in v["final_accuracy"])
        lines.append(f"| {variant} | `{v['argv'] or '(defaults)'}` | {v['reached']} | "
                     f"{per_seed}; {med} | {acc} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", default=",".join(DEFAULT_VARIANTS))
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--out", default="bench/runs/diloco_w1.json", help="raw runs (not committed)")
    ap.add_argument("--summary", default="bench/results/diloco_w1_summary.json")
    args = ap.parse_args()
    variants = [v for v in args.variants.split(",") if v]
    for v in variants:
        if v not in VARIANTS:
            raise SystemExit(f"--variants {v}: use some of {', '.join(VARIANTS)}")
    rows = json.load(open(args.out)) if os.path.exists(args.out) else []
    done = {(r["variant"], r["seed"], r["epochs_max"]) for r in rows}
    for seed in args.seeds:  # seed-major: a stopped invocation leaves whole seeds
        for variant in variants:
            if (variant, seed, args.epochs) in done:
                continue
            r = run(variant, epochs=args.epochs, seed=seed)
            rows.append(r)
            print(f"{variant} seed {seed}: epochs to 99.0 % {r['epochs_to_accuracy']}, final "
                  f"{r['final_accuracy']:.4f}", flush=True)
            os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
            with open(args.out, "w") as f:
                json.dump(rows, f, indent=1)
    summary = summarise([r for r in rows if r["epochs_max"] == args.epochs])
    os.makedirs(os.path.dirname(args.summary) or ".", exist_ok=True)
    with open(args.summary, "w") as f:
        json.dump(summary, f, indent=1)
    print(table(summary))


if __name__ == "__main__":
    main()
