"""Plots of the benchmark results (PNG, matplotlib) for docs/benchmarking.md.

    python bench/plots.py --tta bench/results/tta-w1.json bench/results/tta-w2-subset.json \\
        --throughput bench/results/throughput_grid.json \\
        --epochs bench/results/stat_eff-epochs.json bench/results/stat_eff-epochs-sma.json \\
        --robustness bench/results/stat_eff-robustness.json

Writes docs/images/tta_<workload>.png (test accuracy against training seconds, every run of every
system), throughput_replicas.png (samples/s against learners), epochs_vs_k.png (epochs to target
against k) and robustness_b.png (final accuracy against b at the default lr); with
``--tta-tuned bench/results/tta_w1_tuned.json``, tta_w1_tuned.png (the tuned plain-PyTorch grid's
time to 99.0 % against B at seed 0, and each seed's time of the chosen configurations against
crossbow_graph's defaults).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics

try:
    import matplotlib
except ImportError as exc:
    raise ImportError("the benchmarks' plots need matplotlib: pip install 'crossbow_graph[plots]'") from exc

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.ticker  # noqa: E402

from report import run_length  # noqa: E402  (bench/ is on the path when this script runs)

__all__ = ["plot_tta", "plot_tta_tuned", "plot_throughput", "plot_epochs", "plot_robustness",
           "main"]

PLAIN_RECIPES = ("sgd-multistep", "sgd-onecycle", "adamw-onecycle", "adamw-onecycle-cl")  # bench/tta_baselines.py's
IMAGES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "images")


def _load(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def _save(fig, out: str) -> str:
    """Lay out, write ``out`` (PNG, 110 dpi), close the figure; returns ``out``."""
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_tta(path: str, out: str) -> str:
    """Test accuracy against training seconds: one colour per system, one line per seed."""
    d = _load(path)
    systems = list(d["summary"]["systems"])
    cmap = plt.get_cmap("tab10")
    fig, ax = plt.subplots(figsize=(9, 5.5))
    for i, name in enumerate(systems):
        style = "-" if name.startswith("crossbow") else ("--" if name == "localsgd" else ":")
        width = 2.2 if name.startswith("crossbow") else 1.4
        first = True
        for r in d["runs"]:
            if r["system"] != name or "error" in r["result"]:
                continue
            ev = r["result"]["evals"]
            ax.plot([e["train_seconds"] for e in ev], [100 * e["test_accuracy"] for e in ev],
                    style, color=cmap(i % 10), lw=width, marker=".", ms=4, alpha=0.85,
                    label=name if first else None)
            first = False
    target = 100 * d["target"]
    ax.axhline(target, color="k", lw=0.8)
    ax.text(ax.get_xlim()[1], target, f" target {target:g}%", va="bottom", ha="right", fontsize=8)
    ax.set_xlim(left=0)
    accs = [100 * e["test_accuracy"] for r in d["runs"] if "error" not in r["result"]
            for e in r["result"]["evals"]]
    if d["workload"] == "w1":  # the last percent is what matters; earlier evaluations fall below
        ax.set_ylim(target - 4, min(100, target + 0.6))
    else:
        ax.set_ylim(max(0, min(accs, default=0) - 5), min(100, max(accs + [target]) + 5))
    sub = "" if not d.get("train_samples") else f", first {d['train_samples']:,} training samples"
    ax.set_title(f"{d['workload'].upper()} ({d['model']}): test accuracy of the evaluated model "
                 f"against training seconds\n(evaluation excluded; seeds {d['seeds']}{sub}; shared "
                 f"2-core CPU)", fontsize=10)
    ax.set_xlabel("training seconds")
    ax.set_ylabel("test accuracy (%)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right", ncol=2)
    return _save(fig, out)


def plot_tta_tuned(path: str, out: str) -> str:
    """bench/tta_baselines.py's summary: left, the grid (seed 0): time to the target against B for
    each recipe at its best lr (a missed target is not drawn); right, the final interleaved
    comparison: every seed's time (dots; a miss drawn at the top as ×) and the median (bar)."""
    d = _load(path)
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8), gridspec_kw={"width_ratios": [1, 1.3]})
    grid = d.get("grid_seed0", []) + d.get("grid_seed0_b256", [])
    best: dict[str, dict[int, float]] = {}
    for r in grid:
        recipe, batch, _ = r["system"].split(":")
        t = r["time_to_accuracy_s"]
        if t is not None:
            at = best.setdefault(recipe, {})
            at[int(batch)] = min(t, at.get(int(batch), float("inf")))
    for recipe, at in sorted(best.items()):
        bs = sorted(at)
        left.plot(bs, [at[b] for b in bs], marker="o", label=recipe)
    left.set(xscale="log", xlabel="B (samples per step)", ylabel="seconds to 99.0 % (best lr)",
             title="tuned plain PyTorch, W1, seed 0")
    left.set_xticks(sorted({b for at in best.values() for b in at}))
    left.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
    left.get_xaxis().set_minor_formatter(matplotlib.ticker.NullFormatter())
    left.grid(alpha=0.3)
    left.legend(fontsize=8)
    final = d["final"]
    systems = list(dict.fromkeys(r["system"] for r in final))
    times = [r["time_to_accuracy_s"] for r in final if r["time_to_accuracy_s"] is not None]
    top = 1.1 * max(times, default=1.0)
    for i, name in enumerate(systems):
        mine = [r["time_to_accuracy_s"] for r in final if r["system"] == name]
        ok = sorted(t for t in mine if t is not None)
        missed = len(mine) - len(ok)
        median = statistics.median(ok + [math.inf] * missed)  # a miss counts as +∞ (the protocol)
        colour = "tab:blue" if name.split(":")[0] in PLAIN_RECIPES else "tab:red"
        if math.isfinite(median):
            right.barh(i, median, color=colour, alpha=0.35)
        right.plot(ok, [i] * len(ok), "o", color=colour)
        if missed:
            right.plot([top] * missed, [i] * missed, "x", color=colour)
    right.set_yticks(range(len(systems)), systems, fontsize=8)
    right.invert_yaxis()
    right.set(xlabel="training seconds to 99.0 % (bar: median of seeds; ×: missed)",
              title="interleaved: crossbow_graph (red), best plain recipes (blue)")
    right.grid(alpha=0.3, axis="x")
    return _save(fig, out)


