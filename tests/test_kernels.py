"""The SMA update kernels (docs/design-overview.md §2 steps 1–3, §4) against the torch implementation.

On the CPU the Triton kernels run in Triton's interpreter (conftest.py sets TRITON_INTERPRET=1;
the kernels also run without it, see test_interpreter_without_env_var). Sizes are small except
one LeNet-5-sized case: the interpreter is slow.
"""

import functools
import inspect
import os
import re
import subprocess
import sys
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

import crossbow_graph as cg
from crossbow_graph.kernels import select as S
from crossbow_graph.kernels import triton_sma as K
from crossbow_graph.kernels.c_sma import CSMAKernels, c_kernels_available
from crossbow_graph.kernels.protocol import SMAKernels
from crossbow_graph.kernels.torch_ref import TorchSMAKernels, sma_central_update, sma_local_update

from _plans import make_plan

# float32: the same operations, but torch's CPU kernels fuse a·b + c (one rounding) where the
# interpreter rounds twice, and the sum over replicas may be ordered differently: ≤ a few ulps.
ATOL, RTOL = 1e-6, 1e-5
TRITON = K.TritonSMAKernels(block=64)  # a small block: most P below are not multiples of it


def _params(fn) -> list[tuple[str, object]]:
    """A method's parameters but ``self``: (name, kind), in order."""
    return [(p.name, p.kind) for p in inspect.signature(fn).parameters.values() if p.name != "self"]


@pytest.mark.parametrize("backend", [TorchSMAKernels, CSMAKernels, K.TritonSMAKernels])
def test_every_backend_implements_the_whole_kernel_protocol(backend):
    """The engine calls every SMAKernels method directly: each backend defines all of them, with
    the protocol's parameters, and the attributes (checked on an instance where one can be built:
    the C backend needs a C compiler)."""
    methods = [n for n, v in vars(SMAKernels).items() if callable(v) and not n.startswith("_")]
    assert set(methods) == {"local_update", "central_update", "central_update_shared", "nonfinite_rows"}
    for name in methods:
        assert callable(getattr(backend, name, None)), f"{backend.__name__} lacks {name}"
        assert _params(getattr(backend, name)) == _params(getattr(SMAKernels, name)), name
    if backend is not CSMAKernels or c_kernels_available():
        instance = backend()
        assert isinstance(instance, SMAKernels)
        assert isinstance(instance.name, str) and instance.block is None


def test_backends_without_a_fused_pass_decline_it():
    z = torch.zeros(4)
    for backend in (TorchSMAKernels(), TRITON):
        assert backend.central_update_shared([z], [z.clone()], [z.clone()], central_momentum=0.9) is False
        assert backend.nonfinite_rows(torch.full((2, 4), float("nan"))) is None


