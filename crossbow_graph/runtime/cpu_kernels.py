"""SMA update kernels in C for the CPU: the ``"c"`` kernel backend (DESIGN.md §2 steps 1–3, §4).

``sma_cpu.c`` (next to this file) does the local update of a device's m replicas in one pass
over memory, where the torch implementation (runtime/sma.py, the oracle) makes about eight: on
this 2-core CPU one LeNet-5 replica's update took 16 µs against 67 µs (docs/runtime.md). It is
compiled on first use with the system's C compiler (``$CC``, else ``cc``) at ``-O3
-march=native`` and cached as a shared library under ``$CROSSBOW_GRAPH_CACHE`` (default
``~/.cache/crossbow_graph``), keyed by the source, the flags and the CPU, written atomically (a
temporary file renamed into place), so concurrent processes (torchrun) never load half a file.
Without a compiler ``compile(kernel_backend="auto")`` keeps the torch backend, and
``kernel_backend="c"`` raises with the compiler's message.

The kernels are called through ctypes (which releases the GIL) on the tensors' memory; only
float32 CPU tensors with unit column stride take the C path, anything else (a bfloat16 model's
gradients, a strided view) the torch implementation, with the same results to float rounding.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sysconfig
import tempfile
from pathlib import Path

import torch

from .sma import sma_central_update, sma_local_update

__all__ = ["CSMAKernels", "c_kernels_available", "load_library", "SOURCE_PATH", "CompilerError"]

SOURCE_PATH = Path(__file__).with_name("sma_cpu.c")
_FLAGS = ("-O3", "-march=native", "-fPIC", "-shared")
_PORTABLE_FLAGS = ("-O3", "-fPIC", "-shared")  # when the compiler does not know -march=native

_lib: ctypes.CDLL | None = None
_load_error: str | None = None


class CompilerError(RuntimeError):
    """The C kernels could not be built (no C compiler, or it failed); the message says why."""


def _cache_dir() -> Path:
    root = os.environ.get("CROSSBOW_GRAPH_CACHE")
    if root:
        return Path(root)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "crossbow_graph"


def _cpu_id() -> str:
    """What -march=native depends on: the machine and, on Linux, the CPU's feature flags."""
    flags = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        pass
    return f"{platform.machine()} {platform.processor()} {flags}"


