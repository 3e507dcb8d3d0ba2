"""A single-process plan on a busy host (docs/runtime.md, Threads on a busy host): the seconds of
one epoch with torch's default intra-op threads against ``fit(cpu_threads="auto")`` (threads from
the free cores), and the plain loop with torch's threads and with one, while ``--busy`` neighbour
processes (``nice -n --nice python -c 'while True: pass'``) keep the cores busy.

The job: LeNet-5 on the first ``--samples`` MNIST training images, b = 256, AdamW lr 0.008, one
epoch, one learner on one CPU device (the CLI's default layout; ``compile(devices=1,
replicas=1)``, the inline executor), no evaluation. The plain loop: the same model, optimizer and
batches (``DataLoader(shuffle=True)``), ``for x, y in loader: step``. Every run is a fresh
process (torch's thread pool starts clean) and the configurations alternate (A B C D A B C D …,
``--reps`` times); medians are printed.

Run from the repository root:  python bench/busy_host_threads.py [--busy 2] [--nice 10] [--reps 3]
``--out PATH`` writes the runs as JSON (bench/results/busy_host_threads.json).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = ("plan-torch-threads", "plan-auto", "plain-torch-threads", "plain-1-thread")

__all__ = ["CONFIGS", "run_child", "main"]


def _job(samples: int):
    """(model, optimizer, dataset) of the job, seeded."""
    import torch
    import crossbow_graph as cg

    torch.manual_seed(0)
    train = cg.datasets.mnist(train=True)
    data = torch.utils.data.TensorDataset(train.images[:samples], train.labels[:samples])
    model = cg.models.lenet5()
    return model, torch.optim.AdamW(model.parameters(), lr=0.008), data


def run_child(config: str, samples: int) -> dict:
    """One run of ``config`` in this process: its epoch's training seconds and threads."""
    import torch
    import torch.nn.functional as F
    import crossbow_graph as cg

    model, opt, data = _job(samples)
    if config.startswith("plan"):
        plan = cg.compile(model, (data[0][0].unsqueeze(0),), F.cross_entropy, batch_size=256,
                          devices=1, replicas=1, optimizer=opt)
        history = plan.fit(data, 1, progress=False, metrics_every=None,
                           cpu_threads=None if config == "plan-torch-threads" else "auto")
        return {"seconds": history.epochs[-1].train_seconds, "threads": history.cpu_threads,
                "free_cores": history.free_cores}
    if config == "plain-1-thread":
        torch.set_num_threads(1)
    loader = torch.utils.data.DataLoader(data, batch_size=256, shuffle=True)
    start = time.perf_counter()
    for x, y in loader:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return {"seconds": time.perf_counter() - start, "threads": torch.get_num_threads(),
            "free_cores": None}


def _neighbours(busy: int, nice: int) -> list[subprocess.Popen]:
    return [subprocess.Popen(["nice", "-n", str(nice), sys.executable, "-c", "while True: pass"])
            for _ in range(busy)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--busy", type=int, default=2, help="busy neighbour processes")
    parser.add_argument("--nice", type=int, default=10, help="their niceness (0: none)")
    parser.add_argument("--samples", type=int, default=6000)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--out", help="write the runs as JSON here")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print("RESULT", json.dumps(run_child(args.child, args.samples)), flush=True)
        return
    configs = args.configs.split(",")
    runs: dict[str, list[dict]] = {c: [] for c in configs}
    load_before = os.getloadavg()
    neighbours = _neighbours(args.busy, args.nice)
    try:
        time.sleep(2.0)  # the neighbours are running
        for rep in range(args.reps):
            for config in configs:
                proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", config,
                                       "--samples", str(args.samples)], cwd=ROOT, text=True,
                                      capture_output=True, env={**os.environ, "PYTHONPATH": ROOT})
                line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
                if not line:
                    raise SystemExit(f"{config} failed:\n{proc.stderr[-3000:]}")
                result = json.loads(line[0][len("RESULT "):])
                runs[config].append(result)
                print(f"rep {rep + 1} {config}: {result['seconds']:.1f} s, {result['threads']} "
                      f"thread(s), free cores {result['free_cores']}", flush=True)
    finally:
        for proc in neighbours:
            proc.kill()
            proc.wait()
    medians = {c: statistics.median(r["seconds"] for r in runs[c]) for c in configs}
    for config in configs:
        print(f"{config}: median {medians[config]:.1f} s over {args.reps} runs")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"busy": args.busy, "nice": args.nice, "samples": args.samples,
                       "cores": len(os.sched_getaffinity(0)), "load_before": load_before,
                       "host": f"{platform.machine()}, {os.cpu_count()} CPUs",
                       "when": time.strftime("%Y-%m-%d %H:%M"), "runs": runs,
                       "median_seconds": medians}, f, indent=2)


if __name__ == "__main__":
    main()
