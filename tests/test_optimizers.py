"""Any torch.optim optimizer and LR scheduler as each learner's local optimiser (engine/state/optim.py,
training/lr_schedule.py): eager PyTorch is the oracle."""

from __future__ import annotations

import copy
import functools
import os
import subprocess
import sys

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import crossbow_graph as cg
from crossbow_graph.engine.state.optim import ELEMENTWISE

from _plans import make_plan
from _reference import batches_of, eager_steps, rule_lrs

N, B = 256, 8


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))


@pytest.fixture(scope="module")
def data():
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(N, 12, generator=g), torch.randint(0, 3, (N,), generator=g)
    return TensorDataset(x, y)


def _groups_adamw(model, **implementation):
    """AdamW in two groups; ``implementation``: torch.optim's ``fused``/``foreach`` flags."""
    return torch.optim.AdamW([
        {"params": model[0].parameters(), "lr": 3e-3},
        {"params": list(model[1].parameters()) + list(model[3].parameters()), "lr": 1e-3,
         "weight_decay": 0.1}], lr=1e-3, betas=(0.8, 0.99), **implementation)


def _rmsprop(model):
    return torch.optim.RMSprop(model.parameters(), lr=1e-3, momentum=0.5)


def _nesterov(model):
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True,
                           weight_decay=1e-4)


def _adafactor(model):  # not elementwise: one instance per replica
    return torch.optim.Adafactor(model.parameters(), lr=1e-2)


# the plans of these tests: the model as given at b = B, compile's optimizer unless given; the example
# inputs data.tensors[0][:B]
_plan = functools.partial(make_plan, seed=None, batch_size=B, optimizer=None)


def _adam_after_one_epoch(data) -> cg.Plan:
    """One device × 2 replicas with Adam (lr 1e-2), inline, after one epoch of ``data``."""
    model = _net()
    plan = _plan(model, example=data.tensors[0][:B], devices=1, replicas=2,
                 optimizer=torch.optim.Adam(model.parameters(), lr=1e-2), executor="inline")
    plan.fit(data, epochs=1, progress=False, metrics_every=None)
    return plan


def _one_cycle(opt):
    return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=N // B)


def _implementation(group: dict) -> tuple:
    """A param group's torch.optim implementation flags (``fused``, ``foreach``)."""
    return group.get("fused"), group.get("foreach")


_FUSED_ADAMW = functools.partial(_groups_adamw, fused=True)
_FOREACH_ADAMW = functools.partial(_groups_adamw, foreach=True)
_FOR_LOOP_ADAMW = functools.partial(_groups_adamw, foreach=False)


# the user's optimizer and the oracle: eager PyTorch with the implementation the engine runs
# (docs/optimizers.md, "Which implementation"): where the user left fused and foreach unset,
# one replica's row runs torch's fused AdamW; the user's own flags are kept
@pytest.mark.parametrize("make_opt,eager_opt,sched", [
    (_groups_adamw, _FUSED_ADAMW, None), (_FUSED_ADAMW, _FUSED_ADAMW, None),
    (_FOREACH_ADAMW, _FOREACH_ADAMW, None), (_FOR_LOOP_ADAMW, _FOR_LOOP_ADAMW, None),
    (_rmsprop, _rmsprop, None), (_nesterov, _nesterov, _one_cycle), (_adafactor, _adafactor, None)],
    ids=["adamw-groups", "adamw-groups-fused", "adamw-groups-foreach", "adamw-groups-for-loop",
         "rmsprop", "sgd-nesterov-onecycle", "adafactor"])
