"""Outputs of any form: a model's own loss (``loss_fn=None``), dict samples with the labels among
the inputs, accuracy read from ``.logits`` / the first tensor of a tuple or dict, ``metric_fn``,
and the warning when no accuracy can be computed. Oracle: the same model in eager PyTorch."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Dataset, TensorDataset

import crossbow_graph as cg


class _OwnLoss(nn.Module):
    """Computes its loss when given labels, as HuggingFace models do; returns a dict."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 4)

    def forward(self, x, labels=None):
        logits = self.lin(x)
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = F.cross_entropy(logits, labels)
        return out


class _DictSamples(Dataset):
    """Each sample one dict of keyword inputs, the labels among them."""

    def __init__(self, n: int = 32, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 6, generator=g)
        self.y = (self.x[:, 0] > 0).long() + 2 * (self.x[:, 1] > 0).long()

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "labels": self.y[i]}


def test_loss_fn_none_trains_on_the_models_own_loss_like_eager_sgd():
    """k = 1 is exactly torch.optim.SGD (docs/design-overview.md §2) on the model's own loss."""
    torch.manual_seed(0)
    model, data = _OwnLoss(), _DictSamples()
    plan = cg.compile(model, {"x": data.x[:2], "labels": data.y[:2]}, None, batch_size=8,
                      devices=["cpu:0"], replicas=1, optimizer=cg.SGD(lr=0.1, momentum=0.9))
    assert plan.model_graph.output_has_loss
    plan.fit(data, 2, shuffle=False, progress=False)
    ref = _OwnLoss()
    ref.load_state_dict(plan.template.state_dict())  # the model as compiled (the fit leaves z in it)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for _ in range(2):
        for start in range(0, 32, 8):
            opt.zero_grad()
            ref(data.x[start:start + 8], labels=data.y[start:start + 8])["loss"].backward()
            opt.step()
    z = plan.central_model()
    for name, value in ref.state_dict().items():
        torch.testing.assert_close(z.state_dict()[name], value, rtol=1e-5, atol=1e-6)
    acc, loss = plan.evaluate(data)  # the target of a dict sample is its "labels"
    with torch.no_grad():
        out = z(data.x, labels=data.y)
    assert acc == pytest.approx(float((out["logits"].argmax(1) == data.y).float().mean()))
    assert loss == pytest.approx(float(out["loss"]), rel=1e-5)


def test_loss_fn_none_without_a_loss_in_the_output_fails_before_training():
    data = _DictSamples()
    with pytest.raises(ValueError, match=r"loss_fn=None trains on the loss _OwnLoss computes itself "
                                         r".*has none: put the labels among the example inputs"):
        cg.compile(_OwnLoss(), {"x": data.x[:2]}, None, batch_size=8)


class _TupleOut(nn.Module):
    def __init__(self, loss_first: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 4)
        self.loss_first = loss_first

    def forward(self, x):
        logits = self.lin(x)
        aux = logits.pow(2).mean()
        return (aux, logits) if self.loss_first else (logits, aux)


@pytest.mark.parametrize("loss_first", [False, True])
def test_accuracy_is_read_from_the_first_tensor_of_a_tuple_output(loss_first):
    data = _DictSamples()
    pairs = TensorDataset(data.x, data.y)
    model = _TupleOut(loss_first)
    plan = cg.compile(model, (data.x[:2],), lambda out, y: F.cross_entropy(out[int(loss_first)], y),
                      batch_size=8, devices=["cpu:0"], replicas=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an accuracy, so no warning
        acc, _ = plan.evaluate(pairs)
    logits = plan.central_model()(data.x)[int(loss_first)]
    assert acc == pytest.approx(float((logits.argmax(1) == data.y).float().mean()))


class _Sequence(nn.Module):
    """Per-token class scores [N, T, C]: no class accuracy without a metric_fn."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 4)

    def forward(self, x):
        return self.lin(x)


def _token_loss(out, y):
    return F.cross_entropy(out.flatten(0, 1), y.flatten())


def _token_accuracy(out, y):
    return (out.argmax(-1) == y).float().mean()


def test_no_accuracy_warns_once_and_a_metric_fn_gives_one():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 5, 6, generator=g)
    y = (x[..., 0] > 0).long()
    data = TensorDataset(x, y)
    plan = cg.compile(_Sequence(), (x[:2],), _token_loss, batch_size=8, devices=["cpu:0"], replicas=1)
    with pytest.warns(UserWarning, match=r"_Sequence: no test accuracy: the output \(Tensor \[32, 5, 4\]\) "
                                         r"with targets \(Tensor \[32, 5\] of torch.int64\).*"
                                         r"metric_fn=fn.*target_accuracy cannot stop training") as caught:
        history = plan.fit(data, 2, eval_dataset=data, eval_batch_size=32, progress=False)
    assert [e.test_accuracy for e in history.evals] == [None, None]
    assert sum("no test accuracy" in str(w.message) for w in caught) == 1
    history = plan.fit(data, 4, eval_dataset=data, eval_batch_size=10, progress=False,
                       metric_fn=_token_accuracy)
    with torch.no_grad():
        oracle = float(_token_accuracy(plan.central_model()(x), y))
    assert history.evals[-1].test_accuracy == pytest.approx(oracle, abs=1e-6)  # weighted by batch


def test_metric_fn_must_be_callable():
    data = TensorDataset(torch.randn(8, 6), torch.randint(0, 4, (8,)))
    plan = cg.compile(_Sequence(), (torch.randn(2, 6),), F.cross_entropy, batch_size=4)
    with pytest.raises(TypeError, match=r"metric_fn=0.5: must be callable"):
        plan.fit(data, 1, metric_fn=0.5)
