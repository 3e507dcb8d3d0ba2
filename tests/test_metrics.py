"""Monitored metrics (tuning/metrics.py): the two-batch noise-scale estimator against per-sample
gradients (torch.func vmap + grad), divergence, and the metric records of a fit."""

from __future__ import annotations

import functools
import math

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, vmap
from torch.utils.data import TensorDataset

import crossbow_graph as cg
from crossbow_graph.tuning.metrics import MetricsMonitor, divergence, two_batch_estimate

from _plans import make_plan


class MLP(nn.Module):
    """10 → 16 → 3, tanh; no buffers, no dropout (same gradients in every executor)."""

    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2 = nn.Linear(10, 16), nn.Linear(16, 3)

    def forward(self, x):
        return self.l2(torch.tanh(self.l1(x)))


def teacher_data(n: int, seed: int = 0) -> TensorDataset:
    """x [n, 10] normal; labels from a fixed random teacher with 20 % of them flipped (noise)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 10, generator=g)
    y = (x @ torch.randn(10, 3, generator=g)).argmax(1)
    flip = torch.rand(n, generator=g) < 0.2
    y[flip] = torch.randint(0, 3, (int(flip.sum()),), generator=g)
    return TensorDataset(x, y)


def per_sample_grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Per-sample loss gradients ``[n, P]`` (parameters in named_parameters() order)."""
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(p, xi, yi):
        out = functional_call(model, p, (xi.unsqueeze(0),))
        return nn.functional.cross_entropy(out, yi.unsqueeze(0))

    gs = vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y)
    return torch.cat([gs[k].reshape(len(x), -1) for k in params], dim=1)


# the plans of these tests: the MLP on x [N, 10] on 2 devices × 2 replicas, at lr 1e-9 without momentum
# unless given: the weights stay (numerically) put
mlp_plan = functools.partial(make_plan, model=MLP, input_shape=(10,), devices=2, replicas=2,
                             optimizer=cg.SGD(lr=1e-9, momentum=0.0))


def test_two_batch_formula_on_known_moments():
    # |G|² = 4, tr Σ = 32, b = 8, k = 4: E|G_b|² = 4 + 32/8 = 8, E|G_B|² = 4 + 32/32 = 5
    est = two_batch_estimate(8.0, 5.0, 8, 4)
    assert est.grad_sq == pytest.approx(4.0) and est.trace_sigma == pytest.approx(32.0)
    assert est.noise_scale == pytest.approx(8.0)
    with pytest.raises(ValueError, match="k ≥ 2"):
        two_batch_estimate(1.0, 1.0, 8, 1)


def test_runtime_reads_the_learners_gradients_exactly():
    """One round at w0: the window's |G|², tr Σ equal the two-batch formula applied to per-sample
    gradients grouped as the learners' batches (learner j: samples j·b … (j+1)·b − 1)."""
    b, k = 8, 4
    data = teacher_data(k * b)
    plan = mlp_plan(batch_size=b, executor="inline")
    model0 = plan.central_model()
    h = plan.fit(data, 1, shuffle=False, progress=False, metrics_every=1)
    (rec,) = h.metrics
    gs = per_sample_grads(model0, *data.tensors)                  # [k·b, P]
    small = gs.view(k, b, -1).mean(dim=1)                         # [k, P], the learners' g_j
    big = small.mean(dim=0)
    ref = two_batch_estimate(float((small ** 2).sum(1).mean()), float(big.dot(big)), b, k)
    assert rec.grad_sq == pytest.approx(ref.grad_sq, rel=1e-4)
    assert rec.trace_sigma == pytest.approx(ref.trace_sigma, rel=1e-4)
    assert rec.noise_scale == pytest.approx(ref.trace_sigma / ref.grad_sq, rel=1e-4)


def test_noise_scale_agrees_with_per_sample_estimate():
    """The EMA of two-batch estimates over 64 rounds at (nearly) fixed weights agrees with the
    offline B_noise = tr Σ / |G|² from every sample's gradient, within 25 % (measured: 6 %;
    tolerance: each round's
    estimate has relative spread ≈ √(2/(k−1)) ≈ 0.8 for k = 4; averaging ~64 of them → ≈ 0.1;
    seeded, so the outcome is fixed; a wrong 1/b or B factor is off by ≥ 2×)."""
    b, k, rounds = 8, 4, 64
    data = teacher_data(k * b * rounds, seed=1)
    plan = mlp_plan(batch_size=b, executor="inline")
    model0 = plan.central_model()
    mon = MetricsMonitor(1, ema=0.99)
    plan.fit(data, 1, progress=False, metrics_every=None, hooks=[mon])
    gs = per_sample_grads(model0, *data.tensors)                  # [N, P]
    mean = gs.mean(0)
    trace = float(((gs - mean) ** 2).sum(1).sum()) / (len(gs) - 1)
    offline = trace / float(mean.dot(mean))
    assert mon.last.noise_scale == pytest.approx(offline, rel=0.25)
    assert mon.last.trace_sigma_ema == pytest.approx(trace, rel=0.25)


