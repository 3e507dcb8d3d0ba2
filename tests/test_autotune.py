"""The replica auto-tuner, driven by a deterministic clock (no timing in tests)."""

from __future__ import annotations

import random
import statistics

import pytest
import torch

import crossbow_graph as cg
from crossbow_graph.compiler.tasks import TaskKind
from crossbow_graph.training.hooks import Hook
from crossbow_graph.tuning.autotune import AutoTuner
from crossbow_graph.tuning.autotune_rule import (Measurement, Setting, TuningRule, exceeds,
                                                 sub_window_rates, verdict)

from _plans import make_plan, tiny_data

FAST = dict(warmup_rounds=2, window_s=3.0, min_window_rounds=3)


class _Clock:
    """Training seconds: each round costs ``per_round(k)`` seconds; ``speed`` scales them."""

    def __init__(self, per_round) -> None:
        self.per_round, self.speed, self.round, self.t = per_round, 1.0, 0, 0.0

    def __call__(self, ctx) -> float:
        if ctx.plan.rounds_done != self.round:
            self.round = ctx.plan.rounds_done
            self.t += self.per_round(ctx.plan.num_learners) / self.speed
        return self.t


class _Watch(Hook):
    """Records m per round, checks the task graph matches it, stops after ``decisions``."""

    def __init__(self, tuner: AutoTuner, decisions: int, on_hold=None) -> None:
        self.tuner, self.decisions, self.on_hold, self.ms = tuner, decisions, on_hold, []

    def after_round(self, ctx):
        plan = ctx.plan
        self.ms.append(plan.replicas_per_device)
        learns = sum(1 for _, t in plan.task_graph.nodes(data="task") if t.kind is TaskKind.LEARN)
        assert learns == plan.num_learners == sum(s.m for s in plan.states)
        if self.on_hold and self.tuner.phase == "hold":
            self.on_hold(ctx)
        if len(self.tuner.decisions) >= self.decisions:
            ctx.stop = True


def _tuned_plan(clock, **kw):
    plan = make_plan(replicas="auto", executor="inline", autotune=cg.AutoTune(**FAST), **kw)
    plan.autotuner.clock = clock
    return plan


def test_tuner_grows_while_throughput_rises_and_stops_at_the_memory_bound():
    mem = make_plan(replicas=1).task_graph.graph["memory_per_learner_bytes"]
    plan = _tuned_plan(_Clock(lambda k: 1.0), memory_budget=3 * mem + 1)  # rate ∝ k
    assert plan.replicas_per_device == 1 and plan.max_replicas_per_device == 3
    watch = _Watch(plan.autotuner, 9)
    hist = plan.fit(tiny_data(4000), 1, progress=False, hooks=[watch])
    actions = [(d.action, d.next_replicas_per_device, d.next_learner_mode) for d in hist.autotune]
    assert actions == [("add", 2, "per_replica"), ("confirm", 1, "per_replica"),
                       ("confirmed_add", 2, "per_replica"), ("add", 3, "per_replica"),
                       ("confirm", 2, "per_replica"), ("confirmed_add", 3, "per_replica"),
                       ("bound", 3, "per_replica"), ("try_mode", 3, "fused"),
                       ("revert_mode", 3, "per_replica")]
    assert max(watch.ms) == 3 and plan.replicas_per_device == 3
    assert plan.learner_mode == "per_replica" and plan.autotuner.phase == "hold"
    rates = [d.samples_per_s for d in hist.autotune]
    assert rates[0] == pytest.approx(4.0) and rates[1] == pytest.approx(8.0)  # k·b per second


