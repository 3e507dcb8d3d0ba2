"""Time-to-accuracy of crossbow_graph against the baselines users would pick (docs/benchmarking.md).

Workloads: W1 (LeNet-5 on MNIST, target 99.0%) and W2 (ResNet-32 on Fashion-MNIST padded to
32×32, three channels, target 92%; ``--train-samples`` / ``--test-samples`` take a subset on a CPU).
Test accuracy is evaluated ``--evals-per-epoch`` times per epoch (4) and evaluation time is not
training time. Every run stops at the target or after ``--max-epochs`` epochs.

Systems (one run = one system × one seed, each in a fresh ``python bench/tta.py --one SPEC``
process; runs are interleaved: every system for seed 0, then every system for seed 1, …):

* ``plain-B<B>``: plain PyTorch eager S-SGD, one model, ``torch.optim.SGD(momentum=0.9)``, batch
  B with lr 0.01·B/16, 2 intra-op threads (the protocol's grid, docs/benchmarking.md; the best is the baseline).
* ``localsgd``: PyTorch's local SGD, ``torch.distributed.algorithms.model_averaging``'s
  ``PeriodicModelAverager(period=4, warmup_steps=100)`` (the example of its documentation), gloo
  on 127.0.0.1, 2 processes with 1 intra-op thread each, the same learners as crossbow_graph's
  (per-process b=16, lr 0.02, momentum 0.9). It is evaluated on the average of the 2 models.
* ``crossbow-r2``: crossbow_graph at a small batch with SGD (b=16, lr 0.02 ×0.1 at epochs 2
  and 4, momentum 0.9, 2 devices × 2 replicas, SMA α=1/k, μ_z=0.9; executor "auto");
  ``crossbow-auto``: the same with ``replicas="auto"`` (the auto-tuner).
* ``plain-B32-ms`` (extra, outside the protocol's grid): plain B=32 with the same lr schedule,
  so that the schedule's own effect can be read off.
* ``crossbow-ssgd``: the same engine and flags as ``crossbow-r2`` with ``sync=SSGD()``: the
  gradient of k=4 learners × b=16 averaged, i.e. S-SGD on a batch of 64 at lr 0.02.

    python bench/tta.py                        # W1, 3 seeds, every system (about 20 minutes)
    python bench/tta.py --quick                # W1, 1 seed, 2 epochs, 4 systems (minutes)
    python bench/tta.py --workload w2 --train-samples 10000 --test-samples 2000 --seeds 0 \\
        --max-epochs 2 --systems plain-B32 plain-B128 localsgd crossbow-r2 crossbow-ssgd

Prints a table; writes ``bench/runs/tta-<workload>-<UTC time>.json`` (not committed; every run's evaluations,
the per-system medians and spreads, the ratios to crossbow_graph's default) after every run.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import platform
import socket
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import crossbow_graph as cg  # noqa: E402
from crossbow_graph.cli import build_parser, prepare_train  # noqa: E402
from crossbow_graph.training.hooks import Hook  # noqa: E402

__all__ = ["SYSTEMS", "run_one", "summarise", "main"]

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "runs")  # raw runs, not committed
TARGETS = {"w1": 0.99, "w2": 0.92}
MODELS = {"w1": "lenet5", "w2": "resnet32"}


def _plain(batch: int, lr: float | None = None, threads: int = 2, milestones: tuple = ()) -> dict:
    return dict(kind="plain", batch=batch, lr=lr if lr is not None else 0.01 * batch / 16,
                threads=threads, lr_milestones=milestones)


CLI_MILESTONES = (2, 4)  # ``crossbow-graph train``'s default --lr-milestones (η ×0.1 at each)
GRID_BATCHES = (16, 32, 64, 128, 256)  # docs/benchmarking.md's plain grid: its best is the baseline
GRID = [f"plain-B{B}" for B in GRID_BATCHES]


SYSTEMS: dict[str, dict] = {
    **{name: _plain(B) for name, B in zip(GRID, GRID_BATCHES)},
    "plain-B32-t1": _plain(32, threads=1),  # extra: 1 thread (2 threads suffer on a busy machine)
    # extra, not in the docs/benchmarking.md grid: plain B=32 with crossbow_graph's default lr schedule
    "plain-B32-ms": _plain(32, milestones=CLI_MILESTONES),
    "localsgd": dict(kind="localsgd", batch=16, lr=0.02, period=4, warmup_steps=100, procs=2),
    "crossbow-r2": dict(kind="crossbow", batch=16, lr=0.02, devices=2, replicas=2, sync="sma",
                        lr_milestones=CLI_MILESTONES),
    "crossbow-auto": dict(kind="crossbow", batch=16, lr=0.02, devices=2, replicas="auto", sync="sma",
                          lr_milestones=CLI_MILESTONES),
    "crossbow-ssgd": dict(kind="crossbow", batch=16, lr=0.02, devices=2, replicas=2, sync="ssgd",
                          lr_milestones=CLI_MILESTONES),
    "crossbow-cli": dict(kind="cli", argv=[]),  # ``crossbow-graph train`` exactly, its defaults
}
DEFAULT = "crossbow-r2"  # the system the summary's ratio against the best plain system is of


# -- data and evaluation ---------------------------------------------------------------------

def load(workload: str, train_samples: int | None, test_samples: int | None):
    """(train, test) ImageDatasets of the workload, optionally the first N samples of each."""
    if workload == "w1":
        train, test = cg.datasets.mnist(True), cg.datasets.mnist(False)
    else:
        train = cg.datasets.fashion_mnist(True, pad_to_32=True, rgb=True)
        test = cg.datasets.fashion_mnist(False, pad_to_32=True, rgb=True)

    def first(ds, n):
        return ds if n is None else cg.datasets.ImageDataset(ds.images[:n], ds.labels[:n], ds.name)

    return first(train, train_samples), first(test, test_samples)


@torch.no_grad()
def accuracy(model: torch.nn.Module, test) -> float:
    """Test accuracy (fraction) of ``model`` in eval mode, batches of 1000."""
    was = model.training
    model.eval()
    correct = 0
    for s in range(0, len(test), 1000):
        out = model(test.images[s:s + 1000])
        correct += int((out.argmax(1) == test.labels[s:s + 1000]).sum())
    model.train(was)
    return correct / len(test)


def _eval_points(steps_per_epoch: int, evals_per_epoch: int) -> set[int]:
    """Steps (1-based, within an epoch) after which to evaluate: evenly spaced, the last one last."""
    return {max(1, steps_per_epoch * i // evals_per_epoch) for i in range(1, evals_per_epoch + 1)}


# -- one run of each kind ------------------------------------------------------------------------

def train_plain(model, opt, train, test, *, batch, seed, epochs, target, evals_per_epoch,
                max_train_s=math.inf, step_each_batch=None, step_each_epoch=None) -> dict:
    """The plain-PyTorch loop every plain system runs: ``epochs`` epochs of ``torch.randperm``
    order (seeded by ``seed``, last partial batch dropped), ``evals_per_epoch`` evaluations per
    epoch (``_eval_points``), evaluation off the clock; ends at ``target`` or at the first
    evaluation after ``max_train_s``. ``step_each_batch``/``step_each_epoch``: a scheduler's
    ``step`` called after every batch / epoch. Returns ``_result``'s record."""
    n = len(train)
    steps = n // batch
    points = _eval_points(steps, evals_per_epoch)
    evals, trained, samples = [], 0.0, 0
    gen = torch.Generator().manual_seed(seed)
    for epoch in range(epochs):
        order = torch.randperm(n, generator=gen)
        start = time.perf_counter()
        for i in range(steps):
            idx = order[i * batch:(i + 1) * batch]
            opt.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(model(train.images[idx]), train.labels[idx]).backward()
            opt.step()
            if step_each_batch is not None:
                step_each_batch()
            samples += batch
            if i + 1 in points:
                trained += time.perf_counter() - start
                acc = accuracy(model, test)
                evals.append(dict(epoch=epoch + (i + 1) / steps, train_seconds=trained,
                                  test_accuracy=acc))
                if acc >= target or trained >= max_train_s:
                    return _result(evals, samples, trained, target)
                start = time.perf_counter()
        if step_each_epoch is not None:
            step_each_epoch()
    return _result(evals, samples, trained, target)


