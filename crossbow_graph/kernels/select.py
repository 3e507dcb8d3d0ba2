"""The SMA update backend of a plan and the kernels it runs (docs/design-overview.md §4;
docs/kernels.md): ``select_backend`` picks torch, C or Triton; ``plan_kernels`` lists the kernels
a plan's flat buffers run, one per specialisation."""

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

__all__ = ["TorchKernel", "CKernel", "plan_kernels", "select_backend", "KernelBackend",
           "KERNEL_BACKENDS"]

KernelBackend = Literal["auto", "triton", "torch", "c"]
KERNEL_BACKENDS = get_args(KernelBackend)


@dataclass(frozen=True)
class TorchKernel:
    """One step of the torch backend as ``Plan.kernels`` lists it: the spec it covers and the
    source of the vectorised torch function that runs (kernels/torch_ref.py)."""

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
    """One step of the C backend as ``Plan.kernels`` lists it: the spec it covers and the C
    source that runs (kernels/sma_cpu.c, compiled once per machine; kernels/c_sma.py)."""

    spec: KernelSpec
    backend = "c"

    @property
    def source(self) -> str:
        return (f"// {self.spec.describe(launch=False)} — C (one pass over [m, P])\n"
                + C_SOURCE_PATH.read_text())

    def __repr__(self) -> str:
        return f"<{self.spec.describe(launch=False)}, c>"


def plan_kernels(backend: SMAKernels, states: list[Any], *, local: bool = True, momentum: float,
                 nesterov: bool,
                 weight_decay: float, num_learners: int, sync_every: int,
                 central_momentum: float) -> list[EmittedKernel | TorchKernel]:
    """The kernels a plan runs on its devices' current flat buffers, one per distinct spec.

    Local (``local``: the SGD kernels run the local step, not a row optimizer, engine/optim.py):
    the first step and later steps (when there is momentum), with the correction (k > 1)
    and without it (k = 1, or rounds between syncs when τ > 1). Central: when k > 1. With the
    Triton backend they are emitted (and cached) here; the torch backend lists TorchKernel.
    """
    specs: list[KernelSpec] = []
    corrects = ([True] if num_learners > 1 else []) + ([False] if num_learners == 1 or sync_every > 1 else [])
    firsts = [True, False] if momentum != 0 else [False]
    block = backend.block
    for s in states:
        m, P = s.w.shape
        dev = device_type(s.w)
        for first in firsts if local else ():
            for correct in corrects:
                specs.append(local_spec(m, P, s.g.dtype, dev, momentum=momentum, nesterov=nesterov,
                                        weight_decay=weight_decay, first_step=first,
                                        correct=correct, block=block,
                                        row_stride=s.w.stride(0)))
        if num_learners > 1:
            specs.append(central_spec(P, dev, central_momentum=central_momentum, block=block,
                                      dtype=s.z.dtype))
    unique = list(dict.fromkeys(specs))
    if isinstance(backend, TritonSMAKernels):
        return [emit(s) for s in unique]
    if isinstance(backend, CSMAKernels):  # gradients not in float32 take the torch path
        return [CKernel(s) if s.dtype == torch.float32 else TorchKernel(s) for s in unique]
    return [TorchKernel(s) for s in unique]


def select_backend(kernel_backend: str, device_type: str, dtype: torch.dtype = torch.float32
                   ) -> TorchSMAKernels | TritonSMAKernels | CSMAKernels:
    """The SMA update backend for ``compile(..., kernel_backend=...)``.

    ``"auto"``: Triton on CUDA (if triton is installed); on the CPU the C kernels (kernels/
    sma_cpu.c, built on first use) when a C compiler is there, else torch; torch for a float64
    model (``dtype``, the model's: the C and Triton kernels update float32 masters only).
    ``"c"``: the C kernels (CPU tensors; anything else runs the torch functions). ``"triton"``:
    Triton (on the CPU through its interpreter: slow, for tests). ``"torch"``: the vectorised
    torch implementation (kernels/torch_ref.py, the oracle).

    Raises:
        ValueError: an unknown name; ``"c"`` or ``"triton"`` with a float64 model.
        ImportError: ``"triton"`` without the triton package (says how to install it).
        CompilerError: ``"c"`` without a working C compiler (its message says why).
    """
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
