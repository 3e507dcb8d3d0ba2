"""Markdown tables of the result JSONs for docs/benchmarking.md (numbers copied by program, not by hand).
Text only: matplotlib is not needed (bench/plots.py draws the figures).

    python bench/report.py --tta bench/results/tta-w1.json --epochs bench/results/stat_eff-epochs.json \\
        --robustness bench/results/stat_eff-robustness.json
"""

from __future__ import annotations

import argparse
import json
import re

__all__ = ["run_length", "tta_table", "epochs_table", "robustness_table", "main"]


def _f(x, spec="{:.1f}"):
    return "—" if x is None else spec.format(x)


def run_length(d: dict) -> str:
    """'1 epoch(s)' or '1 epoch(s) of the first 12,000 training samples' (from the meta or command)."""
    n = d.get("train_samples")
    if n is None:
        m = re.search(r"--train-samples (\d+)", d.get("command", ""))
        n = int(m.group(1)) if m else None
    return f"{d['max_epochs']} epoch(s)" + (f" of the first {n:,} training samples" if n else "")


def tta_table(path: str) -> str:
    d = json.load(open(path))
    s = d["summary"]
    lines = [f"Target {100 * d['target']:g}%, seeds {d['seeds']}, cap {d['max_epochs']} epochs or the "
             f"first evaluation after {d.get('max_train_s')} training seconds; `{d['command']}`", "",
             "| system | reached | time to target, median (s) | spread min–max (s) | epochs, median "
             "(min–max) | samples/s, median (min–max) | final acc., median | best acc. | "
             "system ÷ crossbow-r2 (time) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, t in s["systems"].items():
        r = s["baseline_over_default"].get(name)
        lines.append(
            f"| {name} | {t['reached']}/{t['runs']} | {_f(t['tta_median_s'])} | "
            f"{_f(t['tta_min_s'])}–{_f(t['tta_max_s'])} | {_f(t['eta_median'], '{:.2f}')} "
            f"({_f(t['eta_min'], '{:.2f}')}–{_f(t['eta_max'], '{:.2f}')}) | "
            f"{t['samples_per_s_median']:,.0f} ({t['samples_per_s_min']:,.0f}–"
            f"{t['samples_per_s_max']:,.0f}) | {100 * t['final_accuracy_median']:.2f}% | "
            f"{100 * t['best_accuracy_max']:.2f}% | {_f(r, '{:.2f}')} |")
    a = s["acceptance"]
    lines.append("")
    if a:
        lines.append(f"Acceptance: {a['default']} median time ÷ best plain PyTorch ({a['best_plain']}) "
                     f"median time = **{a['ratio']:.2f}** (bar ≤ {a['bar']}): "
                     f"**{'met' if a['met'] else 'missed'}**.")
    else:
        lines.append("Acceptance: not computable — a median run of crossbow-r2 or of every plain "
                     "PyTorch setting did not reach the target within the cap.")
    for name, r in s.get("default_over_extra_plain", {}).items():
        lines.append(f"Outside the protocol's grid: {a['default'] if a else 'crossbow-r2'} median "
                     f"time ÷ {name} median time = **{r:.2f}**.")
    return "\n".join(lines)


def epochs_table(paths: list[str]) -> str:
    ds = [json.load(open(p)) for p in paths]
    d = dict(ds[0], runs=[r for x in ds for r in x["runs"]])
    lines = [*(f"`{x['command']}`  " for x in ds), "",
             "| system | k | epochs to 99.0% | best acc. | final acc. | epochs run | samples/s |",
             "|---|---|---|---|---|---|---|"]
    for r in d["runs"]:
        res = r["result"]
        if "error" in res:
            lines.append(f"| {r['system']} | {r['x']} | error | | | | |")
            continue
        ran = res["evals"][-1]["epoch"] if res["evals"] else None
        lines.append(f"| {r['system']} | {r['x']} | {_f(res['epochs_to_accuracy'], '{:.2f}')} | "
                     f"{100 * res['best_accuracy']:.2f}% | {100 * res['final_accuracy']:.2f}% | "
                     f"{_f(ran, '{:.2f}')} | {res['samples_per_s']:,.0f} |")
    return "\n".join(lines)


def robustness_table(path: str) -> str:
    d = json.load(open(path))
    bs = sorted({r["x"] for r in d["runs"]})
    lines = [f"`{d['command']}` (test accuracy after {run_length(d)}, lr 0.02)", "",
             "| system | " + " | ".join(f"b={b}" for b in bs) + " |",
             "|---|" + "---|" * len(bs)]
    for system in dict.fromkeys(r["system"] for r in d["runs"]):  # in the order run
        cells = []
        for b in bs:
            r = next((r for r in d["runs"] if r["system"] == system and r["x"] == b), None)
            ok = r is not None and "error" not in r["result"]
            cells.append(f"{100 * r['result']['final_accuracy']:.2f}%" if ok else "—")
        lines.append(f"| {system} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tta", nargs="*", default=[])
    parser.add_argument("--epochs", nargs="*", default=[], help="stat_eff epochs JSONs (merged)")
    parser.add_argument("--robustness", default=None)
    args = parser.parse_args(argv)
    for p in args.tta:
        print(tta_table(p), "\n")
    if args.epochs:
        print(epochs_table(args.epochs), "\n")
    if args.robustness:
        print(robustness_table(args.robustness))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
