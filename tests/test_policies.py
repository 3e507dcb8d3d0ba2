"""Policies (tuning/policy_base.py, policies.py, adaptive_batch.py): the adjust interface, schedules against torch's, batch-size
changes, the divergence guard, the CLI spec parser."""

from __future__ import annotations

import math
import types

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import crossbow_graph as cg
from crossbow_graph.errors import PlanError
from crossbow_graph.training.hooks import Hook
from crossbow_graph.tuning.adaptive_batch import lr_power
from crossbow_graph.tuning.metrics import MetricsMonitor
from crossbow_graph.tuning.policies import (Adjustment, AdaptiveBatchSize, CosineLR,
                                            DivergenceGuard, MultiStepLR, Policy, StepLR,
                                            parse_policy)
from _plans import make_plan, tiny_data
from _reference import default_alpha, rule_lrs


class At(Policy):
    """Applies ``changes`` once, after round ``round`` (so from round ``round`` + 1 on)."""

    def __init__(self, round: int, **changes) -> None:
        self.round, self.changes = round, changes

    def after_round(self, ctx):
        if ctx.plan.rounds_done == self.round:
            self.adjust(ctx, reason="test", **self.changes)


class Snapshots(Hook):
    """Copies w, g, z of every device and the round's samples after every round."""

    mutates_replicas = True  # reads g after the round: no speculative learning of the next one

    def __init__(self) -> None:
        self.rounds = []

    def after_round(self, ctx):
        ctx.plan.rounds.flush()
        self.rounds.append({
            "w": [s.w.clone() for s in ctx.plan.states], "g": [s.g.clone() for s in ctx.plan.states],
            "z": [s.z.clone() for s in ctx.plan.states], "samples": ctx.round_samples,
            "indices": ctx.batch_indices.clone(), "lr": ctx.plan.settings.lr,
        })


# -- the adjust interface ------------------------------------------------------------------------


@pytest.mark.parametrize("executor", ["inline", "process"])
def test_change_applies_at_the_same_round_on_every_device(executor):
    """lr changed after round 3: round 4's local step uses the new η on both devices (μ_l = 0,
    λ = 0, so w_{t+1} = ŵ − η·g − α(ŵ − z)), rounds ≤ 3 the old one."""
    plan = make_plan(devices=2, replicas=1, executor=executor, optimizer=cg.SGD(lr=0.05, momentum=0.0))
    snap = Snapshots()
    h = plan.fit(tiny_data(8 * 8), 1, shuffle=False, progress=False, hooks=[snap],
                 policies=[At(3, lr=0.2)], metrics_every=None)
    assert [p.changes for p in h.policy] == [{"lr": 0.2}] and h.policy[0].round == 3
    alpha = default_alpha(2, plan.sync.central_momentum)
    factors = rule_lrs(1.0, [2] * 8, 4, 64)  # SMA's η rule at k = 2 (1 → √2) times the policy's
    for t in range(1, 6):
        lr = (0.2 if t >= 3 else 0.05) * factors[t]  # snapshot t is after round t+1
        prev, cur = snap.rounds[t - 1], snap.rounds[t]
        for d in range(2):
            w_hat, z_old, g = prev["w"][d], prev["z"][d], cur["g"][d]
            expect = w_hat - lr * g - alpha * (w_hat - z_old)
            torch.testing.assert_close(cur["w"][d], expect, rtol=1e-5, atol=1e-6)


