"""Gradient clipping per learner, ``fit(max_grad_norm=...)`` (engine/clipping.py): eager PyTorch
with ``torch.nn.utils.clip_grad_norm_`` before each optimizer step is the oracle, in every
execution path (learner modes, executors, simulated CUDA streams and graphs, float16 loss
scales, SMA, S-SGD, DiLoCo). Every oracle asserts that the clip binds (the unclipped norm
exceeds ``max_grad_norm``), so a run that ignored it would differ."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

import crossbow_graph as cg
from crossbow_graph.engine import graphs as G
from crossbow_graph.engine.capture_check import SimulatedGraphs
from crossbow_graph.engine.clipping import clip_rows
from crossbow_graph.engine.race_check import RaceRecorder
from crossbow_graph.training.hooks import Hook

from _plans import TinyNet, make_plan, tiny_data
from _reference import batches_of, eager_steps, flat, reference_diloco, reference_sma
from test_diloco import NESTEROV, Small, _data

pytestmark = pytest.mark.filterwarnings("ignore::crossbow_graph.errors.TraceWarning")

N, B = 256, 8
RTOL, ATOL = 1e-5, 1e-6  # float32: the row's norm in one reduction, torch's per tensor


class _EveryRound(Hook):
    """z after every round."""

    mutates_replicas = False

    def __init__(self) -> None:
        self.z: list[torch.Tensor] = []

    def after_round(self, ctx) -> None:
        self.z.append(ctx.plan.central_weights())


def _net() -> nn.Module:
    """No bias before a norm layer: its gradient is rounding noise, which Adam makes a step."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3))


def _sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)


def _adamw_groups(model, **implementation):
    return torch.optim.AdamW([
        {"params": model[0].parameters(), "lr": 3e-2},
        {"params": list(model[2].parameters()) + list(model[4].parameters()), "lr": 1e-2,
         "weight_decay": 0.1}], lr=1e-2, betas=(0.8, 0.99), **implementation)


def _fused_adamw_groups(model):
    """The eager twin of ``_adamw_groups`` at k = 1: one replica's row runs torch's fused AdamW
    where fused and foreach are unset (docs/optimizers.md, "Which implementation")."""
    return _adamw_groups(model, fused=True)


@pytest.mark.parametrize("mode", ["per_replica", "fused"])
@pytest.mark.parametrize("make_opt,eager_opt", [(_sgd, _sgd), (_adamw_groups, _fused_adamw_groups)],
                         ids=["sgd", "adamw-groups"])
def test_one_learner_equals_eager_clip_grad_norm_step_for_step(make_opt, eager_opt, mode):
    """k = 1 with SGD (the SGD kernels) and AdamW with two param groups (row optimizers): z after
    every round equals eager PyTorch's weights after backward, clip_grad_norm_(…, 0.1), step."""
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(N, 12, generator=g), torch.randint(0, 3, (N,), generator=g))
    model, max_norm, rounds = _net(), 0.1, N // B
    expected, norms = eager_steps(copy.deepcopy(model), eager_opt, batches_of(data, B)[:rounds],
                                  max_grad_norm=max_norm)
    assert min(norms) > max_norm  # the clip binds at every step
    plan = cg.compile(model, (data.tensors[0][:B],), F.cross_entropy, batch_size=B, devices=1,
                      replicas=1, learner_mode=mode, optimizer=make_opt(model), executor="inline")
    rec = _EveryRound()
    history = plan.fit(data, shuffle=False, progress=False, metrics_every=None, hooks=[rec],
                       max_grad_norm=max_norm)
    assert len(rec.z) == rounds and history.max_grad_norm == max_norm
    for t, (got, want) in enumerate(zip(rec.z, expected)):
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL, msg=lambda m: f"round {t}: {m}")


@pytest.mark.parametrize("executor,mode", [("inline", "per_replica"), ("inline", "fused"),
                                           ("process", "per_replica"), ("process", "fused")])
