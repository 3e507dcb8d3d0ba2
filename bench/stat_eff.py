"""Statistical efficiency: epochs and samples to a target test accuracy against the number of
learners k, 3 seeds each, per workload (docs/benchmarking.md, Statistical efficiency;
docs/design-overview.md §2, How α, μ_z and η follow k).

Workloads (``--workload``, ``WORKLOADS``): ``w1`` LeNet-5 on MNIST, η₁ = 0.01, z evaluated 8×
per epoch on the 10,000 test images, capped at 6 epochs; ``fm`` ResNet-20 (widths 8/16/32) on
Fashion-MNIST at 28×28, η₁ = 0.02, evaluated 8× per epoch on the first 5,000 test images, capped
at 4 epochs; ``gpt`` the GPT of W4 to a validation loss of 2.40, tokens to it against k at b = 1
and 4 windows per learner, read from W4's runs (``GPT_LINES``; bench/lm_baselines.py runs them).
Systems of w1 and fm, b = 16 samples per learner per round, every run one single-threaded
``nice -n 19`` process of ``bench/sma_rules.py run`` (its runners and workloads):

* ``sma``: crossbow_graph with the engine's defaults, one device × k fused replicas on the
  inline executor, the user's ``torch.optim.SGD(lr=η₁, momentum=0.9)`` with η₁ tuned at
  k = 1: ``SMA()`` (α = 0.8 of the pull's stability bound but at least 0.5, z's rate β = k·α
  but at most 0.8 of its bound, ``sma_rules.py run --alpha default``; up to k = 4, where they
  are the same, also the runs of ``--alpha bound:0.8``; μ_z = 0.9; η₁·√min(k, 16) ramped over
  0.25 epoch). At k = 1 this is plain SGD
  at b (the same numbers: the rule is the identity there).
* ``ssgd``: plain PyTorch S-SGD, one model at batch B = k·b (BatchNorm over all of it),
  re-tuned per k: peak lr η₁·m, Goyal et al.'s warm-up from η₁ over 0.5 epoch, over a grid of m
  at seed 0 (w1: powers of 2 up to linear scaling; fm: √k/2, √k, 2√k), the m that reaches the
  last target first there at every seed.
* ``allreduce``: S-SGD as data-parallel training runs it on k devices, the engine's ``SSGD()``:
  k learners of b samples, gradients all-reduced every round, BatchNorm statistics per learner;
  η₁·√min(k, 16) ramped over 0.25 epoch (SMA's default η rule: ``SSGD(scale_lr=True)``, or
  the same factor by ``sma_rules``' LambdaLR).
* ``sma_tuned``: SMA at its best (α, η) per k of those run: of the defaults and every other SMA
  configuration at η₁ and b = 16 at that k, the fastest at seed 0 to the first target, with all
  its seeds (``sma_rules.py run --alpha``, ``--scale``).
* every other run of the workload in the runs folder (SMA at another α or η, EASGD, LocalSGD,
  DiLoCo: ``sma_rules.py run --system``) is a configuration of the summary's ``others``.

    python bench/stat_eff.py --k 1 4 16 64 --seeds 0 1 2    # queue W1's runs not done yet
    python bench/sma_rules.py queue bench/jobs/w1_stat_eff.txt --jobs 2   # W1's other runs
    python bench/sma_rules.py queue bench/jobs/fm_stat_eff.txt --jobs 2   # the fm runs
    python bench/stat_eff.py --report --workload fm         # summary, curves and figure
    python bench/stat_eff.py --report --workload gpt        # from W4's runs (lm-w4.json)
    python bench/stat_eff.py --robustness OUT.json --epochs 1 --train-samples 12000

``--report`` writes ``bench/results/stat_eff_<workload>.json`` (per system and k: epochs and
samples to each target per seed, the median and its ratio to k = 1),
``bench/results/stat_eff_<workload>_curves.json`` (every run's evaluations; read back as runs by
the next report) and ``docs/images/stat_eff_<workload>.png`` (epochs to each target against k,
one line per system, the median with the seeds' range; a run that did not reach it is drawn at
the cap, hollow).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, BENCH)

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

import sma_rules  # noqa: E402  (bench/sma_rules.py: the runners, one run per process)
from crossbow_graph.training.sma_lr import lr_factor_for  # noqa: E402  (SMA's η rule, s(k))
import crossbow_graph as cg  # noqa: E402
from crossbow_graph.engine.sync.sma import PULL_SHARE, pull_bound  # noqa: E402  (SMA's default α: a share of the bound)
import tta  # noqa: E402  (bench/tta.py: the robustness runs' runners)

__all__ = ["job_lines", "collect", "summarise", "markdown", "plot", "robustness_jobs", "main"]

RESULTS = os.path.join(BENCH, "results")
IMAGES = os.path.join(os.path.dirname(BENCH), "docs", "images")
# per workload: η₁ tuned at k = 1 (docs/benchmarking.md, "How SMA's α, μ_z and η follow k"), the
# targets (the last one chooses S-SGD's m), the runs' test images (None: all), how S-SGD's lr
# was chosen, the command that runs them and the figure's title
WORKLOADS = {
    "w1": dict(lr=0.01, targets=("0.985", "0.99"), test_samples=None, ssgd="lr re-tuned per k",
               runs="python bench/stat_eff.py --k 1 4 16 64 --seeds 0 1 2",
               title="W1, LeNet-5/MNIST, b = 16 per learner"),
    "fm": dict(lr=0.02, targets=("0.88", "0.9"), test_samples=5000, ssgd="lr re-tuned per k",
               runs="python bench/sma_rules.py queue bench/jobs/fm_stat_eff.txt --jobs 2",
               title="ResNet-20 (widths 8/16/32) on Fashion-MNIST 28×28, b = 16 per learner"),
}
LR, TARGETS = WORKLOADS["w1"]["lr"], WORKLOADS["w1"]["targets"]
DEFAULT_ALPHA = "default"  # SMA()'s α and β as sma_rules' --alpha
CROSSBOW_ALPHA = f"bound:{PULL_SHARE:g}"  # α = 0.8 of the pull's bound and β = k·α: SMA()'s where
# α is above its floor (design §2), so its runs are the defaults' at those k


def ssgd_grid(k: int) -> list[float]:
    """The peak-lr multiples m tried for S-SGD at k·b: powers of 2 from √k/2 (at least 1) up to
    linear scaling m = k, at most 16 (16·η₁ collapses from k·b = 256 on)."""
    return [float(2 ** i) for i in range(int(math.log2(k)) + 1)
            if max(1.0, math.sqrt(k) / 2) <= 2 ** i <= 16]


def job_lines(ks: list[int], seeds: list[int], ssgd_mult: dict[int, float]) -> list[str]:
    """``sma_rules.py run`` argument lines: SMA's defaults at every k and seed; S-SGD's grid at
    seed 0 and its chosen m (``ssgd_mult``, where known) at the other seeds."""
    lines = []
    for k in ks:
        rule = "--scale 1" if k == 1 else f"--alpha {DEFAULT_ALPHA} --scale engine"
        lines += [f"--k {k} --lr {LR} {rule} --seed {s}" for s in seeds]
        if k == 1:
            continue
        ssgd = f"--system ssgd --k {k} --lr {LR} --warmup-epochs 0.5"
        lines += [f"{ssgd} --lr-mult {m:g} --seed 0" for m in ssgd_grid(k)]
        if k in ssgd_mult:
            lines += [f"{ssgd} --lr-mult {ssgd_mult[k]:g} --seed {s}" for s in seeds if s]
    return lines


def _default_configs(k: int, workload: str) -> set[str]:
    """The configurations (a run name's, ``_config``) of SMA's defaults at k: ``SMA()``'s α and β
    with the engine's η rule, and α = 0.8 of the pull's bound where ``SMA()``'s α is that, above
    its floor, with β = k·α (k ≤ 4 at μ_z = 0.9); at k = 1 plain SGD (``--alpha inv``)."""
    head = f"sma-k{k}-b16-lr{WORKLOADS[workload]['lr']:g}-"
    if k == 1:
        return {head + "ainv-mu0.9-s1-w0"}
    rules = [DEFAULT_ALPHA]
    sma = cg.SMA()
    if sma.alpha_for(k) == PULL_SHARE * pull_bound(k, sma.central_momentum) and sma.centre_gain(k) == 1:
        rules.append(CROSSBOW_ALPHA)
    return {f"{head}a{rule.replace(':', '_')}-mu0.9-sengine-w0" for rule in rules}


def _is_rule_allreduce(a: dict, workload: str) -> bool:
    """The engine's S-SGD (k learners of b, gradients all-reduced) at SMA's default η rule:
    η₁·√min(k, 16), ramped over 0.25 epoch."""
    if not (a["system"] == "allreduce" and a["lr"] == WORKLOADS[workload]["lr"]
            and a["batch"] == 16 and a["warmup_epochs"] == 0.25):
        return False
    if a["scale"] == "engine":
        return True
    scale = sma_rules.Rule(a["alpha"], a["mu_z"], a["scale"], a["batch"]).scale(a["k"], None)
    return scale is not None and math.isclose(scale, lr_factor_for(a["k"]))


def _curves_path(workload: str) -> str:
    return os.path.join(RESULTS, f"stat_eff_{workload}_curves.json")


def collect(workload: str = "w1", runs_dir: str = sma_rules.RUNS) -> list[dict]:
    """Every run of ``workload`` at a fixed k on all the training samples and the workload's
    test images: its settings, epochs and samples to each target (None: not reached in its cap)
    and its evaluations, and for a run that is neither SMA's defaults nor S-SGD at η₁ with
    warm-up (a tuned SMA, EASGD, LocalSGD, DiLoCo) its ``config``; the committed curves file's
    runs, then those recorded in ``runs_dir`` (which replace a committed run of the same name)."""
    w = WORKLOADS[workload]
    runs = {}
    if os.path.exists(_curves_path(workload)):
        with open(_curves_path(workload)) as f:
            runs = {r["name"]: r for r in json.load(f)}
    recorded = sma_rules.recorded_runs(runs_dir) if os.path.isdir(runs_dir) else []
    for fn, r in recorded:
        a = r["args"]
        if a["workload"] != workload or a["train_samples"] or a["test_samples"] != w["test_samples"]:
            continue
        ssgd = (a["system"] == "ssgd" and a["lr"] == w["lr"] and a["batch"] == 16
                and a["warmup_epochs"] == 0.5)
        if a["k_schedule"]:
            continue
        runs[r["name"]] = dict(name=r["name"], system=a["system"], k=a["k"], seed=a["seed"],
                               lr_mult=a["lr_mult"] if ssgd else None, max_epochs=a["max_epochs"],
                               best_accuracy=r["best_accuracy"], diverged=r.get("diverged"),
                               evals=r["evals"])
        if not (ssgd or a["system"] == "sma" or _is_rule_allreduce(a, workload)):
            runs[r["name"]]["config"] = _config(r["name"])
    # a run with --metrics measures B_noise (docs/design-overview.md §2), not epochs to target
    runs = {name: run for name, run in runs.items() if "-metrics-" not in name}
    for run in runs.values():
        if run["system"] == "sma":  # by its name: the committed runs' too
            run.pop("config", None)
            if _config(run["name"]) not in _default_configs(run["k"], workload):
                run["config"] = _config(run["name"])
        run["to_target"] = sma_rules._firsts(run["evals"], [float(t) for t in w["targets"]], 0)
    return sorted(runs.values(), key=lambda r: r["name"])


def _short(x):
    """``x`` with every float rounded to 6 significant digits (the evaluations' own precision)."""
    if isinstance(x, float):
        return float(f"{x:.6g}")
    if isinstance(x, dict):
        return {k: _short(v) for k, v in x.items()}
    return [_short(v) for v in x] if isinstance(x, list) else x


def _config(name: str) -> str:
    """A run's configuration: its name without the workload and the seed
    (``fm-sma-k16-b16-lr0.02-ainv_2-mu0.9-sengine-w0-seed0`` → ``sma-k16-b16-lr0.02-ainv_2-mu0.9-sengine-w0``)."""
    return name.split("-", 1)[1].rsplit("-seed", 1)[0]


def _epochs(run: dict, target: str) -> float:
    hit = run["to_target"].get(target)
    return math.inf if hit is None else hit["epochs"]


def _speed(run: dict, targets: tuple[str, ...]) -> tuple[float, ...]:
    """A run's rank, fastest first: its epochs to each of ``targets`` in turn, then its best
    accuracy (highest first)."""
    return (*(_epochs(run, t) for t in targets), -(run["best_accuracy"] or 0))


def _choose_mult(runs: list[dict], k: int, targets: tuple[str, str]) -> float | None:
    """S-SGD's m at k: the grid's fastest to the last of ``targets`` at seed 0 (then to the
    first, then the best accuracy)."""
    grid = [r for r in runs if r["system"] == "ssgd" and r["k"] == k and r["seed"] == 0]
    if not grid:
        return None
    return min(grid, key=lambda r: _speed(r, (targets[-1], targets[0])))["lr_mult"]


def _is_sma_config(config: str, workload: str) -> bool:
    """Whether ``config`` (a run name's configuration) is SMA at the workload's η₁ and b = 16,
    another α, μ_z or η scale than the defaults."""
    return config.startswith("sma-") and f"-b16-lr{WORKLOADS[workload]['lr']:g}-" in config


def _choose_sma(runs: list[dict], others: list[dict], k: int, workload: str) -> tuple[str, list]:
    """SMA at its best (α, η) at k: of the defaults and every other SMA configuration at η₁ and
    b = 16 run at k, the fastest at seed 0 to the first target, the one the goal's ratios are
    of (then to the last, then the best accuracy; the defaults on a tie), and all its seeds'
    runs."""
    targets = WORKLOADS[workload]["targets"]
    candidates = {"defaults": [r for r in runs if r["system"] == "sma" and r["k"] == k]}
    for r in others:
        if r["k"] == k and _is_sma_config(r["config"], workload):
            candidates.setdefault(r["config"], []).append(r)
    ranked = [((*_speed(r, (targets[0], targets[-1])), config != "defaults"), config)
              for config, rs in candidates.items() for r in rs if r["seed"] == 0]
    if not ranked:
        return "defaults", candidates["defaults"]
    best = min(ranked)[1]
    return best, candidates[best]


def summarise(runs: list[dict], workload: str = "w1") -> dict:
    """Per system and k: the chosen runs' epochs and samples to each target per seed, their
    median, its ratio to the median at k = 1, the best accuracy; S-SGD's m and its grid."""
    targets = WORKLOADS[workload]["targets"]
    target = targets[-1]
    others = [r for r in runs if "config" in r]
    runs = [r for r in runs if "config" not in r]
    systems: dict[str, dict] = {"sma": {}, "ssgd": {}, "allreduce": {}, "sma_tuned": {}}
    ks = sorted({r["k"] for r in runs})
    for k in ks:
        m = _choose_mult(runs, k, targets)
        picks = {system: [r for r in runs if r["system"] == system and r["k"] == k
                          and (system != "ssgd" or r["lr_mult"] == m)] for system in systems}
        tuned, picks["sma_tuned"] = _choose_sma(runs, others, k, workload)
        if k == 1:  # plain SGD at b: S-SGD and SMA are the same run at k = 1
            picks["ssgd"] = picks["allreduce"] = picks["sma_tuned"] = picks["sma"]
        for system, rs in picks.items():
            if not rs:
                continue
            row = _row(rs, targets)
            if system == "sma_tuned":
                row["config"] = tuned
            if system == "ssgd" and k > 1:
                row["lr_mult"] = m
                row["grid"] = {f"{r['lr_mult']:g}": _finite(_epochs(r, target))
                               for r in runs if r["system"] == "ssgd" and r["k"] == k
                               and r["seed"] == 0}
            systems[system][str(k)] = row
    for rows in systems.values():
        if list(rows) == ["1"]:  # a system never run at k > 1 has no line
            rows.clear()
    configs: dict[str, dict] = {}
    for r in others:
        configs.setdefault(r["config"], []).append(r)
    configs = {c: dict(system=rs[0]["system"], k=rs[0]["k"], **_row(rs, targets))
               for c, rs in sorted(configs.items(), key=lambda kv: (kv[1][0]["k"], kv[0]))}
    for row in [*(r for rows in systems.values() for r in rows.values()), *configs.values()]:
        for t in targets:
            base = systems["sma"].get("1", {}).get(t, {}).get("median")
            med = row[t]["median"]
            row[t]["ratio_to_k1"] = None if base is None or med is None else med / base
    return dict(workload=workload, batch_per_learner=16, lr_k1=WORKLOADS[workload]["lr"],
                target=target, targets=targets, systems=systems, others=configs)


def _row(rs: list[dict], targets: tuple[str, ...]) -> dict:
    """The runs ``rs`` of one configuration, by seed: epochs and samples to each target per
    seed (None: not reached), the median (a miss counts as +∞), the best accuracies, the cap."""
    rs = sorted(rs, key=lambda r: r["seed"])
    row = dict(seeds=[r["seed"] for r in rs], runs=[r["name"] for r in rs],
               best_accuracy=[r["best_accuracy"] for r in rs],
               max_epochs=max(r["max_epochs"] for r in rs))
    for t in targets:
        eps = [_epochs(r, t) for r in rs]
        row[t] = dict(epochs=[None if e == math.inf else e for e in eps],
                      samples=[None if e == math.inf else r["to_target"][t]["samples"]
                               for e, r in zip(eps, rs)],
                      median=_finite(statistics.median(eps)))
    return row


def _finite(x: float) -> float | None:
    return None if x is None or math.isinf(x) else x


def _median_line(ax, points: list[tuple[int, float, list]], shift: float, colour: str,
                 **errorbar_kw) -> None:
    """One line on ``ax``: per (k, cap, values of the seeds; None: not reached) the median and
    the seeds' range at k·``shift`` (a missing value counts at the cap), a filled marker where
    the median reached the target, and a hollow one at the cap for each seed that missed (so a
    median that missed shows hollow only)."""
    xs, med, lo, hi, reached = [], [], [], [], []
    for k, cap, values in points:
        filled = [cap if v is None else v for v in values]
        xs.append(k * shift)
        med.append(statistics.median(filled))
        lo.append(med[-1] - min(filled))
        hi.append(max(filled) - med[-1])
        missed = sum(v is None for v in values)
        reached.append(2 * missed < len(values))  # the median of the seeds is a value, not a miss
        if missed:
            ax.scatter([k * shift] * missed, [cap] * missed, s=70, facecolors="none",
                       edgecolors=colour, zorder=3)
    ax.errorbar(xs, med, yerr=[lo, hi], marker="o", capsize=4, color=colour,
                markevery=[i for i, r in enumerate(reached) if r], **errorbar_kw)


def plot(summary: dict, out: str | None = None) -> str:
    """Epochs to each target (one panel each) against k (log₂), one line per system: the median
    and the seeds' range; a seed that did not reach it is drawn at its cap (hollow marker)."""
    targets = summary["targets"]
    out = out or os.path.join(IMAGES, f"stat_eff_{summary['workload']}.png")
    fig, axes = plt.subplots(1, len(targets), figsize=(10, 4.6), sharey=True)
    labels = {"sma": "SMA, the engine's defaults (k = 1's η₁ at every k)",
              "ssgd": f"plain S-SGD, one model at B = k·b, {WORKLOADS[summary['workload']]['ssgd']}",
              "allreduce": "S-SGD, k learners of b all-reduced (BatchNorm per learner), SMA's η rule",
              "sma_tuned": "SMA at its best (α, η) per k of those run (the fastest at seed 0)"}
    lines = [(system, rows) for system, rows in summary["systems"].items() if len(rows) > 1]
    for ax, t in zip(axes, targets):
        for (system, rows), shift, colour in zip(lines, (0.91, 0.97, 1.03, 1.09),
                                                 ("C0", "C1", "C2", "C3")):
            points = [(k, rows[str(k)]["max_epochs"], rows[str(k)][t]["epochs"])
                      for k in sorted(int(k) for k in rows)]
            _median_line(ax, points, shift, colour, label=labels[system])
        ax.set_xscale("log", base=2)
        ax.set_xlabel("learners k (b = 16 each)")
        ax.set_title(f"to {100 * float(t):.1f} % test accuracy", fontsize=9)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("epochs (median, range over 3 seeds; hollow: not reached at the cap)")
    axes[0].yaxis.label.set_fontsize(8)
    fig.legend(*axes[0].get_legend_handles_labels(), loc="lower center", fontsize=8, ncol=2)
    fig.suptitle(WORKLOADS[summary["workload"]]["title"], fontsize=10)
    fig.tight_layout(rect=(0, 0.05 * math.ceil(len(lines) / 2) + 0.04, 1, 1))
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def markdown(summary: dict) -> list[str]:
    """The summary as a Markdown table: per k, each system's epochs to each target per seed
    ("—": not reached) and the median's ratio to k = 1, S-SGD's chosen m."""
    t0, t1 = summary["targets"]
    p0, p1 = (f"{100 * float(t):.1f} %" for t in (t0, t1))
    ssgd = WORKLOADS[summary["workload"]]["ssgd"]
    systems = summary["systems"]
    allreduce = len(systems.get("allreduce", {})) > 1
    head = [f"| k | SMA, defaults: to {p0} | to {p1} | plain S-SGD at B = k·b ({ssgd}): m "
            f"| to {p0} | to {p1} |" + (f" S-SGD, k learners all-reduced: to {p0} | to {p1} |"
                                         if allreduce else ""),
            "|---|---|---|---|---|---|" + ("---|---|" if allreduce else "")]

    def cell(row: dict | None, t: str, best: bool = True) -> str:
        if row is None:
            return "not run"
        eps = ", ".join("—" if e is None else f"{e:.2f}" for e in row[t]["epochs"])
        ratio = row[t]["ratio_to_k1"]
        if best and t == t0 and all(e is None for e in row[t]["epochs"]):  # how close it came
            return eps + " (best " + ", ".join(f"{100 * a:.1f}" for a in row["best_accuracy"]
                                               if a is not None) + " %)"
        return eps + (f" (×{ratio:.2f})" if ratio is not None else "")

    out = []
    for k in sorted({int(k) for rows in systems.values() for k in rows}):
        sma, ssgd = systems["sma"].get(str(k)), systems["ssgd"].get(str(k))
        m = "=" if k == 1 else (f"{ssgd['lr_mult']:g}" if ssgd else "—")
        ar = systems.get("allreduce", {}).get(str(k))
        out.append(f"| {k} | {cell(sma, t0)} | {cell(sma, t1)} | {m} | "
                   f"{cell(ssgd, t0)} | {cell(ssgd, t1)} |"
                   + (f" {cell(ar, t0)} | {cell(ar, t1)} |" if allreduce else ""))
    tuned = systems.get("sma_tuned", {})
    if len(tuned) > 1:
        out += ["", f"| k | SMA at its best (α, η) of those run (bench/sma_rules.py run name) "
                f"| to {p0} | to {p1} |", "|---|---|---|---|"]
        out += [f"| {k} | {row['config']} | {cell(row, t0)} | {cell(row, t1)} |"
                for k, row in sorted(tuned.items(), key=lambda kv: int(kv[0])) if k != "1"]
    if summary.get("others"):
        out += ["", f"| k | other configuration (bench/sma_rules.py run name) | seeds | to {p0} "
                f"| to {p1} | best % |", "|---|---|---|---|---|---|"]
        for config, row in summary["others"].items():
            best = ", ".join(f"{100 * a:.1f}" for a in row["best_accuracy"] if a is not None)
            out.append(f"| {row['k']} | {config} | {', '.join(map(str, row['seeds']))} | "
                       f"{cell(row, t0, False)} | {cell(row, t1)} | {best} |")
    return head + out


def report(workload: str = "w1") -> int:
    runs = [_short(r) for r in collect(workload)]  # as the curves file keeps them
    summary = summarise(runs, workload)
    summary["commands"] = [WORKLOADS[workload]["runs"],
                           f"python bench/stat_eff.py --report --workload {workload}"]
    with open(os.path.join(RESULTS, f"stat_eff_{workload}.json"), "w") as f:
        json.dump(summary, f, indent=1)
    with open(_curves_path(workload), "w") as f:
        json.dump([{k: v for k, v in r.items() if k != "to_target"} for r in runs], f)
    print("\n".join(markdown(summary)))
    print("wrote", plot(summary))
    return 0


# The GPT (W4, bench/lm_baselines.py, its runs in bench/results/lm-w4.json): tokens to its target
# validation loss against k at a fixed b windows per learner; S-SGD at k·b is plain AdamW at
# batch k·b, re-tuned: its lrs are W4's grid's best at that B and its neighbour below (the grid's
# best lr at B = 16 is the grid's lowest). Each line: (label, b, the configurations of its
# points); where several configurations give one k, the point is the one with the fewest median
# tokens (then the lowest final loss of its first seed).
GPT_SOURCE = os.path.join(RESULTS, "lm-w4.json")
GPT_CAP_TOKENS = 1_572_864  # docs/benchmarking.md, W4: a run ends there (or is abandoned before)
_B1 = "b=1:lr=1e-3:beta2=0.9975:fused=1"  # the b = 1 lines' SMA settings
GPT_LINES = (  # SMA's defaults up to k = 4 are α = 0.8 of the pull's bound, β = k·α (design §2)
    ("SMA, AdamW, defaults, b = 1", 1, ("adamw:b=1:lr=1e-3:beta2=0.9975",
                                         f"sma-adamw:k=4:{_B1}:bound=0.8",
                                         f"sma-adamw:k=8:{_B1}:default=1",
                                         f"sma-adamw:k=16:{_B1}:default=1")),
    ("SMA, AdamW, α = 0.8 of the bound, β = k·α, b = 1", 1, (
        "adamw:b=1:lr=1e-3:beta2=0.9975", f"sma-adamw:k=4:{_B1}:bound=0.8",
        f"sma-adamw:k=8:{_B1}:bound=0.8")),
    ("SMA, AdamW, α = 1/k, b = 1", 1, ("adamw:b=1:lr=1e-3:beta2=0.9975", f"sma-adamw:k=4:{_B1}",
                                        f"sma-adamw:k=8:{_B1}")),
    ("SMA, AdamW, defaults, one second moment per device, b = 1", 1, (
        "adamw:b=1:lr=1e-3:beta2=0.9975", f"sma-adamw:k=4:{_B1}:default=1:share=1",
        f"sma-adamw:k=8:{_B1}:default=1:share=1", f"sma-adamw:k=16:{_B1}:default=1:share=1",
        f"sma-adamw:k=32:{_B1}:default=1:share=1")),
    ("SMA, AdamW, one second moment per device, lr 5e-4 at k = 8, b = 1", 1, (
        "adamw:b=1:lr=1e-3:beta2=0.9975", f"sma-adamw:k=4:{_B1}:default=1:share=1",
        "sma-adamw:k=8:b=1:lr=5e-4:beta2=0.9975:fused=1:default=1:share=1")),
    ("AdamW at k·b, lr re-tuned, b = 1", 1, ("adamw:b=1:lr=1e-3:beta2=0.9975", "adamw:b=4:lr=1e-3",
                                              "adamw:b=8:lr=1.4e-3", "adamw:b=8:lr=7.1e-4",
                                              "adamw:b=16:lr=1e-3", "adamw:b=16:lr=5e-4")),
    *((f"{name}, AdamW, H = 4, b = 1", 1, ("adamw:b=1:lr=1e-3:beta2=0.9975", *(
        f"{system}:k={k}:{_B1}:H=4" for k in (8, 32))))
      for name, system in (("LocalSGD", "localsgd-adamw"), ("DiLoCo", "diloco-adamw"))),
    ("SMA, AdamW, defaults, b = 4", 4, ("adamw:b=4:lr=1e-3",
                                         "sma-adamw:k=4:b=4:lr=1e-3:fused=1:bound=0.8",
                                         "sma-adamw:k=16:b=4:lr=1e-3:fused=1:default=1")),
    ("SMA, AdamW, α = 0.8 of the bound, β = k·α, b = 4", 4, (
        "adamw:b=4:lr=1e-3", "sma-adamw:k=4:b=4:lr=1e-3:fused=1:bound=0.8",
        "sma-adamw:k=16:b=4:lr=1e-3:fused=1:bound=0.8")),
    ("SMA, AdamW, α = 1/k, b = 4", 4, ("adamw:b=4:lr=1e-3", "sma-adamw:k=4:b=4:lr=1e-3:fused=1",
                                         "sma-adamw:k=16:b=4:lr=1e-3:fused=1")),
    ("AdamW at k·b, lr re-tuned, b = 4", 4, ("adamw:b=4:lr=1e-3", "adamw:b=16:lr=1e-3",
                                              "adamw:b=16:lr=5e-4")),
)


def gpt_summary(source: str = GPT_SOURCE) -> dict:
    """Per line of ``GPT_LINES`` and k: its configuration (the best where several were run, the
    others' median tokens in ``tried``), the tokens to the target per seed (None: not reached),
    their median (a miss counts as +∞; None when the median is) and its ratio to k = 1."""
    import lm_baselines  # bench/lm_baselines.py: its configurations' parser

    with open(source) as f:
        data = json.load(f)
    lines = {}
    for label, b, configs in GPT_LINES:
        points: dict[str, list[dict]] = {}  # per k, every configuration run
        for text in configs:
            row = data["summary"].get(text)
            if row is None:
                continue
            config = lm_baselines.parse(text)
            k = config["b"] // b if config["system"] in ("adamw", "sgd") else config["k"]
            points.setdefault(str(k), []).append(dict(
                config=text, seeds=row["seeds"], tokens=row["tokens"],
                median=row["median_tokens"], final_loss=row["final"]))
        rows = {}
        for k, runs in points.items():
            best = min(runs, key=_gpt_rank)  # the first listed among equals
            rows[k] = dict(best, tried={p["config"]: p["median"] for p in runs if p is not best})
        base = rows.get("1", {}).get("median")
        for row in rows.values():
            row["ratio_to_k1"] = None if base is None or row["median"] is None else row["median"] / base
        lines[label] = rows
    return dict(workload="gpt", target=data["target"], source=os.path.relpath(source, BENCH),
                cap_tokens=GPT_CAP_TOKENS, lines=lines)


def _gpt_rank(point: dict) -> tuple[float, float]:
    """A GPT point's order among configurations of one k: median tokens (a miss last), then the
    final loss of its first seed."""
    return (math.inf if point["median"] is None else point["median"], point["final_loss"][0])


def plot_gpt(summary: dict, out: str | None = None) -> str:
    """Tokens to the target against k (log₂), one line per ``GPT_LINES`` entry: the median and
    the seeds' range; a seed that did not reach it is drawn at the cap (hollow marker)."""
    out = out or os.path.join(IMAGES, "stat_eff_gpt.png")
    fig, ax = plt.subplots(figsize=(10, 4.6))
    colors = plt.get_cmap("tab20").colors  # more lines than tab10's colours
    for i, (label, rows) in enumerate(summary["lines"].items()):
        points = [(k, summary["cap_tokens"] / 1e6,
                   [None if t is None else t / 1e6 for t in rows[str(k)]["tokens"]])
                  for k in sorted(int(k) for k in rows)]  # M tokens
        _median_line(ax, points, (0.92, 0.96, 1.0, 1.04, 1.08)[i % 5], colors[2 * i % 20 + i // 10],
                     label=label, ls="-" if label.startswith("SMA") else "--")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("learners k (b windows of 128 bytes each)")
    ax.set_ylabel("M tokens to the target (median, seeds' range; hollow: not reached)", fontsize=8)
    ax.set_title(f"W4, a GPT on the fortunes bytes: to a validation loss of {summary['target']:g}",
                 fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(out, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return out


def gpt_report() -> int:
    summary = gpt_summary()
    summary["commands"] = ["docs/benchmarking.md, W4 (bench/lm_baselines.py)",
                           "python bench/stat_eff.py --report --workload gpt"]
    with open(os.path.join(RESULTS, "stat_eff_gpt.json"), "w") as f:
        json.dump(summary, f, indent=1)
    for label, rows in summary["lines"].items():
        for k, row in sorted(rows.items(), key=lambda kv: int(kv[0])):
            ratio = row["ratio_to_k1"]
            print(f"{label:<34} k={k:<3} {row['config']:<48} {row['tokens']} "
                  + (f"×{ratio:.2f}" if ratio else ""))
    print("wrote", plot_gpt(summary))
    return 0


ROBUSTNESS_BS = (4, 8, 16, 32, 64)  # b per learner of the robustness runs


def robustness_jobs(bs=ROBUSTNESS_BS) -> list[tuple[str, int, dict]]:
    """(system, b, spec) of the robustness runs (bench/tta.py's specs), lr 0.02 for every one:
    crossbow_graph's defaults (2 devices × 2 replicas, SMA, its η rule: 4 learners at 2 × 0.02),
    the same at the lr as set (``SMA(scale_lr=False)``) and plain PyTorch at b."""
    jobs = []
    for b in bs:
        sma = dict(kind="crossbow", batch=b, lr=0.02, devices=2, replicas=2, sync="sma")
        jobs.append(("crossbow", b, sma))
        jobs.append(("crossbow-lr-as-set", b, dict(sma, scale_lr=False)))
        jobs.append(("plain", b, tta._plain(b, lr=0.02, threads=1)))
    return jobs


def robustness(out: str, epochs: int, train_samples: int | None, bs=ROBUSTNESS_BS,
               command: str = "") -> int:
    """The final test accuracy after ``epochs`` over b ∈ ``bs`` with the lr left at 0.02,
    one ``bench/tta.py`` subprocess per run, to ``out`` (JSON, with ``command``) after every run."""
    meta = dict(when=time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()), part="robustness",
                workload="w1", seeds=[0], max_epochs=epochs, train_samples=train_samples,
                command=command)
    runs = []
    for system, b, spec in robustness_jobs(bs):
        job = dict(spec=spec, workload="w1", seed=0, max_epochs=epochs, target=1.0,  # no stop
                   evals_per_epoch=4, max_train_s=None, train_samples=train_samples)
        res = tta.run_in_subprocess(job, 900)
        runs.append(dict(system=system, x=b, seed=0, spec=spec, result=res))
        print(f"{system:<18} b={b:<3} {res.get('final_accuracy', res.get('error'))}", flush=True)
        with open(out, "w") as f:
            json.dump(dict(meta, runs=runs), f, indent=1)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--k", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--jobs", type=int, default=2, help="runs at once (each one thread)")
    p.add_argument("--report", action="store_true", help="summarise the runs done, plot")
    p.add_argument("--workload", choices=sorted(WORKLOADS) + ["gpt"], default="w1",
                   help="--report's (gpt: from W4's runs, bench/results/lm-w4.json)")
    p.add_argument("--robustness", metavar="OUT", default=None,
                   help="instead: final accuracy against b at lr 0.02 (robustness_jobs), to OUT")
    p.add_argument("--epochs", type=int, default=1, help="--robustness: epochs per run")
    p.add_argument("--train-samples", type=int, default=None, help="--robustness: first N")
    argv = sys.argv[1:] if argv is None else argv
    args = p.parse_args(argv)
    if args.report:
        return gpt_report() if args.workload == "gpt" else report(args.workload)
    if args.robustness:
        return robustness(args.robustness, args.epochs, args.train_samples,
                          command=" ".join(["python bench/stat_eff.py", *argv]))
    runs = collect()
    chosen = {k: _choose_mult(runs, k, TARGETS) for k in args.k}
    with tempfile.TemporaryDirectory() as tmp:  # the queue re-reads its file between runs
        path = os.path.join(tmp, "stat_eff_jobs.txt")
        with open(path, "w") as f:
            f.write("\n".join(job_lines(args.k, args.seeds,
                                        {k: m for k, m in chosen.items() if m})) + "\n")
        return subprocess.call([sys.executable, os.path.join(BENCH, "sma_rules.py"), "queue",
                                path, "--jobs", str(args.jobs)])


if __name__ == "__main__":
    sys.exit(main())
