"""The test suite's one plan factory and the small models and data sets the test files share."""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch
from torch import nn
from torch.utils.data import TensorDataset

import crossbow_graph as cg

__all__ = ["TinyNet", "TinyBN", "TinyDrop", "tiny_data", "make_plan", "fp32_exact"]


class TinyNet(nn.Module):
    """conv(1→3, 3×3) → ReLU → linear(3·6·6 → 4) on 1×8×8 inputs; no dropout, no buffers."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 3, 3)
        self.fc = nn.Linear(3 * 6 * 6, 4)

    def forward(self, x):
        return self.fc(torch.relu(self.conv(x)).flatten(1))


class TinyBN(TinyNet):
    """TinyNet with BatchNorm2d after the convolution (running statistics per replica)."""

    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm2d(3)

    def forward(self, x):
        return self.fc(torch.relu(self.bn(self.conv(x))).flatten(1))


class TinyDrop(TinyNet):
    """TinyNet with dropout (p = 0.5) before the classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        return self.fc(self.drop(torch.relu(self.conv(x)).flatten(1)))


def tiny_data(n: int = 256, seed: int = 0) -> TensorDataset:
    """n samples: x [n, 1, 8, 8] standard normal, y [n] in 0..3."""
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 1, 8, 8, generator=g), torch.randint(0, 4, (n,), generator=g))


_SGD = cg.SGD(lr=0.05, momentum=0.9)


def make_plan(model: nn.Module | Callable[[], nn.Module] = TinyNet, *, seed: int | None = 0,
              input_shape: tuple[int, ...] = (1, 8, 8), example: Any = None,
              dtype: torch.dtype | None = None, loss_fn=nn.functional.cross_entropy,
              batch_size: int = 4, optimizer: Any = _SGD, **options) -> "cg.Plan":
    """``cg.compile`` of a tiny model with the suite's defaults: batch 4, SGD(lr 0.05, momentum 0.9),
    cross-entropy; the other options as compile's defaults unless given in ``options``.

    In this order: ``torch.manual_seed(seed)`` (``seed=None``: none); ``model`` built when it is a
    class or a function (an ``nn.Module`` is used as it is), then cast to ``dtype`` if given; the
    example inputs: ``example`` as compile takes them (a tuple or a dict; a tensor x stands for
    ``(x,)``), or else ``(torch.randn(2, *input_shape, dtype=dtype),)``. ``optimizer``: a
    ``cg.SGD``, a torch optimizer, a function of the model that builds one
    (``lambda m: torch.optim.Adam(m.parameters())``), or None for compile's default; a class goes
    to compile as it is.
    """
    if seed is not None:
        torch.manual_seed(seed)
    if not isinstance(model, nn.Module):
        model = model()
    if dtype is not None:
        model = model.to(dtype)
    if example is None:
        example = (torch.randn(2, *input_shape, dtype=dtype),)
    elif isinstance(example, torch.Tensor):
        example = (example,)
    if callable(optimizer) and not isinstance(optimizer, type):  # a class is passed on as it is
        optimizer = optimizer(model)
    if optimizer is not None:
        options["optimizer"] = optimizer
    return cg.compile(model, example, loss_fn, batch_size=batch_size, **options)


@contextlib.contextmanager
def fp32_exact():
    """Context: float32 matmuls and convolutions without TF32 on CUDA (a GPU result compared
    with a CPU float32 oracle at rtol 1e-4 needs it: TF32 keeps 10 mantissa bits); restored
    after."""
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before