def test_two_learners_clip_each_gradient_in_every_mode_and_executor(executor, mode):
    """k = 2 SMA (1 device × 2 replicas, SGD with momentum): each learner's gradient clipped
    before its step, per_replica and fused, inline and in worker processes, equals the
    hand-written SMA with clip_grad_norm_ per learner, and differs from it unclipped."""
    data, max_norm = tiny_data(96), 0.5
    plan = make_plan(devices=1, replicas=2, executor=executor, learner_mode=mode)
    assert plan.scheduler.resolved_executor() == executor
    torch.manual_seed(0)
    model = TinyNet()
    model.zero_grad()
    F.cross_entropy(model(data.tensors[0][:4]), data.tensors[1][:4]).backward()
    assert float(nn.utils.clip_grad_norm_(model.parameters(), 1e9)) > max_norm  # it binds
    plan.fit(data, 1, shuffle=False, progress=False, metrics_every=None, max_grad_norm=max_norm)
    torch.manual_seed(0)
    ref = dict(ks=[2] * 12, lr=0.05, momentum=0.9)
    z = flat(reference_sma(TinyNet(), batches_of(data, 4), max_grad_norm=max_norm, **ref)[0])
    torch.testing.assert_close(plan.central_weights(), z, rtol=RTOL, atol=ATOL)
    torch.manual_seed(0)
    unclipped = flat(reference_sma(TinyNet(), batches_of(data, 4), **ref)[0])
    assert not torch.allclose(z, unclipped, rtol=1e-3, atol=1e-4)


def test_ssgd_clips_each_learners_gradient_before_the_average():
    """S-SGD, k = 4 (2 devices × 2): ḡ is the mean of the learners' clipped gradients, then one
    SGD step, as clip_grad_norm_ on each learner's batch and torch.optim.SGD on the mean."""
    k, b, rounds, max_norm = 4, 4, 5, 0.5
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(k * b * rounds, 12, generator=g), torch.randint(0, 3, (k * b * rounds,), generator=g)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 3))
    reference = copy.deepcopy(model)
    plan = cg.compile(model, (x[:1],), F.cross_entropy, batch_size=b, devices=2, replicas=2,
                      optimizer=cg.SGD(lr=0.1, momentum=0.9), sync=cg.SSGD())
    plan.fit(TensorDataset(x, y), 1, shuffle=False, progress=False, max_grad_norm=max_norm)
    sgd = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    params, norms = list(reference.parameters()), []
    for t in range(rounds):
        total = [torch.zeros_like(p) for p in params]
        for j in range(k):
            sl = slice((t * k + j) * b, (t * k + j + 1) * b)
            reference.zero_grad()
            F.cross_entropy(reference(x[sl]), y[sl]).backward()
            norms.append(float(nn.utils.clip_grad_norm_(params, max_norm)))
            total = [s + p.grad for s, p in zip(total, params)]
        for p, s in zip(params, total):
            p.grad = s / k
        sgd.step()
    assert min(norms) > max_norm
    torch.testing.assert_close(plan.central_weights(), flat(params), rtol=RTOL, atol=ATOL)


def test_diloco_learners_clip_before_their_inner_steps():
    """DiLoCo, k = 4 (2 × 2), H = 3, inner AdamW: equals eager DiLoCo with clip_grad_norm_
    before every inner step."""
    k, b, rounds, H, max_norm = 4, 4, 9, 3, 0.3
    torch.manual_seed(0)
    model, data = Small(), _data(k * b * rounds)
    inner = lambda p: torch.optim.AdamW(p, lr=3e-3, weight_decay=0.01)  # noqa: E731
    plan = cg.compile(model, (torch.zeros(1, 1, 8, 8),), F.cross_entropy, batch_size=b,
                      devices=2, replicas=2, optimizer=inner(model.parameters()),
                      sync=cg.DiLoCo(sync_every=H))
    start = copy.deepcopy(model)  # the fit leaves z in model
    plan.fit(data, 1, shuffle=False, progress=False, metrics_every=None, max_grad_norm=max_norm)
    z, _ = reference_diloco(start, batches_of(data, b), k=k, rounds=rounds, H=H, outer=NESTEROV,
                            inner=inner, max_grad_norm=max_norm)
    unclipped, _ = reference_diloco(start, batches_of(data, b), k=k, rounds=rounds, H=H, outer=NESTEROV,
                                    inner=inner)
    torch.testing.assert_close(plan.central_weights(), z, rtol=RTOL, atol=ATOL)
    assert not torch.allclose(z, unclipped, rtol=1e-3, atol=1e-4)  # the clip binds


