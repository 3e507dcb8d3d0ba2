"""Aten ops (kernels on a GPU) per fused learner step, by kind, counted with a dispatch mode.

``python bench/fused_ops.py [--m 4] [--b 8] [--models resnet32 lenet5] [--memory-format auto]
[--out FILE]`` builds an inline plan of each zoo model with m fused replicas on the CPU, runs
one warm-up step and then counts, with a ``TorchDispatchMode``, every aten op of one learner
group's step (``engine.learners.learn_group`` in fused mode: the buffers gathered, the vmapped
forward and backward, the gradients into ``g``, the buffers written back), which is the learner
part of a fused round. It prints the total, the kernels (ops that are not views) and the kernels
by kind, the memory-moving ones (copy_, clone, zero_, stack, …) first. To compare two commits,
run this file in a checkout of each (``git worktree add``) with ``PYTHONPATH`` set to it.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys

import torch
from torch.nn import functional as F
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import crossbow_graph as cg  # noqa: E402
from crossbow_graph.engine.learning.learners import learn_group  # noqa: E402
from crossbow_graph.models import get_model, input_shape  # noqa: E402

__all__ = ["MOVING", "OpCounter", "count_step", "main"]

#: Kernels that only move or fill memory (or count batches): the avoidable kind on a fused step's
#: critical path.
MOVING = ("copy_", "clone", "zero_", "fill_", "stack", "cat", "index_select", "_to_copy", "add_")


class OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched while active, by overload packet name (``copy_``, …);
    ``views`` holds the names of those that only make views (no kernel)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()
        self.views: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.counts[name] += 1
        if func.is_view or name in ("detach", "_unsafe_view"):  # no kernel either
            self.views.add(name)
        return func(*args, **(kwargs or {}))


def count_step(model: str, m: int, b: int, memory_format: str = "auto"
               ) -> tuple[collections.Counter[str], set[str]]:
    """Ops by name of one fused ``learn_group`` step of zoo ``model``, m replicas × b samples,
    convolution weights in ``memory_format`` (compile's option), and the names of the view
    ops among them."""
    torch.manual_seed(0)
    shape = input_shape(model)
    plan = cg.compile(get_model(model), (torch.randn(2, *shape),), F.cross_entropy, batch_size=b,
                      replicas=m, learner_mode="fused", executor="inline",
                      memory_format=memory_format)
    state, fused = plan.states[0], plan.rounds.ctx.fused[0]
    batch = [torch.randn(m * b, *shape), torch.randint(0, 10, (m * b,))]
    learn_group(state, 0, m, batch, F.cross_entropy, b, "fused", fused)  # warm-up
    with OpCounter() as counter:
        learn_group(state, 0, m, batch, F.cross_entropy, b, "fused", fused)
    return counter.counts, counter.views


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--m", type=int, default=4)
    parser.add_argument("--b", type=int, default=8)
    parser.add_argument("--models", nargs="+", default=["resnet32", "lenet5"])
    parser.add_argument("--memory-format", default="auto",
                        help="compile's memory_format: auto (channels-last convolution weights on "
                        "the CPU) or contiguous (what CUDA devices take under auto)")
    parser.add_argument("--out", default=None, help="write the counts as JSON here")
    args = parser.parse_args(argv)
    results = {}
    for model in args.models:
        counts, views = count_step(model, args.m, args.b, args.memory_format)
        kernels = {k: v for k, v in counts.most_common() if k not in views}
        moving = {k: counts[k] for k in MOVING if counts[k]}
        others = {k: v for k, v in kernels.items() if k not in MOVING}
        results[model] = {"m": args.m, "b": args.b, "memory_format": args.memory_format, "ops": sum(counts.values()),
                          "kernels": sum(kernels.values()), "moving": sum(moving.values()),
                          "moving_by_kind": moving, "other_kernels_by_kind": others,
                          "views_by_kind": {k: counts[k] for k in sorted(views)}}
        print(f"{model} m={args.m} b={args.b} {args.memory_format}: {sum(counts.values())} ops per fused step, "
              f"{sum(kernels.values())} of them kernels (not views), {sum(moving.values())} "
              "memory-moving")
        print("  moving: " + ", ".join(f"{k} {v}" for k, v in moving.items()))
        print("  other kernels: " + ", ".join(f"{k} {v}" for k, v in others.items()))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    main()
