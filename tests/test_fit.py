"""compile → plan → fit on the kinds of models users bring, the data order, and real MNIST."""

import copy
import functools

import networkx as nx
import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset, Subset, TensorDataset

import crossbow_graph as cg
from crossbow_graph import TaskKind
from _plans import make_plan
from _reference import batches_of, eager_steps, flat, reference_sma


def data(n, shape=(1, 8, 8), classes=5, seed=1):
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, *shape, generator=g), torch.randint(0, classes, (n,), generator=g))


# the plans of these tests: the model as given on x [N, 1, 8, 8], compile's optimizer
fit_plan = functools.partial(make_plan, seed=None, optimizer=None)


class BNNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4 * 6 * 6, 5)

    def forward(self, x):
        return self.fc(F.relu(self.bn(self.conv(x))).flatten(1))


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.Linear(64, 64, bias=False)
        self.dec = nn.Linear(64, 64, bias=False)
        self.dec.weight = self.enc.weight  # one parameter under two names
        self.head = nn.Linear(64, 5)

    def forward(self, x):
        return self.head(torch.tanh(self.dec(torch.tanh(self.enc(x.flatten(1))))))


class FrozenAndUnused(nn.Module):
    def __init__(self):
        super().__init__()
        self.frozen = nn.Linear(64, 16)
        self.frozen.requires_grad_(False)
        self.head = nn.Linear(16, 5)
        self.unused = nn.Linear(3, 3)

    def forward(self, x):
        return self.head(torch.relu(self.frozen(x.flatten(1))))


def test_task_graph_has_one_learn_per_replica_one_local_sync_per_device_and_one_global_sync():
    plan = fit_plan(BNNet(), devices=2, replicas=3)
    g = plan.task_graph
    assert isinstance(g, nx.DiGraph) and nx.is_directed_acyclic_graph(g)
    tasks = [g.nodes[n]["task"] for n in g.nodes]
    kinds = [t.kind for t in tasks]
    assert (kinds.count(TaskKind.LEARN), kinds.count(TaskKind.LOCAL_SYNC), kinds.count(TaskKind.GLOBAL_SYNC)) == (6, 2, 1)
    for t in tasks:
        if t.kind is TaskKind.LEARN:
            (local,) = g.successors(t.id)
            assert g.nodes[local]["task"].kind is TaskKind.LOCAL_SYNC
            assert g.nodes[local]["task"].device == t.device
        elif t.kind is TaskKind.LOCAL_SYNC:
            assert list(g.successors(t.id)) == ["global_sync"]
    assert "2 device(s) × 3 replica(s) = 6 learners" in plan.summary()


