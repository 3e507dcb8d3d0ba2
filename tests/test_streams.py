"""The inline executor's stream discipline (engine/backends/streams/discipline.py), checked on the CPU by a race
recorder (testing/race_check.py): simulated streams and events, every aten op's reads and writes.

Oracles: no pair of unordered conflicting accesses in fits that exercise every writer and reader
of the state (BatchNorm buffers, evaluation, checkpoints, metrics, faults, τ = 2, S-SGD, DiLoCo,
k = 1, a change of m and of the learner mode); dropping any one wait of the discipline makes the recorder
report a race; the device-side fault path gives the host path's z and fault events.
"""

from __future__ import annotations

import contextlib
import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import crossbow_graph as cg
from crossbow_graph.engine.backends.streams.discipline import CudaStreams
from crossbow_graph.engine.learning.faults import FaultMonitor
from crossbow_graph.testing.race_check import RaceRecorder
from crossbow_graph.training.hooks import Hook

from _plans import TinyBN, make_plan, tiny_data


def _ignored(data, batches):
    """``data`` with the labels of batches of 4 ``batches`` set to ignore_index: their loss is NaN."""
    x, y = data.tensors
    y = y.clone()
    for i in batches:
        y[4 * i:4 * i + 4] = -100
    return torch.utils.data.TensorDataset(x, y)


def _fit(scenario: str, tmp_path, rec: RaceRecorder | None):
    """Run a scenario's plan and fit(s) with ``rec`` as the scheduler's stream ops; returns the plan
    and its last History."""
    kw = dict(executor="inline", kernel_backend="torch")
    fit = dict(epochs=1, progress=False, metrics_every=None)
    if scenario == "batchnorm, 2 devices, evaluation, checkpoints, metrics":
        plan = make_plan(TinyBN, devices=2, replicas=2, **kw)
        fit.update(eval_dataset=tiny_data(16, 1), evals_per_epoch=2, checkpoint_dir=str(tmp_path),
                   checkpoint_every=2, metrics_every=2, hooks=[ResetFromZ(), SaveMidFit()])
    elif scenario == "batchnorm, nothing between rounds":
        plan = make_plan(TinyBN, devices=2, replicas=2, **kw)
    elif scenario == "τ = 2, NaN losses":
        plan = make_plan(devices=1, replicas=2, sync=cg.SMA(sync_every=2), **kw)
    elif scenario == "S-SGD":
        plan = make_plan(TinyBN, devices=1, replicas=2, sync=cg.SSGD(), **kw)
    elif scenario == "DiLoCo, 2 devices, NaN losses":  # its global sync writes every w
        plan = make_plan(TinyBN, devices=2, replicas=2, sync=cg.DiLoCo(sync_every=2), **kw)
        fit.update(checkpoint_dir=str(tmp_path), checkpoint_every=3)
    elif scenario == "one learner, AdamW":
        plan = make_plan(TinyBN, devices=1, replicas=1,
                         optimizer=lambda m: torch.optim.AdamW(m.parameters(), lr=0.01), **kw)
    else:  # "m and the learner mode change between fits"
        plan = make_plan(devices=1, replicas=2, learner_mode="fused", **kw)
    if rec is not None:
        rec.attach(plan.rounds)
    data = tiny_data(64)
    if scenario == "τ = 2, NaN losses":
        data = _ignored(data, [3, 6])
    if scenario == "DiLoCo, 2 devices, NaN losses":
        data = _ignored(data, [5, 12])  # round 1's learner 1 (between syncs), round 3's learner 0
    with rec if rec is not None else _nothing():
        history = plan.fit(data, shuffle=False, **fit)
        if scenario == "m and the learner mode change between fits":
            plan.set_learner_mode("per_replica")
            plan.set_replicas(3)
            history = plan.fit(data, shuffle=False, **fit)
            plan.set_replicas(1)
            history = plan.fit(data, shuffle=False, **fit)
        plan.rounds.flush()
        z = plan.central_weights()
    return plan, history, z


class ResetFromZ(Hook):
    """Before every third round, puts replica 1 of device 0 back at z on the default stream, as
    a policy does (after ``flush``, with no host read after it)."""

    def before_round(self, ctx) -> None:
        if ctx.plan.rounds_done % 3 == 1:
            ctx.plan.rounds.flush()
            FaultMonitor.reset(ctx.plan.states[0], [1])


class SaveMidFit(Hook):
    """After every second round, takes the plan's state_dict (as a user's hook may)."""

    def after_round(self, ctx) -> None:
        if ctx.plan.rounds_done % 2 == 0:
            self.saved = ctx.plan.state_dict()


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


