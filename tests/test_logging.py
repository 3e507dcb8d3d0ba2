"""Logging: CSV and TensorBoard per round and epoch, history.json, progress bar, quiet mode, CLI."""

from __future__ import annotations

import csv
import functools
import json
import math
import os

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import crossbow_graph as cg
from crossbow_graph import cli
from crossbow_graph.training.hooks import Hook
from crossbow_graph.training.metrics_log import MetricsLogger

from _plans import make_plan


def data(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 5, generator=g), torch.randint(0, 3, (n,), generator=g))


def _relu_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 3))


# the plans of these tests: the ReLU MLP on x [N, 5] on 2 devices × 1 replica, SGD(0.1)
relu_plan = functools.partial(make_plan, model=_relu_mlp, example=torch.zeros(1, 5), devices=2, replicas=1,
                              optimizer=cg.SGD(lr=0.1))


def rows(path: str) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_csv_tensorboard_and_history_json(tmp_path):
    log = str(tmp_path / "log")
    history = relu_plan().fit(data(64, 0), 2, eval_dataset=data(20, 1), evals_per_epoch=2,
                              progress=False, log_dir=log)
    per_round = rows(os.path.join(log, "rounds.csv"))
    assert [int(r["round"]) for r in per_round] == list(range(1, 17))  # 8 rounds × 2 epochs
    assert [int(r["epoch"]) for r in per_round] == [1] * 8 + [2] * 8
    assert all(float(r["samples_per_s"]) > 0 for r in per_round)
    for e, record in enumerate(history.epochs):  # the epoch's loss is the mean of its rounds'
        mean = sum(float(r["loss"]) for r in per_round[8 * e: 8 * e + 8]) / 8
        assert math.isclose(mean, record.train_loss, rel_tol=1e-5)
    epochs = rows(os.path.join(log, "epochs.csv"))
    assert [float(r["train_loss"]) for r in epochs] == [e.train_loss for e in history.epochs]
    evals = rows(os.path.join(log, "evals.csv"))
    assert [float(r["test_accuracy"]) for r in evals] == [e.test_accuracy for e in history.evals]
    assert len(evals) == 4
    with open(os.path.join(log, "history.json")) as f:
        assert json.load(f) == json.loads(json.dumps(history.to_dict()))

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(log)
    acc.Reload()
    loss = acc.Scalars("train/loss")
    assert [s.step for s in loss] == list(range(1, 17))
    for s, r in zip(loss, per_round):
        assert math.isclose(s.value, float(r["loss"]), rel_tol=1e-6)
    assert [s.value for s in acc.Scalars("eval/accuracy")] == pytest.approx(
        [e.test_accuracy for e in history.evals])
    assert len(acc.Scalars("epoch/train_loss")) == 2


def test_tensorboard_missing_is_a_clear_error_before_any_round(tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # as if not installed
    plan = relu_plan()
    with pytest.raises(ImportError, match=r"pip install 'crossbow_graph\[tensorboard\]'"):
        plan.fit(data(64, 0), 1, progress=False, log_dir=str(tmp_path / "log"))
    assert plan.rounds_done == 0
    plan.fit(data(64, 0), 1, progress=False,  # CSV files only need no tensorboard
             hooks=[MetricsLogger(str(tmp_path / "csv"), tensorboard=False)])
    assert len(rows(os.path.join(tmp_path, "csv", "rounds.csv"))) == 8


class PoisonOnce(Hook):
    def before_round(self, ctx) -> None:
        if ctx.plan.rounds_done == 2:
            ctx.plan.states[1].w[0, 0] = math.nan


def test_every_rounds_and_faults_csv(tmp_path):
    log = str(tmp_path)
    relu_plan().fit(data(64, 0), 1, progress=False,
                    hooks=[PoisonOnce(), MetricsLogger(log, every_rounds=3, tensorboard=False)])
    assert [int(r["round"]) for r in rows(os.path.join(log, "rounds.csv"))] == [3, 6]
    assert rows(os.path.join(log, "faults.csv")) == [{"round": "2", "device": "cpu:1", "replica": "0", "rank": "0"}]
    assert not [n for n in os.listdir(log) if n.startswith("events.out")]
    with pytest.raises(ValueError, match="every_rounds=0"):
        MetricsLogger(log, every_rounds=0)


def test_progress_bar_shows_accuracy_and_rate_and_quiet_shows_nothing(capsys):
    relu_plan().fit(data(64, 0), 1, eval_dataset=data(20, 1), progress=True)
    err = capsys.readouterr().err
    assert "acc=" in err and "samples_per_s=" in err and "sample/s" in err
    relu_plan().fit(data(64, 0), 1, eval_dataset=data(20, 1), progress=False)
    assert capsys.readouterr().err == ""


def test_cli_log_dir_checkpoint_and_resume(tmp_path, capsys):
    log, ckpt = str(tmp_path / "log"), str(tmp_path / "ckpt")
    base = ["train", "--train-samples", "256", "--test-samples", "100", "--devices", "1",
            "--replicas", "2", "--batch-size", "16", "--quiet", "--target", "0", "--evals-per-epoch", "1",
            "--log-dir", log, "--checkpoint-dir", ckpt]
    assert cli.main(base + ["--epochs", "1"]) == 0
    with open(os.path.join(log, "history.json")) as f:
        assert len(json.load(f)["epochs"]) == 1
    assert os.listdir(ckpt) == ["ckpt-0000000008.pt"]
    assert cli.main(base + ["--epochs", "2", "--resume"]) == 0
    out = capsys.readouterr().out
    assert "epoch 1:" in out and "epoch 2:" in out
    with open(os.path.join(log, "history.json")) as f:
        assert [e["epoch"] for e in json.load(f)["epochs"]] == [1, 2]
    assert [int(r["epoch"]) for r in rows(os.path.join(log, "epochs.csv"))] == [1, 2]
