"""The central model's BatchNorm statistics are re-estimated for z's weights before evaluation and
in central_model() (training/batchnorm.py); oracle: torch.optim.swa_utils.update_bn."""

from __future__ import annotations

import functools
import os
import random
import sys

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.optim.swa_utils import update_bn

import crossbow_graph as cg

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
from bn_central import SmallBN, quadrants  # noqa: E402

from _plans import make_plan  # noqa: E402

TOL = dict(rtol=1e-5, atol=1e-6)


# the benchmark's small BatchNorm net and its quadrant images (bench/bn_central.py)
BNNet, blobs = SmallBN, quadrants


# the plans of these tests: BNNet at b = 8 on 2 devices × 2 replicas, inline, SGD(0.1, momentum 0.9)
_plan = functools.partial(make_plan, model=BNNet, batch_size=8, devices=2, replicas=2, executor="inline",
                          optimizer=cg.SGD(lr=0.1, momentum=0.9),
                          sync=cg.SMA(scale_lr=False))  # 0.1: each learner's lr, tuned at 2 × 2


def _bn_stats(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v for k, v in module.state_dict().items() if "running" in k}


def test_central_model_statistics_are_update_bn_on_the_same_batches():
    plan, train = _plan(), blobs(256, 0)
    plan.fit(train, 2, progress=False, metrics_every=None)
    state = plan.states[0]
    zbuf = state.zbuf.clone()
    got = plan.central_model()
    # oracle: z's weights with the replicas' mean statistics, update_bn on the same samples
    plan.bn_recalibration.batches = 0
    want = plan.central_model()
    assert not any(torch.allclose(a, b) for a, b in zip(_bn_stats(got).values(), _bn_stats(want).values()))
    plan.bn_recalibration.batches = 20
    draws = plan.bn_recalibration.draw(8, plan.rounds_done)
    assert len(draws) == 20 and len(torch.cat(draws).unique()) == 160  # 20 disjoint batches of b
    update_bn([train.tensors[0][i] for i in draws], want)
    torch.testing.assert_close(_bn_stats(got), _bn_stats(want), **TOL)
    for name, p in got.named_parameters():
        torch.testing.assert_close(p, want.get_parameter(name), rtol=0, atol=0)
    # training state untouched: zbuf is the replicas' mean; num_batches_tracked the replicas'
    torch.testing.assert_close(state.zbuf, zbuf, rtol=0, atol=0)
    mean_buf = torch.cat([s.buf for s in plan.states]).mean(0)
    torch.testing.assert_close(state.zbuf, mean_buf, **TOL)
    assert got.b1.num_batches_tracked.item() == state.replicas[0].b1.num_batches_tracked.item() == 16


def test_recalibration_makes_z_evaluate_better_at_2x2():
    train, test = blobs(512, 0), blobs(256, 1)
    plan = _plan(executor="auto")  # worker processes on a CPU with 2 cores: one thread each
    hist = plan.fit(train, 8, eval_dataset=test, progress=False, metrics_every=None)
    recalibrated = hist.evals[-1].test_loss  # the default: 20 batches
    assert plan.evaluate(test)[1] == pytest.approx(recalibrated, rel=1e-6)
    plan.bn_recalibration.batches = 0
    mean = plan.evaluate(test)[1]
    # the replicas' mean statistics are far off for z's weights; re-estimated ones are not
    assert recalibrated < 0.25 * mean, (recalibrated, mean)


def test_recalibration_leaves_training_and_rngs_unchanged():
    train, test = blobs(128, 0), blobs(64, 1)
    runs = []
    for batches in (0, 20):
        plan = _plan()
        plan.fit(train, 2, eval_dataset=test, evals_per_epoch=2, progress=False,
                 metrics_every=None, bn_recalibration_batches=batches)
        runs.append(plan)
    for key in ("z", "zbuf", "w", "buf"):
        torch.testing.assert_close(getattr(runs[0].states[1], key), getattr(runs[1].states[1], key),
                                   rtol=0, atol=0)
    torch.manual_seed(3)
    random.seed(3)
    before = (torch.get_rng_state(), random.getstate())
    first = _bn_stats(runs[1].central_model())
    assert torch.equal(torch.get_rng_state(), before[0]) and random.getstate() == before[1]
    again = _bn_stats(runs[1].central_model())  # the same state re-estimates the same
    torch.testing.assert_close(first, again, rtol=0, atol=0)


def test_with_zero_batches_z_has_the_replicas_mean_statistics():
    plan = _plan()
    plan.fit(blobs(128, 0), 1, progress=False, metrics_every=None, bn_recalibration_batches=0)
    names = [n for n, b in plan.template.named_buffers() if b.is_floating_point()]
    sizes = [b.numel() for b in plan.template.buffers() if b.is_floating_point()]
    zbuf = dict(zip(names, plan.states[0].zbuf.split(sizes)))
    for name, value in _bn_stats(plan.central_model()).items():
        torch.testing.assert_close(value.reshape(-1), zbuf[name], rtol=0, atol=0)


class WithCounters(BNNet):
    """BNNet with a float and an integer buffer that its forward counts up."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("seen", torch.zeros(()))
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))

    def forward(self, x):
        self.seen.add_(torch.ones_like(x[:, 0, 0, 0]).sum())
        self.calls.add_(1)
        return super().forward(x)


def test_only_batch_norm_statistics_change_and_k1_keeps_the_replicas_own():
    torch.manual_seed(0)
    plan = cg.compile(WithCounters(), (torch.randn(2, 1, 8, 8),), F.cross_entropy, batch_size=8,
                      devices=2, replicas=2, executor="inline")
    plan.fit(blobs(128, 0), 1, progress=False, metrics_every=None)
    (off,) = [off for name, _, off, _ in plan.states[0].buffers.entries if name == "seen"]
    seen = float(plan.states[0].zbuf[off])  # the replicas' mean count
    z = plan.central_model()
    assert float(z.seen) == seen and int(z.calls) == int(plan.states[0].replicas[0].calls)
    assert seen == 4 * 8.0  # 4 rounds of b = 8 per replica, not + 20 batches
    assert not torch.equal(z.b1.running_mean, plan.states[0].replicas[0].b1.running_mean)
    one = _plan(devices=1, replicas=1)
    one.fit(blobs(64, 0), 1, progress=False, metrics_every=None)
    torch.testing.assert_close(_bn_stats(one.central_model()), _bn_stats(one.states[0].replicas[0]),
                               rtol=0, atol=0)  # z is the replica: plain PyTorch's statistics


@pytest.mark.parametrize("bad", [-1, 1.5, True])
def test_bad_bn_recalibration_batches_is_refused_before_training(bad):
    plan = _plan()
    with pytest.raises(ValueError, match="bn_recalibration_batches"):
        plan.fit(blobs(64, 0), 1, progress=False, bn_recalibration_batches=bad)
    assert plan.rounds_done == 0
