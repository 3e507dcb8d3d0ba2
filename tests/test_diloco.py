"""sync=DiLoCo(...): an outer optimizer over z every H rounds (docs/design-overview.md §2,
"Outer optimizers: DiLoCo"), checked against a hand-written DiLoCo in eager PyTorch; and SMA's
default rule kept bit for bit."""

from __future__ import annotations

import copy
import functools
import warnings
from fractions import Fraction

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

import crossbow_graph as cg

from _plans import make_plan
from _reference import batches_of, flat, reference_diloco, rule_lrs

# -- SMA stays bit-identical -------------------------------------------------------------------
#
# The SMA update must not change when DiLoCo is added beside it. A bitwise check that holds on
# every machine: a linear model, a mean-squared loss, dyadic data and weights, η = 1/8 (× 2 from
# round 1: SMA's η rule at k = 4), μ_l = μ_z
# = 1/2 and α = 1/4 keep every value of four rounds a dyadic rational of at most 24 significant
# bits, so each float32 operation is exact whatever its order, vector width or FMA, and the
# engine's z and replicas equal the exact rational SMA of docs/design-overview.md §2 (Fractions)
# bit for bit. Any change of the rule (a term, a coefficient, when it applies) changes those bits.

ETA, MU_L, MU_Z = Fraction(1, 8), Fraction(1, 2), Fraction(1, 2)
W0 = (Fraction(1, 2), Fraction(-1, 4), Fraction(1, 8))  # weight[0, 0], weight[0, 1], bias


def _dyadic_data(n: int) -> tuple[list[tuple[Fraction, Fraction]], list[Fraction]]:
    """n samples: x in {−1, 0, 1}², y in {−1, 0, 1}, a fixed pattern."""
    xs = [(Fraction((7 * i + 3) % 3 - 1), Fraction((5 * i + 1) % 3 - 1)) for i in range(n)]
    ys = [Fraction((11 * i + 2) % 3 - 1) for i in range(n)]
    return xs, ys


def _exact_sma(rounds: int, *, k: int, b: int, sync_every: int):
    """SMA by the book in exact rationals: (z, replicas) as lists of (w00, w01, bias); round t
    steps at η·f_t, f SMA's η rule (1, then √min(k, 16) = 2 at k = 4: a ramp of one round)."""
    xs, ys = _dyadic_data(rounds * k * b)
    factors = [Fraction(f) for f in rule_lrs(1.0, [k] * rounds, b, rounds * k * b)]
    alpha = Fraction(1, k)
    ws, vs = [list(W0) for _ in range(k)], [None] * k
    z, z_prev = list(W0), list(W0)
    for t in range(rounds):
        sync = (t + 1) % sync_every == 0
        total = [Fraction(0)] * 3
        for j in range(k):
            w, g = ws[j], [Fraction(0)] * 3
            for i in range((t * k + j) * b, (t * k + j + 1) * b):
                e = 2 * (w[0] * xs[i][0] + w[1] * xs[i][1] + w[2] - ys[i]) / b  # d(mean sq)/d out
                g = [g[0] + e * xs[i][0], g[1] + e * xs[i][1], g[2] + e]
            vs[j] = g if vs[j] is None else [MU_L * v + gi for v, gi in zip(vs[j], g)]
            c = [alpha * (wi - zi) for wi, zi in zip(w, z)] if sync else [Fraction(0)] * 3
            ws[j] = [wi - ETA * factors[t] * vi - ci for wi, vi, ci in zip(w, vs[j], c)]
            total = [a + ci for a, ci in zip(total, c)]
        if sync:
            z, z_prev = [zi + ci + MU_Z * (zi - zp) for zi, ci, zp in zip(z, total, z_prev)], z
    return z, ws