def test_batch_size_change_keeps_batches_disjoint_and_replans():
    """b 4 → 8 after round 3 (mid-epoch): rounds take the next k·b positions of the order, so an
    epoch's batches never overlap; the task graph and the round size follow."""
    n = 160
    data = TensorDataset(torch.randn(n, 1, 8, 8), torch.randint(0, 4, (n,)))
    plan = make_plan(devices=2, replicas=1, executor="inline")
    snap = Snapshots()
    h = plan.fit(data, 2, progress=False, hooks=[snap], policies=[At(3, batch_size=8)],
                 metrics_every=None)
    assert plan.batch_size == 8 and plan.task_graph.graph["batch_size"] == 8
    sizes = [r["samples"] for r in snap.rounds]
    assert sizes[:3] == [8, 8, 8] and set(sizes[3:]) == {16}
    per_epoch = [h.epochs[0].rounds, h.epochs[1].rounds]
    assert per_epoch == [3 + (n - 24) // 16, n // 16]
    first = torch.cat([r["indices"] for r in snap.rounds[:per_epoch[0]]])
    assert len(first) == len(set(first.tolist()))  # disjoint within the epoch
    order = torch.randperm(n, generator=torch.Generator().manual_seed(0 * 1_000_003 + 0))
    assert torch.equal(first, order[:len(first)])  # consecutive positions of the epoch's order


def test_batch_size_over_the_memory_budget_is_refused():
    probe8 = make_plan(batch_size=8, devices=1, replicas=2)
    probe4 = make_plan(batch_size=4, devices=1, replicas=2)
    mem8 = probe8.task_graph.graph["memory_per_learner_bytes"]
    mem4 = probe4.task_graph.graph["memory_per_learner_bytes"]
    assert mem8 > mem4
    plan = make_plan(batch_size=4, devices=1, replicas=2, memory_budget=2 * mem4 + (mem8 - mem4) // 2)
    with pytest.raises(PlanError):
        plan.adjust(Adjustment(batch_size=8))
    assert plan.batch_size == 4 and plan.settings.batch_size == 4
    policy = AdaptiveBatchSize(max_batch_size=64)
    policy.min_batch_size = 4
    assert policy.target(4, 100.0) == 8  # the policy would grow; the plan refuses: it stays


def test_adjust_alpha_sync_every_replicas():
    plan = make_plan(devices=1, replicas=2, executor="inline")
    done = plan.adjust(Adjustment(alpha=0.3, sync_every=2, replicas_per_device=3))
    assert done == {"alpha": 0.3, "sync_every": 2, "replicas_per_device": 3}
    assert plan.rounds.round_env(0, None, True).alpha == 0.3 and plan.sync.sync_every == 2 and plan.num_learners == 3
    plan.adjust(Adjustment(alpha="auto"))  # the default: 0.8 of the pull's bound (design §2)
    assert plan.rounds.round_env(0, None, True).alpha == pytest.approx(0.8 * 2 * 1.9 / 4.9)
    with pytest.raises(ValueError, match="lr"):
        Adjustment(lr=-1.0)
    with pytest.raises(ValueError, match="α"):
        Adjustment(alpha=1.5)


# -- learning-rate schedules ---------------------------------------------------------------------


def _torch_lrs(make, epochs: int, lr: float = 0.1) -> list[float]:
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=lr)
    sched = make(opt)
    out = []
    for _ in range(epochs):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


@pytest.mark.parametrize("ours, theirs", [
    (lambda: StepLR(step_epochs=2, gamma=0.5),
     lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5)),
    (lambda: MultiStepLR((3, 5), gamma=0.1, warmup_epochs=2, warmup_start=0.25),
     lambda o: torch.optim.lr_scheduler.ChainedScheduler([
         torch.optim.lr_scheduler.LinearLR(o, start_factor=0.25, total_iters=2),
         torch.optim.lr_scheduler.MultiStepLR(o, milestones=[3, 5], gamma=0.1)])),
    (lambda: CosineLR(epochs=7, eta_min=0.001),
     lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=7, eta_min=0.001)),
])
def test_schedules_match_torch_lr_scheduler(ours, theirs):
    """η per epoch inside a fit equals torch.optim.lr_scheduler's (stepped per epoch), 8 epochs,
    bit for bit: the policy's torch scheduler steps the plan's own param groups (no shadow)."""
    seen = []

    class Record(Policy):  # after the schedule: the η that the epoch's rounds use
        def before_epoch(self, ctx):
            seen.append(ctx.plan.settings.lr)

    policy = ours()
    plan = make_plan(devices=1, replicas=2, executor="inline", optimizer=cg.SGD(lr=0.1, momentum=0.9))
    plan.fit(tiny_data(16), 8, progress=False, policies=[policy, Record()], metrics_every=None)
    assert seen == _torch_lrs(theirs, 8) and policy.scheduler.optimizer is plan.optimizer


def test_cosine_lr_holds_eta_min_after_its_epochs_and_continues_in_the_next_fit():
    seen = []

    class Record(Policy):
        def before_epoch(self, ctx):
            seen.append(ctx.plan.settings.lr)

    policy, record = CosineLR(epochs=3, eta_min=0.001), Record()
    plan = make_plan(devices=1, replicas=2, executor="inline", optimizer=cg.SGD(lr=0.1, momentum=0.9))
    plan.fit(tiny_data(16), 2, progress=False, policies=[policy, record], metrics_every=None)
    plan.fit(tiny_data(16), 3, progress=False, policies=[policy, record], metrics_every=None)
    cosine = _torch_lrs(lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=3,
                                                                             eta_min=0.001), 4)
    assert seen == cosine + [cosine[3]]


def test_a_schedule_policys_state_from_an_older_checkpoint_continues_at_its_steps():
    """An older checkpoint holds a schedule policy's steps (no torch scheduler state): the
    scheduler built over the plan continues from that step, so StepLR(2) drops at its 2nd step."""
    seen = []

    class Record(Policy):
        def before_epoch(self, ctx):
            seen.append(ctx.plan.settings.lr)

    policy = StepLR(step_epochs=2, gamma=0.5)
    policy.load_state_dict({"base_lr": 0.1, "applied": 1.0, "steps": 1})
    plan = make_plan(devices=1, replicas=2, executor="inline", optimizer=cg.SGD(lr=0.1, momentum=0.9))
    plan.fit(tiny_data(16), 3, progress=False, policies=[policy, Record()], metrics_every=None)
    assert seen == [0.1, 0.1, 0.05] and policy.steps == 2


def test_lr_drop_resets_every_replica_to_z():
    seen = []

    class Check(Policy):
        def before_epoch(self, ctx):
            w, z = ctx.plan.replica_weights(), ctx.plan.central_weights()
            seen.append((ctx.plan.settings.lr, bool((w == z).all()), float(ctx.plan.states[0].v.abs().sum())))

    plan = make_plan(devices=1, replicas=2, executor="inline")
    h = plan.fit(tiny_data(64), 3, progress=False, policies=[StepLR(2, 0.1), Check()],
                 metrics_every=None)
    assert [round(lr, 6) for lr, _, _ in seen] == [0.05, 0.05, 0.005]
    assert [same for _, same, _ in seen] == [True, False, True]  # epoch 0: all start at w0
    assert seen[2][2] == 0.0  # momentum zeroed
    assert h.policy[-1].changes == {"lr": pytest.approx(0.005), "reset_replicas": True}