def plot_throughput(path: str, out: str) -> str:
    """Samples/s against learners (replicas) per CPU device layout, per b, next to plain PyTorch."""
    d = _load(path)
    grid = d["grid"]
    bs = sorted({r["b"] for r in grid})
    modes = sorted({r["mode"] for r in grid})
    cmap = plt.get_cmap("viridis")
    fig, axes = plt.subplots(1, len(modes), figsize=(5.5 * len(modes), 4.5), sharey=True)
    axes = [axes] if len(modes) == 1 else axes
    for ax, mode in zip(axes, modes):
        for i, b in enumerate(bs):
            rows = sorted((r for r in grid if r["b"] == b and r["mode"] == mode), key=lambda r: r["m"])
            c = cmap(i / max(1, len(bs) - 1))
            ax.plot([r["m"] for r in rows], [r["samples_per_s"] for r in rows], "-o", color=c,
                    label=f"b={b}")
            ax.axhline(rows[0]["plain_b"], color=c, ls=":", lw=1)
        ax.set_xscale("log", base=2)
        ms = sorted({r["m"] for r in grid})
        ax.set_xticks(ms)
        ax.set_xticklabels([f"{m}\n({next(r['devices'] for r in grid if r['m'] == m)}×"
                            f"{next(r['m_per_device'] for r in grid if r['m'] == m)})" for m in ms])
        ax.set_xlabel("learners k (devices × replicas per device)")
        ax.set_title(f"{mode}", fontsize=10)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("training samples/s (LeNet-5, MNIST)")
    axes[0].legend(fontsize=8, title="dotted: plain PyTorch at b", title_fontsize=7)
    fig.suptitle(f"crossbow_graph throughput against replicas (bench/throughput.py, "
                 f"{d['when']}, {d['cores']} shared cores)", fontsize=10)
    return _save(fig, out)


def _merge(paths: list[str]) -> dict:
    """stat_eff JSONs as one: the first's settings, every file's runs."""
    ds = [_load(p) for p in paths]
    return dict(ds[0], runs=[r for d in ds for r in d["runs"]])


