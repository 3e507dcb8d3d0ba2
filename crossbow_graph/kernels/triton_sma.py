"""SMA update kernels in Triton, emitted for a plan (docs/design-overview.md §2 steps 1–3, §4).

Two kernels per plan:

* ``sma_local`` — one launch per device per round: from ``W, V, G [m, P]`` and ``Z [P]`` it applies
  each replica's local SGD step (torch.optim.SGD semantics: weight decay, momentum, Nesterov, the
  first step copying d into the momentum buffer) and the correction ``c_j = α(ŵ_j − z)`` at the
  pre-step point, writes ``W`` and ``V`` and the device sum ``acc_d = Σ_j c_j [P]``. Each program
  owns one block of P columns and loops over the m replicas in registers: one pass over memory,
  no atomics.
* ``sma_central`` — ``z_new = z + C + μ_z(z − z_prev)``, ``z_prev ← z``.

Emission: a kernel is specialised to a ``KernelSpec`` — m, P, the gradients' dtype, the block
and the options — which Triton receives as ``tl.constexpr`` compile-time constants, so each spec
compiles to its own binary with the disabled branches removed. Emitted kernels are cached by spec
(`emit`), and a plan lists the ones it runs (``Plan.kernels``); ``EmittedKernel.source`` prints
what runs (the Triton source with its specialisation; on CUDA, after the first launch, the
compiled TTIR/PTX in ``EmittedKernel.asm``).

On CPU tensors the kernels run in Triton's interpreter (what ``TRITON_INTERPRET=1`` selects;
slow, for tests). Triton reads ``TRITON_INTERPRET`` when ``@triton.jit`` decorates a function,
and ``triton.language`` decorates its own helpers (``tl.zeros``, ``tl.sum``…) when it is first
imported; so the kernels below use only core builtins, and the emitter builds the interpreted
function itself for CPU tensors: they run whether or not the variable was set, and whenever
triton was imported. This module imports triton only when a kernel is first emitted.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

import torch

from .torch_ref import sma_central_update, sma_local_update

__all__ = ["KernelSpec", "EmittedKernel", "TritonSMAKernels", "emit", "local_spec", "central_spec",
           "default_block", "import_triton", "device_type"]

triton: Any = None  # the triton module, imported by import_triton()
tl: Any = None  # triton.language, resolved by the kernels' bodies at compile/run time

FP_FUSION = True  # a·b + c in one rounding on the GPU (as torch's fused CPU kernels do)
_INSTALL_HINT = ("install it with `pip install 'triton==3.9.0'` (or `pip install "
                 "'crossbow_graph[triton]'`), or use kernel_backend='torch'")


def import_triton() -> None:
    """Import triton on first use; ImportError with the install command if it is missing."""
    global triton, tl
    if triton is not None:
        return
    try:
        import triton as _triton
        import triton.language as _tl
    except ImportError as exc:
        raise ImportError(f"kernel_backend='triton' needs the triton package, which is not "
                          f"installed: {_INSTALL_HINT}") from exc
    triton, tl = _triton, _tl


# -- the Triton kernels (bodies use tl.* core builtins only; see the module docstring) ----------

def sma_local_kernel(
    w_ptr,  # [M, P] float32, row-major: replicas' parameters; read ŵ, written w (master copy)
    v_ptr,  # [M, P] float32: momentum buffers, read and written (untouched unless MOMENTUM)
    g_ptr,  # [M, P] gradients at ŵ, float32/bfloat16/float16 (read, upcast to float32)
    z_ptr,  # [P] float32: the device's central model z (read only if CORRECT)
    acc_ptr,  # [P] float32: out, acc_d = Σ_j c_j (written only if CORRECT)
    lr,  # float32 scalar: learning rate η (run-time: policies change it)
    momentum,  # float32 scalar: μ_l
    weight_decay,  # float32 scalar: λ
    alpha,  # float32 scalar: α, the pull toward z (run-time: re-derived when k changes)
    P: tl.constexpr,  # parameters per replica (row length)
    M: tl.constexpr,  # replicas on the device (rows), unrolled
    BLOCK: tl.constexpr,  # columns per program (a power of two)
    MOMENTUM: tl.constexpr,  # μ_l ≠ 0: keep and use V
    NESTEROV: tl.constexpr,  # u = d + μ_l·v instead of u = v
    WEIGHT_DECAY: tl.constexpr,  # λ ≠ 0: d = g + λ·ŵ
    FIRST_STEP: tl.constexpr,  # V holds nothing yet: v ← d (torch.optim.SGD's first step)
    CORRECT: tl.constexpr,  # apply c_j = α(ŵ_j − z) and write acc_d (a synchronising round)
    INT64: tl.constexpr,  # M·P ≥ 2^31: index in 64 bits
):
    pid = tl.program_id(0)
    cols = pid * BLOCK + tl.arange(0, BLOCK)  # [BLOCK] this program's columns
    if INT64:
        cols = cols.to(tl.int64)
    mask = cols < P
    if CORRECT:
        z = tl.load(z_ptr + cols, mask=mask)  # read once, reused for all M replicas
    for j in tl.static_range(M):
        offs = j * P + cols
        w = tl.load(w_ptr + offs, mask=mask)  # ŵ_j, the pre-step point
        d = tl.load(g_ptr + offs, mask=mask).to(tl.float32)
        if WEIGHT_DECAY:
            d = d + weight_decay * w
        if MOMENTUM:
            if FIRST_STEP:
                v = d
            else:
                v = momentum * tl.load(v_ptr + offs, mask=mask) + d
            tl.store(v_ptr + offs, v, mask=mask)
            if NESTEROV:
                u = d + momentum * v
            else:
                u = v
        else:
            u = d
        w_new = w - lr * u
        if CORRECT:
            c = alpha * (w - z)
            w_new = w_new - c
            if j == 0:
                acc = c
            else:
                acc = acc + c
        tl.store(w_ptr + offs, w_new, mask=mask)
    if CORRECT:
        tl.store(acc_ptr + cols, acc, mask=mask)


def sma_central_kernel(
    z_ptr,  # [P] float32: central model z, read, written z_new
    z_prev_ptr,  # [P] float32: z before the previous update, read (if MOMENTUM), written z
    c_ptr,  # [P] float32: C = Σ over all devices of acc_d (read)
    central_momentum,  # float32 scalar: μ_z
    P: tl.constexpr,  # parameters
    BLOCK: tl.constexpr,  # elements per program (a power of two)
    MOMENTUM: tl.constexpr,  # μ_z ≠ 0
):
    pid = tl.program_id(0)
    cols = pid * BLOCK + tl.arange(0, BLOCK)
    mask = cols < P
    z = tl.load(z_ptr + cols, mask=mask)
    step = tl.load(c_ptr + cols, mask=mask)
    if MOMENTUM:
        step = step + central_momentum * (z - tl.load(z_prev_ptr + cols, mask=mask))
    tl.store(z_prev_ptr + cols, z, mask=mask)
    tl.store(z_ptr + cols, z + step, mask=mask)


# -- specialisation, emission, cache -----------------------------------------------------------

_FLAGS = {"sma_local": ("MOMENTUM", "NESTEROV", "WEIGHT_DECAY", "FIRST_STEP", "CORRECT", "INT64"),
          "sma_central": ("MOMENTUM",)}
_BODIES = {"sma_local": sma_local_kernel, "sma_central": sma_central_kernel}


def default_block(P: int, device_type: str) -> int:
    """Columns per program: 1024 on CUDA (4 warps × 8 elements per thread); up to 8192 in the
    interpreter, whose cost is per program, not per element; never more than P rounded up."""
    cap = 1024 if device_type == "cuda" else 8192
    return max(16, min(cap, 1 << max(0, P - 1).bit_length()))


@dataclass(frozen=True)
class KernelSpec:
    """What an emitted kernel is specialised to (its ``tl.constexpr`` values and launch).

    Attributes:
        kind: ``"sma_local"`` or ``"sma_central"``.
        m: replicas per device (rows of W; 1 for sma_central).
        P: parameters per replica.
        dtype: the gradients' dtype (the model's: float32, bfloat16 or float16); W, V, Z, acc are
            float32 (the fp32 masters of a low-precision model).
        block: columns per program (power of two); the grid is ceil(P / block) programs.
        flags: ``(name, value)`` of each boolean constexpr (MOMENTUM, NESTEROV, …).
        device_type: ``"cuda"`` (compiled) or ``"cpu"`` (Triton's interpreter).
    """

    kind: str
    m: int
    P: int
    dtype: torch.dtype
    block: int
    flags: tuple[tuple[str, bool], ...]
    device_type: str

    @property
    def constexprs(self) -> dict[str, int | bool]:
        """The compile-time constants passed to the kernel."""
        out: dict[str, int | bool] = {"P": self.P}
        if self.kind == "sma_local":
            out["M"] = self.m
        out["BLOCK"] = self.block
        out.update(self.flags)
        return out

    @property
    def grid(self) -> tuple[int]:
        return ((self.P + self.block - 1) // self.block,)

    def describe(self, launch: bool = True) -> str:
        """One line: kind, m, P, dtype, flags; with ``launch``, the block and the grid too."""
        flags = ", ".join(f"{k}={int(v)}" for k, v in self.flags if launch or k != "INT64")
        dtype = str(self.dtype).removeprefix("torch.")
        if not launch:
            return f"{self.kind}[m={self.m}, P={self.P:,}, dtype={dtype}, {flags}]"
        return (f"{self.kind}[m={self.m}, P={self.P:,}, dtype={dtype}, BLOCK={self.block}, "
                f"{flags}] grid={self.grid[0]}")


def local_spec(m: int, P: int, dtype: torch.dtype, device_type: str, *, momentum: float,
               nesterov: bool, weight_decay: float, first_step: bool, correct: bool,
               block: int | None = None) -> KernelSpec:
    """The spec of the local kernel for these options (flags normalised: no momentum ⇒ no
    Nesterov, no first step)."""
    has_mom = momentum != 0
    flags = (("MOMENTUM", has_mom), ("NESTEROV", has_mom and bool(nesterov)),
             ("WEIGHT_DECAY", weight_decay != 0), ("FIRST_STEP", has_mom and bool(first_step)),
             ("CORRECT", bool(correct)), ("INT64", m * P >= 2**31))
    return KernelSpec("sma_local", m, P, dtype, block or default_block(P, device_type), flags,
                      device_type)


def central_spec(P: int, device_type: str, *, central_momentum: float,
                 block: int | None = None, dtype: torch.dtype = torch.float32) -> KernelSpec:
    """The spec of the central kernel (``dtype``: the masters', z's)."""
    return KernelSpec("sma_central", 1, P, dtype, block or default_block(P, device_type),
                      (("MOMENTUM", central_momentum != 0),), device_type)


@dataclass(eq=False)
class EmittedKernel:
    """A Triton kernel emitted for one KernelSpec.

    Attributes:
        spec: its specialisation.
        fn: the ``triton.jit`` function (CUDA) or Triton's ``InterpretedFunction`` (CPU).
        launches: how many times it ran.
        asm: on CUDA after the first launch, the compiled code by stage (``"ttir"``, ``"ttgir"``,
            ``"llir"``, ``"ptx"``); empty in the interpreter.
    """

    spec: KernelSpec
    fn: Any
    launches: int = 0
    asm: dict[str, Any] = field(default_factory=dict)

    backend = "triton"

    @property
    def mode(self) -> str:
        return "Triton JIT (compiled)" if self.spec.device_type == "cuda" else "Triton interpreter"

    @property
    def source(self) -> str:
        """The Triton source that runs, preceded by the constexpr values it is compiled with."""
        head = [f"# {self.spec.describe()} — {self.mode}", "# tl.constexpr specialisation:"]
        head += [f"#   {k} = {v!r}" for k, v in self.spec.constexprs.items()]
        return "\n".join(head) + "\n" + inspect.getsource(_BODIES[self.spec.kind])

    def launch(self, *args: Any, num_warps: int = 4) -> None:
        """Run the kernel on its grid with run-time ``args`` (pointers and scalars, in order;
        the first a tensor on the device to run on)."""
        if self.spec.device_type == "cuda":
            with torch.cuda.device(args[0].device):  # Triton launches on the current device
                compiled = self.fn[self.spec.grid](*args, **self.spec.constexprs,
                                                   num_warps=num_warps, enable_fp_fusion=FP_FUSION)
            if not self.asm and compiled is not None and hasattr(compiled, "asm"):
                self.asm = dict(compiled.asm)
        else:
            self.fn[self.spec.grid](*args, **self.spec.constexprs)
        self.launches += 1

    def lower(self, arch: int = 90, num_warps: int = 4) -> dict[str, Any]:
        """Compile this spec ahead of time for CUDA ``sm_<arch>`` — no GPU needed — and return
        the code by stage (``"ttir"``, ``"ttgir"``, ``"llir"``, ``"ptx"``, ``"cubin"``).

        This is what the JIT builds on a GPU of that architecture: the pointers are declared
        16-byte aligned, as the JIT specialises them for tensors torch allocates.
        """
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        from triton.runtime.jit import JITFunction

        fn = JITFunction(_BODIES[self.spec.kind])  # compiled even under TRITON_INTERPRET=1
        const = self.spec.constexprs
        signature = {name: "constexpr" if name in const else _ARG_TYPES[name]
                     for name in fn.arg_names}
        if self.spec.kind == "sma_local":
            signature["g_ptr"] = "*" + _TRITON_DTYPE[self.spec.dtype]
        # the JIT's specialisation: every tensor torch allocates is 16-byte aligned
        aligned = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
                   if name.endswith("_ptr")}
        src = ASTSource(fn, signature,
                        constexprs={(fn.arg_names.index(k),): v for k, v in const.items()},
                        attrs=aligned)
        compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                                  options={"num_warps": num_warps, "enable_fp_fusion": FP_FUSION})
        return dict(compiled.asm)

    def __repr__(self) -> str:
        return f"<{self.spec.describe()}, {self.mode}, {self.launches} launches>"


_TRITON_DTYPE = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
_ARG_TYPES = {"w_ptr": "*fp32", "v_ptr": "*fp32", "g_ptr": "*fp32", "z_ptr": "*fp32",
              "acc_ptr": "*fp32", "z_prev_ptr": "*fp32", "c_ptr": "*fp32", "lr": "fp32",
              "momentum": "fp32", "weight_decay": "fp32", "alpha": "fp32",
              "central_momentum": "fp32"}


_CACHE: dict[KernelSpec, EmittedKernel] = {}
_FUNCTIONS: dict[tuple[str, str], Any] = {}


def emit(spec: KernelSpec) -> EmittedKernel:
    """The kernel for ``spec``, emitted once and cached (one compile per spec on CUDA).

    Raises:
        ImportError: triton is not installed (the message says how to install it).
    """
    hit = _CACHE.get(spec)
    if hit is not None:
        return hit
    import_triton()
    key = (spec.kind, spec.device_type)
    fn = _FUNCTIONS.get(key)
    if fn is None:
        body = _BODIES[spec.kind]
        if spec.device_type == "cuda":
            fn = triton.jit(body)  # honours TRITON_INTERPRET=1 too
        else:
            from triton.runtime.interpreter import InterpretedFunction
            fn = InterpretedFunction(body)
        _FUNCTIONS[key] = fn
    kernel = _CACHE[spec] = EmittedKernel(spec, fn)
    return kernel


def device_type(t: torch.Tensor) -> str:
    return "cuda" if t.is_cuda else "cpu"


def _check_master(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    if t.dtype != torch.float32 or tuple(t.shape) != shape or not t.is_contiguous():
        raise TypeError(f"{name} must be a contiguous float32 tensor of shape {list(shape)} "
                        f"(the fp32 master copy), got {t.dtype} {list(t.shape)}"
                        f"{'' if t.is_contiguous() else ' (not contiguous)'}")


class TritonSMAKernels:
    """The SMA update backend in Triton (a ``kernels.protocol.SMAKernels``): ``local_update`` and
    ``central_update`` with the signatures and semantics of ``sma_local_update``/``sma_central_update``
    (kernels/torch_ref.py), each one kernel launch (docs/design-overview.md §4); the fused passes
    of the C backend decline (``central_update_shared`` False, ``nonfinite_rows`` None). CUDA
    tensors run compiled kernels; CPU tensors run them in Triton's interpreter (slow; for tests).

    Args:
        block: columns per program; None picks ``default_block(P, device)``.

    Raises (from the methods):
        ImportError: triton is not installed.
        TypeError: W, V, Z, acc are not contiguous float32 (G may be float32/bfloat16/float16).
    """

    name = "triton"

    def __init__(self, *, block: int | None = None) -> None:
        if block is not None and (block < 1 or block & (block - 1)):
            raise ValueError(f"block={block}: must be a power of two, e.g. 1024")
        self.block = block

    @torch.no_grad()
    def local_update(self, w: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                     z: torch.Tensor | None, *, lr: float, momentum: float, nesterov: bool,
                     weight_decay: float, alpha: float, first_step: bool = False,
                     out: torch.Tensor | None = None) -> torch.Tensor | None:
        """See ``crossbow_graph.kernels.torch_ref.sma_local_update`` (the oracle): ``w, v, g [m, P]``,
        ``z [P]`` or None; returns ``acc [P]`` float32 (in ``out`` when given), or None without a
        correction."""
        m, P = w.shape
        _check_master("w", w, (m, P))
        if momentum != 0:
            _check_master("v", v, (m, P))
        if tuple(g.shape) != (m, P) or not g.is_contiguous() or g.dtype not in _TRITON_DTYPE:
            raise TypeError(f"g must be a contiguous float32, bfloat16 or float16 tensor of shape "
                            f"{[m, P]}, got {g.dtype} {list(g.shape)}")
        correct = z is not None and alpha != 0
        if correct:
            _check_master("z", z, (P,))
        spec = local_spec(m, P, g.dtype, device_type(w), momentum=momentum, nesterov=nesterov,
                          weight_decay=weight_decay, first_step=first_step, correct=correct,
                          block=self.block)
        acc = None
        if correct:
            acc = out if out is not None else torch.empty(P, dtype=torch.float32, device=w.device)
            _check_master("out", acc, (P,))
        emit(spec).launch(w, v if momentum != 0 else w, g, z if correct else w,
                          acc if correct else w, float(lr), float(momentum), float(weight_decay),
                          float(alpha))
        torch.autograd.graph.increment_version([w, v])  # written outside torch's view
        return acc

    @torch.no_grad()
    def central_update(self, z: torch.Tensor, z_prev: torch.Tensor, c: torch.Tensor, *,
                       central_momentum: float) -> None:
        """See ``crossbow_graph.kernels.torch_ref.sma_central_update``: ``z, z_prev, c [P]`` float32."""
        P = z.shape[0]
        for name, t in (("z", z), ("z_prev", z_prev), ("c", c)):
            _check_master(name, t, (P,))
        spec = central_spec(P, device_type(z), central_momentum=central_momentum,
                            block=self.block)
        emit(spec).launch(z, z_prev, c, float(central_momentum))
        torch.autograd.graph.increment_version([z, z_prev])

    @staticmethod
    def central_update_shared(zs: list[torch.Tensor], z_prevs: list[torch.Tensor],
                              parts: list[torch.Tensor], *, central_momentum: float) -> bool:
        """No one-pass update of several devices' z: False (the scheduler sums in torch and
        calls ``central_update``)."""
        return False

    @staticmethod
    def nonfinite_rows(g: torch.Tensor) -> list[int] | None:
        """No row test in Triton: None (engine/faults.py tests the rows in torch)."""
        return None
