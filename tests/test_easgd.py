"""EASGD (engine/sync/easgd.py) as Zhang et al. 2015 write it, checked against the hand-written
reference of tests/_reference.py (``reference_easgd``) through the public API."""

import copy
import functools
import json

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import crossbow_graph as cg
from _plans import make_plan
from _reference import flat, reference_easgd

ATOL, RTOL = 1e-6, 1e-5  # float32, a few rounds of the same operations in another order


class Small(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3)
        self.fc = nn.Linear(4 * 6 * 6, 5)

    def forward(self, x):
        return self.fc(torch.relu(self.conv(x)).flatten(1))


def batches(n, b, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(b, 1, 8, 8, generator=g), torch.randint(0, 5, (b,), generator=g))
            for _ in range(n)]


def as_dataset(bs):
    return TensorDataset(torch.cat([x for x, _ in bs]), torch.cat([y for _, y in bs]))


easgd_plan = functools.partial(make_plan, seed=None, optimizer=cg.SGD(lr=0.05, momentum=0.9))


@pytest.mark.parametrize("executor,alpha,beta,tau", [
    ("inline", None, 0.9, 1), ("inline", 0.3, 0.5, 1), ("inline", 0.2, 0.9, 2),
    ("process", 0.3, 0.5, 1),
])
def test_matches_hand_written_reference(executor, alpha, beta, tau):
    model = Small()
    k, rounds, b = 4, 6, 4
    bs = batches(k * rounds, b)
    plan = easgd_plan(model, devices=2, replicas=2, batch_size=b, executor=executor,
                      sync=cg.EASGD(alpha=alpha, centre_rate=beta, sync_every=tau))
    start = copy.deepcopy(model)  # the fit leaves z in model
    plan.fit(as_dataset(bs), 1, shuffle=False, progress=False)
    centre, replicas = reference_easgd(start, bs, k=k, rounds=rounds, lr=0.05, momentum=0.9,
                                       alpha=beta / k if alpha is None else alpha, beta=beta,
                                       tau=tau)
    torch.testing.assert_close(plan.central_weights(), flat(centre), atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(plan.replica_weights(),
                               torch.stack([flat(r.parameters()) for r in replicas]),
                               atol=ATOL, rtol=RTOL)


def test_centre_rate_k_alpha_is_sma_without_central_momentum():
    """β = k·α: z ← z + Σ_j α(ŵ_j − z), SMA's update with μ_z = 0 (and SMA's η rule off:
    EASGD steps at the optimizer's lr)."""
    bs = batches(4 * 3, 4)
    plans = [easgd_plan(Small, seed=0, devices=2, replicas=2, sync=sync)
             for sync in (cg.EASGD(alpha=0.2, centre_rate=0.8),
                          cg.SMA(alpha=0.2, central_momentum=0.0, scale_lr=False))]
    for plan in plans:
        plan.fit(as_dataset(bs), 1, shuffle=False, progress=False)
    torch.testing.assert_close(plans[0].central_weights(), plans[1].central_weights(),
                               atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("kwargs,error,match", [
    ({"centre_rate": 1.5}, ValueError, r"EASGD\(centre_rate=1.5\): a moving rate must be in \(0, 1\]"),
    ({"alpha": 0.0}, ValueError, r"EASGD\(alpha=0.0\).*alpha=None for β/k"),
    ({"alpha": "0.1"}, TypeError, r"EASGD"),
    ({"sync_every": 0}, ValueError, r"EASGD\(sync_every=0\): must be an integer ≥ 1"),
])
def test_bad_settings_are_refused_on_construction(kwargs, error, match):
    with pytest.raises(error, match=match):
        cg.EASGD(**kwargs)


def test_the_summary_names_its_rates():
    plan = easgd_plan(Small, seed=0, devices=1, replicas=4, sync=cg.EASGD(centre_rate=0.8))
    assert "EASGD(α=0.2, β=0.8, every 1 round(s))" in plan.summary()
    # z moves by γ = β/(k·α) of the corrections' sum: what the plan's settings report
    easgd = cg.EASGD(alpha=0.1, centre_rate=0.8)
    assert easgd.centre_gain(4) == pytest.approx(2.0) and easgd.centre_gain(1) == 1.0
    settings = json.loads(plan.to_json())["settings"]  # α = β/k: γ = β/(k·α) = 1
    assert settings["centre_gain"] == pytest.approx(1.0, rel=1e-12)