# -- AdaptiveBatchSize ---------------------------------------------------------------------------


def test_adaptive_batch_size_rule():
    """k·b is kept in (c·B_noise/2, c·B_noise], c = epoch_overhead (0.125 by default): b doubles
    when 2·k·b ≤ c·B_noise, halves when k·b > c·B_noise, within the bounds."""
    p = AdaptiveBatchSize(min_batch_size=4, max_batch_size=32)
    assert p.epoch_overhead == 0.125 and p.shrink
    assert p.target(4, 63.9) == 4 and p.target(4, 64.0) == 8 and p.target(16, 1e9) == 32  # 2·4 ≤ B/8
    assert p.target(32, 1e9) == 32 and p.target(4, 0.1) == 4  # the bounds
    assert p.target(16, 128.0) == 16 and p.target(16, 127.9) == 8  # 16 ≤ 128/8: stay; above: halve
    assert p.target(4, 255.9, k=4) == 4 and p.target(4, 256.0, k=4) == 8  # against k·b
    assert p.target(16, 511.9, k=4) == 8 and p.target(16, 512.0, k=4) == 16
    quarter = AdaptiveBatchSize(min_batch_size=4, epoch_overhead=0.25)  # a quarter instead of the default eighth
    assert quarter.target(4, 31.9) == 4 and quarter.target(4, 32.0) == 8 and quarter.target(16, 63.9) == 8
    one = AdaptiveBatchSize(min_batch_size=4, epoch_overhead=1.0, shrink=False)  # the plain critical-batch rule
    assert one.target(4, 7.9) == 4 and one.target(4, 8.0) == 8 and one.target(16, 1.0) == 16
    for bad in (0, -1.0, float("inf"), True, "0.25"):
        with pytest.raises(ValueError, match="epoch_overhead"):
            AdaptiveBatchSize(epoch_overhead=bad)
    for kw in ({"max_batch_size": True}, {"max_batch_size": 0}, {"min_batch_size": 2.5},
               {"min_batch_size": 0}, {"shrink": "no"}, {"shrink": None}):
        with pytest.raises(ValueError, match=next(iter(kw))):
            AdaptiveBatchSize(**kw)


def test_adaptive_batch_size_refuses_a_fit_without_metrics():
    """Without a metrics monitor there is no noise scale: the fit stops at its start with an error
    that names the way out, instead of running a policy that never acts."""
    plan = make_plan(devices=2, replicas=1, executor="inline")
    with pytest.raises(ValueError, match="metrics_every"):
        plan.fit(tiny_data(64), 1, progress=False, metrics_every=None, policies=[AdaptiveBatchSize()])
    assert plan.rounds_done == 0


def test_adaptive_batch_size_grows_b_in_a_fit():
    """Random labels: the gradient is all noise (B_noise ≫ b), so b doubles up to the bound (with
    scale_lr, η alike), and every round's batches stay disjoint."""
    plan = make_plan(devices=2, replicas=1, executor="inline", optimizer=cg.SGD(lr=0.01, momentum=0.9))
    snap = Snapshots()
    h = plan.fit(tiny_data(640), 1, progress=False, hooks=[snap], metrics_every=2,
                 policies=[AdaptiveBatchSize(max_batch_size=16, cooldown_epochs=0.02, scale_lr=True)])
    assert [p.changes["batch_size"] for p in h.policy] == [8, 16]
    assert plan.batch_size == 16 and plan.settings.lr == pytest.approx(0.04)
    idx = torch.cat([r["indices"] for r in snap.rounds])
    assert len(idx) == len(set(idx.tolist()))
    assert all(m.noise_scale is not None and m.noise_scale > 2 * 4 for m in h.metrics[:1])
    # settled: 3 windows (the default) of 2 rounds with an estimate before each change
    first, second = (p.round for p in h.policy)
    assert first >= 6 and second - first >= 6


@pytest.mark.parametrize("make,power", [
    (lambda m: torch.optim.SGD(m.parameters(), lr=1e-2, momentum=0.9), 1.0),
    (lambda m: torch.optim.Adam(m.parameters(), lr=1e-2), 0.5),
    (lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2), 0.5)], ids=["sgd", "adam", "adamw"])
def test_adaptive_batch_sizes_lr_rule_is_linear_for_sgd_and_square_root_for_adam(make, power):
    """η ← η·f^p for the batch's factor f (linear) or the gain's ratio r_new/r_old (gain): p = 1
    for SGD-like optimizers, 1/2 for adaptive ones (lr_power)."""
    plan = make_plan(devices=2, replicas=1, executor="inline", optimizer=make)
    assert lr_power(plan.optimizer) == power
    ctx = types.SimpleNamespace(plan=plan)
    linear = AdaptiveBatchSize(scale_lr="linear")
    assert linear._lr_for(ctx, 16)[0] == pytest.approx(1e-2 * 4.0 ** power)  # b 4 → 16
    gain = AdaptiveBatchSize(scale_lr="gain", reference_batch=8)
    gain.pace.noise, gain.pace.gain_windows_seen = (100.0,), gain.gain_windows
    lr, r = gain._lr_for(ctx, 16)
    assert r == pytest.approx(gain.gain_at(2 * 16, 100.0)) and lr == pytest.approx(1e-2 * r ** power)


