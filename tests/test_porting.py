"""A plain PyTorch training loop ported to a plan keeps its meaning: the user's model holds the
trained weights after every fit, parameters frozen after compile are refused, a DataLoader's
``shuffle`` and an evaluation DataLoader's workers are honoured, and a scheduler stepped between
fits raises no false torch warning (docs/api.md, Your model after a fit; README, Porting your
training loop)."""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset, TensorDataset

import crossbow_graph as cg

from _plans import TinyBN, TinyNet, tiny_data

FIT = dict(progress=False, metrics_every=None)


def _exactly_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert list(a) == list(b)
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=0, msg=name)


def _compile(model: nn.Module, **kw) -> cg.Plan:
    options = dict(batch_size=4, devices=1, replicas=2, executor="inline",
                   optimizer=cg.SGD(lr=0.05, momentum=0.9))
    return cg.compile(model, (torch.randn(2, 1, 8, 8),), F.cross_entropy, **{**options, **kw})


# -- the user's model after a fit --------------------------------------------------------------

def test_the_users_model_holds_the_central_model_after_every_fit_in_place():
    """``test(model)`` and ``torch.save(model.state_dict())`` after ``plan.fit`` see z: the same
    tensors (an optimizer built over them still holds them), every entry of central_model()'s
    state_dict, BatchNorm statistics re-estimated for z included; compile leaves it as it was."""
    torch.manual_seed(0)
    model = TinyBN()
    at_start = copy.deepcopy(model.state_dict())
    tensors = {n: t for n, t in model.state_dict(keep_vars=True).items()}
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    plan = _compile(model, optimizer=opt)
    _exactly_equal(model.state_dict(), at_start)  # compile leaves the model as it was
    for epochs in (1, 2):  # after every fit
        plan.fit(tiny_data(64), epochs, **FIT)
        z = plan.central_model().state_dict()
        _exactly_equal(model.state_dict(), z)
        assert all(model.state_dict(keep_vars=True)[n] is t for n, t in tensors.items())
    assert not torch.equal(model.bn.running_mean, at_start["bn.running_mean"])
    assert int(model.bn.num_batches_tracked) > 0
    assert opt.param_groups[0]["params"][0] is model.conv.weight
    assert model.training  # its mode is the user's


