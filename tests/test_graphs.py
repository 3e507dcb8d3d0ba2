"""CUDA-graph rounds (engine/backends/graphs/capture.py) and their preconditions (testing/capture_check.py).

On the CPU the graph path runs on simulated streams (a RaceRecorder, tests/test_streams.py) and
simulated graphs (``SimulatedGraphs``: a capture records the round's aten ops, raising where
CUDA's capture fails; a replay runs them again on the same tensors with the same Python numbers,
so a number frozen into the graph, a host read or a data-dependent branch shows). Oracles: the
eager rounds on the same streams (z within float32 rounding: the torch kernels compute with
tensor hyper-parameters in other operations), the same fault events; the checker finds nothing
in steady-state rounds. The ``gpu`` tests compare real CUDA graphs with eager rounds bitwise.
"""

from __future__ import annotations

import contextlib
import re
import warnings

import pytest
import torch
from torch import nn

import crossbow_graph as cg
from crossbow_graph.engine.backends.graphs import capture as G, inputs as GI
from crossbow_graph.testing.capture_check import (CaptureChecker, CaptureError, SimulatedGraph,
                                                  SimulatedGraphs)
from crossbow_graph.testing.race_check import RaceRecorder
from crossbow_graph.training.data import DeviceFetch

from _plans import TinyBN, TinyDrop, make_plan, tiny_data
from test_streams import _ignored

pytestmark = pytest.mark.filterwarnings("ignore::crossbow_graph.errors.TraceWarning")

ATOL, RTOL = 1e-6, 1e-5  # float32: η·u as one product against the number's fused add


def _adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=0.01)


def _fit(graph: bool, *, mode="per_replica", data=None, optimizer=None, model=TinyBN,
         round_graph=None, fits=1, **kw):
    """A plan (1 device × 3 replicas, b = 4, SGD with momentum and weight decay unless
    ``optimizer``) fitted on simulated streams; with ``graph`` its rounds go through a
    RoundGraph on simulated graphs. η halves every 3 rounds. Returns (plan, history, z, zbuf)."""
    opt = optimizer or cg.SGD(lr=0.05, momentum=0.9, weight_decay=1e-3)
    plan = make_plan(model, devices=1, replicas=3, executor="inline", kernel_backend="torch",
                     learner_mode=mode, optimizer=opt, **kw)
    rec = RaceRecorder().attach(plan.rounds)
    if graph:
        plan.rounds.executors.round_graph = round_graph or G.RoundGraph(SimulatedGraphs())
    steps = torch.optim.lr_scheduler.StepLR(plan.optimizer, step_size=3, gamma=0.5)
    data = data if data is not None else tiny_data(96)  # 8 rounds of k·b = 12
    with rec:
        for _ in range(fits):
            history = plan.fit(data, 1, shuffle=False, progress=False, metrics_every=None,
                               lr_scheduler=steps, lr_scheduler_interval="round")
        plan.rounds.flush()
    assert [str(r) for r in rec.races] == [], [str(r) for r in rec.races][:3]
    return plan, history, plan.central_weights(), plan.states[0].zbuf.clone()


def _graph_rounds(ops, hook) -> "cg.Plan":
    """A TinyBN plan (1 device × 3 replicas, SGD with momentum) fitted one epoch of 8 rounds on
    simulated streams, its rounds through a RoundGraph over ``ops``, with ``hook``."""
    plan = make_plan(TinyBN, devices=1, replicas=3, executor="inline", kernel_backend="torch",
                     optimizer=cg.SGD(lr=0.05, momentum=0.9))
    rec = RaceRecorder().attach(plan.rounds)
    plan.rounds.executors.round_graph = G.RoundGraph(ops)
    with rec:
        plan.fit(tiny_data(96), 1, shuffle=False, progress=False, metrics_every=None, hooks=[hook])
    return plan


def _same(a, b) -> None:
    torch.testing.assert_close(a[2], b[2], atol=ATOL, rtol=RTOL)  # z
    torch.testing.assert_close(a[3], b[3], atol=ATOL, rtol=RTOL)  # BatchNorm's mean buffers
    assert [(f.round, f.replica) for f in a[1].faults] == [(f.round, f.replica) for f in b[1].faults]


