"""I/O-bound loading (docs/benchmarking.md): samples/s through the user's DataLoader, crossbow_graph
against plain PyTorch with the same DataLoader.

A Dataset whose ``__getitem__`` sleeps ``--io-ms`` milliseconds (4: a sample read from a slow disk
or the network) and returns a 1 × 28 × 28 image and a label; ``DataLoader(dataset, batch_size=b,
shuffle=True, num_workers=W)`` (W = 4). Plain PyTorch: the usual loop (``for x, y in loader``,
LeNet-5, torch.optim.SGD with momentum 0.9). crossbow_graph: ``compile(LeNet-5, batch_size=b,
devices=G, replicas=m)`` and ``fit(loader, epochs)`` on the same DataLoader (its workers load the
plan's rounds ahead, one item per learner). Both train ``--epochs`` epochs of ``--samples``
samples; an epoch's samples/s is its samples over its seconds, the loader's start (forking its
workers, the first batches) included for both (for crossbow_graph the History's
``samples_per_s``). The measure is the last epoch's rate; the first epoch's is printed too (for
crossbow_graph it also holds the fit's one-off start: forking the learner processes, measuring
the convolution library on b samples read outside the loader). Plain PyTorch runs with each
``--plain-threads`` setting (default: torch's threads and one) and the faster counts, as in
bench/throughput.py: with the loader's workers on the same cores, a second OpenMP thread that
spins can cut its rate several times over. The two alternate (A B A B …, ``--reps`` times); the
medians and their ratio are printed (target ≥ 0.8).

Run from the repository root:  python bench/dataloader_io.py [--reps 3] [--plain-threads 1]
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
import warnings

import torch
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import crossbow_graph as cg  # noqa: E402
from crossbow_graph.engine.learning.threads import available_cores  # noqa: E402

__all__ = ["SlowDataset", "plain_rates", "crossbow_rates", "main"]


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


def plain_rates(ds: Dataset, b: int, workers: int, epochs: int,
                threads: int | None = None) -> list[float]:
    """Plain PyTorch samples/s of each of ``epochs`` epochs of ``_loader(ds, b, workers)``
    (intra-op ``threads``; None: torch's default)."""
    saved = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        torch.manual_seed(0)
        model = cg.models.lenet5()
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        loader, rates = _loader(ds, b, workers), []
        for _ in range(epochs):
            samples, t0 = 0, time.perf_counter()
            for x, y in loader:
                loss = torch.nn.functional.cross_entropy(model(x), y)
                opt.zero_grad(set_to_none=False)
                loss.backward()
                opt.step()
                samples += len(y)
            rates.append(samples / (time.perf_counter() - t0))
        return rates
    finally:
        torch.set_num_threads(saved)


def crossbow_rates(ds: Dataset, b: int, workers: int, epochs: int, devices: int, replicas
                   ) -> tuple[list[float], str]:
    """crossbow_graph samples/s of each epoch through the same DataLoader, and its layout."""
    torch.manual_seed(0)
    plan = cg.compile(cg.models.lenet5(), (ds.images[:1],), torch.nn.functional.cross_entropy,
                      batch_size=b, devices=devices, replicas=replicas,
                      optimizer=cg.SGD(lr=0.01, momentum=0.9))
    hist = plan.fit(_loader(ds, b, workers), epochs, progress=False)
    return [e.samples_per_s for e in hist.epochs], f"{devices} × {plan.replicas_per_device}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=3, help="A/B repetitions")
    parser.add_argument("--samples", type=int, default=2048, help="samples per epoch")
    parser.add_argument("--epochs", type=int, default=2, help="epochs per run (the last counts)")
    parser.add_argument("--batch-size", type=int, default=16, help="b (and the DataLoader's)")
    parser.add_argument("--workers", type=int, default=4, help="the DataLoader's num_workers")
    parser.add_argument("--io-ms", type=float, default=4.0, help="sleep per sample, ms")
    parser.add_argument("--devices", type=int, default=1, help="crossbow_graph's devices")
    parser.add_argument("--replicas", default="2", help="replicas per device, or 'auto'")
    parser.add_argument("--plain-threads", default="default,1",
                        help="plain PyTorch's intra-op threads to try, the faster counts")
    parser.add_argument("--out", default=None, help="write the runs as JSON here")
    args = parser.parse_args(argv)
    # more loader workers than cores is the point here (they wait on I/O): not worth a warning
    warnings.filterwarnings("ignore", message="This DataLoader will create")
    threads = [None if t == "default" else int(t) for t in args.plain_threads.split(",")]
    replicas = args.replicas if args.replicas == "auto" else int(args.replicas)
    ds = SlowDataset(args.samples, args.io_ms / 1000)
    b, w, epochs = args.batch_size, args.workers, args.epochs
    print(f"{args.io_ms:g} ms of I/O per sample, DataLoader(batch_size={b}, num_workers={w}), "
          f"{epochs} epochs of {args.samples} samples, {available_cores()} cores, torch "
          f"{torch.__version__}", flush=True)
    ours, plain, runs = [], [], []
    for rep in range(args.reps):  # interleaved A B A B
        rates, layout = crossbow_rates(ds, b, w, epochs, args.devices, replicas)
        tried = {t or "default": plain_rates(ds, b, w, epochs, threads=t) for t in threads}
        best = max(tried, key=lambda t: tried[t][-1])
        ours.append(rates[-1])
        plain.append(tried[best][-1])
        runs.append(dict(layout=layout, crossbow_epochs=[round(r) for r in rates],
                         plain_epochs={str(t): [round(r) for r in x] for t, x in tried.items()}))
        shown = ", ".join(f"{t} threads {x[-1]:,.0f}" for t, x in tried.items())
        print(f"run {rep + 1}: last epoch: crossbow_graph ({layout}) {rates[-1]:,.0f} samples/s, "
              f"plain PyTorch {plain[-1]:,.0f} ({shown}); first epoch: {rates[0]:,.0f} and "
              f"{tried[best][0]:,.0f}", flush=True)
    ratio = statistics.median(ours) / statistics.median(plain)
    print(f"medians of the last epochs: crossbow_graph {statistics.median(ours):,.0f}, plain "
          f"PyTorch {statistics.median(plain):,.0f} samples/s (the loaders' bound: "
          f"{w / (args.io_ms / 1000):,.0f}); ratio {ratio:.2f} (target ≥ 0.8)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(io_ms=args.io_ms, batch_size=b, num_workers=w, samples=args.samples,
                           epochs=epochs, devices=args.devices, replicas=args.replicas,
                           plain_threads=args.plain_threads, cores=available_cores(),
                           torch=torch.__version__, machine=platform.machine(),
                           load_average=os.getloadavg(), runs=runs, ratio=round(ratio, 3)),
                      f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
