"""What CUDA-graph rounds take as their batch (engine/graphs.py ``graph_batch``): a DataLoader's
learner batches (worker processes, pinned memory) stacked into static inputs, and the next
round's batch copied to the device a round ahead, by graph rounds and by the eager rounds of a
plan whose rounds a graph cannot take.

On the CPU the rounds run on simulated streams (a RaceRecorder: every read of a batch copied
ahead must be ordered after its copy) and simulated graphs (tests/test_graphs.py says how);
the oracle is the same fit's eager rounds. The ``gpu`` tests run real graphs.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn
from torch.utils._pytree import tree_leaves
from torch.utils.data import DataLoader

import crossbow_graph as cg
from crossbow_graph.engine import graph_inputs as GI
from crossbow_graph.engine import graphs as G
from crossbow_graph.engine.batches import LearnerBatches

from _plans import tiny_data
from test_graphs import _adamw, _fit, _same

pytestmark = pytest.mark.filterwarnings("ignore::crossbow_graph.errors.TraceWarning")


@pytest.mark.parametrize("mode", ["per_replica", "fused"])
def test_graph_rounds_take_a_dataloader_with_worker_processes(mode):
    """A DataLoader with a worker process hands each round as the learners' own batches (a
    LearnerBatches, loaded a round ahead): graph rounds stack them, take them copied to the
    device a round ahead into the graph's static inputs, capture and replay (no eager round),
    and z, the buffers and the fault events equal the eager rounds'."""
    loader = DataLoader(tiny_data(96), batch_size=4, shuffle=False, num_workers=1)
    eager = _fit(False, mode=mode, data=loader)
    graph = _fit(True, mode=mode, data=loader)
    _same(graph, eager)
    assert graph[1].cuda_graphs == {"captures": 1, "replays": 4, "eager_rounds": {}}
    assert graph[0].scheduler.batch_ahead.taken == 7  # every round but the first
    assert graph[0].scheduler.batch_ahead.taken == eager[0].scheduler.batch_ahead.taken


def test_rounds_a_graph_refuses_keep_the_copy_ahead():
    """A row optimizer (AdamW) under cuda_graphs=True runs eager rounds: each takes its batch
    copied to the device a round ahead, as the same plan without graph rounds does, with the
    same numbers."""
    loader = DataLoader(tiny_data(96), batch_size=4, shuffle=False)
    with pytest.warns(G.GraphWarning, match="row optimizer"):
        graph = _fit(True, optimizer=_adamw, data=loader)
    eager = _fit(False, optimizer=_adamw, data=loader)
    _same(graph, eager)
    assert graph[1].cuda_graphs["replays"] == 0
    assert graph[0].scheduler.batch_ahead.taken == eager[0].scheduler.batch_ahead.taken == 7


def _ragged(samples):
    """A collate_fn whose batches have each their own length: x ``[n, 1, 8, L]`` with L the
    batch's first label + 5, y ``[n]``."""
    x = torch.stack([s[0] for s in samples])
    y = torch.stack([s[1] for s in samples])
    return x[..., :5 + int(y[0])], y


class _Pool(nn.Module):
    """Averages over the last dimension (any length) → linear(8 → 4)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        return self.fc(x.mean(-1).flatten(1))


def test_ragged_learner_batches_run_eagerly_naming_why():
    """Learner batches of different lengths do not stack: the rounds run eagerly (per_replica
    learners take them as they are) with a GraphWarning that names the fix, the eager rounds'
    numbers; ``graph_batch`` stacks equal ones learner-major and leaves ragged ones."""
    loader = DataLoader(tiny_data(96), batch_size=4, shuffle=False, collate_fn=_ragged)
    with pytest.warns(G.GraphWarning, match="padded to one length"):
        graph = _fit(True, data=loader, model=_Pool, example=torch.randn(2, 1, 8, 8))
    _same(graph, _fit(False, data=loader, model=_Pool, example=torch.randn(2, 1, 8, 8)))
    assert graph[1].cuda_graphs["replays"] == 0
    even = LearnerBatches([(torch.full((2, 3), float(j)), torch.tensor([j, j])) for j in range(3)], 2)
    x, y = GI.graph_batch(even)
    assert torch.equal(x[:, 0], torch.tensor([0., 0., 1., 1., 2., 2.])) and y.tolist() == [0, 0, 1, 1, 2, 2]
    ragged = LearnerBatches([(torch.zeros(2, 3),), (torch.zeros(2, 4),)], 2)
    assert GI.graph_batch(ragged) is ragged


def test_graph_rounds_take_a_dataloaders_batches_into_static_inputs():
    """A DataLoader's batches (new tensors every round, never the dataset's): the graph rounds
    copy each into static inputs of the plan's device, capture and replay, and z equals the
    eager rounds'; the static inputs are the entry's own, and the first step's round (run once)
    keeps none; the History records the captures, replays and eager rounds."""
    loader = torch.utils.data.DataLoader(tiny_data(96), batch_size=12, shuffle=False)
    eager = _fit(False, data=loader)
    graph = _fit(True, data=loader)
    _same(graph, eager)
    rg = graph[0].scheduler.round_graph
    assert (rg.captures, rg.replays, rg.failure) == (1, 4, None)
    assert graph[1].cuda_graphs == {"captures": 1, "replays": 4, "eager_rounds": {}}
    assert len(rg._entries) == 1  # the steady key only
    (entry,) = rg._entries.values()
    assert all(t.device == graph[0].states[0].torch_device for t in tree_leaves(entry.batch))


class _Ops:
    """Events and pinning as HostStaging uses them, recording the host's waits."""

    def __init__(self):
        self.waited, self.n = [], 0

    def stage(self, t):
        return t.clone()

    def use(self, stream):
        return contextlib.nullcontext()

    def new_event(self):
        self.n += 1
        return self.n

    def record(self, event, stream):
        pass

    def wait_host(self, event):
        self.waited.append(event)