@pytest.mark.parametrize("every,measure", [(3, 10), (4, 2)])
def test_process_executor_reads_the_measured_rounds_gradients(every, measure):
    """Worker processes learn round t+1 while round t's hooks run (overwriting g); a measured round
    is run without that overlap, so the estimates equal the inline executor's (every round of a
    window measured, or its last 2 of 4)."""
    b, k = 4, 4
    data = teacher_data(k * b * 12, seed=2)
    out = []
    for executor in ("inline", "process"):
        plan = mlp_plan(batch_size=b, executor=executor, optimizer=cg.SGD(lr=0.05, momentum=0.9))
        h = plan.fit(data, 1, progress=False, seed=3,
                     metrics_every=MetricsMonitor(every, measure_rounds=measure))
        out.append([(m.round, m.grad_sq, m.trace_sigma) for m in h.metrics])
    assert [r for r, _, _ in out[0]] == list(range(every, 13, every))
    for (r0, g0, t0), (r1, g1, t1) in zip(*out):
        assert r0 == r1
        assert g1 == pytest.approx(g0, rel=1e-3, abs=1e-6) and t1 == pytest.approx(t0, rel=1e-3)


def test_a_windows_estimate_is_the_mean_of_its_last_measured_rounds():
    """Windows of 6 rounds measuring the last 4: each window's |G|² and tr Σ are the means of the
    single-round estimates of its rounds 3–6 (the oracle: a fit with 1-round windows, which
    trains identically: measuring reads g only), and the EMA takes one value per window."""
    b = 4
    data = teacher_data(4 * b * 12, seed=5)
    fits = {}
    for every, measure in ((1, 1), (6, 4)):
        plan = mlp_plan(batch_size=b, executor="inline", optimizer=cg.SGD(lr=0.05, momentum=0.9))
        mon = MetricsMonitor(every, ema=0.5, measure_rounds=measure)
        fits[every] = plan.fit(data, 1, progress=False, seed=3, metrics_every=mon).metrics
        fits[every, "z"] = plan.central_weights()
    torch.testing.assert_close(fits[1, "z"], fits[6, "z"], rtol=0, atol=0)
    single = {m.round: m for m in fits[1]}
    assert [m.round for m in fits[6]] == [6, 12]
    ema_g2 = ema_tr = weight = 0.0
    for m in fits[6]:
        rounds = range(m.round - 3, m.round + 1)
        g2 = sum(single[r].grad_sq for r in rounds) / 4
        tr = sum(single[r].trace_sigma for r in rounds) / 4
        assert m.grad_sq == pytest.approx(g2, rel=1e-9) and m.trace_sigma == pytest.approx(tr, rel=1e-9)
        ema_g2, ema_tr, weight = 0.5 * ema_g2 + 0.5 * g2, 0.5 * ema_tr + 0.5 * tr, 0.5 * weight + 0.5
        assert m.grad_sq_ema == pytest.approx(ema_g2 / weight, rel=1e-9)
        assert m.trace_sigma_ema == pytest.approx(ema_tr / weight, rel=1e-9)


def test_the_first_window_of_training_is_kept_out_of_the_moving_averages():
    """``warmup_windows=1`` (opt-in): the first window of training reports its own |G|² and
    tr Σ but leaves the EMAs (and B_noise) empty; from the second on, the EMAs are those of a
    monitor that never saw it. Training is unchanged. A later fit on the same plan is past the
    warm-up: its first window enters at once."""
    b = 4
    data = teacher_data(4 * b * 12, seed=5)
    fits = {}
    for warm in (0, 1):
        plan = mlp_plan(batch_size=b, executor="inline", optimizer=cg.SGD(lr=0.05, momentum=0.9))
        mon = MetricsMonitor(3, ema=0.5, measure_rounds=3, warmup_windows=warm)
        fits[warm] = plan.fit(data, 1, progress=False, seed=3, metrics_every=mon).metrics
        fits[warm, "z"] = plan.central_weights()
        fits[warm, "plan"] = plan
    torch.testing.assert_close(fits[0, "z"], fits[1, "z"], rtol=0, atol=0)
    cold, warm = fits[0], fits[1]
    assert [m.round for m in warm] == [3, 6, 9, 12]
    assert warm[0].grad_sq == cold[0].grad_sq and warm[0].trace_sigma == cold[0].trace_sigma
    assert warm[0].grad_sq_ema is None and warm[0].trace_sigma_ema is None and warm[0].noise_scale is None
    ema_g2 = ema_tr = weight = 0.0
    for m in warm[1:]:
        ema_g2, ema_tr = 0.5 * ema_g2 + 0.5 * m.grad_sq, 0.5 * ema_tr + 0.5 * m.trace_sigma
        weight = 0.5 * weight + 0.5
        assert m.grad_sq_ema == pytest.approx(ema_g2 / weight, rel=1e-9)
        assert m.trace_sigma_ema == pytest.approx(ema_tr / weight, rel=1e-9)
    assert warm[1].grad_sq_ema == pytest.approx(warm[1].grad_sq, rel=1e-9)  # the first in the EMA
    assert cold[1].grad_sq_ema != pytest.approx(cold[1].grad_sq, rel=1e-6)  # the cold one mixes in window 1
    later = fits[1, "plan"].fit(data, 1, progress=False, seed=4,
                                metrics_every=MetricsMonitor(3, measure_rounds=3,
                                                             warmup_windows=1)).metrics
    assert later[0].grad_sq_ema == pytest.approx(later[0].grad_sq, rel=1e-9)
    for bad in (-1, True, False, 1.5, None):
        with pytest.raises(ValueError, match="warmup_windows"):
            MetricsMonitor(3, warmup_windows=bad)


