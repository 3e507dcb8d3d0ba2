"""sync=SSGD(): the gradient all-reduce baseline equals torch.optim.SGD on one batch of k·b."""

import copy

import pytest
import torch
from torch import nn

import crossbow_graph as cg

from _reference import batches_of, eager_steps


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 3))


@pytest.mark.parametrize("learner_mode", ["per_replica", "fused"])
def test_ssgd_equals_sgd_on_the_large_batch(learner_mode):
    k_devices, m, b, rounds = 2, 2, 4, 5
    k = k_devices * m
    x = torch.randn(k * b * rounds, 12)
    y = torch.randint(0, 3, (k * b * rounds,))
    data = torch.utils.data.TensorDataset(x, y)
    model = _mlp()
    reference = copy.deepcopy(model)
    opt = cg.SGD(lr=0.1, momentum=0.9, weight_decay=1e-3)
    plan = cg.compile(model, (x[:1],), nn.functional.cross_entropy, batch_size=b,
                      devices=k_devices, replicas=m, learner_mode=learner_mode, optimizer=opt,
                      sync=cg.SSGD())
    plan.fit(data, 1, shuffle=False, progress=False)

    sgd = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)
    # round t: learners' batches t·k … t·k+k−1 = samples [t·k·b, (t+1)·k·b)
    expected = eager_steps(reference, sgd, batches_of(data, k * b)[:rounds]).weights[-1]
    z = plan.central_weights()
    torch.testing.assert_close(z, expected, rtol=1e-5, atol=1e-6)
    replicas = plan.replica_weights()  # [k, P]: every replica is z, bit for bit
    torch.testing.assert_close(replicas, z.expand_as(replicas), rtol=0, atol=0)


def test_ssgd_needs_the_inline_executor():
    with pytest.raises(ValueError, match="inline"):
        cg.compile(_mlp(), (torch.randn(1, 12),), nn.functional.cross_entropy, batch_size=4,
                   devices=2, replicas=1, executor="process", sync=cg.SSGD())


def test_ssgd_auto_executor_resolves_inline():
    plan = cg.compile(_mlp(), (torch.randn(1, 12),), nn.functional.cross_entropy, batch_size=4,
                      devices=2, replicas=2, sync=cg.SSGD())
    assert plan.rounds.resolved_executor() == "inline"