SCENARIOS = ["batchnorm, 2 devices, evaluation, checkpoints, metrics", "τ = 2, NaN losses",
             "batchnorm, nothing between rounds", "S-SGD", "DiLoCo, 2 devices, NaN losses",
             "one learner, AdamW",
             "m and the learner mode change between fits"]


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_fits_on_recorded_streams_have_no_race_and_match_the_unstreamed_fit(scenario, tmp_path):
    rec = RaceRecorder()
    plan, history, z = _fit(scenario, tmp_path / "a", rec)
    assert rec.streams_made >= 3 and rec.accesses > 1000  # the streams ran and were recorded
    assert [str(r) for r in rec.races] == []
    _, ref_history, ref_z = _fit(scenario, tmp_path / "b", None)  # no streams: the host paths
    torch.testing.assert_close(z, ref_z, rtol=1e-6, atol=1e-7)
    assert [(f.round, f.device, f.replica) for f in history.faults] == \
        [(f.round, f.device, f.replica) for f in ref_history.faults]
    if scenario == "τ = 2, NaN losses":
        assert [(f.round, f.replica) for f in history.faults] == [(1, 1), (3, 0)]
    if scenario == "DiLoCo, 2 devices, NaN losses":  # learner j = 2·d + r
        assert [(f.round, f.device, f.replica) for f in history.faults] == \
            [(1, "cpu:0", 1), (3, "cpu:0", 0)]


def _rules():
    return [(kind, rule) for kind, rules in CudaStreams.WAITS.items() for rule in rules]


@pytest.mark.parametrize("kind, rule", _rules())
def test_every_wait_of_the_discipline_is_needed(kind, rule, monkeypatch, tmp_path):
    """Without any one of the waits the recorder finds a race in some scenario."""
    waits = dict(CudaStreams.WAITS)
    waits[kind] = tuple(r for r in waits[kind] if r != rule)
    monkeypatch.setattr(CudaStreams, "WAITS", waits)
    # a fit with nothing between its rounds: only the discipline orders a round after the last
    scenario = {"global sync (S-SGD, DiLoCo)": "DiLoCo, 2 devices, NaN losses"}.get(
        rule, "batchnorm, nothing between rounds")
    rec = RaceRecorder()
    if (kind, rule) == ("local", "start"):  # ordered through the learners when a round has any
        _local_sync_without_learners(rec)
    else:
        _fit(scenario, tmp_path, rec)
    assert rec.races, f"no race without {kind} waiting for {rule}"


def _local_sync_without_learners(rec: RaceRecorder) -> None:
    """The caller's stream D writes a tensor, a round starts with no learner on the device,
    and its local sync on S_d writes the tensor too."""
    t = torch.zeros(4)
    with rec:
        streams = CudaStreams([SimpleNamespace(torch_device=torch.device("cpu"))], rec)
        t.add_(1)  # on D, before the round (a hook, the previous round's epilogue)
        streams.begin_round(None)
        with streams.local("local sync", 0):
            t.mul_(2)


def test_a_local_sync_without_learners_waits_for_the_round_start():
    """WAITS["local"] has "start": a LOCAL_SYNC with no learners that round is ordered after
    the caller's work before the round (start_t), as one after learners is."""
    rec = RaceRecorder()
    _local_sync_without_learners(rec)
    assert [str(r) for r in rec.races] == []


def test_join_and_the_buffer_snapshot_are_needed(monkeypatch, tmp_path):
    """The default stream reads z and the replicas only after ``join``; the global sync reads
    the local sync's copy of the BatchNorm buffers, not the live ones the next round updates."""
    monkeypatch.setattr(CudaStreams, "join", lambda self: None)
    rec = RaceRecorder()
    _fit(SCENARIOS[0], tmp_path / "a", rec)
    assert any("metrics.py" in str(r) for r in rec.races)  # the noise scale's read of g
    monkeypatch.undo()
    from crossbow_graph.engine.backends.streams.backend import StreamsBackend
    monkeypatch.setattr(StreamsBackend, "_snapshot_buffers", lambda self, env, d, a, b: None)
    rec = RaceRecorder()
    _fit("batchnorm, nothing between rounds", tmp_path / "b", rec)
    assert any("native_batch_norm" in str(r) for r in rec.races)


