"""How SMA's α, μ_z and the per-learner η should follow the number of learners k
(docs/design-overview.md §2; the findings: docs/benchmarking.md, "How SMA's α, μ_z and η follow k").

One run = one (workload, system, k, rule, seed) in this process, single-threaded
(``torch.set_num_threads(1)``): the epochs (and samples) until z's test accuracy first reaches each
of ``--targets``, evaluated ``--evals-per-epoch`` times per epoch, capped at ``--max-epochs``
("not reached" is ``null``).

Systems:

* ``sma``: crossbow_graph through its public API, one device × k fused replicas on the inline
  executor, b per learner, the user's ``torch.optim.SGD(lr=η₁, momentum=0.9)``;
  ``SMA(alpha=α(k), central_momentum=μ_z(k))``; η(t) = η₁·g(t) by a per-round LambdaLR over
  ``plan.optimizer`` (the rule's scale s(k), reached by a linear warm-up from the scale in force
  before, over ``--warmup-epochs`` epochs of samples, at the start and after every change of k).
* ``allreduce``, ``easgd``, ``localsgd``, ``diloco``: the same plan with ``SSGD()`` (S-SGD as
  data-parallel training runs it on k devices: the k learners' gradients of b samples each
  all-reduced every round, BatchNorm statistics per learner), ``EASGD(alpha=α(k),
  centre_rate=--centre-rate, sync_every=--sync-every)`` (a replica pull α decoupled from z's
  rate β), ``LocalSGD(sync_every=H)`` or ``DiLoCo(sync_every=H)`` (its Nesterov outer SGD, lr 0.7
  or ``--outer-lr``, momentum 0.9) in place of SMA, η(t) by the same LambdaLR (``--scale engine``: the engine's
  rule, SMA's and ``SSGD(scale_lr=True)``'s only).
* ``ssgd``: plain PyTorch S-SGD, one model at batch k·b, ``torch.optim.SGD(momentum=0.9)`` at
  η₁·``--lr-mult`` reached by Goyal et al.'s (2017) gradual warm-up from η₁ over
  ``--warmup-epochs`` epochs (the re-tuned baseline: a grid of ``--lr-mult``).

The rule (sma):

* ``--alpha``: ``default`` (``SMA()``'s rule: α = 0.8 of the pull's stability bound, at least
  0.5, and z's rate β = k·α, at most 0.8 of its bound; design §2), ``inv`` (1/k; EASGD: its own
  β/k), ``inv:c`` (c/k), a number, ``sqrt:c`` (c/√k), or ``bound:f`` (f × the pull's stability
  bound 2(1 + μ_z)/(1 + k + μ_z)); at most 1; each but ``default`` with β = k·α (CROSSBOW's
  update) unless ``--beta`` sets it;
* ``--mu-z``: a number, or ``k:c`` (μ_z = 1 − c/k, at least 0.9);
* ``--scale`` s(k): ``engine`` (the engine's default rule, ``SMA(scale_lr=True)``:
  √min(k, 16) ramped over 0.25 epoch, docs/design-overview.md §2; no LambdaLR), ``1``, ``sqrt``
  (√k), ``pow:p`` (k^p), ``linear`` (k), a number, or ``adascale`` (AdaScale's gain
  r = (1 + B_noise/b)/(1 + B_noise/(k·b)) from the engine's measured gradient noise scale,
  docs/policies.md; 1 until the first estimate; within [1, k]); every scale but ``engine``
  runs with ``SMA(scale_lr=False)`` and the LambdaLR below;
* ``--k-schedule 4@0,16@1.5``: k changes in mid-fit (k = 4 from the start, 16 from epoch 1.5),
  through ``Plan.adjust(Adjustment(replicas_per_device=..., alpha=...))``.

Workloads: ``w1`` LeNet-5 on MNIST (the full 10,000-image test set); ``fm`` ResNet-20 (He et al.
2016 §4.2, n = 3) narrowed to widths 8/16/32 with a 1-channel stem, on Fashion-MNIST at its
native 28×28; ``--train-samples`` / ``--test-samples`` take the first N samples.

    python bench/sma_rules.py run --k 16 --lr 0.01 --scale sqrt --seed 0
    python bench/sma_rules.py run --system ssgd --k 16 --lr 0.01 --lr-mult 8 --warmup-epochs 0.5
    python bench/sma_rules.py run --system easgd --k 16 --alpha 0.5 --centre-rate 0.9 --scale sqrt
    python bench/sma_rules.py queue jobs.txt --jobs 2       # one `run` argument line per job
    python bench/sma_rules.py summary                       # the table of every run so far

Writes ``bench/runs/sma_rules/<run name>.json`` (not committed: every evaluation, η and k over
time, B_noise) and ``summary`` writes ``bench/runs/sma_rules/summary.json``.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import shlex
import subprocess
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import crossbow_graph as cg  # noqa: E402
from crossbow_graph.training.hooks import Hook  # noqa: E402
from crossbow_graph.engine.sync.diloco import DILOCO_OUTER  # noqa: E402
from crossbow_graph.engine.sync.sma import pull_bound  # noqa: E402

__all__ = ["Rule", "SYSTEMS", "run_sma", "run_ssgd", "recorded_runs", "summarise", "main"]

TARGETS = {"w1": (0.985, 0.99), "fm": (0.85, 0.87)}  # the summary's targets per workload
RUNS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "runs", "sma_rules")


# -- workloads ---------------------------------------------------------------------------------

def load(workload: str, train_samples: int | None, test_samples: int | None):
    """(train, test) ImageDatasets; the first N samples of each when asked."""
    if workload == "w1":
        train, test = cg.datasets.mnist(True), cg.datasets.mnist(False)
    else:
        train, test = cg.datasets.fashion_mnist(True), cg.datasets.fashion_mnist(False)

    def first(ds, n):
        return ds if n is None else cg.datasets.ImageDataset(ds.images[:n], ds.labels[:n], ds.name)

    return first(train, train_samples), first(test, test_samples)


class _Block(nn.Module):
    """ResNet basic block: two 3×3 conv + BN, identity or option-A (subsample, zero-pad) shortcut."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.b1 = nn.BatchNorm2d(cout)
        self.c2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.b2 = nn.BatchNorm2d(cout)
        self.stride, self.pad = stride, cout - cin

    def forward(self, x):
        out = self.b2(self.c2(F.relu(self.b1(self.c1(x)))))
        short = x[:, :, ::self.stride, ::self.stride] if self.stride > 1 else x
        if self.pad:
            short = F.pad(short, (0, 0, 0, 0, 0, self.pad))
        return F.relu(out + short)


