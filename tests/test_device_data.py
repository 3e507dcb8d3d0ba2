"""Data on the device (training/data.py ``DeviceFetch``) and batches copied a round ahead
(engine/data/prefetch.py, ``CudaStreams.copy_in``), through ``Plan.fit``.

Oracles: the same fit with the data gathered on the host (``data_on_device=False``, or without
the copy ahead) gives z bit for bit; on simulated streams (testing/race_check.py) the copy ahead
has no unordered access, and without the learners' wait for the copy's event it has one.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import DataLoader, Dataset, TensorDataset

import crossbow_graph as cg
from crossbow_graph.engine.backends.streams.discipline import CudaStreams
from crossbow_graph.engine.scheduler import Scheduler
from crossbow_graph.testing.race_check import RaceRecorder

from _plans import TinyBN, TinyDrop, TinyNet, make_plan, tiny_data

FIT = dict(progress=False, metrics_every=None)


class _Samples(Dataset):
    """A map-style Dataset read sample by sample (not a TensorDataset: its batches are collated
    on the host)."""

    def __init__(self, data: TensorDataset) -> None:
        self.x, self.y = data.tensors

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


class _CountOps(TorchDispatchMode):
    """Counts the aten ops run while entered, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func._schema.name)
        self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def _state(plan: cg.Plan) -> list[torch.Tensor]:
    plan.rounds.flush()
    s = plan.states[0]
    return [plan.central_weights(), s.zbuf.clone(), s.w.clone()]


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


# -- the data on the device -----------------------------------------------------------------------

@pytest.mark.parametrize("model, mode", [(TinyNet, "per_replica"), (TinyBN, "per_replica"),
                                         (TinyBN, "fused")])
