"""SMA as docs/design-overview.md §2 says, checked against torch.optim.SGD and a hand-written reference."""

import copy
import functools
import math
import warnings

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

import crossbow_graph as cg
from _plans import make_plan, tiny_data
from _reference import flat, reference_sma, rule_lrs
from test_fit import BNNet

ATOL, RTOL = 1e-6, 1e-5  # float32, a few dozen rounds of the same operations in another order


class Small(nn.Module):
    def __init__(self, dropout: float = 0.0):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3)
        self.fc = nn.Linear(4 * 6 * 6, 5)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        return self.fc(self.drop(torch.relu(self.conv(x)).flatten(1)))


def batches(n, b, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(b, 1, 8, 8, generator=g), torch.randint(0, 5, (b,), generator=g)) for _ in range(n)]


def as_dataset(bs):
    return TensorDataset(torch.cat([x for x, _ in bs]), torch.cat([y for _, y in bs]))


# the plans of these tests: the model as given, 1 device × 1 replica unless given, SGD(0.05, momentum 0.9)
sma_plan = functools.partial(make_plan, seed=None, devices=1, replicas=1, sync=cg.SMA())


def test_one_learner_equals_torch_sgd_step_for_step():
    model = Small()
    eager = copy.deepcopy(model)
    sgd = torch.optim.SGD(eager.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
    plan = sma_plan(model, optimizer=cg.SGD(lr=0.05, momentum=0.9, weight_decay=1e-4))
    for x, y in batches(6, 4):
        plan.fit(TensorDataset(x, y), 1, shuffle=False, progress=False)
        sgd.zero_grad()
        F.cross_entropy(eager(x), y).backward()
        sgd.step()
        torch.testing.assert_close(plan.central_weights(), flat(eager.parameters()), atol=ATOL, rtol=RTOL)
    for key, value in eager.state_dict().items():
        torch.testing.assert_close(plan.central_model().state_dict()[key], value, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("nesterov,weight_decay,alpha,mu_z", [
    (False, 0.0, None, 0.9), (True, 1e-3, None, 0.9), (False, 0.0, 0.1, 0.5), (False, 1e-4, 1.0, 0.0),
])
@pytest.mark.filterwarnings("ignore:SMA with k")  # the update's arithmetic, past z's bound too
def test_matches_hand_written_reference(nesterov, weight_decay, alpha, mu_z):
    model = Small()
    k, rounds, b = 4, 5, 4
    bs = batches(k * rounds, b)
    opt = cg.SGD(lr=0.05, momentum=0.9, nesterov=nesterov, weight_decay=weight_decay)
    plan = sma_plan(model, devices=2, replicas=2, batch_size=b, optimizer=opt,
                    sync=cg.SMA(alpha=alpha, central_momentum=mu_z))
    start = copy.deepcopy(model)  # the fit leaves z in model
    plan.fit(as_dataset(bs), 1, shuffle=False, progress=False)
    z, replicas = reference_sma(start, bs, k=k, rounds=rounds, lr=0.05, momentum=0.9,
                                weight_decay=weight_decay, nesterov=nesterov, alpha=alpha,
                                central_momentum=mu_z)
    torch.testing.assert_close(plan.central_weights(), flat(z), atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(plan.replica_weights(),
                               torch.stack([flat(r.parameters()) for r in replicas]), atol=ATOL, rtol=RTOL)


def test_alpha_one_over_k_without_central_momentum_is_the_mean_of_prestep_replicas():
    plan = sma_plan(Small(), devices=2, replicas=3, sync=cg.SMA(alpha=1 / 6, central_momentum=0.0))
    bs = batches(3 * 6, 4)
    for t in range(3):
        pre = plan.replica_weights()  # ŵ_j of round t
        plan.fit(as_dataset(bs[6 * t: 6 * t + 6]), 1, shuffle=False, progress=False)
        torch.testing.assert_close(plan.central_weights(), pre.mean(dim=0), atol=ATOL, rtol=RTOL)
        if t > 0:
            assert not torch.allclose(pre[0], pre[1])  # the replicas really differ


def test_every_device_holds_the_same_z_after_each_sync():
    plan = sma_plan(Small(), devices=3, replicas=2)
    bs = batches(6 * 4, 4)
    for t in range(4):
        plan.fit(as_dataset(bs[6 * t: 6 * t + 6]), 1, shuffle=False, progress=False)
        for d in range(1, 3):
            assert torch.equal(plan.central_weights(d), plan.central_weights(0))


@pytest.mark.parametrize("k", [2, 16, 64])
@pytest.mark.parametrize("mu_z", [0.0, 0.9])
def test_pull_bound_is_where_the_pull_alone_turns_unstable(k, mu_z):
    """design-overview §2, the pull's stability bound: SMA's update without the gradient, by hand
    in float64 (c_j = α(w_j − z), w_j ← w_j − c_j, z ← z + Σ_j c_j + μ_z(z − z_prev)) from
    replicas spread around z, dies out at 0.95 of ``pull_bound`` and blows up at 1.05 of it."""
    def spread_after(alpha: float, rounds: int = 1000) -> float:
        w = torch.linspace(-1.0, 1.0, k, dtype=torch.float64) + 0.3
        z = z_prev = torch.zeros((), dtype=torch.float64)
        for _ in range(rounds):
            c = alpha * (w - z)
            w = w - c
            z, z_prev = z + c.sum() + mu_z * (z - z_prev), z
        return float((w - z).abs().max() + (z - z_prev).abs())

    bound = cg.engine.sync.sma.pull_bound(k, mu_z)
    assert spread_after(0.95 * bound) < 1e-6
    assert spread_after(1.05 * bound) > 1e6


@pytest.mark.parametrize("alpha", [0.2, 0.5, 1.0])
@pytest.mark.parametrize("mu_z", [0.0, 0.9])
def test_centre_bound_is_where_zs_rate_turns_the_pull_unstable_whatever_k(alpha, mu_z):
    """design-overview §2: with z's rate β toward the replicas' mean set apart from α
    (z ← z + β·(mean_j w_j − z) + μ_z(z − z_prev), by hand in float64), the pull alone dies out
    at 0.95 of ``centre_bound`` and blows up at 1.05 of it, at k = 4 and at k = 64 alike."""
    def spread_after(k: int, beta: float, rounds: int = 2000) -> float:
        w = torch.linspace(-1.0, 1.0, k, dtype=torch.float64) + 0.3
        z = z_prev = torch.zeros((), dtype=torch.float64)
        for _ in range(rounds):
            mean_offset = (w - z).mean()
            w = w - alpha * (w - z)
            z, z_prev = z + beta * mean_offset + mu_z * (z - z_prev), z
        return float((w - z).abs().max() + (z - z_prev).abs())

    bound = cg.engine.sync.sma.centre_bound(alpha, mu_z)
    for k in (4, 64):
        assert spread_after(k, 0.95 * bound) < 1e-6
        assert spread_after(k, 1.05 * bound) > 1e6


def test_default_alpha_has_a_floor_and_zs_rate_a_cap():
    """SMA()'s rule (design §2): α = 0.8 of the pull's bound while that is at least 0.5, with
    CROSSBOW's β = k·α (γ = 1); from k = 5 (μ_z = 0.9) α = 0.5 and β = 0.8·(1 + μ_z)(2 − α) =
    2.28, a share γ = β/(k·α) of the corrections' sum. A set α keeps β = k·α; a set β stays."""
    sma = cg.SMA()
    for k in (2, 3, 4):
        alpha = sma.alpha_for(k)
        assert alpha == pytest.approx(0.8 * 2 * 1.9 / (1 + k + 0.9), rel=1e-12)
        assert sma.centre_rate_for(k) == k * alpha
        assert sma.centre_gain(k) == 1.0
    for k in (5, 16, 64):
        assert sma.alpha_for(k) == 0.5
        assert sma.centre_rate_for(k) == pytest.approx(2.28, rel=1e-12)
        assert sma.centre_gain(k) == pytest.approx(2.28 / (0.5 * k), rel=1e-12)
    assert cg.SMA(alpha=0.1).centre_gain(64) == 1.0  # k·α = 6.4, the user's to keep
    assert cg.SMA(centre_rate=1.0).centre_gain(16) == pytest.approx(1 / 8)
    assert (sma.alpha_for(1), sma.centre_rate_for(1), sma.centre_gain(1)) == (0.0, 0.0, 1.0)
    assert "β=2.28" in sma.summary_rule(16) and "β" not in sma.summary_rule(4)


def test_a_users_alpha_or_beta_past_zs_bound_is_warned_at_adjust_and_fit_and_the_default_never():
    """β ≥ (1 + μ_z)(2 − α) (design §2): SMA(alpha=0.1) from k = 37 (β = 3.7 ≥ 3.61; 3.6 at 36
    is inside), a set β past the bound; SMA()'s rule at no k; Adjustment(alpha=0.5) at k = 8 (β = 4
    ≥ 2.85) warns the caller of Plan.adjust and of Plan.fit, and "auto" ends it."""
    assert cg.SMA(alpha=0.1).stability_warning(36) is None
    assert "3.61" in cg.SMA(alpha=0.1).stability_warning(37)
    assert cg.SMA(alpha=0.5, centre_rate=2.8).stability_warning(8) is None
    assert cg.SMA(alpha=0.5, centre_rate=2.9).stability_warning(8) is not None
    assert all(cg.SMA().stability_warning(k) is None for k in range(1, 257))
    plan = make_plan(replicas=8, executor="inline", learner_mode="fused")
    with pytest.warns(UserWarning, match="β = 4 is at or above its stability bound") as caught:
        plan.adjust(cg.Adjustment(alpha=0.5))
    assert caught[0].filename == __file__
    with pytest.warns(UserWarning, match="stability bound"):
        plan.fit(tiny_data(64), 1, progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plan.adjust(cg.Adjustment(alpha="auto"))


@pytest.mark.parametrize("beta, error", [(0.0, ValueError), (-1.0, ValueError), (math.inf, ValueError),
                                         (math.nan, ValueError), ("2", TypeError)])
def test_centre_rate_not_finite_and_positive_is_an_error(beta, error):
    with pytest.raises(error, match="centre_rate"):
        cg.SMA(centre_rate=beta)


@pytest.mark.parametrize("alpha", [0.0, -0.5, 1.5])
def test_alpha_outside_unit_interval_is_a_value_error(alpha):
    with pytest.raises(ValueError, match="α must be in"):
        sma_plan(Small(), devices=2, replicas=2, sync=cg.SMA(alpha=alpha))


def test_sync_every_tau_rounds_matches_reference_on_sync_rounds():
    """τ = 2: between syncs the learners only step; on the sync round the usual correction."""
    model, b = Small(), 4
    bs = batches(2 * 2, b)  # 2 rounds × 2 learners
    plan = sma_plan(model, devices=1, replicas=2, batch_size=b,
                    sync=cg.SMA(alpha=0.5, sync_every=2, central_momentum=0.0))
    start = copy.deepcopy(model)  # the fit leaves z in model
    plan.fit(as_dataset(bs), 1, shuffle=False, progress=False)
    reps = [copy.deepcopy(start) for _ in range(2)]
    opts = [torch.optim.SGD(r.parameters(), lr=0.05, momentum=0.9) for r in reps]
    z = flat(start.parameters())
    etas = rule_lrs(0.05, [2, 2], b, len(bs) * b)  # SMA's η rule: 0.05, then 0.05·√2
    for t in range(2):
        pre = []
        for j, (r, o) in enumerate(zip(reps, opts)):
            x, y = bs[t * 2 + j]
            pre.append(flat(r.parameters()))
            o.param_groups[0]["lr"] = etas[t]
            o.zero_grad()
            F.cross_entropy(r(x), y).backward()
            o.step()
    # round 2 synchronises: w_j ← SGD step − α(ŵ_j − z); z ← mean ŵ_j (α=1/2, μ_z=0)
    expected_z = torch.stack(pre).mean(0)
    torch.testing.assert_close(plan.central_weights(), expected_z, atol=ATOL, rtol=RTOL)
    expected_w = torch.stack([flat(r.parameters()) - 0.5 * (p - z) for r, p in zip(reps, pre)])
    torch.testing.assert_close(plan.replica_weights(), expected_w, atol=ATOL, rtol=RTOL)


# -- float64: a float64 model trains in float64 ------------------------------------------------

ATOL64 = RTOL64 = 1e-12  # float64: the same sums in another order, many digits below float32's


def batches64(n, b):
    return [(x.double(), y) for x, y in batches(n, b)]


@pytest.mark.parametrize("learner_mode", ["per_replica", "fused"])
def test_float64_one_learner_equals_torch_sgd_in_float64(learner_mode):
    model = BNNet().double()  # conv, BatchNorm (float buffers), linear
    eager = copy.deepcopy(model)
    sgd = torch.optim.SGD(eager.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
    plan = cg.compile(model, (torch.randn(2, 1, 8, 8, dtype=torch.float64),), F.cross_entropy,
                      batch_size=4, replicas=1, learner_mode=learner_mode,
                      optimizer=cg.SGD(lr=0.05, momentum=0.9, weight_decay=1e-4))
    state = plan.states[0]
    for name in ("w", "v", "g", "buf", "z", "z_prev", "zbuf"):
        assert getattr(state, name).dtype == torch.float64, name
    assert state.replicas[0].conv.weight.data_ptr() == state.w[0].data_ptr()  # views of w
    for x, y in batches64(6, 4):
        plan.fit(TensorDataset(x, y), 1, shuffle=False, progress=False)
        sgd.zero_grad()
        F.cross_entropy(eager(x), y).backward()
        sgd.step()
        z = plan.central_weights()
        assert z.dtype == torch.float64
        torch.testing.assert_close(z, flat(eager.parameters()), atol=ATOL64, rtol=RTOL64)
    central = plan.central_model()
    assert all(p.dtype == torch.float64 for p in central.parameters())
    for key, value in eager.state_dict().items():
        torch.testing.assert_close(central.state_dict()[key], value, atol=ATOL64, rtol=RTOL64)


@pytest.mark.parametrize("executor,learner_mode", [("inline", "per_replica"), ("inline", "fused"),
                                                   ("process", "per_replica"), ("process", "fused")])
def test_float64_matches_hand_written_reference_in_float64(executor, learner_mode):
    model = Small().double()
    k, rounds, b = 4, 5, 4
    bs = batches64(k * rounds, b)
    opt = cg.SGD(lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-4)
    plan = cg.compile(model, (torch.randn(2, 1, 8, 8, dtype=torch.float64),), F.cross_entropy,
                      batch_size=b, replicas=k, optimizer=opt, executor=executor,
                      learner_mode=learner_mode, sync=cg.SMA(central_momentum=0.9))
    assert all(kernel.backend == "torch" for kernel in plan.kernels)  # auto: the C kernels are fp32
    start = copy.deepcopy(model)  # the fit leaves z in model
    plan.fit(as_dataset(bs), 1, shuffle=False, progress=False)
    z, replicas = reference_sma(start, bs, k=k, rounds=rounds, lr=0.05, momentum=0.9,
                                weight_decay=1e-4, nesterov=True, central_momentum=0.9)
    assert plan.central_weights().dtype == plan.replica_weights().dtype == torch.float64
    torch.testing.assert_close(plan.central_weights(), flat(z), atol=ATOL64, rtol=RTOL64)
    torch.testing.assert_close(plan.replica_weights(), torch.stack([flat(r.parameters()) for r in replicas]),
                               atol=ATOL64, rtol=RTOL64)