def _compiler() -> str | None:
    cc = os.environ.get("CC") or (sysconfig.get_config_var("CC") or "").split(" ")[0] or "cc"
    return shutil.which(cc) or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def _build(source: bytes, cc: str, target: Path) -> None:
    """Compile ``source`` into ``target`` atomically. Raises CompilerError with the output."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "sma_cpu.c"
        src.write_bytes(source)
        errors = []
        for flags in (_FLAGS, _PORTABLE_FLAGS):
            out = Path(tmp) / "sma_cpu.so"
            run = subprocess.run([cc, *flags, "-o", str(out), str(src)], capture_output=True,
                                 text=True, timeout=120)
            if run.returncode == 0:
                staged = target.with_name(f".{target.name}.{os.getpid()}.tmp")
                shutil.copyfile(out, staged)
                os.replace(staged, target)  # atomic: another process sees the old file or this one
                return
            errors.append(f"{cc} {' '.join(flags)}: {run.stderr.strip()[-2000:]}")
    raise CompilerError("; ".join(errors))


def load_library() -> ctypes.CDLL:
    """The compiled kernels (built on first use, then cached; once per process).

    Raises:
        CompilerError: no C compiler was found, or it failed (the message has its output);
            set ``$CC`` to a working compiler, or use ``kernel_backend="torch"``.
    """
    global _lib, _load_error
    if _lib is not None:
        return _lib
    if _load_error is not None:
        raise CompilerError(_load_error)
    try:
        cc = _compiler()
        if cc is None:
            raise CompilerError("no C compiler found (looked for $CC, cc, gcc, clang)")
        source = SOURCE_PATH.read_bytes()
        key = hashlib.sha256(b"\0".join([source, cc.encode(), " ".join(_FLAGS).encode(),
                                         _cpu_id().encode()])).hexdigest()[:16]
        target = _cache_dir() / f"sma_cpu-{key}.so"
        if not target.exists():
            try:
                _build(source, cc, target)
            except OSError:  # the cache directory is not writable: build in a temporary one
                target = Path(tempfile.mkdtemp(prefix="crossbow_graph-")) / target.name
                _build(source, cc, target)
        lib = ctypes.CDLL(str(target))
    except (CompilerError, OSError, subprocess.SubprocessError) as exc:
        _load_error = f"the C kernels (runtime/sma_cpu.c) could not be built: {exc}"
        raise CompilerError(_load_error) from exc
    i64, f32, ptr, i32 = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p, ctypes.c_int
    lib.sma_local.argtypes = [i64, i64, ptr, i64, ptr, i64, ptr, i64, ptr, ptr, f32, f32, f32, f32,
                              i32, i32, i32, i32]
    lib.sma_local.restype = None
    lib.sma_central.argtypes = [i64, ptr, ptr, ptr, f32]
    lib.sma_central.restype = None
    lib.sma_central_sum.argtypes = [i64, i64, ptr, i64, ptr, ptr, f32]
    lib.sma_central_sum.restype = None
    lib.sma_rows_nonfinite.argtypes = [i64, i64, ptr, i64, ptr]
    lib.sma_rows_nonfinite.restype = i64
    _lib = lib
    return lib


def c_kernels_available() -> bool:
    """Whether the C kernels build and load on this machine (the result is kept)."""
    try:
        load_library()
    except CompilerError:
        return False
    return True


def _rows_ok(t: torch.Tensor, shape: tuple[int, int]) -> bool:
    """float32 on the CPU, of ``shape``, each row contiguous."""
    return (t.dtype == torch.float32 and t.device.type == "cpu" and tuple(t.shape) == shape
            and (shape[1] <= 1 or t.stride(1) == 1))


def _vec_ok(t: torch.Tensor | None, P: int) -> bool:
    return (t is not None and t.dtype == torch.float32 and t.device.type == "cpu"
            and tuple(t.shape) == (P,) and t.is_contiguous())


class CSMAKernels:
    """The SMA update backend in C (CPU): ``local_update`` and ``central_update`` with the
    signatures and semantics of ``sma_local_update``/``sma_central_update`` (runtime/sma.py, the
    oracle; results agree to float rounding: the C code may fuse a·b + c), and ``all_finite``
    for the fault check (runtime/faults.py).

    Tensors that are not float32 CPU tensors with contiguous rows go to the torch functions.

    Raises:
        CompilerError: at construction, when the kernels cannot be built (see ``load_library``).
    """

    name = "c"

    def __init__(self) -> None:
        self._lib = load_library()

    @torch.no_grad()
    def local_update(self, w: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                     z: torch.Tensor | None, *, lr: float, momentum: float, nesterov: bool,
                     weight_decay: float, alpha: float, first_step: bool = False,
                     out: torch.Tensor | None = None) -> torch.Tensor | None:
        """See ``crossbow_graph.runtime.sma.sma_local_update``: ``w, v, g [m, P]``, ``z [P]`` or
        None; returns ``acc [P]`` (written into ``out [P]`` when given), or None without a
        correction."""
        m, P = w.shape
        correct = z is not None and alpha != 0
        if not (_rows_ok(w, (m, P)) and _rows_ok(g, (m, P))
                and (momentum == 0 or _rows_ok(v, (m, P))) and (not correct or _vec_ok(z, P))
                and (out is None or _vec_ok(out, P))):
            return sma_local_update(w, v, g, z, lr=lr, momentum=momentum, nesterov=nesterov,
                                    weight_decay=weight_decay, alpha=alpha, first_step=first_step,
                                    out=out)
        acc = None
        if correct:
            acc = out if out is not None else torch.empty(P, dtype=torch.float32)
        has_v = momentum != 0
        self._lib.sma_local(m, P, w.data_ptr(), w.stride(0), v.data_ptr() if has_v else None,
                            v.stride(0) if has_v else 0, g.data_ptr(), g.stride(0),
                            z.data_ptr() if correct else None, acc.data_ptr() if correct else None,
                            lr, momentum, weight_decay, alpha if correct else 0.0, int(has_v),
                            int(has_v and bool(nesterov)), int(has_v and bool(first_step)),
                            int(correct))
        torch.autograd.graph.increment_version([w, v] if has_v else [w])  # written outside torch
        return acc

    @torch.no_grad()
    def central_update(self, z: torch.Tensor, z_prev: torch.Tensor, c: torch.Tensor, *,
                       central_momentum: float) -> None:
        """See ``crossbow_graph.runtime.sma.sma_central_update``: ``z, z_prev, c [P]``."""
        P = z.shape[0]
        if not (_vec_ok(z, P) and _vec_ok(z_prev, P) and _vec_ok(c, P)):
            sma_central_update(z, z_prev, c, central_momentum=central_momentum)
            return
        self._lib.sma_central(P, z.data_ptr(), z_prev.data_ptr(), c.data_ptr(), central_momentum)
        torch.autograd.graph.increment_version([z, z_prev])

    @torch.no_grad()
    def central_update_shared(self, zs: list[torch.Tensor], z_prevs: list[torch.Tensor],
                              parts: list[torch.Tensor], *, central_momentum: float) -> None:
        """The central update of CPU devices that share one memory, with the sum of their
        corrections and the copies of z fused into one pass: ``C = Σ parts`` (in order), then
        ``sma_central_update(zs[0], z_prevs[0], C)`` and every ``zs[d], z_prevs[d]`` set to
        ``zs[0], z_prevs[0]``. All ``[P]`` float32 (else the same steps in torch)."""
        P = zs[0].shape[0]
        if not all(_vec_ok(t, P) for t in (*zs, *z_prevs, *parts)) or len(zs) != len(z_prevs):
            total = parts[0].clone()
            for part in parts[1:]:
                total += part
            sma_central_update(zs[0], z_prevs[0], total, central_momentum=central_momentum)
            for z, z_prev in zip(zs[1:], z_prevs[1:]):
                z.copy_(zs[0])
                z_prev.copy_(z_prevs[0])
            return
        arrays = [(ctypes.c_void_p * len(ts))(*(t.data_ptr() for t in ts))
                  for ts in (parts, zs, z_prevs)]
        self._lib.sma_central_sum(P, len(parts), arrays[0], len(zs), arrays[1], arrays[2],
                                  central_momentum)
        torch.autograd.graph.increment_version([*zs, *z_prevs])

    def nonfinite_rows(self, g: torch.Tensor) -> list[int] | None:
        """The rows of ``g [n, P]`` holding a NaN or Inf (``[]`` when all are finite), in one
        read of g; None when g does not take the C path (the caller tests it in torch)."""
        n, P = g.shape
        if not _rows_ok(g, (n, P)):
            return None
        bad = (ctypes.c_uint8 * n)()
        if self._lib.sma_rows_nonfinite(n, P, g.data_ptr(), g.stride(0), bad) == 0:
            return []
        return [j for j in range(n) if bad[j]]
