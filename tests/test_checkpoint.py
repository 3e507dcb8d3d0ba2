"""Checkpoints: bit-identical resume (also mid-epoch, with dropout and BatchNorm, and after a
policy changed b and η), corrupt files, mismatches, and a real SIGKILL in the middle of a write."""

from __future__ import annotations

import functools
import logging
import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import crossbow_graph as cg
from crossbow_graph.engine.backends.process import conv_choice
from crossbow_graph.errors import CheckpointError
from crossbow_graph.training.checkpoint import list_checkpoints, load_checkpoint, load_latest
from crossbow_graph.training.hooks import Hook
from crossbow_graph.tuning.metrics import MetricsMonitor
from crossbow_graph.tuning.policies import AdaptiveBatchSize, Policy

from _plans import TinyNet, make_plan, tiny_data

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Net(nn.Module):
    """Tiny model with every kind of state: dropout (RNG), BatchNorm (float and int buffers)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 12)
        self.bn = nn.BatchNorm1d(12)
        self.drop = nn.Dropout(0.3)
        self.fc2 = nn.Linear(12, 3)

    def forward(self, x):
        return self.fc2(self.drop(torch.relu(self.bn(self.fc1(x)))))


def data(n: int = 96) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g))


# the plans of these tests: Net on x [N, 6] on 2 devices × 2 replicas, SGD with momentum and weight decay
net_plan = functools.partial(make_plan, model=Net, example=torch.zeros(2, 6), devices=2, replicas=2,
                             optimizer=cg.SGD(lr=0.05, momentum=0.9, weight_decay=1e-4),
                             sync=cg.SMA(central_momentum=0.9))


class StopAfter(Hook):
    """Ends the fit after ``n`` rounds (the 'crash')."""

    def __init__(self, n: int) -> None:
        self.n = n

    def after_round(self, ctx) -> None:
        ctx.stop = ctx.plan.rounds_done >= self.n


class DrawRandom(Hook):
    """Draws from Python's and NumPy's RNGs every round, so that their state matters."""

    def __init__(self) -> None:
        self.draws = []

    def after_round(self, ctx) -> None:
        self.draws.append((ctx.plan.rounds_done, random.random(), float(np.random.rand())))


def assert_same_state(a: cg.Plan, b: cg.Plan) -> None:
    for sa, sb in zip(a.states, b.states):
        for key in ("z", "z_prev", "w", "v", "buf", "zbuf"):
            assert torch.equal(getattr(sa, key), getattr(sb, key)), key
        for ra, rb in zip(sa.replicas, sb.replicas):
            assert torch.equal(ra.bn.num_batches_tracked, rb.bn.num_batches_tracked)


@pytest.mark.parametrize("stop_at", [4, 9])  # 6 rounds per epoch: mid-epoch 1 and mid-epoch 2
def test_resume_is_bit_identical(tmp_path, stop_at):
    full_draws = DrawRandom()
    full = net_plan()
    random.seed(7), np.random.seed(7)
    h_full = full.fit(data(), 2, progress=False, hooks=[full_draws], seed=3)

    ckpt = str(tmp_path / "ckpt")
    first = net_plan()
    random.seed(7), np.random.seed(7)
    first.fit(data(), 2, progress=False, hooks=[DrawRandom(), StopAfter(stop_at)], seed=3,
              checkpoint_dir=ckpt, checkpoint_every=1)
    assert load_latest(ckpt)[1]["plan"]["rounds_done"] == stop_at
    second_draws = DrawRandom()
    second = net_plan()
    random.seed(8), np.random.seed(8)  # overwritten by the checkpoint's RNG states
    h = second.fit(data(), 2, progress=False, hooks=[second_draws], seed=3, checkpoint_dir=ckpt,
                   checkpoint_every=1, resume=True)
    assert second.rounds_done == full.rounds_done == 12
    assert_same_state(full, second)
    assert [e.train_loss for e in h.epochs] == [e.train_loss for e in h_full.epochs]
    assert second_draws.draws == full_draws.draws[stop_at:]


def test_resume_of_a_float64_plan_is_bit_identical_in_float64(tmp_path):
    """A float64 model: the checkpoint holds its float64 state, and a resumed fit continues in
    float64 exactly as an uninterrupted one (the process executor: the shared buffers too)."""
    def plan64() -> cg.Plan:
        torch.manual_seed(0)
        return cg.compile(Net().double(), (torch.zeros(2, 6, dtype=torch.float64),),
                          nn.functional.cross_entropy, batch_size=4, devices=1, replicas=4,
                          executor="process", optimizer=cg.SGD(lr=0.05, momentum=0.9))

    train = data()
    train = TensorDataset(train.tensors[0].double(), train.tensors[1])
    full = plan64()
    full.fit(train, 2, progress=False, seed=3)
    ckpt = str(tmp_path / "ckpt")
    plan64().fit(train, 2, progress=False, seed=3, hooks=[StopAfter(4)], checkpoint_dir=ckpt,
                 checkpoint_every=1)
    saved = load_latest(ckpt)[1]["plan"]["states"][0]
    assert all(saved[key].dtype == torch.float64 for key in ("w", "v", "z", "z_prev", "buf", "zbuf"))
    second = plan64()
    second.fit(train, 2, progress=False, seed=3, checkpoint_dir=ckpt, checkpoint_every=1,
               resume=True)
    assert second.rounds_done == full.rounds_done == 12
    assert second.central_weights().dtype == torch.float64
    assert_same_state(full, second)


class NoisyData(torch.utils.data.Dataset):
    """``data()`` with augmentation noise from NumPy's, Python's and torch's global RNGs, drawn
    in whichever process fetches the sample (a worker process, under the process executor)."""

    def __init__(self) -> None:
        self.base = data()

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i):
        x, y = self.base[i]
        return x + float(np.random.standard_normal()) + random.random() + torch.rand(()), y


def test_resume_with_noise_drawn_in_worker_processes_is_bit_identical(tmp_path):
    def fit(plan, **kw):  # the convolution library is measured once (one choice) in this process
        return plan.fit(NoisyData(), 2, progress=False, seed=3, **kw)

    full = net_plan(executor="process")
    fit(full)
    ckpt = str(tmp_path / "ckpt")
    fit(net_plan(executor="process"), hooks=[StopAfter(4)], checkpoint_dir=ckpt,
        checkpoint_every=1)
    second = net_plan(executor="process")
    fit(second, checkpoint_dir=ckpt, checkpoint_every=1, resume=True)
    assert second.rounds_done == full.rounds_done == 12
    assert_same_state(full, second)


def test_a_resumed_process_keeps_the_convolution_library_its_checkpoint_ran_with(tmp_path,
                                                                               monkeypatch):
    """cpu_conv="auto" measures oneDNN against ATen once per process and b; a resumed process's
    measurement may come out the other way (simulated: the other library measures faster). The
    checkpoint holds the library of each b, and the resumed fit runs with its checkpoint's,
    bit-identical to an uninterrupted fit."""
    def faster(onednn: bool):  # conv_choice's timing of a step with oneDNN on (True) and off
        return lambda *args: {onednn: 1.0, not onednn: 2.0}

    def plan() -> cg.Plan:
        return make_plan(TinyNet, devices=1, replicas=2, executor="process", cpu_conv="auto")

    def fit(p: cg.Plan, **kw) -> None:
        p.fit(tiny_data(96), 2, progress=False, seed=3, **kw)

    monkeypatch.setattr(conv_choice, "_ONEDNN_CHOICES", {})  # none measured by earlier tests
    monkeypatch.setattr(conv_choice, "_step_seconds", faster(True))
    full = plan()
    fit(full)
    ckpt = str(tmp_path / "ckpt")
    fit(plan(), hooks=[StopAfter(5)], checkpoint_dir=ckpt, checkpoint_every=1)
    monkeypatch.setattr(conv_choice, "_ONEDNN_CHOICES", {})  # a new process: nothing measured
    monkeypatch.setattr(conv_choice, "_step_seconds", faster(False))
    resumed = plan()
    fit(resumed, hooks=[StopAfter(10**6)], checkpoint_dir=ckpt, checkpoint_every=1, resume=True)
    assert resumed.rounds.ctx.onednn_choices == full.rounds.ctx.onednn_choices == {4: True}
    assert resumed.rounds_done == full.rounds_done == 24
    assert torch.equal(resumed.central_weights(), full.central_weights())
    assert torch.equal(resumed.replica_weights(), full.replica_weights())


def test_an_evaluation_due_at_a_checkpoint_is_in_it_and_a_resume_neither_repeats_nor_misses_it(
        tmp_path):
    """A checkpoint due in a round with an evaluation is written after the evaluation and its
    hooks (ReduceLROnPlateau on z's test loss): a fit killed right after it (a metric_fn that
    raises at the next evaluation stands for SIGKILL) and resumed has the uninterrupted fit's
    evaluations, η of every round, History and state; with target_accuracy, a fit that stopped
    at its target and is resumed trains no further."""
    class Killed(Exception):
        pass

    def metric(kill_at: int | None):
        def accuracy(output, target):
            if kill_at is not None and len(calls) == kill_at:
                raise Killed
            calls.append(1)
            return float((output.argmax(1) == target).float().mean())
        calls: list[int] = []
        return accuracy

    def fit(plan, kill_at=None, **kw):
        sched = torch.optim.lr_scheduler.ReduceLROnPlateau(plan.optimizer, factor=0.5, patience=0)
        return plan.fit(data(96), 3, eval_dataset=data(48), evals_per_epoch=3, progress=False,
                        seed=3, lr_scheduler=sched, metric_fn=metric(kill_at), **kw)

    full = net_plan()
    h_full = fit(full)
    ckpt = str(tmp_path / "ckpt")
    with pytest.raises(Killed):  # at the 5th evaluation, after round 10's (its checkpoint's)
        fit(net_plan(), kill_at=4, checkpoint_dir=ckpt, checkpoint_every=4)
    assert load_latest(ckpt)[1]["plan"]["rounds_done"] == 8
    resumed = net_plan()
    h = fit(resumed, checkpoint_dir=ckpt, checkpoint_every=4, resume=True)
    assert [(e.round, e.test_loss) for e in h.evals] == [(e.round, e.test_loss) for e in h_full.evals]
    assert h.lr == h_full.lr and len(set(h.lr)) > 1  # the plateau halved η
    assert [(e.rounds, e.samples, e.train_loss, e.test_accuracy) for e in h.epochs] == \
        [(e.rounds, e.samples, e.train_loss, e.test_accuracy) for e in h_full.epochs]
    assert_same_state(full, resumed)

    accs = [e.test_accuracy for e in h_full.evals]  # a target first reached after round 2
    i = next(i for i in range(1, len(accs)) if accs[i] > max(accs[:i]))
    ckpt = str(tmp_path / "target")
    first = net_plan()
    fit(first, target_accuracy=accs[i], checkpoint_dir=ckpt, checkpoint_every=2)
    again = net_plan()
    h = fit(again, target_accuracy=accs[i], checkpoint_dir=ckpt, checkpoint_every=2, resume=True)
    assert first.rounds_done == again.rounds_done == h_full.evals[i].round
    assert h.epochs_to_accuracy == h_full.evals[i].epoch


def test_resume_at_epoch_end_without_every(tmp_path):
    """checkpoint_every=None: a checkpoint at each complete epoch; resuming runs the rest."""
    full = net_plan()
    full.fit(data(), 2, progress=False)
    ckpt = str(tmp_path)
    net_plan().fit(data(), 1, progress=False, checkpoint_dir=ckpt)
    assert [os.path.basename(p) for p in list_checkpoints(ckpt)] == ["ckpt-0000000006.pt"]
    resumed = net_plan()
    h = resumed.fit(data(), 2, progress=False, checkpoint_dir=ckpt, resume=True)
    assert [e.epoch for e in h.epochs] == [1, 2]
    assert_same_state(full, resumed)


def test_plan_state_dict_round_trip():
    a = net_plan()
    a.fit(data(), 1, progress=False)
    b = net_plan()
    b.load_state_dict(a.state_dict())
    assert_same_state(a, b)
    assert (b.epochs_done, b.rounds_done) == (1, 6)
    # module parameters are still views of the flat rows after loading
    assert b.states[0].replicas[1].fc1.weight.data_ptr() == b.states[0].w[1].data_ptr()


def test_keeps_last_two_and_falls_back_from_truncated(tmp_path, caplog):
    ckpt = str(tmp_path)
    net_plan().fit(data(), 1, progress=False, checkpoint_dir=ckpt, checkpoint_every=2)
    files = list_checkpoints(ckpt)
    assert [os.path.basename(p) for p in files] == ["ckpt-0000000004.pt", "ckpt-0000000006.pt"]
    size = os.path.getsize(files[-1])
    with open(files[-1], "r+b") as f:
        f.truncate(size // 2)
    with caplog.at_level(logging.WARNING, logger="crossbow_graph.checkpoint"):
        path, state = load_latest(ckpt)
    assert path == files[0] and state["plan"]["rounds_done"] == 4
    assert "truncated" in caplog.text and files[-1] in caplog.text


def test_corrupt_byte_is_detected_and_resume_uses_previous(tmp_path, caplog):
    full = net_plan()
    full.fit(data(), 1, progress=False)
    ckpt = str(tmp_path)
    net_plan().fit(data(), 1, progress=False, checkpoint_dir=ckpt, checkpoint_every=2,
                   hooks=[StopAfter(4)])
    newest = list_checkpoints(ckpt)[-1]
    with open(newest, "r+b") as f:
        f.seek(os.path.getsize(newest) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(CheckpointError, match="checksum"):
        load_checkpoint(newest)
    resumed = net_plan()
    with caplog.at_level(logging.WARNING, logger="crossbow_graph.checkpoint"):
        resumed.fit(data(), 1, progress=False, checkpoint_dir=ckpt, resume=True)
    assert "previous good checkpoint" in caplog.text
    assert_same_state(full, resumed)  # resumed from round 2 instead of 4: still identical


def test_no_readable_checkpoint_is_a_clear_error(tmp_path):
    (tmp_path / "ckpt-0000000001.pt").write_bytes(b"not a checkpoint at all, just text" * 3)
    (tmp_path / "ckpt-0000000002.pt").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"no checkpoint in .* can be loaded.*bad magic"):
        net_plan().fit(data(), 1, progress=False, checkpoint_dir=str(tmp_path), resume=True)


def test_resume_with_other_data_order_or_plan_is_refused(tmp_path):
    ckpt = str(tmp_path)
    net_plan().fit(data(), 1, progress=False, checkpoint_dir=ckpt)
    with pytest.raises(CheckpointError, match=r"seed=0 \(now 5\)"):
        net_plan().fit(data(), 1, progress=False, seed=5, checkpoint_dir=ckpt, resume=True)
    with pytest.raises(CheckpointError, match="2 device.*× 2 replica.*1 × 1"):
        net_plan(devices=1, replicas=1).load_state_dict(net_plan().state_dict())


# -- a checkpoint of another model ------------------------------------------------------------


class _Seq(nn.Module):
    """An MLP as ``net``, an nn.Sequential: 12→5→7→3 and 12→8→3 both have 131 parameters."""

    def __init__(self, *widths: int) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for a, b in zip(widths, widths[1:]):
            layers += [nn.Linear(a, b), nn.ReLU()]
        self.net = nn.Sequential(*layers[:-1])

    def forward(self, x):
        return self.net(x)


class _Named(nn.Module):
    """12→8→3 as ``fc1``/``fc2``: the shapes of ``_Seq(12, 8, 3)`` under other names."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(12, 8), nn.Linear(8, 3)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


