"""The hook contract (training/hooks.py), the fit's progress (training/progress.py) and the one
owner of η (engine/settings.py RunSettings): what a hook declares is what the fit relies on, and
every η change composes by one rule (docs/optimizers.md, Schedules)."""

from __future__ import annotations

import pytest
import torch

import crossbow_graph as cg
from crossbow_graph.training.hooks import FitContext, Hook
from crossbow_graph.training.lr_schedule import LRSchedulerHook
from crossbow_graph.training.progress import FitProgress

from _plans import make_plan, tiny_data
from _reference import rule_lrs

ROUNDS = 10  # rounds per epoch of the process-executor fits: 2 learners × b = 4


def _sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def _process_fit(hooks=(), epochs=2, **kw):
    plan = make_plan(replicas=2, executor="process", optimizer=_sgd)
    sched = torch.optim.lr_scheduler.LambdaLR(plan.optimizer, lambda t: 1.0 / (1 + t))
    plan.fit(tiny_data(4 * 2 * ROUNDS), epochs, shuffle=False, progress=False, metrics_every=None,
             lr_scheduler=sched, lr_scheduler_interval="round", hooks=list(hooks), **kw)
    return plan


def test_a_process_fit_with_an_lr_scheduler_learns_the_next_round_ahead():
    """LRSchedulerHook declares mutates_replicas = False: every round of an epoch but its first
    was learned while the round before synchronised, and the result is the inline executor's."""
    plan = _process_fit()
    assert LRSchedulerHook.mutates_replicas is False
    assert plan.rounds.clock.learned_ahead == 2 * (ROUNDS - 1)
    inline = make_plan(replicas=2, executor="inline", optimizer=_sgd)
    sched = torch.optim.lr_scheduler.LambdaLR(inline.optimizer, lambda t: 1.0 / (1 + t))
    inline.fit(tiny_data(4 * 2 * ROUNDS), 2, shuffle=False, progress=False, metrics_every=None,
               lr_scheduler=sched, lr_scheduler_interval="round")
    assert inline.settings.lr == plan.settings.lr == pytest.approx(0.05 / (2 * ROUNDS + 1))
    torch.testing.assert_close(plan.replica_weights(), inline.replica_weights(), rtol=1e-5,
                               atol=1e-6)


class _Halve(Hook):
    """Halves replica 0's weights in place after round 3 (a direct write of w)."""

    mutates_replicas = False

    def after_round(self, ctx):
        if ctx.plan.rounds_done == 3:
            ctx.plan.states[0].w[0].mul_(0.5)


class _HalveDeclared(_Halve):
    mutates_replicas = True


def test_a_hook_that_writes_replicas_without_declaring_it_is_stopped_naming_it():
    with pytest.raises(cg.HookError, match=r"_Halve.after_round wrote the replicas \(w, v or z\) "
                                           r"after round 2 while worker processes learned round 3 "
                                           r"from them, but _Halve declares mutates_replicas = "
                                           r"False; set mutates_replicas = True on _Halve"):
        _process_fit([_Halve()], epochs=1)


def test_a_hook_that_declares_its_writes_runs_without_the_overlap():
    plan = _process_fit([_HalveDeclared()], epochs=1)
    assert plan.rounds_done == ROUNDS and plan.rounds.clock.learned_ahead == 0


class _ResetThrough(Hook):
    """Resets replica 1 through the engine's interface, which cancels the round learned ahead."""

    mutates_replicas = False

    def after_round(self, ctx):
        if ctx.plan.rounds_done == 3:
            ctx.plan.rounds.reset_replicas([[1]])


def test_a_reset_through_the_scheduler_is_allowed_and_cancels_the_round_learned_ahead():
    plan = _process_fit([_ResetThrough()], epochs=1)
    # round 4 was learned ahead from the old replica 1 and cancelled; the others were kept
    assert plan.rounds_done == ROUNDS and plan.rounds.clock.learned_ahead == ROUNDS - 2


def test_divergence_guard_resets_through_the_engine_and_keeps_the_overlap():
    plan = _process_fit(policies=[cg.DivergenceGuard(max_divergence=None, loss_factor=10.0)],
                        epochs=1)
    assert cg.DivergenceGuard.mutates_replicas is False
    assert plan.rounds.clock.learned_ahead == ROUNDS - 1 and plan.rounds.max_divergence is None


