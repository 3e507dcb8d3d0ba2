"""SMA's η rule (docs/design-overview.md §2, "How α, μ_z and η follow k"): each round steps at the
optimizer's lr × √min(k, 16), ramped over a quarter epoch after every change of k, recorded in
History.lr_rule; ``SMA(scale_lr=False)`` keeps the lr as set (oracle: hand-written SMA)."""

from __future__ import annotations

import math
import shutil

import pytest
import torch

import crossbow_graph as cg
from crossbow_graph.cli import build_parser
from crossbow_graph.cli_sync import sync_of
from crossbow_graph.training.hooks import Hook

from _plans import TinyNet, make_plan, tiny_data
from _reference import batches_of, flat, reference_sma, rule_lrs

TOL = dict(rtol=1e-5, atol=1e-6)
LR, B = 0.05, 4
KS = [2] * 4 + [8] * 6  # m = 2 for four rounds, then plan.adjust to m = 8
N = B * sum(KS)  # one epoch: 224 samples, a ramp of 56


class _Adjust(Hook):
    """plan.adjust(Adjustment(**changes)) after the given round, as a policy or the tuner does."""

    def __init__(self, after: int, **changes) -> None:
        self.after, self.changes = after, changes

    def after_round(self, ctx):
        if ctx.plan.rounds_done == self.after:
            ctx.plan.adjust(cg.Adjustment(**self.changes))


def _fit(sync: cg.SMA):
    plan = make_plan(replicas=2, executor="inline", learner_mode="fused", sync=sync)
    hist = plan.fit(tiny_data(N), 1, shuffle=False, progress=False,
                    hooks=[_Adjust(4, replicas_per_device=8)])
    assert plan.rounds_done == len(KS)
    return plan, hist


