"""Per-device training state in flat buffers (DESIGN.md §4).

A device holds m replicas (deep copies of the user's model) whose trainable parameters are views
into the rows of ``w [m, P]`` and whose gradients are views into ``g [m, P]``; floating-point
buffers (BatchNorm statistics) are views into ``buf [m, Q]``. ``z [P]``/``z_prev [P]`` are the
device's copies of the central average model and ``zbuf [Q]`` its buffers.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["FlatLayout", "DeviceState", "bind_flat"]


@dataclass(frozen=True)
class FlatLayout:
    """Where each tensor of a module lives in a flat row.

    Attributes:
        entries: ``(name, shape, offset, numel)`` per tensor, in ``named_parameters()`` (tied ones
            once) or ``named_buffers()`` order.
        size: total scalars (P for parameters, Q for float buffers).
    """

    entries: tuple[tuple[str, tuple[int, ...], int, int], ...]
    size: int

    @staticmethod
    def of(named: list[tuple[str, torch.Tensor]]) -> "FlatLayout":
        entries, off = [], 0
        for name, t in named:
            n = t.numel()
            entries.append((name, tuple(t.shape), off, n))
            off += n
        return FlatLayout(tuple(entries), off)


def trainable_named(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Trainable parameters, tied ones once, in ``named_parameters()`` order."""
    return [(n, p) for n, p in module.named_parameters() if p.requires_grad]


def float_buffers_named(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Floating-point buffers (averaged at sync); integer ones are carried, never averaged."""
    return [(n, b) for n, b in module.named_buffers() if b.is_floating_point()]


def _set_buffer(module: nn.Module, name: str, value: torch.Tensor) -> None:
    owner, _, leaf = name.rpartition(".")
    sub = module.get_submodule(owner) if owner else module
    sub._buffers[leaf] = value


def bind_flat(module: nn.Module, params_row: torch.Tensor, grads_row: torch.Tensor | None,
              bufs_row: torch.Tensor | None, params: FlatLayout, buffers: FlatLayout) -> None:
    """Make ``module``'s trainable parameters (and gradients, float buffers) views into flat rows.

    The current values are copied into the rows first, so nothing is lost.
    """
    named = dict(module.named_parameters())
    for name, shape, off, n in params.entries:
        p = named[name]
        view = params_row[off:off + n].view(shape)
        view.copy_(p.detach())
        p.data = view
        if grads_row is not None:
            p.grad = grads_row[off:off + n].view(shape)
    if bufs_row is not None:
        named_b = dict(module.named_buffers())
        for name, shape, off, n in buffers.entries:
            view = bufs_row[off:off + n].view(shape)
            view.copy_(named_b[name])
            _set_buffer(module, name, view)


class DeviceState:
    """The m replicas of one device and their flat buffers.

    Attributes:
        name: device name (``"cpu:0"``, ``"cuda:1"``); ``torch_device`` the torch.device.
        replicas: m modules, training mode, parameters are views of ``w``.
        w, v, g: ``[m, P]`` parameters, momentum, gradients.
        buf: ``[m, Q]`` float buffers.
        z, z_prev: ``[P]`` the central average model and its previous value.
        zbuf: ``[Q]`` the central model's float buffers (mean over all replicas at each sync).
        first_step: per replica, momentum not yet initialised (bool list of length m).
    """

    def __init__(self, name: str, torch_device: torch.device, template: nn.Module, m: int,
                 params: FlatLayout, buffers: FlatLayout) -> None:
        self.name = name
        self.torch_device = torch_device
        self.params = params
        self.buffers = buffers
        dtype = torch.float32
        self.w = torch.zeros(m, params.size, dtype=dtype, device=torch_device)
        self.v = torch.zeros_like(self.w)
        self.g = torch.zeros_like(self.w)
        self.buf = torch.zeros(m, buffers.size, dtype=dtype, device=torch_device)
        self.z = torch.zeros(params.size, dtype=dtype, device=torch_device)
        self.zbuf = torch.zeros(buffers.size, dtype=dtype, device=torch_device)
        self.replicas: list[nn.Module] = []
        for j in range(m):
            self.replicas.append(self._new_replica(template, j))
        self.z.copy_(self.w[0])
        self.z_prev = self.z.clone()
        self.zbuf.copy_(self.buf[0])
        self.first_step = [True] * m
        self.acc: torch.Tensor | None = None

    @property
    def m(self) -> int:
        return len(self.replicas)

    def _new_replica(self, template: nn.Module, j: int) -> nn.Module:
        r = copy.deepcopy(template).to(self.torch_device)
        r.train()
        bind_flat(r, self.w[j], self.g[j], self.buf[j], self.params, self.buffers)
        return r