# a plan of an MLP on x [N, 12]: 2 replicas on one device, compile's optimizer
_mlp_plan = functools.partial(make_plan, seed=None, example=torch.zeros(2, 12), optimizer=None, devices=1,
                              replicas=2)


def _mlp_data() -> TensorDataset:
    g = torch.Generator().manual_seed(2)
    return TensorDataset(torch.randn(48, 12, generator=g), torch.randint(0, 3, (48,), generator=g))


_OTHER_MODEL = [
    (lambda: _Seq(12, 8, 3), r"checkpoint's parameter 'net\.0\.weight' has shape \[5, 12\], this "
                             r"plan's has shape \[8, 12\]"),
    (_Named, r"checkpoint's parameter 0 is 'net\.0\.weight', this plan's is 'fc1\.weight'"),
]


@pytest.mark.parametrize("other, first_difference", _OTHER_MODEL, ids=["shapes", "names"])
def test_resume_with_another_model_of_as_many_parameters_is_refused(tmp_path, other, first_difference):
    """Before any round, naming the first parameter that differs; not skipped to start afresh."""
    torch.manual_seed(0)
    writer = _mlp_plan(_Seq(12, 5, 7, 3))
    writer.fit(_mlp_data(), 1, progress=False, checkpoint_dir=str(tmp_path))
    torch.manual_seed(0)
    plan = _mlp_plan(other())
    assert plan.num_parameters == writer.num_parameters == 131
    start, rounds = plan.central_weights(), Counter()
    with pytest.raises(CheckpointError, match=first_difference + r".*resume with the model that "
                                              r"wrote it, or point checkpoint_dir at a new"):
        plan.fit(_mlp_data(), 2, progress=False, checkpoint_dir=str(tmp_path), resume=True,
                 hooks=[rounds])
    assert rounds.seen == 0 and plan.rounds_done == 0
    assert torch.equal(plan.central_weights(), start)
    with pytest.raises(CheckpointError, match=first_difference):
        plan.load_state_dict(writer.state_dict())


