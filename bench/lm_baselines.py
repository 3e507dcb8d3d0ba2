"""W4 groundwork: validation loss against tokens and seconds of ``models.gpt()`` on the fortunes
bytes (docs/benchmarking.md, W4), for plain PyTorch and for crossbow_graph's SMA.

Systems, each run for a fixed budget of training tokens (the schedule's length), one intra-op
thread per process (``OMP_NUM_THREADS=1``, ``torch.set_num_threads(1)``):

* ``adamw:B:LR`` / ``sgd:B:LR``: plain PyTorch, one model, ``torch.optim.AdamW`` (betas (0.9,
  0.99), weight decay 0.1) or ``torch.optim.SGD`` (momentum 0.9), batches of B windows of 128
  bytes drawn without replacement from a seeded permutation of the training windows;
* ``sma-adamw:b:LR`` / ``sma-sgd:b:LR``: ``crossbow_graph.compile(models.gpt(), replicas=4)``
  (one CPU device, inline executor, per-replica learners, SMA's defaults α = 1/k, μ_z = 0.9), b
  windows per learner, the same optimizer per replica, trained on the same permutation's first
  windows for one pass; its tokens count all k learners' (k·b·128 per round).

Every run: linear warm-up over the first 5 % of its steps to LR, then a cosine to LR/10 at the
end of the budget (``LambdaLR``, per step or round); the validation loss of the model (z for
SMA) on a fixed subset of the validation split (``TextDataset.subset``, 128 windows = 16,384
tokens, evenly spread) at the start and every ``--eval-every`` training tokens (default 32,768:
70 evaluations per epoch of 2.3 M tokens). Seconds are training wall seconds, evaluation
excluded; under a shared CPU they are only indicative: ``--speed`` measures one recipe's
single-thread tokens/s alone (run it at ``nice -n 0`` at a quiet moment; it records the load).

    nice -n 19 python bench/lm_baselines.py --grid                    # AdamW, B ∈ {8,16,32,64} × 3 lrs
    nice -n 19 python bench/lm_baselines.py --configs adamw:16:0.002 sma-sgd:8:0.1 --seeds 0 1 2
    python bench/lm_baselines.py --speed adamw:16:0.002               # tokens/s, one thread
    python bench/lm_baselines.py --report bench/runs/lm-*.json --targets 2.6 2.65 2.7 \
        --out bench/results/lm-baselines-w4.json                       # the runs of several files
    python bench/lm_baselines.py --smoke                              # seconds (tests)

Every run is a fresh ``--one JSON`` subprocess (``--jobs`` at a time); the runs are appended to
``bench/runs/lm-baselines-<UTC time>.json`` (not committed) as they finish; the table gives, per
run, the final and best validation loss and the tokens and seconds to each of ``--targets``.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import datetime as dt
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

__all__ = ["GRID_BATCHES", "centre_lr", "grid", "parse_config", "lr_factor", "run_plain", "run_sma",
           "run", "tokens_to", "main"]

RESULTS = os.path.join(BENCH, "runs")  # raw runs, not committed
GRID_BATCHES = (8, 16, 32, 64)
LR_FACTORS = (0.5, 1.0, 2.0)
BUDGET_TOKENS = 2**19  # 524,288: 0.23 epochs, a few minutes on one thread
EVAL_EVERY_TOKENS = 2**15
VAL_WINDOWS = 128
WARMUP_SHARE, FINAL_SHARE = 0.05, 0.1
TARGETS = (2.2, 2.0, 1.9, 1.8, 1.7, 1.6)
SMALL = dict(n_layer=1, n_head=2, n_embd=32)  # --smoke's model


def centre_lr(batch: int) -> float:
    """AdamW's centre lr at B windows: 2e-3·√(B/16) (square root in B, as for Adam)."""
    return 2e-3 * math.sqrt(batch / 16)


def grid(batches=GRID_BATCHES, factors=LR_FACTORS) -> list[str]:
    """The AdamW sweep as configuration names ``adamw:B:LR``, LR rounded to 2 significant digits."""
    return [f"adamw:{b}:{float(f'{centre_lr(b) * f:.2g}'):g}" for b in batches for f in factors]


def parse_config(text: str) -> dict:
    """``SYSTEM:B:LR`` → ``dict(system, batch, lr)``; ValueError naming the format on a bad one."""
    try:
        system, batch, lr = text.split(":")
        config = dict(system=system, batch=int(batch), lr=float(lr))
    except ValueError:
        raise ValueError(f"{text!r}: use SYSTEM:B:LR, e.g. adamw:16:0.002") from None
    if system not in ("adamw", "sgd", "sma-adamw", "sma-sgd"):
        raise ValueError(f"{text!r}: SYSTEM is one of adamw, sgd, sma-adamw, sma-sgd")
    return config


def lr_factor(step: int, steps: int) -> float:
    """The share of the peak lr at ``step`` of ``steps``: linear warm-up over the first
    ``WARMUP_SHARE`` of the steps, then a cosine from 1 to ``FINAL_SHARE`` at the last step."""
    warmup = max(1, round(WARMUP_SHARE * steps))
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - 1 - warmup)
    return FINAL_SHARE + (1 - FINAL_SHARE) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


