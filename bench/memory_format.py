"""Step time of one learner with convolution weights channels-last against contiguous (the layout
``compile(memory_format="auto")`` picks on a CPU, docs/runtime.md).

Plain PyTorch, one model, synthetic inputs: forward, cross-entropy, backward and an AdamW step,
``--threads`` intra-op threads. Each measurement is a fresh process that runs one layout only
(two layouts in one process disturb each other's oneDNN caches: alternating them there made
contiguous weights look up to 35 % slower than they are); the processes alternate, contiguous then
channels-last, ``--pairs`` times, and the figure is the median over the pairs of the ratio of
their median step times (channels-last ÷ contiguous: below 1 is faster).

    python bench/memory_format.py                    # LeNet-5 at b = 16, 64, 256; ResNet-32 at 32
    python bench/memory_format.py --cases lenet5:16 --pairs 3     # one case, short

Prints a table; writes ``bench/results/memory_format.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(BENCH))

import crossbow_graph as cg  # noqa: E402

SHAPES = {"lenet5": (1, 28, 28), "resnet32": (3, 32, 32)}
CASES = ("lenet5:16", "lenet5:64", "lenet5:256", "resnet32:32")


def _model(name: str, channels_last: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = cg.models.get_model(name).train()
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _block(model, opt, x, y, steps: int) -> float:
    """Mean seconds of ``steps`` training steps."""
    t0 = time.perf_counter()
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return (time.perf_counter() - t0) / steps


def step_ms(name: str, batch: int, channels_last: bool, blocks: int = 5) -> float:
    """In this process: the median over ``blocks`` blocks of one layout's mean step time, ms."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, *SHAPES[name], generator=g)
    y = torch.randint(0, 10, (batch,), generator=g)
    model, opt = _model(name, channels_last)
    steps = 2 if name == "resnet32" else max(4, 1024 // batch)
    _block(model, opt, x, y, 3)  # warm-up
    return 1e3 * statistics.median(_block(model, opt, x, y, steps) for _ in range(blocks))


def _in_process(name: str, batch: int, channels_last: bool, threads: int) -> float:
    out = subprocess.run([sys.executable, __file__, "--one", f"{name}:{batch}:{int(channels_last)}",
                          "--threads", str(threads)], capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def measure(name: str, batch: int, pairs: int, threads: int) -> dict:
    """Median step times (ms) of both layouts and the median ratio over alternating processes."""
    times: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(pairs):
        for cl in (False, True):
            times[cl].append(_in_process(name, batch, cl, threads))
    ratios = [a / b for a, b in zip(times[True], times[False])]
    return dict(model=name, batch=batch, pairs=pairs,
                contiguous_ms=statistics.median(times[False]),
                channels_last_ms=statistics.median(times[True]),
                ratio=statistics.median(ratios), ratio_min=min(ratios), ratio_max=max(ratios))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", nargs="+", default=list(CASES), metavar="MODEL:B")
    p.add_argument("--pairs", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=os.path.join(BENCH, "results", "memory_format.json"))
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # MODEL:B:CL, one process
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.one is not None:
        name, batch, cl = args.one.split(":")
        print(step_ms(name, int(batch), cl == "1"))
        return 0
    rows = []
    print(f"{'model':>9} {'b':>4} {'contiguous ms':>14} {'channels-last ms':>17} {'ratio':>6}  (spread)")
    for case in args.cases:
        name, batch = case.split(":")
        row = measure(name, int(batch), args.pairs, args.threads)
        rows.append(row)
        print(f"{name:>9} {row['batch']:>4} {row['contiguous_ms']:>14.2f} {row['channels_last_ms']:>17.2f} "
              f"{row['ratio']:>6.3f}  ({row['ratio_min']:.2f}–{row['ratio_max']:.2f})", flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(dict(command="python bench/memory_format.py " + " ".join(argv or sys.argv[1:]),
                       threads=args.threads, torch=torch.__version__, rows=rows), f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