def test_host_staging_refills_a_buffer_only_after_its_last_copy():
    """Two slots in turn: the third batch waits for the event after the first batch's copy,
    the fourth for the second's; each static input holds the batch copied last."""
    ops = _Ops()
    staging = GI.HostStaging(ops)
    static = [torch.zeros(3)]
    for i in range(4):
        staging.copy_in(static, [torch.full((3,), float(i))], stream=None)
        assert torch.equal(static[0], torch.full((3,), float(i)))
    assert ops.waited == [1, 2]
    assert staging.buffers[0][0] is not staging.buffers[1][0]


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["per_replica", "fused"])
def test_gpu_graph_rounds_from_host_data_replay_and_equal_eager(mode):
    """Host data (data_on_device=False: the batches are gathered on the host) and a DataLoader:
    the graph rounds replay (no fallback) and z equals the eager rounds' on the same batches."""
    torch.backends.cudnn.deterministic = True
    torch.manual_seed(0)
    x, y = torch.randn(4 * 16 * 8, 1, 28, 28), torch.randint(0, 10, (4 * 16 * 8,))
    data = torch.utils.data.TensorDataset(x, y)
    zs = {}
    for source in ("host", "loader"):
        for graphs in (True, False):
            torch.manual_seed(0)
            plan = cg.compile(cg.models.lenet5(), (x[:2],), nn.functional.cross_entropy,
                              batch_size=16, devices=1, replicas=4, learner_mode=mode,
                              optimizer=cg.SGD(lr=0.05, momentum=0.9), cuda_graphs=graphs)
            src = data if source == "host" else torch.utils.data.DataLoader(
                data, batch_size=16, pin_memory=True)
            h = plan.fit(src, 1, shuffle=False, progress=False, metrics_every=None,
                         **({"data_on_device": False} if source == "host" else {}))
            if graphs:
                assert h.cuda_graphs["replays"] > 0 and not h.cuda_graphs["eager_rounds"], h.cuda_graphs
            zs[source, graphs] = plan.central_weights()
        torch.testing.assert_close(zs[source, True], zs[source, False], atol=1e-6, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["per_replica", "fused"])
def test_gpu_graph_rounds_from_a_dataloader_with_workers_and_pinned_memory(mode):
    """LeNet-5, m = 4, b = 16 from a DataLoader with a worker process and pinned memory: the
    graph rounds replay with no eager round and z equals the eager rounds' on the same
    batches."""
    torch.backends.cudnn.deterministic = True
    torch.manual_seed(0)
    x, y = torch.randn(4 * 16 * 8, 1, 28, 28), torch.randint(0, 10, (4 * 16 * 8,))
    data = torch.utils.data.TensorDataset(x, y)
    zs = {}
    for graphs in (True, False):
        torch.manual_seed(0)
        plan = cg.compile(cg.models.lenet5(), (x[:2],), nn.functional.cross_entropy,
                          batch_size=16, devices=1, replicas=4, learner_mode=mode,
                          optimizer=cg.SGD(lr=0.05, momentum=0.9), cuda_graphs=graphs)
        h = plan.fit(DataLoader(data, batch_size=16, num_workers=1, pin_memory=True), 1,
                     shuffle=False, progress=False, metrics_every=None)
        if graphs:
            assert h.cuda_graphs["replays"] > 0 and not h.cuda_graphs["eager_rounds"], h.cuda_graphs
            assert plan.scheduler.batch_ahead.taken == plan.rounds_done - 1
        zs[graphs] = plan.central_weights()
    torch.testing.assert_close(zs[True], zs[False], atol=1e-6, rtol=1e-5)
