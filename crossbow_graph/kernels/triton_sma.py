"""The SMA update kernels in Triton — ``sma_local`` (each replica's SGD step and correction,
acc_d = Σ_j α(ŵ_j − z)) and ``sma_central`` (z ← z + C + μ_z(z − z_prev)) — specialised to a
``KernelSpec``, emitted once and cached (docs/design-overview.md §2 steps 1–3, §4; the
equations, tunings and the interpreter: docs/kernels.md). triton is imported at the first emit."""

from __future__ import annotations

import inspect
import re
import subprocess
import tempfile
from dataclasses import dataclass, field
from typing import Any

import torch

from .torch_ref import Hyper, is_on, sma_central_update, sma_local_update

__all__ = ["KernelSpec", "EmittedKernel", "TritonSMAKernels", "emit", "local_spec", "central_spec",
           "default_block", "cubin_resources", "import_triton", "device_type", "kernel_body",
           "UNROLL_MAX", "TARGET_PROGRAMS"]

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


# -- the Triton kernels (bodies use tl.* core builtins only: docs/kernels.md, Backends) ----------

def sma_local_kernel(
    w_ptr,  # [M, P] float32, rows ROW_STRIDE apart: replicas' parameters; read ŵ, written w
    v_ptr,  # [M, P] float32, rows ROW_STRIDE apart: momentum buffers (untouched unless MOMENTUM)
    g_ptr,  # [M, P] float32/bfloat16/float16, rows ROW_STRIDE apart: gradients at ŵ (upcast)
    z_ptr,  # [P] float32: the device's central model z (read only if CORRECT)
    acc_ptr,  # [P] float32: out, acc_d = Σ_j c_j (written only if CORRECT)
    lr,  # float32 scalar, or with HYPER_PTR a pointer to it: learning rate η (run-time)
    momentum,  # float32 scalar (or pointer, HYPER_PTR): μ_l
    weight_decay,  # float32 scalar (or pointer, HYPER_PTR): λ
    alpha,  # float32 scalar (or pointer, HYPER_PTR): α, the pull toward z (run-time)
    P: tl.constexpr,  # parameters per replica (row length)
    ROW_STRIDE: tl.constexpr,  # elements from row j to row j+1 of W, V, G (≥ P; the pad unread)
    M: tl.constexpr,  # replicas on the device (rows)
    UNROLL: tl.constexpr,  # full blocks unroll the loop over the M rows UNROLL times (M: fully)
    BLOCK: tl.constexpr,  # columns per program (a power of two)
    MOMENTUM: tl.constexpr,  # μ_l ≠ 0: keep and use V
    NESTEROV: tl.constexpr,  # u = d + μ_l·v instead of u = v
    WEIGHT_DECAY: tl.constexpr,  # λ ≠ 0: d = g + λ·ŵ
    FIRST_STEP: tl.constexpr,  # V holds nothing yet: v ← d (torch.optim.SGD's first step)
    CORRECT: tl.constexpr,  # apply c_j = α(ŵ_j − z) and write acc_d (a synchronising round)
    INT64: tl.constexpr,  # M·ROW_STRIDE ≥ 2^31: index in 64 bits
    HYPER_PTR: tl.constexpr,  # lr … alpha point to 0-dim float32 tensors, read at every launch
):
    if HYPER_PTR:  # device memory, so that a captured launch (a CUDA graph) reads the current value
        lr = tl.load(lr)
        momentum = tl.load(momentum)
        weight_decay = tl.load(weight_decay)
        alpha = tl.load(alpha)
    pid = tl.program_id(0)
    cols = pid * BLOCK + tl.arange(0, BLOCK)  # [BLOCK] this program's columns
    if INT64:
        cols = cols.to(tl.int64)
    tail = pid >= P // BLOCK  # the last program, when BLOCK does not divide P
    # The body below is compiled twice when BLOCK does not divide P: unmasked for the full
    # blocks, where each thread moves 16-byte vectors when the rows are 16-byte aligned, and
    # masked for the tail, whose mask cols < P splits vectors when 4 does not divide P (one
    # program: its loop over the rows is not unrolled). Each program runs one of them.
    for MASKED in tl.static_range(2 if P % BLOCK else 1):
        if tail == MASKED:
            if MASKED:
                mask = cols < P
            else:
                mask = None
            if CORRECT:
                z = tl.load(z_ptr + cols, mask=mask)  # read once, reused for all M replicas
                acc = tl.full((BLOCK,), 0.0, tl.float32)  # Σ_j c_j, in registers
            w_row = w_ptr + cols  # [BLOCK] pointers into row j, advanced ROW_STRIDE per replica
            v_row = v_ptr + cols
            g_row = g_ptr + cols
            for _ in tl.range(0, M, loop_unroll_factor=1 if MASKED else UNROLL):
                w = tl.load(w_row, mask=mask)  # ŵ_j, the pre-step point
                d = tl.load(g_row, mask=mask).to(tl.float32)
                if WEIGHT_DECAY:
                    d = d + weight_decay * w
                if MOMENTUM:
                    if FIRST_STEP:
                        v = d
                    else:
                        v = momentum * tl.load(v_row, mask=mask) + d
                    tl.store(v_row, v, mask=mask)
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
                    acc = acc + c
                tl.store(w_row, w_new, mask=mask)
                w_row += ROW_STRIDE
                v_row += ROW_STRIDE
                g_row += ROW_STRIDE
            if CORRECT:
                tl.store(acc_ptr + cols, acc, mask=mask)


