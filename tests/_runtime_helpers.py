"""Shared helpers of the runtime tests: tiny models, data, and a hand-written SMA reference."""

from __future__ import annotations

import contextlib
import copy

import torch
from torch import nn
from torch.utils.data import TensorDataset

import crossbow_graph as cg

__all__ = ["TinyNet", "TinyBN", "TinyDrop", "tiny_data", "compile_tiny", "reference_sma"]


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


def tiny_data(n: int = 256, seed: int = 0) -> TensorDataset:
    """n samples: x [n, 1, 8, 8] standard normal, y [n] in 0..3."""
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 1, 8, 8, generator=g), torch.randint(0, 4, (n,), generator=g))


def compile_tiny(model_cls=TinyNet, *, seed: int = 0, **kw) -> "cg.Plan":
    """A plan of a fresh ``model_cls`` (seeded init) with batch 4 and SGD(lr 0.05, momentum 0.9);
    ``optimizer`` may be a function of the model (``lambda m: torch.optim.Adam(m.parameters())``)."""
    torch.manual_seed(seed)
    model = model_cls()
    kw.setdefault("batch_size", 4)
    kw.setdefault("optimizer", cg.SGD(lr=0.05, momentum=0.9))
    if callable(kw["optimizer"]):  # a torch.optim optimizer to build over the model
        kw["optimizer"] = kw["optimizer"](model)
    loss_fn = kw.pop("loss_fn", nn.functional.cross_entropy)
    return cg.compile(model, (torch.randn(2, 1, 8, 8),), loss_fn, **kw)


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _load(model: nn.Module, flat: torch.Tensor) -> None:
    off = 0
    for p in model.parameters():
        n = p.numel()
        p.data.copy_(flat[off:off + n].view_as(p))
        off += n


def reference_sma(model: nn.Module, dataset: TensorDataset, *, batch_size: int, ks: list[int],
                  lr: float, momentum: float, central_momentum: float = 0.9,
                  max_grad_norm: float | None = None) -> torch.Tensor:
    """z after len(ks) rounds of SMA (docs/design-overview.md §2) written out by hand in eager PyTorch.

    Round t has ks[t] learners that take the next ks[t]·b samples of the dataset's order
    (shuffle=False); α = 1/k (0 for k = 1, where z follows the single replica). When k grows, new
    replicas are z with zero momentum; when it shrinks, the last replicas go. No weight decay.
    ``max_grad_norm``: each learner's gradient clipped by ``torch.nn.utils.clip_grad_norm_``.
    """
    x_all, y_all = dataset.tensors
    w0 = _flat(model)
    ws, vs = [w0.clone()], [torch.zeros_like(w0)]
    z, z_prev = w0.clone(), w0.clone()
    pos, b = 0, batch_size
    work = copy.deepcopy(model).train()
    for k in ks:
        while len(ws) < k:
            ws.append(z.clone())
            vs.append(torch.zeros_like(z))
        del ws[k:], vs[k:]
        alpha = 0.0 if k == 1 else 1.0 / k
        cs = []
        for j in range(k):
            _load(work, ws[j])
            work.zero_grad()
            x, y = x_all[pos + j * b: pos + (j + 1) * b], y_all[pos + j * b: pos + (j + 1) * b]
            nn.functional.cross_entropy(work(x), y).backward()
            if max_grad_norm is not None:
                nn.utils.clip_grad_norm_(work.parameters(), max_grad_norm)
            g = torch.cat([p.grad.reshape(-1) for p in work.parameters()])
            vs[j] = momentum * vs[j] + g
            c = alpha * (ws[j] - z)
            ws[j] = ws[j] - lr * vs[j] - c
            cs.append(c)
        pos += k * b
        if k == 1:
            z_prev, z = z, ws[0].clone()
        else:
            z_new = z + torch.stack(cs).sum(0) + central_momentum * (z - z_prev)
            z_prev, z = z, z_new
    return z
