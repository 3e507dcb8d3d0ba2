"""How long Ctrl-C to the coordinator alone takes to end a fit on the process executor.

Each run starts a fit (an MLP, 1 device × 2 replicas, ``executor="process"``) in a subprocess of
its own session, waits until it has trained a few rounds, sends SIGINT to the coordinator only
(not its process group: the workers get no signal, as with ``kill -INT <pid>``), and measures

- ``close``: the coordinator's shutdown of its worker processes (``ProcessExecutor.close``);
- ``exit``: from the signal until the process has exited (the rest is the interpreter's exit,
  the same as after a fit that ends normally).

    python bench/interrupt_latency.py [--runs 6]
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import textwrap
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = textwrap.dedent("""
    import signal, sys, time
    # Ctrl-C as in a terminal: a shell's background job inherits SIGINT ignored
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.path.insert(0, {root!r})
    import torch
    from torch import nn
    from torch.utils.data import TensorDataset
    import crossbow_graph as cg
    import crossbow_graph.engine.backends.process.executor as workers
    from crossbow_graph.training.hooks import Hook

    close = workers.ProcessExecutor.close
    def timed_close(self):
        start = time.perf_counter()
        close(self)
        print(f"close {{time.perf_counter() - start:.4f}}", file=sys.stderr, flush=True)
    workers.ProcessExecutor.close = timed_close

    class Ready(Hook):
        def after_round(self, ctx):
            if ctx.plan.rounds_done == 3:
                print("ready", flush=True)

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                        nn.Linear(512, 10))
    plan = cg.compile(net, (torch.zeros(2, 64),), nn.functional.cross_entropy, batch_size=64,
                      devices=1, replicas=2, executor="process")
    n = 64 * 2 * 4000
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(n, 64, generator=g), torch.randint(0, 10, (n,), generator=g))
    plan.fit(data, 1, progress=False, hooks=[Ready()], metrics_every=None)
""")


def one_run(delay_s: float) -> tuple[float, float]:
    """(close seconds, exit seconds) of one interrupted fit."""
    proc = subprocess.Popen([sys.executable, "-c", CHILD.format(root=ROOT)], text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    assert proc.stdout.readline().strip() == "ready", proc.communicate()[1][-2000:]
    time.sleep(delay_s)
    start = time.perf_counter()
    os.kill(proc.pid, signal.SIGINT)
    err = proc.communicate(timeout=120)[1]
    exit_s = time.perf_counter() - start
    found = re.search(r"close ([\d.]+)", err)
    return (float(found.group(1)) if found else float("nan")), exit_s


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=6)
    args = parser.parse_args(argv)
    closes, exits = [], []
    for i in range(args.runs):
        close_s, exit_s = one_run(0.1 * (i % 4))
        closes.append(close_s)
        exits.append(exit_s)
        print(f"run {i}: close {close_s:.3f} s, exit {exit_s:.2f} s", flush=True)
    print(f"close: median {statistics.median(closes):.3f} s, max {max(closes):.3f} s; "
          f"exit: median {statistics.median(exits):.2f} s, max {max(exits):.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