def make_inputs(m, P, *, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(m, P, generator=gen)
    v = torch.randn(m, P, generator=gen)
    g = torch.randn(m, P, generator=gen).to(dtype)
    z = w.mean(0) + 0.1 * torch.randn(P, generator=gen)
    return w, v, g, z


def check_local(m, P, *, steps=2, dtype=torch.float32, backend=TRITON, with_z=True, **opts):
    """Run ``steps`` local updates (the first with first_step=True) with the Triton backend and
    with the torch implementation on copies; compare w, v and acc after every step."""
    w, v, g, z = make_inputs(m, P, dtype=dtype)
    w_ref, v_ref = w.clone(), v.clone()
    for step in range(steps):
        kw = dict(opts, first_step=step == 0)
        acc = backend.local_update(w, v, g, z if with_z else None, **kw)
        acc_ref = sma_local_update(w_ref, v_ref, g.float(), z if with_z else None, **kw)
        torch.testing.assert_close(w, w_ref, atol=ATOL, rtol=RTOL)
        if opts["momentum"]:
            torch.testing.assert_close(v, v_ref, atol=ATOL, rtol=RTOL)
        if acc_ref is None:
            assert acc is None
        else:
            torch.testing.assert_close(acc, acc_ref, atol=ATOL * m, rtol=RTOL)
        g = g.roll(1, dims=1)  # new gradients for the next step
    return w, acc_ref


OPTS = dict(lr=0.1, momentum=0.9, nesterov=False, weight_decay=0.0, alpha=0.25)


@pytest.mark.parametrize("m", [*range(1, 9), 9, 16])  # unrolled up to UNROLL_MAX = 8, then a loop
@pytest.mark.parametrize("P", [1, 100, 128, 193])  # 128: full blocks only (no tail program)
def test_local_update_every_m(m, P):
    check_local(m, P, **dict(OPTS, nesterov=m % 2 == 0, weight_decay=1e-3 if m > 4 else 0.0))


@pytest.mark.parametrize("momentum,nesterov", [(0.0, False), (0.9, False), (0.9, True)])
@pytest.mark.parametrize("weight_decay", [0.0, 5e-3])
@pytest.mark.parametrize("alpha", [0.0, 0.3, 1.0])
def test_local_update_options(momentum, nesterov, weight_decay, alpha):
    check_local(3, 130, lr=0.05, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay,
                alpha=alpha)


def test_local_update_without_z_is_a_plain_step():
    w, _ = check_local(2, 70, with_z=False, **OPTS)
    assert torch.isfinite(w).all()


def test_local_update_first_step_copies_d_into_momentum():
    w, v, g, z = make_inputs(2, 50)
    TRITON.local_update(w, v, g, z, lr=0.1, momentum=0.9, nesterov=False, weight_decay=0.01,
                        alpha=0.0, first_step=True)
    w0, _, _, _ = make_inputs(2, 50)
    torch.testing.assert_close(v, g + 0.01 * w0, atol=ATOL, rtol=RTOL)  # the old v is ignored


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_local_update_lenet5_size_default_block(device):
    """One medium case: P = 61,706 (LeNet-5), m = 4, with the interpreter's default block (8 programs)
    and with CUDA's (128 columns: 483 programs, the last one partial)."""
    block = K.default_block(61_706, device)
    assert (block, -(-61_706 // block)) == ((8192, 8) if device == "cpu" else (128, 483))
    check_local(4, 61_706, steps=2, backend=K.TritonSMAKernels(block=block),
                **dict(OPTS, nesterov=True, weight_decay=1e-4))


@pytest.mark.parametrize("P,block", [(61_706, 128), (464_154, 1024), (25_557_032, 1024),
                                     (1_000_000, 1024), (100_000, 256), (10_000, 128), (100, 128),
                                     (50, 64), (1, 16)])
def test_default_block_fills_the_sms_on_cuda(P, block):
    """The CUDA block is the largest power of two in [128, 1024] whose grid has ≥ 2 programs
    per SM of a 132-SM H200 (else 128, or P rounded up when smaller): LeNet-5 (P = 61,706) and
    ResNet-32/-50 sizes get ≥ 264 programs; a thread holds 4 float32 (8 at BLOCK 1024)."""
    spec = K.local_spec(4, P, torch.float32, "cuda", momentum=0.9, nesterov=False,
                        weight_decay=0.0, first_step=False, correct=True)
    assert spec.block == K.default_block(P, "cuda") == block
    if P >= 128 * K.TARGET_PROGRAMS:
        assert spec.grid[0] >= K.TARGET_PROGRAMS == 264
        assert block == 1024 or -(-P // (2 * block)) < K.TARGET_PROGRAMS  # the largest such
    assert spec.num_warps == max(1, min(4, block // 128))
    assert K.default_block(P, "cpu") == max(16, min(8192, 1 << (P - 1).bit_length()))


@settings(max_examples=25, deadline=None)
@given(m=st.integers(1, 8), P=st.integers(1, 300), block=st.sampled_from([16, 64, 256]),
       momentum=st.sampled_from([0.0, 0.5, 0.9]), nesterov=st.booleans(),
       weight_decay=st.sampled_from([0.0, 1e-2]), alpha=st.sampled_from([0.0, 0.01, 0.5, 1.0]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]), with_z=st.booleans())
def test_local_update_random(m, P, block, momentum, nesterov, weight_decay, alpha, dtype, with_z):
    check_local(m, P, dtype=dtype, backend=K.TritonSMAKernels(block=block), with_z=with_z, lr=0.03,
                momentum=momentum, nesterov=nesterov and momentum > 0,
                weight_decay=weight_decay, alpha=alpha)


@pytest.mark.parametrize("backend", ["triton", pytest.param("c", marks=pytest.mark.skipif(
    not c_kernels_available(), reason="no C compiler (scripts/setup.sh installs gcc)"))])
@pytest.mark.parametrize("P", [1, 100, 1000, 5000])
@pytest.mark.parametrize("mu_z", [0.0, 0.9])
def test_central_update(backend, P, mu_z):
    """Triton (interpreted) and C (kernels/sma_cpu.c, 2,048-column blocks) against torch."""
    gen = torch.Generator().manual_seed(P)
    z, z_prev, c = (torch.randn(P, generator=gen) for _ in range(3))
    z_ref, z_prev_ref = z.clone(), z_prev.clone()
    (TRITON if backend == "triton" else CSMAKernels()).central_update(z, z_prev, c, central_momentum=mu_z)
    sma_central_update(z_ref, z_prev_ref, c, central_momentum=mu_z)
    torch.testing.assert_close(z, z_ref, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(z_prev, z_prev_ref, atol=0, rtol=0)


def test_backend_rejects_non_float32_masters():
    w, v, g, z = make_inputs(2, 10)
    with pytest.raises(TypeError, match="float32"):
        TRITON.local_update(w.bfloat16(), v, g, z, **OPTS)
    with pytest.raises(ValueError, match="unit-stride rows"):  # tests/test_row_padding.py: more
        TRITON.local_update(w.t().contiguous().t(), v, g, z, **OPTS)
    with pytest.raises(TypeError, match="contiguous"):
        TRITON.local_update(w, v, g, torch.randn(20)[::2], **OPTS)  # z [P] strided


# -- emission: specialisation, cache, visibility ----------------------------------------------

def test_emit_caches_by_spec_and_specialises():
    spec = K.local_spec(3, 100, torch.float32, "cpu", momentum=0.9, nesterov=False,
                        weight_decay=0.0, first_step=False, correct=True)
    assert K.emit(spec) is K.emit(spec)
    other = K.local_spec(4, 100, torch.float32, "cpu", momentum=0.9, nesterov=False,
                         weight_decay=0.0, first_step=False, correct=True)
    assert K.emit(other) is not K.emit(spec)
    assert spec.constexprs["M"] == 3 and spec.constexprs["P"] == 100
    assert spec.constexprs["ROW_STRIDE"] == 100 and spec.constexprs["UNROLL"] == 3
    assert dict(spec.flags) == {"MOMENTUM": True, "NESTEROV": False, "WEIGHT_DECAY": False,
                                "FIRST_STEP": False, "CORRECT": True, "INT64": False}
    src = K.emit(spec).source
    assert "#   M = 3" in src and "def sma_local_kernel" in src
    assert "tl.range(0, M, loop_unroll_factor=1 if MASKED else UNROLL)" in src
    padded = K.local_spec(3, 100, torch.float32, "cpu", momentum=0.9, nesterov=False,
                          weight_decay=0.0, first_step=False, correct=True, row_stride=128)
    assert K.emit(padded) is not K.emit(spec) and "row_stride=128" in padded.describe()
    assert K.local_spec(1, 100, torch.float32, "cpu", momentum=0.9, nesterov=False,
                        weight_decay=0.0, first_step=False, correct=True,
                        row_stride=128).row_stride == 100  # one row: no stride to specialise
    many = K.local_spec(K.UNROLL_MAX + 1, 100, torch.float32, "cpu", momentum=0.9,
                        nesterov=False, weight_decay=0.0, first_step=False, correct=True)
    assert many.unroll == 1  # a run-time loop over the rows above UNROLL_MAX


def test_lower_compiles_for_cuda_without_a_gpu():
    """The compiled path (not the interpreter): both kernels build to PTX for sm_90."""
    spec = K.local_spec(4, 61_706, torch.bfloat16, "cuda", momentum=0.9, nesterov=True,
                        weight_decay=1e-4, first_step=False, correct=True)
    asm = K.emit(spec).lower(arch=90)
    assert ".entry sma_local_kernel" in asm["ptx"]
    assert "tt.load" in asm["ttir"] and "tensor<1024xi64>" not in asm["ttir"]
    asm = K.emit(K.central_spec(61_706, "cuda", central_momentum=0.9)).lower(arch=90)
    assert ".entry sma_central_kernel" in asm["ptx"]
    big = K.local_spec(8, 300_000_000, torch.float32, "cuda", momentum=0.0, nesterov=False,
                       weight_decay=0.0, first_step=False, correct=True)  # m·P ≥ 2^31
    assert dict(big.flags)["INT64"]
    assert "tensor<1024xi64>" in K.emit(big).lower(arch=90)["ttir"]  # 64-bit offsets


_LOAD = {16: "ld.global.v4.b32", 8: "ld.global.v2.b32", 4: "ld.global.b32"}


def _expected_loads(spec: K.KernelSpec, *, tail: bool) -> Counter:
    """The global loads of one compiled body of ``spec`` (a full block's, or the tail's), per
    thread: each array's E = BLOCK / threads elements as accesses of up to 16 bytes — 2
    elements in the tail, whose mask splits vectors when P ≡ 2 mod 4 — for 16-byte aligned
    rows. Arrays: per unrolled row (the tail does not unroll) w, g and v (with momentum, after
    the first step); z when correcting; central: z, C, z_prev."""
    E = spec.block // (32 * spec.num_warps)
    f = dict(spec.flags)
    if spec.kind == "sma_central":
        arrays = [4] * (2 + f["MOMENTUM"])
    else:
        per_row = [4, spec.dtype.itemsize] + [4] * (f["MOMENTUM"] and not f["FIRST_STEP"])
        arrays = per_row * (1 if tail else spec.unroll) + [4] * f["CORRECT"]
    out = Counter()
    for size in arrays:
        k = min(E, 16 // size, 2 if tail else E)  # elements per access
        out[_LOAD[k * size]] += E // k
    return out


def _loads(ptx: str) -> Counter:
    return Counter(re.findall(r"ld\.global[\w.]*", ptx))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=["fp32", "bf16", "fp16"])
def test_every_kernel_lowers_for_sm90_with_16_byte_loads(dtype):
    """Every kernel (local, with and without momentum/Nesterov/weight decay/correction, for m ∈
    {1, 2, 8, 64}; central) lowers to an sm_90 cubin without a GPU, with nothing spilled
    (``cubin_resources``). The pointers are declared 16-byte aligned as the JIT's are.

    Loads (docs/kernels.md): P = 65,536, a multiple of the block, has only full blocks, and
    every access is a 16-byte vector (the 2-byte gradients': 8 bytes, 4 per thread). At
    LeNet-5's P = 61,706 with the rows padded to 61,728 elements (engine/state/flat.py on CUDA) the
    full blocks' accesses are the same, and only the tail program's are split in two by its
    mask; with unpadded rows (61,706 apart, 8-byte aligned) rows 1… are 8-byte loads too.

    m = 64 loops over the rows at run time (UNROLL 1): its cubin is smaller than the unrolled
    m = 8 one (fully unrolled, it is about 7× larger: docs/kernels.md)."""
    options = [dict(momentum=0.9, nesterov=False, weight_decay=0.0, first_step=False, correct=True),
               dict(momentum=0.9, nesterov=True, weight_decay=1e-4, first_step=True, correct=False),
               dict(momentum=0.0, nesterov=False, weight_decay=0.0, first_step=False, correct=True)]
    for opts in options:
        cubin_bytes = {}
        for m in (1, 2, 8, 64):
            for P, row_stride in ((65_536, None), (61_706, 61_728)):
                spec = K.local_spec(m, P, dtype, "cuda", row_stride=row_stride, **opts)
                asm = K.emit(spec).lower(arch=90)
                assert ".target sm_90" in asm["ptx"]
                used = K.cubin_resources(asm["cubin"])
                assert used["local_bytes"] == used["stack_bytes"] == 0, (spec.describe(), used)
                loads, full = _loads(asm["ptx"]), _expected_loads(spec, tail=False)
                tail = loads - full  # what is left once the full blocks' loads are taken
                assert loads["ld.global.v4.b32"] == full["ld.global.v4.b32"] and full <= loads
                assert set(tail) <= {"ld.global.v2.b32", "ld.global.b32"}, spec.describe()
                assert bool(tail) == bool(P % spec.block), (spec.describe(), loads, full)
                if P % spec.block and spec.unroll == 1:  # LLVM may unroll a short tail loop
                    assert tail == _expected_loads(spec, tail=True), (spec.describe(), tail)
                cubin_bytes[m, P] = len(asm["cubin"])
        assert cubin_bytes[64, 61_706] < cubin_bytes[8, 61_706], cubin_bytes
    spec = K.local_spec(8, 61_706, dtype, "cuda", **options[0])  # unpadded rows
    full = _expected_loads(spec, tail=False)
    assert _loads(K.emit(spec).lower(arch=90)["ptx"])["ld.global.v4.b32"] < full["ld.global.v4.b32"]
    for P in (61_706, 65_536):
        spec = K.central_spec(P, "cuda", central_momentum=0.9)
        want = _expected_loads(spec, tail=False) + (_expected_loads(spec, tail=True) if P % 4 else Counter())
        assert _loads(K.emit(spec).lower(arch=90)["ptx"]) == want, P


def _scalars(**values):
    """The hyper-parameters as 0-dim float32 tensors (the form a CUDA graph captures)."""
    return {k: torch.tensor(v, dtype=torch.float32) for k, v in values.items()}


@pytest.mark.parametrize("backend", ["triton", "torch", pytest.param("c", marks=pytest.mark.skipif(
    not c_kernels_available(), reason="no C compiler"))])
@pytest.mark.parametrize("momentum,nesterov,weight_decay,alpha", [
    (0.9, False, 0.0, 0.25), (0.9, True, 5e-3, 1.0), (0.0, False, 1e-3, 0.3)])
def test_tensor_hyper_parameters_equal_the_numbers(backend, momentum, nesterov, weight_decay, alpha):
    """η, μ_l, λ, α and μ_z as 0-dim float32 tensors give the numbers' results (Triton: the
    same arithmetic on the loaded values, bitwise; torch: the products in other operations,
    within the usual tolerances); a changed tensor value changes the next launch's result as
    the number would."""
    kernels = {"triton": TRITON, "torch": TorchSMAKernels()}.get(backend) or CSMAKernels()
    w, v, g, z = make_inputs(3, 130)
    w_t, v_t = w.clone(), v.clone()
    hyper = dict(lr=0.05, momentum=momentum, weight_decay=weight_decay, alpha=alpha)
    tensors = _scalars(**hyper)
    if momentum == 0:
        tensors["momentum"] = 0.0  # the number 0 compiles the branch out among tensors
    exact = backend == "triton"
    same = (lambda a, b: torch.equal(a, b)) if exact else \
        (lambda a, b: torch.allclose(a, b, atol=ATOL, rtol=RTOL))
    for step, lr in enumerate((0.05, 0.2)):  # η changes between the launches
        hyper["lr"] = lr
        tensors["lr"].fill_(lr)
        acc = kernels.local_update(w, v, g, z, nesterov=nesterov, first_step=step == 0, **hyper)
        acc_t = kernels.local_update(w_t, v_t, g, z, nesterov=nesterov, first_step=step == 0,
                                     **tensors)
        assert same(w, w_t) and same(acc, acc_t), (step, (w - w_t).abs().max())
        if momentum:
            assert same(v, v_t)
        g = g.roll(1, dims=1)
    assert not torch.allclose(w, make_inputs(3, 130)[0])  # it moved
    for mu_z in (0.9, 0.5):
        zs = [z.clone(), z.clone()]
        prev = [z + 0.1, z + 0.1]
        kernels.central_update(zs[0], prev[0], acc, central_momentum=mu_z)
        kernels.central_update(zs[1], prev[1], acc, central_momentum=torch.tensor(mu_z))
        assert same(zs[0], zs[1]) and same(prev[0], prev[1]), mu_z


def test_tensor_hyper_parameters_are_checked():
    """Tensors and numbers mixed (other than a 0 that compiles a branch out), or a tensor of
    another shape or dtype, are TypeErrors naming the argument."""
    w, v, g, z = make_inputs(2, 40)
    kw = dict(nesterov=False, first_step=False, weight_decay=0.0)
    with pytest.raises(TypeError, match="momentum=0.9 is a number"):
        TRITON.local_update(w, v, g, z, lr=torch.tensor(0.1), momentum=0.9, alpha=torch.tensor(0.5), **kw)
    with pytest.raises(TypeError, match="lr must be a number or a 0-dim float32 tensor"):
        TRITON.local_update(w, v, g, z, lr=torch.tensor([0.1]), momentum=0.0, alpha=0.5, **kw)
    with pytest.raises(TypeError, match="alpha must be"):
        TRITON.local_update(w, v, g, z, lr=torch.tensor(0.1), momentum=0.0,
                            alpha=torch.tensor(0.5, dtype=torch.float64), **kw)


def test_tensor_hyper_parameter_kernels_lower_for_sm90():
    """With ``hyper_ptr`` the kernels lower for sm_90 with nothing spilled, the same 16-byte
    vector loads of the rows as with numbers, and one scalar load per hyper-parameter."""
    opts = dict(momentum=0.9, nesterov=True, weight_decay=1e-4, first_step=False, correct=True)
    for make, extra in ((lambda hp: K.local_spec(8, 61_706, torch.float32, "cuda", row_stride=61_728,
                                                 hyper_ptr=hp, **opts), 4),
                        (lambda hp: K.central_spec(61_706, "cuda", central_momentum=0.9,
                                                   hyper_ptr=hp), 1)):
        spec = make(True)
        assert "HYPER_PTR=1" in spec.describe() and spec.constexprs["HYPER_PTR"] is True
        asm = K.emit(spec).lower(arch=90)
        used = K.cubin_resources(asm["cubin"])
        assert used["local_bytes"] == used["stack_bytes"] == 0, used
        numbers = _loads(K.emit(make(False)).lower(arch=90)["ptx"])
        assert _loads(asm["ptx"]) == numbers + Counter({"ld.global.b32": extra}), spec.describe()


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 3)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def tiny_data(n=64, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 8, generator=gen).to(dtype),
                         torch.randint(0, 3, (n,), generator=gen))


# the plans of these tests: the MLP on x [N, 8], 2 replicas on one device, SGD with Nesterov momentum
# and weight decay
mlp_plan = functools.partial(make_plan, model=MLP, input_shape=(8,), replicas=2, devices=1,
                             optimizer=cg.SGD(lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-3))


def test_plan_kernels_lists_what_runs():
    # inline: this process runs every launch (worker processes count their own)
    plan = mlp_plan(replicas=3, kernel_backend="triton", sync=cg.SMA(sync_every=2), executor="inline")
    assert isinstance(plan.rounds.kernels, K.TritonSMAKernels)
    listed = plan.kernels
    kinds = sorted((k.spec.kind, dict(k.spec.flags).get("FIRST_STEP"), dict(k.spec.flags).get("CORRECT"))
                   for k in listed)
    assert kinds == [("sma_central", None, None), ("sma_local", False, False),
                     ("sma_local", False, True), ("sma_local", True, False),
                     ("sma_local", True, True)]
    assert all(k.spec.m == 3 or k.spec.kind == "sma_central" for k in listed)
    assert all(k.spec.P == plan.num_parameters for k in listed)
    plan.fit(tiny_data(), 1, shuffle=False, progress=False)
    assert sum(k.launches for k in plan.kernels) > 0  # the listed objects are the ones launched
    torch_plan = mlp_plan(replicas=3, kernel_backend="torch")
    assert isinstance(torch_plan.rounds.kernels, TorchSMAKernels)
    assert all(k.backend == "torch" for k in torch_plan.kernels)
    assert "def sma_local_update" in torch_plan.kernels[0].source


def test_select_backend():
    cpu_default = CSMAKernels if c_kernels_available() else TorchSMAKernels
    assert isinstance(S.select_backend("auto", "cpu"), cpu_default)  # C when a compiler is here
    assert isinstance(S.select_backend("auto", "cuda"), K.TritonSMAKernels)
    assert isinstance(S.select_backend("torch", "cuda"), TorchSMAKernels)
    assert isinstance(S.select_backend("triton", "cpu"), K.TritonSMAKernels)
    with pytest.raises(ValueError, match="kernel_backend='cuda'"):
        S.select_backend("cuda", "cpu")


def test_triton_missing_says_how_to_install(monkeypatch):
    monkeypatch.setattr(K, "triton", None)
    monkeypatch.setitem(sys.modules, "triton", None)  # import triton now raises ImportError
    with pytest.raises(ImportError, match="pip install"):
        mlp_plan(kernel_backend="triton")
    cpu_default = CSMAKernels if c_kernels_available() else TorchSMAKernels
    assert isinstance(mlp_plan(kernel_backend="auto").rounds.kernels, cpu_default)


@pytest.mark.parametrize("replicas,devices,sync_every", [(1, 1, 1), (3, 1, 1), (2, 2, 2)])
def test_fit_same_weights_triton_and_torch(replicas, devices, sync_every):
    """A whole short fit: the Triton kernels (interpreted) and the torch implementation agree."""
    out = {}
    for backend in ("triton", "torch"):
        plan = mlp_plan(replicas=replicas, devices=devices, kernel_backend=backend,
                        sync=cg.SMA(sync_every=sync_every))
        plan.fit(tiny_data(), 2, seed=3, progress=False)
        out[backend] = plan.replica_weights(), plan.central_weights()
    w0 = mlp_plan(replicas=replicas, devices=devices).replica_weights()
    assert (out["torch"][0] - w0).abs().max() > 1e-3  # training moved the weights
    for a, b in zip(out["triton"], out["torch"]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


# -- low precision ----------------------------------------------------------------------------

@pytest.mark.parametrize("backend,dtype", [("triton", torch.bfloat16), ("torch", torch.bfloat16),
                                           ("triton", torch.float16)])
def test_bf16_small_pull_moves_z(backend, dtype):
    """α = 0.01 in a bf16 (fp16) model: C is far below the resolution of z in that dtype, so only
    an fp32 master z moves; the modules show the masters rounded."""
    plan = mlp_plan(dtype=dtype, kernel_backend=backend,
                    optimizer=cg.SGD(lr=0.01, momentum=0.0),
                    sync=cg.SMA(alpha=0.01, central_momentum=0.0))
    state = plan.states[0]
    assert state.w.dtype == state.z.dtype == state.v.dtype == torch.float32
    assert state.g.dtype == state.w_model.dtype == dtype
    z0 = plan.central_weights()
    plan.fit(tiny_data(16, dtype=dtype), 1, shuffle=False, progress=False)  # 2 rounds
    z1 = plan.central_weights()
    moved = z1 != z0
    assert moved.any()
    # the same step on a z in the model's dtype would be lost: z0 + C rounds back to z0
    lost = (z0.to(dtype) + (z1 - z0).to(dtype)) == z0.to(dtype)
    assert lost[moved].float().mean() > 0.5
    plan.evaluate(tiny_data(8, dtype=dtype))  # the central module's forward copies back
    central = torch.cat([p.detach().flatten() for p in plan.central.module.parameters()])
    torch.testing.assert_close(central, z1.to(dtype), atol=0, rtol=0)
    replica = state.replicas[1]
    replica(torch.randn(2, 8, dtype=dtype))
    torch.testing.assert_close(torch.cat([p.detach().flatten() for p in replica.parameters()]),
                               state.w[1].to(dtype), atol=0, rtol=0)


def test_fp16_model_and_mixed_dtypes():
    plan = mlp_plan(dtype=torch.float16, kernel_backend="torch")
    assert plan.states[0].g.dtype == torch.float16 and plan.states[0].w.dtype == torch.float32
    mixed = Mixed()
    mixed(torch.randn(2, 8))  # it runs: a model may mix dtypes, but not its trainable parameters
    with pytest.raises(ValueError, match="mix dtypes: 'fc1.weight' is torch.float32 but "
                                         "'fc2.weight' is torch.bfloat16"):
        cg.compile(mixed, (torch.randn(2, 8),), F.cross_entropy, batch_size=4)


def test_float64_model_runs_the_torch_kernels_in_float64():
    """The C and Triton kernels update float32 masters: "auto" picks torch for a float64 model
    (on CUDA too), and asking for either of them is a clear error at compile."""
    plan = mlp_plan(dtype=torch.float64)
    assert isinstance(plan.rounds.kernels, TorchSMAKernels)
    assert all(k.backend == "torch" and k.spec.dtype == torch.float64 for k in plan.kernels)
    assert isinstance(S.select_backend("auto", "cuda", torch.float64), TorchSMAKernels)
    for backend in ("c", "triton"):
        with pytest.raises(ValueError, match=rf"kernel_backend='{backend}' updates float32 masters "
                                             r"only, but the model is float64 .*use "
                                             r"kernel_backend='torch' .*model.float\(\)"):
            mlp_plan(dtype=torch.float64, kernel_backend=backend)
    plan.fit(tiny_data(16, dtype=torch.float64), 1, progress=False)
    assert plan.central_weights().dtype == torch.float64


class Mixed(MLP):
    def __init__(self):
        super().__init__()
        self.fc2.to(torch.bfloat16)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)).to(torch.bfloat16))


# -- the interpreter without TRITON_INTERPRET, and the GPU ------------------------------------

def test_interpreter_without_env_var():
    """Triton imported first, TRITON_INTERPRET unset: the emitter still runs CPU kernels."""
    code = ("import triton, torch\n"
            "from crossbow_graph.kernels.triton_sma import TritonSMAKernels\n"
            "from crossbow_graph.kernels.torch_ref import sma_local_update\n"
            "w, v, g, z = torch.randn(3, 70), torch.randn(3, 70), torch.randn(3, 70), torch.randn(70)\n"
            "w2, v2 = w.clone(), v.clone()\n"
            "kw = dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.0, alpha=0.5)\n"
            "a = TritonSMAKernels(block=32).local_update(w, v, g, z, **kw)\n"
            "b = sma_local_update(w2, v2, g, z, **kw)\n"
            "torch.testing.assert_close((w, v, a), (w2, v2, b), atol=1e-6, rtol=1e-5)\n"
            "print('ok')\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    res = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr[-2000:]


@pytest.mark.gpu
@pytest.mark.parametrize("padded", [False, True], ids=["rows", "padded_rows"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 4, 8, 16])
def test_gpu_kernels_match_torch(m, dtype, padded):
    """ResNet-32's P: many programs, P not a multiple of the block; contiguous rows, and rows
    padded to 32 elements as engine/state/flat.py allocates them on CUDA (pads left untouched)."""
    P = 464_154
    gpu = K.TritonSMAKernels()
    w, v, g, z = (t.cuda() for t in make_inputs(m, P, dtype=dtype))
    if padded:
        fulls = [torch.full((m, 464_160), -3.5, dtype=t.dtype, device="cuda") for t in (w, v, g)]
        for full, t in zip(fulls, (w, v, g)):
            full[:, :P] = t
        w, v, g = (full[:, :P] for full in fulls)
    w_ref, v_ref = w.clone(), v.clone()
    for step in range(3):
        kw = dict(lr=0.05, momentum=0.9, nesterov=step == 2, weight_decay=1e-4, alpha=1 / m,
                  first_step=step == 0)
        acc = gpu.local_update(w, v, g, z, **kw)
        acc_ref = sma_local_update(w_ref, v_ref, g.float(), z, **kw)
        torch.testing.assert_close((w, v, acc), (w_ref, v_ref, acc_ref), atol=1e-5, rtol=1e-5)
    z_prev, z_ref, z_prev_ref = z.roll(1), z.clone(), z.roll(1)
    gpu.central_update(z, z_prev, acc, central_momentum=0.9)
    sma_central_update(z_ref, z_prev_ref, acc_ref, central_momentum=0.9)
    torch.testing.assert_close((z, z_prev), (z_ref, z_prev_ref), atol=1e-5, rtol=1e-5)
    assert any("ptx" in k.asm for k in K._CACHE.values() if k.spec.device_type == "cuda")
    if padded:
        assert all((full[:, P:] == -3.5).all() for full in fulls)


@pytest.mark.gpu
def test_gpu_fit_auto_picks_triton_and_matches_torch():
    out = {}
    for backend in ("auto", "torch"):
        plan = mlp_plan(replicas=4, kernel_backend=backend, devices=["cuda:0"])
        plan.fit(tiny_data(), 2, seed=3, progress=False)
        out[backend] = plan.central_weights()
        if backend == "auto":
            assert isinstance(plan.rounds.kernels, K.TritonSMAKernels)
    torch.testing.assert_close(out["auto"], out["torch"], atol=1e-5, rtol=1e-5)


def test_torch_column_blocks_change_nothing(monkeypatch):
    """The torch implementation's CPU column blocking (kernels/torch_ref.py) against one block."""
    from crossbow_graph.kernels import torch_ref as sma

    out = []
    for block_bytes in (1 << 40, 1024):  # one block; blocks of 1024 columns (the minimum)
        monkeypatch.setattr(sma, "BLOCK_BYTES", block_bytes)
        w, v, g, z = make_inputs(3, 2500)
        z_prev = z.flip(0)
        accs = [sma_local_update(w, v, g, z, **dict(OPTS, first_step=step == 0)) for step in range(2)]
        sma_central_update(z, z_prev, accs[-1], central_momentum=0.9)
        out.append((w, v, *accs, z, z_prev))
    torch.testing.assert_close(out[0], out[1], atol=0, rtol=0)
