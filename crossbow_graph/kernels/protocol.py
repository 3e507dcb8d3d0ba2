"""``SMAKernels``: every method the engine calls on an SMA update backend, which each backend
implements, declining with False or None where it has no fast path (docs/kernels.md, Backends)."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

__all__ = ["SMAKernels"]


@runtime_checkable
class SMAKernels(Protocol):
    """An SMA update backend: ``name`` ``"torch"``, ``"c"`` or ``"triton"``; ``block`` columns
    per kernel program, or None for the backend's own choice."""

    name: str
    block: int | None

    def local_update(self, w: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                     z: torch.Tensor | None, *, lr: float, momentum: float, nesterov: bool,
                     weight_decay: float, alpha: float, first_step: bool = False,
                     out: torch.Tensor | None = None) -> torch.Tensor | None:
        """``torch_ref.sma_local_update``: returns ``acc [P]``, or None without a correction."""
        ...

    def central_update(self, z: torch.Tensor, z_prev: torch.Tensor, c: torch.Tensor, *,
                       central_momentum: float) -> None:
        """``torch_ref.sma_central_update``: z ← z + c + μ_z·(z − z_prev), z_prev ← the old z."""
        ...

    def central_update_shared(self, zs: list[torch.Tensor], z_prevs: list[torch.Tensor],
                              parts: list[torch.Tensor], *, central_momentum: float) -> bool:
        """In one pass: C = Σ parts (in order), ``central_update(zs[0], z_prevs[0], C)``, and
        every ``zs[d], z_prevs[d]`` set to ``zs[0], z_prevs[0]``; False, doing nothing, when
        the backend has no such pass for these tensors."""
        ...

    def nonfinite_rows(self, g: torch.Tensor) -> list[int] | None:
        """The rows of ``g [n, P]`` that hold a NaN or Inf, or None when the backend does not
        test these rows."""
        ...