class ResNet20(nn.Module):
    """ResNet-20 (He et al. 2016 §4.2, n = 3) with widths w/2w/4w (16 in the paper) and a
    1-channel stem: ``[N, 1, 28, 28]`` → ``[N, 10]``."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width),
                                  nn.ReLU())
        blocks, cin = [], width
        for cout, stride in ((width, 1), (2 * width, 2), (4 * width, 2)):
            for i in range(3):
                blocks.append(_Block(cin, cout, stride if i == 0 else 1))
                cin = cout
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(cin, 10)

    def forward(self, x):
        return self.fc(self.blocks(self.stem(x)).mean((2, 3)))  # global average pooling


def build_model(workload: str) -> nn.Module:
    """LeNet-5 (w1) or a ResNet-20 of base width 8 for 28×28 Fashion-MNIST (fm)."""
    return cg.models.lenet5() if workload == "w1" else ResNet20(width=8)


# -- the rule ----------------------------------------------------------------------------------

class Rule:
    """α(k), μ_z(k) and the η scale s(k) of one run, parsed from the CLI's strings."""

    def __init__(self, alpha: str, mu_z: str, scale: str, batch: int) -> None:
        self.alpha_s, self.mu_s, self.scale_s, self.batch = alpha, mu_z, scale, batch

    def alpha(self, k: int) -> float | None:
        """α for k learners, set explicitly (None at k = 1, where it is unused, and for
        ``default``: ``SMA()``'s rule, α and β)."""
        if k == 1 or self.alpha_s == "default":
            return None
        if self.alpha_s == "inv":
            return 1.0 / k
        if self.alpha_s.startswith("inv:"):
            return min(1.0, float(self.alpha_s[4:]) / k)
        if self.alpha_s.startswith("sqrt:"):
            return min(1.0, float(self.alpha_s[5:]) / math.sqrt(k))
        if self.alpha_s.startswith("bound:"):  # a share of the pull's stability bound (§2)
            return min(1.0, float(self.alpha_s[6:]) * pull_bound(k, self.mu_z(k)))
        return float(self.alpha_s)

    def mu_z(self, k: int) -> float:
        if self.mu_s.startswith("k:"):
            return max(0.9, 1 - float(self.mu_s[2:]) / k)
        return float(self.mu_s)

    def scale(self, k: int, noise_scale: float | None) -> float:
        """s(k): the factor on the user's η₁ at k learners (1 at k = 1)."""
        s = self.scale_s
        if k == 1 or s in ("1", "engine"):
            return 1.0
        if s == "sqrt":
            return math.sqrt(k)
        if s == "linear":
            return float(k)
        if s.startswith("pow:"):
            return k ** float(s[4:])
        if s == "adascale":
            if noise_scale is None or not math.isfinite(noise_scale) or noise_scale <= 0:
                return None  # keep the scale in force
            b = self.batch
            return min(float(k), max(1.0, (1 + noise_scale / b) / (1 + noise_scale / (k * b))))
        return float(s)


