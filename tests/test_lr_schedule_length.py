"""How long an LR schedule runs in a fit: one step per round of k·b samples, per batch of b (a
plain loop's steps, whatever k is) or per epoch; the warnings when a schedule cannot reach its
end, at the fit's start and when k or b changes, whatever its class."""

from __future__ import annotations

import functools
import math
import re
import warnings

import pytest
import torch
from torch import nn
from torch.optim import lr_scheduler as lrs
from torch.utils.data import DataLoader, TensorDataset

import crossbow_graph as cg
from crossbow_graph.training.hooks import Hook
from crossbow_graph.training.lr_schedule import schedule_end

from _plans import make_plan

N, B, LR = 96, 4, 0.1  # samples, b, η


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, 6, generator=g)
    return TensorDataset(x, (x[:, 0] > 0).long())


# the plans of these tests: Linear(6 → 2) at b = B, 2 replicas on one device, inline, SGD(LR) without
# momentum
linear_plan = functools.partial(make_plan, model=lambda: nn.Linear(6, 2), example=torch.ones(1, 6),
                                batch_size=B, devices=1, replicas=2, executor="inline",
                                optimizer=cg.SGD(lr=LR, momentum=0.0))


class SetReplicas(Hook):
    mutates_replicas = False

    def __init__(self, at: int, m: int) -> None:
        self.at, self.m = at, m

    def after_round(self, ctx) -> None:
        if ctx.plan.rounds_done == self.at:
            ctx.plan.set_replicas(self.m)


def fit(plan: cg.Plan, sched, epochs: int, interval: str = "round", hooks=()) -> list[str]:
    """The fit's schedule warnings (messages)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan.fit(data(), epochs, progress=False, metrics_every=None, lr_scheduler=sched,
                 lr_scheduler_interval=interval, hooks=list(hooks))
    return [str(w.message) for w in caught if str(w.message).startswith("lr_scheduler")]


def cosine(t: int, t_max: int) -> float:
    """CosineAnnealingLR's η at step t (eta_min = 0): the oracle."""
    return LR * (1 + math.cos(math.pi * t / t_max)) / 2


def test_a_cosine_schedule_sized_from_the_dataloaders_length_warns_at_the_start():
    """T_max = len(DataLoader) · epochs = 48 batches of b, but k = 2 learners make a round of
    k·b = 8 samples: 2 epochs are 24 rounds, so the schedule stops halfway (η = LR/2, not 0),
    which the warning says with both numbers and the fix."""
    plan = linear_plan()
    t_max = len(DataLoader(data(), batch_size=B)) * 2
    said = fit(plan, lrs.CosineAnnealingLR(plan.optimizer, T_max=t_max), 2)
    assert len(said) == 1
    assert re.search(r"CosineAnnealingLR reaches its end \(T_max=48\) 48 steps from now, but this "
                     r"fit runs 24 rounds of k·b = 2 × 4 = 8 samples \(12 an epoch of 96 samples\)"
                     r", one step each; it stops at step 24; size it in rounds \(T_max=24\), step it "
                     r"per batch of b \(lr_scheduler_interval='batch': a schedule sized in "
                     r"len\(DataLoader\) steps, as a plain loop sizes it, then ends with the fit "
                     r"whatever k is\) or per epoch \(lr_scheduler_interval='epoch'\)",
                     said[0])
    assert plan.optimizer.param_groups[0]["lr"] == pytest.approx(cosine(24, 48), rel=1e-6)
    assert plan.optimizer.param_groups[0]["lr"] == pytest.approx(LR / 2, rel=1e-6)