def _optimizer(kind: str, model: torch.nn.Module, lr: float) -> torch.optim.Optimizer:
    if kind.endswith("sgd"):
        return torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    return torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.99), weight_decay=0.1)


def _data(block_size: int, val_windows: int):
    return (cg.datasets.fortunes("train", block_size=block_size),
            cg.datasets.fortunes("val", block_size=block_size).subset(val_windows))


@torch.no_grad()
def _val_loss(model: torch.nn.Module, val) -> float:
    model.eval()
    x, y = val.tensors
    total = sum(float(cg.models.lm_loss(model(x[i:i + 64]), y[i:i + 64])) * len(x[i:i + 64])
                for i in range(0, len(x), 64))
    model.train()
    return total / len(x)


def run_plain(system: str, batch: int, lr: float, seed: int, *, budget: int = BUDGET_TOKENS,
              eval_every: int = EVAL_EVERY_TOKENS, val_windows: int = VAL_WINDOWS,
              model_kw: dict | None = None) -> dict:
    """One plain-PyTorch run (``adamw`` or ``sgd``): ``evals`` of (tokens, train_seconds,
    val_loss), from the start to ``budget`` training tokens."""
    torch.set_num_threads(1)
    torch.manual_seed(seed)
    model = cg.models.gpt(**(model_kw or {})).train()
    train, val = _data(model.block_size, val_windows)
    per_step = batch * model.block_size
    steps = budget // per_step
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(seed))
    opt = _optimizer(system, model, lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, steps))
    evals, seconds = [dict(tokens=0, train_seconds=0.0, val_loss=_val_loss(model, val))], 0.0
    for step in range(steps):
        idx = order[step * batch:(step + 1) * batch]
        start = time.perf_counter()
        loss = cg.models.lm_loss(model(train.tensors[0][idx]), train.tensors[1][idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        seconds += time.perf_counter() - start
        tokens = (step + 1) * per_step
        if tokens // eval_every > (tokens - per_step) // eval_every or step == steps - 1:
            evals.append(dict(tokens=tokens, train_seconds=seconds, val_loss=_val_loss(model, val)))
    return dict(evals=evals, steps=steps, tokens=steps * per_step, train_seconds=seconds)


def run_sma(system: str, batch: int, lr: float, seed: int, *, replicas: int = 4,
            budget: int = BUDGET_TOKENS, eval_every: int = EVAL_EVERY_TOKENS,
            val_windows: int = VAL_WINDOWS, model_kw: dict | None = None) -> dict:
    """One crossbow_graph run (``sma-adamw`` or ``sma-sgd``): k = ``replicas`` learners of b =
    ``batch`` windows on one CPU device, for ``budget`` tokens of all learners together."""
    torch.set_num_threads(1)
    torch.manual_seed(seed)
    model = cg.models.gpt(**(model_kw or {})).train()
    train, val = _data(model.block_size, val_windows)
    per_round = replicas * batch * model.block_size
    rounds = budget // per_round
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(seed))
    idx = order[:rounds * replicas * batch]
    data = torch.utils.data.TensorDataset(train.tensors[0][idx], train.tensors[1][idx])
    plan = cg.compile(model, (train.tensors[0][:2],), cg.models.lm_loss, batch_size=batch,
                      replicas=replicas, devices=1, executor="inline", learner_mode="per_replica",
                      optimizer=_optimizer(system, model, lr))
    sched = torch.optim.lr_scheduler.LambdaLR(plan.optimizer, lambda s: lr_factor(s, rounds))
    start_loss = plan.evaluate(val, batch_size=64)[1]
    history = plan.fit(data, epochs=1, shuffle=False, seed=seed, eval_dataset=val,
                       evals_per_epoch=max(1, rounds * per_round // eval_every), eval_batch_size=64,
                       lr_scheduler=sched, lr_scheduler_interval="round", progress=False,
                       metrics_every=None)
    evals = [dict(tokens=0, train_seconds=0.0, val_loss=start_loss)] + [
        dict(tokens=e.round * per_round, train_seconds=e.train_seconds, val_loss=e.test_loss)
        for e in history.evals]
    return dict(evals=evals, steps=rounds, tokens=rounds * per_round,
                train_seconds=history.epochs[-1].train_seconds, replicas=replicas)


def run(config: str, seed: int, **kw) -> dict:
    """``config`` (``SYSTEM:B:LR``) for one seed, in this process: the record of the run."""
    c = parse_config(config)
    runner = run_sma if c["system"].startswith("sma-") else run_plain
    out = runner(c["system"], c["batch"], c["lr"], seed, **kw)
    out.update(config=config, seed=seed, load_avg=os.getloadavg(), nice=os.nice(0),
               tokens_per_s=out["tokens"] / out["train_seconds"])
    return out


def tokens_to(evals: list[dict], target: float) -> tuple[int | None, float | None]:
    """(tokens, training seconds) at the first evaluation at or below ``target``, or (None, None)."""
    hit = next((e for e in evals if e["val_loss"] <= target), None)
    return (hit["tokens"], hit["train_seconds"]) if hit else (None, None)


def speed(config: str, *, steps: int = 8, repeats: int = 5) -> dict:
    """Single-thread training tokens/s of a plain configuration (no evaluation): the median of
    ``repeats`` timings of ``steps`` steps after 3 warm-up steps, with the load average."""
    c = parse_config(config)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = cg.models.gpt().train()
    opt = _optimizer(c["system"], model, c["lr"])
    x = torch.randint(0, 256, (c["batch"], model.block_size))

    def step():
        opt.zero_grad(set_to_none=True)
        cg.models.lm_loss(model(x), x).backward()
        opt.step()

    for _ in range(3):
        step()
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(steps):
            step()
        rates.append(steps * x.numel() / (time.perf_counter() - start))
    return dict(config=config, tokens_per_s=statistics.median(rates), all=rates,
                load_avg=os.getloadavg(), nice=os.nice(0))


def _subprocess(config: str, seed: int, extra: dict) -> dict:
    job = json.dumps(dict(config=config, seed=seed, **extra))
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, __file__, "--one", job], capture_output=True, text=True,
                          env=env)
    if proc.returncode:
        return dict(config=config, seed=seed, error=proc.stderr[-2000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _table(runs: list[dict], targets) -> str:
    head = f"{'config':<22}{'seed':>5}{'final':>8}{'best':>8}{'tok/s':>8}" + "".join(
        f"{'tok@' + format(t, 'g'):>10}{'s':>6}" for t in targets)
    rows = [head]
    for r in runs:
        if "error" in r:
            rows.append(f"{r['config']:<22}{r['seed']:>5}  error: {r['error'].splitlines()[-1][:80]}")
            continue
        losses = [e["val_loss"] for e in r["evals"]]
        cells = ""
        for t in targets:
            tok, sec = tokens_to(r["evals"], t)
            cells += f"{tok or '-':>10}{format(sec, '.0f') if sec else '-':>6}"
        rows.append(f"{r['config']:<22}{r['seed']:>5}{losses[-1]:>8.3f}{min(losses):>8.3f}"
                    f"{r['tokens_per_s']:>8.0f}{cells}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--grid", action="store_true", help="the AdamW sweep: B × 3 lrs around centre_lr(B)")
    p.add_argument("--configs", nargs="*", default=[], help="SYSTEM:B:LR, e.g. adamw:16:0.002 sma-sgd:8:0.1")
    p.add_argument("--seeds", nargs="*", type=int, default=[0])
    p.add_argument("--budget", type=int, default=BUDGET_TOKENS, help="training tokens per run")
    p.add_argument("--eval-every", type=int, default=EVAL_EVERY_TOKENS, help="tokens between evaluations")
    p.add_argument("--jobs", type=int, default=1, help="runs at a time, each one process of one thread")
    p.add_argument("--targets", nargs="*", type=float, default=list(TARGETS))
    p.add_argument("--speed", nargs="*", default=[], help="single-thread tokens/s of these configs")
    p.add_argument("--smoke", action="store_true", help="a one-layer model for 4,096 tokens: adamw and sma-sgd")
    p.add_argument("--report", nargs="*", default=[], help="JSON files of earlier runs: their table (and --out, merged)")
    p.add_argument("--out", default=None, help="JSON file (default bench/runs/lm-baselines-<time>.json)")
    p.add_argument("--one", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one:
        job = json.loads(args.one)
        print(json.dumps(run(job.pop("config"), job.pop("seed"), **job)))
        return 0
    if args.speed:
        for config in args.speed:
            print(json.dumps(speed(config)))
        return 0
    if args.report:
        runs = [r for path in args.report for r in json.load(open(path))["runs"]]
        print(_table(runs, args.targets))
        if args.out:
            with open(args.out, "w") as f:
                json.dump(dict(sources=[os.path.basename(x) for x in args.report], runs=runs), f, indent=1)
        return 0
    configs = (grid() if args.grid else []) + args.configs
    extra = dict(budget=args.budget, eval_every=args.eval_every)
    if args.smoke:
        configs, extra = ["adamw:8:0.003", "sma-sgd:2:0.1"], dict(budget=4096, eval_every=2048,
                                                                  val_windows=8, model_kw=SMALL)
    if not configs:
        p.error("nothing to run: give --grid, --configs, --speed or --smoke")
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    out = args.out or os.path.join(RESULTS, f"lm-baselines-{stamp}.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    jobs = [(c, s) for s in args.seeds for c in configs]  # interleaved: every config per seed
    runs: list[dict] = []
    with cf.ThreadPoolExecutor(max_workers=args.jobs) as pool:
        for result in pool.map(lambda job: _subprocess(*job, extra), jobs):
            runs.append(result)
            with open(out, "w") as f:
                json.dump(dict(when=stamp, budget=extra["budget"], runs=runs), f, indent=1)
            print(_table([result], args.targets).splitlines()[-1], flush=True)
    print(_table(runs, args.targets))
    print(f"wrote {out}")
    return 0 if all("error" not in r for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
