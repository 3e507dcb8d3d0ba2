"""The ``"c"`` kernel backend: ``sma_cpu.c``, built on first use and cached, called through
ctypes (docs/kernels.md, "The C kernels")."""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shlex
import shutil
import subprocess
import sysconfig
import tempfile
import threading
from pathlib import Path

import torch

from ..errors import CompilerError
from .torch_ref import any_tensor, is_on, sma_central_update, sma_local_update

__all__ = ["CSMAKernels", "c_kernels_available", "load_library", "SOURCE_PATH", "CompilerError"]

log = logging.getLogger("crossbow_graph.kernels")

SOURCE_PATH = Path(__file__).with_name("sma_cpu.c")
_FLAGS = ("-O3", "-march=native", "-fPIC", "-shared")
_PORTABLE_FLAGS = ("-O3", "-fPIC", "-shared")  # when the compiler does not know -march=native
_FIX = ("install a C compiler (e.g. `apt-get install gcc`), point $CC at one, or use "
        "kernel_backend='torch'")

_lib: ctypes.CDLL | None = None
_load_error: str | None = None
_lock = threading.Lock()  # one build per process, even from threads


def _cache_dir() -> Path:
    root = os.environ.get("CROSSBOW_GRAPH_CACHE")
    if root:
        return Path(root)
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
        return Path(xdg) / "crossbow_graph"
    try:
        return Path.home() / ".cache" / "crossbow_graph"
    except (RuntimeError, KeyError):  # no HOME and no passwd entry (a container's bare UID)
        return Path(tempfile.gettempdir()) / "crossbow_graph-cache"


def _cpu_id() -> str:
    """What -march=native depends on: the machine and, on Linux, the CPU's feature flags."""
    flags = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        pass
    return f"{platform.machine()} {platform.processor()} {flags}"


def _compiler() -> list[str] | None:
    """The compiler command (its executable's real path), or None; CompilerError when ``$CC``
    names no executable."""
    env = os.environ.get("CC")
    if env:
        words = shlex.split(env)
        exe = shutil.which(words[0]) if words else None
        if exe is None:
            raise CompilerError(f"$CC={env!r}: {words[0] if words else '(empty)'} is not an "
                                "executable on PATH; set $CC to a C compiler, or unset it")
        return [os.path.realpath(exe), *words[1:]]
    configured = (sysconfig.get_config_var("CC") or "").split()
    for name in ([configured[0]] if configured else []) + ["cc", "gcc", "clang"]:
        exe = shutil.which(name)
        if exe:
            return [os.path.realpath(exe)]
    return None


