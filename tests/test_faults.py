"""NaN/Inf replicas: reset from z, left out of the round's average, logged; all fail ⇒ DivergenceError."""

from __future__ import annotations

import functools
import logging
import math
import os
import re
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import crossbow_graph as cg
from crossbow_graph.engine.learning.faults import FaultEvent, FaultMonitor
from crossbow_graph.errors import DivergenceError, TaskError
from crossbow_graph.training.checkpoint import load_latest
from crossbow_graph.training.hooks import Hook

from _plans import make_plan
from _reference import default_alpha, default_centre_rate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def data(n: int = 64, nan_at: int | None = None, ignored=()) -> TensorDataset:
    """n samples of 5 features, 3 classes; ``ignored``: batches of 4 (index i: samples 4i … 4i+3)
    whose labels are all cross-entropy's ignore_index, so their loss is NaN (0/0) and their
    gradient zero."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(n, 5, generator=g)
    if nan_at is not None:
        x[nan_at, 0] = math.nan
    y = torch.randint(0, 3, (n,), generator=g)
    for i in ignored:
        y[4 * i:4 * i + 4] = -100
    return TensorDataset(x, y)


def _tanh_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))


# the plans of these tests: the tanh MLP on x [N, 5] on 2 devices × 2 replicas, SGD(0.1, momentum 0.9),
# no central momentum
tanh_plan = functools.partial(make_plan, model=_tanh_mlp, example=torch.zeros(1, 5), devices=2, replicas=2,
                              optimizer=cg.SGD(lr=0.1, momentum=0.9), sync=cg.SMA(central_momentum=0.0))


class Poison(Hook):
    """Before round ``at`` (0-based), writes NaN into replicas ``targets`` [(device, replica)];
    records the pre-step replicas and z of that round."""

    def __init__(self, at: int, targets) -> None:
        self.at, self.targets = at, targets

    def before_round(self, ctx) -> None:
        if ctx.plan.rounds_done != self.at:
            return
        for d, r in self.targets:
            ctx.plan.states[d].w[r, 3] = math.nan
        self.pre_w = ctx.plan.replica_weights()  # [k, P] ŵ of the round
        self.pre_z = ctx.plan.central_weights()

    def after_round(self, ctx) -> None:
        if ctx.plan.rounds_done == self.at + 1:
            self.post = [(s.w.clone(), s.v.clone(), s.z.clone(), s.z_prev.clone()) for s in ctx.plan.states]


def test_faulty_replica_is_reset_and_left_out_of_the_average(caplog):
    plan = tanh_plan()
    hook = Poison(at=3, targets=[(1, 0)])
    with caplog.at_level(logging.WARNING, logger="crossbow_graph.faults"):
        history = plan.fit(data(), 1, progress=False, hooks=[hook])
    k = plan.num_learners
    # oracle (μ_z = 0, the default α and β): z_new = z + (β/k)·Σ_{healthy j} (ŵ_j − z); the faulty
    # one adds nothing
    healthy = [j for j in range(k) if j != 2]  # device 1, replica 0 is learner 2
    beta = default_centre_rate(k, default_alpha(k, 0.0), 0.0)
    expected = hook.pre_z + beta / k * sum(hook.pre_w[j] - hook.pre_z for j in healthy)
    for w, v, z, z_prev in hook.post:
        torch.testing.assert_close(z, expected, rtol=1e-6, atol=1e-6)
    w, v, z, z_prev = hook.post[1]
    assert torch.equal(w[0], z_prev) and torch.equal(v[0], torch.zeros_like(v[0]))  # reset from z
    assert all(torch.isfinite(s.w).all() and torch.isfinite(s.z).all() for s in plan.states)
    assert [(f.round, f.device, f.replica) for f in history.faults] == [(3, "cpu:1", 0)]
    assert "round 3: replica 0 on cpu:1 has NaN/Inf gradients" in caplog.text


def test_nan_in_data_resets_only_that_learner():
    plan = tanh_plan(devices=1, replicas=2)
    # shuffle=False: round 1, learner 1 reads samples [12, 16)
    history = plan.fit(data(nan_at=13), 1, shuffle=False, progress=False)
    assert [(f.round, f.device, f.replica) for f in history.faults] == [(1, "cpu:0", 1)]
    assert torch.isfinite(plan.central_weights()).all()
    assert math.isfinite(history.epochs[0].train_loss)  # the faulty replica's NaN loss left out


def test_all_replicas_failing_stops_with_divergence_error_and_checkpoint_intact(tmp_path):
    plan = tanh_plan(sync=cg.SMA(central_momentum=0.9))
    targets = [(d, r) for d in range(2) for r in range(2)]
    poison = Poison(at=3, targets=targets)
    with pytest.raises(DivergenceError, match=r"all 4 replicas have NaN/Inf gradients in round 3") as err:
        plan.fit(data(), 1, progress=False, hooks=[poison],
                 checkpoint_dir=str(tmp_path), checkpoint_every=1)
    assert plan.rounds.resolved_executor() == "process"  # the last worker runs the global sync
    assert torch.equal(plan.central_weights(), poison.pre_z)  # z untouched by the failed round
    assert isinstance(err.value, TaskError) and err.value.round_index == 3
    assert re.search(r"resume=True continues from \S+/ckpt-0000000003\.pt, the newest checkpoint "
                     r"whose training loss", str(err.value))
    assert "the central model z is finite" in str(err.value)
    path, state = load_latest(str(tmp_path))
    assert state["plan"]["rounds_done"] == 3
    assert all(torch.isfinite(s["w"]).all() and torch.isfinite(s["z"]).all()
               for s in state["plan"]["states"])


class Snapshot(Hook):
    """Records ŵ and z before round ``at`` (0-based) and z after it."""

    def __init__(self, at: int) -> None:
        self.at = at

    def before_round(self, ctx) -> None:
        if ctx.plan.rounds_done == self.at:
            self.pre_w, self.pre_z = ctx.plan.replica_weights(), ctx.plan.central_weights()

    def after_round(self, ctx) -> None:
        if ctx.plan.rounds_done == self.at + 1:
            self.post_z = ctx.plan.central_weights()


@pytest.mark.parametrize("executor", ["inline", "process"])
def test_nan_loss_with_finite_gradients_is_a_fault(executor, caplog):
    plan = tanh_plan(devices=1, replicas=2, executor=executor)
    # shuffle=False, k = 2, b = 4: learner j of round t reads batch 2t + j; the loss of a batch
    # of ignored labels is NaN while its gradient is zero
    train = data(ignored=[2 * 1 + 1, 2 * 2 + 0])  # round 1 learner 1, round 2 learner 0
    hook = Snapshot(at=1)
    with caplog.at_level(logging.WARNING, logger="crossbow_graph.faults"):
        history = plan.fit(train, 1, shuffle=False, progress=False, hooks=[hook])
    assert plan.rounds.resolved_executor() == executor
    assert [(f.round, f.device, f.replica, f.rank) for f in history.faults] == [
        (1, "cpu:0", 1, 0), (2, "cpu:0", 0, 0)]
    assert "round 1: replica 1 on cpu:0 has NaN/Inf gradients or loss" in caplog.text
    assert math.isfinite(history.epochs[0].train_loss)
    # oracle (μ_z = 0, the default α at k = 2): the faulty replica's correction is left out of
    # round 1's sum
    expected = hook.pre_z + default_alpha(2, 0.0) * (hook.pre_w[0] - hook.pre_z)
    torch.testing.assert_close(hook.post_z, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("executor", ["inline", "process"])
def test_nan_loss_of_every_replica_is_divergence(executor):
    plan = tanh_plan(devices=1, replicas=2, executor=executor)
    hook = Snapshot(at=2)
    with pytest.raises(DivergenceError, match="all 2 replicas have NaN/Inf gradients in round 2") as err:
        plan.fit(data(ignored=[4, 5]), 1, shuffle=False, progress=False, hooks=[hook])
    assert err.value.round_index == 2
    assert torch.equal(plan.central_weights(), hook.pre_z)  # z untouched by the failed round


def test_single_learner_nan_is_divergence():
    plan = tanh_plan(devices=1, replicas=1)
    with pytest.raises(DivergenceError, match="all 1 replicas"):
        plan.fit(data(), 1, progress=False, hooks=[Poison(at=0, targets=[(0, 0)])])


def test_healthy_rounds_match_a_plan_without_faults():
    """The check changes nothing when every replica is finite (same z, bit for bit)."""
    a, b = tanh_plan(sync=cg.SMA(central_momentum=0.9)), tanh_plan(sync=cg.SMA(central_momentum=0.9))
    a.fit(data(), 1, progress=False)
    b.rounds.faults.check = lambda state, **kw: None  # no detection at all
    b.fit(data(), 1, progress=False)
    assert torch.equal(a.central_weights(), b.central_weights())


# -- the DivergenceError's advice: a lower learning rate, then resume ----------------------------


def _relu_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 3))


def _squared(out, y):
    return ((out - nn.functional.one_hot(y, 3).float()) ** 2).mean()


# The ReLU MLP on a squared loss against one-hot targets, 2 replicas on one device: at lr = 1 with
# momentum 0.9 it grows without bound until every replica overflows in the same round (in epoch 5,
# of 8 rounds).
_regression_plan = functools.partial(make_plan, model=_relu_mlp, example=torch.zeros(1, 5),
                                     loss_fn=_squared, devices=1, replicas=2,
                                     sync=cg.SMA(central_momentum=0.0, scale_lr=False),  # η as set
                                     executor="inline")


def test_lowering_the_lr_and_resuming_after_divergence_trains_on(tmp_path):
    """The reporter's run: DivergenceError, the plan compiled again with a 1000× lower η and no
    momentum, resume=True: the resumed fit runs with the new η and momentum (a warning names both
    values), does not diverge again, and equals the state of the checkpoint the error names (an
    epoch's end whose training loss stayed low before and after it) trained on with them."""
    ckpt = str(tmp_path)
    with pytest.raises(DivergenceError, match=r"Lower the learning rate \(compile the plan again "
                                              r"with a lower lr") as err:
        diverging = _regression_plan(optimizer=cg.SGD(lr=1.0, momentum=0.9))
        diverging.fit(data(), 6, progress=False, checkpoint_dir=ckpt)
    path, state = load_latest(ckpt)
    saved = state["plan"]
    done = saved["rounds_done"]
    assert done % 8 == 0 and 8 <= done < err.value.round_index  # an epoch's end before the error
    assert f"resume=True continues from {path}, the newest checkpoint" in str(err.value)
    resumed = _regression_plan(optimizer=cg.SGD(lr=1e-3, momentum=0.0))
    with pytest.warns(UserWarning, match=r"this fit's win: lr \(param group 0\) 0\.001 \(the "
                                         r"checkpoint's run was set up with 1\.0; 1\.0 in force at "
                                         r"the checkpoint\); momentum \(param group 0\) 0\.0"):
        history = resumed.fit(data(), 6, progress=False, checkpoint_dir=ckpt, resume=True)
    assert resumed.rounds_done == 48 and history.lr[done:] == [1e-3] * (48 - done)
    assert not [f for f in history.faults if f.round >= done]
    assert torch.isfinite(resumed.central_weights()).all()
    # the checkpoint's state, then the new settings
    oracle = _regression_plan(optimizer=cg.SGD(lr=1e-3, momentum=0.0))
    oracle.load_state_dict(saved)
    oracle.adjust(cg.Adjustment(lr=1e-3))
    oracle.optimizer.param_groups[0]["momentum"] = 0.0
    oracle.fit(data(), 6 - done // 8, progress=False)
    assert torch.equal(oracle.central_weights(), resumed.central_weights())
    assert torch.equal(oracle.replica_weights(), resumed.replica_weights())


def _scale_10_data() -> TensorDataset:
    """512 samples x [512, 8] of scale 10, y = x·w [512, 1]: SGD at η = 1 diverges on it."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 8, generator=g) * 10
    return TensorDataset(x, x @ torch.randn(8, 1, generator=g))


_linear_plan = functools.partial(make_plan, model=lambda: nn.Linear(8, 1), example=torch.zeros(1, 8),
                                 loss_fn=nn.functional.mse_loss, batch_size=8, devices=1,
                                 replicas=2, executor="inline",
                                 sync=cg.SMA(alpha=0.5, scale_lr=False))  # the rounds' η as the lr is set


class _RaiseLr(cg.Policy):
    """η ← 1.0 after round 13 (a schedule gone wrong)."""

    def after_round(self, ctx) -> None:
        if ctx.plan.rounds_done == 13:
            self.adjust(ctx, lr=1.0, reason="too high")


def test_after_divergence_a_resume_continues_from_the_newest_healthy_checkpoint(tmp_path):
    """η = 1e-3 for 13 rounds, then 1.0: the run diverges some rounds later, and the checkpoints
    written since (every 2 rounds) hold a blown-up but finite z. The error names checkpoint 12
    (the loss stayed low before and after it), those after it are set aside, and a resume at a
    lower η continues from round 12 and trains on."""
    ckpt = str(tmp_path)
    with pytest.raises(DivergenceError) as err:
        _linear_plan(optimizer=cg.SGD(lr=1e-3, momentum=0.9)).fit(
            _scale_10_data(), 2, progress=False, policies=[_RaiseLr()], checkpoint_dir=ckpt,
            checkpoint_every=2)
    assert (f"resume=True continues from {ckpt}/ckpt-0000000012.pt, the newest checkpoint whose "
            "training loss before and after it stayed within 10×") in str(err.value)
    kept, *aside = sorted(os.listdir(ckpt))  # the newest two besides checkpoint 12, set aside
    assert kept == "ckpt-0000000012.pt" and len(aside) == 2
    assert all(name.endswith(".pt.diverged") and name in str(err.value) for name in aside)
    resumed = _linear_plan(optimizer=cg.SGD(lr=5e-4, momentum=0.9))
    with pytest.warns(UserWarning, match=r"this fit's win: lr \(param group 0\) 0\.0005"):
        history = resumed.fit(_scale_10_data(), 1, progress=False, checkpoint_dir=ckpt,
                              checkpoint_every=2, resume=True)
    assert history.lr == [1e-3] * 12 + [5e-4] * 20
    assert not history.faults and torch.isfinite(resumed.central_weights()).all()


def test_after_divergence_with_no_healthy_checkpoint_a_resume_starts_afresh(tmp_path):
    """SGD at η = 1, momentum 0.9 from the first round: every checkpoint (every 2 rounds) already
    holds a blown-up but finite z. The error says none is healthy and sets them aside, so the same
    fit compiled with η = 1e-3 and resume=True starts afresh, as a new fit at η = 1e-3."""
    ckpt = str(tmp_path)
    with pytest.raises(DivergenceError, match=r"no checkpoint of this run holds a healthy state "
                                              r"\(the training loss rose above 10× its first "
                                              r"round's, [0-9.]+, around each\): they are set aside "
                                              r"as ckpt-\d+\.pt\.diverged .*, so resume=True "
                                              r"starts afresh"):
        _linear_plan(optimizer=cg.SGD(lr=1.0, momentum=0.9)).fit(
            _scale_10_data(), 2, progress=False, checkpoint_dir=ckpt, checkpoint_every=2)
    assert load_latest(ckpt) is None
    resumed = _linear_plan(optimizer=cg.SGD(lr=1e-3, momentum=0.9))
    history = resumed.fit(_scale_10_data(), 1, progress=False, checkpoint_dir=ckpt, resume=True)
    fresh = _linear_plan(optimizer=cg.SGD(lr=1e-3, momentum=0.9))
    fresh.fit(_scale_10_data(), 1, progress=False)
    assert not history.faults and history.lr == [1e-3] * 32
    assert torch.equal(resumed.central_weights(), fresh.central_weights())



def test_replicas_faulty_in_turn_from_a_blown_up_z_is_divergence():
    """η raised to 1.0 after round 13 at SMA's default α, k = 2: z blows up but stays finite, and
    from round 20 the two replicas fault in turn, one per round, each reset from z and faulty
    again; no round has both. Once each has failed twice with no round free of faults between,
    DivergenceError stops the fit in place of a run that ends with an infinite training loss."""
    plan = _linear_plan(optimizer=cg.SGD(lr=1e-3, momentum=0.9), sync=cg.SMA(scale_lr=False))
    with pytest.raises(DivergenceError, match=r"all 2 replicas have NaN/Inf gradients in rounds "
                                              r"(\d+)–(\d+), twice each") as err:
        plan.fit(_scale_10_data(), 2, progress=False, policies=[_RaiseLr()])
    first, last = map(int, re.search(r"rounds (\d+)–(\d+)", str(err.value)).groups())
    assert err.value.round_index == last and last - first == 3
    assert "the central model z is finite" in str(err.value)


class _Gather:
    """A torchrun group's all-gather of the ranks' fault events, as ``share`` calls it."""

    rank, is_main = 0, True

    def __init__(self, other: list) -> None:
        self.other = other  # rank 1's events of the round

    def all_gather_object(self, mine, what, round_index):
        return [mine, self.other]


def _share(monitor, round_index, mine=(), other=()):
    monitor.pending = [FaultEvent(round=round_index, device="cpu:0", replica=r, rank=0)
                       for r in mine]
    other = [FaultEvent(round=round_index, device="cpu:0", replica=r, rank=1) for r in other]
    monitor.share(_Gather(other), round_index, num_learners=4, z=torch.zeros(3))


def test_the_ranks_count_faults_in_turn_over_every_rank():
    """Under torchrun (2 ranks × 2 learners): faults one rank at a time in rounds 5–8 cover every
    learner once, and a round free of faults ends the run; twice each in rounds 10–13 stops every
    rank, at the round where the last learner fails for the second time."""
    monitor = FaultMonitor()
    for t, mine, other in [(5, [0], []), (6, [], [0]), (7, [1], []), (8, [], [1])]:
        _share(monitor, t, mine, other)  # once each: not yet divergence
    _share(monitor, 9)  # no fault: the run ends
    for t, mine, other in [(10, [0, 1], []), (11, [], [0, 1]), (12, [0, 1], [])]:
        _share(monitor, t, mine, other)
    with pytest.raises(DivergenceError, match=r"in rounds 10–13, twice each .* on ranks 0, 1"):
        _share(monitor, 13, [], [0, 1])
    assert [(e.round, e.rank) for e in monitor.events] == [  # rank 1's, as they were shared
        (6, 1), (8, 1), (11, 1), (11, 1), (13, 1), (13, 1)]


# -- Ctrl-C to the coordinator alone -------------------------------------------------------------

_INTERRUPTED = textwrap.dedent("""
    import signal, sys, time
    # Ctrl-C as in a terminal: a shell's background job (CI) inherits SIGINT ignored
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.path.insert(0, {root!r})
    sys.path.insert(0, {tests!r})
    from crossbow_graph.training.hooks import Hook
    from test_faults import tanh_plan, data
    class Mark(Hook):  # after round 2 the workers run; then the rounds go on until SIGINT
        def after_round(self, ctx):
            if ctx.plan.rounds_done == 2:
                print(" ".join(str(p.pid) for p in ctx.plan.rounds.executors.process.executor.workers.procs if p),
                      flush=True)
    tanh_plan(devices=1, replicas=2, executor="process").fit(data(64 * 4000), 1, progress=False,
                                                            hooks=[Mark()], metrics_every=None)
""")


def test_sigint_to_the_coordinator_alone_stops_its_workers():
    """A real SIGINT to the coordinator only (its workers get no signal): the process ends and so
    do its worker processes."""
    script = _INTERRUPTED.format(root=ROOT, tests=os.path.join(ROOT, "tests"))
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        workers = [int(p) for p in proc.stdout.readline().split()]
        assert workers, proc.communicate()[1][-3000:]
        os.kill(proc.pid, signal.SIGINT)
        proc.communicate(timeout=60)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == -signal.SIGINT
    for pid in workers:  # gone (reaped by the coordinator, not orphaned)
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


_COORDINATOR = os.getpid()


class _CtrlC(nn.Module):
    """``tanh_plan``'s model whose forward, in this process only (the coordinator, learning group
    0) and once ``armed``, raises KeyboardInterrupt: Ctrl-C in the middle of a round, while the
    workers learn theirs and then wait for the coordinator's release."""

    armed = False

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))

    def forward(self, x):
        if _CtrlC.armed and os.getpid() == _COORDINATOR:
            raise KeyboardInterrupt
        return self.net(x)