def sma_central_kernel(
    z_ptr,  # [P] float32: central model z, read, written z_new
    z_prev_ptr,  # [P] float32: z before the previous update, read (if MOMENTUM), written z
    c_ptr,  # [P] float32: C = Σ over all devices of acc_d (read)
    central_momentum,  # float32 scalar, or with HYPER_PTR a pointer to it: μ_z
    P: tl.constexpr,  # parameters
    BLOCK: tl.constexpr,  # elements per program (a power of two)
    MOMENTUM: tl.constexpr,  # μ_z ≠ 0
    HYPER_PTR: tl.constexpr,  # central_momentum points to a 0-dim float32 tensor
):
    if HYPER_PTR:
        central_momentum = tl.load(central_momentum)
    pid = tl.program_id(0)
    cols = pid * BLOCK + tl.arange(0, BLOCK)
    tail = pid >= P // BLOCK
    for MASKED in tl.static_range(2 if P % BLOCK else 1):  # as in sma_local_kernel
        if tail == MASKED:
            if MASKED:
                mask = cols < P
            else:
                mask = None
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


def kernel_body(kind: str) -> Any:
    """The Python function of kernel ``kind`` (``"sma_local"``, ``"sma_central"``), undecorated:
    what ``triton.jit`` compiles."""
    return _BODIES[kind]


UNROLL_MAX = 8  # the local kernel's loop over M rows is unrolled fully up to this M
TARGET_PROGRAMS = 2 * 132  # CUDA: the grid default_block aims for (2 programs per SM, 132 SMs)