def test_adaptive_batch_size_waits_for_the_estimate_to_settle():
    """The default waits 3 windows that updated the EMAs before the first change, None one EMA
    time constant (10 for ema = 0.9); ``settle_windows=1`` acts on the first window with
    2·k·b ≤ c·B_noise."""
    none = AdaptiveBatchSize(settle_windows=None)
    assert none.windows_to_settle(0.9) == 10 and none.windows_to_settle(0.5) == 2
    assert none.windows_to_settle(0.0) == 1 and AdaptiveBatchSize().windows_to_settle(0.9) == 3
    with pytest.raises(ValueError, match="settle_windows=0"):
        AdaptiveBatchSize(settle_windows=0)
    for settle, skip in ((1, 0), (3, 2), (None, 9)):
        plan = make_plan(devices=2, replicas=1, executor="inline",
                         optimizer=cg.SGD(lr=0.01, momentum=0.9))
        h = plan.fit(tiny_data(640), 1, progress=False, metrics_every=2,
                     policies=[AdaptiveBatchSize(max_batch_size=8, settle_windows=settle, scale_lr="none")])
        windows = [m for m in h.metrics if m.grad_sq_ema is not None]  # the EMAs were updated
        due = [m.round for m in windows[skip:]
               if m.noise_scale is not None and 2 * 2 * 4 <= 0.125 * m.noise_scale]  # k·b = 2·4, c
        assert due and [r.round for r in h.policy] == due[:1], (settle, h.policy)


def test_lr_gain_is_mccandlish_ratio_of_best_step_sizes():
    """r(B) = (1 + B_noise/B₀)/(1 + B_noise/B): 1 at the reference, between 1 and B/B₀, B/B₀ when
    the noise dominates (B_noise = None: EMA(|G|²) ≤ 0), 1 without measured noise (B_noise ≤ 0)."""
    p = AdaptiveBatchSize(reference_batch=64)
    assert p.gain_at(64, 300.0) == pytest.approx(1.0)
    assert p.gain_at(256, 300.0) == pytest.approx((1 + 300 / 64) / (1 + 300 / 256))  # ≈ 2.70
    assert p.gain_at(16, 300.0) == pytest.approx((1 + 300 / 64) / (1 + 300 / 16))  # ≈ 0.29
    assert p.gain_at(256, None) == 4.0 and p.gain_at(16, None) == 0.25
    assert p.gain_at(256, -5.0) == 1.0 and p.gain_at(256, 1e12) == pytest.approx(4.0)
    for ns in (1.0, 50.0, 1e3, 1e5):
        assert 1.0 < p.gain_at(256, ns) < 4.0 and 0.25 < p.gain_at(16, ns) < 1.0


def _gain_invariant(h, lr0, k, p, b=4):
    """Every η the gain set equals lr0·r(k·b, the window's B_noise) (times the schedule's factor,
    folded into lr0 by the caller's epoch map); b: the starting batch size."""
    ns_at = {m.round: m.noise_scale for m in h.metrics}
    checked = 0
    for rec in h.policy:
        b = rec.changes.get("batch_size", b)
        if rec.policy == "AdaptiveBatchSize" and "lr" in rec.changes:
            assert rec.changes["lr"] == pytest.approx(lr0(rec.epoch) * p.gain_at(k * b, ns_at[rec.round]),
                                                      rel=1e-9), rec
            checked += 1
    return checked


def test_lr_follows_the_gain_window_by_window_and_composes_with_a_schedule():
    """Default scale_lr='gain': from the ``gain_windows``-th window with an estimate on, η is
    η₀·r(k·b, B_noise) with the window's B_noise; a growth of b carries the gain at the new
    k·b in the same adjustment; a schedule's drop multiplies in (η₀·γ·r after the milestone)."""
    plan = make_plan(devices=2, replicas=1, executor="inline", optimizer=cg.SGD(lr=0.01, momentum=0.9))
    p = AdaptiveBatchSize(reference_batch=4, max_batch_size=8, cooldown_epochs=0.02, settle_windows=5)
    h = plan.fit(tiny_data(320), 2, progress=False, metrics_every=2,
                 policies=[p, MultiStepLR(milestones=(1,), gamma=0.1)])
    assert [r.changes["batch_size"] for r in h.policy if "batch_size" in r.changes] == [8]
    grown = next(r for r in h.policy if "batch_size" in r.changes)
    assert "lr" in grown.changes  # the growth's own η, at the gain of k·b = 16
    assert _gain_invariant(h, lambda e: 0.01 * (0.1 if e >= 1 else 1.0), 2, p) >= 10
    first = next(r for r in h.policy if r.policy == "AdaptiveBatchSize")
    windows = [m.round for m in h.metrics if m.grad_sq_ema is not None]
    assert first.round == windows[p.gain_windows - 1]  # not before gain_windows windows
    assert p.gain == pytest.approx(plan.settings.lr / 0.001)


