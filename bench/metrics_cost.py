"""Cost of the noise-scale measurement: samples/s of one epoch-fraction of W1 (LeNet-5 / MNIST,
2 devices × 2 replicas, process executor) with ``MetricsMonitor(N, measure_rounds=R)`` for each R
in ``--measure-rounds``, interleaved A/B ``--repeats`` times in one process; prints each run and
the median ratio of every R against the first.

    python bench/metrics_cost.py [--batch-size 8] [--samples 30000] [--every 50]
                                 [--measure-rounds 1,10] [--repeats 3]

A measured round runs without the process executor's overlap of the next round (its gradients are
read after it), so R measured rounds of every N cost throughput. Not a test; nothing asserted.
"""

from __future__ import annotations

import argparse
import statistics

import torch

import crossbow_graph as cg


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--samples", type=int, default=30000, help="training samples per run")
    ap.add_argument("--every", type=int, default=50, help="N, rounds per metrics window")
    ap.add_argument("--measure-rounds", default="1,10", help="R values, comma-separated")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    train = cg.datasets.mnist(train=True)
    data = torch.utils.data.Subset(train, range(min(args.samples, len(train))))
    rs = [int(x) for x in args.measure_rounds.split(",")]
    speed: dict[int, list[float]] = {r: [] for r in rs}
    for rep in range(args.repeats):
        for r in rs:
            torch.manual_seed(0)
            plan = cg.compile(cg.models.lenet5(), (train[0][0].unsqueeze(0),),
                              torch.nn.functional.cross_entropy, batch_size=args.batch_size,
                              devices=2, replicas=2, optimizer=cg.SGD(lr=0.02, momentum=0.9))
            plan.fit(data, 1, progress=False, seed=0,
                     metrics_every=cg.MetricsMonitor(args.every, measure_rounds=r))
            speed[r].append(len(data) / plan.train_seconds)
            print(f"repeat {rep} R={r}: {speed[r][-1]:,.0f} samples/s", flush=True)
    base = rs[0]
    for r in rs[1:]:
        ratio = statistics.median(a / b for a, b in zip(speed[r], speed[base]))
        print(f"R={r} / R={base}: {ratio:.3f} (median of {args.repeats} interleaved pairs)")


if __name__ == "__main__":
    main()
