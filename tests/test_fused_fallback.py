"""Fused learners fall back where torch.func.vmap cannot run the model (LSTM, GRU, checkpointing):
a clear error for an explicit ``learner_mode="fused"``, a warning and per-replica learners for the
auto-tuner; an LSTM trains with ``replicas="auto"``."""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
import torch.utils.checkpoint
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

import crossbow_graph as cg

from _plans import make_plan
from test_autotune import FAST, _Clock


class SeqNet(nn.Module):
    """A recurrent layer over [N, 6, 4] sequences, its last output → 3 classes."""

    def __init__(self, cell=nn.LSTM) -> None:
        super().__init__()
        self.rnn = cell(4, 8, batch_first=True)
        self.fc = nn.Linear(8, 3)

    def forward(self, x):
        return self.fc(self.rnn(x)[0][:, -1])


class Checkpointed(nn.Module):
    """A block under torch.utils.checkpoint (vmap cannot run it)."""

    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Linear(24, 24)
        self.fc = nn.Linear(24, 3)

    def forward(self, x):
        h = torch.utils.checkpoint.checkpoint(self.block, x.flatten(1), use_reentrant=False)
        return self.fc(torch.relu(h))


def seq_data(n: int = 512, seed: int = 0) -> TensorDataset:
    """Learnable sequences: the class is the sign pattern of the last step's first two features."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, 4, generator=g)
    y = (x[:, -1, 0] > 0).long() + (x[:, -1, 1] > 0).long()
    return TensorDataset(x, y)


# the plans of these tests: the model as given on x [N, 6, 4] at b = 8, inline, SGD(0.1, momentum 0.9)
seq_plan = functools.partial(make_plan, seed=None, input_shape=(6, 4), batch_size=8, executor="inline",
                             optimizer=cg.SGD(lr=0.1, momentum=0.9))


@pytest.mark.parametrize("model", [SeqNet(nn.LSTM), SeqNet(nn.GRU), Checkpointed()],
                         ids=["lstm", "gru", "checkpoint"])
def test_explicit_fused_that_vmap_cannot_run_is_refused_at_compile_naming_per_replica(model):
    with pytest.raises(ValueError, match=r"learner_mode='fused' cannot run .*vmap.*"
                                         r"use learner_mode='per_replica'"):
        seq_plan(model, replicas=2, learner_mode="fused")


def test_fused_is_refused_by_adjust_and_nothing_changes():
    plan = seq_plan(SeqNet(), replicas=2)
    assert "lstm" in plan.fused_failure
    with pytest.raises(ValueError, match="per_replica"):
        plan.set_learner_mode("fused")
    with pytest.raises(ValueError, match="per_replica"):
        plan.adjust(cg.Adjustment(learner_mode="fused", lr=0.5))
    assert plan.learner_mode == "per_replica" and plan.settings.lr == 0.1


def test_models_vmap_runs_are_not_refused():
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Flatten(), nn.Linear(24, 8), nn.BatchNorm1d(8), nn.Dropout(0.1),
                        nn.Linear(8, 3))
    plan = seq_plan(mlp, replicas=2, learner_mode="fused")
    assert plan.fused_failure is None and plan.learner_mode == "fused"
    plan.fit(seq_data(64), 1, progress=False)
    z = plan.central_model().state_dict()  # the fused fit trained; the model holds z
    assert not torch.equal(z["1.weight"], plan.template[1].weight)
    assert all(torch.equal(value, z[name]) for name, value in mlp.state_dict().items())


def test_fused_with_auto_replicas_warns_and_starts_per_replica():
    with pytest.warns(UserWarning, match="starts with per_replica"):
        plan = seq_plan(SeqNet(), replicas="auto", learner_mode="fused")
    assert plan.learner_mode == "per_replica"


def test_vmap_failure_in_training_names_per_replica():
    # the dry run passes (it does not call the loss), the loss cannot run under vmap: the first
    # round says what to do
    def loss_with_item(out, y):
        return F.cross_entropy(out, y) * (1.0 if out.sum().item() > -1e30 else 0.0)

    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Flatten(), nn.Linear(24, 3))
    plan = cg.compile(mlp, (torch.randn(2, 6, 4),), loss_with_item, batch_size=8,
                      replicas=2, learner_mode="fused", executor="inline")
    with pytest.raises(cg.TaskError, match=r"round 0.*cannot run.*learner_mode='per_replica'"):
        plan.fit(seq_data(64), 1, progress=False)


def test_lstm_trains_with_auto_replicas_and_the_tuner_skips_fused():
    torch.manual_seed(0)
    model = SeqNet()
    mem = seq_plan(SeqNet(), replicas=1).task_graph.graph["memory_per_learner_bytes"]
    plan = seq_plan(model, replicas="auto", devices=2, memory_budget=2 * mem + 1,
                    autotune=cg.AutoTune(**FAST))
    plan.autotuner.clock = _Clock(lambda k: 1.0)  # throughput ∝ k: the tuner grows to the bound
    train, test = seq_data(768), seq_data(256, seed=1)
    loss0 = plan.evaluate(test)[1]
    with pytest.warns(UserWarning, match="keeps learner_mode='per_replica'"):
        hist = plan.fit(train, 2, eval_dataset=test, progress=False)
    actions = [(d.action, d.next_replicas_per_device, d.next_learner_mode) for d in hist.autotune]
    assert actions[:5] == [("add", 2, "per_replica"), ("confirm", 1, "per_replica"),
                           ("confirmed_add", 2, "per_replica"), ("bound", 2, "per_replica"),
                           ("skip_mode", 2, "per_replica")]
    assert plan.learner_mode == "per_replica" and plan.autotuner.phase == "hold"
    assert plan.num_learners == 4
    assert hist.evals[-1].test_loss < 0.75 * loss0, (loss0, hist.evals[-1].test_loss)
    assert type(plan.central_model()) is SeqNet