def plot_epochs(paths: list[str], out: str) -> str:
    """Epochs to the target against k: SMA (b=16), S-SGD (b·k), local SGD (b=16 per process)."""
    d = _merge(paths)
    cap = d["max_epochs"]
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    styles = {"sma": ("o-", "SMA, b=16 per learner (crossbow_graph)"),
              "ssgd": ("s--", "S-SGD, one batch of 16·k (plain PyTorch)"),
              "localsgd": ("^:", "local SGD, period 4, b=16 per process")}
    for system, (fmt, label) in styles.items():
        rows = sorted((r for r in d["runs"] if r["system"] == system and "error" not in r["result"]),
                      key=lambda r: r["x"])
        if system == "ssgd":  # k = 1 is SMA's k = 1: plain SGD at b = 16
            rows = [r for r in d["runs"] if r["system"] == "sma" and r["x"] == 1] + rows
        if not rows:
            continue
        ks = [r["x"] for r in rows]
        eta = [r["result"]["epochs_to_accuracy"] for r in rows]
        line, = ax.plot(ks, [e if e is not None else float("nan") for e in eta], fmt, label=label)
        for k, e, r in zip(ks, eta, rows):
            if e is None:  # not reached: an open marker at the epochs it ran
                ran = r["result"]["evals"][-1]["epoch"] if r["result"]["evals"] else cap
                ax.plot([k], [ran], fmt[0], mfc="none", color=line.get_color(), ms=10)
                dy = {"sma": 10, "ssgd": -22, "localsgd": -40}[system]
                ax.annotate(f"{system}: best {100 * r['result']['best_accuracy']:.2f}%",
                            (k, ran), fontsize=7, textcoords="offset points", xytext=(6, dy),
                            color=line.get_color())
    ax.set_xscale("log", base=2)
    ax.set_xticks([1, 2, 4, 8])
    ax.set_xticklabels(["1", "2", "4", "8"])
    ax.set_xlabel("k (learners, or processes for local SGD)")
    ax.set_ylabel(f"epochs to {100 * d['target']:g}% test accuracy")
    ax.set_title(f"W1 statistical efficiency (lr 0.02, momentum 0.9, seed {d['seeds']})\n"
                 "open marker: target not reached when the run ended (at that epoch)", fontsize=9)
    ax.set_ylim(0, cap + 0.7)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, out)


def plot_robustness(path: str, out: str) -> str:
    """Final test accuracy against b with the learning rate left at 0.02."""
    d = _load(path)
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    labels = {"crossbow": "crossbow_graph defaults (SMA, 2×2 learners of b, η rule: 2 × 0.02)",
              "crossbow-lr-as-set": "the same at the lr as set (SMA(scale_lr=False))",
              "plain": "plain PyTorch SGD at batch b"}
    for system, fmt in (("crossbow", "o-"), ("crossbow-lr-as-set", "^:"), ("plain", "s--")):
        rows = sorted((r for r in d["runs"] if r["system"] == system and "error" not in r["result"]),
                      key=lambda r: r["x"])
        if rows:
            ax.plot([r["x"] for r in rows], [100 * r["result"]["final_accuracy"] for r in rows], fmt,
                    label=labels[system])
    ax.set_xscale("log", base=2)
    ax.set_xticks([4, 8, 16, 32, 64])
    ax.set_xticklabels(["4", "8", "16", "32", "64"])
    ax.set_xlabel("batch size b")
    ax.set_ylabel("test accuracy after the run (%)")
    ax.set_title(f"W1 robustness: lr left at 0.02; {run_length(d)}; seed {d['seeds']}",
                 fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tta", nargs="*", default=[])
    parser.add_argument("--throughput", default=None)
    parser.add_argument("--epochs", nargs="*", default=[], help="stat_eff epochs JSONs (merged)")
    parser.add_argument("--robustness", default=None)
    parser.add_argument("--tta-tuned", default=None, help="bench/tta_baselines.py's summary JSON")
    parser.add_argument("--out-dir", default=IMAGES)
    args = parser.parse_args(argv)
    os.makedirs(args.out_dir, exist_ok=True)
    for path in args.tta:
        print(plot_tta(path, os.path.join(args.out_dir, f"tta_{_load(path)['workload']}.png")))
    if args.throughput:
        print(plot_throughput(args.throughput, os.path.join(args.out_dir, "throughput_replicas.png")))
    if args.epochs:
        print(plot_epochs(args.epochs, os.path.join(args.out_dir, "epochs_vs_k.png")))
    if args.tta_tuned:
        print(plot_tta_tuned(args.tta_tuned, os.path.join(args.out_dir, "tta_w1_tuned.png")))
    if args.robustness:
        print(plot_robustness(args.robustness, os.path.join(args.out_dir, "robustness_b.png")))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
