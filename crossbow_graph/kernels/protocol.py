"""The contract between the engine and an SMA update backend (docs/kernels.md).

``SMAKernels`` names every attribute and method the engine and ``select.plan_kernels`` use on a
backend: the torch reference (torch_ref.TorchSMAKernels), the C kernels (c_sma.CSMAKernels) and
the Triton kernels (triton_sma.TritonSMAKernels) implement all of it. A backend without a fast
path for a method still implements it, with the documented "not done here" answer (False, None)
that makes the caller take the torch path, so the engine calls methods directly, never probing.
All tensors are the flat per-device buffers of engine/state.py (``w, v [m, P]`` float32 masters,
or float64; ``g [m, P]`` in the model's dtype; ``z, z_prev [P]``).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

__all__ = ["SMAKernels"]


@runtime_checkable
class SMAKernels(Protocol):
    """An SMA update backend.

    Attributes:
        name: ``"torch"``, ``"c"`` or ``"triton"`` (what ``Plan.kernels`` and logs show).
        block: columns per kernel program (Triton), or None for the backend's own choice.
    """

    name: str
    block: int | None

    def local_update(self, w: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                     z: torch.Tensor | None, *, lr: float, momentum: float, nesterov: bool,
                     weight_decay: float, alpha: float, first_step: bool = False,
                     out: torch.Tensor | None = None) -> torch.Tensor | None:
        """The local step and correction of a device's replicas, in place: the semantics of
        ``torch_ref.sma_local_update`` (the oracle). Returns ``acc [P]`` (in ``out`` when given),
        or None without a correction (``z`` None or ``alpha == 0``). ``lr``, ``momentum``,
        ``weight_decay``, ``alpha`` are numbers or 0-dim float32 tensors on w's device, read at
        run time (what a captured CUDA graph needs; the C backend takes the torch path then)."""
        ...

    def central_update(self, z: torch.Tensor, z_prev: torch.Tensor, c: torch.Tensor, *,
                       central_momentum: float) -> None:
        """z ← z + c + μ_z·(z − z_prev), then z_prev ← the old z, in place
        (``torch_ref.sma_central_update``); ``central_momentum`` a number or a 0-dim float32
        tensor on z's device."""
        ...

    def central_update_shared(self, zs: list[torch.Tensor], z_prevs: list[torch.Tensor],
                              parts: list[torch.Tensor], *, central_momentum: float) -> bool:
        """The central update of CPU devices that share one memory in one pass: C = Σ parts (in
        order), ``central_update(zs[0], z_prevs[0], C)``, every ``zs[d], z_prevs[d]`` set to
        ``zs[0], z_prevs[0]``. Returns False, having done nothing, when the backend has no such
        pass for these tensors (the scheduler then takes the same steps in torch)."""
        ...

    def nonfinite_rows(self, g: torch.Tensor) -> list[int] | None:
        """The rows of ``g [n, P]`` that hold a NaN or Inf (``[]`` when all are finite), for the
        fault test (engine/faults.py); None when the backend does not test these rows (the
        caller then tests them in torch)."""
        ...