def test_batchnorm_statistics_are_per_replica_and_z_holds_their_mean():
    plan = fit_plan(BNNet(), devices=2, replicas=2)
    # 0 batches: the central model shows zbuf, the training state (else re-estimated for z:
    # tests/test_bn_recalibration.py)
    plan.fit(data(4 * 4 * 5), 1, progress=False, bn_recalibration_batches=0)
    replicas = [r for s in plan.states for r in s.replicas]
    means = torch.stack([r.bn.running_mean for r in replicas])
    assert not torch.allclose(means[0], means[1])  # each replica keeps its own statistics
    z = plan.central_model()
    torch.testing.assert_close(z.bn.running_mean, means.mean(0), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(z.bn.running_var, torch.stack([r.bn.running_var for r in replicas]).mean(0))
    assert z.bn.num_batches_tracked.dtype == torch.int64 and int(z.bn.num_batches_tracked) == 5


def test_batchnorm_model_matches_reference():
    model = BNNet()
    ds = data(4 * 4 * 3)
    plan = fit_plan(model, devices=2, replicas=2, optimizer=cg.SGD(lr=0.05, momentum=0.9))
    start = copy.deepcopy(model)  # the fit leaves z in model
    plan.fit(ds, 1, shuffle=False, progress=False)
    bs = [(ds.tensors[0][i * 4:(i + 1) * 4], ds.tensors[1][i * 4:(i + 1) * 4]) for i in range(12)]
    z, _ = reference_sma(start, bs, k=4, rounds=3, lr=0.05, momentum=0.9)
    torch.testing.assert_close(plan.central_weights(), flat(z), atol=1e-6, rtol=1e-5)


def test_tied_parameter_is_one_parameter_updated_once():
    model = Tied()
    plan = fit_plan(model, optimizer=cg.SGD(lr=0.1, momentum=0.9))
    assert plan.num_parameters == 64 * 64 + 64 * 5 + 5
    eager = copy.deepcopy(model)
    sgd = torch.optim.SGD(eager.parameters(), lr=0.1, momentum=0.9)
    ds = data(12)
    plan.fit(ds, 1, shuffle=False, progress=False)
    eager_steps(eager, sgd, batches_of(ds, 4))
    z = plan.central_model()
    assert z.enc.weight is z.dec.weight
    assert set(z.state_dict()) == set(model.state_dict())
    torch.testing.assert_close(z.enc.weight, eager.enc.weight, atol=1e-6, rtol=1e-5)


def test_frozen_parameters_never_change_and_unused_ones_do_not_crash():
    model = FrozenAndUnused()
    plan = fit_plan(model, devices=2, replicas=2)
    assert plan.num_parameters == 16 * 5 + 5 + 3 * 3 + 3  # head and unused, not frozen
    plan.fit(data(64), 2, progress=False)
    z = plan.central_model()
    assert torch.equal(z.frozen.weight, model.frozen.weight)
    assert torch.equal(z.unused.weight, model.unused.weight)  # zero gradient, no weight decay
    assert not torch.equal(z.head.weight, plan.template.head.weight)
    assert list(z.state_dict()) == list(model.state_dict())


def test_central_model_is_the_input_class_with_the_same_keys():
    model = cg.models.lenet5()
    plan = cg.compile(model, (torch.randn(1, 1, 28, 28),), F.cross_entropy, batch_size=2, replicas=2)
    z = plan.central_model()
    assert type(z) is type(model) and list(z.state_dict()) == list(model.state_dict())
    assert z is not model and not z.training


def test_untraceable_model_with_strict_trace_raises_trace_error_naming_module_and_line():
    class Gate(nn.Module):
        def forward(self, x):
            if x.sum() > 0:
                return x
            return -x

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate = Gate()
            self.fc = nn.Linear(4, 2)

        def forward(self, x):
            return self.fc(self.gate(x))

    with pytest.raises(cg.TraceError) as info:
        cg.compile(Net(), (torch.randn(2, 4),), F.cross_entropy, batch_size=2, strict_trace=True)
    msg = str(info.value)
    assert isinstance(info.value, ValueError)
    assert "'gate' (Gate)" in msg and "if x.sum() > 0" in msg and "leaf_modules" in msg


class Indexed(Dataset):
    """Sample i is (image, i): the target tells the loss which sample it got."""

    def __len__(self):
        return 50

    def __getitem__(self, i):
        return torch.full((1, 8, 8), float(i)), i


class Recorder:
    def __init__(self):
        self.seen = []

    def __call__(self, out, y):
        self.seen.append(y.tolist())
        return out.sum() * 0.0 + out.pow(2).mean()


def test_without_shuffle_learner_j_gets_batch_t_k_plus_j_and_the_partial_round_is_dropped():
    rec = Recorder()
    plan = cg.compile(nn.Sequential(nn.Flatten(), nn.Linear(64, 3)), (torch.randn(2, 1, 8, 8),), rec,
                      batch_size=4, devices=2, replicas=3, executor="inline")  # the recorder is in this process
    plan.fit(Indexed(), 1, shuffle=False, progress=False)
    # k = 6 learners × b = 4 = 24 samples a round: 2 rounds of 50 samples, 2 left over
    assert rec.seen == [list(range(4 * n, 4 * n + 4)) for n in range(12)]


def test_shuffled_epochs_give_every_learner_disjoint_batches_and_a_new_order_each_epoch():
    rec = Recorder()
    plan = cg.compile(nn.Sequential(nn.Flatten(), nn.Linear(64, 3)), (torch.randn(2, 1, 8, 8),), rec,
                      batch_size=3, devices=2, replicas=2, executor="inline",
                      sync=cg.SMA(scale_lr=False))  # the batches under test: η as set (2η diverges)
    plan.fit(DataLoader(Indexed(), batch_size=7, shuffle=True), 2, progress=False, seed=5)
    per_epoch = [sum(rec.seen[i * 16:(i + 1) * 16], []) for i in range(2)]  # 4 rounds × 4 learners
    for seen in per_epoch:
        assert len(seen) == 48 and len(set(seen)) == 48
    assert per_epoch[0] != per_epoch[1]


def test_dataset_smaller_than_one_round_is_a_clear_error():
    plan = fit_plan(BNNet(), devices=2, replicas=2)
    with pytest.raises(ValueError, match="fewer than one round of 4 learners × 4 samples = 16"):
        plan.fit(data(10), 1, progress=False)


def test_history_and_target_accuracy_stop():
    ds = data(400, classes=2)
    ds.tensors[1].copy_((ds.tensors[0].flatten(1).mean(1) > 0).long())  # an easy rule
    plan = fit_plan(nn.Sequential(nn.Flatten(), nn.Linear(64, 2)), devices=2, replicas=2,
                    optimizer=cg.SGD(lr=0.1, momentum=0.9))
    h = plan.fit(ds, 20, eval_dataset=ds, target_accuracy=0.9, evals_per_epoch=2, progress=False)
    assert h.time_to_accuracy_s is not None and h.final_accuracy >= 0.9
    assert len(h.epochs) < 20 and h.epochs_to_accuracy <= len(h.epochs)
    e = h.epochs[-1]
    assert e.samples_per_s > 0 and e.train_seconds > 0 and e.train_loss > 0


@pytest.mark.slow
def test_short_run_on_real_mnist_reaches_90_percent():
    train, test = cg.datasets.mnist(True), cg.datasets.mnist(False)
    torch.manual_seed(0)
    plan = cg.compile(cg.models.lenet5(), (train.images[:1],), F.cross_entropy, batch_size=16,
                      devices=2, replicas=2, optimizer=cg.SGD(lr=0.02, momentum=0.9))
    h = plan.fit(Subset(train, range(12_800)), 1, eval_dataset=Subset(test, range(2_000)), progress=False)
    assert h.final_accuracy >= 0.90, h
    assert len(train) == 60_000 and len(test) == 10_000
    x, y = train[0]
    assert x.shape == (1, 28, 28) and x.dtype == torch.float32 and 0 <= int(y) <= 9