@pytest.mark.parametrize("mode", ["per_replica", "fused"])
def test_graph_rounds_equal_eager_rounds(mode):
    """8 rounds, η changed every 3 (read from the device tensors at each replay), a NaN loss in
    a replayed round (round 5, learner 1: reset on the device, recorded a round late): z, the
    buffers and the fault events equal the eager rounds'. Warm-up: round 0 (its first-step
    key), rounds 1–2; round 3 is captured, rounds 4–7 replay it."""
    data = _ignored(tiny_data(96), [16])  # batch 16 of 4 = round 5's learner 1
    eager = _fit(False, mode=mode, data=data)
    graph = _fit(True, mode=mode, data=data)
    _same(graph, eager)
    assert [(f.round, f.replica) for f in graph[1].faults] == [(5, 1)]
    rg = graph[0].rounds.executors.round_graph
    assert (rg.captures, rg.replays, rg.failure) == (1, 4, None)
    assert graph[1].lr == eager[1].lr and len(set(graph[1].lr[3:])) == 2  # η changed after capture


def test_numbers_in_the_graph_would_be_frozen(monkeypatch):
    """The oracle can fail: with η handed to the kernels as a number, the replays keep the
    captured round's η and z moves away from the eager rounds'."""
    monkeypatch.setattr(GI.GraphHyper, "kernel_args", GI.Hyper.kernel_args)
    eager, graph = _fit(False), _fit(True)
    assert not torch.allclose(graph[2], eager[2], atol=100 * ATOL, rtol=100 * RTOL)


class _SetAlpha(cg.Hook):
    """α ← ``alpha`` after round ``at``: with z's rate β set, the round's γ = β/(k·α) changes."""

    def __init__(self, at: int, alpha: float) -> None:
        self.at, self.alpha = at, alpha

    def after_round(self, ctx) -> None:
        if ctx.plan.rounds_done == self.at:
            ctx.plan.adjust(cg.Adjustment(alpha=self.alpha))


def _gain_rounds(graph: bool) -> tuple["cg.Plan", torch.Tensor]:
    """A TinyBN plan (1 device × 3 replicas) with ``SMA(alpha=0.6, centre_rate=1.5)``, α ← 0.3
    after round 4 (γ from 0.83 to 1.67), one epoch of 8 rounds on simulated streams."""
    plan = make_plan(TinyBN, devices=1, replicas=3, executor="inline", kernel_backend="torch",
                     optimizer=cg.SGD(lr=0.05, momentum=0.9),
                     sync=cg.SMA(alpha=0.6, centre_rate=1.5))
    if graph:
        plan.rounds.executors.round_graph = G.RoundGraph(SimulatedGraphs())
    with RaceRecorder().attach(plan.rounds):
        plan.fit(tiny_data(96), 1, shuffle=False, progress=False, metrics_every=None,
                 hooks=[_SetAlpha(4, 0.3)])
        plan.rounds.flush()
    return plan, plan.central_weights()


def test_a_centre_gain_that_changes_after_capture_is_read_at_every_replay(monkeypatch):
    """z's share γ of the corrections' sum is a device tensor in the graph: a change of α after
    the capture changes γ in the replays as in eager rounds; as a number frozen into the graph
    (the oracle can fail) z moves away from the eager rounds'."""
    (plan, z), (_, z_eager) = _gain_rounds(True), _gain_rounds(False)
    rg = plan.rounds.executors.round_graph
    assert rg.captures == 1 and rg.replays >= 3
    torch.testing.assert_close(z, z_eager, atol=ATOL, rtol=RTOL)
    monkeypatch.setattr(GI.GraphHyper, "gain", GI.Hyper.gain)
    _, z_frozen = _gain_rounds(True)
    assert not torch.allclose(z_frozen, z_eager, atol=100 * ATOL, rtol=100 * RTOL)


def test_a_re_plan_captures_again():
    """A change of m between fits re-plans: new graphs for the new buffers, the same numbers as
    eager rounds."""
    def run(graph):
        plan, *_ = _fit(graph, fits=1)
        plan.set_replicas(2)
        with plan.rounds.executors.stream_ops:
            plan.fit(tiny_data(96), 1, shuffle=False, progress=False, metrics_every=None)
            plan.rounds.flush()
        return plan, plan.central_weights()
    (plan, z), (_, z_eager) = run(True), run(False)
    torch.testing.assert_close(z, z_eager, atol=ATOL, rtol=RTOL)
    rg = plan.rounds.executors.round_graph
    assert rg.captures == 2 and rg.replays == 4 + 9  # 8 + 12 rounds: 4 and 3 eager of each