def test_measure_rounds_validated_and_capped():
    with pytest.raises(ValueError, match="measure_rounds"):
        MetricsMonitor(5, measure_rounds=0)
    assert MetricsMonitor(5, measure_rounds=10).measure_rounds == 5
    mon, wanted = MetricsMonitor(5, measure_rounds=2), []
    for r in range(1, 11):  # two windows: the last 2 rounds of each are measured
        wanted.append(mon.wants_gradients(r))
        mon._rounds = (mon._rounds + 1) % 5  # as after_round counts, and a window's end resets
    assert wanted == [False, False, False, True, True] * 2


def test_metric_records_of_a_fit():
    b = 4
    data = teacher_data(4 * b * 10, seed=4)
    plan = mlp_plan(batch_size=b, executor="inline", optimizer=cg.SGD(lr=0.05, momentum=0.9))
    h = plan.fit(data, 2, eval_dataset=data, evals_per_epoch=1, progress=False, metrics_every=5)
    assert [m.round for m in h.metrics] == [5, 10, 15, 20]
    for m in h.metrics:
        assert m.lr == 0.05 and m.batch_size == 4 and m.num_learners == 4 and m.alpha == pytest.approx(
            0.8 * 2 * 1.9 / 5.9)  # the default α at k = 4, μ_z = 0.9
        assert m.samples_per_s > 0 and math.isfinite(m.train_loss)
        assert 0 < m.divergence_mean <= m.divergence_max
    assert [m.test_accuracy is not None for m in h.metrics] == [False, True, False, True]
    assert h.metrics[-1].epoch == pytest.approx(2.0)
    w, z = plan.replica_weights(), plan.central_weights()
    ref = (w - z).norm(dim=1) / z.norm()
    torch.testing.assert_close(divergence(plan.states), ref)
    assert h.to_dict()["metrics"][0]["round"] == 5  # JSON-ready


def test_metrics_every_validated():
    with pytest.raises(ValueError, match="metrics_every"):
        MetricsMonitor(0)


def test_windows_of_window_samples_follow_the_batch_size():
    """With window_samples S a window is ⌈S/(k·b)⌉ rounds within [measure_rounds, every]: after a
    policy quadruples b the windows are a quarter as many rounds."""
    with pytest.raises(ValueError, match="window_samples"):
        MetricsMonitor(5, window_samples=0)
    mon = MetricsMonitor(50, measure_rounds=2, window_samples=96)
    assert [mon.window_rounds(kb) for kb in (1, 16, 32, 64, 96, 1000)] == [50, 6, 3, 2, 2, 2]

    class Quadruple(cg.Policy):  # b 4 → 16 at round 12
        def after_round(self, ctx):
            if ctx.plan.rounds_done == 12:
                self.adjust(ctx, batch_size=16)

    data = teacher_data(4 * 16 * 12, seed=5)
    plan = mlp_plan(batch_size=4, executor="inline", optimizer=cg.SGD(lr=0.05, momentum=0.9))
    monitor = MetricsMonitor(50, measure_rounds=2, window_samples=96)
    h = plan.fit(data, 1, progress=False, metrics_every=monitor, policies=[Quadruple()])
    # k·b = 16: windows of 6 rounds, then k·b = 64: windows of 2 rounds
    assert [m.round for m in h.metrics][:4] == [6, 12, 14, 16]
    assert [m.batch_size for m in h.metrics][:4] == [4, 4, 16, 16]
    assert all(m.grad_sq is not None for m in h.metrics)  # each window measured its last rounds
