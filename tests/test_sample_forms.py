"""Samples in the forms users give them: without a target (``(inputs, None)``), with keyword
flags (``return_loss=True`` in every sample, or only among compile's example inputs), with
sparse tensors, with tensors that require grad. Each trains, evaluates and loads through a
DataLoader as its plain twin does. Oracles: the same plan on the plain data (bit for bit), and
eager PyTorch for the loss."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset, TensorDataset

import crossbow_graph as cg
from _plans import make_plan

N, B = 32, 4


def _xy(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, 6, generator=g)
    return x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long()


def _plan(model: type[nn.Module] | None = None, example=None, loss_fn=F.cross_entropy,
          **kw) -> cg.Plan:
    """The suite's plan (tests/_plans.py) of ``model()`` (``nn.Linear(6, 3)``) built after
    ``torch.manual_seed(0)``."""
    kw = {"devices": 1, "replicas": 2, "optimizer": cg.SGD(lr=0.1, momentum=0.9), **kw}
    return make_plan(model or (lambda: nn.Linear(6, 3)), seed=0,
                     example=torch.zeros(2, 6) if example is None else example, loss_fn=loss_fn,
                     batch_size=B, **kw)


def _fit(plan: cg.Plan, data, **kw) -> torch.Tensor:
    plan.fit(data, 2, shuffle=False, progress=False, metrics_every=None, **kw)
    return plan.replica_weights()


# -- samples without a target ------------------------------------------------------------------

class Unlabelled(Dataset):
    """``(x, None)`` samples: a contrastive or self-supervised set."""

    def __init__(self, x: torch.Tensor) -> None:
        self.x = x

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], None


def _energy(out: torch.Tensor, target) -> torch.Tensor:
    """A loss that needs no target (and is given None)."""
    assert target is None
    return out.pow(2).mean()


def _zero_target_energy(out: torch.Tensor, target) -> torch.Tensor:
    return out.pow(2).mean()


@pytest.mark.parametrize("loader", [False, True], ids=["dataset", "dataloader-workers"])
def test_samples_without_a_target_train_and_evaluate_with_none_given_to_loss_fn(loader):
    x, _ = _xy()
    data = Unlabelled(x)
    given = DataLoader(data, batch_size=B, num_workers=1) if loader else data
    with pytest.warns(UserWarning, match=r"no test accuracy: the samples have no target \(None\)"
                                         r".*metric_fn"):
        trained = _fit(_plan(loss_fn=_energy), given, eval_dataset=given)
    # the oracle: the same plan on (x, 0) pairs, whose loss ignores the 0
    zeros = TensorDataset(x, torch.zeros(N, dtype=torch.long))
    torch.testing.assert_close(trained, _fit(_plan(loss_fn=_zero_target_energy), zeros),
                               rtol=0, atol=0)
    plan = _plan(loss_fn=_energy)
    _fit(plan, data)
    acc, loss = plan.evaluate(given, metric_fn=lambda out, y: float(y is None))
    with torch.no_grad():
        oracle = float(plan.central_model()(x).pow(2).mean())
    assert acc == 1.0 and loss == pytest.approx(oracle, rel=1e-6)


class OwnLoss(nn.Module):
    """A model that computes its own loss from its inputs alone (loss_fn=None)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x):
        return {"loss": (self.lin(x) - x).pow(2).mean()}


def test_samples_without_a_target_train_on_the_models_own_loss():
    x, _ = _xy(1)
    plan = _plan(OwnLoss, loss_fn=None, optimizer=cg.SGD(lr=0.05))
    before = plan.evaluate(Unlabelled(x), metric_fn=lambda out, y: 0.0)[1]
    _fit(plan, Unlabelled(x))
    after = plan.evaluate(Unlabelled(x), metric_fn=lambda out, y: 0.0)[1]
    assert after < 0.8 * before


# -- keyword flags ------------------------------------------------------------------------------

class Flagged(nn.Module):
    """A forward with CLIP's kind of flag: ``return_loss=True`` adds the loss to the output."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 3)

    def forward(self, x, labels=None, return_loss: bool = False):
        logits = self.lin(x)
        if not return_loss:
            return {"logits": logits}
        return {"logits": logits, "loss": F.cross_entropy(logits, labels)}


class Dicts(Dataset):
    """Dict samples (keyword inputs) with an optional flag in every sample."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, **flags) -> None:
        self.x, self.y, self.flags = x, y, flags

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return {"x": self.x[i], "labels": self.y[i], **self.flags}