def test_one_learner_equals_eager_pytorch_step_for_step(data, make_opt, eager_opt, sched):
    model = _net()
    expected = eager_steps(copy.deepcopy(model), eager_opt, batches_of(data, B), lr_scheduler=sched).weights[-1]
    opt = make_opt(model)
    plan = _plan(model, example=data.tensors[0][:B], devices=1, replicas=1, optimizer=opt, executor="inline")
    history = plan.fit(data, shuffle=False, progress=False, metrics_every=None,
                       lr_scheduler=sched(plan.optimizer) if sched else None,
                       lr_scheduler_interval="round")
    z = plan.central_weights()
    assert float((z - expected).norm() / expected.norm()) < 1e-5
    rows = plan.states[0].optim_rows
    if rows is not None:  # the row optimizer ran the oracle's implementation
        (inst, _), = rows._cache.values()
        assert _implementation(inst.param_groups[0]) == \
            _implementation(eager_opt(_net()).param_groups[0])
    assert len(history.lr) == N // B
    if sched:  # η per round, as the eager scheduler gave it
        ref = _one_cycle(torch.optim.SGD([torch.zeros(1)], lr=0.05, momentum=0.9))
        etas = []
        for _ in range(N // B):
            etas.append(ref.get_last_lr()[0])
            ref.optimizer.step()
            ref.step()
        assert history.lr == pytest.approx(etas, rel=1e-12)


def test_one_learner_drifts_from_eager_default_adamw_only_where_adam_amplifies_rounding(data):
    """Left unset, k = 1 runs torch's fused AdamW, eager PyTorch its default (the single-tensor
    loop on the CPU): the same arithmetic in another order. After 32 steps every parameter is
    within 1e-4 relative error of eager's but the Linear bias right before BatchNorm, whose
    gradient is zero up to rounding and which Adam's normalisation turns into steps of up to η
    (3e-3) either way: its drift is bounded by 32·η per element. Measured: 2e-11 overall with
    AVX-512 kernels, 4e-3 with ATen's baseline kernels (ATEN_CPU_CAPABILITY=default), all of it
    in that bias (docs/optimizers.md)."""
    model = _net()
    expected = eager_steps(copy.deepcopy(model), _groups_adamw, batches_of(data, B)).weights[-1]
    plan = _plan(model, example=data.tensors[0][:B], devices=1, replicas=1, optimizer=_groups_adamw(model),
                 executor="inline")
    plan.fit(data, shuffle=False, progress=False, metrics_every=None)
    z = plan.central_weights()
    assert float((z - expected).norm() / expected.norm()) < 2e-2
    sizes = [p.numel() for p in model.parameters()]
    for (name, _), got, ref in zip(model.named_parameters(), z.split(sizes), expected.split(sizes)):
        if name == "0.bias":
            assert float((got - ref).abs().max()) <= (N // B) * 3e-3
        else:
            assert float((got - ref).norm() / ref.norm()) < 1e-4, name


@pytest.mark.slow
def test_one_learner_oracles_hold_with_atens_baseline_cpu_kernels():
    """The step-for-step oracles compare like with like on any x86-64 CPU: run under ATen's
    baseline kernels (ATEN_CPU_CAPABILITY=default, where fused and default AdamW drift apart by
    4e-3 in 32 steps), not only this CPU's vector kernels."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, ATEN_CPU_CAPABILITY="default")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           os.path.abspath(__file__), "-k", "step_for_step or drifts_from_eager"],
                          cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "8 passed" in proc.stdout


def test_fused_adamw_over_several_replicas_equals_one_eager_fused_adamw_each(data):
    """The user's fused=True at m = 2 replicas per device runs one instance per replica: torch's
    fused kernels take dense tensors only (over a strided stack of rows they write outside it).
    With τ beyond the fit the replicas never synchronise, so replica j equals eager fused AdamW
    on batches j, k + j, 2k + j, ... (shuffle=False)."""
    k, rounds = 2, N // (2 * B)
    model = _net()
    start = copy.deepcopy(model)
    plan = _plan(model, example=data.tensors[0][:B], devices=1, replicas=k, executor="inline",
                 optimizer=_FUSED_ADAMW(model),  # the optimizer under test: η as set
                 sync=cg.SMA(sync_every=10 * rounds, scale_lr=False))
    plan.fit(data, shuffle=False, progress=False, metrics_every=None)
    assert not plan.settings.optimizer.stacked
    for j in range(k):  # learner j: batch t·k + j in round t; no sync in this fit
        eager = eager_steps(copy.deepcopy(start), _FUSED_ADAMW, batches_of(data, B)[j::k][:rounds])
        torch.testing.assert_close(plan.replica_weights()[j], eager.weights[-1], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("executor,replicas", [("inline", 2), ("process", 2), ("inline", 1)],
                         ids=["inline-stacked", "process-stacked", "inline-fused-rows"])
def test_four_learners_adamw_train_and_a_zero_lr_group_stays_bitwise(data, executor, replicas):
    """Stacked rows (strided views: torch's single-tensor AdamW) and single rows (contiguous:
    torch's fused AdamW) alike."""
    model = _net()
    frozen = model[0].weight.detach().clone(), model[0].bias.detach().clone()
    opt = torch.optim.AdamW([{"params": model[0].parameters(), "lr": 0.0},
                             {"params": list(model[1].parameters()) + list(model[3].parameters())}],
                            lr=1e-2)
    plan = _plan(model, example=data.tensors[0][:B], devices=2, replicas=replicas, optimizer=opt,
                 executor=executor)
    history = plan.fit(data, epochs=3, progress=False, metrics_every=None, eval_dataset=data)
    losses = [e.test_loss for e in history.evals]
    assert losses[-1] < losses[0]
    z = plan.central_model()
    assert torch.equal(z[0].weight, frozen[0]) and torch.equal(z[0].bias, frozen[1])
    assert not torch.equal(z[3].weight, plan.template[3].weight)


def test_stacked_replicas_equal_one_instance_per_replica(data, monkeypatch):
    """The elementwise optimizers' one instance over a device's rows is m optimizers: the same
    numbers as one AdamW per replica (both with torch's single-tensor implementation: the fused
    one rounds differently, and Adam turns a rounding of a near-zero gradient into a full step)."""
    results = []
    for stacked in (True, False):
        model = _net()
        opt = _groups_adamw(model)
        for group in opt.param_groups:
            group["foreach"] = False
        plan = _plan(model, example=data.tensors[0][:B], devices=1, replicas=4, optimizer=opt,
                     executor="inline")
        assert plan.settings.optimizer.stacked
        if not stacked:
            monkeypatch.setattr(plan.settings.optimizer, "stacked", False)
            for s in plan.states:
                s.optim_rows = type(s.optim_rows)(plan.settings.optimizer, s)
        plan.fit(data, epochs=1, shuffle=False, progress=False, metrics_every=None)
        results.append(plan.replica_weights())
    torch.testing.assert_close(results[0], results[1], rtol=1e-6, atol=1e-7)


def test_a_new_replica_starts_from_z_with_fresh_optimizer_state(data):
    plan = _adam_after_one_epoch(data)
    rows = plan.states[0].optim_rows
    kept = {k: t[:2].clone() for k, t in rows.store[0].items()}
    plan.set_replicas(3)
    assert rows.age.tolist() == [N // (2 * B)] * 2 + [0]
    for key, t in rows.store[0].items():
        assert torch.equal(t[:2], kept[key])
    torch.testing.assert_close(plan.states[0].w[2], plan.states[0].z, rtol=0, atol=0)
    plan.fit(data, epochs=1, progress=False, metrics_every=None)  # ages differ: instances split
    assert rows.age.tolist()[2] == N // (3 * B)
    # Adam's step count is per replica: the new replica's bias correction is its own
    assert float(rows.store[0]["step"][2]) == N // (3 * B)
    assert float(rows.store[0]["step"][0]) == N // (2 * B) + N // (3 * B)


def test_a_faulty_replica_gets_fresh_optimizer_state(data):
    plan = _adam_after_one_epoch(data)
    poisoned = [False]

    class Poison(cg.Hook):
        def before_round(self, ctx):
            if not poisoned[0]:
                poisoned[0] = True
                ctx.plan.states[0].w[1, 0] = float("nan")

    history = plan.fit(data, epochs=1, progress=False, metrics_every=None, hooks=[Poison()])
    assert [f.replica for f in history.faults] == [1]
    rows = plan.states[0].optim_rows
    ages = rows.age.tolist()
    assert ages[1] < ages[0]  # fresh state at the fault, then its own steps
    assert [float(rows.store[0]["step"][j]) for j in range(2)] == ages


def test_resume_with_adamw_and_a_scheduler_is_bit_identical(data, tmp_path):
    def run(epochs, resume, directory):
        model = _net()
        opt = _groups_adamw(model)
        plan = _plan(model, example=data.tensors[0][:B], devices=2, replicas=2, optimizer=opt)
        sched = torch.optim.lr_scheduler.SequentialLR(plan.optimizer, [
            torch.optim.lr_scheduler.LinearLR(plan.optimizer, start_factor=0.1, total_iters=4),
            torch.optim.lr_scheduler.CosineAnnealingLR(plan.optimizer, T_max=20)], milestones=[4])
        history = plan.fit(data, epochs=epochs, progress=False, metrics_every=None,
                           checkpoint_dir=str(directory), resume=resume, lr_scheduler=sched,
                           lr_scheduler_interval="round")
        return plan, history

    whole, h_whole = run(3, False, tmp_path / "a")
    run(2, False, tmp_path / "b")
    resumed, h_resumed = run(3, True, tmp_path / "b")
    assert torch.equal(whole.central_weights(), resumed.central_weights())
    assert torch.equal(whole.replica_weights(), resumed.replica_weights())
    for a, b in zip(whole.states, resumed.states):
        for key, t in a.optim_rows.store[0].items():
            assert torch.equal(t, b.optim_rows.store[0][key])
    assert h_whole.lr == h_resumed.lr  # η of every round, the resumed run's restored too
    assert whole.optimizer.param_groups[1]["lr"] == resumed.optimizer.param_groups[1]["lr"]


def test_a_resume_without_a_hook_the_first_fit_had_keeps_the_schedulers_state(data, tmp_path):
    """Hooks' states are keyed by class and place among their class, not by position: a user's
    hook left out at the resume (one that stopped the first fit mid-epoch) does not lose the LR
    scheduler's step count."""
    class Stop(cg.Hook):
        def after_round(self, ctx):
            if ctx.plan.progress.rounds_done == 10:
                ctx.stop = True

    def run(directory, resume, hooks=()):
        model = _net()
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
        plan = _plan(model, example=data.tensors[0][:B], devices=1, replicas=2, optimizer=opt,
                     executor="inline")
        plan.fit(data, epochs=2, progress=False, metrics_every=None, lr_scheduler=sched,
                 lr_scheduler_interval="round", checkpoint_dir=str(directory), checkpoint_every=4,
                 resume=resume, hooks=list(hooks))
        return plan, sched

    whole, whole_sched = run(tmp_path / "a", False)
    run(tmp_path / "b", False, [Stop()])  # stops after round 10; the last checkpoint is round 8
    resumed, resumed_sched = run(tmp_path / "b", True)
    assert resumed_sched.last_epoch == whole_sched.last_epoch == 2 * N // (2 * B)
    assert whole.optimizer.param_groups[0]["lr"] == resumed.optimizer.param_groups[0]["lr"]
    assert torch.equal(whole.central_weights(), resumed.central_weights())


def test_reduce_on_plateau_reads_the_central_models_test_loss(data):
    model = _net()
    plan = _plan(model, example=data.tensors[0][:B], devices=1, replicas=2,
                 optimizer=torch.optim.SGD(model.parameters(), lr=0.05))
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(plan.optimizer, patience=0, factor=0.5,
                                                       threshold=10.0, threshold_mode="abs")
    # better only at the first evaluation, then halved at each
    history = plan.fit(data, epochs=3, progress=False, metrics_every=None, eval_dataset=data,
                       lr_scheduler=sched)
    assert sched.best == pytest.approx(history.evals[0].test_loss)
    assert plan.settings.lr == pytest.approx(0.05 * 0.5 ** 2)


def test_torch_sgd_with_one_group_runs_the_sma_kernels(data):
    model = _net()
    plan = _plan(model, example=data.tensors[0][:B], devices=1, replicas=2,
                 optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    assert plan.settings.optimizer.kernel and plan.states[0].optim_rows is None
    adam = _plan(model, example=data.tensors[0][:B], devices=1, replicas=2,
                 optimizer=torch.optim.Adam(model.parameters()))
    assert len(plan.kernels) > len(adam.kernels) == 1  # the row optimizer: central update only
    assert "SGD(lr=0.1" in plan.summary() and "Adam(lr=0.001" in adam.summary()


def test_cg_sgd_is_a_torch_sgd_a_scheduler_can_drive(data):
    model = _net()
    plan = _plan(model, example=data.tensors[0][:B], devices=1, replicas=2, optimizer=cg.SGD(lr=0.1))
    assert isinstance(plan.optimizer, torch.optim.SGD) and plan.settings.optimizer.kernel
    sched = torch.optim.lr_scheduler.MultiStepLR(plan.optimizer, milestones=[1], gamma=0.1)
    history = plan.fit(data, epochs=2, progress=False, metrics_every=None, lr_scheduler=sched)
    per_epoch = N // (2 * B)
    factors = rule_lrs(1.0, [2] * 2 * per_epoch, B, N)  # SMA's η rule at k = 2: 1 → √2
    assert history.lr == pytest.approx([f * (0.1 if t < per_epoch else 0.01)
                                        for t, f in enumerate(factors)], rel=1e-12)
    assert plan.optimizer.param_groups[0]["lr"] == pytest.approx(0.01)  # the scheduler's value


def test_elementwise_list_holds_the_elementwise_torch_optimizers():
    assert torch.optim.AdamW in ELEMENTWISE and torch.optim.Adafactor not in ELEMENTWISE


@pytest.mark.parametrize("bad,match", [
    (lambda m: torch.optim.LBFGS(m.parameters()), "closure"),
    (lambda m: torch.optim.SparseAdam(m.parameters()), "sparse"),
    (lambda m: torch.optim.Adam(_net().parameters()), "not a parameter of the model"),
    (lambda m: torch.optim.Adam([{"params": m.parameters()}, {"params": m[0].parameters()}]),
     None),
    ("adam", "torch.optim optimizer"),
    (lambda m: torch.optim.AdamW(m.parameters(), lr=torch.tensor(1e-3)),
     r"param group 0 holds lr as a tensor: .*AdamW\(model.parameters\(\), lr=0.001\)"),
    (lambda m: torch.optim.Adam([{"params": m[0].parameters()}, {"params": m[1].parameters(),
                                  "betas": (torch.tensor(0.9), torch.tensor(0.99))}]),
     r"param group 1 holds betas as a tensor: .*param group 1's \"betas\": \(0.9, 0.99\) in its dict"),
])
def test_optimizers_that_cannot_be_replicated_are_refused_before_training(data, bad, match):
    model = _net()
    x = data.tensors[0][:B]
    if isinstance(bad, str):
        with pytest.raises(TypeError, match=match):
            cg.compile(model, (x,), nn.functional.cross_entropy, batch_size=B, optimizer=bad)
        return
    try:
        opt = bad(model)
    except ValueError as exc:  # torch.optim itself refuses a parameter in two groups
        assert "more than one" in str(exc) or "appear" in str(exc)
        return
    with pytest.raises((TypeError, ValueError), match=match):
        cg.compile(model, (x,), nn.functional.cross_entropy, batch_size=B, optimizer=opt)


def test_ssgd_with_adamw_is_refused(data):
    model = _net()
    with pytest.raises(ValueError, match="SSGD"):
        _plan(model, example=data.tensors[0][:B], replicas=2,
              optimizer=torch.optim.AdamW(model.parameters()), sync=cg.SSGD())


def test_a_scheduler_over_another_optimizer_is_refused(data):
    model = _net()
    plan = _plan(model, example=data.tensors[0][:B], replicas=2,
                 optimizer=torch.optim.AdamW(model.parameters()))
    other = torch.optim.AdamW(_net().parameters())
    with pytest.raises(ValueError, match="another optimizer"):
        plan.fit(data, progress=False, lr_scheduler=torch.optim.lr_scheduler.StepLR(other, 1))
    with pytest.raises(ValueError, match="lr_scheduler_interval"):
        plan.fit(data, progress=False, lr_scheduler_interval="step")


def test_frozen_parameters_in_the_optimizer_are_skipped_as_torch_skips_them(data):
    model = _net()
    model[0].weight.requires_grad_(False)
    frozen = model[0].weight.detach().clone()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)  # holds the frozen one too
    plan = _plan(model, example=data.tensors[0][:B], devices=1, replicas=2, optimizer=opt)
    plan.fit(data, progress=False, metrics_every=None)
    assert torch.equal(plan.central_model()[0].weight, frozen)
    with pytest.raises(TypeError, match="the class AdamW"):
        _plan(model, example=data.tensors[0][:B], optimizer=torch.optim.AdamW)


def test_a_one_cycle_shorter_than_the_fit_is_refused_before_any_round(data):
    model = _net()
    plan = _plan(model, example=data.tensors[0][:B], devices=1, replicas=2,
                 optimizer=torch.optim.AdamW(model.parameters()))
    short = torch.optim.lr_scheduler.OneCycleLR(plan.optimizer, max_lr=0.01, total_steps=5)
    with pytest.raises(ValueError, match="total_steps=16"):
        plan.fit(data, progress=False, lr_scheduler=short, lr_scheduler_interval="round")
    assert plan.rounds_done == 0


@pytest.mark.parametrize("make_sched", [
    lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1.0 / (1 + t)),
    lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.04, total_steps=64),
    lambda opt: torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[5, 10], gamma=0.5)],
    ids=["lambda", "onecycle", "multistep"])
def test_a_policys_lr_change_composes_with_the_schedule_as_a_factor(data, make_sched):
    """A policy that doubles η at round 4 keeps η = 2·schedule(t) in every group from then on,
    under closed-form schedulers (which alone would overwrite it) and chainable ones."""
    def run(policy):
        model = _net()
        opt = _groups_adamw(model)
        plan = _plan(model, example=data.tensors[0][:B], devices=1, replicas=2, optimizer=opt,
                     executor="inline")
        h = plan.fit(data, epochs=2, progress=False, metrics_every=None,
                     lr_scheduler=make_sched(plan.optimizer), lr_scheduler_interval="round",
                     policies=[policy] if policy else [])
        return h, plan

    class Double(cg.Policy):
        def after_round(self, ctx):
            if ctx.plan.rounds_done == 4:
                self.adjust(ctx, lr=2 * ctx.plan.settings.lr)

    (plain, p0), (doubled, p1) = run(None), run(Double())
    assert len(plain.lr) == len(doubled.lr) == 2 * N // (2 * B)
    assert doubled.lr[:4] == pytest.approx(plain.lr[:4], rel=1e-12)
    assert doubled.lr[4:] == pytest.approx([2 * x for x in plain.lr[4:]], rel=1e-9)
    for g0, g1 in zip(p0.optimizer.param_groups, p1.optimizer.param_groups):  # every group
        assert g1["lr"] == pytest.approx(2 * g0["lr"], rel=1e-9)