class ItemNet(TinyBN):
    """TinyBN whose forward reads a value on the host: a graph cannot capture it."""

    def forward(self, x):
        return super().forward(x) * (1.0 + 0.0 * float(x.abs().max()))


class _CountedCaptures(SimulatedGraphs):
    """Simulated graphs that count the captures started."""

    started = 0

    def capture(self, graph, device):
        self.started += 1
        return super().capture(graph, device)


def test_an_uncapturable_model_warns_once_and_trains_eagerly():
    """A warm-up round finds the host read (CaptureProbe): one GraphWarning names it and the
    model's line, no capture is started, and every round trains eagerly: the eager rounds' z."""
    ops = _CountedCaptures()
    with pytest.warns(G.GraphWarning, match=r"capture would fail \(aten::_local_scalar_dense reads "
                      r"device data on the host .* at tests/test_graphs\.py:\d+ \(forward\)\)") as caught:
        graph = _fit(True, model=ItemNet, round_graph=G.RoundGraph(ops))
    assert len([w for w in caught if issubclass(w.category, G.GraphWarning)]) == 1
    _same(graph, _fit(False, model=ItemNet))
    rg = graph[0].rounds.executors.round_graph
    assert rg.captures == 0 and ops.started == 0 and "_local_scalar_dense" in rg.failure


def test_a_capture_that_fails_after_a_clean_warm_up_falls_back():
    """An op the warm-up's probe does not see fails the capture itself (a simulated
    CaptureError): what the capture ran is put back, one GraphWarning names the failure, and
    every round trains eagerly: the eager rounds' z."""
    class Late(SimulatedGraphs):
        def capture(self, graph, device):
            graph.__class__ = _FailingGraph
            return super().capture(graph, device)

    with pytest.warns(G.GraphWarning, match="a capture failed .*CaptureError"):
        graph = _fit(True, round_graph=G.RoundGraph(Late()))
    _same(graph, _fit(False))
    rg = graph[0].rounds.executors.round_graph
    assert rg.captures == 0 and rg.failure.startswith("CaptureError")