class LRRule:
    """The per-round LambdaLR factor g(t) = the rule's scale, ramped linearly over
    ``warmup_samples`` from the scale in force when k last changed (1 at the start)."""

    def __init__(self, plan, rule: Rule, monitor, n_train: int, warmup_samples: float) -> None:
        self.plan, self.rule, self.monitor, self.n = plan, rule, monitor, n_train
        self.warmup = warmup_samples
        self.k, self.start, self.ramp_from, self.current, self.target = None, 0, 1.0, 1.0, 1.0
        self.trace: list[tuple[float, int, float, float | None]] = []  # (epoch, k, factor, B_noise)

    def samples(self) -> int:
        return self.plan.epochs_done * self.n + self.plan.position_in_epoch

    def __call__(self, _step: int) -> float:
        k, t = self.plan.num_learners, self.samples()
        ns = self.monitor.noise_scale if self.monitor is not None else None
        if k != self.k:  # a change of k: ramp from what is in force now
            self.k, self.start, self.ramp_from = k, t, self.current
        target = self.rule.scale(k, ns)
        self.target = self.target if target is None else target
        frac = 1.0 if self.warmup <= 0 else min(1.0, (t - self.start) / self.warmup)
        self.current = self.ramp_from + (self.target - self.ramp_from) * frac
        if not self.trace or self.trace[-1][1] != k or abs(self.trace[-1][2] - self.current) > 0.02 * self.current:
            self.trace.append((t / self.n, k, self.current, ns))
        return self.current


class KSchedule(Hook):
    """Changes k (one device × m replicas) at the given epochs, with the rule's α for the new k."""

    def __init__(self, schedule: list[tuple[int, float]], rule: Rule, n_train: int) -> None:
        self.todo, self.rule, self.n = sorted(schedule[1:], key=lambda p: p[1]), rule, n_train

    def after_round(self, ctx) -> None:
        plan = ctx.plan
        epoch = plan.epochs_done + plan.position_in_epoch / self.n
        while self.todo and epoch >= self.todo[0][1]:
            k, _ = self.todo.pop(0)
            alpha = self.rule.alpha(k)
            plan.adjust(cg.Adjustment(replicas_per_device=k,
                                      alpha="auto" if alpha is None else alpha))


# -- the runs ----------------------------------------------------------------------------------

def _firsts(evals: list[dict], targets: list[float], n_train: int) -> dict:
    out = {}
    for tgt in targets:
        hit = next((e for e in evals if e["test_accuracy"] >= tgt), None)
        out[f"{tgt}"] = None if hit is None else dict(epochs=hit["epoch"], samples=hit["samples"])
    return out