def _build(source: bytes, cc: list[str], target: Path) -> None:
    """Compile ``source`` into ``target`` atomically, its checksum beside it; CompilerError when
    the compiler fails, OSError when the directory is not writable."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "sma_cpu.c"
        src.write_bytes(source)
        errors = []
        for flags in (_FLAGS, _PORTABLE_FLAGS):
            out = Path(tmp) / "sma_cpu.so"
            run = subprocess.run([*cc, *flags, "-o", str(out), str(src)], capture_output=True,
                                 text=True, timeout=120)
            if run.returncode == 0:
                data = out.read_bytes()
                # unique temporary names (mkstemp), renamed into place: a reader sees no file or
                # a whole one, and the checksum is written only after the library it describes
                _write_atomic(target, data)
                _write_atomic(_checksum_path(target), hashlib.sha256(data).hexdigest().encode())
                return
            errors.append(f"{' '.join(cc)} {' '.join(flags)}: {run.stderr.strip()[-2000:]}")
    raise CompilerError("; ".join(errors))


def _write_atomic(path: Path, data: bytes) -> None:
    fd, staged = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(staged, 0o644)  # mkstemp's 0600 would keep a shared cache from other users
        os.replace(staged, path)
    except BaseException:
        Path(staged).unlink(missing_ok=True)
        raise


def _checksum_path(target: Path) -> Path:
    return target.with_name(target.name + ".sha256")


def _intact(target: Path) -> bool:
    """The cached library exists and matches its checksum."""
    try:
        want = _checksum_path(target).read_text().strip()
        return hashlib.sha256(target.read_bytes()).hexdigest() == want
    except OSError:
        return False


def load_library() -> ctypes.CDLL:
    """The compiled kernels, built once per process or taken from the cache.

    Raises:
        CompilerError: no C compiler was found, or it failed, now or earlier in the process
            (its output and the fixes)."""
    global _lib, _load_error
    with _lock:
        if _lib is not None:
            return _lib
        if _load_error is not None:
            raise CompilerError(_load_error)
        try:
            cc = _compiler()
            if cc is None:
                raise CompilerError("no C compiler found (looked for $CC, Python's configured "
                                    "compiler, cc, gcc, clang)")
            source = SOURCE_PATH.read_bytes()
            key = hashlib.sha256(b"\0".join([source, " ".join(cc).encode(), " ".join(_FLAGS).encode(),
                                             _cpu_id().encode()])).hexdigest()[:16]
            target = _cache_dir() / f"sma_cpu-{key}.so"
            if not _intact(target):
                try:
                    _build(source, cc, target)
                except OSError as exc:  # the cache directory is not writable
                    tmp = Path(tempfile.mkdtemp(prefix="crossbow_graph-"))
                    log.warning("the C kernels' cache %s is not writable (%s): building them in %s "
                                "for this process; set $CROSSBOW_GRAPH_CACHE to a writable directory",
                                target.parent, exc, tmp)
                    target = tmp / target.name
                    _build(source, cc, target)
            lib = ctypes.CDLL(str(target))
        except Exception as exc:  # noqa: BLE001 - every failure becomes one CompilerError
            why = exc if isinstance(exc, CompilerError) else f"{type(exc).__name__}: {exc}"
            _load_error = (f"the C kernels (kernels/sma_cpu.c) could not be built or loaded: {why}. "
                           f"To fix: {_FIX}")
            raise CompilerError(_load_error) from exc
        i64, f32, ptr, i32 = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p, ctypes.c_int
        lib.sma_local.argtypes = [i64, i64, ptr, i64, ptr, i64, ptr, i64, ptr, ptr, f32, f32, f32,
                                  f32, i32, i32, i32, i32]
        lib.sma_local.restype = None
        lib.sma_central_sum.argtypes = [i64, i64, ptr, i64, ptr, ptr, f32]
        lib.sma_central_sum.restype = None
        lib.sma_rows_nonfinite.argtypes = [i64, i64, ptr, i64, ptr]
        lib.sma_rows_nonfinite.restype = i64
        _lib = lib
        log.debug("C kernels loaded from %s", target)
        return lib


def c_kernels_available() -> bool:
    """Whether the C kernels build and load on this machine (the result is kept)."""
    try:
        load_library()
    except CompilerError as exc:
        log.info("kernel_backend='auto' keeps the torch kernels on the CPU: %s", exc)
        return False
    return True


def _rows_ok(t: torch.Tensor, shape: tuple[int, int]) -> bool:
    """float32 on the CPU, of ``shape`` (at least one row), each row contiguous, rows apart."""
    m, P = shape
    return (t.dtype == torch.float32 and t.device.type == "cpu" and tuple(t.shape) == shape
            and m >= 1 and (P <= 1 or t.stride(1) == 1) and (m == 1 or t.stride(0) >= P))


def _vec_ok(t: torch.Tensor | None, P: int) -> bool:
    return (t is not None and t.dtype == torch.float32 and t.device.type == "cpu"
            and tuple(t.shape) == (P,) and t.is_contiguous())


class CSMAKernels:
    """The ``SMAKernels`` backend in C, for float32 CPU tensors with contiguous rows (others go
    to the torch functions). Raises CompilerError when the kernels cannot be built."""

    name = "c"
    block = None

    def __init__(self) -> None:
        self._lib = load_library()

    def __reduce__(self):  # a copy (deepcopy, pickle) loads the library again: no pointers copied
        return (CSMAKernels, ())

    @torch.no_grad()
    def local_update(self, w: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                     z: torch.Tensor | None, *, lr: float, momentum: float, nesterov: bool,
                     weight_decay: float, alpha: float, first_step: bool = False,
                     out: torch.Tensor | None = None) -> torch.Tensor | None:
        """``torch_ref.sma_local_update`` in one pass."""
        m, P = w.shape
        correct = z is not None and is_on(alpha)
        if any_tensor(lr, momentum, weight_decay, alpha) or not (
                _rows_ok(w, (m, P)) and _rows_ok(g, (m, P))
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
        """``torch_ref.sma_central_update`` (``central_update_shared`` of one device)."""
        if not self.central_update_shared([z], [z_prev], [c], central_momentum=central_momentum):
            sma_central_update(z, z_prev, c, central_momentum=central_momentum)

    @torch.no_grad()
    def central_update_shared(self, zs: list[torch.Tensor], z_prevs: list[torch.Tensor],
                              parts: list[torch.Tensor], *, central_momentum: float) -> bool:
        """``SMAKernels.central_update_shared`` in one pass, for ``[P]`` float32 contiguous
        CPU tensors (else False)."""
        P = zs[0].shape[0]
        if any_tensor(central_momentum) or len(zs) != len(z_prevs) or \
                not all(_vec_ok(t, P) for t in (*zs, *z_prevs, *parts)):
            return False
        arrays = [(ctypes.c_void_p * len(ts))(*(t.data_ptr() for t in ts))
                  for ts in (parts, zs, z_prevs)]
        self._lib.sma_central_sum(P, len(parts), arrays[0], len(zs), arrays[1], arrays[2],
                                  central_momentum)
        torch.autograd.graph.increment_version([*zs, *z_prevs])
        return True

    def nonfinite_rows(self, g: torch.Tensor) -> list[int] | None:
        """The rows of ``g [n, P]`` holding a NaN or Inf, in one read; None off the C path."""
        n, P = g.shape
        if not _rows_ok(g, (n, P)):
            return None
        bad = (ctypes.c_uint8 * n)()
        if self._lib.sma_rows_nonfinite(n, P, g.data_ptr(), g.stride(0), bad) == 0:
            return []
        return [j for j in range(n) if bad[j]]