def run_plain(spec, train, test, *, model_name, seed, max_epochs, target, evals_per_epoch,
              max_train_s=math.inf) -> dict:
    """Plain PyTorch eager S-SGD: one model, batch B, torch.optim.SGD(momentum=0.9)."""
    torch.set_num_threads(spec["threads"])
    torch.manual_seed(seed)
    model = cg.models.get_model(model_name).train()
    opt = torch.optim.SGD(model.parameters(), lr=spec["lr"], momentum=0.9)
    schedule = torch.optim.lr_scheduler.MultiStepLR(  # stepped per epoch; no milestones: constant
        opt, milestones=list(spec.get("lr_milestones", ())), gamma=0.1)
    return train_plain(model, opt, train, test, batch=spec["batch"], seed=seed, epochs=max_epochs,
                       target=target, evals_per_epoch=evals_per_epoch, max_train_s=max_train_s,
                       step_each_epoch=schedule.step)


def run_crossbow(spec, train, test, *, model_name, seed, max_epochs, target, evals_per_epoch,
                max_train_s=math.inf) -> dict:
    """crossbow_graph with the CLI's defaults (``spec`` names b, lr, devices, replicas, sync)."""
    torch.manual_seed(seed)
    sync = cg.SSGD() if spec["sync"] == "ssgd" else cg.SMA(scale_lr=spec.get("scale_lr", cg.SMA.scale_lr))
    plan = cg.compile(cg.models.get_model(model_name), (train.images[:1],),
                      torch.nn.functional.cross_entropy, batch_size=spec["batch"],
                      devices=spec["devices"], replicas=spec["replicas"],
                      optimizer=cg.SGD(lr=spec["lr"], momentum=0.9), sync=sync)
    policies = ([cg.MultiStepLR(milestones=tuple(spec["lr_milestones"]), gamma=0.1)]
                if spec.get("lr_milestones") else [])
    h = plan.fit(train, max_epochs, eval_dataset=test, seed=seed, target_accuracy=target,
                 evals_per_epoch=evals_per_epoch, progress=False, hooks=[_TimeCap(max_train_s)],
                 policies=policies)
    evals = [dict(epoch=e.epoch, train_seconds=e.train_seconds, test_accuracy=e.test_accuracy)
             for e in h.evals]
    samples = sum(e.samples for e in h.epochs)
    if not evals or evals[-1]["train_seconds"] < plan.train_seconds - 1e-3:  # stopped by the cap
        evals.append(dict(epoch=samples / len(train), train_seconds=plan.train_seconds,
                          test_accuracy=plan.evaluate(test)[0]))
    out = _result(evals, samples, plan.train_seconds, target)
    out["executor"] = plan.rounds.resolved_executor()
    out["final_replicas_per_device"] = plan.replicas_per_device
    out["final_learner_mode"] = plan.learner_mode
    out["autotune"] = [dict(round=d.round, m=d.replicas_per_device, mode=d.learner_mode,
                            samples_per_s=d.samples_per_s, action=d.action) for d in h.autotune]
    return out