SYSTEMS = ("sma", "ssgd", "allreduce", "easgd", "localsgd", "diloco")


def engine_sync(args, rule: Rule, k: int):
    """The plan's sync algorithm for ``args.system`` at k learners (the module docstring)."""
    if args.system == "sma":
        return cg.SMA(alpha=rule.alpha(k), central_momentum=rule.mu_z(k),
                      scale_lr=args.scale == "engine", centre_rate=args.beta)
    if args.system == "allreduce":
        return cg.SSGD(scale_lr=args.scale == "engine")
    if args.scale == "engine":
        raise SystemExit(f"--system {args.system} --scale engine: the engine's η rule is SMA's "
                         "and SSGD's; name the scale, e.g. --scale sqrt")
    if args.system == "easgd":
        return cg.EASGD(alpha=None if rule.alpha_s == "inv" else rule.alpha(k),  # inv: β/k
                        centre_rate=args.centre_rate,
                        sync_every=args.sync_every)
    if args.system == "localsgd":
        return cg.LocalSGD(sync_every=args.sync_every)
    outer = (DILOCO_OUTER if args.outer_lr is None
             else functools.partial(DILOCO_OUTER, lr=args.outer_lr))
    return cg.DiLoCo(sync_every=args.sync_every, outer_optimizer=outer)


def run_sma(args, train, test) -> dict:
    """One run of the engine (SMA, EASGD, LocalSGD or DiLoCo) through the public API (see the
    module docstring)."""
    torch.manual_seed(args.seed)
    sched = parse_k_schedule(args.k_schedule) or [(args.k, 0.0)]
    k0 = sched[0][0]
    rule = Rule(args.alpha, args.mu_z, args.scale, args.batch)
    model = build_model(args.workload)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9,
                          weight_decay=args.weight_decay)
    plan = cg.compile(model, (train.images[:args.batch],), F.cross_entropy, batch_size=args.batch,
                      devices=1, replicas=k0, learner_mode="fused", executor="inline",
                      optimizer=opt, sync=engine_sync(args, rule, k0))
    adascale = args.scale == "adascale" or args.metrics
    monitor = cg.MetricsMonitor(50, window_samples=12_800) if adascale else None
    n = len(train)
    lr_rule = LRRule(plan, rule, monitor, len(train), args.warmup_epochs * len(train))
    scheduler = None if args.scale == "engine" else \
        torch.optim.lr_scheduler.LambdaLR(plan.optimizer, lr_rule)
    hooks = [KSchedule(sched, rule, len(train))] if len(sched) > 1 else []
    h = plan.fit(train, args.max_epochs, eval_dataset=test, seed=args.seed,
                 target_accuracy=max(args.targets), evals_per_epoch=args.evals_per_epoch,
                 progress=False, metrics_every=monitor, lr_scheduler=scheduler,
                 lr_scheduler_interval="round", hooks=hooks)
    if args.scale == "engine":  # the engine's η rule as History recorded it
        lr_rule.trace = [(r.epoch, r.num_learners, r.factor_to, r.ramp_samples / n)
                         for r in h.lr_rule]
    evals = [dict(epoch=e.epoch, samples=round(e.epoch * n), round=e.round,
                  train_seconds=e.train_seconds, test_accuracy=e.test_accuracy,
                  test_loss=e.test_loss) for e in h.evals]
    metrics = [dict(epoch=m.epoch, k=m.num_learners, lr=m.lr, alpha=m.alpha,
                    noise_scale=m.noise_scale, divergence=m.divergence_mean, loss=m.train_loss)
               for m in h.metrics] if monitor is not None else []
    return dict(evals=evals, lr_trace=lr_rule.trace, metrics=metrics,
                train_seconds=plan.train_seconds)