def test_the_hook_contract_has_documented_defaults_and_typed_context():
    seen = {}

    class Look(Hook):
        mutates_replicas = False

        def after_round(self, ctx: FitContext):
            seen.update(metrics=ctx.metrics, n=ctx.num_samples, end=ctx.end_epoch,
                        losses=len(ctx.round_losses))

    hook = Hook()
    assert hook.mutates_replicas is True and hook.wants_gradients(1) is False
    assert hook.state_dict() == {} and hook.load_state_dict({}) is None
    monitor = cg.MetricsMonitor(5)
    plan = make_plan(replicas=2, executor="inline")
    plan.fit(tiny_data(64), 2, progress=False, hooks=[Look()], metrics_every=monitor)
    assert seen == {"metrics": monitor, "n": 64, "end": 2, "losses": 2}
    assert not hasattr(FitContext(plan=plan, history=cg.History()), "extra")


def test_an_object_with_hook_methods_that_is_not_a_hook_is_refused():
    class Duck:
        def __getattr__(self, name):
            return lambda *a: None

    with pytest.raises(TypeError, match=r"hooks: .*Duck.* is not a hook \(not a "
                                        r"crossbow_graph.Hook\): .*subclass crossbow_graph.Hook"):
        make_plan().fit(tiny_data(32), 1, progress=False, hooks=[Duck()])


def test_auto_replicas_is_the_plans_tuner_class_and_checkpoints_its_rule():
    tuner = cg.AutoReplicas(threshold=0.2)
    plan = make_plan(replicas="auto")
    assert isinstance(tuner, type(plan.autotuner)) and isinstance(plan.autotuner, cg.Policy)
    assert tuner.state_dict() == tuner.rule.state_dict() and tuner.state_dict()


def test_fit_progress_is_one_object_the_plans_attributes_read():
    plan = make_plan(replicas=2, executor="inline")
    plan.fit(tiny_data(4 * 2 * 5 + 3), 2, progress=False, metrics_every=None)
    assert plan.progress == FitProgress(epochs_done=2, rounds_done=10, round_in_epoch=0,
                                        position_in_epoch=0,
                                        train_seconds=plan.progress.train_seconds,
                                        losses=plan.progress.losses)
    assert len(plan.progress.losses) == 5 * 2  # the last epoch's rounds × learners
    assert (plan.epochs_done, plan.rounds_done) == (2, 10) and plan.train_seconds > 0
    with pytest.raises(AttributeError):
        plan.rounds_done = 0
    state = plan.state_dict()  # the checkpoint keeps its keys
    assert {k: state[k] for k in ("epochs_done", "rounds_done", "round_in_epoch",
                                  "position_in_epoch")} == {"epochs_done": 2, "rounds_done": 10,
                                                            "round_in_epoch": 0,
                                                            "position_in_epoch": 0}
    other = make_plan(replicas=2, executor="inline")
    other.load_state_dict(state)
    assert other.progress == plan.progress


def test_a_policys_eta_composes_with_a_schedule_and_a_schedule_policy_by_one_rule():
    """η_i = F·schedule(t), F the product of the other writers' ratios: a per-round LambdaLR, a
    StepLR policy halving η at every epoch and a policy doubling η at round 3 give
    η = 0.05 · λ(t) · 0.5^epoch · 2 (from round 4 on) in every round, times SMA's η factor."""
    class Double(cg.Policy):
        def after_round(self, ctx):
            if ctx.plan.rounds_done == 3:
                self.adjust(ctx, lr=2 * ctx.plan.settings.lr)

    plan = make_plan(replicas=2, executor="inline", optimizer=_sgd)
    sched = torch.optim.lr_scheduler.LambdaLR(plan.optimizer, lambda t: 1.0 / (1 + t))
    h = plan.fit(tiny_data(4 * 2 * 4), 3, shuffle=False, progress=False, metrics_every=None,
                 policies=[cg.StepLR(step_epochs=1, gamma=0.5, reset_on_drop=False), Double()],
                 lr_scheduler=sched, lr_scheduler_interval="round")
    factors = rule_lrs(1.0, [2] * 12, 4, 32)  # SMA's η factor at k = 2: 1, then √2
    expected = [0.05 / (1 + t) * 0.5 ** (t // 4) * (2 if t >= 3 else 1) * f
                for t, f in zip(range(12), factors)]
    assert h.lr == pytest.approx(expected, rel=1e-12)