def test_data_on_device_on_a_cpu_device_equals_the_host_gather(model, mode):
    """data_on_device=True on a CPU device runs the device path (indices to the device, one
    index_select per tensor there): the same z, buffers and replicas as the host's gather, bit
    for bit, over two shuffled epochs with an evaluation."""
    data = tiny_data(96)

    def run(where):
        plan = make_plan(model, devices=2, replicas=2, learner_mode=mode, executor="inline")
        with _CountOps() as ops:
            history = plan.fit(data, 2, eval_dataset=tiny_data(16, 1), data_on_device=where, **FIT)
        return plan, history, ops.counts

    plan, history, counts = run(True)
    ref_plan, ref_history, ref_counts = run(False)
    rounds = plan.rounds_done
    assert rounds == 2 * (96 // 16)
    # fused BatchNorm: one gather of each device's float buffers per round (engine/learning/fused.py)
    bn_gathers = 2 * rounds if (model, mode) == (TinyBN, "fused") else 0
    assert counts.get("aten::index_select", 0) >= 2 * rounds + bn_gathers  # x and y, every round
    assert ref_counts.get("aten::index_select", 0) == bn_gathers
    assert _equal(_state(plan), _state(ref_plan))
    assert [e.train_loss for e in history.epochs] == [e.train_loss for e in ref_history.epochs]


def test_data_on_device_in_worker_processes_equals_the_host_gather():
    """The process executor's workers gather from the same device-resident tensors."""
    data = tiny_data(64)

    def run(where):
        plan = make_plan(TinyBN, devices=1, replicas=2, executor="process")
        plan.fit(data, 1, shuffle=False, data_on_device=where, **FIT)
        return _state(plan)

    assert _equal(run(True), run(False))


@pytest.mark.parametrize("value", ["yes", 1, 0, None, "cuda"])
def test_a_bad_data_on_device_is_a_value_error_before_training(value):
    plan = make_plan(devices=1, replicas=2, executor="inline")
    with pytest.raises(ValueError, match=r"data_on_device=.*use 'auto'.*True or False"):
        plan.fit(tiny_data(64), data_on_device=value, **FIT)
    assert plan.rounds_done == 0


@pytest.mark.parametrize("wrap", ["dataset", "loader"])
def test_data_on_device_true_needs_a_tensor_dataset(wrap):
    """True with samples the host reads one by one (or a DataLoader) cannot be honoured: a
    ValueError naming the type and the fix, before any round."""
    plan = make_plan(devices=1, replicas=2, executor="inline")
    data = _Samples(tiny_data(64)) if wrap == "dataset" else DataLoader(tiny_data(64), batch_size=4)
    with pytest.raises(ValueError, match=r"data_on_device=True .* TensorDataset\(x, y\)"):
        plan.fit(data, data_on_device=True, **FIT)
    assert plan.rounds_done == 0


# -- batches copied a round ahead, on simulated streams --------------------------------------------

def _collate(samples):
    return torch.stack([x for x, _ in samples]), torch.stack([y for _, y in samples])


class _Replan(cg.Hook):
    """Before round 3 (of the fit), m goes from 2 to 3; before round 6, b from 4 to 2."""

    def before_round(self, ctx) -> None:
        if ctx.plan.rounds_done == 3:
            ctx.plan.set_replicas(3)
        if ctx.plan.rounds_done == 6:
            ctx.plan.adjust(cg.Adjustment(batch_size=2))


SCENARIOS = {
    "a Dataset, BatchNorm, 2 devices": dict(model=TinyBN, devices=2, data="samples"),
    "a DataLoader's collate_fn, fused, 2 devices": dict(model=TinyBN, devices=2, data="collate",
                                                        learner_mode="fused"),
    "a DataLoader's workers, 2 devices": dict(model=TinyBN, devices=2, data="workers"),
    "a TensorDataset on the host, S-SGD": dict(model=TinyBN, devices=1, data="tensors",
                                               sync=cg.SSGD()),
    "m and b change mid-fit": dict(model=TinyNet, devices=1, data="samples", hooks=True),
    # device 1's learners seed their dropout masks from their global rows, copied ahead or not
    "dropout, 2 devices": dict(model=TinyDrop, devices=2, data="samples"),
}


def _fit(name: str, rec: RaceRecorder | None, *, ahead: bool = True):
    """The scenario's fit (2 epochs, shuffled) on ``rec``'s simulated streams (None: none);
    ``ahead=False`` turns the copy ahead off. Returns the plan."""
    spec = dict(SCENARIOS[name])
    hooks = [_Replan()] if spec.pop("hooks", False) else []
    kind = spec.pop("data")
    plan = make_plan(spec.pop("model"), replicas=2, executor="inline", kernel_backend="torch",
                     **spec)
    if rec is not None:
        rec.attach(plan.rounds)
    base = tiny_data(96)
    data = {"samples": _Samples(base), "tensors": base,
            "collate": DataLoader(_Samples(base), batch_size=4, collate_fn=_collate),
            "workers": DataLoader(_Samples(base), batch_size=4, num_workers=1)}[kind]
    original = Scheduler.prefetch
    if not ahead:
        Scheduler.prefetch = lambda self, t, indices, b: None
    try:
        with rec if rec is not None else _Nothing():
            plan.fit(data, 2, hooks=hooks, data_on_device=False, **FIT)
            plan.rounds.flush()
    finally:
        Scheduler.prefetch = original
    return plan


class _Nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_batches_copied_ahead_have_no_race_and_change_nothing(name):
    """Every round but an epoch's first takes its batch from the copy ahead (a re-plan drops the
    one copied for the old k or b); no unordered access; z, buffers and replicas bit for bit
    those of the fit without the copy ahead, on the same streams and on none."""
    rec = RaceRecorder()
    plan = _fit(name, rec)
    assert [str(r) for r in rec.races] == []
    ahead = plan.rounds.ctx.batch_ahead
    rounds = plan.rounds_done
    if name == "m and b change mid-fit":
        assert ahead.dropped == 2 and ahead.taken == rounds - 2 - 2  # 2 epochs' first rounds
    else:
        assert ahead.taken == rounds - 2 and ahead.dropped == 0
    state = _state(plan)
    assert _equal(state, _state(_fit(name, RaceRecorder(), ahead=False)))
    assert _equal(state, _state(_fit(name, None)))


def test_without_the_wait_for_the_copy_the_learners_race_with_it(monkeypatch):
    """The learners' wait for the copy's event ("batch copy" in ``CudaStreams.WAITS``) is what
    orders their reads after the copy stream's writes."""
    waits = dict(CudaStreams.WAITS)
    waits["learn"] = tuple(r for r in waits["learn"] if r != "batch copy")
    monkeypatch.setattr(CudaStreams, "WAITS", waits)
    rec = RaceRecorder()
    _fit("a Dataset, BatchNorm, 2 devices", rec)
    assert rec.races
    assert any("(_copy)" in r.first and "learn" in r.second for r in rec.races), rec.races[:3]


# -- on a GPU --------------------------------------------------------------------------------------

def _cuda_fit(mode: str, where, delay: dict | None = None):
    torch.backends.cudnn.deterministic = True
    plan = make_plan(TinyBN, devices=["cuda:0"], replicas=2, learner_mode=mode,
                     executor="inline", kernel_backend="torch")
    if delay:
        plan.rounds.executors.cuda_streams.delay = delay
    plan.fit(tiny_data(96), 2, data_on_device=where, **FIT)
    return plan


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["per_replica", "fused"])
def test_data_on_cuda_equals_the_host_path(mode):
    """The TensorDataset on cuda:0 (gathered there) and on the host (copied a round ahead from
    pinned memory): z, buffers and replicas bit for bit; "auto" keeps this small one on the GPU."""
    resident, host, auto = (_cuda_fit(mode, w) for w in (True, False, "auto"))
    assert host.rounds.ctx.batch_ahead.taken == host.rounds_done - 2
    assert auto.rounds.ctx.batch_ahead.taken == 0
    assert _equal(_state(resident), _state(host)) and _equal(_state(resident), _state(auto))


@pytest.mark.gpu
def test_a_delayed_copy_stream_changes_nothing_on_cuda():
    """The copy streams sleep ~10 ms before every copy: the learners still read the copied
    batch only after it landed (z bit for bit as without the delay)."""
    assert _equal(_state(_cuda_fit("per_replica", False)),
                  _state(_cuda_fit("per_replica", False, delay={"copy": 10_000_000})))
