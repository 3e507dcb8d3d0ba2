"""The replica auto-tuner, driven by a deterministic clock (no timing in tests)."""

from __future__ import annotations

import pytest
import torch

import crossbow_graph as cg
from crossbow_graph.compiler.tasks import TaskKind
from crossbow_graph.tuning.autotune import AutoTuner
from crossbow_graph.training.hooks import Hook

from _runtime_helpers import compile_tiny, tiny_data

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
    plan = compile_tiny(replicas="auto", executor="inline", autotune=cg.AutoTune(**FAST), **kw)
    plan.autotuner.clock = clock
    return plan


def test_tuner_grows_while_throughput_rises_and_stops_at_the_memory_bound():
    mem = compile_tiny(replicas=1).task_graph.graph["memory_per_learner_bytes"]
    plan = _tuned_plan(_Clock(lambda k: 1.0), memory_budget=3 * mem + 1)  # rate ∝ k
    assert plan.replicas_per_device == 1 and plan.max_replicas_per_device == 3
    watch = _Watch(plan.autotuner, 5)
    hist = plan.fit(tiny_data(4000), 1, progress=False, hooks=[watch])
    actions = [(d.action, d.next_replicas_per_device, d.next_learner_mode) for d in hist.autotune]
    assert actions == [("add", 2, "per_replica"), ("add", 3, "per_replica"),
                       ("bound", 3, "per_replica"), ("try_mode", 3, "fused"),
                       ("revert_mode", 3, "per_replica")]
    assert max(watch.ms) == 3 and plan.replicas_per_device == 3
    assert plan.learner_mode == "per_replica" and plan.autotuner.phase == "hold"
    rates = [d.samples_per_s for d in hist.autotune]
    assert rates[0] == pytest.approx(4.0) and rates[1] == pytest.approx(8.0)  # k·b per second


def test_tuner_removes_the_last_replica_when_throughput_does_not_rise_and_reprobes_on_drift():
    clock = _Clock(lambda k: float(k))  # time ∝ k: throughput flat in m

    def slow_down(ctx):
        clock.speed = 2.0  # later, the machine gets faster: throughput doubles → drift

    plan = _tuned_plan(clock)
    watch = _Watch(plan.autotuner, 7, on_hold=slow_down)
    hist = plan.fit(tiny_data(4000), 1, progress=False, hooks=[watch])
    actions = [(d.action, d.replicas_per_device, d.next_replicas_per_device) for d in hist.autotune]
    assert actions[:4] == [("add", 1, 2), ("remove", 2, 1), ("try_mode", 2, 1),
                           ("revert_mode", 1, 1)]
    assert actions[4:7] == [("drift", 1, 1), ("add", 1, 2), ("remove", 2, 1)]  # mode tried once
    assert hist.autotune[4].samples_per_s == pytest.approx(2 * hist.autotune[0].samples_per_s)
    assert plan.autotuner.phase == "hold"


def test_one_noisy_window_is_not_a_drift():
    from crossbow_graph.training.history import History
    from crossbow_graph.training.hooks import FitContext

    plan = _tuned_plan(_Clock(lambda k: 1.0))
    tuner = plan.autotuner
    tuner.phase, tuner.held, tuner.best, tuner.mode_tried = "hold", 100.0, (100.0, 1, "per_replica"), True
    ctx = FitContext(plan=plan, history=History())
    changed = [tuner._decide(ctx, rate) for rate in (150.0, 100.0, 50.0, 150.0, 95.0, 150.0, 150.0)]
    assert changed == [False] * 6 + [True]  # only two windows in a row above the band
    assert [d.action for d in tuner.decisions] == ["drift", "add"]
    assert plan.replicas_per_device == 2 and tuner.phase == "grow"


def test_tuner_keeps_the_other_mode_when_it_is_faster():
    clock = _Clock(lambda k: 1.0)
    plan = _tuned_plan(clock)
    plan.autotuner.config = cg.AutoTune(max_replicas=2, **FAST)
    orig = plan.set_learner_mode

    def faster_fused(mode):
        orig(mode)
        clock.per_round = (lambda k: 0.5) if mode == "fused" else (lambda k: 1.0)

    plan.set_learner_mode = faster_fused
    watch = _Watch(plan.autotuner, 5)
    hist = plan.fit(tiny_data(4000), 1, progress=False, hooks=[watch])
    actions = [d.action for d in hist.autotune]
    assert actions[:5] == ["add", "bound", "try_mode", "keep_mode", "bound"]
    assert plan.learner_mode == "fused" and plan.replicas_per_device == 2


def test_tuner_history_and_state_survive_a_real_fit():
    """No clock tricks: the default clock (training seconds) decides; only consistency is checked."""
    plan = compile_tiny(replicas="auto", autotune=cg.AutoTune(warmup_rounds=2, warmup_s=0.0, window_s=0.01,
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
    with pytest.raises(ValueError, match="replicas"):
        compile_tiny(replicas="many")


def test_tuner_warms_up_for_warmup_s_as_well_as_warmup_rounds():
    first = {}
    for warmup_s in (0.0, 1.0):
        plan = compile_tiny(replicas="auto", executor="inline", autotune=cg.AutoTune(
            warmup_rounds=2, warmup_s=warmup_s, window_s=3.0, min_window_rounds=3))
        plan.autotuner.clock = _Clock(lambda k: 0.25)  # seconds per round
        hist = plan.fit(tiny_data(4000), 1, progress=False, hooks=[_Watch(plan.autotuner, 1)])
        first[warmup_s] = hist.autotune[0].round
    # warm-up ends at round 2 (2 rounds) or at round 5 (1.0 s after round 1); then 12 rounds of 3 s
    assert first == {0.0: 14, 1.0: 17}


class _SlowFirstWindow:
    """Clock: 1 s per round at m = 1; at m ≥ 2, 2 s per round (no gain in samples/s) for the
    first ``slow`` rounds after a change, as if the machine were busy, then 1 s (a real gain)."""

    def __init__(self, slow: int) -> None:
        self.slow, self.t, self.round, self.m, self.since = slow, 0.0, 0, None, 0

    def __call__(self, ctx) -> float:
        plan = ctx.plan
        if plan.rounds_done != self.round:
            self.round = plan.rounds_done
            if plan.replicas_per_device != self.m:
                self.m, self.since = plan.replicas_per_device, 0
            self.since += 1
            self.t += 1.0 if self.m == 1 or self.since > self.slow else 2.0
        return self.t


@pytest.mark.parametrize("confirm", [True, False])
def test_tuner_confirms_a_step_that_did_not_gain_before_removing_it(confirm):
    plan = compile_tiny(replicas="auto", executor="inline",
                        autotune=cg.AutoTune(confirm=confirm, max_replicas=2, **FAST))
    plan.autotuner.clock = _SlowFirstWindow(slow=5)  # warm-up (2 rounds) + the first window (3)
    hist = plan.fit(tiny_data(4000), 1, progress=False, hooks=[_Watch(plan.autotuner, 2)])
    actions = [(d.action, d.next_replicas_per_device) for d in hist.autotune[:2]]
    if confirm:  # the second window at m = 2 shows the gain: m = 2 stays
        assert actions == [("add", 2), ("bound", 2)]
        assert hist.autotune[1].samples_per_s == pytest.approx(2 * hist.autotune[0].samples_per_s)
    else:  # one busy window decides
        assert actions == [("add", 2), ("remove", 1)]