def test_adaptive_batch_size_shrinks_b_where_the_noise_is_small():
    """One label for every sample: the per-sample gradients agree, so the gradient dominates its
    noise (B_noise small against k·b = 32) and b halves to the lower bound 4; η follows the gain
    against the start's k·b."""
    x = torch.randn(1280, 1, 8, 8, generator=torch.Generator().manual_seed(1))
    data = TensorDataset(x, torch.zeros(1280, dtype=torch.long))
    plan = make_plan(devices=2, replicas=1, executor="inline", batch_size=16,
                     optimizer=cg.SGD(lr=0.01, momentum=0.9))
    p = AdaptiveBatchSize(cooldown_epochs=0.02)
    h = plan.fit(data, 1, progress=False, metrics_every=2, policies=[p])
    sizes = [r.changes["batch_size"] for r in h.policy if "batch_size" in r.changes]
    assert sizes[:2] == [8, 4] and p.min_batch_size == 4, h.policy
    first = next(r for r in h.policy if "batch_size" in r.changes)
    ns = next(m.noise_scale for m in h.metrics if m.round == first.round)
    assert 2 * 16 > p.epoch_overhead * ns  # k·b > c·B_noise
    assert _gain_invariant(h, lambda e: 0.01, 2, p, b=16) >= 1 and p.reference_batch == 32


def test_lr_gain_waits_in_every_fit_and_restarts_on_another_plan():
    """A policy reused for a second fit on the same plan waits ``gain_windows`` windows of that
    fit again (a new monitor's first window is a single, noisy estimate); reused on another plan
    (whose η holds no gain) it starts again at r = 1: every η it sets there is η₀·r."""
    plan = make_plan(devices=2, replicas=1, executor="inline", optimizer=cg.SGD(lr=0.01, momentum=0.9))
    p = AdaptiveBatchSize(reference_batch=4, max_batch_size=4)
    plan.fit(tiny_data(96), 1, progress=False, metrics_every=2, policies=[p])
    assert p.gain > 1.5  # k·b = 8 against B₀ = 4
    h = plan.fit(tiny_data(96), 1, progress=False, metrics_every=2, policies=[p])
    windows = [m.round for m in h.metrics if m.grad_sq_ema is not None]
    assert min(r.round for r in h.policy) >= windows[p.gain_windows - 1]
    other = make_plan(devices=2, replicas=1, executor="inline", optimizer=cg.SGD(lr=0.01, momentum=0.9))
    h = other.fit(tiny_data(96), 1, progress=False, metrics_every=2, policies=[p])
    assert _gain_invariant(h, lambda e: 0.01, 2, p) >= 1


def test_lr_gain_validated_and_reference_defaults_to_the_starting_batch():
    for kw in ({"scale_lr": "sqrt"}, {"reference_batch": 0}, {"reference_batch": 2.5},
               {"gain_windows": 0}, {"gain_windows": None}):
        with pytest.raises(ValueError, match=next(iter(kw))):
            AdaptiveBatchSize(**kw)
    assert AdaptiveBatchSize(scale_lr=True).scale_lr == "linear"
    plan = make_plan(devices=2, replicas=1, executor="inline", optimizer=cg.SGD(lr=0.01, momentum=0.9))
    p = AdaptiveBatchSize(max_batch_size=4)
    h = plan.fit(tiny_data(96), 1, progress=False, metrics_every=2, policies=[p])
    assert p.reference_batch == 2 * 4  # k·b at the start: η taken as right there
    assert h.policy == [] and p.gain == 1.0 and plan.settings.lr == 0.01  # at B = B₀, r = 1


class FakeSpeed(Policy):
    """Runs before AdaptiveBatchSize (policies run in order, after the metrics monitor) and sets
    each new window's samples/s from b alone: a deterministic clock for the throughput rule."""

    def __init__(self, speed_of_b):
        self.speed_of_b = speed_of_b

    def after_round(self, ctx):
        last = self.metrics(ctx).last
        if last is not None and last.round == ctx.plan.rounds_done:
            last.samples_per_s = self.speed_of_b(last.batch_size)


@pytest.mark.parametrize("speed_8,kept", [(104.0, False), (150.0, True)])
def test_adaptive_batch_size_keeps_a_growth_only_if_samples_per_s_rose(speed_8, kept):
    """The growth 4 → 8 is judged on ``speed_windows`` (2) windows at b = 8 after one warm-up
    window, against the median at b = 4: +4 % (≤ 10 %) goes back to b = 4, which becomes the
    bound (and η with it, under scale_lr); +50 % is kept and b goes on to 16."""
    plan = make_plan(devices=2, replicas=1, executor="inline", optimizer=cg.SGD(lr=0.01, momentum=0.9))
    speeds = {4: 100.0, 8: speed_8, 16: 2 * speed_8}
    policy = AdaptiveBatchSize(max_batch_size=16, cooldown_epochs=0.02, settle_windows=3,
                               scale_lr=True, min_speedup=0.1)
    h = plan.fit(tiny_data(640), 1, progress=False, metrics_every=2,
                 policies=[FakeSpeed(speeds.__getitem__), policy])
    changes = [p.changes for p in h.policy]
    grown = [r.round for r in h.policy][0]
    if kept:
        assert [c["batch_size"] for c in changes] == [8, 16] and plan.batch_size == 16
        assert plan.settings.lr == pytest.approx(0.04)
    else:
        assert changes == [{"batch_size": 8, "lr": pytest.approx(0.02)},
                           {"batch_size": 4, "lr": pytest.approx(0.01)}]
        assert plan.batch_size == 4 and policy.max_batch_size == 4
        assert plan.settings.lr == pytest.approx(0.01)
        # judged at the end of the 3rd window at b = 8: warm-up, then 2 measured windows
        assert h.policy[1].round == grown + 3 * 2 and "+4.0%" in h.policy[1].reason