class _FailingGraph(SimulatedGraph):
    """A simulated graph whose capture fails at its first in-place add (after it wrote)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if func is torch.ops.aten.add_.Tensor:
            raise CaptureError("operation not permitted when stream is capturing: a late op")
        return out


def test_rounds_a_graph_cannot_take_run_eagerly_with_a_warning():
    """A row optimizer (AdamW: torch.optim's step reads its step count on the host) runs eager
    rounds, with one GraphWarning saying why; the numbers are the eager rounds'."""
    with pytest.warns(G.GraphWarning, match="row optimizer"):
        graph = _fit(True, optimizer=_adamw)
    _same(graph, _fit(False, optimizer=_adamw))
    assert graph[0].rounds.executors.round_graph.captures == 0


def test_compile_refuses_cuda_graphs_with_fault_tolerance():
    """Distributed(fault_tolerant=True) with cuda_graphs=True is refused before any device,
    process group or torchft is touched: its global sync runs torchft's quorum and all-reduce
    on the host every round, which a graph cannot hold."""
    with pytest.raises(ValueError, match=r"fault_tolerant=True.*cuda_graphs=True.*leave cuda_graphs"):
        make_plan(devices=1, replicas=2, cuda_graphs=True,
                  distributed=cg.Distributed(fault_tolerant=True, lighthouse="http://nowhere:1"))


@pytest.mark.gpu
def test_gpu_compile_refuses_cuda_graphs_with_fault_tolerance():
    with pytest.raises(ValueError, match=r"fault_tolerant=True.*cuda_graphs=True"):
        make_plan(devices=1, replicas=2, cuda_graphs=True,
                  distributed=cg.Distributed(fault_tolerant=True, lighthouse="http://nowhere:1"))


def test_compile_refuses_cuda_graphs_without_cuda():
    with pytest.raises(ValueError, match="cuda_graphs=True captures rounds in CUDA graphs.*cpu:0"):
        make_plan(devices=1, replicas=2, cuda_graphs=True)
    with pytest.raises(ValueError, match="warmup_rounds=0"):
        G.RoundGraph(warmup_rounds=0)


# -- the preconditions: no host read, no data-dependent shape, nothing that changes -------------

# torch.optim's Adam/AdamW without capturable=True (which CPU tensors refuse) read the step count
# on the host and pass the bias corrections as Python numbers; a fault's reset gives the replica
# fresh state, which its next round steps apart from the others
ROW_OPTIMIZER_EXCEPTIONS = (r"_local_scalar_dense reads device data on the host .* engine/state/optim\.py",
                            r"^aten\.\w+\.\w+: [-\d.e ]+ → [-\d.e ]+$",
                            r"^the op sequence changed")


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("mode", ["per_replica", "fused"])
def test_steady_state_rounds_have_no_host_sync_and_change_nothing(mode, optimizer, monkeypatch):
    """5 rounds of the graph path's body, run eagerly under a CaptureChecker, a NaN loss in
    round 2: rounds 3–5 (t = 2, 3, 4) read nothing on the host, take no data-dependent shape,
    and run the same ops with the same Python numbers as the round before, with the SGD
    kernels. A row optimizer has the known exceptions ``ROW_OPTIMIZER_EXCEPTIONS`` (so graph
    rounds decline it; ``test_rounds_a_graph_cannot_take_run_eagerly_with_a_warning``)."""
    rg = G.RoundGraph(SimulatedGraphs(), warmup_rounds=10**6)  # never captured: eager bodies
    checker = CaptureChecker()
    rg.observer = checker.round
    if optimizer == "adamw":  # let the body run, to show why graphs decline it
        monkeypatch.setattr(rg, "why_not", lambda backend, env, batch: None)
    data = _ignored(tiny_data(60), [7])  # round 2's learner 1
    _, history, *_ = _fit(True, mode=mode, data=data, round_graph=rg,
                          optimizer=_adamw if optimizer == "adamw" else None)
    assert [(f.round, f.replica) for f in history.faults] == [(2, 1)]
    assert sorted(checker.findings) == [0, 1, 2, 3, 4] and min(checker.ops.values()) > 100
    steady = [f for t in (2, 3, 4) for f in checker.findings[t]]
    if optimizer == "sgd":
        assert steady == []
        assert checker.findings[1]  # the first step's kernel differs: another key
    else:
        assert any("_local_scalar_dense" in f for f in steady)
        assert all(any(re.search(p, f) for p in ROW_OPTIMIZER_EXCEPTIONS) for f in steady), steady


def test_the_checker_finds_host_reads_and_data_dependent_shapes():
    """The checker can fail: a host read and a boolean mask in the model are findings of every
    round, with the line."""
    class Masked(ItemNet):
        def forward(self, x):
            out = super().forward(x)
            return out + 0.0 * out[out > 0].sum()

    rg = G.RoundGraph(SimulatedGraphs(), warmup_rounds=10**6)
    checker = CaptureChecker()
    rg.observer = checker.round
    _fit(True, model=Masked, round_graph=rg, data=tiny_data(36))
    found = checker.findings[2]
    assert any("_local_scalar_dense" in f for f in found)
    assert any("boolean mask" in f or "nonzero" in f for f in found), found


# -- on a GPU -------------------------------------------------------------------------------------

def _gpu_fit(model_fn, mode: str, graphs: bool, rounds: int = 6, m: int = 4, b: int = 16):
    """A seeded LeNet-5-sized fit on cuda:0 (m × b, SGD with momentum), η halved after round 3."""
    torch.manual_seed(0)
    model = model_fn()
    x = torch.randn(m * b * rounds, 1, 28, 28)
    y = torch.randint(0, 10, (m * b * rounds,))
    plan = make_plan(model, seed=None, example=x[:2], batch_size=b, devices=1, replicas=m,
                     learner_mode=mode, optimizer=cg.SGD(lr=0.05, momentum=0.9), cuda_graphs=graphs)
    steps = torch.optim.lr_scheduler.StepLR(plan.optimizer, step_size=3, gamma=0.5)
    plan.fit(torch.utils.data.TensorDataset(x, y), 1, shuffle=False, progress=False,
             metrics_every=None, lr_scheduler=steps, lr_scheduler_interval="round")
    plan.rounds.flush()
    return plan, plan.central_weights(), plan.states[0].zbuf.clone()


class LeNetBN(cg.models.LeNet5):
    def __init__(self):
        super().__init__()
        self.features.insert(1, nn.BatchNorm2d(6))


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["per_replica", "fused"])
def test_gpu_graph_rounds_equal_eager_rounds_bitwise(mode):
    """LeNet-5, m = 4, b = 16, 6 rounds with η changed mid-fit: z bitwise equal to eager
    rounds (Triton kernels: the same arithmetic on the loaded η); the graph replayed."""
    torch.backends.cudnn.deterministic = True
    plan, z, _ = _gpu_fit(cg.models.lenet5, mode, True)
    _, z_eager, _ = _gpu_fit(cg.models.lenet5, mode, False)
    rg = plan.rounds.executors.round_graph
    assert rg.failure is None and rg.captures == 1 and rg.replays == 2, (rg.failure, rg.replays)
    assert torch.equal(z, z_eager), (z - z_eager).abs().max()
    assert [e.draws_random for e in rg._entries.values()] == [False]  # replays seed nothing


