"""Hardware-efficiency grid (docs/benchmarking.md): samples/s of crossbow_graph against plain PyTorch.

LeNet-5 on MNIST (real data). For b ∈ {4, 8, 16, 32, 64} × m ∈ {1, 2, 4, 8, 16} learners in all ×
learner mode ∈ {per_replica, fused}: crossbow_graph's training samples/s, next to plain PyTorch
(one model, torch.optim.SGD momentum 0.9, main thread) at the same b and at b·m. The m learners
run on G logical CPU devices (G = the number of cores when it divides m, else 1), m/G per device,
so that every worker process gets the same share. Then the auto-tuner (``replicas="auto"`` on G =
cores devices: it adds a replica per device) runs at b = 8 and its choice is marked in the grid;
finally the throughput check: the tuned configuration against plain PyTorch at b = 8, interleaved
A B A B in this one run (medians and their ratio; bench/results/throughput_b8.json summarises
such runs). Plain PyTorch is measured with the default intra-op threads and with one thread, and
the faster counts as the baseline.

Run from the repository root:  python bench/throughput.py [--quick] [--seconds S]
Prints the table; writes the raw JSON to bench/runs/throughput-<UTC time>.json (not committed).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import crossbow_graph as cg  # noqa: E402
from crossbow_graph.engine.learning.threads import available_cores  # noqa: E402
from crossbow_graph.training.hooks import Hook  # noqa: E402

__all__ = ["plain_rate", "crossbow_rate", "tuned_choice", "main"]

WARMUP_ROUNDS = 20


def plain_rate(data, b: int, seconds: float, threads: int | None = None) -> float:
    """Plain PyTorch LeNet-5 training samples/s at batch ``b`` (main thread, ``threads``)."""
    saved = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        torch.manual_seed(0)
        model = cg.models.lenet5()
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        x_all, y_all = data.images, data.labels
        order = torch.randperm(len(x_all))
        pos, steps, t0 = 0, 0, None
        while True:
            if pos + b > len(order):
                pos = 0
            idx = order[pos:pos + b]
            pos += b
            loss = torch.nn.functional.cross_entropy(model(x_all[idx]), y_all[idx])
            opt.zero_grad(set_to_none=False)
            loss.backward()
            opt.step()
            steps += 1
            if t0 is None and steps == WARMUP_ROUNDS:
                t0, steps = time.perf_counter(), 0
            elif t0 is not None and time.perf_counter() - t0 >= seconds:
                return steps * b / (time.perf_counter() - t0)
    finally:
        torch.set_num_threads(saved)


class _Meter(Hook):
    """Measures samples/s after a warm-up and stops the fit after ``seconds``."""

    mutates_replicas = False

    def __init__(self, seconds: float, warmup_rounds: int = WARMUP_ROUNDS) -> None:
        self.seconds, self.warmup = seconds, warmup_rounds
        self.rounds, self.samples, self.t0, self.rate = 0, 0, None, None

    def after_round(self, ctx) -> None:
        self.rounds += 1
        if self.rounds == self.warmup:
            self.t0, self.samples = time.perf_counter(), 0
            return
        if self.t0 is None:
            return
        self.samples += ctx.round_samples
        elapsed = time.perf_counter() - self.t0
        if elapsed >= self.seconds:
            self.rate = self.samples / elapsed
            ctx.stop = True


def _compile(data, b: int, replicas, mode: str = "per_replica", **kw):
    torch.manual_seed(0)
    return cg.compile(cg.models.lenet5(), (data.images[:2],), torch.nn.functional.cross_entropy,
                      batch_size=b, replicas=replicas, learner_mode=mode,
                      optimizer=cg.SGD(lr=0.01, momentum=0.9), **kw)


def layout(k: int) -> tuple[int, int]:
    """(G devices, m per device) for k learners: G = cores when it divides k, else 1."""
    g = available_cores()
    return (g, k // g) if k >= g and k % g == 0 else (1, k)


def crossbow_rate(data, b: int, k: int, mode: str, seconds: float) -> float:
    """crossbow_graph samples/s with k learners (``layout(k)``) in ``mode`` (steady state)."""
    g, m = layout(k)
    plan = _compile(data, b, m, mode, devices=g)
    meter = _Meter(seconds)
    plan.fit(data, 100, progress=False, hooks=[meter], shuffle=True)
    return meter.rate or float("nan")


def tuned_choice(data, b: int, seconds: float) -> tuple[int, str, list[dict]]:
    """Run the auto-tuner (G = cores devices) for ``seconds``; its final (k, mode), decisions."""
    plan = _compile(data, b, "auto", devices=available_cores(),
                    autotune=cg.AutoTune(window_s=1.0, warmup_rounds=20, reprobe=False))
    meter = _Meter(seconds, warmup_rounds=1)
    hist = plan.fit(data, 100, progress=False, hooks=[meter])
    return plan.num_learners, plan.learner_mode, [vars(r) for r in hist.autotune]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="b=8, m∈{1,2,4,8}, both modes, tuner and acceptance (about a minute)")
    parser.add_argument("--seconds", type=float, default=None,
                        help="measurement seconds per cell (default 1.0, quick 0.8)")
    parser.add_argument("--reps", type=int, default=3, help="A/B repetitions of the acceptance")
    parser.add_argument("--out", default=None, help="JSON path (default bench/runs/...)")
    args = parser.parse_args(argv)
    sec = args.seconds or (0.8 if args.quick else 1.0)
    bs = [8] if args.quick else [4, 8, 16, 32, 64]
    ms = [1, 2, 4, 8] if args.quick else [1, 2, 4, 8, 16]
    modes = ["per_replica", "fused"]
    data = cg.datasets.mnist(train=True)
    t_start = time.perf_counter()
    print(f"LeNet-5/MNIST throughput, {available_cores()} cores, torch {torch.__version__}, "
          f"default intra-op threads {torch.get_num_threads()}, {sec:.1f} s per cell", flush=True)

    plain: dict[int, float] = {}

    def plain_best(b: int) -> float:
        if b not in plain:
            plain[b] = max(plain_rate(data, b, sec), plain_rate(data, b, sec, threads=1))
        return plain[b]

    grid = []
    for b in bs:
        for m in ms:
            for mode in modes:
                rate = crossbow_rate(data, b, m, mode, sec)
                row = dict(b=b, m=m, devices=layout(m)[0], m_per_device=layout(m)[1], mode=mode,
                           samples_per_s=rate, plain_b=plain_best(b), plain_bm=plain_best(b * m))
                grid.append(row)
                print(f"b={b:>3} m={m:>2} {mode:<12} {rate:>9,.0f} samples/s   plain b: "
                      f"{row['plain_b']:>9,.0f}  plain b·m={b * m}: {row['plain_bm']:>9,.0f}  "
                      f"×{rate / row['plain_b']:.2f}", flush=True)

    b = 8
    m_t, mode_t, decisions = tuned_choice(data, b, 15.0 if args.quick else 25.0)
    print(f"auto-tuner at b={b}: {m_t} learners ({layout(m_t)[0]} devices × {layout(m_t)[1]}), "
          f"{mode_t}; decisions (m per device):")
    for d in decisions:
        print(f"  round {d['round']:>5}: m={d['replicas_per_device']} {d['learner_mode']:<12} "
              f"{d['samples_per_s']:>9,.0f} samples/s → {d['action']} "
              f"(m={d['next_replicas_per_device']}, {d['next_learner_mode']})")
    for row in grid:
        row["tuner_choice"] = row["b"] == b and row["m"] == m_t and row["mode"] == mode_t

    a_rates, p_rates = [], []
    for _ in range(args.reps):  # interleaved A B A B
        a_rates.append(crossbow_rate(data, b, m_t, mode_t, 2 * sec))
        p_rates.append(max(plain_rate(data, b, 2 * sec), plain_rate(data, b, 2 * sec, threads=1)))
    ratio = statistics.median(a_rates) / statistics.median(p_rates)
    print()
    print(f"{'b':>3} {'m':>3} {'mode':<12} {'samples/s':>10} {'plain b':>9} {'plain b·m':>10} "
          f"{'vs b':>6}")
    for row in grid:
        mark = "  ← tuner" if row["tuner_choice"] else ""
        print(f"{row['b']:>3} {row['m']:>3} {row['mode']:<12} {row['samples_per_s']:>10,.0f} "
              f"{row['plain_b']:>9,.0f} {row['plain_bm']:>10,.0f} "
              f"{row['samples_per_s'] / row['plain_b']:>6.2f}{mark}")
    print(f"\nacceptance (b={b}, A/B × {args.reps}): tuned {m_t} learners {mode_t}: median "
          f"{statistics.median(a_rates):,.0f} samples/s {[round(x) for x in a_rates]}; plain "
          f"PyTorch: median {statistics.median(p_rates):,.0f} {[round(x) for x in p_rates]}; "
          f"ratio {ratio:.2f} (target ≥ 1.5)")
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "runs",
                                   f"throughput-{stamp}{'-quick' if args.quick else ''}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(dict(
            when=stamp, quick=args.quick, seconds_per_cell=sec, cores=available_cores(),
            torch=torch.__version__, machine=platform.machine(),
            load_average=os.getloadavg(), grid=grid,
            tuner=dict(b=b, learners=m_t, devices=layout(m_t)[0], replicas_per_device=layout(m_t)[1],
                       learner_mode=mode_t, decisions=decisions),
            acceptance=dict(b=b, tuned_samples_per_s=a_rates, plain_samples_per_s=p_rates,
                            ratio=ratio, target=1.5),
            wall_s=time.perf_counter() - t_start,
        ), f, indent=2)
    print(f"wrote {out} ({time.perf_counter() - t_start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