class _TimeCap(Hook):
    """Ends a fit at the first evaluation after ``max_train_s`` training seconds."""

    mutates_replicas = False

    def __init__(self, max_train_s: float) -> None:
        self.max_train_s = max_train_s

    def after_round(self, ctx) -> None:  # a slow run may not reach an evaluation for minutes
        if ctx.train_seconds >= self.max_train_s:
            ctx.stop = True


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _localsgd_worker(rank, spec, port, train, test, model_name, seed, max_epochs, target,
                     evals_per_epoch, max_train_s, queue) -> None:
    import torch.distributed as dist
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager

    torch.set_num_threads(1)
    world = spec["procs"]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    torch.manual_seed(seed)  # the same initial model in every process
    model = cg.models.get_model(model_name).train()
    opt = torch.optim.SGD(model.parameters(), lr=spec["lr"], momentum=0.9)
    averager = PeriodicModelAverager(period=spec["period"], warmup_steps=spec["warmup_steps"])
    b, n = spec["batch"], len(train)
    steps = n // (world * b)  # per process per epoch; process r takes batches r, r+world, …
    points = _eval_points(steps, evals_per_epoch)
    evals, trained, samples, stop = [], 0.0, 0, torch.zeros(1)
    gen = torch.Generator().manual_seed(seed)
    for epoch in range(max_epochs):
        order = torch.randperm(n, generator=gen)  # the same order in every process
        start = time.perf_counter()
        for i in range(steps):
            idx = order[(i * world + rank) * b:(i * world + rank + 1) * b]
            opt.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(model(train.images[idx]), train.labels[idx]).backward()
            opt.step()
            averager.average_parameters(model.parameters())
            samples += world * b
            if i + 1 in points:
                dist.barrier()  # every process has trained up to here
                trained += time.perf_counter() - start
                avg = [t.detach().clone() for t in model.state_dict().values()]
                for t in avg:
                    if t.is_floating_point():
                        dist.all_reduce(t)
                        t /= world
                if rank == 0:
                    probe = cg.models.get_model(model_name)
                    probe.load_state_dict(dict(zip(model.state_dict().keys(), avg)))
                    acc = accuracy(probe, test)
                    evals.append(dict(epoch=epoch + (i + 1) / steps, train_seconds=trained,
                                      test_accuracy=acc))
                    stop.fill_(float(acc >= target or trained >= max_train_s))
                dist.broadcast(stop, 0)
                if stop.item():
                    break
                start = time.perf_counter()
        if stop.item():
            break
    if rank == 0:
        queue.put(_result(evals, samples, trained, target))
    dist.destroy_process_group()