def run_ssgd(args, train, test) -> dict:
    """Plain PyTorch S-SGD at batch k·b with Goyal et al.'s warm-up from η₁ to η₁·lr_mult."""
    torch.manual_seed(args.seed)
    model = build_model(args.workload).train()
    big = args.k * args.batch
    peak = args.lr * args.lr_mult
    opt = torch.optim.SGD(model.parameters(), lr=peak, momentum=0.9, weight_decay=args.weight_decay)
    n = len(train)
    steps = n // big
    warm = args.warmup_epochs * n
    points = {max(1, steps * i // args.evals_per_epoch) for i in range(1, args.evals_per_epoch + 1)}
    gen = torch.Generator().manual_seed(args.seed)
    evals, samples, trained = [], 0, 0.0
    for epoch in range(args.max_epochs):
        order = torch.randperm(n, generator=gen)
        for i in range(steps):
            t0 = time.perf_counter()
            frac = 1.0 if warm <= 0 else min(1.0, samples / warm)
            for g in opt.param_groups:
                g["lr"] = args.lr + (peak - args.lr) * frac
            idx = order[i * big:(i + 1) * big]
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(train.images[idx]), train.labels[idx]).backward()
            opt.step()
            samples += big
            trained += time.perf_counter() - t0
            if i + 1 in points:
                acc, loss = evaluate(model, test)
                evals.append(dict(epoch=samples / n, samples=samples, round=samples // big,
                                  train_seconds=trained, test_accuracy=acc, test_loss=loss))
                if acc >= max(args.targets) or not math.isfinite(loss):
                    return dict(evals=evals, train_seconds=trained)
    return dict(evals=evals, train_seconds=trained)


@torch.no_grad()
def evaluate(model: nn.Module, test) -> tuple[float, float]:
    """(accuracy, mean cross-entropy) of ``model`` in eval mode on ``test``, batches of 1000."""
    model.eval()
    correct, loss = 0, 0.0
    for s in range(0, len(test), 1000):
        out = model(test.images[s:s + 1000])
        correct += int((out.argmax(1) == test.labels[s:s + 1000]).sum())
        loss += float(F.cross_entropy(out, test.labels[s:s + 1000], reduction="sum"))
    model.train()
    return correct / len(test), loss / len(test)


def parse_k_schedule(text: str | None) -> list[tuple[int, float]] | None:
    """``"4@0,16@1.5"`` → [(4, 0.0), (16, 1.5)] (k from that epoch on)."""
    if not text:
        return None
    return [(int(p.split("@")[0]), float(p.split("@")[1])) for p in text.split(",")]


def run_name(args) -> str:
    base = f"{args.workload}-{args.system}-k{args.k_schedule or args.k}-b{args.batch}-lr{args.lr:g}"
    if args.system == "ssgd":
        tail = f"-m{args.lr_mult:g}"
    else:  # the system's own settings, then the η scale
        tail = {"sma": f"-a{args.alpha}-mu{args.mu_z}" + (f"-beta{args.beta:g}" if args.beta else ""),
                "easgd": f"-a{args.alpha}-beta{args.centre_rate:g}"}.get(args.system, "")
        tail += f"-s{args.scale}"
    tail += f"-w{args.warmup_epochs:g}"
    if args.system in ("easgd", "localsgd", "diloco") and args.sync_every != 1:
        tail += f"-H{args.sync_every}"
    if args.outer_lr not in (None, DILOCO_OUTER.keywords["lr"]):
        tail += f"-olr{args.outer_lr:g}"
    if args.weight_decay:
        tail += f"-wd{args.weight_decay:g}"
    if args.train_samples:
        tail += f"-n{args.train_samples}"
    if args.metrics and args.scale != "adascale":
        tail += "-metrics"
    return (base + tail + f"-seed{args.seed}").replace(":", "_").replace("@", "at").replace(",", "+")


def cmd_run(args) -> int:
    if args.outer_lr is not None and args.system != "diloco":
        raise SystemExit(f"--outer-lr with --system {args.system}: it is DiLoCo's outer lr")
    if args.metrics and args.system == "ssgd":
        raise SystemExit("--metrics with --system ssgd: plain PyTorch has no monitor (the engine's "
                         "S-SGD is --system allreduce)")
    torch.set_num_threads(1)
    os.makedirs(RUNS, exist_ok=True)
    name = run_name(args)
    path = os.path.join(RUNS, name + ".json")
    if os.path.exists(path) and not args.force:
        print(f"{name}: done already ({path})")
        return 0
    train, test = load(args.workload, args.train_samples, args.test_samples)
    t0 = time.perf_counter()
    try:
        res = (run_ssgd if args.system == "ssgd" else run_sma)(args, train, test)
    except cg.errors.DivergenceError as e:  # every replica NaN/Inf in one round
        res = dict(evals=[], diverged=str(e).split(";")[0], train_seconds=None)
    res.update(name=name, args=vars(args), wall_s=time.perf_counter() - t0,
               to_target=_firsts(res["evals"], args.targets, len(train)),
               best_accuracy=max((e["test_accuracy"] for e in res["evals"]), default=None))
    with open(path, "w") as f:
        json.dump(res, f, indent=1)
    reached = "  ".join(f"{t}: {v['epochs']:.3f}" if v else f"{t}: not reached"
                        for t, v in res["to_target"].items())
    best = res["best_accuracy"]
    print(f"{name}: {reached}  best {best if best is None else round(best, 4)}  "
          f"{res.get('diverged', '')} ({res['wall_s']:.0f} s)", flush=True)
    return 0


def _runs_alive() -> int:
    """`sma_rules.py run` processes alive on this machine (of any queue)."""
    out = subprocess.run(["pgrep", "-f", "sma_rules.py run"], capture_output=True, text=True)
    return len(out.stdout.split())


def cmd_queue(args) -> int:
    """Runs the argument lines of ``args.file`` as ``nice -n 19`` subprocesses, ``--jobs`` at once
    (counting every ``run`` alive), re-reading the file so that lines appended later run too;
    ends when every line has started and none is running."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    started: set[str] = set()
    running: list[subprocess.Popen] = []
    while True:
        running = [p for p in running if p.poll() is None]
        lines = [ln.strip() for ln in open(args.file) if ln.strip() and not ln.startswith("#")]
        todo = [ln for ln in lines if ln not in started]
        if not todo and not running:
            return 0
        if todo and _runs_alive() < args.jobs:
            started.add(todo[0])
            cmd = ["nice", "-n", "19", sys.executable, os.path.abspath(__file__), "run",
                   *shlex.split(todo[0])]
            running.append(subprocess.Popen(cmd, env=env))
        time.sleep(5)


def recorded_runs(runs_dir: str = RUNS):
    """Every recorded run in ``runs_dir`` (the summary aside), as (file name, run), by name."""
    for fn in sorted(os.listdir(runs_dir)):
        if fn.endswith(".json") and fn != "summary.json":
            with open(os.path.join(runs_dir, fn)) as f:
                yield fn, json.load(f)


def summarise(runs_dir: str = RUNS) -> list[dict]:
    """One row per run: its settings and epochs to each target."""
    rows = []
    for _, r in recorded_runs(runs_dir):
        a = r["args"]
        rows.append(dict(name=r["name"], workload=a["workload"], system=a["system"], k=a["k"],
                         k_schedule=a["k_schedule"], lr=a["lr"], lr_mult=a["lr_mult"],
                         alpha=a["alpha"], mu_z=a["mu_z"], scale=a["scale"],
                         warmup_epochs=a["warmup_epochs"], seed=a["seed"],
                         max_epochs=a["max_epochs"], best_accuracy=r["best_accuracy"],
                         to_target=_firsts(r["evals"], list(TARGETS[a["workload"]]), 0),
                         diverged=r.get("diverged"), wall_s=r["wall_s"]))
    return rows


def table(rows: list[dict]) -> list[str]:
    """Markdown rows: one per configuration (its seeds pooled): epochs to each target per seed
    ("—": not reached within the cap, with the best accuracy seen), and the median's ratio to
    the median of the k = 1 runs at the same η₁ (the user's tuned learning rate)."""
    groups: dict[str, list[dict]] = {}
    for r in rows:
        groups.setdefault(r["name"].rsplit("-seed", 1)[0], []).append(r)

    def epochs(x: dict, t: str) -> float:
        v = x["to_target"].get(t)
        return v["epochs"] if v else math.inf

    base: dict[tuple, float] = {}
    for rs in groups.values():
        r0 = rs[0]
        if r0["k"] == 1 and not r0["k_schedule"] and r0["system"] == "sma":
            for t in r0["to_target"]:
                base[(r0["workload"], r0["lr"], t)] = _median([epochs(x, t) for x in rs])
    out = []
    for key, rs in sorted(groups.items(), key=lambda kv: (kv[1][0]["workload"], kv[1][0]["k"], kv[0])):
        cells = []
        for t in rs[0]["to_target"]:
            vals = [epochs(x, t) for x in rs]
            b0 = base.get((rs[0]["workload"], rs[0]["lr"], t), math.nan)
            ratio = _median(vals) / b0 if math.isfinite(b0) else math.nan
            txt = ", ".join("—" if v == math.inf else f"{v:.2f}" for v in vals)
            cells.append(txt + (f" (×{ratio:.2f})" if math.isfinite(ratio) else ""))
        best = max(x["best_accuracy"] or 0 for x in rs)
        out.append(f"| {key} | {len(rs)} | " + " | ".join(cells) + f" | {100 * best:.2f} |")
    return out


def _median(vals: list[float]) -> float:
    vals = sorted(vals)
    n = len(vals)
    return vals[n // 2] if n % 2 else (vals[n // 2 - 1] + vals[n // 2]) / 2


def cmd_summary(args) -> int:
    rows = summarise()
    with open(os.path.join(RUNS, "summary.json"), "w") as f:
        json.dump(rows, f, indent=1)
    print("| run | seeds | epochs to 1st target (×k=1) | to 2nd target (×k=1) | best % |")
    print("|---|---|---|---|---|")
    print("\n".join(table(rows)))
    return 0


def _positive(text: str) -> float:
    """A finite number > 0, for argparse."""
    x = float(text)
    if not (math.isfinite(x) and x > 0):
        raise argparse.ArgumentTypeError(f"{text!r}: must be a finite number > 0")
    return x


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--workload", choices=("w1", "fm"), default="w1")
    r.add_argument("--system", choices=SYSTEMS, default="sma")
    r.add_argument("--k", type=int, default=1)
    r.add_argument("--k-schedule", default=None, help='k in mid-fit: "4@0,16@1.5"')
    r.add_argument("--batch", type=int, default=16, help="b, samples per learner per round")
    r.add_argument("--lr", type=float, default=0.01, help="η₁, the lr tuned at k = 1")
    r.add_argument("--lr-mult", type=float, default=1.0, help="ssgd: peak lr = η₁·this")
    r.add_argument("--alpha", default="inv")
    r.add_argument("--mu-z", default="0.9")
    r.add_argument("--scale", default="1")
    r.add_argument("--centre-rate", type=float, default=0.9, help="easgd: β, z's rate")
    r.add_argument("--beta", type=float, default=None,
                   help="sma: z's rate β (None: SMA()'s rule with --alpha default, else k·α)")
    r.add_argument("--sync-every", type=int, default=1,
                   help="easgd, localsgd, diloco: H, rounds between synchronisations")
    r.add_argument("--outer-lr", type=_positive, default=None,
                   help="diloco: the outer Nesterov SGD's lr (None: DiLoCo's 0.7)")
    r.add_argument("--warmup-epochs", type=float, default=0.0)
    r.add_argument("--weight-decay", type=float, default=0.0)
    r.add_argument("--metrics", action="store_true",
                   help="the engine's systems: record B_noise whatever the rule (names end -metrics)")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--max-epochs", type=int, default=6)
    r.add_argument("--targets", type=float, nargs="+", default=[0.985, 0.99])
    r.add_argument("--evals-per-epoch", type=int, default=8)
    r.add_argument("--train-samples", type=int, default=None)
    r.add_argument("--test-samples", type=int, default=None)
    r.add_argument("--force", action="store_true")
    q = sub.add_parser("queue")
    q.add_argument("file")
    q.add_argument("--jobs", type=int, default=2)
    sub.add_parser("summary")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return {"run": cmd_run, "queue": cmd_queue, "summary": cmd_summary}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