class Tied(nn.Module):
    """An embedding tied to the classifier, and a frozen projection."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 6)
        self.proj = nn.Linear(6, 6)
        self.head = nn.Linear(6, 10, bias=False)
        self.head.weight = self.embed.weight
        self.proj.requires_grad_(False)

    def forward(self, ids):
        return self.head(torch.tanh(self.proj(self.embed(ids))).mean(1))


def test_tied_and_frozen_parameters_stay_so_in_the_users_model():
    torch.manual_seed(0)
    model = Tied()
    frozen = model.proj.weight.detach().clone()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 10, (64, 5), generator=g)
    plan = cg.compile(model, (ids[:2],), F.cross_entropy, batch_size=4, devices=1, replicas=2,
                      executor="inline", optimizer=cg.SGD(lr=0.1))
    plan.fit(TensorDataset(ids, ids[:, 0]), 1, **FIT)
    assert model.head.weight is model.embed.weight
    torch.testing.assert_close(model.embed.weight, plan.central_model().embed.weight, rtol=0, atol=0)
    assert not torch.equal(model.embed.weight, Tied().embed.weight)
    torch.testing.assert_close(model.proj.weight, frozen, rtol=0, atol=0)


def test_a_resumed_fit_leaves_the_trained_weights_in_the_new_model(tmp_path):
    """After a crash: a new model, a new plan, the same fit call with resume=True; the model
    then holds the checkpoint's training continued, as the uninterrupted run's model does."""
    torch.manual_seed(0)
    whole_model = TinyNet()
    first_model, again_model = copy.deepcopy(whole_model), copy.deepcopy(whole_model)
    initial = copy.deepcopy(whole_model.state_dict())
    _compile(whole_model).fit(tiny_data(64), 2, **FIT)

    class StopAfter(cg.Hook):
        mutates_replicas = False

        def after_round(self, ctx):
            ctx.stop = ctx.plan.rounds_done == 3

    ckpt = str(tmp_path / "ckpt")
    _compile(first_model).fit(tiny_data(64), 2, checkpoint_dir=ckpt, checkpoint_every=1,
                              hooks=[StopAfter()], **FIT)
    assert not torch.equal(first_model.fc.weight, initial["fc.weight"])  # the stopped fit's z
    _compile(again_model).fit(tiny_data(64), 2, checkpoint_dir=ckpt, resume=True, **FIT)
    _exactly_equal(again_model.state_dict(), whole_model.state_dict())
    assert not torch.equal(again_model.fc.weight, first_model.fc.weight)  # trained on after the stop


def test_a_model_nobody_keeps_is_not_kept_alive():
    plan = _compile(TinyNet())
    assert plan.user_model.module is None
    plan.fit(tiny_data(64), 1, **FIT)  # nothing to write into


# -- parameters frozen after compile -----------------------------------------------------------

class Backbone(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Conv2d(1, 3, 3), nn.ReLU(), nn.Flatten())
        self.head = nn.Linear(3 * 6 * 6, 4)

    def forward(self, x):
        return self.head(self.backbone(x))


def test_parameters_frozen_after_compile_are_refused_before_training():
    """``model.backbone.requires_grad_(False)`` between compile and fit, the head-only idiom:
    the plan would train the backbone all the same, so the fit refuses, naming the parameters
    and the fix (compile after freezing), before any round."""
    model = Backbone()
    plan = _compile(model)
    model.backbone.requires_grad_(False)
    with pytest.raises(ValueError, match=r"Backbone's parameters 'backbone\.0\.weight', "
                                         r"'backbone\.0\.bias' have requires_grad=False now, but "
                                         r"the plan trains them.*freeze or unfreeze them before "
                                         r"compile"):
        plan.fit(tiny_data(64), 1, **FIT)
    assert plan.rounds_done == 0
    model.backbone.requires_grad_(True)
    model.head.requires_grad_(False)
    plan = _compile(model)
    model.head.requires_grad_(True)
    with pytest.raises(ValueError, match=r"'head\.weight', 'head\.bias' have requires_grad=True "
                                         r"now, but the plan was compiled with them frozen"):
        plan.fit(tiny_data(64), 1, **FIT)


def test_a_head_only_phase_then_full_fine_tuning_are_two_plans_over_the_model():
    """The fix the refusal names: freeze, compile, fit (the backbone stays); unfreeze, compile
    again from the model, which holds the first phase's weights, and fit."""
    torch.manual_seed(0)
    model = Backbone()
    backbone = copy.deepcopy(model.backbone.state_dict())
    model.backbone.requires_grad_(False)
    head_only = _compile(model)
    head_only.fit(tiny_data(64), 1, **FIT)
    _exactly_equal(model.backbone.state_dict(), backbone)
    head = copy.deepcopy(model.head.state_dict())
    model.backbone.requires_grad_(True)
    full = _compile(model)
    _exactly_equal(full.template.head.state_dict(), head)  # phase two starts where one ended
    full.fit(tiny_data(64), 1, **FIT)
    assert not torch.equal(model.backbone[0].weight, backbone["0.weight"])


# -- a DataLoader's shuffle, an evaluation DataLoader's workers ----------------------------------

class Orders(cg.Hook):
    """Every round's sample indices."""

    mutates_replicas = False

    def __init__(self) -> None:
        self.rounds: list[list[int]] = []

    def after_round(self, ctx) -> None:
        self.rounds.append(ctx.batch_indices.tolist())


def _order(data, **fit) -> list[int]:
    orders = Orders()
    _compile(TinyNet()).fit(data, 1, hooks=[orders], **FIT, **fit)
    return [i for r in orders.rounds for i in r]


