"""W1 time-to-accuracy of tuned plain PyTorch: the baselines of docs/benchmarking.md's protocol.

LeNet-5 on MNIST to 99.0 % test accuracy, plain PyTorch eager (one model, ``torch.set_num_threads``
to the machine's cores, as a user would run it), with the recipes a user who tunes would pick:

* ``sgd-multistep``: ``torch.optim.SGD(momentum=0.9)``, ``MultiStepLR(milestones=[2, 4],
  gamma=0.1)`` stepped per epoch; lr around 0.01·B/16 (linear in B);
* ``sgd-onecycle``: ``SGD(momentum=0.9)`` with ``OneCycleLR`` (its momentum cycle, stepped per
  batch) over ``--cycle-epochs`` epochs; max lr around 0.02·B/16 (linear in B);
* ``adamw-onecycle``: ``torch.optim.AdamW`` (weight decay 0.01) with ``OneCycleLR`` over
  ``--cycle-epochs`` epochs; max lr around 4e-3·√(B/128) (square root in B, as for Adam);

each for B ∈ {32, 64, 128, 256} and a sweep of three lrs (0.5×, 1×, 2× the centre). A OneCycle
cycle spans min(``--cycle-epochs``, ``--max-epochs``) epochs and the run ends with it (its lr is
then ~0). The best median time-to-accuracy over the grid is the baseline.

Measurement (the rule of ``bench/tta.py``, whose helpers are used, so that both sides count
alike): the test set is evaluated ``--evals-per-epoch`` times per epoch (4), at evenly spaced
steps; time is training wall seconds, evaluation excluded; a run stops at the target, at
``--max-epochs`` (6) or at the first evaluation after ``--max-train-s`` training seconds. Every
run is a fresh ``python bench/tta_baselines.py --one JSON`` process; the runs are interleaved
(every configuration for seed 0, then every one for seed 1, …, the order rotated by one
configuration per seed). A run that misses the target counts as +∞ in a median.

    python bench/tta_baselines.py                              # the whole grid, 3 seeds (hours)
    python bench/tta_baselines.py --recipes adamw-onecycle --batches 128 --seeds 0
    python bench/tta_baselines.py --configs sgd-multistep:64:0.04 adamw-onecycle:128:0.004 \\
        --with-tta-systems crossbow-cli --seeds 0 1 2      # chosen ones, interleaved with crossbow
    python bench/tta_baselines.py --smoke                      # one short run (tests)

``--configs`` runs only the listed ``recipe:B:lr`` configurations; ``--with-tta-systems`` adds
systems of ``bench/tta.py`` (e.g. ``crossbow-cli``, ``crossbow-graph train`` with its defaults) into
the same interleaving, each run by ``bench/tta.py``'s own runner. Prints a table; writes
``bench/runs/tta-baselines-<UTC time>.json`` (not committed) after every run. ``run_recipe`` runs
one configuration in this process (importable: ``from tta_baselines import run_recipe`` with
``bench/`` on the path).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable

import torch

BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, BENCH)
sys.path.insert(0, os.path.dirname(BENCH))

import crossbow_graph as cg  # noqa: E402
from crossbow_graph.engine.learning.threads import available_cores  # noqa: E402

import tta  # noqa: E402  (bench/tta.py: data, evaluation points, accuracy, result record)

__all__ = ["RECIPES", "BATCHES", "LR_FACTORS", "Recipe", "grid", "run_recipe", "summarise", "main"]

RESULTS = os.path.join(BENCH, "runs")  # raw runs, not committed
TARGET = tta.TARGETS["w1"]
BATCHES = (32, 64, 128, 256)
LR_FACTORS = (0.5, 1.0, 2.0)  # the sweep around each recipe's centre lr


@dataclass(frozen=True)
class Recipe:
    """One plain-PyTorch training recipe.

    Attributes:
        optimizer: ``"sgd"`` (momentum 0.9) or ``"adamw"`` (weight decay 0.01).
        schedule: ``"multistep"`` (×0.1 at epochs 2 and 4, per epoch) or ``"onecycle"``
            (``OneCycleLR`` over the cycle's epochs, per batch).
        centre_lr: B → the centre of the lr sweep (the max lr for OneCycle).
        channels_last: the model's weights in ``torch.channels_last`` (the layout
            ``crossbow_graph.compile`` gives convolution weights on a CPU; not in the protocol's
            grid: shown beside it, so that the gain of the layout is seen apart from the engine's).
    """

    optimizer: str
    schedule: str
    centre_lr: Callable[[int], float]
    channels_last: bool = False


RECIPES: dict[str, Recipe] = {
    "sgd-multistep": Recipe("sgd", "multistep", lambda B: 0.01 * B / 16),
    "sgd-onecycle": Recipe("sgd", "onecycle", lambda B: 0.02 * B / 16),
    "adamw-onecycle": Recipe("adamw", "onecycle", lambda B: 4e-3 * math.sqrt(B / 128)),
    "adamw-onecycle-cl": Recipe("adamw", "onecycle", lambda B: 4e-3 * math.sqrt(B / 128),
                                channels_last=True),
}
GRID = ("sgd-multistep", "sgd-onecycle", "adamw-onecycle")  # the protocol's recipes
MILESTONES = (2, 4)  # MultiStepLR's epochs, as crossbow-graph train's default --lr-milestones


def grid(recipes=GRID, batches=BATCHES, factors=LR_FACTORS) -> list[dict]:
    """Configurations ``dict(recipe, batch, lr)`` of the sweep, lr rounded to 3 significant digits."""
    return [dict(recipe=r, batch=B, lr=float(f"{RECIPES[r].centre_lr(B) * f:.3g}"))
            for r in recipes for B in batches for f in factors]


def config_name(config: dict) -> str:
    """``recipe:B:lr``, e.g. ``sgd-multistep:64:0.04`` (what ``--configs`` takes)."""
    return f"{config['recipe']}:{config['batch']}:{config['lr']:g}"


def parse_config(text: str) -> dict:
    """The inverse of ``config_name``; ValueError naming the format on a bad one."""
    try:
        recipe, batch, lr = text.split(":")
        config = dict(recipe=recipe, batch=int(batch), lr=float(lr))
    except ValueError:
        raise ValueError(f"--configs {text!r}: use RECIPE:B:LR, e.g. sgd-multistep:64:0.04") from None
    if recipe not in RECIPES:
        raise ValueError(f"--configs {text!r}: unknown recipe {recipe!r}; use one of {', '.join(RECIPES)}")
    return config


def _optimizer(recipe: Recipe, model: torch.nn.Module, lr: float) -> torch.optim.Optimizer:
    if recipe.optimizer == "sgd":
        return torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)


def run_recipe(recipe: str, batch: int, lr: float, seed: int, max_epochs: int = 6,
               target: float = TARGET, *, evals_per_epoch: int = 4, threads: int | None = None,
               max_train_s: float = math.inf, cycle_epochs: int = 3, train=None, test=None,
               train_samples: int | None = None, test_samples: int | None = None) -> dict:
    """Train LeNet-5 on MNIST with one plain-PyTorch recipe until ``target`` test accuracy.

    Args:
        recipe: a name of ``RECIPES``; batch: B; lr: the lr (OneCycle: its max lr).
        seed: initialisation and data order (``torch.randperm`` per epoch, last partial batch
            dropped, as ``bench/tta.py``'s plain runs).
        max_epochs: cap; a OneCycle run also ends with its cycle of ``cycle_epochs`` epochs.
        target: test accuracy (fraction) that ends the run.
        evals_per_epoch: evaluations of the test set per epoch (``tta._eval_points``).
        threads: intra-op threads (default: the cores this process may use).
        max_train_s: also end at the first evaluation after this many training seconds.
        train, test: the data sets (default: ``tta.load("w1", train_samples, test_samples)``).

    Returns:
        ``tta._result``'s record (evals, samples, train_seconds, samples_per_s,
        time_to_accuracy_s, epochs_to_accuracy, final and best accuracy) with the configuration.
    """
    spec = RECIPES[recipe]
    if train is None or test is None:
        train, test = tta.load("w1", train_samples, test_samples)
    threads = threads or available_cores()
    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    model = cg.models.get_model("lenet5").train()
    if spec.channels_last:
        model = model.to(memory_format=torch.channels_last)
    opt = _optimizer(spec, model, lr)
    steps = len(train) // batch
    epochs = min(max_epochs, cycle_epochs) if spec.schedule == "onecycle" else max_epochs
    if spec.schedule == "onecycle":
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=epochs * steps)
        steppers = dict(step_each_batch=sched.step)
    else:
        sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=list(MILESTONES), gamma=0.1)
        steppers = dict(step_each_epoch=sched.step)
    out = tta.train_plain(model, opt, train, test, batch=batch, seed=seed, epochs=epochs,
                          target=target, evals_per_epoch=evals_per_epoch,
                          max_train_s=max_train_s, **steppers)
    out.update(recipe=recipe, batch=batch, lr=lr, threads=threads)
    return out


def _run_in_subprocess(job: dict, timeout_s: float) -> dict:
    """``run_recipe(**job)`` in a fresh ``python bench/tta_baselines.py --one`` process."""
    return tta.run_in_subprocess(job, timeout_s, script=__file__)


# -- summary ------------------------------------------------------------------------------------

def summarise(runs: list[dict]) -> dict:
    """Per system (``recipe:B:lr`` or a bench/tta.py system): runs, runs reaching the target,
    median and spread of time- and epochs-to-accuracy, median samples/s; the best configuration
    per recipe and B; the best plain configuration overall (the baseline)."""
    table: dict[str, dict] = {}
    for name in dict.fromkeys(r["system"] for r in runs):
        rs = [r["result"] for r in runs if r["system"] == name and "error" not in r["result"]]
        if not rs:
            continue
        tta_s = [r["time_to_accuracy_s"] for r in rs]
        reached = [x for x in tta_s if x is not None]
        table[name] = dict(
            runs=len(rs), reached=len(reached), tta_median_s=tta._median(tta_s),
            tta_min_s=min(reached, default=None),
            tta_max_s=max(reached) if reached and len(reached) == len(rs) else None,
            eta_median=tta._median([r["epochs_to_accuracy"] for r in rs]),
            samples_per_s_median=statistics.median(r["samples_per_s"] for r in rs),
            final_accuracy_median=statistics.median(r["final_accuracy"] or 0.0 for r in rs))
    plain = {n: t for n, t in table.items() if n.count(":") == 2 and t["tta_median_s"] is not None}
    best_per = {}
    for name, t in plain.items():
        key = ":".join(name.split(":")[:2])
        if key not in best_per or t["tta_median_s"] < plain[best_per[key]]["tta_median_s"]:
            best_per[key] = name
    best = min(plain, key=lambda n: plain[n]["tta_median_s"]) if plain else None
    return dict(systems=table, best_per_recipe_and_batch=best_per, baseline=best,
                baseline_tta_median_s=plain[best]["tta_median_s"] if best else None)


_fmt = tta._fmt  # "—" for a missed target


def print_table(summary: dict) -> None:
    rows = sorted(summary["systems"].items(),
                  key=lambda kv: math.inf if kv[1]["tta_median_s"] is None else kv[1]["tta_median_s"])
    print(f"\n{'system':<26} {'reached':>7} {'TTA median s':>12} {'spread s':>13} {'epochs':>6} "
          f"{'samples/s':>10} {'final acc':>9}")
    for name, t in rows:
        spread = f"{_fmt(t['tta_min_s'])}–{_fmt(t['tta_max_s'])}"
        print(f"{name:<26} {t['reached']}/{t['runs']:<5} {_fmt(t['tta_median_s']):>12} "
              f"{spread:>13} {_fmt(t['eta_median'], '{:.2f}'):>6} "
              f"{t['samples_per_s_median']:>10,.0f} {t['final_accuracy_median']:>9.4f}")
    print(f"\nbaseline (best plain configuration): {summary['baseline'] or '— (none reached the target)'}"
          f"  {_fmt(summary['baseline_tta_median_s'])} s")


# -- the sweep ----------------------------------------------------------------------------------

def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--recipes", nargs="+", default=list(GRID), choices=list(RECIPES))
    p.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
    p.add_argument("--lr-factors", type=float, nargs="+", default=list(LR_FACTORS),
                   help="the lr sweep, as factors of each recipe's centre lr")
    p.add_argument("--configs", nargs="+", default=None, metavar="RECIPE:B:LR",
                   help="run these configurations instead of the grid")
    p.add_argument("--with-tta-systems", nargs="+", default=[], metavar="SYSTEM",
                   help="bench/tta.py systems to interleave, e.g. crossbow-cli (crossbow-graph train "
                        "with its defaults) or 'cli:FLAGS' (with those flags)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--max-epochs", type=int, default=6, help="cap of every run")
    p.add_argument("--cycle-epochs", type=int, default=3,
                   help="OneCycleLR's length in epochs (at most --max-epochs)")
    p.add_argument("--target", type=float, default=TARGET)
    p.add_argument("--max-train-s", type=float, default=90.0,
                   help="also end a run at the first evaluation after this many training seconds")
    p.add_argument("--evals-per-epoch", type=int, default=4)
    p.add_argument("--threads", type=int, default=available_cores(),
                   help="intra-op threads of the plain runs (default: this machine's cores)")
    p.add_argument("--train-samples", type=int, default=None, help="first N training samples")
    p.add_argument("--test-samples", type=int, default=None, help="first N test samples")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    p.add_argument("--smoke", action="store_true",
                   help="one short run: sgd-multistep B=64 at its centre lr, seed 0, 1 epoch, "
                        "2,048 training and 500 test samples, 2 evaluations")
    p.add_argument("--out", default=None, help="JSON path (default bench/runs/tta-baselines-…)")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)
    return p


def _jobs(args: argparse.Namespace) -> list[tuple[str, int, dict]]:
    """(system name, seed, job) in run order: per seed every system, rotated by one per seed."""
    configs = ([parse_config(c) for c in args.configs] if args.configs else
               grid(args.recipes, args.batches, args.lr_factors))
    common = dict(max_epochs=args.max_epochs, target=args.target, evals_per_epoch=args.evals_per_epoch,
                  max_train_s=args.max_train_s, train_samples=args.train_samples,
                  test_samples=args.test_samples)
    systems = [(config_name(c), dict(c, seed=None, threads=args.threads, cycle_epochs=args.cycle_epochs,
                                     **common)) for c in configs]
    systems += [(name, dict(tta=dict(spec=tta.system_spec(name), workload="w1", seed=None, **common)))
                for name in args.with_tta_systems]
    jobs = []
    for i, seed in enumerate(args.seeds):
        k = i % len(systems)
        for name, job in systems[k:] + systems[:k]:
            job = json.loads(json.dumps(job))
            (job["tta"] if "tta" in job else job)["seed"] = seed
            jobs.append((name, seed, job))
    return jobs


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.one is not None:
        print(json.dumps(run_recipe(**json.loads(args.one))), flush=True)
        return 0
    if args.smoke:
        args.configs = [config_name(grid(["sgd-multistep"], [64], [1.0])[0])]
        args.seeds, args.max_epochs, args.evals_per_epoch = args.seeds[:1], 1, 2
        args.train_samples, args.test_samples = args.train_samples or 2048, args.test_samples or 500
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    out = args.out or os.path.join(RESULTS, f"tta-baselines-{stamp}{'-smoke' if args.smoke else ''}.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    jobs = _jobs(args)
    meta = dict(when=stamp, workload="w1", target=args.target, seeds=args.seeds,
                max_epochs=args.max_epochs, cycle_epochs=args.cycle_epochs,
                max_train_s=args.max_train_s, evals_per_epoch=args.evals_per_epoch,
                threads=args.threads, train_samples=args.train_samples,
                test_samples=args.test_samples, smoke=args.smoke,
                command="python bench/tta_baselines.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                torch=torch.__version__, machine=platform.machine(), cores=os.cpu_count())
    runs: list[dict] = []
    t_start = time.perf_counter()
    for name, seed, job in jobs:
        load1 = os.getloadavg()[0]
        res = (tta.run_in_subprocess(job["tta"], args.timeout) if "tta" in job
               else _run_in_subprocess(job, args.timeout))
        runs.append(dict(system=name, seed=seed, load_average_1min=load1, result=res))
        tta.print_run(seed, name, res, load1, width=26)
        with open(out, "w") as f:
            json.dump(dict(meta, wall_s=time.perf_counter() - t_start, runs=runs,
                           summary=summarise(runs)), f, indent=1)
    print_table(summarise(runs))
    print(f"wrote {out} ({time.perf_counter() - t_start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
