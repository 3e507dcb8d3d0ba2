"""W4: tokens and training seconds until ``models.gpt()`` reaches a validation loss on the fortunes
bytes (docs/benchmarking.md, W4), for plain PyTorch and crossbow_graph, and the AdamW grid.

A configuration is ``SYSTEM`` followed by ``:key=value`` settings (``adamw:b=4:lr=1e-3``):

* ``adamw`` / ``sgd``: plain PyTorch, one model, batches of b windows of 128 bytes;
  ``torch.optim.AdamW`` (betas (0.9, beta2), weight decay wd) or ``torch.optim.SGD`` (momentum
  mom, default 0: Marek et al. 2025's vanilla SGD);
* ``sma-adamw`` / ``sma-sgd``: ``crossbow_graph.compile(models.gpt(), ...)`` with k learners of b
  windows each, SMA (α = 1/k or by ``bound``, μ_z = 0.9), the same optimizer per learner;
* ``diloco-adamw`` / ``diloco-sgd``: the same with ``sync=DiLoCo(sync_every=H)`` (Nesterov outer
  step, lr ``olr``, momentum 0.9); ``localsgd-adamw`` / ``localsgd-sgd``: ``sync=LocalSGD(sync_every=H)``
  (the learners' mean every H rounds); both at the lr as set.

Keys: ``k`` learners (1), ``b`` windows per learner (4), ``lr`` peak (1e-3), ``beta2`` (0.99),
``mom`` (0), ``wd`` (0.1 for AdamW, 0 for SGD), ``H`` (8), ``scale`` (1: SMA's η rule, the
learners step at lr × √min(k, 16); 0: ``SMA(scale_lr=False)``, lr as set), ``bound`` (0: α = 1/k;
f > 0: α = f × the pull's stability bound 2(1 + μ_z)/(1 + k + μ_z), design §2; both with z's rate
β = k·α, CROSSBOW's update), ``default`` (1: ``SMA()``'s α and β, design §2), ``olr`` (0.7, DiLoCo's outer lr). Tokens count every learner's
(k·b·128 a round); ``fused`` (0: one module per learner, ``learner_mode="per_replica"``;
1: the k learners of a device as one vmapped module, ``learner_mode="fused"``). Every run: one intra-op thread per process; the learning rate warms up
linearly over the first 5 % of ``--schedule-tokens`` and follows a cosine to a tenth of its peak
at ``--schedule-tokens``, then stays there (``crossbow_graph.cli_lm.lr_factor``, the schedule of
``crossbow-graph train --model gpt``); batches are drawn without replacement from a seeded
permutation of the training windows (one pass, at most ``--cap-tokens``); the validation loss of
the model (z) on ``--val-windows`` evenly spread windows of the validation split is measured at
the start and every ``--eval-every`` tokens; the run stops at the first evaluation at or below
``--target`` (crossbow_graph: ``fit(target_loss=)``) or at ``--cap-tokens``. Seconds are training seconds (evaluation excluded).
crossbow_graph runs with ``--executor process`` on 2 CPU devices (k/2 learners each, one process
per device) or ``inline`` on one device in this process (one thread); DiLoCo and LocalSGD run
inline.

    nice -n 19 python bench/lm_baselines.py --configs adamw:b=4:lr=1e-3 sma-adamw:k=4:b=2:lr=1e-3 \\
        --seeds 0 1 2 --target 2.4
    nice -n 19 python bench/lm_baselines.py --grid --schedule-tokens 524288 --cap-tokens 524288 --target 0
    python bench/lm_baselines.py --speed adamw:b=4 sma-adamw:k=4:b=2
    python bench/lm_baselines.py --report bench/runs/lm-*.json --target 2.4 \\
        --out bench/results/lm-w4.json --plot docs/images/lm_w4.png
    python bench/lm_baselines.py --smoke

``--grid``: AdamW at B ∈ {8, 16, 32, 64} × lr ∈ {0.5, 1, 2} × ``centre_lr(B)``. ``--report``: the
table of JSON files of runs (medians over seeds), with ``--out`` the summary and every run's
evaluations (a file a later ``--report`` reads as runs), and with ``--plot`` the validation loss
of each configuration against tokens and against training seconds (a line per seed).

Every run is a fresh ``--one JSON`` subprocess (``--jobs`` at a time, interleaved: every
configuration of a seed before the next seed); runs are appended to ``--out`` (default
``bench/runs/lm-<UTC time>.json``, not committed) as they finish.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import datetime as dt
import functools
import json
import math
import os
import statistics
import subprocess
import sys
import time

import torch

BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(BENCH))

import crossbow_graph as cg  # noqa: E402
from crossbow_graph.cli_lm import lr_factor  # noqa: E402
from crossbow_graph.engine.sync.diloco import DILOCO_OUTER  # noqa: E402
from crossbow_graph.engine.sync.sma import pull_bound  # noqa: E402

__all__ = ["SYSTEMS", "parse", "lr_factor", "centre_lr", "grid", "val_loss", "run_plain",
           "run_crossbow", "run", "reached", "speed", "summarise", "plot", "main"]

RUNS = os.path.join(BENCH, "runs")  # raw runs, not committed
_PER_SEED = ("seeds", "tokens", "seconds", "final", "tps")  # a summary row's lists, one per seed
SYSTEMS = ("adamw", "sgd", "sma-adamw", "sma-sgd", "diloco-adamw", "diloco-sgd", "localsgd-adamw",
           "localsgd-sgd")
KEYS = dict(k=int, b=int, lr=float, beta2=float, mom=float, wd=float, H=int, scale=int, fused=int,
            bound=float, default=int, olr=float, share=int)
SCHEDULE_TOKENS = 2**20
EVAL_EVERY_TOKENS = 2**15
VAL_WINDOWS = 128
GRID_BATCHES, LR_FACTORS = (8, 16, 32, 64), (0.5, 1.0, 2.0)
SMALL = dict(n_layer=1, n_head=2, n_embd=32)  # --smoke's model


def parse(text: str) -> dict:
    """``SYSTEM:key=value:...`` → the configuration with every key (defaults filled in);
    ValueError naming the format, the systems or the keys on a bad one."""
    system, *pairs = text.split(":")
    if system not in SYSTEMS:
        raise ValueError(f"{text!r}: SYSTEM is one of {', '.join(SYSTEMS)}")
    config = dict(system=system, k=1, b=4, lr=1e-3, beta2=0.99, mom=0.0,
                  wd=0.1 if system.endswith("adamw") else 0.0, H=8, scale=1, fused=0, bound=0.0,
                  default=0, olr=DILOCO_OUTER.keywords["lr"], share=0)
    for pair in pairs:
        key, _, value = pair.partition("=")
        if key not in KEYS or not value:
            raise ValueError(f"{text!r}: settings are key=value with key one of {', '.join(KEYS)}")
        config[key] = KEYS[key](value)
    if system in ("adamw", "sgd") and config["k"] != 1:
        raise ValueError(f"{text!r}: plain PyTorch trains one model (k=1)")
    if any(pair.startswith("olr=") for pair in pairs) and not system.startswith("diloco"):
        raise ValueError(f"{text!r}: olr is DiLoCo's outer lr (diloco-adamw, diloco-sgd)")
    if config["share"] and not (system == "sma-adamw" and config["k"] > 1):
        raise ValueError(f"{text!r}: share=1 is SMA's share_second_moment (sma-adamw, k > 1)")
    if not (math.isfinite(config["olr"]) and config["olr"] > 0):
        raise ValueError(f"{text!r}: olr must be a finite number > 0")
    return config


def centre_lr(batch: int) -> float:
    """AdamW's centre lr at B windows: 2e-3·√(B/16) (square root in B, as for Adam)."""
    return 2e-3 * math.sqrt(batch / 16)


