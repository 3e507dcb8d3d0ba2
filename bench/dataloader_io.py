"""I/O-bound loading (docs/benchmarking.md): samples/s through the user's DataLoader, crossbow_graph
against plain PyTorch with the same DataLoader.

A Dataset whose ``__getitem__`` sleeps ``--io-ms`` milliseconds (4: a sample read from a slow disk
or the network) and returns a 1 × 28 × 28 image and a label; ``DataLoader(dataset, batch_size=b,
shuffle=True, num_workers=W)`` (W = 4). Plain PyTorch: the usual loop (``for x, y in loader``,
LeNet-5, torch.optim.SGD with momentum 0.9). crossbow_graph: ``compile(LeNet-5, batch_size=b,
devices=G, replicas=m)`` and ``fit(loader)`` on the same DataLoader (its workers load whole
rounds ahead, one item per learner). Both train one epoch of ``--samples`` samples; samples/s is
the epoch's samples over its seconds, the loader's start (forking its workers, the first
batches) included for both: for crossbow_graph the epoch's ``samples_per_s`` (History), which
leaves out the fit's one-off checks before the first round (their seconds are printed too). Plain
PyTorch runs with the default intra-op threads and with one, and the faster counts (as in
bench/throughput.py: with the loader's workers on the same cores, a second OpenMP thread that
spins can halve its rate). The two alternate (A B A B …, ``--reps`` times); the medians and their
ratio are printed (target ≥ 0.8).

Run from the repository root:  python bench/dataloader_io.py [--reps 3] [--samples 2048]
Prints the runs and the ratio; ``--out PATH`` writes them as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import crossbow_graph as cg  # noqa: E402
from crossbow_graph.engine.workers import available_cores  # noqa: E402

__all__ = ["SlowDataset", "plain_rate", "crossbow_rate", "main"]


class SlowDataset(Dataset):
    """``n`` samples ``(image [1, 28, 28], label)``, each read after ``io_s`` seconds of sleep
    (I/O: the process waits, the CPU is free)."""

    def __init__(self, n: int, io_s: float) -> None:
        g = torch.Generator().manual_seed(0)
        self.images = torch.randn(n, 1, 28, 28, generator=g)
        self.labels = torch.randint(0, 10, (n,), generator=g)
        self.io_s = io_s

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        time.sleep(self.io_s)
        return self.images[i].clone(), self.labels[i]


def _loader(ds: Dataset, b: int, workers: int) -> DataLoader:
    return DataLoader(ds, batch_size=b, shuffle=True, num_workers=workers, drop_last=True)


def plain_rate(ds: Dataset, b: int, workers: int, threads: int | None = None) -> float:
    """Plain PyTorch samples/s over one epoch of ``_loader(ds, b, workers)`` (intra-op
    ``threads``, default: torch's)."""
    saved = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        return _plain_epoch(ds, b, workers)
    finally:
        torch.set_num_threads(saved)


def _plain_epoch(ds: Dataset, b: int, workers: int) -> float:
    torch.manual_seed(0)
    model = cg.models.lenet5()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    samples, t0 = 0, time.perf_counter()
    for x, y in _loader(ds, b, workers):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=False)
        loss.backward()
        opt.step()
        samples += len(y)
    return samples / (time.perf_counter() - t0)


def crossbow_rate(ds: Dataset, b: int, workers: int, devices: int, replicas
                  ) -> tuple[float, float, str]:
    """crossbow_graph samples/s over one epoch of the same DataLoader, the fit's seconds before
    its first round, and its layout."""
    torch.manual_seed(0)
    plan = cg.compile(cg.models.lenet5(), (ds.images[:1],), torch.nn.functional.cross_entropy,
                      batch_size=b, devices=devices, replicas=replicas,
                      optimizer=cg.SGD(lr=0.01, momentum=0.9))
    t0 = time.perf_counter()
    hist = plan.fit(_loader(ds, b, workers), 1, progress=False)
    wall = time.perf_counter() - t0
    epoch = hist.epochs[-1]
    return epoch.samples_per_s, wall - epoch.train_seconds, f"{devices} × {plan.replicas_per_device}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=3, help="A/B repetitions")
    parser.add_argument("--samples", type=int, default=2048, help="samples per epoch")
    parser.add_argument("--batch-size", type=int, default=16, help="b (and the DataLoader's)")
    parser.add_argument("--workers", type=int, default=4, help="the DataLoader's num_workers")
    parser.add_argument("--io-ms", type=float, default=4.0, help="sleep per sample, ms")
    parser.add_argument("--devices", type=int, default=1, help="crossbow_graph's devices")
    parser.add_argument("--replicas", default="2", help="replicas per device, or 'auto'")
    parser.add_argument("--out", default=None, help="write the runs as JSON here")
    args = parser.parse_args(argv)
    replicas = args.replicas if args.replicas == "auto" else int(args.replicas)
    ds = SlowDataset(args.samples, args.io_ms / 1000)
    b, w = args.batch_size, args.workers
    print(f"{args.io_ms:g} ms of I/O per sample, DataLoader(batch_size={b}, num_workers={w}), "
          f"{args.samples} samples, {available_cores()} cores, torch {torch.__version__}",
          flush=True)
    ours, plain, runs = [], [], []
    for rep in range(args.reps):  # interleaved A B A B
        rate, before_s, layout = crossbow_rate(ds, b, w, args.devices, replicas)
        ours.append(rate)
        default, one = plain_rate(ds, b, w), plain_rate(ds, b, w, threads=1)
        plain.append(max(default, one))
        runs.append(dict(crossbow_samples_per_s=round(rate), layout=layout,
                         fit_checks_s=round(before_s, 3), plain_samples_per_s=round(plain[-1]),
                         plain_default_threads=round(default), plain_one_thread=round(one)))
        print(f"run {rep + 1}: crossbow_graph ({layout}) {rate:,.0f} samples/s (+{before_s:.2f} s "
              f"of checks before the first round), plain PyTorch {plain[-1]:,.0f} (default "
              f"threads {default:,.0f}, one thread {one:,.0f})", flush=True)
    ratio = statistics.median(ours) / statistics.median(plain)
    bound = w / (args.io_ms / 1000)
    print(f"medians: crossbow_graph {statistics.median(ours):,.0f}, plain PyTorch "
          f"{statistics.median(plain):,.0f} samples/s (the loaders' bound: {bound:,.0f}); "
          f"ratio {ratio:.2f} (target ≥ 0.8)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(io_ms=args.io_ms, batch_size=b, num_workers=w, samples=args.samples,
                           devices=args.devices, replicas=args.replicas, cores=available_cores(),
                           torch=torch.__version__, machine=platform.machine(),
                           load_average=os.getloadavg(), runs=runs, ratio=round(ratio, 3)),
                      f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
