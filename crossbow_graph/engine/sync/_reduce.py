"""What the algorithms' global updates share after their sum: the central model to every device
and every replica restarted from it (engine/sync/)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ..state.flat import DeviceState

__all__ = ["restart_from_z"]


def restart_from_z(states: list["DeviceState"], mean_buf: torch.Tensor | None) -> None:
    """The first device's new z and z_prev to every other device, every replica restarted from z
    (w_j ← z; v and the row optimizers' state kept) and zbuf ← ``mean_buf`` (when not None)."""
    s0 = states[0]
    for s in states:
        if s is not s0:
            s.z.copy_(s0.z.to(s.torch_device))
            s.z_prev.copy_(s0.z_prev.to(s.torch_device))
        s.w.copy_(s.z.expand_as(s.w))
        if mean_buf is not None:
            s.zbuf.copy_(mean_buf.to(s.torch_device))
