"""The computation's fingerprint the ranks compare at start-up (compiler/fingerprint.py): the same
text for the same computation whatever the weights and object addresses, another text for another
activation, dropout p, forward or loss function. The two-rank refusals are in
tests/test_distributed.py."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from crossbow_graph.compiler.fingerprint import computation_fingerprint, first_difference


class Net(nn.Module):
    """conv → act → linear on 1×8×8 inputs; ``act`` a module, ``extra`` shown in extra_repr."""

    def __init__(self, act: nn.Module | None = None, p: float = 0.5, extra=None) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 3, 3)
        self.act = act if act is not None else nn.ReLU()
        self.drop = nn.Dropout(p)
        self.fc = nn.Linear(3 * 6 * 6, 4)
        self.extra = extra

    def extra_repr(self) -> str:
        return f"extra={self.extra}"

    def forward(self, x):
        return self.fc(self.drop(self.act(self.conv(x)).flatten(1)))


def _fingerprint(model: nn.Module, loss=F.cross_entropy, traced: bool = True):
    graph = torch.fx.symbolic_trace(model) if traced else None
    return computation_fingerprint(model, graph, loss)


def _scale(s: float):
    return lambda o, y: F.cross_entropy(o, y) * s  # a fresh function object (address) per call


def test_the_same_computation_gives_the_same_text_whatever_the_weights_and_addresses():
    torch.manual_seed(0)
    a = Net(extra=_scale(1.0))
    torch.manual_seed(1)
    b = Net(extra=_scale(1.0))
    assert not torch.equal(a.conv.weight, b.conv.weight) and a.extra is not b.extra
    fa, fb = _fingerprint(a, _scale(2.0)), _fingerprint(b, _scale(2.0))
    assert fa.lines == fb.lines and fa.digest == fb.digest
    assert " at 0x" in a.extra_repr() and a.extra_repr() != b.extra_repr()  # the addresses
    assert "module (root): Net(extra=<function _scale.<locals>.<lambda>>)" in fa.lines
    assert "module act: ReLU()" in fa.lines and "module drop: Dropout(p=0.5, inplace=False)" in fa.lines
    assert any(line.startswith("forward: ") for line in fa.lines)


@pytest.mark.parametrize("other, line, was, at", [
    (Net(act=nn.GELU()), "module act: GELU(approximate='none')", "module act: ReLU()", 3),
    (Net(act=nn.GELU(approximate="tanh")), "module act: GELU(approximate='tanh')",
     "module act: ReLU()", 3),
    (Net(p=0.3), "module drop: Dropout(p=0.3, inplace=False)",
     "module drop: Dropout(p=0.5, inplace=False)", 4),
])
def test_another_activation_or_dropout_changes_the_text_at_its_module(other, line, was, at):
    ref, got = _fingerprint(Net()), _fingerprint(other)
    assert ref.digest != got.digest
    assert first_difference([ref.lines, got.lines]) == (
        f"rank 1 runs `{line}` where rank 0 runs `{was}` (line {at} of the computation's fingerprint)")


def _net_with_forward(body: str) -> nn.Module:
    """A ``Net`` subclass named Net whose forward is ``body`` (another code, the same modules)."""
    namespace: dict = {"Net": Net, "torch": torch}
    exec(f"class Net(Net):\n    def forward(self, x):\n        {body}\n", namespace)
    return namespace["Net"]()


def test_another_forward_changes_the_traced_graph_or_the_forward_source():
    plain = _net_with_forward("return self.fc(self.act(self.conv(x)).flatten(1))")
    tanh = _net_with_forward("return self.fc(torch.tanh(self.conv(x)).flatten(1))")
    traced = first_difference([_fingerprint(plain).lines, _fingerprint(tanh).lines])
    assert "rank 1 runs `forward: tanh = torch.tanh(conv)" in traced, traced
    untraced = [_fingerprint(m, traced=False) for m in (plain, tanh)]
    assert untraced[0].digest != untraced[1].digest
    assert "forward of " in first_difference([u.lines for u in untraced])


@pytest.mark.parametrize("loss, other", [
    (F.cross_entropy, F.nll_loss),
    (functools.partial(F.cross_entropy, label_smoothing=0.1),
     functools.partial(F.cross_entropy, label_smoothing=0.2)),
    (nn.CrossEntropyLoss(label_smoothing=0.1), nn.CrossEntropyLoss(label_smoothing=0.2)),
    (nn.CrossEntropyLoss(weight=torch.ones(4)), nn.CrossEntropyLoss(weight=torch.arange(4.0))),
    (_scale(1.0), _scale(2.0)),
    (F.cross_entropy, None),
])
def test_another_loss_function_changes_the_last_line(loss, other):
    a, b = _fingerprint(Net(), loss), _fingerprint(Net(), other)
    assert a.lines[:-1] == b.lines[:-1] and a.lines[-1] != b.lines[-1]
    assert a.lines[-1].startswith("loss_fn: ")


@pytest.mark.parametrize("make", [
    lambda: F.cross_entropy,
    lambda: functools.partial(F.cross_entropy, label_smoothing=0.1),
    lambda: nn.CrossEntropyLoss(label_smoothing=0.1),
    lambda: _scale(2.0),
])
def test_the_same_loss_made_twice_gives_the_same_line(make):
    assert _fingerprint(Net(), make()).lines == _fingerprint(Net(), make()).lines


def test_first_difference_names_each_differing_rank_and_a_missing_line():
    lines = ("module (root): Net()", "module act: ReLU()", "loss_fn: f")
    said = first_difference([lines, lines, lines[:2]])
    assert said == ("rank 2 has nothing more where rank 0 runs `loss_fn: f` (line 3 of the "
                    "computation's fingerprint)")
