"""Settings and data that cannot train get an error of the library's, naming what, where and the
fix, before any round trains on them: at compile, at the start of fit or evaluate, or (a
scheduler's negative lr) at the round it appears; and the CLI's usage errors."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Dataset, TensorDataset

import crossbow_graph as cg
from crossbow_graph import cli
from crossbow_graph.errors import PlanError
from _plans import make_plan

N, B = 32, 4


def _data(n: int = N) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 4, generator=g), torch.randint(0, 3, (n,), generator=g))


def _plan(model: nn.Module | None = None, **kw) -> cg.Plan:
    """The suite's plan (tests/_plans.py) of ``model`` (a linear classifier) on x [N, 4]."""
    kw = {"devices": 1, "replicas": 2, "optimizer": None, **kw}
    return make_plan(model or (lambda: nn.Linear(4, 3)), example=torch.zeros(2, 4), batch_size=B,
                     **kw)


class _Labelled(Dataset):
    """Dict samples whose target is under 'label', not 'labels'."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int):
        return {"x": torch.zeros(4), "label": torch.tensor(i % 3)}


def test_evaluate_checks_its_data_as_fit_does():
    p = _plan()
    message = (r"'s samples are dicts \('x', 'label'\) without a 'labels' entry: a dict sample is "
               r"the model's keyword inputs, and its target, what loss_fn gets, is its 'labels' "
               r"entry; return \(inputs, target\) pairs")
    with pytest.raises(ValueError, match="train_dataset" + message):
        p.fit(_Labelled(), 1, progress=False)
    with pytest.raises(ValueError, match="eval_dataset" + message):
        p.evaluate(_Labelled())
    wide = TensorDataset(torch.zeros(N, 5), torch.zeros(N, dtype=torch.long))
    with pytest.raises(ValueError, match=r"eval_dataset: input 0 \('input'\) of a sample has shape "
                                         r"\[5\], but the plan was compiled for example inputs of "
                                         r"shape \[4\] per sample"):
        p.evaluate(wide)
    assert p.rounds_done == 0


@pytest.mark.parametrize("part, label", [(0, r"input 0 \('input'\) of a sample"),
                                         (1, "the target of a sample")])
def test_data_on_the_meta_device_is_refused_before_any_round(part, label):
    tensors = list(_data().tensors)
    tensors[part] = tensors[part].to("meta")
    p = _plan()
    message = (rf"{{what}}: {label} is a tensor on the meta device \(a shape, \[4.*\] for a batch, "
               r"without data\), which no forward or loss can read; give {what} real tensors")
    with pytest.raises(ValueError, match=message.format(what="train_dataset")):
        p.fit(TensorDataset(*tensors), 1, progress=False)
    with pytest.raises(ValueError, match=message.format(what="eval_dataset")):
        p.evaluate(TensorDataset(*tensors))
    assert p.rounds_done == 0


class _NoTarget(Dataset):
    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int):
        return torch.zeros(4), None


def test_samples_without_a_target_under_a_class_index_loss_are_refused_before_any_round():
    p = _plan()
    with pytest.raises(ValueError, match=r"train_dataset's samples have no target \(None\), but "
                                         r"loss_fn is cross_entropy, which takes class indices; give "
                                         r"\(inputs, label\) pairs, or a loss_fn that needs no target"):
        p.fit(_NoTarget(), 1, progress=False)
    assert p.rounds_done == 0


def test_one_score_per_sample_under_cross_entropy_is_refused_before_any_round():
    p = _plan(nn.Sequential(nn.Linear(4, 1), nn.Flatten(0)))
    with pytest.raises(ValueError, match=r"Sequential's output on a batch has shape \[4\] \(one "
                                         r"score per sample\), but cross_entropy takes class "
                                         r"scores \[N, C\] with class indices \[N\]: for C classes "
                                         r"end the model with C outputs .*binary_cross_entropy_"
                                         r"with_logits\(out, y.float\(\)\)"):
        p.fit(_data(), 1, progress=False)
    assert p.rounds_done == 0


class _Squeezed(nn.Module):
    """Class scores [N, C] that a batch of one squeezes to [C]: the example's output is 1-d."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x):
        return self.lin(x).squeeze()


def test_an_output_squeezed_only_for_a_batch_of_one_trains():
    torch.manual_seed(0)
    p = cg.compile(_Squeezed(), (torch.zeros(1, 4),), F.cross_entropy, batch_size=B, replicas=2)
    p.fit(_data(), 1, progress=False)
    assert p.rounds_done == N // (2 * B)


