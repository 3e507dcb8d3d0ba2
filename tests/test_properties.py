"""Property tests (hypothesis) over random small configurations: the SMA invariants of
docs/design-overview.md §2 and the data schedule (no sample lost or repeated within an epoch)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils.data import TensorDataset

import crossbow_graph as cg
from crossbow_graph.training.data import BatchSchedule
from crossbow_graph.training.hooks import Hook

from _reference import batches_of, eager_steps
from _reference import default_alpha as default_alpha_for  # default_alpha: the test's flag
from _reference import default_centre_rate

FAST = settings(max_examples=12, deadline=None)
F = nn.functional


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))


def data(n: int, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 3, generator=g), torch.randint(0, 2, (n,), generator=g))


optimizers = st.builds(
    lambda lr, mom, nest, wd: cg.SGD(lr=lr, momentum=mom, nesterov=nest and mom > 0, weight_decay=wd),
    st.floats(0.01, 0.5), st.sampled_from([0.0, 0.5, 0.9]), st.booleans(), st.sampled_from([0.0, 1e-3]))


@FAST
@given(opt=optimizers, b=st.integers(1, 5), rounds=st.integers(1, 6))
def test_one_learner_is_torch_sgd(opt, b, rounds):
    ds = data(b * rounds)
    ref = model()
    sgd = torch.optim.SGD(ref.parameters(), lr=opt.lr, momentum=opt.momentum, nesterov=opt.nesterov,
                          weight_decay=opt.weight_decay)
    plan = cg.compile(model(), (torch.zeros(1, 3),), F.cross_entropy, batch_size=b, optimizer=opt)
    plan.fit(ds, 1, shuffle=False, progress=False)
    want = eager_steps(ref, sgd, batches_of(ds, b)).weights[-1]
    torch.testing.assert_close(plan.central_weights(), want, rtol=1e-5, atol=1e-6)


class SmaOracle(Hook):
    """Checks every synchronising round against docs/design-overview.md §2 step 3, on every device:
    z_new = z + (β/k)·Σ_j (ŵ_j − z) + μ_z·(z − z_prev) (β = k·α: z moves by Σ_j c_j), and all
    devices' z identical."""

    def __init__(self, alpha: float, beta: float, mu: float, tau: int) -> None:
        self.alpha, self.beta, self.mu, self.tau, self.checked = alpha, beta, mu, tau, 0

    def before_round(self, ctx) -> None:
        s = ctx.plan.states[0]
        self.pre = (ctx.plan.replica_weights(), s.z.clone(), s.z_prev.clone())

    def after_round(self, ctx) -> None:
        if ctx.plan.rounds_done % self.tau:
            return
        w_hat, z, z_prev = self.pre
        expected = z + self.beta / len(w_hat) * (w_hat - z).sum(0) + self.mu * (z - z_prev)
        for s in ctx.plan.states:
            assert torch.equal(s.z, ctx.plan.states[0].z)
            torch.testing.assert_close(s.z, expected, rtol=1e-5, atol=1e-6)
        if self.mu == 0 and self.alpha == 1 / ctx.plan.num_learners:
            torch.testing.assert_close(ctx.plan.states[0].z, w_hat.mean(0), rtol=1e-5, atol=1e-6)
        self.checked += 1


@pytest.mark.filterwarnings("ignore:SMA with k")  # the update's arithmetic, past z's bound too
@FAST
@given(devices=st.integers(1, 3), replicas=st.integers(1, 3), opt=optimizers, b=st.integers(1, 4),
       default_alpha=st.booleans(), alpha=st.floats(0.05, 1.0), mu=st.sampled_from([0.0, 0.5, 0.9]),
       tau=st.integers(1, 3), beta=st.one_of(st.none(), st.floats(0.05, 2.5)))