def test_a_change_of_m_in_mid_fit_ramps_eta_to_sqrt_k_and_history_records_it():
    plan, hist = _fit(cg.SMA())
    want = rule_lrs(LR, KS, B, N)
    assert hist.lr == pytest.approx(want, rel=1e-12)
    assert hist.lr[0] == LR and hist.lr[3] < LR * math.sqrt(2)  # the first ramp, unfinished
    assert LR * math.sqrt(2) < hist.lr[5] < LR * math.sqrt(8)  # the second, under way
    assert hist.lr[-1] == pytest.approx(LR * math.sqrt(8), rel=1e-12)
    assert plan.optimizer.param_groups[0]["lr"] == LR  # the user's η₁ is not written
    first, second = hist.lr_rule
    # α: 0.8 of the pull's stability bound 2(1 + μ_z)/(1 + k + μ_z) at μ_z = 0.9, at least 0.5;
    # β: k·α, at most 0.8 of (1 + μ_z)(2 − α) (design §2)
    assert (first.round, first.num_learners, first.factor_from, first.ramp_samples) \
        == (0, 2, 1.0, N // 4)
    assert first.alpha == pytest.approx(0.8 * 2 * 1.9 / 3.9, rel=1e-12)
    assert first.centre_rate == pytest.approx(2 * first.alpha, rel=1e-12)
    assert first.factor_to == pytest.approx(math.sqrt(2))
    assert (second.round, second.num_learners, second.ramp_samples) == (4, 8, N // 4)
    assert second.alpha == 0.5  # the floor: 0.8 of the bound is 0.31 at k = 8
    assert second.centre_rate == pytest.approx(0.8 * 1.9 * 1.5, rel=1e-12)  # not k·α = 4
    assert second.factor_from == pytest.approx(want[3] / LR)
    assert second.factor_to == pytest.approx(math.sqrt(8))
    assert second.epoch == pytest.approx(4 * 2 * B / N)
    torch.manual_seed(0)
    z, _ = reference_sma(TinyNet(), batches_of(tiny_data(N), B), ks=KS, lr=LR, momentum=0.9,
                         epoch_samples=N)
    torch.testing.assert_close(plan.central_weights(), flat(z), **TOL)


def test_scale_lr_false_steps_at_the_optimizers_lr_at_every_k():
    plan, hist = _fit(cg.SMA(scale_lr=False))
    assert hist.lr == [LR] * len(KS) and hist.lr_rule == []
    torch.manual_seed(0)
    z, _ = reference_sma(TinyNet(), batches_of(tiny_data(N), B), ks=KS, lr=LR, momentum=0.9,
                         scale_lr=False)
    torch.testing.assert_close(plan.central_weights(), flat(z), **TOL)


def test_a_second_fit_at_the_same_k_keeps_the_factor_and_records_nothing():
    plan = make_plan(replicas=4, executor="inline")
    first = plan.fit(tiny_data(64), 1, shuffle=False, progress=False)
    second = plan.fit(tiny_data(64), 1, shuffle=False, progress=False)
    assert [r.factor_to for r in first.lr_rule] == [2.0] and second.lr_rule == []
    assert second.lr == [LR * 2.0] * 4
    assert "SMA(α=0.5153, μ_z=0.9, every 1 round(s), lr × √min(k, 16))" in plan.summary()


def test_one_learner_has_no_factor():
    plan = make_plan(replicas=1, executor="inline")
    hist = plan.fit(tiny_data(32), 1, shuffle=False, progress=False)
    assert hist.lr == [LR] * 8 and hist.lr_rule == []
    assert "round(s))" in plan.summary() and "√min" not in plan.summary()


def test_scale_lr_not_a_bool_is_a_type_error():
    with pytest.raises(TypeError, match="scale_lr"):
        cg.SMA(scale_lr="yes")


class _StopAfter(Hook):
    def __init__(self, n: int) -> None:
        self.n = n

    def after_round(self, ctx):
        ctx.stop = ctx.plan.rounds_done >= self.n


def test_a_checkpoint_keeps_the_ramp_and_an_opted_out_plan_ignores_it(tmp_path):
    """A fit stopped inside the ramp (after 3 of its 4 rounds) and resumed continues it exactly
    (the factor and the ramp are in the checkpoint); the same checkpoint resumed by a plan with
    SMA(scale_lr=False) steps at the lr as set."""
    data = tiny_data(256)
    whole = make_plan(replicas=4, executor="inline").fit(data, 1, shuffle=False, progress=False)
    lrs = {}
    for name, sync in (("default", cg.SMA()), ("opted out", cg.SMA(scale_lr=False))):
        fit = dict(shuffle=False, progress=False, checkpoint_dir=str(tmp_path / name),
                   checkpoint_every=1)
        make_plan(replicas=4, executor="inline").fit(data, 1, hooks=[_StopAfter(3)], **fit)
        lrs[name] = make_plan(replicas=4, executor="inline", sync=sync).fit(
            data, 1, hooks=[_StopAfter(99)], resume=True, **fit).lr  # the checkpoint's 3 too
    assert whole.lr[1] < whole.lr[3] < LR * 2 == whole.lr[-1]  # the ramp takes 4 rounds of 16
    assert lrs["default"] == whole.lr
    assert lrs["opted out"] == whole.lr[:3] + [LR] * 13


def test_ssgd_opts_into_the_rule_and_steps_as_sgd_on_k_b_at_the_rules_lr():
    """``SSGD(scale_lr=True)`` steps each round at the rule's η through a change of m in mid-fit,
    recorded in History.lr_rule (α = 0): one SGD step on the round's k·b samples, as eager
    torch.optim.SGD at that η; ``SSGD()`` keeps the lr as set."""
    plan = make_plan(replicas=2, executor="inline", learner_mode="fused",
                     sync=cg.SSGD(scale_lr=True))
    hist = plan.fit(tiny_data(N), 1, shuffle=False, progress=False,
                    hooks=[_Adjust(4, replicas_per_device=8)])
    want = rule_lrs(LR, KS, B, N)
    assert hist.lr == pytest.approx(want, rel=1e-12)
    assert [(r.round, r.num_learners, r.alpha) for r in hist.lr_rule] == [(0, 2, 0.0), (4, 8, 0.0)]
    torch.manual_seed(0)
    reference = TinyNet()
    sgd = torch.optim.SGD(reference.parameters(), lr=LR, momentum=0.9)
    batches, start = batches_of(tiny_data(N), B), 0
    for k, lr in zip(KS, want):
        x = torch.cat([bx for bx, _ in batches[start:start + k]])
        y = torch.cat([by for _, by in batches[start:start + k]])
        start += k
        sgd.param_groups[0]["lr"] = lr
        sgd.zero_grad()
        torch.nn.functional.cross_entropy(reference(x), y).backward()
        sgd.step()
    torch.testing.assert_close(plan.central_weights(), flat(reference), **TOL)
    plain = make_plan(replicas=2, executor="inline", learner_mode="fused", sync=cg.SSGD())
    assert plain.fit(tiny_data(N), 1, shuffle=False, progress=False).lr == [LR] * (N // (2 * B))
    with pytest.raises(TypeError, match="scale_lr"):
        cg.SSGD(scale_lr=1)
    args = build_parser().parse_args(["train", "--sync", "ssgd", "--scale-lr"])
    assert sync_of(args) == cg.SSGD(scale_lr=True)  # the CLI's flag, from the field


def test_a_change_of_alpha_alone_is_recorded_with_its_beta_and_leaves_the_ramp_as_it_was():
    """Adjustment(alpha=0.3) at k = 8 in mid-ramp: History.lr_rule gains a record with α = 0.3 and
    β = k·α = 2.4 (a user's α: CROSSBOW's update), the factor in force at both ends and no ramp;
    every round's η is the fit's without the change."""
    _, plain = _fit(cg.SMA())
    plan = make_plan(replicas=2, executor="inline", learner_mode="fused", sync=cg.SMA())
    hist = plan.fit(tiny_data(N), 1, shuffle=False, progress=False,
                    hooks=[_Adjust(4, replicas_per_device=8), _Adjust(6, alpha=0.3)])
    assert hist.lr == plain.lr
    assert hist.lr_rule[:2] == plain.lr_rule and len(hist.lr_rule) == 3
    third = hist.lr_rule[2]
    assert (third.round, third.num_learners, third.ramp_samples) == (6, 8, 0)
    assert third.alpha == 0.3 and third.centre_rate == pytest.approx(2.4, rel=1e-12)
    assert third.factor_from == third.factor_to == pytest.approx(plain.lr[5] / LR, rel=1e-12)
    assert math.sqrt(2) < third.factor_to < math.sqrt(8)  # inside the ramp


def test_a_fit_stopped_after_a_change_of_alpha_and_resumed_records_it_as_the_whole_fit(tmp_path):
    """Adjustment(alpha=0.3) after round 5 of 8, the fit stopped there (the checkpoint holds the
    last round's α and β) and resumed: History.lr_rule and every round's η are the uninterrupted
    fit's; a plan compiled with another α resuming the checkpoint records its own at once."""
    data, first, second = tiny_data(128), tmp_path / "a", tmp_path / "b"

    def plan(sync=cg.SMA()):
        return make_plan(replicas=4, executor="inline", sync=sync)

    def fit(plan, folder, hooks, **resume):
        return plan.fit(data, 1, shuffle=False, progress=False, checkpoint_dir=str(folder),
                        checkpoint_every=1, hooks=hooks, **resume)

    whole = plan().fit(data, 1, shuffle=False, progress=False, hooks=[_Adjust(5, alpha=0.3)])
    fit(plan(), first, [_Adjust(5, alpha=0.3), _StopAfter(5)])
    shutil.copytree(first, second)
    resumed = fit(plan(), first, [], resume=True)
    assert [(r.round, r.alpha) for r in whole.lr_rule][-1] == (5, 0.3) and len(whole.lr_rule) == 2
    assert resumed.lr_rule == whole.lr_rule and resumed.lr == whole.lr
    with pytest.warns(UserWarning, match="alpha 0.2"):
        other = fit(plan(cg.SMA(alpha=0.2)), second, [], resume=True)
    assert [(r.round, r.alpha) for r in other.lr_rule][1:] == [(5, 0.2)]


def test_ssgd_resumed_inside_the_ramp_equals_the_uninterrupted_fit_bit_for_bit(tmp_path):
    """``SSGD(scale_lr=True)`` stopped after 3 rounds of a 4-round ramp and resumed steps at the
    uninterrupted fit's η every round, ends with its weights bit for bit, and its History keeps
    the checkpoint's ``lr_rule`` record (the change of k that began the ramp)."""
    data = tiny_data(256)

    def plan():
        return make_plan(replicas=4, executor="inline", sync=cg.SSGD(scale_lr=True))

    whole_plan = plan()
    whole = whole_plan.fit(data, 1, shuffle=False, progress=False)
    fit = dict(shuffle=False, progress=False, checkpoint_dir=str(tmp_path), checkpoint_every=1)
    plan().fit(data, 1, hooks=[_StopAfter(3)], **fit)
    resumed_plan = plan()
    resumed = resumed_plan.fit(data, 1, hooks=[_StopAfter(99)], resume=True, **fit)
    assert whole.lr[0] < whole.lr[2] < LR * 2 == whole.lr[-1]  # the checkpoint is inside the ramp
    assert resumed.lr == whole.lr
    assert resumed.lr_rule == whole.lr_rule and len(whole.lr_rule) == 1
    assert torch.equal(resumed_plan.central_weights(), whole_plan.central_weights())