def test_sparse_data_kept_on_the_device_is_refused_with_the_auto_fix():
    g = torch.Generator().manual_seed(0)
    sparse = TensorDataset(torch.randn(N, 4, generator=g).to_sparse(), torch.zeros(N, dtype=torch.long))
    p = _plan()
    with pytest.raises(ValueError, match=r"data_on_device=True keeps a TensorDataset's tensors on "
                                         r"the device .* but train_dataset holds sparse tensors; "
                                         r"pass data_on_device='auto'"):
        p.fit(sparse, 1, progress=False, data_on_device=True)
    assert p.rounds_done == 0


def test_an_empty_device_list_is_refused():
    with pytest.raises(ValueError, match=r"devices=\[\] names no device; use devices=1 .*'auto', "
                                         r"or a list of names such as \['cpu:0'\]"):
        _plan(devices=[])


def test_replicas_beyond_the_hosts_memory_are_refused_at_compile_with_the_arithmetic():
    # 1.25 M float32 parameters: 100,000 replicas' parameters, gradients and optimizer rows
    # are 100,000 × 15 MB = 1.5 TB
    with pytest.raises(PlanError, match=r"replicas=100,000: 100,000 replicas × 14.3 MiB of state "
                                        r"per learner \(params 4.77 \+ grads 4.77 \+ optimizer "
                                        r"4.77 MiB\) \+ 14.3 MiB of the device's central model \+ "
                                        r"[\d.]+ MiB for one learner's step at batch 4 = "
                                        r"1,430,5\d\d MiB, more than the [\d,]+ MiB this machine "
                                        r"has available; at most [\d,]+ replicas per device fit: "
                                        r"lower replicas to [\d,]+ or fewer"):
        _plan(nn.Linear(4, 250_000), replicas=100_000)


def test_the_largest_number_of_replicas_the_host_fits_is_the_one_the_message_gives():
    graph = _plan(nn.Linear(4, 250_000), replicas=1).model_graph
    budget = 200 * 2**20
    with pytest.raises(PlanError, match=r"at most (\d+) replicas per device fit") as refused:
        cg.build.check_host_memory(graph, ["cpu:0"], 100, B, budget)
    fit = int(refused.value.args[0].split("at most ")[1].split(" ")[0])
    assert fit > 1
    cg.build.check_host_memory(graph, ["cpu:0"], fit, B, budget)  # fits
    with pytest.raises(PlanError, match=rf"at most {fit} replicas"):
        cg.build.check_host_memory(graph, ["cpu:0"], fit + 1, B, budget)
    with pytest.raises(PlanError, match=r"2 CPU devices, each .* available per device"):
        cg.build.check_host_memory(graph, ["cpu:0", "cpu:1"], fit, B, budget)


@pytest.mark.parametrize("interval", ["epoch", "round"])
def test_a_scheduler_that_sets_a_negative_lr_stops_the_fit_at_that_round(interval):
    p = _plan(optimizer=cg.SGD(lr=0.1))
    # η < 0 from step 2: after epoch 2 (4 rounds an epoch), or after round 1 (rounds 0, 1 ran)
    rounds = {"epoch": 8, "round": 2}[interval]
    sched = torch.optim.lr_scheduler.LambdaLR(p.optimizer, lambda step: 1.0 - 0.75 * step)
    with pytest.raises(ValueError, match=rf"lr_scheduler LambdaLR set lr=-0.05 for param group 0 "
                                         rf"at its step \d, before round {rounds} \(epoch \d\): a "
                                         r"negative learning rate climbs the loss; make the "
                                         r"schedule's factor ≥ 0 at every step"):
        p.fit(_data(), 3, progress=False, lr_scheduler=sched, lr_scheduler_interval=interval)
    assert p.rounds_done == rounds  # no round trained at η < 0


def test_a_scheduler_negative_from_its_start_stops_the_fit_before_round_0():
    p = _plan(optimizer=cg.SGD(lr=0.1))
    sched = torch.optim.lr_scheduler.LambdaLR(p.optimizer, lambda step: -1.0)
    with pytest.raises(ValueError, match=r"LambdaLR set lr=-0.1 for param group 0 at its step 0, "
                                         r"before round 0"):
        p.fit(_data(), 1, progress=False, lr_scheduler=sched)
    assert p.rounds_done == 0


@pytest.mark.parametrize("epochs", ["0", "-1", "two"])
def test_cli_epochs_below_one_is_a_usage_error(epochs, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["train", "--epochs", epochs, "--quiet"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "argument --epochs:" in err and ("must be a whole number ≥ 1" in err
                                            or "give a whole number of epochs" in err)
