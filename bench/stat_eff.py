"""Statistical efficiency and hyper-parameter robustness on W1 (docs/benchmarking.md).

``--part epochs``: epochs to 99.0% test accuracy (evaluated 4× per epoch) for

* SMA (crossbow_graph) at b=16, lr 0.02, k ∈ {1, 2, 4, 8} learners (one device × k replicas;
  k=1 is plain SGD at b=16),
* S-SGD at a batch of b·k (plain PyTorch, the same lr 0.02, 1 thread: what ``sync=SSGD()``
  computes, tests/test_ssgd.py), k ∈ {2, 4, 8},
* local SGD (PyTorch's ``PeriodicModelAverager``, period 4, b=16 per process, lr 0.02) with
  k ∈ {2, 4} processes.

``--part robustness``: the final test accuracy after ``--epochs`` epochs over b ∈ {4, 8, 16, 32,
64} with the learning rate left at its default (0.02): crossbow_graph's CLI defaults otherwise
(2 devices × 2 replicas, SMA), and plain PyTorch at batch b (1 thread) for contrast.

Each run is one ``bench/tta.py --one`` process; one seed unless ``--seeds`` says more.

    python bench/stat_eff.py --part epochs --max-epochs 4
    python bench/stat_eff.py --part robustness --epochs 1

Writes ``bench/runs/stat_eff-<part>-<UTC time>.json`` (not committed) after every run.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import tta  # noqa: E402  (bench/tta.py: the runners)

__all__ = ["epochs_jobs", "robustness_jobs", "main"]


def epochs_jobs(only: list[str] | None = None) -> list[tuple[str, int, dict]]:
    """(system, k, spec) of the statistical-efficiency part; ``only``: names like "sma-4"."""
    jobs = [("sma", k, dict(kind="crossbow", batch=16, lr=0.02, devices=1, replicas=k, sync="sma"))
            for k in (1, 2, 4, 8)]
    jobs += [("ssgd", k, tta._plain(16 * k, lr=0.02, threads=1)) for k in (2, 4, 8)]
    jobs += [("localsgd", k, dict(kind="localsgd", batch=16, lr=0.02, period=4, warmup_steps=100,
                                  procs=k)) for k in (2, 4)]
    if not only:
        return jobs
    named = {f"{j[0]}-{j[1]}": j for j in jobs}
    return [named[n] for n in only]


def robustness_jobs(bs=(4, 8, 16, 32, 64)) -> list[tuple[str, int, dict]]:
    """(system, b, spec) of the robustness part: the lr stays 0.02."""
    jobs = []
    for b in bs:
        jobs.append(("crossbow", b, dict(kind="crossbow", batch=b, lr=0.02, devices=2, replicas=2,
                                         sync="sma")))
        jobs.append(("plain", b, tta._plain(b, lr=0.02, threads=1)))
    return jobs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=("epochs", "robustness"), required=True)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--max-epochs", type=int, default=4, help="epochs part: cap of every run")
    parser.add_argument("--max-train-s", type=float, default=90.0,
                        help="epochs part: also end a run at the first evaluation after this")
    parser.add_argument("--epochs", type=int, default=1, help="robustness part: epochs per run")
    parser.add_argument("--train-samples", type=int, default=None)
    parser.add_argument("--only", nargs="*", default=None, metavar="NAME",
                        help="epochs part: run only these, e.g. sma-1 sma-8 ssgd-8 localsgd-4")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    out = args.out or os.path.join(tta.RESULTS, f"stat_eff-{args.part}-{stamp}.json")
    robust = args.part == "robustness"
    jobs = robustness_jobs() if robust else epochs_jobs(args.only)
    meta = dict(when=stamp, part=args.part, workload="w1", target=0.99, seeds=args.seeds,
                max_epochs=args.epochs if robust else args.max_epochs,
                max_train_s=None if robust else args.max_train_s, train_samples=args.train_samples,
                command="python bench/stat_eff.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                note="shared machine: other jobs ran during the measurement")
    runs, t0 = [], time.perf_counter()
    for seed in args.seeds:
        for system, x, spec in jobs:
            job = dict(spec=spec, workload="w1", seed=seed,
                       max_epochs=args.epochs if robust else args.max_epochs,
                       target=1.01 if robust else 0.99,  # robustness: run every epoch
                       evals_per_epoch=4, max_train_s=None if robust else args.max_train_s,
                       train_samples=args.train_samples)
            res = tta.run_in_subprocess(job, 900)
            runs.append(dict(system=system, x=x, seed=seed, spec=spec, result=res))
            if "error" in res:
                print(f"{system} {x}: ERROR {res['error'][-300:]}", flush=True)
            else:
                print(f"{system:<9} {'b' if robust else 'k'}={x:<3} epochs to 99.0%: "
                      f"{tta._fmt(res['epochs_to_accuracy'], '{:.2f}'):>5}  final "
                      f"{res['final_accuracy']:.4f}  best {res['best_accuracy']:.4f}  "
                      f"{res['samples_per_s']:,.0f} samples/s  trained {res['train_seconds']:.0f} s",
                      flush=True)
            with open(out, "w") as f:
                json.dump(dict(meta, wall_s=time.perf_counter() - t0, runs=runs), f, indent=1)
    print(f"wrote {out} ({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
