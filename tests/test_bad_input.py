"""Every bad input a user can give gets an error that says what, where, and how to fix it."""

from __future__ import annotations

import functools
import os
import pickle
import re

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset

import crossbow_graph as cg
from crossbow_graph import cli, datasets
from crossbow_graph.errors import PlanError, TaskError, TraceError
from crossbow_graph.training.hooks import Hook
from crossbow_graph.training.options import FitOptions

from _fake_cifar import write_fake_cifar
from _plans import make_plan

F = nn.functional


def tiny(classes: int = 3) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(4, classes))


# the plans of these tests: the tiny linear model on x [N, 4], 2 replicas on one device, compile's optimizer
plan = functools.partial(make_plan, model=tiny, seed=None, example=torch.zeros(1, 4), optimizer=None,
                         devices=1, replicas=2)


def ds(n: int = 32, features: tuple[int, ...] = (4,), classes: int = 3) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, *features, generator=g), torch.randint(0, classes, (n,), generator=g))


# -- data against the plan (checked once, on the first batch) -------------------------------

def test_example_input_that_does_not_match_the_data():
    with pytest.raises(ValueError, match=r"input 0 \('input'\) of a sample has shape \[2, 4\], but the plan "
                                         r"was compiled for example inputs of shape \[4\] per sample, and the "
                                         r"model fails on them \(RuntimeError: .*unsqueeze\(0\)"):
        plan().fit(ds(features=(2, 4)), 1, progress=False)
    # runs, but each sample gives 2 × 3 scores instead of 3
    lin = nn.Linear(4, 3)
    with pytest.raises(ValueError, match=r"output per sample would be \[2, 3\] instead of \[3\]"):
        plan(model=lin).fit(ds(features=(2, 4)), 1, progress=False)


