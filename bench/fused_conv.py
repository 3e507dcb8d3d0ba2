"""Fused against per-replica learners on a conv net: where the fused step's time goes.

``python bench/fused_conv.py [--quick] [--out bench/results/fused_conv.json]`` measures, on a
ResNet-18 laid out as torchvision defines it (BasicBlocks [2, 2, 2, 2], 7×7 stem, max-pool; 10
classes) on 3×32×32 inputs:

1. **one learner group's step** (forward and backward of n = 2 replicas at b = 16, one thread, as a
   worker process runs it), through ``engine.learners.learn_group``: ``per_replica``, ``fused``
   (engine/learning/fused.py: one autograd leaf per parameter tensor), and ``fused_one_leaf``, the fused
   step with the whole ``[n, P]`` block as one leaf and every tensor a slice of it. Per step:
   seconds (best of the repetitions), user and system CPU seconds and minor page faults
   (``resource.getrusage``).
2. **a fit** of 2 devices × 2 replicas at b = 16 on the process executor, each learner mode:
   samples/s and the CPU seconds of every process (user, system).
3. with ``--tune``: a fit with ``replicas="auto"``, and the auto-tuner's decisions (it keeps the
   faster learner mode).

The one-leaf step is slow because the backward of each slice ``w[:, a:b]`` is a zero-filled
``[n, P]`` tensor with the slice's gradient in it, summed into the leaf's gradient: O(tensors · P)
memory traffic per step (62 tensors × 2 × 11.2 M floats on this ResNet-18), fresh large
allocations that the kernel maps and zero-fills page by page (the system time). docs/runtime.md
quotes the numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time

import torch
from torch import nn
from torch.func import functional_call
from torch.nn import functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import crossbow_graph as cg  # noqa: E402
from crossbow_graph.engine.data.inputs import split_inputs  # noqa: E402
from crossbow_graph.engine.learning.learners import learn_group  # noqa: E402

__all__ = ["ResNet18", "measure_step", "measure_fit", "main"]


class _Basic(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                           if stride != 1 or cin != cout else nn.Identity())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.downsample(x))


class ResNet18(nn.Module):
    """torchvision's ResNet-18 layout (11.2 M parameters at 10 classes); x ``[N, 3, H, W]``."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        blocks, cin = [], 64
        for cout, stride in ((64, 1), (64, 1), (128, 2), (128, 1), (256, 2), (256, 1), (512, 2), (512, 1)):
            blocks.append(_Basic(cin, cout, stride))
            cin = cout
        self.layers = nn.Sequential(*blocks)
        self.fc = nn.Linear(512, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(F.relu(self.bn1(self.conv1(x))))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(self.layers(x), 1), 1))


def _one_leaf_step(fused, state, r0: int, r1: int, batch) -> None:
    """The fused step with ``w[r0:r1] [n, P]`` as one autograd leaf (the layout to avoid)."""
    n, b = r1 - r0, fused.batch_size
    w = state.w[r0:r1].detach().requires_grad_(True)
    params = {name: w[:, off:off + k].view(n, *shape) for name, shape, off, k in state.params.entries}
    buffers = {name: state.buf[r0:r1, off:off + k].reshape(n, *shape).clone()
               for name, shape, off, k in state.buffers.entries}
    for name, t in state.replicas[r0].named_buffers():
        if not t.is_floating_point():
            buffers[name] = torch.stack([state.replicas[r].get_buffer(name) for r in range(r0, r1)])
    args, _, target = split_inputs(batch)
    x, y = args[0].view(n, b, *args[0].shape[1:]), target.view(n, b)

    def one(p, bufs, xx, yy):
        return F.cross_entropy(functional_call(fused.module, (p, bufs), (xx,)), yy)

    torch.func.vmap(one, randomness="different")(params, buffers, x, y).sum().backward()
    state.g[r0:r1].copy_(w.grad)