def test_device_fault_path_resets_like_the_host_path_and_raises_a_round_late():
    """All learners NaN in round 2: the device path resets every replica from z (finite), and the
    DivergenceError names round 2, raised when the host reads the flags a round later."""
    def plan_of():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))
        return cg.compile(model, (torch.zeros(1, 5),), nn.functional.cross_entropy, batch_size=4,
                          devices=1, replicas=2, optimizer=cg.SGD(lr=0.1, momentum=0.9),
                          executor="inline", kernel_backend="torch")
    g = torch.Generator().manual_seed(2)
    data = torch.utils.data.TensorDataset(torch.randn(64, 5, generator=g),
                                          torch.randint(0, 3, (64,), generator=g))
    data = _ignored(data, [4, 5])  # round 2's two learners
    plan = plan_of()
    rec = RaceRecorder().attach(plan.rounds)
    with rec, pytest.raises(cg.DivergenceError, match="all 2 replicas .* round 2"):
        plan.fit(data, 1, shuffle=False, progress=False, metrics_every=None)
    assert plan.rounds_done == 4  # round 3 ran before the host read round 2's flags
    assert all(torch.isfinite(s.w).all() and torch.isfinite(s.z).all() for s in plan.states)
    assert rec.races == []
    assert math.isfinite(float(plan.central_weights().sum()))


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["per_replica", "fused"])
@pytest.mark.parametrize("kind", ["learn", "local", "global"])
def test_a_delayed_stream_changes_nothing_on_cuda(mode, kind):
    """Each kind of stream sleeps ~10 ms before its work every round (``CudaStreams.delay``): a
    missing wait would let another stream read or overwrite its data early; z stays bitwise the
    same as without the delay."""
    torch.backends.cudnn.deterministic = True

    def run(delay: int):
        plan = make_plan(TinyBN, devices=1, replicas=2, learner_mode=mode, executor="inline",
                         kernel_backend="torch")
        streams = plan.rounds.executors.cuda_streams
        streams.delay = {kind: delay} if delay else {}
        plan.fit(tiny_data(64), 1, shuffle=False, progress=False, metrics_every=None)
        return plan.central_weights(), plan.states[0].zbuf.clone()

    z, zbuf = run(0)
    z_late, zbuf_late = run(10_000_000)
    assert torch.equal(z, z_late) and torch.equal(zbuf, zbuf_late)


def test_stream_timings_come_from_events_into_the_trace(tmp_path):
    """On streams the tasks are timed by events (read when done), one trace lane per kind of
    stream, every task of every round in it; the host clock is not used (the recorder's
    events measure 0 ms)."""
    import json
    plan = make_plan(devices=2, replicas=2, executor="inline", kernel_backend="torch")
    rec = RaceRecorder().attach(plan.rounds)
    trace = tmp_path / "run.json"
    with rec:
        plan.fit(tiny_data(64), 1, shuffle=False, progress=False, metrics_every=None,
                 trace=str(trace))
    events = json.loads(trace.read_text())
    events = events["traceEvents"] if isinstance(events, dict) else events
    lanes = {e["args"]["name"] for e in events if e.get("ph") == "M"}
    assert lanes == {"learn stream", "local stream", "global stream"}
    names = [e["name"] for e in events if e.get("ph") == "X"]
    rounds = plan.rounds_done
    assert rounds == 4 and names.count("global_sync") == rounds
    assert sum(n.startswith("learn") for n in names) == 4 * rounds
    assert plan.rounds.clock.sync_s == 0.0  # the simulated events' durations


def test_learner_streams_stay_within_the_pool_and_apart_from_the_sync_streams():
    """m = 34 per_replica learners: at most STREAM_POOL learner streams (torch's pool size per
    priority; the groups beyond share them on purpose), and the sync and global streams come
    from another priority's pool, so no learner stream aliases them; no race, z as unstreamed."""
    from crossbow_graph.engine.backends.streams.discipline import STREAM_POOL, SYNC_PRIORITY

    def fit(rec):
        plan = make_plan(TinyBN, devices=1, replicas=34, executor="inline",
                            kernel_backend="torch", optimizer=cg.SGD(lr=0.05, momentum=0.9))
        if rec is not None:
            rec.attach(plan.rounds)
        with rec if rec is not None else contextlib.nullcontext():
            plan.fit(tiny_data(34 * 4 * 2), 1, shuffle=False, progress=False, metrics_every=None)
        plan.rounds.flush()
        return plan

    rec = RaceRecorder()
    plan = fit(rec)
    streams = plan.rounds.executors.cuda_streams
    learners = {id(s): s for s in streams.groups.values()}
    assert len(streams.groups) == 34 and len(learners) == STREAM_POOL
    assert all(s.priority == 0 for s in learners.values())
    assert streams.sync_stream[0].priority == SYNC_PRIORITY == streams.global_stream.priority
    assert [str(r) for r in rec.races] == []
    torch.testing.assert_close(plan.central_weights(), fit(None).central_weights(),
                               atol=1e-6, rtol=1e-5)


@pytest.mark.gpu
def test_gpu_learner_streams_never_alias_the_sync_streams():
    """m = 40 per_replica on cuda:0: the learner streams are at most 32 distinct CUDA streams,
    none of them the sync or the global stream."""
    torch.manual_seed(0)
    x, y = torch.randn(40 * 8 * 2, 1, 28, 28), torch.randint(0, 10, (40 * 8 * 2,))
    plan = cg.compile(cg.models.lenet5(), (x[:2],), nn.functional.cross_entropy, batch_size=8,
                      devices=1, replicas=40, executor="inline")
    plan.fit(torch.utils.data.TensorDataset(x, y), 1, progress=False, metrics_every=None)
    streams = plan.rounds.executors.cuda_streams
    learners = {s.cuda_stream for s in streams.groups.values()}
    syncs = {streams.sync_stream[0].cuda_stream, streams.global_stream.cuda_stream}
    assert len(learners) <= 32 and not learners & syncs