def run_localsgd(spec, train, test, *, model_name, seed, max_epochs, target, evals_per_epoch,
                max_train_s=math.inf) -> dict:
    """PyTorch local SGD (PeriodicModelAverager) in ``procs`` forked processes over gloo."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_localsgd_worker,
                         args=(r, spec, port, train, test, model_name, seed, max_epochs, target,
                               evals_per_epoch, max_train_s, queue))
             for r in range(spec["procs"])]
    for p in procs:
        p.start()
    out = queue.get()
    for p in procs:
        p.join()
    return out


def _result(evals: list[dict], samples: int, trained: float, target: float) -> dict:
    hit = next((e for e in evals if e["test_accuracy"] >= target), None)
    return dict(evals=evals, samples=samples, train_seconds=trained,
                samples_per_s=samples / max(trained, 1e-9),
                time_to_accuracy_s=hit["train_seconds"] if hit else None,
                epochs_to_accuracy=hit["epoch"] if hit else None,
                final_accuracy=evals[-1]["test_accuracy"] if evals else None,
                best_accuracy=max((e["test_accuracy"] for e in evals), default=None))


def system_spec(name: str) -> dict:
    """A system by name: one of SYSTEMS, or ``"cli:FLAGS"``, ``crossbow-graph train FLAGS`` (e.g.
    ``"cli:--batch-size 64 --devices 2 --replicas 1"``; the bench sets --seed, --target,
    --evals-per-epoch and --quiet, and --epochs only when ``--max-epochs`` is below the CLI's
    own, which is a schedule's length).

    Raises:
        KeyError: an unknown name.
    """
    if name.startswith("cli:"):
        return dict(kind="cli", argv=name[4:].split())
    return dict(SYSTEMS[name])


def run_cli(spec, train, test, *, model_name, seed, max_epochs, target, evals_per_epoch,
            max_train_s=math.inf) -> dict:
    """``crossbow-graph train`` with ``spec["argv"]`` (cli.prepare_train: the same plan, data,
    optimizer, schedule and policies as the command), its own data (W1: the CLI's MNIST)."""
    argv = ["train", *spec["argv"], "--seed", str(seed), "--target", str(target),
            "--evals-per-epoch", str(evals_per_epoch), "--quiet"]
    if "--epochs" not in argv:  # the CLI's own --epochs (a schedule's length) unless capped lower
        defaults = build_parser().parse_args(argv)
        argv += ["--epochs", str(min(defaults.epochs, max_epochs))]
    plan, fit = prepare_train(build_parser().parse_args(argv))
    fit["hooks"] = [_TimeCap(max_train_s)]
    h = plan.fit(**fit)
    evals = [dict(epoch=e.epoch, train_seconds=e.train_seconds, test_accuracy=e.test_accuracy)
             for e in h.evals]
    out = _result(evals, sum(e.samples for e in h.epochs), plan.train_seconds, target)
    out.update(argv=argv, final_replicas_per_device=plan.replicas_per_device,
               executor=plan.rounds.resolved_executor())
    return out


RUNNERS = {"plain": run_plain, "crossbow": run_crossbow, "localsgd": run_localsgd, "cli": run_cli}


def run_one(job: dict) -> dict:
    """One run: ``job`` = dict(spec, workload, seed, max_epochs, target, evals_per_epoch,
    train_samples, test_samples)."""
    train, test = load(job["workload"], job.get("train_samples"), job.get("test_samples"))
    spec = job["spec"]
    return RUNNERS[spec["kind"]](spec, train, test, model_name=MODELS[job["workload"]],
                                 seed=job["seed"], max_epochs=job["max_epochs"],
                                 target=job["target"], evals_per_epoch=job["evals_per_epoch"],
                                 max_train_s=job.get("max_train_s") or math.inf)


def run_in_subprocess(job: dict, timeout_s: float, script: str = __file__) -> dict:
    """``run_one(job)`` in a fresh ``python bench/tta.py --one`` process (its own threads, forks);
    ``script``: another bench script with the same ``--one JSON`` protocol (tta_baselines.py)."""
    t0 = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, os.path.abspath(script), "--one", json.dumps(job)],
                              capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return dict(error=f"timed out after {timeout_s:.0f} s", wall_s=time.perf_counter() - t0)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("{")]
    if proc.returncode != 0 or not lines:
        return dict(error=(proc.stderr or proc.stdout)[-2000:], wall_s=time.perf_counter() - t0)
    out = json.loads(lines[-1])
    out["wall_s"] = time.perf_counter() - t0
    return out