def test_a_growth_on_trial_is_not_judged_after_another_policy_changed_k():
    """Samples/s compare only at the same b and k: when another policy adds replicas while a
    growth is on trial, the trial ends without a verdict (the slow b = 8 is not returned)."""
    class MoreReplicas(Policy):
        def after_round(self, ctx):
            grown = [p for p in ctx.history.policy if p.changes.get("batch_size") == 8]
            if grown and ctx.plan.replicas_per_device == 1 and ctx.plan.rounds_done >= grown[0].round + 2:
                self.adjust(ctx, replicas_per_device=2)

    plan = make_plan(devices=2, replicas=1, executor="inline", optimizer=cg.SGD(lr=0.01, momentum=0.9))
    policy = AdaptiveBatchSize(max_batch_size=8, cooldown_epochs=0.02, settle_windows=3,
                               min_speedup=0.1, scale_lr="none")
    h = plan.fit(tiny_data(640), 1, progress=False, metrics_every=2,
                 policies=[FakeSpeed({4: 100.0, 8: 104.0}.__getitem__), policy, MoreReplicas()])
    assert [p.changes for p in h.policy] == [{"batch_size": 8}, {"replicas_per_device": 2}]
    assert plan.batch_size == 8 and policy.pace.trial is None and policy.max_batch_size == 8


def test_a_returned_growth_keeps_an_lr_drop_made_during_the_trial():
    """Under scale_lr the return scales η back by b0/b: a drop made during the trial stays
    (0.01 → 0.02 with b = 8, dropped 10× to 0.002, back at b = 4: 0.001, not the old 0.01)."""
    class Drop(Policy):
        def after_round(self, ctx):
            grown = [p for p in ctx.history.policy if p.changes.get("batch_size") == 8]
            if grown and len(ctx.history.policy) == 1 and ctx.plan.rounds_done >= grown[0].round + 1:
                self.adjust(ctx, lr=ctx.plan.settings.lr * 0.1)

    plan = make_plan(devices=2, replicas=1, executor="inline", optimizer=cg.SGD(lr=0.01, momentum=0.9))
    policy = AdaptiveBatchSize(max_batch_size=16, cooldown_epochs=0.02, settle_windows=3,
                               scale_lr=True, min_speedup=0.1)
    h = plan.fit(tiny_data(640), 1, progress=False, metrics_every=2,
                 policies=[FakeSpeed({4: 100.0, 8: 104.0}.__getitem__), policy, Drop()])
    assert [p.changes for p in h.policy] == [{"batch_size": 8, "lr": pytest.approx(0.02)},
                                             {"lr": pytest.approx(0.002)},
                                             {"batch_size": 4, "lr": pytest.approx(0.001)}]


def test_a_growth_waits_for_a_samples_per_s_baseline():
    """With settle_windows=1 the noise scale asks for a growth at the first window; with
    min_speedup the growth waits for the baseline (one warm-up window and speed_windows = 2
    windows at b = 4), so it is judged (here returned) instead of taken untested."""
    plan = make_plan(devices=2, replicas=1, executor="inline", optimizer=cg.SGD(lr=0.01, momentum=0.9))
    policy = AdaptiveBatchSize(max_batch_size=16, cooldown_epochs=0.02, settle_windows=1,
                               min_speedup=0.1, scale_lr="none")
    h = plan.fit(tiny_data(640), 1, progress=False, metrics_every=2,
                 policies=[FakeSpeed({4: 100.0, 8: 50.0}.__getitem__), policy])
    assert [p.changes["batch_size"] for p in h.policy] == [8, 4]
    assert h.policy[0].round >= 3 * 2 and plan.batch_size == 4


def test_a_growth_on_trial_at_the_end_of_a_fit_is_judged_in_the_next():
    """The same plan, policy and monitor over two fits: the growth 4 → 8 made near the end of the
    first fit is judged (and returned) in the second, after the restarted workers' warm-up."""
    plan = make_plan(devices=2, replicas=1, executor="inline", optimizer=cg.SGD(lr=0.01, momentum=0.9))
    mon = MetricsMonitor(2, measure_rounds=2)
    policy = AdaptiveBatchSize(max_batch_size=16, cooldown_epochs=0.02, settle_windows=3,
                               min_speedup=0.1, scale_lr="none")
    speed = FakeSpeed({4: 100.0, 8: 50.0, 16: 25.0}.__getitem__)
    first = plan.fit(tiny_data(96), 2, progress=False, metrics_every=mon, policies=[speed, policy])
    assert [p.changes for p in first.policy] == [{"batch_size": 8}] and policy.pace.trial is not None
    second = plan.fit(tiny_data(96), 1, progress=False, metrics_every=mon, policies=[speed, policy])
    assert [p.changes for p in second.policy] == [{"batch_size": 4}]
    assert plan.batch_size == 4 and policy.max_batch_size == 4