def _usage() -> tuple[float, float, int]:
    """(user s, system s, minor faults) of this process and its waited-for children."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return (own.ru_utime + kids.ru_utime, own.ru_stime + kids.ru_stime, own.ru_minflt + kids.ru_minflt)


def measure_step(variant: str, *, n: int = 2, b: int = 16, reps: int = 3) -> dict:
    """One learner group's step (n replicas × b), one thread: seconds, CPU seconds, faults."""
    torch.manual_seed(0)
    mode = "per_replica" if variant == "per_replica" else "fused"
    plan = cg.compile(ResNet18(), (torch.randn(2, 3, 32, 32),), F.cross_entropy, batch_size=b,
                      replicas=n, learner_mode=mode, executor="inline")
    state, fused = plan.states[0], plan.rounds.ctx.fused[0]
    batch = [torch.randn(n * b, 3, 32, 32), torch.randint(0, 10, (n * b,))]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        def step():
            if variant == "fused_one_leaf":
                state.g.zero_()
                _one_leaf_step(fused, state, 0, n, batch)
            else:
                learn_group(state, 0, n, batch, F.cross_entropy, b, mode, fused)

        step()  # warm-up
        best, u0 = float("inf"), _usage()
        for _ in range(reps):
            t0 = time.perf_counter()
            step()
            best = min(best, time.perf_counter() - t0)
        u1 = _usage()
    finally:
        torch.set_num_threads(threads)
    return {"variant": variant, "replicas": n, "batch_size": b, "step_s": best,
            "samples_per_s": n * b / best, "user_s_per_step": (u1[0] - u0[0]) / reps,
            "system_s_per_step": (u1[1] - u0[1]) / reps, "minor_faults_per_step": (u1[2] - u0[2]) // reps}


def measure_fit(mode: str, *, devices: int = 2, replicas: int | str = 2, b: int = 16,
                rounds: int = 12) -> dict:
    """A fit on the process executor: samples/s, CPU seconds of every process, tuner decisions."""
    torch.manual_seed(0)
    k = devices * (replicas if isinstance(replicas, int) else 4)
    n = k * b * rounds
    data = torch.utils.data.TensorDataset(torch.randn(n, 3, 32, 32), torch.randint(0, 10, (n,)))
    plan = cg.compile(ResNet18(), (torch.randn(2, 3, 32, 32),), F.cross_entropy, batch_size=b,
                      devices=devices, replicas=replicas, learner_mode=mode,
                      autotune=cg.AutoTune(max_replicas=4, window_s=3.0, warmup_s=1.0))
    u0, t0 = _usage(), time.perf_counter()
    hist = plan.fit(data, 1, progress=False, metrics_every=None)
    wall, u1 = time.perf_counter() - t0, _usage()
    return {"learner_mode": mode, "devices": devices, "replicas": replicas, "batch_size": b,
            "samples_per_s": hist.epochs[-1].samples_per_s, "wall_s": wall,
            "user_s": u1[0] - u0[0], "system_s": u1[1] - u0[1],
            "final": [plan.replicas_per_device, plan.learner_mode],
            "autotune": [[d.action, d.replicas_per_device, d.learner_mode, round(d.samples_per_s, 1)]
                         for d in hist.autotune]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the step measurements only")
    parser.add_argument("--tune", action="store_true", help="also a fit with replicas='auto'")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    results = {"torch": torch.__version__, "cpus": os.cpu_count(),
               "load_average_1min": os.getloadavg()[0], "steps": [], "fits": []}
    for variant in ("per_replica", "fused", "fused_one_leaf"):
        row = measure_step(variant, reps=1 if variant == "fused_one_leaf" else 3)
        results["steps"].append(row)
        print(json.dumps(row), flush=True)
    if not args.quick:
        for mode in ("per_replica", "fused"):
            row = measure_fit(mode)
            results["fits"].append(row)
            print(json.dumps(row), flush=True)
    if args.tune:
        row = measure_fit("per_replica", replicas="auto", rounds=60)
        results["fits"].append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