# -- summary ------------------------------------------------------------------------------

def _median(xs: list[float | None]) -> float | None:
    """Median with a run that never reached the target counted as +∞ (None if the median is ∞)."""
    vals = [math.inf if x is None else x for x in xs]
    if not vals:
        return None
    m = statistics.median(vals)
    return None if math.isinf(m) else m


def summarise(runs: list[dict], systems: list[str]) -> dict:
    """Per system: median and spread (min, max) of time- and epochs-to-accuracy and samples/s,
    runs reaching the target; the best plain-PyTorch batch; ratios of each system to the default."""
    table = {}
    for name in systems:
        rs = [r for r in runs if r["system"] == name and "error" not in r["result"]]
        if not rs:
            continue
        tta = [r["result"]["time_to_accuracy_s"] for r in rs]
        eta = [r["result"]["epochs_to_accuracy"] for r in rs]
        sps = [r["result"]["samples_per_s"] for r in rs]
        fin = [r["result"]["final_accuracy"] for r in rs]
        reached = [x for x in tta if x is not None]
        table[name] = dict(
            runs=len(rs), reached=len(reached),
            tta_median_s=_median(tta), tta_min_s=min(reached, default=None),
            tta_max_s=max(reached, default=None) if len(reached) == len(rs) else None,
            eta_median=_median(eta), eta_min=min((x for x in eta if x is not None), default=None),
            eta_max=max(eta) if None not in eta else None,
            samples_per_s_median=statistics.median(sps), samples_per_s_min=min(sps),
            samples_per_s_max=max(sps), final_accuracy_median=statistics.median(fin),
            best_accuracy_max=max(r["result"]["best_accuracy"] for r in rs))
    plain = {n: t for n, t in table.items() if n in GRID and t["tta_median_s"] is not None}
    best_plain = min(plain, key=lambda n: plain[n]["tta_median_s"]) if plain else None
    ref = table.get(DEFAULT, {}).get("tta_median_s")
    ratios = {n: (t["tta_median_s"] / ref if ref and t["tta_median_s"] else None)
              for n, t in table.items()}
    acceptance = None
    if best_plain and ref:
        acceptance = dict(default=DEFAULT, best_plain=best_plain,
                          ratio=ref / table[best_plain]["tta_median_s"], bar=0.75,
                          met=ref / table[best_plain]["tta_median_s"] <= 0.75)
    # plain systems outside the grid (another schedule, 1 thread): the default's time ÷ theirs
    extra = {n: ref / t["tta_median_s"] for n, t in table.items()
             if n.startswith("plain-") and n not in GRID and ref and t["tta_median_s"]}
    return dict(systems=table, best_plain=best_plain, baseline_over_default=ratios,
                acceptance=acceptance, default_over_extra_plain=extra)