def grid(batches=GRID_BATCHES, factors=LR_FACTORS) -> list[str]:
    """The AdamW sweep as configurations ``adamw:b=B:lr=LR``, LR rounded to 2 significant digits."""
    return [f"adamw:b={b}:lr={float(f'{centre_lr(b) * f:.2g}'):g}" for b in batches for f in factors]


def _optimizer(config: dict, model: torch.nn.Module) -> torch.optim.Optimizer:
    if config["system"].endswith("sgd"):
        return torch.optim.SGD(model.parameters(), lr=config["lr"], momentum=config["mom"],
                               weight_decay=config["wd"])
    return torch.optim.AdamW(model.parameters(), lr=config["lr"], betas=(0.9, config["beta2"]),
                             weight_decay=config["wd"])


def _data(block_size: int, val_windows: int):
    return (cg.datasets.fortunes("train", block_size=block_size),
            cg.datasets.fortunes("val", block_size=block_size).subset(val_windows))


@torch.no_grad()
def val_loss(model: torch.nn.Module, val) -> float:
    """Mean next-byte cross-entropy (nats per byte) of ``model`` over the windows of ``val``."""
    model.eval()
    x, y = val.tensors
    total = sum(float(cg.models.lm_loss(model(x[i:i + 64]), y[i:i + 64])) * len(x[i:i + 64])
                for i in range(0, len(x), 64))
    model.train()
    return total / len(x)


