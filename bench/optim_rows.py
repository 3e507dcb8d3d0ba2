"""Row optimizers: one instance over a device's stacked rows against one per replica, and the
torch.optim implementations of one replica's row.

    python bench/optim_rows.py [--replicas 8] [--repeats 200]

Times ``OptimizerRows.step`` (engine/state/optim.py) for all m rows of one device of a LeNet-5 plan, one
thread, for AdamW and SGD with momentum 0.9 in two params groups (so SGD takes the row path too),
interleaving the two layouts; prints milliseconds per step (median of 5 blocks) and the ratio.
Then AdamW on one replica's row (k = 1) as each implementation: fused and foreach unset (torch's
fused kernel), ``foreach=True`` and ``foreach=False`` (the single-tensor loop, torch's CPU
default), interleaved the same way.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import crossbow_graph as cg
from crossbow_graph.engine.state.optim import OptimizerRows


def _plan(make, m: int):
    model = cg.models.lenet5()
    x = torch.randn(1, 1, 28, 28)
    return cg.compile(model, (x,), torch.nn.functional.cross_entropy, batch_size=8, devices=1,
                      replicas=m, optimizer=make(model), executor="inline")


def _time(plan, stacked: bool, repeats: int) -> float:
    state = plan.states[0]
    plan.settings.optimizer.stacked = stacked
    state.optim_rows = OptimizerRows(plan.settings.optimizer, state)
    state.g.normal_()
    state.optim_rows.step(state, 0, state.m)  # the fresh step, then timed steps
    t = time.perf_counter()
    for _ in range(repeats):
        state.optim_rows.step(state, 0, state.m)
    return (time.perf_counter() - t) / repeats * 1e3


def one_row(repeats: int) -> None:
    """AdamW on a k = 1 plan's row, per implementation: milliseconds per step."""
    flags = {"unset (fused)": {}, "foreach=True": {"foreach": True},
             "foreach=False (CPU default)": {"foreach": False}}
    plans = {name: _plan(lambda m, kw=kw: torch.optim.AdamW(m.parameters(), lr=1e-3, **kw), 1)
             for name, kw in flags.items()}
    runs: dict[str, list[float]] = {name: [] for name in flags}
    for _ in range(5):
        for name, plan in plans.items():
            runs[name].append(_time(plan, True, repeats))
    for name, ms in runs.items():
        print(f"AdamW, one row, {name}: {statistics.median(ms):.3f} ms per step "
              f"(min {min(ms):.3f})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replicas", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=200)
    args = ap.parse_args()
    torch.set_num_threads(1)
    makers = {
        "AdamW": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3),
        "SGD momentum, 2 groups": lambda m: torch.optim.SGD(
            [{"params": list(m.parameters())[:2], "lr": 0.02},
             {"params": list(m.parameters())[2:]}], lr=0.01, momentum=0.9),
    }
    for name, make in makers.items():
        plan = _plan(make, args.replicas)
        runs = {True: [], False: []}
        for _ in range(5):
            for stacked in (True, False):
                runs[stacked].append(_time(plan, stacked, args.repeats))
        a, b = statistics.median(runs[True]), statistics.median(runs[False])
        print(f"{name}: m={args.replicas}, P={plan.num_parameters:,}: stacked {a:.2f} ms, "
              f"per replica {b:.2f} ms per step ({b / a:.2f}×)")
    one_row(args.repeats)


if __name__ == "__main__":
    main()
