"""Resuming with other settings than the checkpoint's run (training/run_setup.py): what the
user changed since wins, with a warning naming both values; everything else, a policy's or a
scheduler's changes included, continues from the checkpoint (docs/reliability.md)."""

from __future__ import annotations

import re

import pytest
import torch

import crossbow_graph as cg
from crossbow_graph.training.checkpoint import load_latest, save_checkpoint

from _reference import rule_lrs
from test_checkpoint import (StopAfter, _DoubleBatch, _fit_interrupted_and_resumed,
                             assert_same_state, data, net_plan)



def _resume_warnings(record) -> list[str]:
    return [str(w.message) for w in record if "resuming" in str(w.message)]


def test_resume_with_another_lr_and_momentum_uses_the_new_ones_and_warns(tmp_path):
    """The same model, data and seed compiled with another η and momentum: the resumed fit runs
    with them (not the checkpoint's), warning with both values; the replicas, momenta and
    everything else continue from the checkpoint (oracle: the checkpoint's state loaded into a
    plan that then trains with the new settings)."""
    ckpt = str(tmp_path)
    net_plan().fit(data(), 2, progress=False, seed=3, hooks=[StopAfter(4)], checkpoint_dir=ckpt,
                   checkpoint_every=1)
    saved = load_latest(ckpt)[1]["plan"]
    other = dict(optimizer=cg.SGD(lr=0.01, momentum=0.5, weight_decay=1e-4))
    resumed = net_plan(**other)
    with pytest.warns(UserWarning) as record:
        h = resumed.fit(data(), 2, progress=False, seed=3, checkpoint_dir=ckpt, resume=True)
    (message,) = _resume_warnings(record)
    assert re.search(r"this fit's win: lr \(param group 0\) 0\.01 \(the checkpoint's run was set "
                     r"up with 0\.05; 0\.05 in force at the checkpoint\); momentum \(param group "
                     r"0\) 0\.5 \(.*set up with 0\.9", message), message
    assert "weight_decay" not in message  # unchanged: the checkpoint's
    # the new lr × SMA's η factor at k = 4, restored from the checkpoint: 2 (its ramp is done)
    assert h.lr[4:] == rule_lrs(0.01, [4] * 12, 4, 96)[4:] == [0.02] * 8 and resumed.optimizer.param_groups[0]["momentum"] == 0.5
    oracle = net_plan(**other)
    oracle.load_state_dict(saved)  # as saved: η 0.05, μ 0.9 …
    assert (oracle.settings.lr, oracle.optimizer.param_groups[0]["momentum"]) == (0.05, 0.9)
    oracle.adjust(cg.Adjustment(lr=0.01))  # … then the new settings
    oracle.optimizer.param_groups[0]["momentum"] = 0.5
    oracle.fit(data(), 2, progress=False, seed=3)  # the rest of epoch 1, then epoch 2
    assert oracle.rounds_done == resumed.rounds_done == 12
    assert_same_state(oracle, resumed)  # the learners' dropout draws: from (seed, round, replica)


def test_resume_after_a_policy_changed_lr_keeps_it_without_a_warning(tmp_path, recwarn):
    """Unchanged set-up: the policy's b and η of the checkpoint continue (bit-identical, see
    test_resume_continues_at_a_policy_changed_batch_size) and nothing warns."""
    def fit(plan, **kw):
        return plan.fit(data(144), 2, progress=False, seed=3, policies=[_DoubleBatch()], **kw)

    second, _ = _fit_interrupted_and_resumed(tmp_path, 5, fit)
    assert (second.batch_size, second.settings.lr) == (8, 0.1)
    assert _resume_warnings(recwarn.list) == []


def test_an_older_checkpoint_without_a_set_up_keeps_its_settings_and_warns(tmp_path):
    ckpt = str(tmp_path)
    net_plan().fit(data(), 1, progress=False, hooks=[StopAfter(4)], checkpoint_dir=ckpt,
                   checkpoint_every=4)
    path, state = load_latest(ckpt)
    del state["plan"]["setup"]  # as written before checkpoints recorded it
    save_checkpoint(path, state)
    resumed = net_plan(optimizer=cg.SGD(lr=0.01, momentum=0.9, weight_decay=1e-4))
    with pytest.warns(UserWarning, match=r"records no set-up .*: lr \(param group 0\) 0\.05 "
                                         r"\(this fit's: 0\.01\)"):
        h = resumed.fit(data(), 1, progress=False, checkpoint_dir=ckpt, resume=True)
    assert h.lr[4:] == rule_lrs(0.05, [4] * 6, 4, 96)[4:]  # × SMA's η factor at k = 4: 2