def default_block(P: int, device_type: str) -> int:
    """Columns per program for P parameters, at most P rounded up to a power of two (≥ 16).
    CUDA: the largest power of two in [128, 1024] whose grid has ≥ ``TARGET_PROGRAMS``
    programs, else 128 (docs/kernels.md, CUDA tunings); the interpreter: up to 8192."""
    fit = 1 << max(0, P - 1).bit_length()  # P rounded up to a power of two
    if device_type == "cuda":
        block = 1024
        while block > 128 and -(-P // block) < TARGET_PROGRAMS:
            block //= 2
    else:
        block = 8192
    return max(16, min(block, fit))


@dataclass(frozen=True)
class KernelSpec:
    """What an emitted kernel is specialised to (its ``tl.constexpr`` values and launch).

    Attributes:
        kind: ``"sma_local"`` or ``"sma_central"``.
        m, P: rows of W (1 for sma_central) and parameters per replica.
        row_stride: elements from one row of W, V, G to the next (≥ P).
        dtype: the gradients' dtype (float32, bfloat16 or float16); W, V, Z, acc are float32.
        block: columns per program (power of two); the grid is ceil(P / block) programs.
        flags: ``(name, value)`` of each boolean constexpr (MOMENTUM, NESTEROV, …).
        device_type: ``"cuda"`` (compiled) or ``"cpu"`` (Triton's interpreter).
        hyper_ptr: η, μ_l, λ, α (μ_z) are pointers to 0-dim float32 tensors, loaded at every
            launch (``HYPER_PTR``: docs/kernels.md, The two kernels), instead of numbers."""

    kind: str
    m: int
    P: int
    row_stride: int
    dtype: torch.dtype
    block: int
    flags: tuple[tuple[str, bool], ...]
    device_type: str
    hyper_ptr: bool = False

    @property
    def unroll(self) -> int:
        """Unrolling of the loop over the m rows: m up to ``UNROLL_MAX``, else 1."""
        return self.m if self.m <= UNROLL_MAX else 1

    @property
    def num_warps(self) -> int:
        """Warps per program on CUDA: BLOCK / 128 (4 float32 per thread), between 1 and 4."""
        return max(1, min(4, self.block // 128))

    @property
    def constexprs(self) -> dict[str, int | bool]:
        """The compile-time constants passed to the kernel."""
        out: dict[str, int | bool] = {"P": self.P}
        if self.kind == "sma_local":
            out.update(ROW_STRIDE=self.row_stride, M=self.m, UNROLL=self.unroll)
        out["BLOCK"] = self.block
        out.update(self.flags)
        out["HYPER_PTR"] = self.hyper_ptr
        return out

    @property
    def grid(self) -> tuple[int]:
        return ((self.P + self.block - 1) // self.block,)

    def describe(self, launch: bool = True) -> str:
        """One line: kind, m, P, dtype, flags; with ``launch``, the block and the grid too."""
        flags = ", ".join(f"{k}={int(v)}" for k, v in self.flags if launch or k != "INT64")
        flags += ", HYPER_PTR=1" if self.hyper_ptr else ""
        dtype = str(self.dtype).removeprefix("torch.")
        rows = f"P={self.P:,}" + (f", row_stride={self.row_stride:,}"
                                  if self.row_stride != self.P else "")
        if not launch:
            return f"{self.kind}[m={self.m}, {rows}, dtype={dtype}, {flags}]"
        return (f"{self.kind}[m={self.m}, {rows}, dtype={dtype}, BLOCK={self.block}, "
                f"{flags}] grid={self.grid[0]}")


def local_spec(m: int, P: int, dtype: torch.dtype, device_type: str, *, momentum: Hyper,
               nesterov: bool, weight_decay: Hyper, first_step: bool, correct: bool,
               block: int | None = None, row_stride: int | None = None,
               hyper_ptr: bool = False) -> KernelSpec:
    """The spec of the local kernel for these options (no momentum ⇒ no Nesterov, no first
    step; ``row_stride`` None or m = 1 ⇒ P). Raises ValueError when ``row_stride < P``."""
    stride = P if row_stride is None or m == 1 else row_stride
    if stride < P:
        raise ValueError(f"row_stride={stride} < P={P}: the rows of W, V, G would overlap; "
                         f"pass the tensors' stride(0) (≥ P)")
    has_mom = is_on(momentum)
    flags = (("MOMENTUM", has_mom), ("NESTEROV", has_mom and bool(nesterov)),
             ("WEIGHT_DECAY", is_on(weight_decay)), ("FIRST_STEP", has_mom and bool(first_step)),
             ("CORRECT", bool(correct)), ("INT64", m * stride >= 2**31))
    return KernelSpec("sma_local", m, P, stride, dtype, block or default_block(P, device_type),
                      flags, device_type, bool(hyper_ptr))


def central_spec(P: int, device_type: str, *, central_momentum: Hyper,
                 block: int | None = None, dtype: torch.dtype = torch.float32,
                 hyper_ptr: bool = False) -> KernelSpec:
    """The spec of the central kernel (``dtype``: z's)."""
    return KernelSpec("sma_central", 1, P, P, dtype, block or default_block(P, device_type),
                      (("MOMENTUM", is_on(central_momentum)),), device_type, bool(hyper_ptr))


@dataclass(eq=False)
class EmittedKernel:
    """A Triton kernel emitted for one KernelSpec: ``fn`` the ``triton.jit`` function (CUDA) or
    ``InterpretedFunction`` (CPU), ``launches`` its runs, ``asm`` the compiled code by stage
    after the first CUDA launch (empty in the interpreter)."""

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

    def launch(self, *args: Any, num_warps: int | None = None) -> None:
        """Run the kernel on its grid with run-time ``args`` (the first a tensor on its device)."""
        num_warps = num_warps or self.spec.num_warps
        if self.spec.device_type == "cuda":
            with torch.cuda.device(args[0].device):  # Triton launches on the current device
                compiled = self.fn[self.spec.grid](*args, **self.spec.constexprs,
                                                   num_warps=num_warps, enable_fp_fusion=FP_FUSION)
            if not self.asm and compiled is not None and hasattr(compiled, "asm"):
                self.asm = dict(compiled.asm)
        else:
            self.fn[self.spec.grid](*args, **self.spec.constexprs)
        self.launches += 1

    def lower(self, arch: int = 90, num_warps: int | None = None) -> dict[str, Any]:
        """Compile this spec for CUDA ``sm_<arch>`` without a GPU, pointers 16-byte aligned as
        the JIT's: the code by stage (``"ttir"``, ``"ttgir"``, ``"llir"``, ``"ptx"``,
        ``"cubin"``)."""
        num_warps = num_warps or self.spec.num_warps
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        from triton.runtime.jit import JITFunction

        fn = JITFunction(_BODIES[self.spec.kind])  # compiled even under TRITON_INTERPRET=1
        const = self.spec.constexprs
        signature = {name: "constexpr" if name in const else _ARG_TYPES[name]
                     for name in fn.arg_names}
        if self.spec.kind == "sma_local":
            signature["g_ptr"] = "*" + _TRITON_DTYPE[self.spec.dtype]
        if self.spec.hyper_ptr:  # the hyper-parameters are pointers to float32 scalars
            signature.update({name: "*fp32" for name in _HYPER_NAMES if name in signature})
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


def cubin_resources(cubin: bytes) -> dict[str, int]:
    """A cubin's ``"registers"``, ``"stack_bytes"``, ``"local_bytes"`` per thread and
    ``"shared_bytes"`` per program, from Triton's ``cuobjdump -res-usage`` (no GPU needed).
    Raises RuntimeError when cuobjdump fails or prints no resource line."""
    import_triton()
    from triton import knobs

    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        res = subprocess.run([knobs.nvidia.cuobjdump.path, "-res-usage", f.name],
                             capture_output=True, text=True)
    found = dict(re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", res.stdout))
    if res.returncode != 0 or len(found) < 4:
        raise RuntimeError(f"cuobjdump -res-usage gave no resource usage (exit {res.returncode}): "
                           f"{res.stdout[-500:]}{res.stderr[-500:]}")
    return {"registers": int(found["REG"]), "stack_bytes": int(found["STACK"]),
            "local_bytes": int(found["LOCAL"]), "shared_bytes": int(found["SHARED"])}


_TRITON_DTYPE = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
_ARG_TYPES = {"w_ptr": "*fp32", "v_ptr": "*fp32", "g_ptr": "*fp32", "z_ptr": "*fp32",
              "acc_ptr": "*fp32", "z_prev_ptr": "*fp32", "c_ptr": "*fp32", "lr": "fp32",
              "momentum": "fp32", "weight_decay": "fp32", "alpha": "fp32",
              "central_momentum": "fp32"}


_HYPER_NAMES = ("lr", "momentum", "weight_decay", "alpha", "central_momentum")

_CACHE: dict[KernelSpec, EmittedKernel] = {}
_FUNCTIONS: dict[tuple[str, str], Any] = {}


def emit(spec: KernelSpec) -> EmittedKernel:
    """The kernel for ``spec``, emitted once and cached; ImportError without triton."""
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


def _hyper_args(device: torch.device, values: dict[str, Hyper],
                optional: tuple[str, ...]) -> tuple[bool, list[Any]]:
    """(whether the hyper-parameters are pointers, the kernel's arguments): numbers, or 0-dim
    float32 tensors on ``device`` once any is one (an ``optional`` number 0 gets an unread
    pointer). Raises TypeError for another tensor, or a number among tensors."""
    tensors = [v for v in values.values() if isinstance(v, torch.Tensor)]
    if not tensors:
        return False, [float(v) for v in values.values()]
    args = []
    for name, v in values.items():
        if isinstance(v, torch.Tensor):
            if v.dim() != 0 or v.dtype != torch.float32 or v.device != device:
                raise TypeError(f"{name} must be a number or a 0-dim float32 tensor on {device}, "
                                f"got {v.dtype} {list(v.shape)} on {v.device}")
            args.append(v)
        elif name in optional and v == 0:
            args.append(tensors[0])  # its branch is compiled out: the pointer is never read
        else:
            raise TypeError(f"{name}={v!r} is a number while other hyper-parameters are tensors: "
                            f"give every hyper-parameter the kernel reads as a 0-dim float32 "
                            f"tensor, or all as numbers")
    return True, args


def _row_stride(rows: dict[str, torch.Tensor]) -> int:
    """The one row stride of the ``[m, P]`` tensors ``rows`` (P when m = 1). Raises ValueError
    when a row is not unit-stride, the rows overlap, or the strides differ."""
    m, P = next(iter(rows.values())).shape
    for name, t in rows.items():
        if P > 1 and t.stride(1) != 1:
            raise ValueError(f"{name} [{m}, {P}] has stride {tuple(t.stride())}: the Triton kernel "
                             f"needs unit-stride rows (stride(1) == 1), e.g. {name}.contiguous() "
                             f"or a [:, :P] view of a row-major [m, P_pad] tensor")
    if m == 1:
        return P
    strides = {name: t.stride(0) for name, t in rows.items()}
    stride = strides[next(iter(strides))]
    if len(set(strides.values())) > 1 or stride < P:
        raise ValueError(f"the rows of {', '.join(strides)} [{m}, {P}] are {strides} elements "
                         f"apart: the Triton kernel needs one row stride ≥ P for all of them "
                         f"(engine/state/flat.py allocates them alike), e.g. .contiguous() each")
    return stride


class TritonSMAKernels:
    """The ``SMAKernels`` backend in Triton: each update one launch, compiled on CUDA, in
    Triton's interpreter on CPU tensors (docs/kernels.md, Backends). ``block``: columns per
    program (None: ``default_block``).

    Raises (from the methods):
        ImportError: triton is not installed.
        TypeError: W, V, Z, acc are not float32 (G float32/bfloat16/float16), a shape is not
            ``[m, P]``/``[P]``, or Z, acc are not contiguous.
        ValueError: the rows of W, V, G are not unit-stride, or not one row stride ≥ P apart."""

    name = "triton"

    def __init__(self, *, block: int | None = None) -> None:
        if block is not None and (block < 1 or block & (block - 1)):
            raise ValueError(f"block={block}: must be a power of two, e.g. 1024")
        self.block = block

    @torch.no_grad()
    def local_update(self, w: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                     z: torch.Tensor | None, *, lr: Hyper, momentum: Hyper, nesterov: bool,
                     weight_decay: Hyper, alpha: Hyper, first_step: bool = False,
                     out: torch.Tensor | None = None) -> torch.Tensor | None:
        """``torch_ref.sma_local_update`` in one launch; the rows of ``w, v, g`` may be one
        shared ``stride(0)`` ≥ P apart, and the hyper-parameters 0-dim float32 tensors."""
        m, P = w.shape
        has_mom = is_on(momentum)
        rows = {"w": w, "v": v, "g": g} if has_mom else {"w": w, "g": g}
        for name in rows.keys() - {"g"}:
            if rows[name].dtype != torch.float32 or tuple(rows[name].shape) != (m, P):
                raise TypeError(f"{name} must be a float32 tensor of shape {[m, P]} (the fp32 "
                                f"master copy), got {rows[name].dtype} {list(rows[name].shape)}")
        if tuple(g.shape) != (m, P) or g.dtype not in _TRITON_DTYPE:
            raise TypeError(f"g must be a float32, bfloat16 or float16 tensor of shape "
                            f"{[m, P]}, got {g.dtype} {list(g.shape)}")
        row_stride = _row_stride(rows)
        correct = z is not None and is_on(alpha)
        if correct:
            _check_master("z", z, (P,))
        hyper_ptr, hyper = _hyper_args(
            w.device, {"lr": lr, "momentum": momentum, "weight_decay": weight_decay,
                       "alpha": alpha if correct else 0.0}, ("momentum", "weight_decay", "alpha"))
        spec = local_spec(m, P, g.dtype, device_type(w), momentum=momentum, nesterov=nesterov,
                          weight_decay=weight_decay, first_step=first_step, correct=correct,
                          block=self.block, row_stride=row_stride, hyper_ptr=hyper_ptr)
        acc = None
        if correct:
            acc = out if out is not None else torch.empty(P, dtype=torch.float32, device=w.device)
            _check_master("out", acc, (P,))
        emit(spec).launch(w, v if has_mom else w, g, z if correct else w, acc if correct else w,
                          *hyper)
        torch.autograd.graph.increment_version([w, v])  # written outside torch's view
        return acc

    @torch.no_grad()
    def central_update(self, z: torch.Tensor, z_prev: torch.Tensor, c: torch.Tensor, *,
                       central_momentum: Hyper) -> None:
        """``torch_ref.sma_central_update`` in one launch (``z, z_prev, c [P]`` float32)."""
        P = z.shape[0]
        for name, t in (("z", z), ("z_prev", z_prev), ("c", c)):
            _check_master(name, t, (P,))
        hyper_ptr, hyper = _hyper_args(z.device, {"central_momentum": central_momentum}, ())
        spec = central_spec(P, device_type(z), central_momentum=central_momentum,
                            block=self.block, hyper_ptr=hyper_ptr)
        emit(spec).launch(z, z_prev, c, *hyper)
        torch.autograd.graph.increment_version([z, z_prev])

    @staticmethod
    def central_update_shared(zs: list[torch.Tensor], z_prevs: list[torch.Tensor],
                              parts: list[torch.Tensor], *, central_momentum: float) -> bool:
        """Declined: False (the scheduler sums in torch and calls ``central_update``)."""
        return False

    @staticmethod
    def nonfinite_rows(g: torch.Tensor) -> list[int] | None:
        """Declined: None (engine/learning/faults.py tests the rows in torch)."""
        return None