def _as_float32(values) -> torch.Tensor:
    for q in values:  # exactly representable: a power-of-two denominator, ≤ 24 significant bits
        odd = abs(q.numerator)
        while odd and odd % 2 == 0:
            odd //= 2
        assert q.denominator & (q.denominator - 1) == 0 and odd.bit_length() <= 24, q
    return torch.tensor([float(q) for q in values], dtype=torch.float32)


def _dyadic_model() -> nn.Linear:
    """Linear(2 → 1) with the weights W0."""
    model = nn.Linear(2, 1)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[float(W0[0]), float(W0[1])]]))
        model.bias.fill_(float(W0[2]))
    return model


def _row_sgd(model: nn.Module) -> torch.optim.SGD:
    """Not the SGD kernels: torch.optim.SGD with two param groups, per replica."""
    return torch.optim.SGD([{"params": [model.weight]}, {"params": [model.bias]}],
                           lr=float(ETA), momentum=float(MU_L))


def _squared(out, y):
    return F.mse_loss(out.squeeze(1), y)


@pytest.mark.parametrize("case", [
    dict(executor="inline"), dict(executor="process"),
    dict(executor="inline", kernel_backend="torch", sync_every=2),
    dict(executor="inline", optimizer="row"), dict(executor="process", optimizer="row"),
])
def test_sma_default_rule_is_bit_identical_to_exact_sma(case):
    case = dict(case)
    tau = case.pop("sync_every", 1)
    row = case.pop("optimizer", None) == "row"
    plan = make_plan(_dyadic_model, seed=None, example=torch.zeros(1, 2), loss_fn=_squared,
                     optimizer=_row_sgd if row else cg.SGD(lr=float(ETA), momentum=float(MU_L)),
                     devices=2, replicas=2, sync=cg.SMA(alpha=0.25, central_momentum=float(MU_Z), sync_every=tau),
                     **case)  # α = 1/4, dyadic (the default, 0.8 of the pull's bound, is not)
    rounds, k, b = 4, 4, 4
    xs, ys = _dyadic_data(rounds * k * b)
    data = TensorDataset(torch.tensor([[float(a), float(c)] for a, c in xs]),
                         torch.tensor([float(y) for y in ys]))
    plan.fit(data, 1, shuffle=False, progress=False, metrics_every=None)
    assert plan.rounds_done == rounds
    z, ws = _exact_sma(rounds, k=k, b=b, sync_every=tau)
    assert torch.equal(plan.central_weights(), _as_float32(z))
    assert torch.equal(plan.replica_weights(), torch.stack([_as_float32(w) for w in ws]))


# -- DiLoCo against a hand-written DiLoCo in eager PyTorch -------------------------------------

RTOL = 1e-5  # float32: the same operations, Δ summed in another order