def test_tuner_removes_the_last_replica_when_throughput_does_not_rise_and_reprobes_on_drift():
    """Throughput flat in m: add, remove, the other mode, hold. Once the reference of the held
    configuration is measured (after the warm-up of 2 rounds, its first 2 windows of 3 rounds),
    the machine gets twice as fast: 3 windows in a row above it re-probe, from a fresh window."""
    clock = _Clock(lambda k: float(k))  # time ∝ k: throughput flat in m
    held_rounds = [0]

    def slow_down(ctx):
        held_rounds[0] += 1
        if held_rounds[0] > 8:
            clock.speed = 2.0  # the machine gets faster: throughput doubles → drift

    plan = _tuned_plan(clock)
    watch = _Watch(plan.autotuner, 7, on_hold=slow_down)
    hist = plan.fit(tiny_data(4000), 1, progress=False, hooks=[watch])
    actions = [(d.action, d.replicas_per_device, d.next_replicas_per_device) for d in hist.autotune]
    assert actions[:4] == [("add", 1, 2), ("remove", 2, 1), ("try_mode", 2, 1),
                           ("revert_mode", 1, 1)]
    assert actions[4:7] == [("drift", 1, 1), ("add", 1, 2), ("remove", 2, 1)]  # mode tried once
    drift, add = hist.autotune[4:6]
    assert drift.samples_per_s == add.samples_per_s == pytest.approx(2 * hist.autotune[0].samples_per_s)
    assert add.round - drift.round == 12  # two fresh windows of m = 1 (3 s at 0.5 s a round) first
    assert plan.autotuner.phase == "hold"


def test_holding_reprobes_only_on_three_windows_off_beyond_the_spread():
    """While holding, the first 2 windows form the reference; a window counts as off only when
    its median is more than 10 % away from it and the intervals do not overlap; 3 such windows
    in a row, on the same side, re-probe from a fresh window. A window of 150 scattered over
    60–240 is not off; one of 150 ± 2 is."""
    rule = TuningRule(threshold=0.10, repeats=2, reprobe=True, try_other_mode=False)
    rule.phase, rule.mode_tried = "hold", True
    at = Setting(1, "per_replica", 4)
    steady = Measurement((99.0, 101.0) * 4)
    scattered = Measurement((60.0, 240.0, 150.0, 70.0, 230.0, 150.0, 80.0, 220.0))
    above, below = Measurement((148.0, 152.0) * 4), Measurement((48.0, 52.0) * 4)
    windows = (steady, steady, scattered, scattered, above, above, below, above, scattered,
               above, above, above)
    steps = [rule.decide(w, at, bound=4, fused_ok=True).steps for w in windows]
    assert scattered.samples_per_s == 150.0 and rule.held is None  # the re-probe forgot it
    assert steps[:-1] == [[]] * 11  # never 3 clear windows in a row on the same side before
    assert steps[-1] == [("drift", 1, "per_replica")]
    assert rule.phase == "grow" and rule.best is None
    fresh = rule.decide(above, at, bound=4, fused_ok=True)
    assert fresh.steps == [("add", 2, "per_replica")] and rule.best[0] == above


def test_tuner_keeps_the_other_mode_when_it_is_faster():
    clock = _Clock(lambda k: 1.0)
    plan = _tuned_plan(clock)
    plan.autotuner.config = cg.AutoTune(max_replicas=2, **FAST)
    orig = plan.adjust  # the one way a tuner changes the plan (training/fit_plan.py FitPlan)

    def faster_fused(adjustment):
        done = orig(adjustment)
        clock.per_round = (lambda k: 0.5) if plan.learner_mode == "fused" else (lambda k: 1.0)
        return done

    plan.adjust = faster_fused
    watch = _Watch(plan.autotuner, 9)
    hist = plan.fit(tiny_data(4000), 1, progress=False, hooks=[watch])
    actions = [d.action for d in hist.autotune]
    assert actions[:9] == ["add", "confirm", "confirmed_add", "bound", "try_mode", "confirm",
                           "confirmed_keep_mode", "bound", "hold"]
    assert plan.learner_mode == "fused" and plan.replicas_per_device == 2


def test_tuner_history_and_state_survive_a_real_fit():
    """No clock tricks: the default clock (training seconds) decides; only consistency is checked."""
    plan = make_plan(replicas="auto", autotune=cg.AutoTune(warmup_rounds=2, warmup_s=0.0, window_s=0.01,
                                                           min_window_rounds=2, max_replicas=3))
    data = tiny_data(600)
    hist = plan.fit(data, 1, shuffle=False, progress=False)
    assert hist.autotune, "the tuner took no decision"
    for d in hist.autotune:
        assert 1 <= d.next_replicas_per_device <= 3 and d.samples_per_s > 0
    assert plan.replicas_per_device == hist.autotune[-1].next_replicas_per_device
    assert torch.isfinite(plan.central_weights()).all()
    assert hist.epochs[0].replicas_per_device == plan.replicas_per_device