def test_resume_with_a_scheduler_over_another_lr_follows_the_new_schedule(tmp_path):
    """A LambdaLR built over another compiled η: the resumed fit continues the schedule's
    position with the new base (η = new base × f(t), from its first round), warning with both
    bases."""
    def fit(lr, **kw):
        plan = net_plan(optimizer=cg.SGD(lr=lr, momentum=0.9))
        sched = torch.optim.lr_scheduler.LambdaLR(plan.optimizer, lambda t: 1 / (1 + t))
        return plan.fit(data(), 2, progress=False, seed=3, lr_scheduler=sched,
                        lr_scheduler_interval="round", **kw)

    full = fit(0.05)
    ckpt = str(tmp_path)
    fit(0.05, hooks=[StopAfter(4)], checkpoint_dir=ckpt, checkpoint_every=1)  # hooks' state is
    # keyed by position: the resumed fit has as many before the scheduler's
    with pytest.warns(UserWarning) as record:
        h = fit(0.02, hooks=[StopAfter(10**6)], checkpoint_dir=ckpt, resume=True)
    groups, scheduler = _resume_warnings(record)  # the param group's lr, then the schedule's base
    assert re.search(r"this fit's win: lr \(param group 0\) 0\.02 .*initial_lr \(param group 0\) "
                     r"0\.02 \(the checkpoint's run was set up with 0\.05", groups), groups
    assert re.search(r"LR scheduler LambdaLR at its position \(last_epoch=4\) with this fit's base "
                     r"learning rates.*\[0\.02\] now, \[0\.05\] in the checkpoint", scheduler), scheduler
    assert h.lr[:4] == full.lr[:4]  # the checkpoint's History
    torch.testing.assert_close(torch.tensor(h.lr[4:], dtype=torch.float64),
                               torch.tensor(full.lr[4:], dtype=torch.float64) * 0.4, rtol=1e-12, atol=0)


def test_resume_with_another_diloco_outer_lr_uses_it(tmp_path):
    """DiLoCo's outer optimizer is part of the set-up: compiled again with another outer lr, the
    resumed fit steps z with it (its momentum buffer from the checkpoint), warning with both."""
    import functools

    def diloco(outer_lr: float) -> cg.Plan:
        outer = functools.partial(torch.optim.SGD, lr=outer_lr, momentum=0.9, nesterov=True)
        return net_plan(devices=1, executor="inline",
                        sync=cg.DiLoCo(sync_every=2, outer_optimizer=outer))

    ckpt = str(tmp_path)
    diloco(0.7).fit(data(), 1, progress=False, hooks=[StopAfter(6)], checkpoint_dir=ckpt,
                    checkpoint_every=2)
    saved = load_latest(ckpt)[1]["plan"]
    resumed = diloco(0.3)
    with pytest.warns(UserWarning, match=r"this fit's win: outer optimizer lr \(param group 0\) "
                                         r"0\.3 \(the checkpoint's run was set up with 0\.7"):
        resumed.fit(data(), 1, progress=False, checkpoint_dir=ckpt, resume=True)
    oracle = diloco(0.3)
    oracle.load_state_dict(saved)  # the outer optimizer's state, its lr 0.7 included …
    oracle.rounds.sync_state.optimizer.param_groups[0]["lr"] = 0.3  # … then the new lr
    oracle.fit(data(), 1, progress=False)
    assert resumed.rounds.sync_state.optimizer.param_groups[0]["lr"] == 0.3
    assert torch.equal(oracle.central_weights(), resumed.central_weights())


def test_resume_with_another_centre_rate_and_central_momentum_names_them(tmp_path):
    """z's rate β and μ_z are the compiled SMA's (not adjustable): a resumed fit runs with this
    plan's, and the warning names each that differs from the checkpoint's run's set-up."""
    ckpt = str(tmp_path)
    net_plan().fit(data(), 2, progress=False, seed=3, hooks=[StopAfter(4)], checkpoint_dir=ckpt,
                   checkpoint_every=1)
    resumed = net_plan(sync=cg.SMA(centre_rate=1.0, central_momentum=0.5))
    with pytest.warns(UserWarning) as record:
        resumed.fit(data(), 2, progress=False, seed=3, checkpoint_dir=ckpt, resume=True)
    (message,) = _resume_warnings(record)
    assert "central_momentum 0.5 (the checkpoint's run was set up with 0.9; 0.9 in force at the " \
           "checkpoint)" in message, message
    assert ("centre_rate 1.0 (the checkpoint's run was set up with auto (the default rule)"
            in message), message
    assert (resumed.sync.centre_rate, resumed.sync.central_momentum) == (1.0, 0.5)
    assert "β=1" in resumed.summary()


def test_resume_with_one_second_moment_per_device_switched_names_it(tmp_path):
    """``SMA(share_second_moment=...)`` is the compiled SMA's: a resume with it switched on runs
    with this plan's (the checkpoint's Adam state has the same keys and shapes) and the warning
    names it."""
    ckpt = str(tmp_path)
    adam = lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3)  # noqa: E731
    net_plan(optimizer=adam, executor="inline").fit(
        data(), 2, progress=False, seed=3, hooks=[StopAfter(4)], checkpoint_dir=ckpt,
        checkpoint_every=1)
    resumed = net_plan(optimizer=adam, executor="inline", sync=cg.SMA(share_second_moment=True))
    with pytest.warns(UserWarning) as record:
        resumed.fit(data(), 2, progress=False, seed=3, checkpoint_dir=ckpt, resume=True)
    (message,) = _resume_warnings(record)
    assert "share_second_moment True (the checkpoint's run was set up with False; False in force " \
           "at the checkpoint)" in message, message
    assert resumed.sync.shares_second_moment