class Small(nn.Module):
    """conv(1→4, 3×3) → ReLU → linear(4·6·6 → 5) on 1×8×8 inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3)
        self.fc = nn.Linear(4 * 6 * 6, 5)

    def forward(self, x):
        return self.fc(torch.relu(self.conv(x)).flatten(1))


def _data(n: int, seed: int = 1) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 1, 8, 8, generator=g), torch.randint(0, 5, (n,), generator=g))


NESTEROV = functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)


@pytest.mark.parametrize("devices,replicas", [(2, 2), (1, 4)])
def test_diloco_equals_the_hand_written_reference(devices, replicas):
    """k = 4, τ = H = 5, inner AdamW, 20 rounds: z within 1e-5 relative error of eager DiLoCo."""
    k, b, rounds, H = 4, 4, 20, 5
    torch.manual_seed(0)
    model, data = Small(), _data(k * b * rounds)
    plan = cg.compile(model, (torch.zeros(1, 1, 8, 8),), F.cross_entropy, batch_size=b,
                      devices=devices, replicas=replicas,
                      optimizer=torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01),
                      sync=cg.DiLoCo(sync_every=H))
    assert plan.rounds.resolved_executor() == "inline"  # auto picks it for DiLoCo
    start = copy.deepcopy(model)  # the fit leaves z in model
    plan.fit(data, 1, shuffle=False, progress=False, metrics_every=None)
    assert plan.rounds_done == rounds
    z, ws = reference_diloco(start, batches_of(data, b), k=k, rounds=rounds, H=H, outer=NESTEROV,
                             inner=lambda p: torch.optim.AdamW(p, lr=3e-3, weight_decay=0.01))
    got = plan.central_weights()
    assert (got - z).norm() / z.norm() < RTOL
    torch.testing.assert_close(got, z, rtol=RTOL, atol=1e-6)
    assert torch.equal(plan.replica_weights(), got.expand(k, -1))  # restarted from z
    assert not torch.allclose(got, flat(start), atol=1e-3)  # it trained


def _ignored(data: TensorDataset, batches: list[int], b: int) -> TensorDataset:
    """``data`` with the labels of batches ``batches`` (of b samples) set to ignore_index: their
    loss is NaN, so the learner that takes one is faulty that round (engine/learning/faults.py)."""
    x, y = data.tensors
    y = y.clone()
    for i in batches:
        y[i * b:(i + 1) * b] = -100
    return TensorDataset(x, y)


@pytest.mark.parametrize("case", ["one learner", "local SGD", "faults"])
def test_diloco_with_the_sgd_kernels_one_learner_local_sgd_and_faults(case):
    """Inner SGD with momentum (the fused SGD kernels), H = 3, 9 rounds. One learner: DiLoCo is
    still an outer step (Δ = z − w_0). Local SGD: an outer SGD with lr 1 and no momentum makes z
    the mean of the replicas. Faults: a faulty replica is reset to z with fresh optimizer state
    (mid-window: it trains on from z; in a sync round: it is in the mean at z, Δ_j = 0, the
    mean still over all k)."""
    k = 1 if case == "one learner" else 2
    b, rounds, H = 4, 9, 3
    outer = functools.partial(torch.optim.SGD, lr=1.0) if case == "local SGD" else NESTEROV
    torch.manual_seed(0)
    model, data = Small(), _data(k * b * rounds)
    faulty = {(1, 1), (5, 0)} if case == "faults" else set()  # (round, learner): mid-window, sync
    if faulty:
        data = _ignored(data, [t * k + j for t, j in faulty], b)
    plan = cg.compile(model, (torch.zeros(1, 1, 8, 8),), F.cross_entropy, batch_size=b,
                      devices=1, replicas=k, optimizer=cg.SGD(lr=0.05, momentum=0.9),
                      sync=cg.DiLoCo(sync_every=H, outer_optimizer=outer))
    start = copy.deepcopy(model)  # the fit leaves z in model
    history = plan.fit(data, 1, shuffle=False, progress=False, metrics_every=None)
    assert sorted((f.round, f.replica) for f in history.faults) == sorted(faulty)

    x, y = data.tensors  # the reference: k copies, torch.optim.SGD each
    copies = [copy.deepcopy(start) for _ in range(k)]
    inners = [torch.optim.SGD(c.parameters(), lr=0.05, momentum=0.9) for c in copies]
    z = [p.detach().clone() for p in start.parameters()]
    outer_opt = outer(z)
    for t in range(rounds):
        for j, c in enumerate(copies):
            if (t, j) in faulty:  # reset to z, fresh state, no step
                with torch.no_grad():
                    for p, zi in zip(c.parameters(), z):
                        p.copy_(zi)
                inners[j] = torch.optim.SGD(c.parameters(), lr=0.05, momentum=0.9)
                continue
            sl = slice((t * k + j) * b, (t * k + j + 1) * b)
            inners[j].zero_grad()
            F.cross_entropy(c(x[sl]), y[sl]).backward()
            inners[j].step()
        if (t + 1) % H == 0:
            with torch.no_grad():
                mean = [torch.stack([list(c.parameters())[i] for c in copies]).mean(0)
                        for i in range(len(z))]
                if case == "local SGD":  # periodic averaging: z is the replicas' mean
                    expected_mean = torch.cat([m.reshape(-1) for m in mean])
                for zi, m in zip(z, mean):
                    zi.grad = zi - m
                outer_opt.step()
                for c in copies:
                    for p, zi in zip(c.parameters(), z):
                        p.copy_(zi)
    expected = torch.cat([zi.reshape(-1) for zi in z])
    torch.testing.assert_close(plan.central_weights(), expected, rtol=RTOL, atol=1e-6)
    if case == "local SGD":
        torch.testing.assert_close(plan.central_weights(), expected_mean, rtol=RTOL, atol=1e-6)


class SmallBN(Small):
    """Small with BatchNorm2d after the convolution (running statistics per replica)."""

    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x):
        return self.fc(torch.relu(self.bn(self.conv(x))).flatten(1))


def test_diloco_averages_float_buffers_into_zbuf_and_keeps_them_per_replica():
    """Only parameters restart from z: zbuf is the replicas' mean buffers at the sync, and each
    replica keeps its own running statistics (as DiLoCo syncs parameters only)."""
    torch.manual_seed(0)
    plan = cg.compile(SmallBN(), (torch.zeros(2, 1, 8, 8),), F.cross_entropy, batch_size=4,
                      devices=2, replicas=2, optimizer=cg.SGD(lr=0.05, momentum=0.9),
                      sync=cg.DiLoCo(sync_every=2))
    plan.fit(_data(4 * 4 * 4), 1, shuffle=False, progress=False, metrics_every=None)
    bufs = torch.cat([s.buf for s in plan.states])  # [k, Q]
    assert not torch.allclose(bufs[0], bufs[1])
    for s in plan.states:
        torch.testing.assert_close(s.zbuf, bufs.mean(0), rtol=1e-6, atol=1e-7)
        assert torch.equal(s.z, plan.states[0].z) and torch.equal(s.z_prev, plan.states[0].z_prev)
    assert not torch.equal(plan.states[0].z, plan.states[0].z_prev)


# -- checkpoints -------------------------------------------------------------------------------

class _StopAfter(cg.Hook):
    def __init__(self, n: int) -> None:
        self.n = n

    def after_round(self, ctx) -> None:
        ctx.stop = ctx.plan.rounds_done >= self.n


# SmallBN at b = 4 on 2 devices × 2 replicas, AdamW per replica, DiLoCo with H = 3
_adamw_plan = functools.partial(make_plan, model=SmallBN, example=torch.zeros(2, 1, 8, 8), devices=2,
                                replicas=2, optimizer=lambda m: torch.optim.AdamW(m.parameters(), lr=3e-3),
                                sync=cg.DiLoCo(sync_every=3))


@pytest.mark.parametrize("stop_at", [4, 6])  # mid-window (after 1 outer step), at an outer step
def test_resume_mid_run_gives_the_uninterrupted_z_bit_for_bit(tmp_path, stop_at):
    data = _data(4 * 4 * 10)
    full = _adamw_plan()
    full.fit(data, 1, progress=False, seed=3, metrics_every=None)
    ckpt = str(tmp_path / "ckpt")
    first = _adamw_plan()
    first.fit(data, 1, progress=False, seed=3, metrics_every=None, checkpoint_dir=ckpt,
              checkpoint_every=1, hooks=[_StopAfter(stop_at)])
    second = _adamw_plan()
    second.fit(data, 1, progress=False, seed=3, metrics_every=None, checkpoint_dir=ckpt,
               checkpoint_every=1, resume=True)
    assert second.rounds_done == full.rounds_done == 10
    for a, b in zip(full.states, second.states):
        for key in ("z", "z_prev", "w", "buf", "zbuf"):
            assert torch.equal(getattr(a, key), getattr(b, key)), key
    mine, theirs = (p.rounds.sync_state.state_dict()["state"][0]["momentum_buffer"] for p in (full, second))
    assert torch.equal(mine, theirs) and mine.abs().sum() > 0


@pytest.mark.parametrize("written, resumed", [
    (cg.SMA(), cg.DiLoCo(sync_every=2)), (cg.DiLoCo(sync_every=2), cg.SMA()),
    (cg.SSGD(), cg.SMA()), (cg.SMA(), cg.SSGD(scale_lr=True))])
def test_a_checkpoint_of_another_sync_is_refused(tmp_path, written, resumed):
    """A checkpoint resumes only under the sync algorithm that wrote it, also where neither has
    an outer optimizer (SSGD and SMA keep the same tensors), before any state is copied."""
    data = _data(4 * 4 * 2)

    def plan(sync):
        return cg.compile(Small(), (torch.zeros(1, 1, 8, 8),), F.cross_entropy, batch_size=4,
                          devices=2, replicas=2, sync=sync, optimizer=cg.SGD(lr=0.1, momentum=0.9))

    plan(written).fit(data, 1, progress=False, metrics_every=None, checkpoint_dir=str(tmp_path))
    other = plan(resumed)
    z = other.states[0].z.clone()
    theirs, mine = type(written).__name__, type(resumed).__name__
    with pytest.raises(cg.CheckpointError, match=rf"written with sync={theirs}\(\.\.\.\), but "
                       rf"this plan's is sync={mine}\(\.\.\.\); compile with sync={theirs}"):
        other.fit(data, 2, progress=False, metrics_every=None, checkpoint_dir=str(tmp_path),
                  resume=True)
    assert torch.equal(other.states[0].z, z) and other.rounds_done == 0


# -- bad arguments -----------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, error, match", [
    (dict(sync_every=0), ValueError, r"DiLoCo\(sync_every=0\): H, .* integer ≥ 1"),
    (dict(sync_every=2.5), ValueError, r"sync_every=2.5"),
    (dict(sync_every=4, outer_optimizer=3), TypeError, r"must be callable as outer_optimizer\(params\)"),
    (dict(sync_every=4, outer_optimizer=torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1)),
     TypeError, r"pass a factory .* not an optimizer"),
])
def test_bad_diloco_arguments_are_clear_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        cg.DiLoCo(**kwargs)


# Small on 2 devices × 1 replica, compile's optimizer
_small_plan = functools.partial(make_plan, model=Small, seed=None, example=torch.zeros(1, 1, 8, 8),
                                optimizer=None, devices=2, replicas=1)


@pytest.mark.parametrize("factory, error, match", [
    (functools.partial(torch.optim.SGD, lr=-1.0), ValueError, r"calling it with \[z\] raised ValueError: Invalid learning rate"),
    (lambda params: "SGD", TypeError, r"returned str, not a torch.optim optimizer"),
    (lambda params: torch.optim.SGD([torch.zeros(3, requires_grad=True)], lr=1.0), TypeError,
     r"must optimise the list it is called with"),
    (torch.optim.LBFGS, TypeError, r"LBFGS re-evaluates a loss"),
])
def test_a_bad_outer_optimizer_fails_at_compile(factory, error, match):
    with pytest.raises(error, match=match):
        _small_plan(sync=cg.DiLoCo(sync_every=2, outer_optimizer=factory))


def test_diloco_on_the_process_executor_and_alpha_are_refused():
    with pytest.raises(ValueError, match=r"DiLoCo\(...\) runs on the inline executor only.*executor='inline'"):
        _small_plan(sync=cg.DiLoCo(sync_every=2), executor="process")
    plan = _small_plan(sync=cg.DiLoCo(sync_every=2))
    assert plan.rounds.resolved_executor() == "inline"
    with pytest.raises(ValueError, match="DiLoCo pulls no replica toward z"):
        plan.adjust(cg.Adjustment(alpha=0.5))
    plan.adjust(cg.Adjustment(sync_every=4))  # H changes like τ
    assert plan.sync == cg.DiLoCo(sync_every=4) and plan.sync.sync_every == 4
    assert "DiLoCo(outer SGD(lr=0.7, momentum=0.9, nesterov=True" in plan.summary()


# -- torchrun: two processes -------------------------------------------------------------------

@pytest.mark.distributed
@pytest.mark.parametrize("sync_dtype", ["fp32", "bf16"])
def test_two_processes_step_the_same_outer_optimizer_and_give_the_one_process_z(tmp_path, sync_dtype):
    """Two gloo ranks × 2 learners, resumed from a checkpoint in the middle of a window: every
    rank has the same z and outer optimizer state bit for bit (the same all-reduced Δ, the same
    steps), and z is the uninterrupted one-process DiLoCo's with k = 4 up to the summation order
    (fp32), or up to bf16's rounding of Σ_j (w_j − z) (2⁻⁹ relative, the rest carried by error
    feedback: bf16)."""
    import os
    import socket
    import subprocess
    import sys

    from _dist_diloco import B, H, M, ROUNDS, BNNoBias
    from _plans import tiny_data

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    here = os.path.dirname(os.path.abspath(__file__))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2",
               PYTHONPATH=os.path.dirname(here), OMP_NUM_THREADS="1", CB_SYNC_DTYPE=sync_dtype)
    procs = [subprocess.Popen([sys.executable, os.path.join(here, "_dist_diloco.py"), str(tmp_path)],
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(2)]
    try:
        logs = [p.communicate(timeout=90)[0] for p in procs]  # a safety net against a hang
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in procs] == [0, 0], logs
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2))
    assert "error" not in r0 and "error" not in r1, (r0.get("error"), r1.get("error"))
    assert r0["rounds"] == r1["rounds"] == ROUNDS
    assert torch.equal(r0["z"], r1["z"]) and torch.equal(r0["zbuf"], r1["zbuf"])
    b0, b1 = (r["outer"]["state"][0]["momentum_buffer"] for r in (r0, r1))
    assert torch.equal(b0, b1) and b0.abs().sum() > 0
    one = make_plan(BNNoBias, seed=0, batch_size=B, devices=1, replicas=2 * M, executor="inline",
                    sync=cg.DiLoCo(sync_every=H),
                    optimizer=lambda m: torch.optim.AdamW(m.parameters(), lr=0.01))
    one.fit(tiny_data(ROUNDS * B * M * 2), 1, shuffle=False, progress=False)
    if sync_dtype == "fp32":
        torch.testing.assert_close(r0["z"], one.central_weights(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(r0["zbuf"], one.states[0].zbuf, rtol=1e-5, atol=1e-6)
    else:  # |Δ| ≲ 0.1 after H AdamW steps of η 0.01: 2⁻⁹ of it per outer step, two steps (and
        # the BatchNorm statistics of the weights that differ by that much)
        assert not torch.equal(r0["z"], one.central_weights())
        torch.testing.assert_close(r0["z"], one.central_weights(), rtol=0, atol=1e-3)
        torch.testing.assert_close(r0["zbuf"], one.states[0].zbuf, rtol=0, atol=1e-3)


def test_a_fit_shorter_than_h_warns_that_z_gets_no_outer_step():
    """8 rounds with H = 16: z would end where it started; the warning names the fix."""
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(64, 1, 8, 8, generator=g),
                                          torch.randint(0, 4, (64,), generator=g))
    plan = _small_plan(sync=cg.DiLoCo(sync_every=16))
    with pytest.warns(UserWarning, match=r"runs 8 rounds, fewer than H.*sync_every ≤ 8"):
        plan.fit(data, 1, progress=False, metrics_every=None)
    plan = _small_plan(sync=cg.DiLoCo(sync_every=8))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        plan.fit(data, 1, progress=False, metrics_every=None)