def run_plain(config: dict, seed: int, opts: dict) -> dict:
    """One plain-PyTorch run: ``evals`` of (tokens, train_seconds, val_loss) until the target or
    the cap."""
    torch.manual_seed(seed)
    model = cg.models.gpt(**opts.get("model_kw", {})).train()
    train, val = _data(model.block_size, opts["val_windows"])
    b = config["b"]
    per_step = b * model.block_size
    steps, schedule = opts["cap_tokens"] // per_step, opts["schedule_tokens"] // per_step
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(seed))
    opt = _optimizer(config, model)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, schedule))
    evals, seconds = [dict(tokens=0, train_seconds=0.0, val_loss=val_loss(model, val))], 0.0
    for step in range(steps):
        idx = order[step * b:(step + 1) * b]
        start = time.perf_counter()
        loss = cg.models.lm_loss(model(train.tensors[0][idx]), train.tensors[1][idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        seconds += time.perf_counter() - start
        tokens = (step + 1) * per_step
        if tokens % opts["eval_every"] < per_step or step == steps - 1:
            evals.append(dict(tokens=tokens, train_seconds=seconds, val_loss=val_loss(model, val)))
            if _done(evals[-1]["tokens"], evals[-1]["val_loss"], opts):
                break
    return dict(evals=evals, tokens=evals[-1]["tokens"], train_seconds=seconds)


def _behind(tokens: int, loss: float, opts: dict) -> bool:
    """Whether ``loss`` is above an abandon threshold ``[tokens, loss]`` of ``opts["abandon"]``
    that ``tokens`` has reached."""
    return any(tokens >= t and loss > limit for t, limit in opts.get("abandon", []))


def _done(tokens: int, loss: float, opts: dict) -> bool:
    """Whether a run stops after an evaluation: at the target, at a loss that is not finite, or
    behind (``_behind``)."""
    return loss <= opts["target"] or not math.isfinite(loss) or _behind(tokens, loss, opts)


class Abandon(cg.Hook):
    """Stops the fit after an evaluation of z whose loss is not finite or behind (``_behind``);
    the target itself stops it through ``fit(target_loss=)``."""

    mutates_replicas = False

    def __init__(self, opts: dict, per_round: int) -> None:
        self.opts, self.per_round = opts, per_round

    def after_eval(self, ctx: cg.FitContext, record) -> None:
        loss = record.test_loss
        if not math.isfinite(loss) or _behind(record.round * self.per_round, loss, self.opts):
            ctx.stop = True


def _alpha(config: dict) -> float | None:
    """SMA's α for ``config``: 1/k (``bound`` 0) or ``bound`` × the pull's stability bound at
    μ_z = 0.9, at most 1; None at k = 1 (unused) and with ``default`` (``SMA()``'s rule)."""
    k = config["k"]
    if k == 1 or config["default"]:
        return None
    mu_z = cg.SMA.central_momentum  # SMA's default μ_z
    return min(1.0, config["bound"] * pull_bound(k, mu_z)) if config["bound"] else 1.0 / k


def _compile(config: dict, model: torch.nn.Module, example: torch.Tensor, executor: str):
    k, system = config["k"], config["system"]
    devices = 2 if executor == "process" and system.startswith("sma") and k % 2 == 0 else 1
    outer = functools.partial(DILOCO_OUTER, lr=config["olr"])  # DiLoCo's, at its lr
    sync = (cg.DiLoCo(sync_every=config["H"], outer_optimizer=outer) if system.startswith("diloco")
            else cg.LocalSGD(sync_every=config["H"]) if system.startswith("localsgd")
            else cg.SMA(scale_lr=bool(config["scale"]), alpha=_alpha(config),
                        share_second_moment=bool(config["share"])))
    return cg.compile(model, (example,), cg.models.lm_loss, batch_size=config["b"],
                      replicas=k // devices, devices=devices,
                      executor="process" if devices == 2 else "inline",
                      learner_mode="fused" if config["fused"] else "per_replica",
                      optimizer=_optimizer(config, model), sync=sync)


def run_crossbow(config: dict, seed: int, opts: dict) -> dict:
    """One crossbow_graph run (SMA or DiLoCo): k learners of b windows, ``evals`` of z until the
    target or the cap (tokens of all learners)."""
    torch.manual_seed(seed)
    model = cg.models.gpt(**opts.get("model_kw", {})).train()
    train, val = _data(model.block_size, opts["val_windows"])
    per_round = config["k"] * config["b"] * model.block_size
    rounds, schedule = opts["cap_tokens"] // per_round, opts["schedule_tokens"] // per_round
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(seed))
    idx = order[:rounds * config["k"] * config["b"]]
    data = torch.utils.data.TensorDataset(train.tensors[0][idx], train.tensors[1][idx])
    plan = _compile(config, model, train.tensors[0][:2], opts["executor"])
    sched = torch.optim.lr_scheduler.LambdaLR(plan.optimizer, lambda s: lr_factor(s, schedule))
    start_loss = plan.evaluate(val, batch_size=64)[1]
    history = plan.fit(data, epochs=1, shuffle=False, seed=seed, eval_dataset=val,
                       evals_per_epoch=max(1, rounds * per_round // opts["eval_every"]),
                       eval_batch_size=64, lr_scheduler=sched, lr_scheduler_interval="round",
                       hooks=[Abandon(opts, per_round)], target_loss=opts["target"],
                       progress=False, metrics_every=None, cpu_threads=1)
    evals = [dict(tokens=0, train_seconds=0.0, val_loss=start_loss)] + [
        dict(tokens=e.round * per_round, train_seconds=e.train_seconds, val_loss=e.test_loss)
        for e in history.evals]
    return dict(evals=evals, tokens=evals[-1]["tokens"],
                train_seconds=history.epochs[-1].train_seconds,
                executor=plan.options.executor, devices=len(plan.options.devices)
                if isinstance(plan.options.devices, (list, tuple)) else plan.options.devices)


def run(text: str, seed: int, opts: dict) -> dict:
    """``text`` (a configuration) for one seed, in this process: the record of the run, with the
    load average before and after."""
    torch.set_num_threads(1)
    config = parse(text)
    load_before = os.getloadavg()
    runner = run_plain if config["system"] in ("adamw", "sgd") else run_crossbow
    out = runner(config, seed, opts)
    tok, sec = reached(out["evals"], opts["target"])
    last = out["evals"][-1]
    out.update(config=text, seed=seed, target=opts["target"], tokens_to_target=tok,
               abandoned=tok is None and _behind(last["tokens"], last["val_loss"], opts),
               seconds_to_target=sec, final_loss=out["evals"][-1]["val_loss"],
               tokens_per_s=out["tokens"] / max(out["train_seconds"], 1e-9),
               load_before=load_before, load_after=os.getloadavg(), nice=os.nice(0))
    return out


def reached(evals: list[dict], target: float) -> tuple[int | None, float | None]:
    """(tokens, training seconds) at the first evaluation at or below ``target``, or (None, None)."""
    hit = next((e for e in evals if e["val_loss"] <= target), None)
    return (hit["tokens"], hit["train_seconds"]) if hit else (None, None)


def speed(text: str, executor: str, tokens: int = 2**15) -> dict:
    """Training tokens/s of a configuration without evaluation: ``tokens`` tokens after a warm-up
    of a tenth of them, in this process (and its workers), with the load average."""
    opts = dict(cap_tokens=tokens, schedule_tokens=SCHEDULE_TOKENS, eval_every=10**12,
                val_windows=2, target=-1.0, executor=executor)
    torch.set_num_threads(1)
    config = parse(text)
    runner = run_plain if config["system"] in ("adamw", "sgd") else run_crossbow
    runner(config, 0, dict(opts, cap_tokens=tokens // 10))
    out = runner(config, 1, opts)
    return dict(config=text, executor=executor, tokens_per_s=out["tokens"] / out["train_seconds"],
                load_avg=os.getloadavg(), nice=os.nice(0))


def _subprocess(text: str, seed: int, opts: dict) -> dict:
    job = json.dumps(dict(config=text, seed=seed, opts=opts))
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, __file__, "--one", job], capture_output=True, text=True,
                          env=env)
    if proc.returncode:
        return dict(config=text, seed=seed, error=proc.stderr[-2000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def summarise(runs: list[dict], target: float, carried: dict | None = None) -> dict:
    """Per configuration, over its seeds: runs, seeds that reached ``target``, and the medians of
    tokens and seconds to it (a seed that missed it counts as +∞; None when the median is), of
    the final loss and of tokens/s, with each seed's values. ``carried``: rows of an earlier
    summary at the same target whose runs are not kept; their seeds that ``runs`` lacks count."""
    by_seed: dict[str, dict[int, tuple]] = {}  # config → seed → the _PER_SEED values but "seeds"
    for r in runs:
        if "error" not in r:
            tok, sec = reached(r["evals"], target)
            by_seed.setdefault(r["config"], {})[r["seed"]] = (
                tok, sec, r["evals"][-1]["val_loss"], r["tokens_per_s"])
    for config, old in (carried or {}).items():
        for i, seed in enumerate(old["seeds"]):
            by_seed.setdefault(config, {}).setdefault(
                seed, tuple(old[key][i] for key in _PER_SEED[1:]))
    out: dict[str, dict] = {}
    for config, seeds in by_seed.items():
        order = sorted(seeds)
        row = out[config] = dict(seeds=order, **{key: [seeds[s][i] for s in order]
                                                 for i, key in enumerate(_PER_SEED[1:])})
        hit = [t for t in row["tokens"] if t is not None]
        row["reached"] = len(hit)
        row["median_tokens"] = _median_missing_inf(row["tokens"])
        row["median_seconds"] = _median_missing_inf(row["seconds"])
        row["median_final"] = statistics.median(row["final"])
        row["median_tokens_per_s"] = statistics.median(row["tps"])
    return out


def _median_missing_inf(values: list) -> float | None:
    """The median of ``values`` with None as +∞ (docs/benchmarking.md, Protocol); None if +∞."""
    median = statistics.median([math.inf if v is None else v for v in values])
    return None if math.isinf(median) else median


def _table(summary: dict, target: float) -> str:
    rows = [f"{'config':<44}{'seeds':>6}{'hit':>4}{'tokens':>10}{'s':>7}{'final':>7}{'tok/s':>7}"
            f"   tokens to {target:g} per seed"]
    for name, r in summary.items():
        tok = f"{r['median_tokens']:.0f}" if r["median_tokens"] is not None else "-"
        sec = f"{r['median_seconds']:.0f}" if r["median_seconds"] is not None else "-"
        per_seed = ", ".join(str(t or "-") for t in r["tokens"])
        rows.append(f"{name:<44}{len(r['seeds']):>6}{r['reached']:>4}{tok:>10}{sec:>7}"
                    f"{r['median_final']:>7.3f}{r['median_tokens_per_s']:>7.0f}   {per_seed}")
    return "\n".join(rows)


def _write(path: str, opts: dict, runs: list[dict]) -> None:
    with open(path, "w") as f:
        json.dump(dict(opts=opts, runs=runs), f, indent=1)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", nargs="*", default=[], help="SYSTEM:key=value:..., e.g. adamw:b=4:lr=1e-3")
    p.add_argument("--grid", action="store_true", help="the AdamW sweep: B × 3 lrs around centre_lr(B)")
    p.add_argument("--plot", default=None, help="with --report: a PNG of loss against tokens and seconds")
    p.add_argument("--plot-configs", nargs="*", default=None, help="--plot draws these configurations only")
    p.add_argument("--seeds", nargs="*", type=int, default=[0])
    p.add_argument("--target", type=float, default=2.4, help="validation loss to stop at (nats per byte)")
    p.add_argument("--schedule-tokens", type=int, default=SCHEDULE_TOKENS, help="the cosine's length")
    p.add_argument("--cap-tokens", type=int, default=2 * SCHEDULE_TOKENS, help="tokens at most")
    p.add_argument("--eval-every", type=int, default=EVAL_EVERY_TOKENS, help="tokens between evaluations")
    p.add_argument("--val-windows", type=int, default=VAL_WINDOWS, help="validation windows evaluated")
    p.add_argument("--abandon", nargs="*", default=[], metavar="LOSS@TOKENS",
                   help="stop a run whose validation loss is above LOSS at or after TOKENS")
    p.add_argument("--executor", choices=("inline", "process"), default="inline",
                   help="crossbow_graph's SMA: one device inline, or 2 devices of processes")
    p.add_argument("--jobs", type=int, default=1, help="runs at a time")
    p.add_argument("--speed", nargs="*", default=[], help="tokens/s of these configurations, no evaluation")
    p.add_argument("--report", nargs="*", default=[], help="JSON files of earlier runs: their table (and --out)")
    p.add_argument("--smoke", action="store_true", help="a one-layer model, 4,096 tokens, four systems")
    p.add_argument("--out", default=None, help="JSON file (default bench/runs/lm-<time>.json)")
    p.add_argument("--one", help=argparse.SUPPRESS)
    return p


def plot(runs: list[dict], target: float, path: str, configs: list[str] | None = None) -> None:
    """Validation loss against training tokens and against training seconds, a line per run
    (one colour per configuration; only ``configs`` when given), the target dashed, as a PNG at
    ``path``."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("plots need matplotlib: pip install matplotlib") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4.6), sharey=True)
    colours: dict[str, str] = {}
    for r in (r for r in runs if "error" not in r and (not configs or r["config"] in configs)):
        colour = colours.setdefault(r["config"], f"C{len(colours) % 10}")
        for ax, key in zip(axes, ("tokens", "train_seconds")):
            ax.plot([e[key] for e in r["evals"]], [e["val_loss"] for e in r["evals"]], color=colour,
                    lw=1, alpha=0.8, label=r["config"] if key == "tokens" and r["seed"] == min(
                        x["seed"] for x in runs if x.get("config") == r["config"]) else None)
    for ax, label in zip(axes, ("training tokens", "training seconds (one thread, shared CPU)")):
        ax.axhline(target, color="k", ls="--", lw=0.8)
        ax.set_xlabel(label)
        ax.set_ylim(max(target - 0.4, 1.0), 3.6)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("validation loss (nats per byte)")
    fig.legend(loc="lower center", ncol=3, fontsize=7, frameon=False)
    fig.tight_layout(rect=(0, 0.04 + 0.035 * math.ceil(len(colours) / 3), 1, 1))
    fig.savefig(path, dpi=80)


def _report(args: argparse.Namespace) -> int:
    """The runs of ``args.report``'s files summarised (one per configuration and seed, the last
    file's); a configuration that only a file's summary holds (its runs not kept) is carried over
    as that summary has it."""
    files = [json.load(open(path)) for path in args.report]
    # one run per (configuration, seed): a later file's replaces an earlier one's
    runs = list({(r["config"], r["seed"]): r for data in files for r in data.get("runs", [])}.values())
    carried = {config: row for data in files if data.get("target") == args.target
               for config, row in data.get("summary", {}).items()}
    summary = summarise(runs, args.target, carried)
    print(_table(summary, args.target))
    if args.out:  # the summary and every run's curve: a later --report reads it back as runs
        kept = [dict(config=r["config"], seed=r["seed"], tokens_per_s=r["tokens_per_s"],
                     load_after=r.get("load_after"),
                     evals=[dict(tokens=e["tokens"], train_seconds=e["train_seconds"],
                                 val_loss=e["val_loss"]) for e in r["evals"]])
                for r in runs if "error" not in r]
        with open(args.out, "w") as f:
            json.dump(dict(sources=[os.path.basename(x) for x in args.report], target=args.target,
                           summary=summary, runs=kept), f, separators=(",", ":"))
    if args.plot:
        plot(runs, args.target, args.plot, args.plot_configs)
    return 0


def _line(result: dict) -> str:
    if "error" in result:
        return f"{result['config']} seed {result['seed']}: error {result['error'].splitlines()[-1][:200]}"
    return (f"{result['config']} seed {result['seed']}: tokens {result['tokens_to_target']} "
            f"s {result['seconds_to_target']} final {result['final_loss']:.3f} "
            f"tok/s {result['tokens_per_s']:.0f} load {result['load_after'][0]:.1f}")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.one:
        job = json.loads(args.one)
        print(json.dumps(run(job["config"], job["seed"], job["opts"])))
        return 0
    if args.speed:
        for text in args.speed:
            print(json.dumps(speed(text, args.executor)), flush=True)
        return 0
    if args.report:
        return _report(args)
    opts = dict(target=args.target, schedule_tokens=args.schedule_tokens, cap_tokens=args.cap_tokens,
                eval_every=args.eval_every, val_windows=args.val_windows, executor=args.executor,
                abandon=[[int(t), float(x)] for x, t in (a.split("@") for a in args.abandon)])
    configs = (grid() if args.grid else []) + args.configs
    if args.smoke:
        configs = ["adamw:b=8:lr=3e-3", "sgd:b=2:lr=0.3", "sma-adamw:k=2:b=2:lr=3e-3",
                   "diloco-adamw:k=2:b=2:lr=3e-3:H=2", "localsgd-adamw:k=2:b=2:lr=3e-3:H=2"]
        opts.update(schedule_tokens=4096, cap_tokens=4096, eval_every=2048, val_windows=8,
                    model_kw=SMALL)
    if not configs:
        _parser().error("nothing to run: give --configs, --grid, --speed, --report or --smoke")
    for text in configs:
        parse(text)
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    out = args.out or os.path.join(RUNS, f"lm-{stamp}.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    jobs = [(c, s) for s in args.seeds for c in configs]  # interleaved: every config per seed
    runs: list[dict] = []
    with cf.ThreadPoolExecutor(max_workers=args.jobs) as pool:
        for result in pool.map(lambda job: _subprocess(*job, opts), jobs):
            runs.append(result)
            _write(out, opts, runs)
            print(_line(result), flush=True)
    print(_table(summarise(runs, args.target), args.target))
    print(f"wrote {out}")
    return 0 if all("error" not in r for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