@pytest.mark.filterwarnings("ignore::crossbow_graph.TraceWarning")  # `if not return_loss`
@pytest.mark.parametrize("mode", ["per_replica", "fused"])
def test_a_flag_in_every_sample_or_only_in_the_example_inputs_reaches_every_forward(mode):
    x, y = _xy(2)
    example = {"x": x[:2], "labels": y[:2], "return_loss": True}
    in_samples = _fit(_plan(Flagged, example, None, learner_mode=mode),
                      Dicts(x, y, return_loss=True))
    in_example = _plan(Flagged, example, None, learner_mode=mode)
    torch.testing.assert_close(_fit(in_example, Dicts(x, y)), in_samples, rtol=0, atol=0)
    # the oracle: the same model's logits under cross-entropy, with its flag off
    oracle = _fit(_plan(Flagged, {"x": x[:2]}, lambda out, t: F.cross_entropy(out["logits"], t),
                        learner_mode=mode), Dicts(x, y))
    torch.testing.assert_close(in_samples, oracle, rtol=1e-6, atol=1e-7)
    acc, loss = in_example.evaluate(Dicts(x, y))
    with torch.no_grad():
        logits = in_example.central_model()(x)["logits"]
    assert loss == pytest.approx(float(F.cross_entropy(logits, y)), rel=1e-6)
    assert acc == pytest.approx(float((logits.argmax(1) == y).float().mean()), abs=1e-9)


# -- sparse inputs and inputs that require grad ---------------------------------------------------

class Rows(Dataset):
    """A Dataset that returns rows of ``x`` as they are (sparse rows, rows that require grad)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


def _sparse_x() -> tuple[torch.Tensor, torch.Tensor]:
    x, y = _xy(3)
    return torch.where(x > 0.5, x, 0.0), y


@pytest.mark.parametrize("form", ["coo", "csr", "rows", "loader"])
def test_sparse_inputs_train_and_evaluate_as_their_dense_values(form):
    x, y = _sparse_x()
    dense = _fit(_plan(), TensorDataset(x, y))
    data = {"coo": lambda: TensorDataset(x.to_sparse(), y),
            "csr": lambda: TensorDataset(x.to_sparse_csr(), y),
            "rows": lambda: Rows(x.to_sparse(), y),
            "loader": lambda: DataLoader(Rows(x.to_sparse(), y), batch_size=B, num_workers=1)}[form]()
    plan = _plan()
    torch.testing.assert_close(_fit(plan, data), dense, rtol=0, atol=0)
    with torch.no_grad():
        logits = plan.central_model()(x)
    acc, loss = plan.evaluate(data)
    assert loss == pytest.approx(float(F.cross_entropy(logits, y)), rel=1e-6)


@pytest.mark.parametrize("executor, form", [("inline", "tensor"), ("inline", "rows"),
                                            ("inline", "loader"), ("process", "tensor"),
                                            ("inline", "non-leaf"), ("inline", "resident")])
def test_inputs_that_require_grad_train_as_detached_data(executor, form):
    x, y = _xy(4)
    plain = _fit(_plan(devices=2, executor=executor), TensorDataset(x, y))
    leaf = x.clone().requires_grad_(True)
    data = {"tensor": lambda: TensorDataset(leaf, y), "rows": lambda: Rows(leaf, y),
            "loader": lambda: DataLoader(Rows(leaf, y), batch_size=B, num_workers=1),
            "non-leaf": lambda: TensorDataset(leaf * 1.0, y),
            "resident": lambda: TensorDataset(leaf, y)}[form]()
    on_device = {"data_on_device": True} if form == "resident" else {}
    torch.testing.assert_close(_fit(_plan(devices=2, executor=executor), data, **on_device), plain,
                               rtol=0, atol=0)
    assert leaf.grad is None  # the data got no gradient


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("form", ["resident", "sparse"])
def test_inputs_that_require_grad_or_are_sparse_train_on_a_gpu_as_their_plain_values(form):
    x, y = _sparse_x()
    plain = _fit(_plan(devices=["cuda:0"]), TensorDataset(x, y))
    leaf = x.clone().requires_grad_(True)
    data = TensorDataset(leaf, y) if form == "resident" else TensorDataset(x.to_sparse(), y)
    torch.testing.assert_close(_fit(_plan(devices=["cuda:0"]), data), plain, rtol=1e-6, atol=1e-7)
    assert leaf.grad is None