class LeNetDrop(cg.models.LeNet5):
    def __init__(self):
        super().__init__()
        self.classifier.insert(0, nn.Dropout(0.5))


@pytest.mark.gpu
def test_gpu_graph_rounds_with_dropout_seed_every_round():
    """LeNet-5 with dropout in graph rounds: the body draws from the CUDA generator (its Philox
    offset moves), so every round is seeded from (fit seed, round): two fits equal bitwise."""
    torch.backends.cudnn.deterministic = True
    plan, z, _ = _gpu_fit(LeNetDrop, "per_replica", True)
    _, z_again, _ = _gpu_fit(LeNetDrop, "per_replica", True)
    rg = plan.rounds.executors.round_graph
    assert rg.failure is None and rg.replays == 2 and [e.draws_random for e in rg._entries.values()] == [True]
    assert torch.equal(z, z_again)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["per_replica", "fused"])
def test_gpu_graph_rounds_with_batchnorm_within_tolerance(mode):
    """LeNet-5 with BatchNorm: within 1e-5 (cuDNN may pick other algorithms under capture)."""
    plan, z, zbuf = _gpu_fit(LeNetBN, mode, True)
    _, z_eager, zbuf_eager = _gpu_fit(LeNetBN, mode, False)
    assert plan.rounds.executors.round_graph.failure is None
    torch.testing.assert_close(z, z_eager, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(zbuf, zbuf_eager, atol=1e-5, rtol=1e-4)


class ItemLeNet(cg.models.LeNet5):
    def forward(self, x):
        return super().forward(x) * (1.0 + 0.0 * float(x.abs().max()))


@pytest.mark.gpu
def test_gpu_uncapturable_model_falls_back_and_trains():
    with pytest.warns(G.GraphWarning, match="capture would fail"):
        plan, z, _ = _gpu_fit(ItemLeNet, "per_replica", True)
    _, z_eager, _ = _gpu_fit(ItemLeNet, "per_replica", False)
    assert plan.rounds.executors.round_graph.captures == 0
    torch.testing.assert_close(z, z_eager, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("value", ["yes", "False", 1, None])
def test_cuda_graphs_must_be_a_bool(value):
    with pytest.raises(TypeError, match=r"cuda_graphs=.*must be True or False"):
        make_plan(devices=1, replicas=2, cuda_graphs=value)


class _FakeCudaGraph:
    """torch.cuda.graph as it behaves on a GPU: its enter makes a side stream current; its exit
    raises in capture_end (a failed capture) before putting the caller's stream back."""

    def __init__(self, current: list, fail: bool, **kw) -> None:
        self.current, self.fail, self.kw = current, fail, kw

    def __enter__(self):
        self.before, self.current[0] = self.current[0], "capture stream"

    def __exit__(self, *exc):
        if self.fail or exc[0] is not None:
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing")
        self.current[0] = self.before


@pytest.mark.parametrize("fail", [False, True])
def test_capture_is_thread_local_and_restores_the_callers_stream(monkeypatch, fail):
    """CudaGraphOps.capture asks for capture_error_mode="thread_local" (a DataLoader's pin
    thread or a logger's .item() elsewhere cannot break it), puts every graph in one memory
    pool, and leaves the caller's stream current after a capture, also one that failed in
    capture_end; after a failure it ends the allocator's allocation to the pool and releases
    the pool (torch's capture_end raises before it does), and the next capture takes a new
    pool."""
    current, seen, allocator = ["D"], {}, []
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda d=None: current[0])
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_stream", lambda s: current.__setitem__(0, s))
    monkeypatch.setattr(torch._C, "_cuda_endAllocateToPool",
                        lambda i, pool: allocator.append(("end", i, pool)), raising=False)
    monkeypatch.setattr(torch._C, "_cuda_releasePool",
                        lambda i, pool: allocator.append(("release", i, pool)), raising=False)

    def graph(g, **kw):
        seen.update(kw)
        return _FakeCudaGraph(current, fail, **kw)

    monkeypatch.setattr(torch.cuda, "graph", graph)
    pools = iter(["pool", "another pool"])
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: next(pools))
    ops = G.CudaGraphOps()
    if fail:
        with pytest.raises(RuntimeError, match="capturing"):
            with ops.capture(object(), torch.device("cpu")):
                assert current[0] == "capture stream"
        assert allocator == [("end", 0, "pool"), ("release", 0, "pool")] and ops.pool is None
    else:
        for _ in range(2):  # every graph in the one pool
            with ops.capture(object(), torch.device("cpu")):
                assert current[0] == "capture stream"
        assert allocator == []
    assert current[0] == "D" and seen == {"capture_error_mode": "thread_local", "pool": "pool"}
    if fail:
        fail = False
        with ops.capture(object(), torch.device("cpu")):
            pass
        assert seen["pool"] == "another pool"


