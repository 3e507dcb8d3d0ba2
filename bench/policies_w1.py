"""W1 (LeNet-5 / MNIST, target 99.0 %): epochs to the target from every start b, with and without
AdaptiveBatchSize, everything else at ``crossbow-graph train``'s defaults (AdamW at its default η
with the OneCycle schedule over ``--epochs``) but ``--devices 2`` (k = 2 learners: the two-batch
noise-scale estimate needs k ≥ 2): each run is the CLI's own plan (``cli.prepare_train``) with
``--devices 2 --batch-size b`` and the variant's ``--policy`` flags; and the gradient noise scale
over training.

    python bench/policies_w1.py [--batch-sizes 4,8,16,32,64,128,256,512] [--variants none,adaptive]
                                [--epochs 5] [--seed 0] [--cli-flags "..."]
                                [--out bench/runs/policies_w1.json]
                                [--summary bench/results/policies_w1_summary.json]
                                [--plot docs/images/noise_scale_w1.png] [--merge FILE ...]

Runs accumulate in ``--out`` (raw, not committed: every run's evaluations, policy changes and
metrics windows), so several invocations (one seed each, say) fill one table. ``--batch-sizes ""``
runs nothing: with ``--merge`` it folds other result files into ``--out`` and redraws the table,
the summary and the plot. The summary (committed) holds, per variant, the runs reaching 99.0 % per
start b, the median epochs over all seeds and over each triple of consecutive seeds, and one row
per run (epochs to 99.0 % or the best accuracy, the final b and η; seed 0's noise-scale windows).

Variants (``VARIANTS``: the ``--policy`` flags): ``none`` (no policy, so no metrics either);
``adaptive``, ``--policy adaptive_batch`` (the η gain's reference B₀ is the k·b of 256 at which
the default η was tuned); ``adaptive-speed`` with the opt-in throughput test (``min_speedup=0.1``);
``metrics`` the metrics monitor alone (``--metrics-every 50``, no policy: the monitor's cost).
``--cli-flags`` adds flags to every run (e.g. ``"--optimizer sgd"``).

Prints a markdown table. Not a test; no timing asserted.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import statistics
import time

from crossbow_graph.cli import build_parser, prepare_train

VARIANTS = {"none": [], "adaptive": ["--policy", "adaptive_batch"],
            "adaptive-speed": ["--policy", "adaptive_batch:min_speedup=0.1"],
            "metrics": ["--metrics-every", "50"]}


def run(b: int, variant: str, *, epochs: int, seed: int, cli_flags: str = "") -> dict:
    argv = ["train", "--devices", "2", "--batch-size", str(b), "--epochs", str(epochs), "--seed", str(seed),
            "--quiet", *VARIANTS[variant], *shlex.split(cli_flags)]
    plan, fit = prepare_train(build_parser().parse_args(argv))
    t0 = time.perf_counter()
    h = plan.fit(**fit)
    wall = time.perf_counter() - t0
    return {
        "batch_size": b, "variant": variant, "argv": argv, "lr": h.lr[0] if h.lr else None,
        "seed": seed, "epochs_max": epochs,
        "final_accuracy": h.final_accuracy, "reached": h.epochs_to_accuracy is not None,
        "epochs_to_accuracy": h.epochs_to_accuracy, "time_to_accuracy_s": h.time_to_accuracy_s,
        "train_seconds": plan.train_seconds, "wall_seconds": wall,
        "final_batch_size": plan.batch_size, "final_lr": plan.settings.lr,
        "policy": [vars(p) for p in h.policy],
        "evals": [vars(e) for e in h.evals],
        "metrics": [vars(m) for m in h.metrics],
    }


def plot(rows: list[dict], path: str) -> None:
    try:
        import matplotlib
    except ImportError as exc:
        raise ImportError("the noise-scale plot needs matplotlib: pip install 'crossbow_graph[plots]'") from exc

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for r in rows:
        ms = [m for m in r["metrics"] if m["noise_scale"] is not None]
        if not ms:
            continue
        style = "-" if r["variant"] == "none" else "--"
        if r["seed"] != 0 or r["variant"] not in ("none", "metrics", "adaptive"):  # seed 0
            continue
        label = f"b={r['batch_size']} {r['variant']}"
        axes[0].plot([m["epoch"] for m in ms], [m["noise_scale"] for m in ms], style, label=label)
        axes[1].plot([m["epoch"] for m in r["metrics"]], [m["batch_size"] for m in r["metrics"]],
                     style, label=label)
    axes[0].set(xlabel="epoch", ylabel="B_noise (samples, EMA two-batch estimate)", yscale="log",
                title="W1 gradient noise scale")
    axes[1].set(xlabel="epoch", ylabel="b per learner", yscale="log", title="batch size")
    axes[0].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)


def _median_epochs(rows: list[dict]) -> float | None:
    """Median epochs to the target over runs, a run that missed counting as +∞ (None if the
    median missed)."""
    e = sorted(r["epochs_to_accuracy"] if r["reached"] else math.inf for r in rows)
    m = statistics.median(e) if e else math.inf
    return None if math.isinf(m) else round(m, 2)


def summarise(rows: list[dict]) -> dict:
    """The committed summary of the runs: per variant and start b the runs that reached the
    target, the median epochs over all seeds and over each triple of consecutive seeds (the
    protocol's median of three), and one small row per run."""
    out: dict = {"workload": "W1 LeNet-5/MNIST", "target": 0.99, "pass": {}, "median_epochs": {},
                 "median_epochs_per_seed_triple": {}, "runs": []}
    for variant in sorted({r["variant"] for r in rows}):
        mine = [r for r in rows if r["variant"] == variant]
        seeds = sorted({r["seed"] for r in mine})
        out["pass"][variant], out["median_epochs"][variant] = {}, {}
        out["median_epochs_per_seed_triple"][variant] = {}
        for b in sorted({r["batch_size"] for r in mine}):
            at_b = [r for r in mine if r["batch_size"] == b]
            out["pass"][variant][str(b)] = f"{sum(r['reached'] for r in at_b)}/{len(at_b)}"
            out["median_epochs"][variant][str(b)] = _median_epochs(at_b)
            out["median_epochs_per_seed_triple"][variant][str(b)] = [
                _median_epochs([r for r in at_b if r["seed"] in seeds[i:i + 3]])
                for i in range(0, len(seeds) - 2, 3)]
        out["pass"][variant]["all"] = f"{sum(r['reached'] for r in mine)}/{len(mine)}"
    for r in sorted(rows, key=lambda r: (r["variant"], r["batch_size"], r["seed"])):
        row = {k: r.get(k) for k in ("variant", "batch_size", "seed", "reached",
                                     "epochs_to_accuracy", "final_batch_size", "final_lr", "lr",
                                     "train_seconds")}
        row["best_accuracy"] = max((e["test_accuracy"] for e in r["evals"]), default=None)
        if r["seed"] == 0:  # what the plot draws
            row["metrics"] = [{k: m[k] for k in ("epoch", "noise_scale", "batch_size")}
                              for m in r["metrics"]]
        out["runs"].append(row)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-sizes", default="4,8,16,32,64,128,256,512")
    ap.add_argument("--variants", default="none,adaptive")
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cli-flags", default="", help="more crossbow-graph train flags for every run")
    ap.add_argument("--out", default="bench/runs/policies_w1.json", help="raw runs (not committed)")
    ap.add_argument("--summary", default="bench/results/policies_w1_summary.json")
    ap.add_argument("--plot", default="docs/images/noise_scale_w1.png")
    ap.add_argument("--merge", nargs="*", default=[], help="other result files to fold in")
    args = ap.parse_args()
    rows = []
    for path in [args.out] + args.merge:  # runs accumulate: several invocations fill one table
        if os.path.exists(path):
            with open(path) as f:
                new = json.load(f)["runs"]
            keys = {(x["batch_size"], x["variant"], x["seed"]) for x in new}
            rows = [x for x in rows if (x["batch_size"], x["variant"], x["seed"]) not in keys] + new
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"workload": "W1 LeNet-5/MNIST", "target": 0.99, "runs": rows}, f, indent=1)
    for b in [int(x) for x in args.batch_sizes.split(",") if x]:
        for variant in args.variants.split(","):
            r = run(b, variant, epochs=args.epochs, seed=args.seed, cli_flags=args.cli_flags)
            rows = [x for x in rows if (x["batch_size"], x["variant"], x["seed"]) != (b, variant, args.seed)]
            rows.append(r)
            print(f"b={b:3d} {variant:9s} acc={r['final_accuracy']:.4f} "
                  f"epochs_to_99={r['epochs_to_accuracy']} final_b={r['final_batch_size']} "
                  f"final_lr={r['final_lr']:.3g} train_s={r['train_seconds']:.1f}", flush=True)
            with open(args.out, "w") as f:
                json.dump({"workload": "W1 LeNet-5/MNIST", "target": 0.99, "runs": rows}, f, indent=1)
    rows.sort(key=lambda r: (r["variant"], r["batch_size"], r["seed"]))
    print("\n| b | policy | seed | final accuracy | epochs to 99.0% | final b | final lr | train s |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        e = f"{r['epochs_to_accuracy']:.2f}" if r["epochs_to_accuracy"] is not None else f"not in {r['epochs_max']}"
        print(f"| {r['batch_size']} | {r['variant']} | {r['seed']} | {r['final_accuracy']:.4f} | {e} | "
              f"{r['final_batch_size']} | {r['final_lr']:.3g} | {r['train_seconds']:.1f} |")
    with open(args.summary, "w") as f:
        json.dump(summarise(rows), f, indent=1)
    plot(rows, args.plot)


if __name__ == "__main__":
    main()