def test_autotune_settings_are_checked():
    with pytest.raises(ValueError, match="threshold"):
        cg.AutoTune(threshold=0)
    with pytest.raises(ValueError, match="warmup_s"):
        cg.AutoTune(warmup_s=-1)
    with pytest.raises(ValueError, match="sub_windows=0"):
        cg.AutoTune(sub_windows=0)
    with pytest.raises(ValueError, match="repeats=-1"):
        cg.AutoTune(repeats=-1)
    with pytest.raises(ValueError, match=r"repeats=1\.5\): must be a whole number ≥ 0"):
        cg.AutoTune(repeats=1.5)
    with pytest.raises(ValueError, match=r"windows=0"):
        cg.AutoTune(windows=0)
    with pytest.raises(ValueError, match="replicas"):
        make_plan(replicas="many")


def test_tuner_warms_up_for_warmup_s_as_well_as_warmup_rounds():
    first = {}
    for warmup_s in (0.0, 1.0):
        plan = make_plan(replicas="auto", executor="inline", autotune=cg.AutoTune(
            warmup_rounds=2, warmup_s=warmup_s, window_s=3.0, min_window_rounds=3))
        plan.autotuner.clock = _Clock(lambda k: 0.25)  # seconds per round
        hist = plan.fit(tiny_data(4000), 1, progress=False, hooks=[_Watch(plan.autotuner, 1)])
        first[warmup_s] = hist.autotune[0].round
    # warm-up ends at round 2 (2 rounds) or at round 5 (1.0 s after round 1); then two windows of
    # 12 rounds (3 s each)
    assert first == {0.0: 26, 1.0: 29}


def test_measurement_is_the_median_and_its_notch():
    """Eight sub-windows 100, 200, ..., 800: median 450, quartiles 275 and 625 (inclusive), so
    the interval is 450 ± 1.58·350/√8; pooling two windows halves √n's share; one sub-window
    has no spread. A window's rounds split into runs as equal as can be."""
    m = Measurement(tuple(100.0 * i for i in range(1, 9)))
    assert m.samples_per_s == 450.0
    assert m.spread == pytest.approx(1.58 * 350 / 8 ** 0.5)
    assert (m.low, m.high) == (pytest.approx(450 - m.spread), pytest.approx(450 + m.spread))
    both = m.pooled(m)
    assert both.windows == 2 and both.samples_per_s == 450.0
    assert both.spread == pytest.approx(1.58 * 350 / 16 ** 0.5, rel=0.05)
    assert Measurement((5.0,)).spread == 0.0
    assert Measurement.from_list(m.as_list()) == m
    rates = sub_window_rates([4] * 10, [1.0] * 5 + [2.0] * 5, 4)  # runs of 3, 3, 2, 2 rounds
    assert rates == (4.0, pytest.approx(12 / 4), 2.0, 2.0)


def test_a_step_counts_only_beyond_the_threshold_and_both_intervals():
    tight = Measurement((99.0, 101.0) * 4)
    assert exceeds(Measurement((119.0, 121.0) * 4), tight, 0.10)
    assert not exceeds(Measurement((108.0, 110.0) * 4), tight, 0.10)  # under the threshold
    wide = Measurement((60.0, 180.0) * 4)  # median 120, but the interval reaches below 100
    assert not exceeds(wide, tight, 0.10) and verdict(wide, tight, 0.10) == "open"
    assert verdict(Measurement((100.0, 102.0) * 4), tight, 0.10) == "none"


def test_an_open_step_is_measured_again_pooled_then_decided():
    """A step whose first window is open (median 125, interval reaching below 100) is measured
    again; pooled with a second, steadier window the gain shows, and m grows. With repeats=0
    the open window is no gain: the replica goes."""
    first = Measurement((60.0, 190.0, 70.0, 180.0, 125.0, 125.0, 65.0, 185.0))
    second = Measurement((128.0, 132.0) * 4)
    outcomes = {}
    for repeats in (2, 0):
        rule = TuningRule(threshold=0.10, repeats=repeats, reprobe=True, try_other_mode=False)
        one, two = Setting(1, "per_replica", 4), Setting(2, "per_replica", 4)
        assert rule.decide(Measurement((99.0, 101.0) * 4), one, bound=4, fused_ok=True).steps == \
            [("add", 2, "per_replica")]
        d = rule.decide(first, two, bound=4, fused_ok=True)
        outcomes[repeats] = [d.steps]
        if repeats:
            d = rule.decide(second, two, bound=4, fused_ok=True)
            outcomes[repeats].append(d.steps)
            assert d.measured.windows == 2 and d.measured.rates == first.rates + second.rates
    assert outcomes[2] == [[("repeat", 2, "per_replica")], [("confirm", 1, "per_replica")]]
    assert outcomes[0] == [[("remove", 1, "per_replica"), ("hold", 1, "per_replica")]]