def test_sma_update_and_identical_central_models(devices, replicas, opt, b, default_alpha, alpha, mu,
                                                 tau, beta):
    k = devices * replicas
    if k == 1:
        replicas = 2
        k = devices * replicas
    sync = cg.SMA(alpha=None if default_alpha else alpha, central_momentum=mu, sync_every=tau,
                  centre_rate=beta)
    plan = cg.compile(model(), (torch.zeros(1, 3),), F.cross_entropy, batch_size=b, devices=devices,
                      replicas=replicas, optimizer=opt, sync=sync)
    a = default_alpha_for(k, mu) if default_alpha else alpha
    if beta is None:
        beta = default_centre_rate(k, a, mu) if default_alpha else k * a
    oracle = SmaOracle(a, beta, mu, tau)
    plan.fit(data(k * b * 4, seed=1), 1, progress=False, hooks=[oracle])
    assert oracle.checked == 4 // tau
    for s in plan.states:
        assert torch.equal(s.z, plan.states[0].z) and torch.equal(s.z_prev, plan.states[0].z_prev)


@FAST
@given(devices=st.integers(1, 3), replicas=st.integers(1, 3), opt=optimizers, b=st.integers(1, 4))
def test_alpha_one_over_k_without_central_momentum_is_the_mean(devices, replicas, opt, b):
    k = devices * replicas
    plan = cg.compile(model(), (torch.zeros(1, 3),), F.cross_entropy, batch_size=b, devices=devices,
                      replicas=replicas, optimizer=opt, sync=cg.SMA(alpha=1 / k, central_momentum=0.0))
    means = []

    class Mean(Hook):
        def before_round(self, ctx) -> None:
            self.w_hat = ctx.plan.replica_weights()

        def after_round(self, ctx) -> None:
            if k > 1:  # with k = 1, z is the replica after its step (no averaging)
                means.append((ctx.plan.central_weights(), self.w_hat.mean(0)))

    plan.fit(data(k * b * 3, seed=2), 1, progress=False, hooks=[Mean()])
    for z, mean in means:
        torch.testing.assert_close(z, mean, rtol=1e-5, atol=1e-6)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 300), k=st.integers(1, 8), b=st.integers(1, 12), shuffle=st.booleans(),
       seed=st.integers(0, 2**31), epoch=st.integers(0, 5))
def test_schedule_never_loses_or_repeats_a_sample(n, k, b, shuffle, seed, epoch):
    schedule = BatchSchedule(n, shuffle=shuffle, seed=seed)
    order = schedule.order(epoch)
    rounds = schedule.rounds_per_epoch(k, b)
    assert rounds == n // (k * b)
    per_learner = [schedule.round_indices(order, t, k, b, j, 1) for t in range(rounds)
                   for j in range(k)]
    assert all(len(ix) == b for ix in per_learner)
    seen = torch.cat(per_learner + [torch.zeros(0, dtype=torch.long)])
    assert len(seen) == len(set(seen.tolist())) == rounds * k * b  # nothing repeated
    assert all(0 <= i < n for i in seen.tolist())
    assert n - len(seen) < k * b  # only the last partial round is dropped
    whole = torch.cat([schedule.round_indices(order, t, k, b) for t in range(rounds)]
                      + [seen[:0]])
    assert torch.equal(whole, seen)  # a round's batch is its learners' batches, device-major


class Recording(TensorDataset):
    """A dataset that records which samples every round's batch holds."""

    def __init__(self, *tensors) -> None:
        super().__init__(*tensors)
        self.batches = []

    def get_batch(self, indices: torch.Tensor):
        self.batches.append(indices.clone())
        return [t[indices] for t in self.tensors]


@FAST
@given(devices=st.integers(1, 2), replicas=st.integers(1, 3), b=st.integers(1, 4),
       extra=st.integers(0, 7), shuffle=st.booleans())
def test_fit_draws_every_sample_at_most_once_per_epoch(devices, replicas, b, extra, shuffle):
    k = devices * replicas
    n = k * b * 3 + extra % (k * b)  # 3 whole rounds and a partial one
    ds = Recording(*data(n).tensors)
    plan = cg.compile(model(), (torch.zeros(1, 3),), F.cross_entropy, batch_size=b, devices=devices,
                      replicas=replicas, executor="inline")  # worker processes fetch in their own copy
    plan.fit(ds, 2, progress=False, shuffle=shuffle)
    rounds = ds.batches[1:]  # the first call is fit's one-time check of the first batch
    assert len(rounds) == 6 and all(len(r) == k * b for r in rounds)
    for epoch in (rounds[:3], rounds[3:]):
        seen = torch.cat(epoch).tolist()
        assert len(set(seen)) == len(seen) == 3 * k * b