def test_fp16_learner_clips_after_unscaling_as_gradscaler_recipe():
    """precision='fp16', k = 1: equals eager autocast with GradScaler's recipe: scale(loss)
    .backward(), unscale_, clip_grad_norm_, step, update."""
    torch.manual_seed(0)
    model, max_norm = TinyNet(), 0.3
    eager = copy.deepcopy(model)
    sgd = torch.optim.SGD(eager.parameters(), lr=0.05, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu")
    plan = cg.compile(model, (torch.randn(2, 1, 8, 8),), F.cross_entropy, batch_size=8,
                      devices=1, replicas=1, executor="inline", precision="fp16",
                      optimizer=cg.SGD(lr=0.05, momentum=0.9))
    data = tiny_data(48, seed=3)
    plan.fit(data, 1, shuffle=False, progress=False, max_grad_norm=max_norm)
    x, y = data.tensors
    norms = []
    for t in range(6):
        sgd.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(eager(x[t * 8:(t + 1) * 8]), y[t * 8:(t + 1) * 8])
        scaler.scale(loss).backward()
        scaler.unscale_(sgd)
        norms.append(float(nn.utils.clip_grad_norm_(eager.parameters(), max_norm)))
        scaler.step(sgd)
        scaler.update()
    assert min(norms) > max_norm and scaler.get_scale() == 2.0 ** 16  # every step was taken
    torch.testing.assert_close(plan.central_weights(), flat(eager.parameters()),
                               rtol=RTOL, atol=ATOL)


def _on_streams(graph: bool, norms: tuple[float, ...]) -> tuple[torch.Tensor, G.RoundGraph | None]:
    """1 device × 3 replicas on simulated CUDA streams (and, with ``graph``, simulated CUDA
    graphs), one fit per entry of ``norms`` with that max_grad_norm. Returns (z, round graph)."""
    plan = make_plan(devices=1, replicas=3, executor="inline", kernel_backend="torch")
    rec = RaceRecorder().attach(plan.scheduler)
    if graph:
        plan.scheduler.round_graph = G.RoundGraph(SimulatedGraphs())
    with rec:
        for norm in norms:
            plan.fit(tiny_data(96), 1, shuffle=False, progress=False, metrics_every=None,
                     max_grad_norm=norm)
        plan.scheduler.flush()
    assert [str(r) for r in rec.races] == []
    return plan.central_weights(), plan.scheduler.round_graph


def test_clipping_on_cuda_streams_and_in_graph_rounds_reads_nothing_on_the_host():
    """Simulated CUDA streams clip as the inline rounds do (the SMA reference), and a CUDA-graph
    round captures the clip (a host read would fail the simulated capture); a second fit with
    another max_grad_norm captures a new graph instead of replaying the first one's number."""
    norms = (0.3, 1.2)
    eager, _ = _on_streams(False, norms)
    graph, rg = _on_streams(True, norms)
    torch.manual_seed(0)
    z = flat(reference_sma(TinyNet(), batches_of(tiny_data(96), 4), ks=[3] * 8, lr=0.05, momentum=0.9,
                           max_grad_norm=0.3)[0])
    assert rg.failure is None and rg.captures == 2 and rg.replays > 0
    torch.testing.assert_close(graph, eager, rtol=RTOL, atol=ATOL)
    first, _ = _on_streams(False, norms[:1])
    torch.testing.assert_close(first, z, rtol=RTOL, atol=ATOL)


def test_clip_rows_is_clip_grad_norm_per_row_and_keeps_faults_visible():
    """Each row scaled as clip_grad_norm_ scales one model's gradients (a row under the norm is
    unchanged); a row with NaN or Inf stays non-finite, for the fault monitor."""
    g = torch.randn(4, 10) * torch.tensor([[0.01], [1.0], [5.0], [1.0]])
    g[3, 2] = float("inf")
    want = []
    for row in g[:3]:
        p = nn.Parameter(torch.zeros(10))
        p.grad = row.clone()
        nn.utils.clip_grad_norm_([p], 0.5)
        want.append(p.grad)
    clip_rows(g, 0.5)
    torch.testing.assert_close(g[:3], torch.stack(want), rtol=1e-6, atol=0)
    assert not torch.isfinite(g[3]).all()
    before = g.clone()
    clip_rows(g, None)
    torch.testing.assert_close(g, before, rtol=0, atol=0, equal_nan=True)