SUB = 16  # sub-windows per window, AutoTune's default


def _simulate(rate, noise: float, seed: int, windows: int = 60, bound: int = 12):
    """The rule on synthetic windows: 16 sub-windows at ``rate(m)`` samples/s, each divided by a
    factor drawn from U[1 − noise, 1 + noise] (a busy host's scatter of round times); returns
    the m of every window and every step."""
    rng = random.Random(seed)
    rule = TuningRule(threshold=0.10, repeats=2, reprobe=True, try_other_mode=False)
    m, ms, steps = 1, [], []
    for _ in range(windows):
        window = Measurement(tuple(rate(m) / rng.uniform(1 - noise, 1 + noise) for _ in range(SUB)))
        d = rule.decide(window, Setting(m, "per_replica", 8), bound=bound, fused_ok=True)
        steps += d.steps
        m = d.steps[-1][1] if d.steps else m
        ms.append(m)
    return ms, steps


def test_the_rule_does_not_climb_a_noisy_plateau_and_follows_a_real_gain():
    """Throughput flat from m = 3 under ±50 % scatter of round times: in 40 seeded runs of 60
    windows m never passes 4 and re-probes stay rare; throughput ∝ m up to the bound 6 under
    ±10 % scatter: every run reaches m = 6 and stays there."""
    for seed in range(40):
        ms, steps = _simulate(lambda m: 1000.0 * min(m, 3), 0.5, seed)
        assert max(ms) <= 4, (seed, ms)
        assert sum(a == "drift" for a, _, _ in steps) <= 1, (seed, steps)
        ms, steps = _simulate(lambda m: 1000.0 * m, 0.1, seed, bound=6)
        assert ms[-1] == 6 and ms.count(6) >= 40, (seed, ms)


class _NoisyClock:
    """Training seconds: a round of k·b samples takes k·b / rate(m) seconds times a factor drawn
    from U[1 − noise, 1 + noise] (seeded), as on a busy host."""

    def __init__(self, rate, noise: float, seed: int = 0) -> None:
        self.rate, self.noise, self.rng = rate, noise, random.Random(seed)
        self.t, self.round = 0.0, 0

    def __call__(self, ctx) -> float:
        plan = ctx.plan
        if plan.rounds_done != self.round:
            self.round = plan.rounds_done
            factor = self.rng.uniform(1 - self.noise, 1 + self.noise)
            self.t += plan.num_learners * plan.batch_size / self.rate(plan.replicas_per_device) * factor
        return self.t


class _StopAfter(Hook):
    """Records m after every round and stops the fit after ``rounds``."""

    mutates_replicas = False

    def __init__(self, rounds: int) -> None:
        self.rounds, self.ms = rounds, []

    def after_round(self, ctx):
        self.ms.append(ctx.plan.replicas_per_device)
        ctx.stop = len(self.ms) >= self.rounds


def _noisy_fit(rate, noise: float, rounds: int):
    """A tuned plan (windows of 8 rounds, at most 8 replicas, one learner mode) fitted for
    ``rounds`` rounds on a ``_NoisyClock(rate, noise)``: (plan, history, m of every round,
    the decisions as (action, m, samples/s) for messages)."""
    plan = make_plan(replicas="auto", executor="inline", autotune=cg.AutoTune(
        warmup_rounds=2, warmup_s=0.0, window_s=1e-9, min_window_rounds=8, max_replicas=8,
        try_other_mode=False))
    plan.autotuner.clock = _NoisyClock(rate, noise)
    stop = _StopAfter(rounds)
    hist = plan.fit(tiny_data(4000), 20, progress=False, hooks=[stop], metrics_every=None)
    return plan, hist, stop.ms, [(d.action, d.replicas_per_device, round(d.samples_per_s))
                                 for d in hist.autotune]