def test_a_new_policy_does_not_act_on_a_reused_monitors_old_window():
    """A monitor reused from an earlier fit still holds that fit's last window (made to ask for a
    growth here); a policy new to this fit acts only on windows of this fit."""
    plan = make_plan(devices=2, replicas=1, executor="inline", optimizer=cg.SGD(lr=0.01, momentum=0.9))
    mon = MetricsMonitor(2, measure_rounds=2)
    plan.fit(tiny_data(96), 1, progress=False, metrics_every=mon)
    done = plan.rounds_done
    mon.last.grad_sq_ema, mon.last.noise_scale = 1.0, 1e6  # the old window says: grow at once
    h = plan.fit(tiny_data(96), 1, progress=False, metrics_every=mon,
                 policies=[AdaptiveBatchSize(max_batch_size=8, settle_windows=1, cooldown_epochs=0.01,
                                                   scale_lr="none")])
    assert [p.changes for p in h.policy] == [{"batch_size": 8}]
    assert h.policy[0].round >= done + 2  # not at the first round, on the old window


def test_windows_are_classed_by_their_own_settings():
    """A policy listed before AdaptiveBatchSize changes m (k = 2 → 4) in the round that closes a
    window: that window ran at k = 2 and still counts; the next one, with the re-plan, is the
    warm-up, whatever the order of the policies (here its samples/s are 10 % of the steady ones:
    counted, it would make the slower b = 8 look 27 % faster)."""
    class Ramp(Policy):
        def after_round(self, ctx):
            last = self.metrics(ctx).last
            if last is not None and last.round == ctx.plan.rounds_done:
                replanned = any(last.round - 2 <= p.round < last.round for p in ctx.history.policy)
                last.samples_per_s = {4: 100.0, 8: 70.0}[last.batch_size] * (0.1 if replanned else 1)

    class MoreReplicasAt6(Policy):
        def after_round(self, ctx):
            if ctx.plan.rounds_done == 6:
                self.adjust(ctx, replicas_per_device=2)

    plan = make_plan(devices=2, replicas=1, executor="inline", optimizer=cg.SGD(lr=0.01, momentum=0.9))
    policy = AdaptiveBatchSize(max_batch_size=8, min_speedup=0.1, settle_windows=1,
                               cooldown_epochs=0.001, scale_lr="none")
    h = plan.fit(tiny_data(640), 1, progress=False, metrics_every=2,
                 policies=[Ramp(), MoreReplicasAt6(), policy])
    assert [p.changes for p in h.policy] == [{"replicas_per_device": 2}, {"batch_size": 8},
                                             {"batch_size": 4}]
    assert plan.batch_size == 4


def test_adaptive_batch_size_speed_rule_validated():
    with pytest.raises(ValueError, match="min_speedup"):
        AdaptiveBatchSize(min_speedup=-0.1)
    for bad in (True, "0.1", 10):
        with pytest.raises(ValueError, match="min_speedup"):
            AdaptiveBatchSize(min_speedup=bad)
    with pytest.raises(ValueError, match="speed_windows"):
        AdaptiveBatchSize(speed_windows=0)
    assert AdaptiveBatchSize().min_speedup is None  # off by default: decisions without a clock


# -- DivergenceGuard -----------------------------------------------------------------------------


class Poison(Hook):
    """After round ``round`` sets replica 1 of device 0 to ``value`` (NaN) or adds ``shift``."""

    mutates_replicas = True

    def __init__(self, round: int, *, value: float | None = None, shift: float = 0.0) -> None:
        self.round, self.value, self.shift = round, value, shift

    def after_round(self, ctx):
        if ctx.plan.rounds_done == self.round:
            s = ctx.plan.states[0]
            if self.value is not None:
                s.w[1] = self.value
            else:
                s.w[1] += self.shift


@pytest.mark.parametrize("executor", ["inline", "process"])
def test_nan_replica_is_reset_and_training_goes_on(executor):
    plan = make_plan(devices=1, replicas=2, executor=executor)
    snap = Snapshots()
    h = plan.fit(tiny_data(8 * 12), 1, progress=False, hooks=[Poison(4, value=float("nan")), snap],
                 policies=[DivergenceGuard()], metrics_every=None)
    assert [(f.round, f.replica) for f in h.faults] == [(4, 1)]  # found in the next round (t = 4)
    z = plan.central_weights()
    assert torch.isfinite(z).all() and torch.isfinite(plan.replica_weights()).all()
    assert all(torch.isfinite(r["z"][0]).all() for r in snap.rounds)
    assert plan.rounds_done == 12


