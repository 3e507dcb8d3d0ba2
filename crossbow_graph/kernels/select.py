"""The SMA update backend of a plan (``select_backend``) and the kernels it runs
(``plan_kernels``, ``kernel_specs``) (docs/kernels.md, "Emission, cache, what runs")."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Literal, get_args

import torch

from .c_sma import SOURCE_PATH as C_SOURCE_PATH
from .c_sma import CSMAKernels, c_kernels_available
from .protocol import SMAKernels
from .torch_ref import TorchSMAKernels, sma_central_update, sma_local_update
from .triton_sma import (EmittedKernel, KernelSpec, TritonSMAKernels, central_spec, device_type, emit,
                         import_triton, local_spec)

__all__ = ["TorchKernel", "CKernel", "UpdateFacts", "plan_kernels", "kernel_specs",
           "select_backend", "KernelBackend", "KERNEL_BACKENDS"]

KernelBackend = Literal["auto", "triton", "torch", "c"]
KERNEL_BACKENDS = get_args(KernelBackend)


@dataclass(frozen=True)
class TorchKernel:
    """A torch backend step in ``Plan.kernels``: its spec and the torch function's source."""

    spec: KernelSpec
    backend = "torch"

    @property
    def source(self) -> str:
        fn = sma_local_update if self.spec.kind == "sma_local" else sma_central_update
        return (f"# {self.spec.describe(launch=False)} — torch (vectorised over [m, P])\n"
                + inspect.getsource(fn))

    def __repr__(self) -> str:
        return f"<{self.spec.describe(launch=False)}, torch>"


@dataclass(frozen=True)
class CKernel:
    """A C backend step in ``Plan.kernels``: its spec and the C source (kernels/sma_cpu.c)."""

    spec: KernelSpec
    backend = "c"

    @property
    def source(self) -> str:
        return (f"// {self.spec.describe(launch=False)} — C (one pass over [m, P])\n"
                + C_SOURCE_PATH.read_text())

    def __repr__(self) -> str:
        return f"<{self.spec.describe(launch=False)}, c>"


@dataclass(frozen=True)
class UpdateFacts:
    """What selects a device's update kernels besides m and P: the SGD flags of the local kernel
    (``local``: no row optimizer), k = ``num_learners``, τ = ``sync_every``, μ_z."""

    momentum: float
    nesterov: bool
    weight_decay: float
    num_learners: int
    sync_every: int
    central_momentum: float
    local: bool = True


def plan_kernels(backend: SMAKernels, states: list[Any], facts: UpdateFacts, *,
                 graphs: bool = False) -> list[EmittedKernel | TorchKernel]:
    """The kernels a plan runs on its devices' flat buffers, one per distinct spec
    (``kernel_specs`` of each device's ``w [m, P]``, its row stride and gradients' dtype)."""
    specs: list[KernelSpec] = []
    for s in states:
        m, P = s.w.shape
        specs += kernel_specs(m, P, device_type(s.w), facts, row_stride=s.w.stride(0),
                              dtype=s.g.dtype, z_dtype=s.z.dtype, graphs=graphs,
                              block=backend.block)
    unique = list(dict.fromkeys(specs))
    if isinstance(backend, TritonSMAKernels):
        return [emit(s) for s in unique]
    if isinstance(backend, CSMAKernels):  # gradients not in float32 take the torch path
        return [CKernel(s) if s.dtype == torch.float32 else TorchKernel(s) for s in unique]
    return [TorchKernel(s) for s in unique]


def kernel_specs(m: int, P: int, device_type: str, facts: UpdateFacts, *,
                 row_stride: int | None = None, dtype: torch.dtype = torch.float32,
                 z_dtype: torch.dtype = torch.float32, graphs: bool = False,
                 block: int | None = None) -> list[KernelSpec]:
    """The specs one device of m replicas of P parameters launches (rows ``row_stride`` apart,
    gradients of ``dtype``): the local kernel of the first and later steps, with and without
    the correction as k and τ need them; the central one when k > 1. ``graphs``: as CUDA-graph
    rounds launch them (``HYPER_PTR``; μ_z = 0 stays a number)."""
    f, specs = facts, []
    corrects = [True] * (f.num_learners > 1) + [False] * (f.num_learners == 1 or f.sync_every > 1)
    for first in ([True, False] if f.momentum != 0 else [False]) if f.local else ():
        for correct in corrects:
            specs.append(local_spec(m, P, dtype, device_type, momentum=f.momentum,
                                    nesterov=f.nesterov, weight_decay=f.weight_decay,
                                    first_step=first, correct=correct, block=block,
                                    row_stride=row_stride, hyper_ptr=graphs))
    if f.num_learners > 1:
        specs.append(central_spec(P, device_type, central_momentum=f.central_momentum,
                                  block=block, dtype=z_dtype,
                                  hyper_ptr=graphs and f.central_momentum != 0))
    return specs


def select_backend(kernel_backend: str, device_type: str, dtype: torch.dtype = torch.float32
                   ) -> TorchSMAKernels | TritonSMAKernels | CSMAKernels:
    """The SMA update backend for ``compile(..., kernel_backend=...)`` on ``device_type`` for a
    model of ``dtype`` (docs/kernels.md, Backends).

    Raises:
        ValueError: an unknown name; ``"c"`` or ``"triton"`` with a float64 model.
        ImportError: ``"triton"`` without the triton package (says how to install it).
        CompilerError: ``"c"`` without a working C compiler (its message says why)."""
    if kernel_backend not in KERNEL_BACKENDS:
        raise ValueError(f"kernel_backend={kernel_backend!r}: use one of {', '.join(map(repr, KERNEL_BACKENDS))}")
    if dtype == torch.float64 and kernel_backend in ("c", "triton"):
        raise ValueError(f"kernel_backend={kernel_backend!r} updates float32 masters only, but the "
                         "model is float64 (its masters are float64); use kernel_backend='torch' "
                         "(or 'auto', which picks it), or cast the model to float32 with "
                         "model.float()")
    if kernel_backend == "torch" or dtype == torch.float64:
        return TorchSMAKernels()
    if kernel_backend == "c":
        return CSMAKernels()
    if kernel_backend == "auto":
        if device_type != "cuda":
            return CSMAKernels() if c_kernels_available() else TorchSMAKernels()
        try:
            import_triton()
        except ImportError:
            return TorchSMAKernels()
        return TritonSMAKernels()
    import_triton()
    return TritonSMAKernels()