def test_tuner_does_not_follow_noise_on_a_plateau():
    """The tuner in a fit, throughput flat from m = 2, round times scattered ±50 %: over 240
    rounds (windows of 8 rounds) it never goes past m = 3 and ends within one of 2; every
    decision records the interval it rested on. (A rule that compares single windows'
    samples/s, taking the better of two windows for a step that did not gain, climbs to m = 6
    on this clock.)"""
    plan, hist, ms, decisions = _noisy_fit(lambda m: 1000.0 * min(m, 2), 0.5, 240)
    assert max(ms) <= 3 and abs(plan.replicas_per_device - 2) <= 1, decisions
    for d in hist.autotune:
        assert d.samples_per_s_low <= d.samples_per_s <= d.samples_per_s_high
        assert d.samples_per_s_high > d.samples_per_s_low  # scattered windows have a spread
        assert d.windows >= 1


def test_tuner_follows_a_real_gain_through_noise():
    """Throughput ∝ m up to m = 4 (then flat), round times scattered ±10 %: in 200 rounds the
    tuner reaches m = 4 and holds at 4 or 5."""
    plan, _, ms, decisions = _noisy_fit(lambda m: 1000.0 * min(m, 4), 0.1, 200)
    assert plan.replicas_per_device in (4, 5) and max(ms) <= 5, decisions
    assert plan.autotuner.phase == "hold"


def test_a_step_needs_two_windows_and_their_medians_apart_widen_the_spread():
    """A load that changes between windows moves whole windows: the second window of m = 2 reads
    25 % below the first, so the pooled spread covers both, and m = 2's 14 % gain over m = 1 is not
    a gain; with a steady second window it is."""
    def rule():
        return TuningRule(threshold=0.10, repeats=0, reprobe=True, try_other_mode=False, windows=2)

    one, two = Setting(1, "per_replica", 8), Setting(2, "per_replica", 8)
    steady = lambda v: Measurement((v - 1.0, v + 1.0) * 8)  # noqa: E731 (a tight window)
    for second, gains in ((steady(95.0), False), (steady(127.0), True)):
        r = rule()
        assert r.decide(steady(100.0), one, bound=4, fused_ok=True).steps == []  # one window: wait
        assert r.decide(steady(100.0), one, bound=4, fused_ok=True).steps == [("add", 2, "per_replica")]
        assert r.decide(steady(125.0), two, bound=4, fused_ok=True).steps == []
        decision = r.decide(second, two, bound=4, fused_ok=True)
        assert (decision.steps[0][0] == "confirm") is gains, decision
        assert decision.measured.windows == 2
        assert decision.measured.spread >= abs(125.0 - second.samples_per_s) / 2


def test_a_gain_counts_only_if_the_configuration_before_it_is_slower_again():
    """A B A: m = 2 is measured during a dip (the host busy), m = 3 after it; going back to m = 2
    shows the dip has passed, so m = 3's gain is not confirmed and m = 2 stays. Where m = 2 is
    slow again, m = 3 counts and growing goes on."""
    steady = lambda v: Measurement((v - 1.0, v + 1.0) * 8)  # noqa: E731 (a tight window)
    two, three = Setting(2, "per_replica", 8), Setting(3, "per_replica", 8)
    for again, steps in ((2000.0, [("unconfirmed", 2, "per_replica"), ("hold", 2, "per_replica")]),
                         (1500.0, [("confirmed_add", 3, "per_replica"), ("add", 4, "per_replica")])):
        rule = TuningRule(threshold=0.10, repeats=0, reprobe=True, try_other_mode=False)
        assert rule.decide(steady(1500.0), two, bound=8, fused_ok=True).steps == \
            [("add", 3, "per_replica")]  # the dip: 1,500 where the host gives 2,000
        assert rule.decide(steady(2100.0), three, bound=8, fused_ok=True).steps == \
            [("confirm", 2, "per_replica")]
        assert rule.decide(steady(again), two, bound=8, fused_ok=True).steps == steps
        state = rule.state_dict()
        assert state["candidate"] is None and state["best"][1] == steps[0][1]