class SyncLeNet(cg.models.LeNet5):
    """LeNet-5 whose forward synchronises its stream: no aten op (the warm-up's CaptureProbe
    does not see it), and a capturing stream cannot be synchronised: the capture fails."""

    def forward(self, x):
        torch.cuda.current_stream().synchronize()
        return super().forward(x)


@pytest.mark.gpu
def test_gpu_failed_capture_leaves_the_default_stream_current():
    """After a capture that failed (a stream synchronised in the model), the caller's stream is
    current again: later rounds and the user's code do not run on torch's capture stream."""
    with pytest.warns(G.GraphWarning, match="capture failed"):
        _gpu_fit(SyncLeNet, "per_replica", True)
    assert torch.cuda.current_stream() == torch.cuda.default_stream()


@pytest.mark.gpu
def test_gpu_memory_stays_flat_after_a_failed_capture():
    """200 rounds after a failed capture (SyncLeNet: the capture fails at round 3), eager on
    CUDA streams: torch's caching allocator left capture mode (the capture's pool ended and
    released), so the blocks each round frees after their use on another stream are reused:
    the reserved memory after round 200 is that after round 20."""
    reserved = {}

    class Reserved(cg.Hook):
        mutates_replicas = False

        def after_round(self, ctx):
            if ctx.plan.rounds_done in (20, 200):
                torch.cuda.synchronize()
                reserved[ctx.plan.rounds_done] = torch.cuda.memory_reserved()

    torch.manual_seed(0)
    x, y = torch.randn(4 * 16 * 200, 1, 28, 28), torch.randint(0, 10, (4 * 16 * 200,))
    plan = make_plan(SyncLeNet, seed=None, example=x[:2], batch_size=16, devices=1, replicas=4,
                     optimizer=cg.SGD(lr=0.05, momentum=0.9), cuda_graphs=True)
    with pytest.warns(G.GraphWarning, match="capture failed"):
        plan.fit(torch.utils.data.TensorDataset(x, y), 1, shuffle=False, progress=False,
                 metrics_every=None, hooks=[Reserved()])
    assert plan.rounds.executors.round_graph.captures == 0 and plan.rounds_done == 200
    assert reserved[200] == reserved[20], reserved


@pytest.mark.gpu
def test_gpu_capture_survives_another_threads_cuda_work():
    """A thread reading device values (.item(), as a logger does) all through the fit does not
    break the capture (capture_error_mode="thread_local")."""
    import threading

    stop = threading.Event()
    probe = torch.ones(4, device="cuda")

    def logger():
        while not stop.is_set():
            float(probe.sum().item())

    thread = threading.Thread(target=logger, daemon=True)
    thread.start()
    try:
        plan, _, _ = _gpu_fit(cg.models.lenet5, "fused", True)
    finally:
        stop.set()
        thread.join()
    rg = plan.rounds.executors.round_graph
    assert rg.failure is None and rg.replays > 0, rg.failure


class _VersionlessReplay(SimulatedGraphs):
    """A replay that, like a CUDA graph's, moves no tensor's version counter (it runs nothing)."""

    def replay(self, graph) -> None:
        pass