class _ArmAfter(Hook):
    """Keeps the worker processes of round 2 and arms _CtrlC for the next forward."""

    def after_round(self, ctx) -> None:
        if ctx.plan.rounds_done == 2:
            self.procs = [p for p in ctx.plan.rounds.executors.process.executor.workers.procs if p is not None]
            _CtrlC.armed = True


def test_ctrl_c_in_the_coordinators_round_stops_the_workers_by_their_own_exit():
    """A KeyboardInterrupt in the coordinator's learning: its workers, which wait for its release
    of the round, are told to stop and exit by themselves (exit code 0) instead of being killed
    after a timeout."""
    torch.manual_seed(0)
    plan = cg.compile(_CtrlC(), (torch.zeros(1, 5),), nn.functional.cross_entropy, batch_size=4,
                      devices=1, replicas=2, executor="process")
    arm = _ArmAfter()
    try:
        with pytest.raises(KeyboardInterrupt):
            plan.fit(data(), 1, progress=False, hooks=[arm], metrics_every=None)
    finally:
        _CtrlC.armed = False
    assert arm.procs and [p.exitcode for p in arm.procs] == [0] * len(arm.procs)
    plan.fit(data(), 1, progress=False, metrics_every=None)  # the plan trains on

class PoisonZ(Hook):
    """Before round ``at`` (0-based), writes NaN into z (element 3) of every device."""

    def __init__(self, at: int) -> None:
        self.at = at

    def before_round(self, ctx) -> None:
        if ctx.plan.rounds_done == self.at:
            for s in ctx.plan.states:
                s.z[3] = math.nan


def test_divergence_error_says_whether_z_itself_holds_nan():
    """NaN in z reaches every replica through its correction α(w − z); the replicas reset to
    that z fail again, and the DivergenceError says z holds NaN (it is not intact)."""
    plan = tanh_plan(devices=1, replicas=2, executor="inline")
    with pytest.raises(DivergenceError, match=r"all 2 replicas have NaN/Inf gradients") as err:
        plan.fit(data(), 1, progress=False, hooks=[PoisonZ(at=2)])
    z = plan.central_weights()
    bad = int((~torch.isfinite(z)).sum())
    assert bad > 0  # the oracle: z's state when the error was raised
    assert f"the central model z itself holds NaN/Inf ({bad} of {z.numel()} values)" in str(err.value)
    assert "intact" not in str(err.value)