def test_a_state_without_the_model_layout_is_checked_by_its_counts():
    """States written before checkpoints recorded the model load when the counts agree."""
    torch.manual_seed(0)
    state = _mlp_plan(_Seq(12, 5, 7, 3)).state_dict()
    del state["model"]
    _mlp_plan(_Seq(12, 8, 3)).load_state_dict(state)
    with pytest.raises(CheckpointError, match="131 parameters .* 163"):
        _mlp_plan(_Seq(12, 10, 3)).load_state_dict(state)


def test_load_state_dict_of_the_same_model_in_another_dtype_is_refused():
    torch.manual_seed(0)
    state = _mlp_plan(_Named()).state_dict()
    torch.manual_seed(0)
    plan = _mlp_plan(_Named(), dtype=torch.bfloat16, example=torch.zeros(2, 12, dtype=torch.bfloat16))
    with pytest.raises(CheckpointError, match=r"checkpoint's parameter 'fc1\.weight' has dtype "
                                              r"float32, this plan's has dtype bfloat16"):
        plan.load_state_dict(state)


class _Frozen(nn.Module):
    """A frozen feature extractor of width ``h`` before a trained head, and an EMA buffer."""

    def __init__(self, h: int, buffer_dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.pre = nn.Sequential(nn.Linear(12, h), nn.Linear(h, 12)).requires_grad_(False)
        self.fc = nn.Linear(12, 3)
        self.register_buffer("ema", torch.zeros(12, dtype=buffer_dtype))

    def forward(self, x):
        return self.fc(self.pre(x))


@pytest.mark.parametrize("other, first_difference", [
    (lambda: _Frozen(32), r"frozen parameter 'pre\.0\.weight' has shape \[4, 12\], this plan's has "
                          r"shape \[32, 12\]"),
    (lambda: _Frozen(4, torch.float64), r"float buffer 'ema' has dtype float32, this plan's has "
                                        r"dtype float64"),
], ids=["frozen-shape", "buffer-dtype"])
def test_resume_with_other_frozen_parameters_or_buffer_dtypes_is_refused(tmp_path, other,
                                                                         first_difference):
    """Frozen parameters and the model's own buffer dtypes identify it too (same trainable layout)."""
    torch.manual_seed(0)
    _mlp_plan(_Frozen(4)).fit(_mlp_data(), 1, progress=False, checkpoint_dir=str(tmp_path))
    rounds = Counter()
    with pytest.raises(CheckpointError, match=first_difference):
        _mlp_plan(other()).fit(_mlp_data(), 2, progress=False, checkpoint_dir=str(tmp_path),
                               resume=True, hooks=[rounds])
    assert rounds.seen == 0
    _mlp_plan(_Frozen(4)).fit(_mlp_data(), 2, progress=False, checkpoint_dir=str(tmp_path),
                              resume=True)  # the model that wrote it resumes


def test_resume_without_checkpoint_starts_afresh_and_needs_dir(tmp_path):
    a, b = net_plan(), net_plan()
    a.fit(data(), 1, progress=False)
    b.fit(data(), 1, progress=False, checkpoint_dir=str(tmp_path / "new"), resume=True)
    assert_same_state(a, b)
    with pytest.raises(ValueError, match="resume=True needs checkpoint_dir"):
        net_plan().fit(data(), 1, progress=False, resume=True)
    with pytest.raises(ValueError, match="checkpoint_every=0"):
        net_plan().fit(data(), 1, progress=False, checkpoint_dir=str(tmp_path), checkpoint_every=0)


_KILLED_WRITER = textwrap.dedent("""
    import os, sys, time, torch
    sys.path.insert(0, {root!r})
    sys.path.insert(0, {tests!r})
    import crossbow_graph.training.checkpoint_files as ck
    from test_checkpoint import net_plan, data
    marker, ckpt = sys.argv[1], sys.argv[2]
    real = ck._write_all
    calls = [0]
    def half_then_hang(f, payload):
        calls[0] += 1
        if calls[0] < 3:
            return real(f, payload)
        f.write(payload[: len(payload) // 2])
        f.flush()
        os.fsync(f.fileno())
        open(marker, "w").close()
        time.sleep(600)
    ck._write_all = half_then_hang
    net_plan().fit(data(), 1, progress=False, checkpoint_dir=ckpt, checkpoint_every=1)
""")


def test_sigkill_during_write_leaves_last_good_checkpoint(tmp_path):
    marker, ckpt = str(tmp_path / "writing"), str(tmp_path / "ckpt")
    script = _KILLED_WRITER.format(root=ROOT, tests=os.path.join(ROOT, "tests"))
    proc = subprocess.Popen([sys.executable, "-c", script, marker, ckpt],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        for _ in range(1200):  # wait (up to ~120 s) for the third write to be half done
            if os.path.exists(marker) or proc.poll() is not None:
                break
            time.sleep(0.1)
        assert os.path.exists(marker), proc.communicate()[0].decode()[-2000:]
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    leftovers = [n for n in os.listdir(ckpt) if n.endswith(".tmp")]
    assert len(leftovers) == 1  # the half-written temporary file, never renamed
    assert [os.path.basename(p) for p in list_checkpoints(ckpt)] == ["ckpt-0000000001.pt",
                                                                     "ckpt-0000000002.pt"]
    path, state = load_latest(ckpt)
    assert state["plan"]["rounds_done"] == 2
    # resuming works, cleans up the temporary file, and matches an uninterrupted run
    full = net_plan()
    full.fit(data(), 1, progress=False)
    resumed = net_plan()
    resumed.fit(data(), 1, progress=False, checkpoint_dir=ckpt, checkpoint_every=1, resume=True)
    assert_same_state(full, resumed)
    assert not [n for n in os.listdir(ckpt) if n.endswith(".tmp")]


class Counter(Hook):
    """A hook with state (like the auto-tuner): rounds it has seen."""

    def __init__(self) -> None:
        self.seen = 0

    def after_round(self, ctx) -> None:
        self.seen += 1

    def state_dict(self) -> dict:
        return {"seen": self.seen}

    def load_state_dict(self, state: dict) -> None:
        self.seen = state["seen"]


def test_hook_state_is_checkpointed(tmp_path):
    ckpt = str(tmp_path)
    net_plan().fit(data(), 1, progress=False, hooks=[Counter(), StopAfter(4)], checkpoint_dir=ckpt,
                   checkpoint_every=2)
    counter = Counter()
    net_plan().fit(data(), 1, progress=False, hooks=[counter, StopAfter(100)], checkpoint_dir=ckpt,
                   resume=True)
    assert counter.seen == 6  # 4 before the checkpoint, 2 after resuming


class _SetReplicas(Hook):
    """Stands in for the auto-tuner: m 1 → 2 per device after round 2."""

    mutates_replicas = False

    def after_round(self, ctx) -> None:
        if ctx.plan.rounds_done == 2:
            ctx.plan.set_replicas(2)


def test_resume_of_an_auto_tuned_plan_continues_at_the_tuned_replica_count(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    first = net_plan(replicas="auto", devices=1, executor="inline")
    assert first.replicas_per_device == 1
    first.fit(data(), 1, shuffle=False, progress=False, checkpoint_dir=ckpt, checkpoint_every=1,
              hooks=[_SetReplicas(), StopAfter(5)])
    assert first.replicas_per_device == 2
    again = net_plan(replicas="auto", devices=1, executor="inline")
    loaded = _Capture()
    again.fit(data(), 1, shuffle=False, progress=False, checkpoint_dir=ckpt, resume=True,
              hooks=[loaded, StopAfter(6)])
    assert loaded.m == 2 and loaded.rounds == 5
    assert torch.equal(loaded.z, first.central_weights())
    assert torch.equal(loaded.w, first.replica_weights())
    assert again.rounds_done == 6 and torch.isfinite(again.central_weights()).all()


class _Capture(Hook):
    """The state a resumed fit starts from (before_fit runs after the checkpoint is loaded)."""

    mutates_replicas = False

    def before_fit(self, ctx) -> None:
        plan = ctx.plan
        self.m, self.rounds = plan.replicas_per_device, plan.rounds_done
        self.z, self.w = plan.central_weights(), plan.replica_weights()


# -- resuming after a policy changed b -----------------------------------------------------------


class _DoubleBatch(Policy):
    """b 4 → 8 and η 0.05 → 0.1 after round 3, through Plan.adjust (as AdaptiveBatchSize does)."""

    def after_round(self, ctx) -> None:
        if ctx.plan.rounds_done == 3:
            self.adjust(ctx, batch_size=8, lr=0.1, reason="test")


def _policy_log(h: cg.History) -> list:
    return [(p.round, p.epoch, p.policy, p.changes) for p in h.policy]


def _fit_interrupted_and_resumed(tmp_path, stop_at, fit, make=net_plan) -> tuple[cg.Plan, cg.History]:
    """``fit(plan, **kw)`` stopped after ``stop_at`` rounds (checkpoint every round), then resumed
    on a freshly compiled plan ``make()`` (b = 4 again); returns that plan and the resumed fit's
    History."""
    ckpt = str(tmp_path / "ckpt")
    first = make()
    random.seed(7), np.random.seed(7)
    fit(first, hooks=[StopAfter(stop_at)], checkpoint_dir=ckpt, checkpoint_every=1)
    assert load_latest(ckpt)[1]["plan"]["rounds_done"] == stop_at
    second = make()
    assert second.batch_size == 4
    random.seed(8), np.random.seed(8)  # overwritten by the checkpoint's RNG states
    # the same hooks (their state is keyed by position), as when the same command is run again
    h = fit(second, hooks=[StopAfter(10**6)], checkpoint_dir=ckpt, checkpoint_every=1, resume=True)
    return second, h


@pytest.mark.parametrize("stop_at", [5, 8])  # after the change: mid-epoch 1 and mid-epoch 2
def test_resume_continues_at_a_policy_changed_batch_size(tmp_path, stop_at):
    """A policy doubles b (and η) after round 3; a fit stopped after round 5 or 9 and resumed on a
    plan compiled with b = 4 continues at b = 8, η = 0.1, bit-identical to an uninterrupted fit
    (epoch 1: 3 rounds of 4·4 and 3 of 4·8 of the 144 samples; epoch 2: 4 rounds of 4·8)."""
    def fit(plan, **kw):
        return plan.fit(data(144), 2, progress=False, seed=3, policies=[_DoubleBatch()],
                        hooks=[DrawRandom()] + kw.pop("hooks"), **kw)

    full = net_plan()
    random.seed(7), np.random.seed(7)
    h_full = fit(full, hooks=[StopAfter(10**6)])
    assert (full.batch_size, full.settings.lr, full.rounds_done) == (8, 0.1, 10)
    second, h = _fit_interrupted_and_resumed(tmp_path, stop_at, fit)
    assert (second.batch_size, second.settings.lr, second.rounds_done) == (8, 0.1, 10)
    assert second.settings.batch_size == 8
    assert_same_state(full, second)
    assert [e.train_loss for e in h.epochs] == [e.train_loss for e in h_full.epochs]
    assert _policy_log(h) == _policy_log(h_full) == [(3, 0, "_DoubleBatch",
                                                      {"batch_size": 8, "lr": 0.1})]


@pytest.mark.parametrize("window", [2, 3])
def test_resume_restores_adaptive_batch_size_state(tmp_path, window):
    """AdaptiveBatchSize on random labels (the gradient is all noise: b doubles 4 → 8 → 16 once
    settled): stopped between its two changes and resumed, the fit takes the same decisions at
    the same rounds, with the same noise-scale windows, and ends bit-identical. Windows of 3
    rounds measure the last 2, and the fit stops after the first of them: the window's first
    single-round estimate is in the checkpoint."""
    def fit(plan, **kw):
        policy = AdaptiveBatchSize(max_batch_size=16, cooldown_epochs=0.1, settle_windows=3)
        monitor = MetricsMonitor(window, measure_rounds=2 if window == 3 else 10)
        return plan.fit(data(480), 1, progress=False, seed=3, metrics_every=monitor,
                        policies=[policy], **kw)

    make = functools.partial(net_plan, sync=cg.SMA(central_momentum=0.9, scale_lr=False))
    full = make()  # the scenario's decisions at η as set
    random.seed(7), np.random.seed(7)
    h_full = fit(full, hooks=[StopAfter(10**6)])
    resized = [p for p in h_full.policy if "batch_size" in p.changes]  # the others: η's gain
    rounds = [p.round for p in resized]
    assert [p.changes["batch_size"] for p in resized] == [8, 16], _policy_log(h_full)
    assert any("lr" in p.changes and "batch_size" not in p.changes for p in h_full.policy)
    stop = (rounds[0] + rounds[1]) // 2 + 1
    if window == 3:  # after round 2 of a window: one of its two estimates taken
        stop = next(r for r in range(rounds[0] + 1, rounds[1]) if r % 3 == 2)
    second, h = _fit_interrupted_and_resumed(tmp_path, stop, fit, make)
    assert second.batch_size == full.batch_size == 16
    assert second.rounds_done == full.rounds_done
    assert_same_state(full, second)
    assert _policy_log(h) == _policy_log(h_full)
    assert [(m.round, m.batch_size, m.noise_scale) for m in h.metrics] == \
        [(m.round, m.batch_size, m.noise_scale) for m in h_full.metrics]


@pytest.mark.parametrize("stop_at", [2, 4])  # inside the warm-up window; inside the first after it
def test_resume_keeps_the_metrics_warm_up(tmp_path, stop_at):
    """The monitor's warm-up is counted in the plan's rounds, which the checkpoint holds: a fit
    stopped inside the first window (kept out of the EMAs) or inside the next, and resumed, has
    the same windows, estimates and EMAs as an uninterrupted one."""
    def fit(plan, **kw):
        return plan.fit(data(480), 1, progress=False, seed=3,
                        metrics_every=MetricsMonitor(3, measure_rounds=2, warmup_windows=1), **kw)

    full = net_plan()
    random.seed(7), np.random.seed(7)
    h_full = fit(full, hooks=[StopAfter(10**6)])
    second, h = _fit_interrupted_and_resumed(tmp_path, stop_at, fit)
    fields = [(m.round, m.grad_sq, m.grad_sq_ema, m.trace_sigma_ema, m.noise_scale) for m in h_full.metrics]
    assert fields[0][2] is None and fields[1][2] is not None  # window 1 is the warm-up
    assert [(m.round, m.grad_sq, m.grad_sq_ema, m.trace_sigma_ema, m.noise_scale)
            for m in h.metrics] == fields
    assert_same_state(full, second)