def _fmt(x, spec="{:.1f}"):
    return "—" if x is None else spec.format(x)


def print_run(seed: int, name: str, res: dict, load1: float, width: int = 14) -> None:
    """One line per finished run: its time and epochs to the target, samples/s, final accuracy,
    wall seconds and the load average when it started (or its error)."""
    if "error" in res:
        print(f"seed {seed} {name:<{width}} ERROR {res['error'][-300:]}", flush=True)
        return
    print(f"seed {seed} {name:<{width}} TTA {_fmt(res['time_to_accuracy_s']):>6} s  "
          f"epochs {_fmt(res['epochs_to_accuracy'], '{:.2f}'):>5}  "
          f"{res['samples_per_s']:>8,.0f} samples/s  final {res['final_accuracy']:.4f}  "
          f"(wall {res['wall_s']:.0f} s, load {load1:.1f})", flush=True)


def print_table(summary: dict, target: float) -> None:
    print(f"\n{'system':<15} {'reached':>7} {'TTA median s':>12} {'spread s':>13} "
          f"{'epochs':>6} {'samples/s':>10} {'final acc':>9} {'÷ default':>9}")
    for name, t in summary["systems"].items():
        spread = f"{_fmt(t['tta_min_s'])}–{_fmt(t['tta_max_s'])}"
        r = summary["baseline_over_default"].get(name)
        print(f"{name:<15} {t['reached']}/{t['runs']:<5} {_fmt(t['tta_median_s']):>12} "
              f"{spread:>13} {_fmt(t['eta_median'], '{:.2f}'):>6} "
              f"{t['samples_per_s_median']:>10,.0f} {t['final_accuracy_median']:>9.4f} "
              f"{_fmt(r, '{:.2f}'):>9}")
    a = summary["acceptance"]
    if a:
        print(f"\nacceptance: {a['default']} TTA / best plain of the grid ({a['best_plain']}) TTA = "
              f"{a['ratio']:.2f} (bar ≤ {a['bar']}): {'met' if a['met'] else 'missed'}")
    else:
        print(f"\nacceptance: not computable (a median did not reach {target:.3f})")
    for name, r in summary.get("default_over_extra_plain", {}).items():
        print(f"outside the grid: {DEFAULT} TTA / {name} TTA = {r:.2f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--workload", choices=("w1", "w2"), default="w1")
    parser.add_argument("--systems", nargs="+", default=list(SYSTEMS), metavar="SYSTEM",
                        help=f"systems to run, of: {' '.join(SYSTEMS)}, or 'cli:FLAGS' "
                             "(crossbow-graph train FLAGS)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--max-epochs", type=int, default=6, help="cap of every run")
    parser.add_argument("--target", type=float, default=None, help="default: 0.99 (W1), 0.92 (W2)")
    parser.add_argument("--max-train-s", type=float, default=90.0,
                        help="also end a run at the first evaluation after this many training seconds")
    parser.add_argument("--evals-per-epoch", type=int, default=4)
    parser.add_argument("--train-samples", type=int, default=None, help="first N training samples")
    parser.add_argument("--test-samples", type=int, default=None, help="first N test samples")
    parser.add_argument("--plain-threads", type=int, default=2,
                        help="intra-op threads of the plain-B<B> grid (the protocol: 2)")
    parser.add_argument("--once", nargs="*", default=[], metavar="SYSTEM",
                        help="of --systems, those run for the first seed only")
    parser.add_argument("--resume", action="store_true",
                        help="keep the runs already in --out and run only the missing ones")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    parser.add_argument("--quick", action="store_true",
                        help="1 seed, 2 epochs, plain-B32, localsgd, crossbow-r2, crossbow-ssgd")
    parser.add_argument("--out", default=None, help="JSON path (default bench/runs/tta-…)")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one is not None:
        print(json.dumps(run_one(json.loads(args.one))), flush=True)
        return 0
    if args.quick:
        args.seeds, args.max_epochs = args.seeds[:1], min(args.max_epochs, 2)
        if args.systems == list(SYSTEMS):
            args.systems = ["plain-B32", "localsgd", "crossbow-r2", "crossbow-ssgd"]
    target = args.target if args.target is not None else TARGETS[args.workload]
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    out = args.out or os.path.join(RESULTS, f"tta-{args.workload}-{stamp}{'-quick' if args.quick else ''}.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    meta = dict(when=stamp, workload=args.workload, model=MODELS[args.workload], target=target,
                seeds=args.seeds, max_epochs=args.max_epochs, max_train_s=args.max_train_s,
                evals_per_epoch=args.evals_per_epoch,
                train_samples=args.train_samples, test_samples=args.test_samples,
                quick=args.quick, once=args.once,
                command="python bench/tta.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                torch=torch.__version__, machine=platform.machine(), cores=os.cpu_count(),
                note="shared machine: other jobs ran during the measurement")
    runs: list[dict] = []
    if args.resume and os.path.exists(out):
        with open(out) as f:
            old = json.load(f)
        runs = [r for r in old["runs"] if r["system"] in args.systems and "error" not in r["result"]]
        meta["resumed_from"] = dict(when=old["when"], command=old["command"])
    done = {(r["system"], r["seed"]) for r in runs}
    t_start = time.perf_counter()
    try:
        specs = {n: system_spec(n) for n in args.systems}
    except KeyError as exc:
        parser.error(f"--systems: unknown system {exc}; use one of {' '.join(SYSTEMS)} or 'cli:FLAGS'")
    for n, spec in specs.items():
        if spec["kind"] == "plain" and not n.endswith("-t1"):
            spec["threads"] = args.plain_threads
    meta["systems"] = specs
    for seed in args.seeds:  # interleaved: A B C … for seed 0, then for seed 1, …
        for name in args.systems:
            if (name in args.once and seed != args.seeds[0]) or (name, seed) in done:
                continue
            job = dict(spec=specs[name], workload=args.workload, seed=seed,
                       max_epochs=args.max_epochs, target=target,
                       evals_per_epoch=args.evals_per_epoch, max_train_s=args.max_train_s,
                       train_samples=args.train_samples,
                       test_samples=args.test_samples)
            load1 = os.getloadavg()[0]
            res = run_in_subprocess(job, args.timeout)
            runs.append(dict(system=name, seed=seed, load_average_1min=load1, result=res))
            print_run(seed, name, res, load1)
            summary = summarise(runs, args.systems)
            with open(out, "w") as f:
                json.dump(dict(meta, wall_s=time.perf_counter() - t_start, runs=runs,
                               summary=summary), f, indent=1)
    print_table(summary, target)
    print(f"wrote {out} ({time.perf_counter() - t_start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
