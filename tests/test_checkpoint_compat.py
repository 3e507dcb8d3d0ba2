"""A checkpoint written by an earlier release (checkpoint format 1, tests/data/checkpoint_v1/,
made by its make.py with torch 2.13.0) resumes under the current engine: the weights it holds are
the resumed plan's bit for bit, and the fit goes on as the uninterrupted one did on the machine
that wrote the fixture (float32 rounding apart: another CPU's SIMD kernels or another torch round
differently, by ~3e-8 here, while a fit resumed at the wrong samples or state is off by ~0.2)."""

from __future__ import annotations

import os
import shutil

import torch

import crossbow_graph as cg
from crossbow_graph.training.checkpoint import _by_class, _hook_keys, load_latest
from crossbow_graph.training.hooks import Hook

from test_checkpoint import data, net_plan

class CountRounds(Hook):
    def __init__(self) -> None:
        self.rounds = 0

    def after_round(self, ctx) -> None:
        self.rounds += 1


FIXTURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "checkpoint_v1")


class FirstRound(Hook):
    """Keeps z and the replicas' weights at the start of the first round the fit runs."""

    def __init__(self) -> None:
        self.z = self.w = None

    def before_round(self, ctx) -> None:
        if self.z is None:
            self.z, self.w = ctx.plan.central_weights().clone(), ctx.plan.replica_weights().clone()


def test_an_older_releases_checkpoint_resumes_exactly(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    shutil.copytree(os.path.join(FIXTURE, "ckpt"), ckpt)
    saved = load_latest(ckpt)[1]["plan"]
    assert saved["rounds_done"] == 4
    # the older release stepped at the lr as set and pulled by α = 1/k (k = 4):
    # SMA(alpha=0.25, scale_lr=False) continues its run exactly
    plan = net_plan(sync=cg.SMA(alpha=0.25, central_momentum=0.9, scale_lr=False))
    count, first = CountRounds(), FirstRound()
    plan.fit(data(), 2, progress=False, seed=3, checkpoint_dir=ckpt, resume=True, hooks=[count, first])
    assert plan.rounds_done == 12 and count.rounds == 8  # resumed at round 4, not restarted
    assert torch.equal(first.z, saved["states"][0]["z"])
    assert torch.equal(first.w, torch.cat([s["w"] for s in saved["states"]]))
    expected = torch.load(os.path.join(FIXTURE, "expected.pt"))
    for d, s in enumerate(plan.states):
        for key in ("z", "z_prev", "w", "v", "buf", "zbuf"):
            torch.testing.assert_close(getattr(s, key), expected[f"{d}.{key}"], rtol=1e-4,
                                       atol=1e-6, msg=f"device {d} {key}")


def test_an_older_checkpoints_hook_states_keyed_by_position_are_read_by_class():
    """Older checkpoints keyed a hook's state by its position ("1:LRSchedulerHook"); they are
    read in that order as the class and its place among its class ("LRSchedulerHook#0")."""
    saved = {"2:LRSchedulerHook": "scheduler", "0:Poll": "first", "1:Poll": "second"}
    assert _by_class(saved) == {"Poll#0": "first", "Poll#1": "second",
                                "LRSchedulerHook#0": "scheduler"}
    assert _by_class({"Poll#0": "kept"}) == {"Poll#0": "kept"}

    class Poll(Hook):
        pass

    assert _hook_keys([Poll(), Hook(), Poll()]) == ["Poll#0", "Hook#0", "Poll#1"]