@pytest.mark.parametrize("executor", ["inline", "process"])
def test_diverged_replica_is_left_out_of_the_average(executor):
    """A finite replica far from z (‖ŵ − z‖/‖z‖ = 50) is reset before its correction: z moves as
    if only the healthy replica had been averaged (with the guard off, z jumps by ~α·50·‖z‖)."""
    moves = {}
    for guard in (True, False):
        plan = make_plan(devices=1, replicas=2, executor=executor)
        snap = Snapshots()
        z0 = plan.central_weights()
        policies = [DivergenceGuard(max_divergence=5.0, loss_factor=None)] if guard else []
        h = plan.fit(tiny_data(8 * 6), 1, shuffle=False, progress=False,
                     hooks=[Poison(3, shift=50 * float(z0.norm()) / math.sqrt(z0.numel())), snap],
                     policies=policies, metrics_every=None)
        z3, z4 = snap.rounds[2]["z"][0], snap.rounds[3]["z"][0]
        moves[guard] = float((z4 - z3).norm() / z3.norm())
        if guard:
            assert [(f.round, f.replica) for f in h.faults] == [(3, 1)]
            torch.testing.assert_close(snap.rounds[3]["w"][0][1], z3)  # reset to the z it met
    assert moves[True] < 0.5 and moves[False] > 5


def test_exploding_loss_replica_is_reset_after_the_round():
    plan = make_plan(devices=1, replicas=2, executor="inline", optimizer=cg.SGD(lr=0.05, momentum=0.0))
    z0 = plan.central_weights()
    h = plan.fit(tiny_data(8 * 6), 1, shuffle=False, progress=False,
                 hooks=[Poison(2, shift=30 * float(z0.norm()) / math.sqrt(z0.numel()))],
                 policies=[DivergenceGuard(max_divergence=None, loss_factor=10.0)],
                 metrics_every=None)
    faults = [(f.round, f.replica) for f in h.faults]
    assert faults and all(r == 1 and t in (2, 3) for t, r in faults)  # its next round or the one after
    assert torch.isfinite(plan.central_weights()).all()


# -- by name -------------------------------------------------------------------------------------


def test_parse_policy():
    p = parse_policy("adaptive_batch:max_batch_size=128,scale_lr=false")
    assert isinstance(p, AdaptiveBatchSize) and p.max_batch_size == 128 and p.scale_lr == "none"
    assert parse_policy("adaptive_batch:scale_lr=none").scale_lr == "none"  # 'none' parses as None
    assert parse_policy("adaptive_batch:scale_lr=linear,reference_batch=32").reference_batch == 32
    p = parse_policy("multistep_lr:milestones=3/4,warmup_epochs=1")
    assert p.milestones == [3, 4] and p.warmup_epochs == 1
    assert isinstance(parse_policy("auto_replicas:threshold=0.2"), cg.AutoReplicas)
    with pytest.raises(ValueError, match="known: auto_replicas"):
        parse_policy("bogus")
    with pytest.raises(ValueError, match="KEY=VALUE"):
        parse_policy("step_lr:2")
    with pytest.raises(ValueError, match="unexpected keyword"):
        parse_policy("step_lr:steps=2")


def test_auto_replicas_policy_grows_m():
    """The tuner as a policy, with a deterministic clock where samples/s rise with m."""
    from crossbow_graph.tuning.autotune import AutoTune

    pol = cg.AutoReplicas(AutoTune(warmup_rounds=1, min_window_rounds=2, window_s=1e-9, max_replicas=3,
                                   try_other_mode=False))
    clock = {"t": 0.0}

    def tick(ctx):
        return clock["t"]

    class Clock(Hook):
        mutates_replicas = False

        def before_round(self, ctx):
            clock["t"] += 1.0 / ctx.plan.replicas_per_device  # rounds get cheaper per sample

    pol.clock = tick
    plan = make_plan(devices=1, replicas=1, executor="inline")
    h = plan.fit(tiny_data(4 * 60), 1, progress=False, hooks=[Clock()], policies=[pol],
                 metrics_every=None)
    assert plan.replicas_per_device == 3  # each gain confirmed by a second look at m − 1 (A B A)
    assert [p.changes["replicas_per_device"] for p in h.policy] == [2, 1, 3, 2, 3]


def test_cli_policy_flag(capsys):
    from crossbow_graph.cli import build_parser, main

    args = build_parser().parse_args(["train", "--policy", "adaptive_batch", "--policy", "step_lr:gamma=0.5"])
    assert args.policy == ["adaptive_batch", "step_lr:gamma=0.5"]
    assert main(["train", "--policy", "nope", "--quiet"]) == 2
    assert "unknown policy 'nope'" in capsys.readouterr().err


def test_adaptive_batch_size_moves_a_start_outside_its_bounds_into_them():
    """A start above max_batch_size is moved to it before the first round (η unchanged), and every
    batch of the fit is then of the bound's size; a plan of k = 1 without the tuner is refused."""
    sizes = []

    class Record(Hook):
        def before_round(self, ctx):
            sizes.append(ctx.plan.batch_size)

    plan = make_plan(batch_size=16, devices=1, replicas=2, executor="inline")
    h = plan.fit(tiny_data(64), 1, progress=False, hooks=[Record()], metrics_every=5,
                 policies=[AdaptiveBatchSize(max_batch_size=8)])
    assert sizes and set(sizes) == {8}
    first = h.policy[0]
    assert (first.round, first.changes) == (0, {"batch_size": 8}) and "outside" in first.reason
    assert plan.settings.lr == 0.05
    single = make_plan(batch_size=4, devices=1, replicas=1, executor="inline")
    with pytest.raises(ValueError, match="k = 1"):
        single.fit(tiny_data(16), 1, progress=False, policies=[AdaptiveBatchSize()])