def test_a_schedule_sized_in_rounds_of_k_b_finishes_without_a_warning():
    plan = linear_plan()
    sched = lrs.CosineAnnealingLR(plan.optimizer, T_max=2 * N // (2 * B))
    assert fit(plan, sched, 2) == []
    assert plan.optimizer.param_groups[0]["lr"] == pytest.approx(0.0, abs=1e-9)
    plan = linear_plan()  # OneCycleLR with total_steps = the rounds (docs/optimizers.md)
    assert fit(plan, lrs.OneCycleLR(plan.optimizer, max_lr=LR, total_steps=24), 2) == []


def test_k_growing_mid_fit_warns_once_with_the_rounds_and_steps_left():
    """T_max = 24 fits k = 2; m 2 → 3 after round 5 leaves (96 − 40) // 12 + 8 = 12 rounds of 12
    samples: the warning predicts step 17 of 24, and the fit ends there (a second change to
    m = 4 does not warn again)."""
    plan = linear_plan()
    sched = lrs.CosineAnnealingLR(plan.optimizer, T_max=24)
    said = fit(plan, sched, 2, hooks=[SetReplicas(5, 3), SetReplicas(9, 4)])
    assert len(said) == 1
    assert re.search(r"reaches its end \(T_max=24\) 19 steps from now, but k·b changed at round 5"
                     r", and 12 rounds of k·b = 3 × 4 = 12 samples \(8 an epoch of 96 samples\) are "
                     r"left, one step each; it stops at step 17; step it per batch of b", said[0])
    assert "it stops at step 17" in said[0]
    assert sched.last_epoch == plan.rounds_done < 24
    assert plan.optimizer.param_groups[0]["lr"] == pytest.approx(cosine(sched.last_epoch, 24),
                                                                 rel=1e-6)


def test_k_shrinking_mid_fit_does_not_warn():
    plan = linear_plan()
    assert fit(plan, lrs.CosineAnnealingLR(plan.optimizer, T_max=24), 2,
               hooks=[SetReplicas(5, 1)]) == []


def test_a_schedule_stepped_per_epoch_warns_when_the_fit_has_fewer_epochs():
    plan = linear_plan()
    said = fit(plan, lrs.CosineAnnealingLR(plan.optimizer, T_max=5), 3, interval="epoch")
    assert len(said) == 1
    assert re.search(r"reaches its end \(T_max=5\) 5 steps from now, but this fit steps it 3 more "
                     r"times \(once per epoch\); it stops at step 3; build it with T_max=3 or "
                     r"train more epochs", said[0])
    assert fit(plan, lrs.CosineAnnealingLR(plan.optimizer, T_max=2), 2, interval="epoch") == []


def test_where_a_schedule_ends():
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    seq = lrs.SequentialLR(opt, [lrs.LinearLR(opt, 0.1, total_iters=5),
                                 lrs.CosineAnnealingLR(opt, T_max=20)], milestones=[5])
    assert schedule_end(seq)[0] == 25
    assert schedule_end(lrs.OneCycleLR(opt, max_lr=1.0, total_steps=10))[0] == 9
    assert schedule_end(lrs.MultiStepLR(opt, [3, 7]))[0] == 7
    assert schedule_end(lrs.LinearLR(opt, 0.5, total_iters=4))[0] == 4
    assert schedule_end(lrs.StepLR(opt, 2)) is None
    assert schedule_end(lrs.LambdaLR(opt, lambda t: 1.0)) is None


def test_a_one_cycle_schedule_past_its_end_holds_its_last_lr_with_a_warning():
    """k falls mid-fit, so the epoch holds more rounds than OneCycleLR was built for: torch would
    raise at its (total_steps + 1)-th step; the fit holds the last η instead and says so."""
    plan = linear_plan(replicas=2)
    rounds = 2 * (N // (2 * B))  # 2 epochs at k = 2
    sched = lrs.OneCycleLR(plan.optimizer, max_lr=LR, total_steps=rounds)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = plan.fit(data(), 2, progress=False, metrics_every=None, lr_scheduler=sched,
                           lr_scheduler_interval="round", hooks=[SetReplicas(at=2, m=1)])
    held = [str(w.message) for w in caught if "has taken all its total_steps" in str(w.message)]
    assert len(held) == 1 and f"total_steps={rounds}" in held[0]
    assert sched.last_epoch == rounds
    assert plan.rounds_done > rounds  # the fit ran on past the schedule's end
    last = history.lr[rounds]
    assert history.lr[rounds:] == [last] * (plan.rounds_done - rounds)


def hf_linear(warmup: int, total: int):
    """transformers' get_linear_schedule_with_warmup's factor at step t (the default schedule of
    HuggingFace's fine-tuning scripts): up over ``warmup`` steps, then down to 0 at ``total``."""
    return lambda t: t / max(1, warmup) if t < warmup else max(0.0, (total - t) / max(1, total - warmup))


def loader() -> DataLoader:
    return DataLoader(data(), batch_size=B)


def test_a_lambda_schedule_sized_in_dataloader_steps_and_stepped_per_round_warns():
    """The port of an HF script: a LambdaLR over epochs · len(loader) = 48 steps, stepped once per
    round; 2 learners make 24 rounds, so η stops about halfway down (0.545·LR), where the plain loop ends at
    0. Its length is no attribute: the fit probes a copy and says so, with both values."""
    plan = linear_plan()
    total = 2 * len(loader())
    said = fit(plan, lrs.LambdaLR(plan.optimizer, hf_linear(4, total)), 2)
    assert len(said) == 1
    assert re.search(r"LambdaLR, stepped once per round, takes 24 more steps in this fit \(rounds "
                     r"of k·b = 2 × 4 = 8 samples\) and leaves η at 0\.0545; stepped once per batch "
                     r"of b, as a plain loop over the DataLoader steps it \(48 batches, 24 an epoch\), "
                     r"it would go on to η = 0: a schedule sized in len\(DataLoader\) steps .* step "
                     r"it per batch \(lr_scheduler_interval='batch'\) or size it in rounds \(24\)",
                     said[0])
    assert plan.optimizer.param_groups[0]["lr"] == pytest.approx(LR * hf_linear(4, total)(24))


def test_a_lambda_schedule_warns_when_the_auto_tuner_adds_learners_mid_fit():
    """replicas="auto" starts at k = 1, where rounds are the loader's batches; when k grows
    (here m 1 → 3 after round 6) the rounds left fall short, and the fit says so then, once."""
    plan = linear_plan(replicas=1)
    said = fit(plan, lrs.LambdaLR(plan.optimizer, hf_linear(4, 48)), 2,
               hooks=[SetReplicas(6, 3), SetReplicas(9, 2)])
    assert len(said) == 1
    assert re.search(r"LambdaLR, stepped once per round, takes 14 more steps in this fit \(rounds "
                     r"of k·b = 3 × 4 = 12 samples\) .* \(42 batches, 24 an epoch\), it would go on "
                     r"to η = 0", said[0])


def test_a_lambda_schedule_sized_in_rounds_is_not_warned():
    """The same schedule over the fit's 24 rounds ends at 0 there, its lowest η: as meant."""
    plan = linear_plan()
    assert fit(plan, lrs.LambdaLR(plan.optimizer, hf_linear(4, 24)), 2) == []
    assert plan.optimizer.param_groups[0]["lr"] == 0.0
    plan = linear_plan(replicas=1)  # k = 1: a round is a batch of b
    assert fit(plan, lrs.LambdaLR(plan.optimizer, hf_linear(4, 48)), 2) == []


def test_a_schedule_stepped_per_batch_ends_with_the_fit_as_the_plain_loop_does():
    """lr_scheduler_interval='batch': len(loader) steps per epoch spread over its rounds (k per
    round here), so the schedule sized as the plain loop sizes it takes all its 48 steps and ends
    at 0 at k = 2, and when the auto-tuner or a policy changes k mid-epoch too."""
    plain = [LR * hf_linear(4, 48)(t) for t in range(48)]  # η of the plain loop's 48 steps
    for hooks in ([], [SetReplicas(5, 3), SetReplicas(9, 1)]):
        plan = linear_plan(sync=cg.SMA(scale_lr=False))  # the schedule's η, not SMA's factor
        sched = lrs.LambdaLR(plan.optimizer, hf_linear(4, 48))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            history = plan.fit(loader(), 2, progress=False, metrics_every=None, lr_scheduler=sched,
                               lr_scheduler_interval="batch", hooks=hooks)
        assert [str(w.message) for w in caught if "lr_scheduler" in str(w.message)] == []
        assert sched.last_epoch == 48
        assert plan.optimizer.param_groups[0]["lr"] == 0.0
        assert all(any(lr == pytest.approx(p, abs=1e-12) for p in plain) for lr in history.lr)
    assert history.lr[:6] == pytest.approx([plain[t] for t in (0, 2, 4, 6, 8, 10)])  # k = 2


def test_a_schedule_stepped_per_batch_resumes_bit_identically(tmp_path):
    """Stopped after 3 rounds and resumed: the steps taken in the epoch are checkpointed."""
    def run(hooks, **kw):
        plan = linear_plan(replicas=3)  # 96 samples: 8 rounds of 12, 24 batches of b an epoch
        sched = lrs.LambdaLR(plan.optimizer, hf_linear(4, 48))
        history = plan.fit(data(), 2, progress=False, metrics_every=None, lr_scheduler=sched,
                           lr_scheduler_interval="batch", hooks=hooks, **kw)
        return plan, sched, history

    class StopAt(Hook):
        mutates_replicas = False

        def after_round(self, ctx):
            ctx.stop = ctx.plan.rounds_done == 3

    whole, whole_sched, whole_history = run([])
    ckpt = str(tmp_path / "ckpt")
    run([StopAt()], checkpoint_dir=ckpt, checkpoint_every=1)
    again, sched, history = run([], checkpoint_dir=ckpt, resume=True)
    assert sched.last_epoch == whole_sched.last_epoch == 48
    assert history.lr == whole_history.lr
    torch.testing.assert_close(again.central_weights(), whole.central_weights(), rtol=0, atol=0)


def test_a_one_cycle_shorter_than_the_batches_is_refused():
    plan = linear_plan()
    short = lrs.OneCycleLR(plan.optimizer, max_lr=LR, total_steps=24)  # 24 rounds, 48 batches
    with pytest.raises(ValueError, match=r"OneCycleLR has 24 steps left .* the fit runs 48 batches "
                                         r"of b; build it with total_steps=48"):
        plan.fit(loader(), 2, progress=False, lr_scheduler=short, lr_scheduler_interval="batch")