def test_a_replay_moves_the_version_of_the_state_it_writes():
    """After every round, replayed ones too, z's version has moved: the central module's
    low-precision copy (refreshed on z._version) is never stale after a replay."""
    versions = []

    class Versions(cg.Hook):
        mutates_replicas = False

        def after_round(self, ctx):
            versions.append(ctx.plan.states[0].z._version)

    plan = _graph_rounds(_VersionlessReplay(), Versions())
    assert plan.rounds.executors.round_graph.replays == 4
    assert all(b > a for a, b in zip(versions, versions[1:])), versions


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["per_replica", "fused"])
def test_gpu_bf16_central_module_reads_z_after_replays(mode):
    """bf16 weights, graph rounds: an evaluation after replays runs on z's current value (the
    central module's bf16 copy equals z rounded), not on the value of the last eager round."""
    torch.manual_seed(0)
    x = torch.randn(4 * 16 * 6, 1, 28, 28, dtype=torch.bfloat16)
    y = torch.randint(0, 10, (4 * 16 * 6,))
    plan = cg.compile(cg.models.lenet5().to(torch.bfloat16), (x[:2],), nn.functional.cross_entropy,
                      batch_size=16, devices=1, replicas=4, learner_mode=mode,
                      optimizer=cg.SGD(lr=0.05, momentum=0.9), cuda_graphs=True)
    data = torch.utils.data.TensorDataset(x, y)
    plan.fit(data, 1, shuffle=False, progress=False, metrics_every=None)
    assert plan.rounds.executors.round_graph.replays > 0
    plan.evaluate(data)
    s = plan.states[0]
    assert s.z_model is not s.z and torch.equal(s.z_model, s.z.to(torch.bfloat16))


def test_a_refused_round_names_data_on_device_and_is_recorded():
    """Rounds a graph cannot take are counted by reason in the History (a row optimizer: all
    8); a batch that is not a structure of tensors is refused naming data_on_device."""
    graph = _fit(True, optimizer=_adamw)
    record = graph[1].cuda_graphs
    assert record["replays"] == 0 and list(record["eager_rounds"].values()) == [8], record
    rounds = _fit(True)[0].rounds  # SGD: graph rounds
    backend, env = rounds.executors.inline, rounds.round_env(0, None, True)
    rg = rounds.executors.round_graph
    reason = rg.why_not(backend, env, ((torch.zeros(2), "tag"), torch.zeros(2)))
    assert reason is not None and "data_on_device" in reason
    assert rg.why_not(backend, env, (torch.zeros(2), torch.zeros(2))) is None


def test_hyper_parameters_are_written_only_when_they_change():
    """DeviceHyper.set fills a tensor only when its number changed (no kernel in a round whose
    η, μ_l, λ, α, μ_z stay), and always holds the number in force."""
    def round_of(lr, momentum):
        return GI.Hyper((), lr, momentum, 0.0, False, 0.0, 0.0)

    hyper = GI.DeviceHyper(torch.device("cpu"))
    hyper.set(round_of(0.1, 0.9))
    versions = {n: t._version for n, t in hyper.values.items()}
    hyper.set(round_of(0.1, 0.9))
    assert {n: t._version for n, t in hyper.values.items()} == versions
    hyper.set(round_of(0.05, 0.9))
    assert hyper.values["lr"]._version == versions["lr"] + 1
    assert hyper.values["momentum"]._version == versions["momentum"]
    assert float(hyper.values["lr"]) == pytest.approx(0.05) and float(hyper.values["momentum"]) == pytest.approx(0.9)


def test_graph_rounds_leave_two_rounds_of_fault_masks_in_flight():
    """After graph round t the host has taken the fault masks of rounds before t − 1 only (it
    waits for round t − 2's replay, so two rounds stay queued on the GPU); the fit's end takes
    every one, and the faults equal the eager rounds' (test_graph_rounds_equal_eager_rounds)."""
    pending = []

    class Pending(cg.Hook):
        mutates_replicas = False

        def after_round(self, ctx):
            pending.append(sorted({t for t, *_ in ctx.plan.rounds.executors.current._late}))

    plan = _graph_rounds(SimulatedGraphs(), Pending())
    assert pending[4:] == [[3, 4], [4, 5], [5, 6], [6, 7]], pending
    assert plan.rounds.executors.current._late == []


