"""The Triton kernels compiled ahead of their first launch, in parallel worker processes, without
a GPU, through the path Triton's JIT takes, into the on-disk cache key a launch on a GPU of that
compute capability looks up (docs/kernels.md, "Compiling ahead")."""

from __future__ import annotations

import math
import multiprocessing
import os
import time
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch

from . import triton_sma
from .triton_sma import FP_FUSION, KernelSpec

__all__ = ["precompile", "compile_spec", "launch_args", "PrecompileResult"]


@dataclass
class PrecompileResult:
    """What ``precompile`` did: ``compiled`` specs built now, ``cached`` ones already in Triton's
    cache, ``failed`` (spec line, error) pairs, ``pending`` spec lines not done within the
    time limit, ``seconds`` wall time, ``workers`` processes, ``arch`` the target (e.g. 90)."""

    arch: int
    workers: int
    compiled: list[str] = field(default_factory=list)
    cached: list[str] = field(default_factory=list)
    failed: list[tuple[str, str]] = field(default_factory=list)
    pending: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def line(self) -> str:
        """One line: counts, target, processes and seconds."""
        return (f"{len(self.compiled)} Triton kernels compiled for sm_{self.arch} "
                f"({len(self.cached)} already cached, {len(self.failed)} failed, "
                f"{len(self.pending)} not done) on {self.workers} processes in "
                f"{self.seconds:.1f} s")


class _TargetDriver:
    """Triton's driver as its JIT asks it while compiling for ``sm_<arch>`` without launching:
    the target, device 0, a null stream (``triton.runtime.driver.set_active``)."""

    def __init__(self, arch: int) -> None:
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", arch, 32)

    def get_current_target(self) -> Any:
        return self.target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0


def launch_args(spec: KernelSpec) -> list[Any]:
    """The run-time arguments ``EmittedKernel.launch`` passes for ``spec``, as the JIT
    specialises them: a tensor by its dtype (``torch.dtype``: Triton's ``MockTensor``, 16-byte
    aligned as every tensor torch allocates), a number by its type. Local: ``w, v, g, z, acc``
    and ``lr, momentum, weight_decay, alpha``; central: ``z, z_prev, c`` and ``central_momentum``;
    the hyper-parameters 0-dim float32 tensors with ``hyper_ptr``, else numbers."""
    if spec.kind == "sma_local":
        pointers = [torch.float32, torch.float32, spec.dtype, torch.float32, torch.float32]
        hyper = 4
    else:
        pointers, hyper = [torch.float32] * 3, 1
    return pointers + ([torch.float32] if spec.hyper_ptr else [0.5]) * hyper


def compile_spec(spec: KernelSpec, arch: int) -> tuple[str, bool | None, float]:
    """Compile ``spec`` for ``sm_<arch>`` into Triton's cache as a launch would, in this process
    (which must launch no Triton kernel afterwards: Triton's driver stays the stand-in).
    Returns (the spec's line, whether the cache had it (None: this Triton cannot say), seconds).
    Raises ImportError without triton; Triton's own errors when the compilation fails."""
    triton_sma.import_triton()
    from triton import knobs
    from triton.runtime.driver import driver
    from triton.runtime.jit import JITFunction

    hits: list[bool] = []
    driver.set_active(_TargetDriver(arch))
    listens = hasattr(knobs.compilation, "listener")
    if listens:
        knobs.compilation.listener = lambda **kw: hits.append(bool(kw.get("cache_hit")))
    t0 = time.perf_counter()
    fn = JITFunction(triton_sma.kernel_body(spec.kind))  # compiled even under TRITON_INTERPRET=1
    fn.warmup(*launch_args(spec), grid=spec.grid, **spec.constexprs, num_warps=spec.num_warps,
              enable_fp_fusion=FP_FUSION)
    return spec.describe(), (hits[-1] if hits else None) if listens else None, \
        time.perf_counter() - t0


def precompile(specs: Iterable[KernelSpec], *, arch: int = 90, workers: int | None = None,
               timeout_s: float | None = None) -> PrecompileResult:
    """Compile every CUDA ``spec`` of ``specs`` (others are skipped; duplicates once) for
    ``sm_<arch>`` in ``workers`` processes (default: the CPUs less one, at most one per spec),
    into Triton's on-disk cache (``compile_spec``); specs not done within ``timeout_s`` are left
    pending and their workers stopped. The workers are forked where the platform can: start it
    before this process initialises CUDA. Raises ImportError without triton."""
    triton_sma.import_triton()
    todo = list(dict.fromkeys(s for s in specs if s.device_type == "cuda"))
    workers = max(1, min(workers or max(1, (os.cpu_count() or 2) - 1), len(todo) or 1))
    result = PrecompileResult(arch=arch, workers=workers)
    t0 = time.perf_counter()
    deadline = math.inf if timeout_s is None else t0 + timeout_s
    methods = multiprocessing.get_all_start_methods()
    context = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
    with context.Pool(workers) as pool:  # its exit stops the workers still compiling
        jobs = [(spec, pool.apply_async(_compile_reporting, (spec, arch))) for spec in todo]
        for spec, job in jobs:
            left = deadline - time.perf_counter()
            try:
                line, hit, error = job.get(None if math.isinf(left) else max(0.0, left))
            except multiprocessing.TimeoutError:
                result.pending.append(spec.describe())
                continue
            if error is not None:
                result.failed.append((line, error))
            else:
                (result.cached if hit else result.compiled).append(line)
    result.seconds = time.perf_counter() - t0
    return result


def _compile_reporting(spec: KernelSpec, arch: int) -> tuple[str, bool | None, str | None]:
    """``compile_spec`` in a worker: (the spec's line, cache hit, None) or (line, None, the
    error as text: Triton's exceptions do not all pickle)."""
    try:
        line, hit, _ = compile_spec(spec, arch)
    except Exception as exc:  # noqa: BLE001 - a spec that does not build is reported, not raised
        return spec.describe(), None, f"{type(exc).__name__}: {str(exc)[:300]}"
    return line, hit, None