def test_a_dataloader_without_shuffle_keeps_the_datasets_order():
    """``DataLoader(ds, batch_size=b)`` (shuffle=False, its default) trains in the dataset's
    order, as the plain loop over it does; ``shuffle=True`` shuffles; fit(shuffle=) decides
    when given."""
    ds = tiny_data(64)
    assert _order(DataLoader(ds, batch_size=4)) == list(range(64))
    assert _order(DataLoader(ds, batch_size=4, shuffle=False)) == list(range(64))
    shuffled = _order(DataLoader(ds, batch_size=4, shuffle=True))
    assert sorted(shuffled) == list(range(64)) and shuffled != list(range(64))
    assert _order(DataLoader(ds, batch_size=4), shuffle=True) == shuffled  # the fit's seed
    assert _order(DataLoader(ds, batch_size=4, shuffle=True), shuffle=False) == list(range(64))
    assert _order(ds) == shuffled  # a Dataset: shuffled


class MainReads(Dataset):
    """tiny_data that counts the samples read in the process that made it (not in a worker)."""

    def __init__(self, n: int) -> None:
        self.data, self.main_reads = tiny_data(n), 0

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int):
        if torch.utils.data.get_worker_info() is None:
            self.main_reads += 1
        return self.data[i]


def test_an_evaluation_dataloaders_workers_load_its_batches():
    """``eval_dataset=DataLoader(ds, num_workers=2)``: its workers read the samples of every
    evaluation; this process reads only the first batch's check at the start. The results are
    those of the samples read here."""
    test = MainReads(40)
    plan = _compile(TinyNet())
    history = plan.fit(tiny_data(64), 2, eval_dataset=DataLoader(test, batch_size=8, num_workers=2),
                       eval_batch_size=16, **FIT)
    assert len(history.evals) == 2
    assert test.main_reads <= 2 * 4  # the start's checks of a first batch of b; 80 in workers
    acc, loss = plan.evaluate(test.data, batch_size=16)
    assert history.evals[-1].test_accuracy == acc
    assert history.evals[-1].test_loss == pytest.approx(loss, rel=1e-6)


# -- a scheduler stepped between fits ------------------------------------------------------------

def test_a_scheduler_stepped_between_fits_gives_no_false_torch_warning():
    """The simplest port of ``for epoch: train(); sched.step()``: the rounds stepped the
    optimizer, so torch's "lr_scheduler.step() before optimizer.step()" warning (which says the
    schedule's first value is skipped) is false, and does not come; η follows the schedule
    (times SMA's η factor at k = 2: 1 in the first round, √2 once its ramp is done)."""
    plan = _compile(TinyNet(), optimizer=cg.SGD(lr=0.1))
    sched = torch.optim.lr_scheduler.StepLR(plan.optimizer, step_size=1, gamma=0.5)
    lrs = []
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=r".*lr_scheduler\.step\(\).*")
        for _ in range(3):
            history = plan.fit(tiny_data(64), 1, **FIT)
            lrs.append(history.lr[0])
            sched.step()
    assert lrs == pytest.approx([0.1, 0.05 * math.sqrt(2), 0.025 * math.sqrt(2)])


def _collate(samples):
    """A DataLoader's collate_fn of its own (default_collate's result, built by hand)."""
    return torch.stack([x for x, _ in samples]), torch.stack([y for _, y in samples])


def test_a_batchnorm_model_trained_through_a_collate_fn_holds_z():
    """k = 2 learners, BatchNorm and a DataLoader with a collate_fn: z's statistics are
    re-estimated on batches that collate_fn makes, and the model holds them after the fit."""
    torch.manual_seed(0)
    model = TinyBN()
    plan = _compile(model)
    plan.fit(DataLoader(tiny_data(64), batch_size=4, collate_fn=_collate), 1, **FIT)
    z = plan.central_model().state_dict()
    _exactly_equal(model.state_dict(), z)
    assert not torch.equal(z["bn.running_var"], plan.template.bn.running_var)