def _resident_fit(graph: bool, model=TinyBN, counts=None, monkeypatch=None):
    """``_graph_rounds``' plan (3 replicas, b = 4, 8 rounds) on a device-resident TensorDataset
    (``data_on_device=True``), through a RoundGraph on simulated graphs when ``graph``; with
    ``counts``, the calls of DeviceFetch's gathers without ``out``, its index copies and the
    generator seeds are counted. Returns (plan, history)."""
    plan = make_plan(model, devices=1, replicas=3, executor="inline", kernel_backend="torch",
                     optimizer=cg.SGD(lr=0.05, momentum=0.9))
    if counts is not None:
        for cls, name, key in ((DeviceFetch, "_copied", "index copies"),
                               (DeviceFetch, "gather", "gathers outside a graph"), (G, "seed_rng", "seeds")):
            original = getattr(cls, name)

            def counted(*a, _f=original, _k=key, **kw):
                counts[_k] += _k != "gathers outside a graph" or kw.get("out") is None
                return _f(*a, **kw)
            monkeypatch.setattr(cls, name, counted)
    rec = RaceRecorder().attach(plan.rounds)
    if graph:
        plan.rounds.executors.round_graph = G.RoundGraph(SimulatedGraphs())
    with rec:
        history = plan.fit(tiny_data(96), 1, shuffle=True, progress=False, metrics_every=None,
                           data_on_device=True)
        plan.rounds.flush()
    return plan, history


def test_resident_data_is_gathered_in_the_graph_from_the_epochs_order_on_the_device(monkeypatch):
    """A device-resident TensorDataset: the epoch's order goes to the device once, each round's
    indices are a view of it copied into the graph's static indices, and the gathers run in the
    graph (none outside it); z and the buffers equal the eager rounds' on the same samples."""
    counts = {"index copies": 0, "gathers outside a graph": 0, "seeds": 0}
    eager = _resident_fit(False)
    graph = _resident_fit(True, counts=counts, monkeypatch=monkeypatch)
    torch.testing.assert_close(graph[0].central_weights(), eager[0].central_weights(), atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(graph[0].states[0].zbuf, eager[0].states[0].zbuf, atol=ATOL, rtol=RTOL)
    assert graph[1].cuda_graphs == {"captures": 1, "replays": 4, "eager_rounds": {}}
    assert counts["index copies"] == 1 and counts["gathers outside a graph"] == 0, counts
    (entry,) = graph[0].rounds.executors.round_graph._entries.values()
    assert entry.gather is not None and entry.gather.indices.shape == (12,)


def test_device_fetch_reads_a_slice_of_the_epochs_order_on_the_device():
    """``on_device``: a slice of the epoch's order is a view of its device copy (same values);
    other indices (a copy, a reversed order) are copied, with their own values."""
    fetch = DeviceFetch((torch.arange(10.0),), torch.device("cpu"))
    order = torch.randperm(10, generator=torch.Generator().manual_seed(0))
    fetch.start_epoch(order)
    device_order = fetch._order[1]
    view = fetch.on_device(order[3:7])
    assert view.untyped_storage().data_ptr() == device_order.untyped_storage().data_ptr()
    assert torch.equal(view, order[3:7]) and torch.equal(fetch(order[3:7])[0], order[3:7].float())
    for other in (order[3:7].clone(), order.flip(0)[:4]):
        got = fetch.on_device(other)
        assert torch.equal(got, other) and got.untyped_storage().data_ptr() != device_order.untyped_storage().data_ptr()


@pytest.mark.parametrize("model, seeded_rounds", [(TinyBN, 2), (TinyDrop, 8)])
def test_graph_rounds_seed_the_generator_only_when_the_round_draws_random_numbers(
        model, seeded_rounds, monkeypatch):
    """A model without random ops: only the warm-up rounds that measure it are seeded (round 0,
    its first-step key, and round 1); the capture and the replays seed nothing. With dropout every
    round is seeded from (fit seed, round): two fits draw the same masks, z equal bit for bit."""
    counts = {"index copies": 0, "gathers outside a graph": 0, "seeds": 0}
    plan, history = _resident_fit(True, model=model, counts=counts, monkeypatch=monkeypatch)
    assert counts["seeds"] == seeded_rounds and history.cuda_graphs["replays"] == 4, counts
    again = _resident_fit(True, model=model)[0]
    assert torch.equal(plan.central_weights(), again.central_weights())
