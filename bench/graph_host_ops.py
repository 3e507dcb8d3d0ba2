"""The operations the host issues per replayed CUDA-graph round outside the replay, on the CPU's
simulated graphs (docs/benchmarking.md, "What only a GPU can confirm"): a TinyBN plan (1 device ×
3 learners, b = 4, SGD with momentum) on a device-resident TensorDataset, every aten op of
``Scheduler.run_round`` counted except the replay's own.

    python bench/graph_host_ops.py
"""

from __future__ import annotations

import collections
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import crossbow_graph as cg  # noqa: E402
from crossbow_graph.engine.backends.graphs import capture as G  # noqa: E402
from crossbow_graph.testing.capture_check import SimulatedGraphs  # noqa: E402
from crossbow_graph.testing.race_check import RaceRecorder  # noqa: E402
from _plans import TinyBN, make_plan, tiny_data  # noqa: E402


class OpCount(TorchDispatchMode):
    """Counts aten ops while ``counting`` (the replay pauses it)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter = collections.Counter()
        self.counting = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.counting:
            self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def main() -> None:
    count, ops = OpCount(), SimulatedGraphs()
    replay = ops.replay

    def uncounted_replay(graph):
        count.counting = False
        try:
            replay(graph)
        finally:
            count.counting = True
    ops.replay = uncounted_replay
    plan = make_plan(TinyBN, devices=1, replicas=3, executor="inline", kernel_backend="torch",
                     optimizer=cg.SGD(lr=0.05, momentum=0.9))
    sched = plan.rounds
    sched.round_graph = G.RoundGraph(ops)
    rounds = []
    run_round = sched.run_round

    def counted_round(*args, **kwargs):
        count.ops.clear()
        count.counting = True
        try:
            run_round(*args, **kwargs)
        finally:
            count.counting = False
        rounds.append((sched.round_graph.replays, dict(count.ops)))
    sched.run_round = counted_round
    with RaceRecorder().attach(sched), count:
        plan.fit(tiny_data(96 * 4), 1, shuffle=True, progress=False, metrics_every=None,
                 data_on_device=True)
    replayed = [o for (n, o), (before, _) in zip(rounds[1:], rounds) if n > before]
    views = {"aten.slice.Tensor", "aten.view.default", "aten.unbind.int", "aten.nonzero.default"}
    last = replayed[-1]
    print(f"{len(replayed)} replayed rounds; the last one's ops outside the replay: {last}")
    print("device operations (views, and the host's nonzero on the host copy of the mask, left "
          f"out): {sum(v for k, v in last.items() if k not in views and 'empty' not in k)}")


if __name__ == "__main__":
    main()