def test_other_input_shapes_that_the_model_takes_are_accepted():
    torch.manual_seed(0)
    pooled = nn.Sequential(nn.Conv2d(1, 3, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten())
    p = plan(model=pooled, example=torch.zeros(1, 1, 8, 8))
    h = p.fit(ds(features=(1, 12, 12)), 1, progress=False)  # 12×12 images: same [3] output
    assert p.rounds_done > 0 and all(torch.isfinite(torch.tensor(e.train_loss)) for e in h.epochs)


class _CastsToFloat32(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        return self.fc(x.float())


@pytest.mark.parametrize("model_dtype,data_dtype,fix", [
    (torch.float64, torch.float32, r"cast the data to torch.float64 \(e.g. TensorDataset\(x.double\(\), y\)\), "
                                   r"or compile the model in float32 \(model.float\(\)"),
    (torch.float32, torch.float64, r"cast the data to torch.float32 \(e.g. TensorDataset\(x.float\(\), y\)\), "
                                   r"or compile the model in float64 \(model.double\(\)"),
])
def test_data_of_another_dtype_than_the_model(model_dtype, data_dtype, fix):
    p = plan(model=tiny().to(model_dtype), example=torch.zeros(1, 4, dtype=model_dtype))
    before = p.central_weights()
    train = ds()
    train = TensorDataset(train.tensors[0].to(data_dtype), train.tensors[1])
    with pytest.raises(ValueError, match=rf"train_dataset: input 0 \('input'\) is {data_dtype}, but the "
                                         rf"plan was compiled for example inputs of {model_dtype} \(the "
                                         rf"model's parameters are {model_dtype}\), and the model fails "
                                         rf"on .* inputs \(RuntimeError: .*\); {fix}"):
        p.fit(train, 1, progress=False)
    assert p.rounds_done == 0 and torch.equal(p.central_weights(), before)  # before any round
    p.fit(TensorDataset(train.tensors[0].to(model_dtype), train.tensors[1]), 1, progress=False)
    # a model that casts its inputs takes the other dtype
    torch.manual_seed(0)
    plan(model=_CastsToFloat32()).fit(TensorDataset(train.tensors[0].double(), train.tensors[1]), 1,
                                      progress=False)


def test_example_input_that_does_not_run_through_the_model():
    with pytest.raises(TraceError) as err:
        plan(example=torch.zeros(1, 7))
    message = str(err.value)
    assert "example inputs" in message and "do not run through Sequential" in message
    assert "Pass example_inputs=(x,) with x one batch shaped like the training data" in message


def test_empty_dataset():
    with pytest.raises(ValueError, match=r"train_dataset is empty \(0 samples\)"):
        plan().fit(TensorDataset(torch.zeros(0, 4), torch.zeros(0, dtype=torch.long)), 1)


def test_dataset_smaller_than_one_round():
    with pytest.raises(ValueError, match=r"train_dataset has 7 samples, fewer than one round of 2 learners × "
                                         r"4 samples = 8; lower the batch size or the replicas"):
        plan().fit(ds(7), 1)


def test_labels_outside_the_model_classes():
    data = ds()
    data.tensors[1][20] = 12  # not in the first batch: every label of a tensor dataset is checked
    with pytest.raises(ValueError, match=r"label 12, outside the model's 3 classes \[0, 2\].*num_classes=13"):
        plan().fit(data, 1, progress=False)
    data.tensors[1][20] = -1
    with pytest.raises(ValueError, match=r"label -1, outside.*remap the labels"):
        plan().fit(data, 1, progress=False)


class PairList(Dataset):
    def __init__(self, pairs):
        self.pairs = pairs

    def __len__(self):
        return len(self.pairs)

    def __getitem__(self, i):
        return self.pairs[i]


def test_labels_outside_classes_in_a_generic_dataset_first_batch():
    pairs = [(torch.randn(4), 5 if i == 1 else 0) for i in range(16)]
    with pytest.raises(ValueError, match=r"label 5, outside the model's 3 classes"):
        plan().fit(PairList(pairs), 1, progress=False, shuffle=False)


def test_loss_that_is_not_a_scalar():
    bad = lambda out, y: F.cross_entropy(out, y, reduction="none")  # noqa: E731
    with pytest.raises(TaskError, match=r"task 'learn.*' \(LEARN on cpu:0\) failed in round 0: ValueError: "
                                        r"loss_fn must return a scalar tensor, got a tensor of shape \[4\]; "
                                        r"reduce it over the batch, e.g. with reduction='mean'"):
        plan(loss_fn=bad).fit(ds(), 1, progress=False)
    with pytest.raises(TypeError, match="loss_fn must be callable"):
        plan(loss_fn="cross_entropy")
    with pytest.raises(TypeError, match=r"loss_fn=nn.CrossEntropyLoss is a class, not a loss: pass an "
                                        r"instance: nn.CrossEntropyLoss\(\)"):
        plan(loss_fn=nn.CrossEntropyLoss)


def test_labels_are_only_checked_for_class_index_losses():
    """Integer targets of other losses are not class indices (e.g. regression on counts)."""
    data = ds()
    data.tensors[1][3] = 7
    plan(loss_fn=lambda out, y: (out.sum(1) - y).pow(2).mean()).fit(data, 1, progress=False)
    data.tensors[1][3] = -100  # cross_entropy's ignore_index
    plan().fit(data, 1, progress=False)
    data.tensors[1][3] = 7
    with pytest.raises(ValueError, match="label 7"):
        plan(loss_fn=nn.CrossEntropyLoss()).fit(data, 1, progress=False)


class RoundCounter(Hook):
    def __init__(self) -> None:
        self.rounds = 0

    def after_round(self, ctx) -> None:
        self.rounds += 1


def fails_before_training(error, pattern, data=None, p=None, **fit):
    """fit raises ``error`` matching ``pattern`` and no training round ran."""
    p = p or plan()
    counter = RoundCounter()
    with pytest.raises(error, match=pattern):
        p.fit(ds() if data is None else data, 1, progress=False, hooks=[counter], **fit)
    assert counter.rounds == 0 and p.rounds_done == 0


# -- fit's arguments (checked before the first round) --------------------------------------

@pytest.mark.parametrize("target, guess", [(2.0, ""), (99, r"; did you mean 0.99\?"), (0, ""),
                                           (-0.5, "")])
def test_target_accuracy_outside_zero_one(target, guess):
    fails_before_training(ValueError, rf"target_accuracy={target!r}: must be a fraction in \(0, 1\].*"
                                      rf"e.g. 0.99{guess}$",
                          eval_dataset=ds(8), target_accuracy=target)


@pytest.mark.parametrize("evals", [0, -1, 1.5])
def test_evals_per_epoch_not_a_positive_integer(evals):
    fails_before_training(ValueError, rf"evals_per_epoch={evals!r}: must be an integer ≥ 1",
                          eval_dataset=ds(8), evals_per_epoch=evals)


def test_eval_batch_size_not_a_positive_integer():
    fails_before_training(ValueError, r"eval_batch_size=0: must be an integer ≥ 1, e.g. 1000",
                          eval_dataset=ds(8), eval_batch_size=0)


def test_seed_not_an_integer():
    fails_before_training(TypeError, r"seed=0.5: must be an integer, e.g. seed=0", seed=0.5)


def test_epochs_resume_and_target_without_what_they_need():
    p = plan()
    with pytest.raises(ValueError, match=r"epochs=0: must be an integer ≥ 1"):
        p.fit(ds(), 0, progress=False)
    assert p.rounds_done == 0
    fails_before_training(ValueError, r"resume=True needs checkpoint_dir", resume=True)
    fails_before_training(ValueError, r"target_accuracy needs an eval_dataset", target_accuracy=0.9)


def test_fit_options_are_checked_when_built():
    """The options Plan.fit trains with fail when they are built, with fit's messages."""
    with pytest.raises(TypeError, match=r"seed=0.5: must be an integer, e.g. seed=0"):
        FitOptions(seed=0.5)
    with pytest.raises(ValueError, match=r"eval_batch_size=0: must be an integer ≥ 1"):
        FitOptions(eval_batch_size=0)
    options = FitOptions(epochs=2, hooks=[RoundCounter()], policies=[])
    assert isinstance(options.hooks, tuple) and options.policies == ()


def test_eval_dataset_that_does_not_fit_the_model():
    """Checked at the start like the training set, not after training up to the first evaluation."""
    fails_before_training(ValueError, r"eval_dataset: input 0 \('input'\) of a sample has shape \[5\], "
                                      r"but the plan was compiled for .* shape \[4\].*give eval_dataset "
                                      r"samples shaped like the training data's",
                          eval_dataset=ds(8, features=(5,)))
    fails_before_training(ValueError, r"eval_dataset has label \d, outside the model's 3 classes.*"
                                      r"num_classes=7", eval_dataset=ds(40, classes=7))


class Items(Dataset):
    def __init__(self, item, n: int = 32, readable: int | None = None):
        self.item, self.n, self.readable = item, n, n if readable is None else readable

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i >= self.readable:
            raise IndexError(f"index {i} out of range")
        return self.item(i)


@pytest.mark.parametrize("item, what", [(lambda i: None, "None"),
                                        (lambda i: torch.randn(4), r"a Tensor of shape \[4\]"),
                                        (lambda i: (torch.randn(4), 0, 1), "a tuple of 3 items")])
def test_sample_that_is_not_an_inputs_target_pair(item, what):
    fails_before_training(ValueError, rf"train_dataset\[\d+\] is {what}, not an \(inputs, target\) "
                                      r"pair; make __getitem__ return a pair", data=Items(item))


def test_a_none_sample_past_the_first_batch_names_its_index():
    """Only the first batch and the last index are read before round 0; a None sample found later
    fails that round with an error naming the index (default_collate's names neither)."""
    data = Items(lambda i: None if i == 20 else (torch.randn(4), i % 3))
    with pytest.raises(TaskError, match=r"sample 20 is None, not an \(inputs, target\) pair"):
        plan().fit(data, 1, progress=False, shuffle=False)


@pytest.mark.parametrize("fit, error, pattern", [
    (dict(shuffle="yes"), TypeError, r"shuffle='yes': must be True or False"),
    (dict(checkpoint_every=5), ValueError, r"checkpoint_every=5 needs checkpoint_dir"),
    (dict(trace="/proc/no-such-folder/run.json"), ValueError,
     r"trace='/proc/no-such-folder/run.json': its folder '/proc/no-such-folder' does not exist"),
    (dict(policies=[cg.AdaptiveBatchSize]), TypeError,
     r"AdaptiveBatchSize is a class, not a hook: pass an instance"),
], ids=["shuffle", "checkpoint_every", "trace", "policy-class"])
def test_more_fit_options_that_fail_before_training(fit, error, pattern):
    fails_before_training(error, pattern, **fit)


def test_one_hook_not_in_a_list_a_log_dir_that_is_a_file_and_progress_not_a_bool(tmp_path):
    with pytest.raises(TypeError, match=r"hooks=.*: pass a list of hooks, e.g. hooks=\[RoundCounter"):
        plan().fit(ds(), 1, progress=False, hooks=RoundCounter())
    (tmp_path / "f").write_text("")
    fails_before_training(ValueError, r"log_dir='.*f' is a file, not a directory", log_dir=str(tmp_path / "f"))
    with pytest.raises(TypeError, match=r"progress='no': must be True or False"):
        plan().fit(ds(), 1, progress="no")


@pytest.mark.parametrize("model, pattern", [
    ("lenet5", r"compile\(\) takes an nn.Module as model, got str 'lenet5' \(a zoo name: build it "
               r"with cg.models.get_model\(name\)\)"),
    (cg.models.lenet5, r"got function .* \(a factory: call it, e.g. cg.models.lenet5\(\)\)"),
], ids=["name", "factory"])
def test_compile_a_model_that_is_not_a_module(model, pattern):
    with pytest.raises(TypeError, match=pattern):
        cg.compile(model, (torch.zeros(1, 1, 28, 28),), F.cross_entropy, batch_size=4)


def test_memory_budget_not_an_integer_and_cuda_without_a_gpu():
    with pytest.raises(TypeError, match=r"memory_budget='1GB': bytes per device as an integer"):
        plan(memory_budget="1GB")
    if torch.cuda.device_count() == 0:
        with pytest.raises(ValueError, match=r"devices='cuda': this machine has no CUDA GPU"):
            plan(devices="cuda")


def test_negative_labels_get_the_ignore_index_fix():
    data = TensorDataset(torch.randn(32, 4), torch.tensor([-1, 0, 1, 2] * 8))
    fails_before_training(ValueError, r"has label -1, .*remap the labels to 0 … 2, or mark the ones "
                                      r"to skip with the loss's ignore_index \(-100\)", data=data)


def test_len_larger_than_the_data():
    data = Items(lambda i: (torch.randn(4), i % 3), n=32, readable=20)
    fails_before_training(ValueError, r"train_dataset\[31\] fails \(IndexError: index 31 out of range\); "
                                      r"train_dataset says len\(\) = 32: make __len__ return the number",
                          data=data, shuffle=False)  # the first rounds would read only 0 … 19


def test_float_class_index_labels():
    x, y = ds().tensors
    fails_before_training(ValueError, r"train_dataset's labels are torch.float32 of shape \[4\]: "
                                      r"cross_entropy reads float labels as class probabilities of shape "
                                      r"\[N, 3\].*convert them: y.long\(\)",
                          data=TensorDataset(x, y.float()))
    fails_before_training(ValueError, r"labels are torch.int32 .*convert them: y.long\(\)",
                          data=TensorDataset(x, y.int()))
    # float class probabilities [N, C] are cross_entropy's soft labels: accepted
    plan().fit(TensorDataset(x, F.one_hot(y, 3).float()), 1, progress=False)


def test_labels_of_shape_n_1():
    x, y = ds().tensors
    fails_before_training(ValueError, r"train_dataset's labels are torch.int64 of shape \[4, 1\], but "
                                      r"cross_entropy takes class indices of shape \[N\]; squeeze the "
                                      r"labels: y.squeeze\(1\)", data=TensorDataset(x, y[:, None]))


def test_checkpoint_dir_that_is_a_file_or_not_writable(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("")
    fails_before_training(ValueError, rf"checkpoint_dir='{re.escape(str(afile))}' is a file, not a directory",
                          checkpoint_dir=str(afile))
    fails_before_training(ValueError, rf"checkpoint_dir='{re.escape(str(afile / 'sub'))}' cannot be created "
                                      r"\(NotADirectoryError: .*\); pass a writable directory",
                          checkpoint_dir=str(afile / "sub"))


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc")
def test_checkpoint_dir_that_exists_but_is_not_writable():
    """/proc: a directory in which nobody, root included, can create a file."""
    fails_before_training(ValueError, r"checkpoint_dir='/proc' is not writable: creating a file in it "
                                      r"fails .*; pass a writable directory", checkpoint_dir="/proc")


# -- the model ----------------------------------------------------------------------------

def test_model_on_the_meta_device():
    with torch.device("meta"):
        model = nn.Sequential(nn.Flatten(), nn.Linear(4, 3))
    with pytest.raises(ValueError, match=r"model's parameter '1.weight' is on the meta device.*"
                                         r"model.to_empty\(device='cpu'\) and load weights"):
        plan(model=model)


def test_batch_norm_with_one_value_per_channel():
    torch.manual_seed(0)
    bn1d = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
    with pytest.raises(ValueError, match=r"batch_size=1 with BatchNorm1d '1', which normalises inputs of "
                                         r"shape \[1, 3\].*use batch_size ≥ 2, or GroupNorm/LayerNorm"):
        plan(model=bn1d, batch_size=1)
    plan(model=bn1d, batch_size=2).fit(ds(), 1, progress=False)
    # BatchNorm2d over 4×4 maps has 16 values per channel at b = 1: it trains
    bn2d = nn.Sequential(nn.Conv2d(1, 2, 3, padding=1), nn.BatchNorm2d(2), nn.Flatten(), nn.Linear(32, 3))
    p = plan(model=bn2d, example=torch.zeros(1, 1, 4, 4), batch_size=1)
    p.fit(ds(features=(1, 4, 4)), 1, progress=False)
    assert p.rounds_done == 16


def test_model_without_parameters():
    with pytest.raises(ValueError, match="ReLU has no parameters: there is nothing to train"):
        plan(model=nn.ReLU())


class IntParam(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.steps = nn.Parameter(torch.zeros(1, dtype=torch.long), requires_grad=False)

    def forward(self, x):
        return self.fc(x)


def test_model_with_integer_parameters():
    with pytest.raises(ValueError, match=r"parameter 'steps' of IntParam has dtype torch.int64.*register "
                                         r"integer tensors as buffers"):
        plan(model=IntParam())


def test_model_with_only_frozen_parameters():
    model = tiny()
    model.requires_grad_(False)
    with pytest.raises(ValueError, match="every parameter of Sequential is frozen"):
        plan(model=model)


# -- the plan's arguments -----------------------------------------------------------------

@pytest.mark.parametrize("b", [0, -3, 2.5, True])
def test_batch_size_not_positive(b):
    with pytest.raises(ValueError, match=rf"batch_size={b!r}: must be a positive integer, e.g. 16"):
        plan(batch_size=b)


def test_more_devices_or_replicas_than_exist_or_fit():
    with pytest.raises(ValueError, match=r"device 'cuda:0' does not exist: this machine has 0 CUDA GPUs"):
        plan(devices=["cuda:0"])
    with pytest.raises(ValueError, match="devices=0: need at least one device"):
        plan(devices=0)
    with pytest.raises(ValueError, match=r"device 'tpu:0': use 'cpu:N'"):
        plan(devices=["tpu:0"])
    with pytest.raises(ValueError, match=r"replicas=0: replicas per device must be an integer ≥ 1"):
        plan(replicas=0)
    with pytest.raises(PlanError, match=r"2 replicas × .* MiB per learner \(params .*\) = .* MiB exceed the "
                                        r".* MiB budget of cpu:0 .*not even one replica fits"):
        plan(memory_budget=64)


@pytest.mark.parametrize("make, pattern", [
    (lambda: cg.SGD(lr="0.1"), r"SGD\(lr='0.1'\): must be a number, got str; e.g. lr=0.1"),
    (lambda: cg.SGD(momentum=None), r"SGD\(momentum=None\): must be a number, got NoneType"),
    (lambda: cg.SGD(weight_decay="1e-4"), r"SGD\(weight_decay='1e-4'\): must be a number.*weight_decay=0.0001"),
    (lambda: cg.SGD(nesterov="no"), r"SGD\(nesterov='no'\): must be True or False"),
    (lambda: cg.SMA(alpha="0.5"), r"SMA\(alpha='0.5'\): must be a number, got str; e.g. alpha=0.5"),
    (lambda: cg.SMA(central_momentum=[0.9]), r"SMA\(central_momentum=\[0.9\]\): must be a number, got list"),
])
def test_optimizer_and_sync_settings_that_are_not_numbers(make, pattern):
    with pytest.raises(TypeError, match=pattern):
        make()


@pytest.mark.parametrize("tau", [True, 1.0, "2"])
def test_sync_every_not_an_integer(tau):
    with pytest.raises(ValueError, match=rf"SMA\(sync_every={tau!r}\): must be an integer ≥ 1"):
        cg.SMA(sync_every=tau)


# -- the command line ---------------------------------------------------------------------

def test_cli_unknown_model_and_dataset(capsys):
    assert cli.main(["train", "--model", "resnet9000", "--quiet"]) == 2
    assert "unknown model 'resnet9000'; the zoo has: lenet5" in capsys.readouterr().err
    assert cli.main(["train", "--dataset", "imagenet", "--quiet"]) == 2
    assert "unknown dataset 'imagenet'; choose one of: mnist, fashion_mnist, cifar10" in capsys.readouterr().err
    assert cli.main(["train", "--dataset", "cifar10", "--quiet"]) == 2
    assert "--dataset cifar10 needs --data-dir DIR" in capsys.readouterr().err


def test_cli_missing_cifar_dir(tmp_path, capsys):
    assert cli.main(["train", "--dataset", "cifar10", "--data-dir", str(tmp_path / "nope"), "--quiet"]) == 2
    assert f"CIFAR-10 directory {tmp_path / 'nope'} does not exist" in capsys.readouterr().err


# -- CIFAR-10 directories -----------------------------------------------------------------

def test_cifar_directory_missing(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"does not exist; download cifar-10-python.tar.gz"):
        datasets.cifar10(str(tmp_path / "missing"))


def test_cifar_directory_lacking_files(tmp_path):
    write_fake_cifar(str(tmp_path))
    os.remove(tmp_path / "data_batch_3")
    os.remove(tmp_path / "batches.meta")
    with pytest.raises(FileNotFoundError, match=r"lacks data_batch_3, batches.meta; it must be the unpacked "
                                                r"cifar-10-batches-py folder"):
        datasets.cifar10(str(tmp_path))


def _rewrite(path, obj) -> None:
    with open(path, "wb") as f:
        pickle.dump(obj, f)


def test_cifar_directory_malformed(tmp_path):
    root = str(tmp_path)
    write_fake_cifar(root)
    batch = os.path.join(root, "test_batch")
    with open(batch, "wb") as f:
        f.write(b"\x00garbage")
    with pytest.raises(ValueError, match=r"test_batch cannot be read as a pickled batch.*python version"):
        datasets.cifar10(root, train=False)
    _rewrite(batch, {b"images": np.zeros((2, 3072), np.uint8)})
    with pytest.raises(ValueError, match=r"test_batch is not a batch dict with b'data' and b'labels'"):
        datasets.cifar10(root, train=False)
    _rewrite(batch, {b"data": np.zeros((2, 1024), np.uint8), b"labels": [0, 1]})
    with pytest.raises(ValueError, match=r"b'data' must be uint8 \[N, 3072\].*got uint8 \[2, 1024\]"):
        datasets.cifar10(root, train=False)
    _rewrite(batch, {b"data": np.zeros((2, 3072), np.uint8), b"labels": [0, 1, 2]})
    with pytest.raises(ValueError, match=r"2 images but 3 labels"):
        datasets.cifar10(root, train=False)
    _rewrite(batch, {b"data": np.zeros((2, 3072), np.uint8), b"labels": [0, 10]})
    with pytest.raises(ValueError, match=r"labels range over \[0, 10\], CIFAR-10 has classes 0–9"):
        datasets.cifar10(root, train=False)


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_cifar_pickle_cannot_run_code(tmp_path):
    root = str(tmp_path)
    write_fake_cifar(root)
    _rewrite(os.path.join(root, "test_batch"), {b"data": _Evil(), b"labels": []})
    with pytest.raises(ValueError, match=r"refusing to unpickle posix.system"):
        datasets.cifar10(root, train=False)


def test_cli_unreadable_checkpoint_is_one_line_and_exit_2(tmp_path, capsys):
    (tmp_path / "ckpt-0000000001.pt").write_bytes(b"garbage")
    argv = ["train", "--train-samples", "64", "--test-samples", "10", "--quiet", "--batch-size", "16",
            "--checkpoint-dir", str(tmp_path), "--resume"]
    assert cli.main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()  # the skipped file's warning, the error
    assert lines[-1].startswith("crossbow-graph train: error: no checkpoint in")
    assert "is truncated: 7 bytes" in lines[-1]
    assert [line for line in lines if "error" in line] == lines[-1:]


# -- gradient clipping (fit's max_grad_norm) ------------------------------------------------

@pytest.mark.parametrize("norm, error, pattern", [
    (0, ValueError, r"max_grad_norm=0: must be a positive finite number, e.g. max_grad_norm=1.0; "
                    r"pass None \(the default\) for no clipping"),
    (-1.0, ValueError, r"max_grad_norm=-1.0: must be a positive finite number"),
    (float("inf"), ValueError, r"max_grad_norm=inf: must be a positive finite number"),
    (float("nan"), ValueError, r"max_grad_norm=nan: must be a positive finite number"),
    ("1.0", TypeError, r"max_grad_norm='1.0': must be a positive number, the largest 2-norm of a "
                       r"learner's gradient, e.g. max_grad_norm=1.0, or None \(no clipping\)"),
    (True, TypeError, r"max_grad_norm=True: must be a positive number"),
    (torch.tensor(1.0), TypeError, r"max_grad_norm=tensor\(1.\): must be a positive number"),
], ids=["zero", "negative", "inf", "nan", "string", "bool", "tensor"])
def test_max_grad_norm_not_a_positive_finite_number(norm, error, pattern):
    fails_before_training(error, pattern, max_grad_norm=norm)


# -- compile's tracing arguments and flags (checked before any tracing) ----------------------

def _never_traced(monkeypatch):
    """compile must refuse before it traces: tracing fails the test."""
    def trace(*args, **kwargs):
        raise AssertionError("compile traced the model before refusing its arguments")
    monkeypatch.setattr("crossbow_graph.build.trace_model", trace)


NOT_A_BOOL = r"must be True or False \(a string is not a bool: any non-empty string, 'no' and 'False' too, counts as True\)"


@pytest.mark.parametrize("kw, error, pattern", [
    (dict(concrete_args=[1]), TypeError,
     r"concrete_args=\[1\]: must be a dict of forward argument names to fixed values, as torch.fx "
     r"takes it, e.g. concrete_args=\{'mask': None\}, or None"),
    (dict(concrete_args={"maks": None}), ValueError,
     r"concrete_args=\{'maks': ...\}: 'maks' is not an argument of Sequential.forward\(input\); "
     r"name one of its arguments \['input'\], or drop it"),
    (dict(leaf_modules=nn.Linear), TypeError,
     r"leaf_modules=nn.Linear: must be a list of module classes, e.g. leaf_modules=\[nn.Linear\]"),
    (dict(leaf_modules=["Linear"]), TypeError,
     r"leaf_modules=\['Linear'\]: 'Linear' is a class name: torch.fx picks leaf modules by class, "
     r"not by name; e.g. leaf_modules=\[nn.Linear\]"),
    (dict(leaf_modules=[nn.Flatten()]), TypeError,
     r"leaf_modules=\[Flatten\(.*\)\]: Flatten\(.*\) is a module instance: pass its class; e.g. "
     r"leaf_modules=\[nn.Flatten\]"),
    (dict(leaf_modules=[int]), TypeError, r"builtins.int is not an nn.Module class"),
    (dict(strict_trace="no"), TypeError, rf"strict_trace='no': {NOT_A_BOOL}"),
    (dict(verify="yes"), TypeError, rf"verify='yes': {NOT_A_BOOL}"),
    (dict(cuda_graphs=1), TypeError, r"cuda_graphs=1: must be True or False$"),
    (dict(example=torch.zeros(1, 4, device="meta")), ValueError,
     r"example_inputs\[0\] is a tensor of shape \[1, 4\] on the meta device \(no data\), which no "
     r"forward can run; pass real tensors, one batch shaped like the training data, e.g. "
     r"example_inputs=\(train_dataset\[0\]\[0\].unsqueeze\(0\),\)"),
], ids=["concrete-list", "concrete-key", "leaf-class-alone", "leaf-name", "leaf-instance",
        "leaf-not-module", "strict-str", "verify-str", "cuda-graphs-int", "meta-input"])
def test_compile_refuses_bad_tracing_arguments_before_tracing(monkeypatch, kw, error, pattern):
    _never_traced(monkeypatch)
    with pytest.raises(error, match=pattern):
        plan(**kw)


def test_keyword_example_input_on_meta_and_autotune_flags_are_refused(monkeypatch):
    _never_traced(monkeypatch)
    with pytest.raises(ValueError, match=r"example_inputs\['input'\] is a tensor of shape \[1, 4\] "
                                         r"on the meta device"):
        cg.compile(tiny(), {"input": torch.zeros(1, 4, device="meta")}, F.cross_entropy,
                   batch_size=4)
    with pytest.raises(TypeError, match=rf"AutoTune\(reprobe='no'\): {NOT_A_BOOL}"):
        cg.AutoTune(reprobe="no")


@pytest.mark.parametrize("strict", [False, True])
def test_example_inputs_that_do_not_run_raise_the_public_trace_error(strict):
    """What leaves compile is crossbow_graph.TraceError itself (a ValueError), not a private
    subclass, with the message and its cause."""
    with pytest.raises(TraceError, match=r"do not run through Sequential") as err:
        plan(example=torch.zeros(1, 7), strict_trace=strict)
    assert type(err.value) is TraceError and isinstance(err.value, ValueError)
    assert isinstance(err.value.__cause__, RuntimeError)


# -- a checkpoint_dir another fit uses, or another run's checkpoints ------------------------------

def test_checkpoint_dir_in_use_by_another_fit(tmp_path):
    """The directory's lock held (as by a fit in another process): refused before any round,
    naming the directory, the holder and the fix."""
    from crossbow_graph.training.run_lock import DirectoryLock

    with DirectoryLock(str(tmp_path)):
        fails_before_training(cg.CheckpointError, rf"checkpoint_dir='{re.escape(str(tmp_path))}' is "
                                                  rf"in use by another fit \(pid {os.getpid()} on .* "
                                                  r"since .*\); .*Pass another checkpoint_dir, or wait "
                                                  r"until that fit ends", checkpoint_dir=str(tmp_path))
    plan().fit(ds(), 1, progress=False, checkpoint_dir=str(tmp_path))  # released


def test_checkpoint_dir_with_another_runs_checkpoints_and_resume_false(tmp_path):
    plan().fit(ds(), 1, progress=False, checkpoint_dir=str(tmp_path))
    fails_before_training(cg.CheckpointError, r"holds 1 checkpoint\(s\) of another run \(the newest "
                                              r"ckpt-0000000004\.pt\) and resume=False: .*Pass "
                                              r"resume=True to continue that run, another "
                                              r"checkpoint_dir for a new one, or delete its "
                                              r"ckpt-\*\.pt files", checkpoint_dir=str(tmp_path))


# -- the shape of the data: samples, datasets, hooks (before round 0) ------------------------

class _Samples(Dataset):
    """32 samples made by ``make(i)``."""

    def __init__(self, make) -> None:
        self.make = make

    def __len__(self) -> int:
        return 32

    def __getitem__(self, i: int):
        return self.make(i)


@pytest.mark.parametrize("make, message", [
    (lambda i: {"x": torch.zeros(4), "y": torch.tensor(i % 3)},
     r"train_dataset's samples are dicts \('x', 'y'\) without a 'labels' entry: a dict sample is "
     r"the model's keyword inputs, and its target, what loss_fn gets, is its 'labels' entry; "
     r"return \(inputs, target\) pairs such as \(x, y\)"),
    (lambda i: {"x": torch.zeros(4), "labels": torch.tensor(i % 3)},
     r"train_dataset's samples are dicts \('x', 'labels'\) of keyword inputs, all passed, the "
     r"'labels' entry too, to Sequential.forward\(input\) by name, which takes no 'x', 'labels'; "
     r"return \(inputs, target\) pairs"),
    (lambda i: ({"x": torch.zeros(4)}, i % 3),
     r"pairs whose inputs are dicts \('x'\) of keyword inputs, all passed to "
     r"Sequential.forward\(input\) by name, which takes no 'x'"),
    (lambda i: ("a cat on a mat", i % 3),
     r"train_dataset: input 0 \('input'\) of a sample is a str \('a cat on a mat'\), but the model "
     r"takes a tensor there \(compiled for example inputs of shape \[4\] per sample\); turn the "
     r"text into tensors first: token ids from a tokenizer"),
    (lambda i: (torch.zeros(4), "cat"),
     r"train_dataset: the target of a sample is a str \('cat'\), but loss_fn takes tensors; map "
     r"the class names to integer class indices"),
])
def test_samples_the_model_cannot_take_are_clear_errors_before_round_0(make, message):
    p = plan()
    with pytest.raises(ValueError, match=message):
        p.fit(_Samples(make), 1, progress=False)
    assert p.rounds_done == 0


def test_a_dict_sample_with_labels_for_a_model_that_takes_them_trains():
    class Named(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = tiny()

        def forward(self, x, labels=None):
            return self.net(x)

    p = cg.compile(Named(), {"x": torch.zeros(1, 4)}, F.cross_entropy, batch_size=4, devices=1,
                   replicas=1)
    p.fit(_Samples(lambda i: {"x": torch.zeros(4), "labels": torch.tensor(i % 3)}), 1,
          progress=False)
    assert p.rounds_done == 8


@pytest.mark.parametrize("data, message", [
    (lambda x, y: (x, y), r"train_dataset is a tuple of 2 tensors \(\[32, 4\], \[32\]\), not a "
                          r"Dataset; wrap it: TensorDataset\(X, Y\)"),
    (lambda x, y: [x, y], r"train_dataset is a list of 2 tensors"),
    (lambda x, y: x, r"train_dataset is a Tensor of shape \[32, 4\], not a Dataset of \(inputs, "
                     r"target\) samples; wrap it with its targets: TensorDataset\(X, Y\)"),
])
def test_tensors_given_as_a_dataset_are_a_clear_error(data, message):
    x, y = ds().tensors
    p = plan()
    with pytest.raises(TypeError, match=message):
        p.fit(data(x, y), 1, progress=False)
    with pytest.raises(TypeError, match=message.replace("train_dataset", "eval_dataset")):
        p.evaluate(data(x, y))
    assert p.rounds_done == 0


def test_a_plain_function_as_a_hook_is_a_clear_error():
    def log_round(ctx):
        pass

    p = plan()
    with pytest.raises(TypeError, match=r"hooks: the function log_round is not a hook \(no "
                                        r"before_fit, .*after_fit\): .*subclass crossbow_graph.Hook "
                                        r"and override the one you need, e.g. class Every\(cg.Hook\)"
                                        r": def after_round\(self, ctx\): log_round\(ctx\)"):
        p.fit(ds(), 1, progress=False, hooks=[log_round])
    with pytest.raises(TypeError, match=r"policies: 3 \(of type int\) is not a hook"):
        p.fit(ds(), 1, progress=False, policies=[3])
    assert p.rounds_done == 0
    p.fit(ds(), 1, progress=False, hooks=None, policies=None)  # None: none, as an empty list
    assert p.rounds_done > 0


def test_an_evaluation_sampler_that_yields_nothing_is_a_clear_error():
    data = torch.utils.data.DataLoader(ds(), sampler=torch.utils.data.SubsetRandomSampler([]))
    with pytest.raises(ValueError, match=r"eval_dataset is a DataLoader whose sampler "
                                         r"\(SubsetRandomSampler\) yields no sample of its 32; "
                                         r"give it a sampler that yields the samples to score"):
        p = plan()
        p.fit(ds(), 1, progress=False, eval_dataset=data)
    assert p.rounds_done == 0
