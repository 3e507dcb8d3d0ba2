"""sync=DiLoCo(...): an outer optimizer over z every H rounds (docs/design-overview.md §2,
"Outer optimizers: DiLoCo"), checked against a hand-written DiLoCo in eager PyTorch; and SMA's
default rule kept bit for bit."""

from __future__ import annotations

import copy
import functools
from fractions import Fraction

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

import crossbow_graph as cg

# -- SMA stays bit-identical -------------------------------------------------------------------
#
# The SMA update must not change when DiLoCo is added beside it. A bitwise check that holds on
# every machine: a linear model, a mean-squared loss, dyadic data and weights, η = 1/8, μ_l = μ_z
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
    """SMA by the book in exact rationals: (z, replicas) as lists of (w00, w01, bias)."""
    xs, ys = _dyadic_data(rounds * k * b)
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
            ws[j] = [wi - ETA * vi - ci for wi, vi, ci in zip(w, vs[j], c)]
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


def _dyadic_plan(**kw) -> cg.Plan:
    model = nn.Linear(2, 1)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[float(W0[0]), float(W0[1])]]))
        model.bias.fill_(float(W0[2]))
    opt = kw.pop("optimizer", None)
    if opt is None:
        opt = cg.SGD(lr=float(ETA), momentum=float(MU_L))
    elif opt == "row":  # not the SGD kernels: torch.optim.SGD with two param groups, per replica
        opt = torch.optim.SGD([{"params": [model.weight]}, {"params": [model.bias]}],
                              lr=float(ETA), momentum=float(MU_L))
    return cg.compile(model, (torch.zeros(1, 2),), lambda out, y: F.mse_loss(out.squeeze(1), y),
                      batch_size=4, devices=2, replicas=2, optimizer=opt, **kw)


@pytest.mark.parametrize("case", [
    dict(executor="inline"), dict(executor="process"),
    dict(executor="inline", kernel_backend="torch", sync_every=2),
    dict(executor="inline", optimizer="row"), dict(executor="process", optimizer="row"),
])
def test_sma_default_rule_is_bit_identical_to_exact_sma(case):
    case = dict(case)
    tau = case.pop("sync_every", 1)
    plan = _dyadic_plan(sync=cg.SMA(central_momentum=float(MU_Z), sync_every=tau), **case)
    rounds, k, b = 4, 4, 4
    xs, ys = _dyadic_data(rounds * k * b)
    data = TensorDataset(torch.tensor([[float(a), float(c)] for a, c in xs]),
                         torch.tensor([float(y) for y in ys]))
    plan.fit(data, 1, shuffle=False, progress=False, metrics_every=None)
    assert plan.rounds_done == rounds
    z, ws = _exact_sma(rounds, k=k, b=b, sync_every=tau)
    assert torch.equal(plan.central_weights(), _as_float32(z))
    assert torch.equal(plan.replica_weights(), torch.stack([_as_float32(w) for w in ws]))
