"""The C kernel backend for the CPU (kernels/sma_cpu.c, kernels/c_sma.py) against the torch
implementation of the SMA update (kernels/torch_ref.py, the oracle), its fault test, its build and cache,
and its place in a plan.

Tolerances: the same float32 operations, but the C compiler may fuse a·b + c into one rounding
and sums α·e per replica where the oracle scales the sum: a few ulps.
"""

import copy
import functools
import logging
import os
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import crossbow_graph as cg
from crossbow_graph.engine.learning.faults import FaultMonitor
from crossbow_graph.kernels import c_sma as CK, select as S
from crossbow_graph.kernels.torch_ref import TorchSMAKernels, sma_central_update, sma_local_update

from _plans import make_plan
from test_kernels import MLP, tiny_data  # the model and data of the kernels' plan tests

ATOL, RTOL = 1e-6, 1e-5
# scripts/setup.sh installs gcc (CI has it); elsewhere without a C compiler these tests skip
pytestmark = pytest.mark.skipif(not CK.c_kernels_available(), reason="no C compiler: the C kernels "
                                "cannot be built (scripts/setup.sh installs gcc)")
C = CK.CSMAKernels() if CK.c_kernels_available() else None


def inputs(m, P, *, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    w, v = torch.randn(m, P, generator=gen), torch.randn(m, P, generator=gen)
    g = torch.randn(m, P, generator=gen).to(dtype)
    z = w.mean(0) + 0.1 * torch.randn(P, generator=gen)
    return w, v, g, z


def check(w, v, g, z, steps=2, **opts):
    """``steps`` local updates with the C backend and with the oracle on copies; every step's
    w, v and acc agree."""
    w_ref, v_ref = w.clone(), v.clone()
    for step in range(steps):
        kw = dict(opts, first_step=step == 0)
        acc = C.local_update(w, v, g, z, **kw)
        acc_ref = sma_local_update(w_ref, v_ref, g.float(), z, **kw)
        torch.testing.assert_close(w, w_ref, atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(v, v_ref, atol=ATOL, rtol=RTOL)
        if acc_ref is None:
            assert acc is None
        else:
            torch.testing.assert_close(acc, acc_ref, atol=ATOL * w.shape[0], rtol=RTOL)
        g = g.roll(1, dims=1)
    return w, acc


@settings(max_examples=60, deadline=None)
@given(m=st.integers(1, 8), P=st.sampled_from([1, 7, 2047, 2048, 2049, 5000]),
       momentum=st.sampled_from([0.0, 0.9]), nesterov=st.booleans(),
       weight_decay=st.sampled_from([0.0, 1e-2]), alpha=st.sampled_from([0.0, 0.05, 1.0]),
       with_z=st.booleans())
def test_local_update_matches_oracle(m, P, momentum, nesterov, weight_decay, alpha, with_z):
    """Every option, P across the C code's column blocks (2,048), m rows summed into acc."""
    w, v, g, z = inputs(m, P)
    check(w, v, g, z if with_z else None, lr=0.03, momentum=momentum,
          nesterov=nesterov and momentum > 0, weight_decay=weight_decay, alpha=alpha)


def test_lenet5_size_and_moves_the_weights():
    w, v, g, z = inputs(4, 61_706)
    w0 = w.clone()
    _, acc = check(w, v, g, z, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-4, alpha=0.1)
    assert (w - w0).abs().max() > 1e-3 and acc.abs().max() > 1e-3


def test_rows_of_a_wider_buffer_and_out():
    """Rows with a stride larger than P (a column slice), and acc written into ``out``."""
    w_big, v_big, g_big, z = inputs(3, 300)
    P = 200
    w, v, g = w_big[:, :P], v_big[:, :P], g_big[:, :P]
    tail = w_big[:, P:].clone()
    w_ref, v_ref = w.clone(), v.clone()
    out = torch.full((P,), 7.0)
    acc = C.local_update(w, v, g, z[:P], lr=0.1, momentum=0.9, nesterov=False, weight_decay=0.0,
                         alpha=0.2, out=out)
    ref = sma_local_update(w_ref, v_ref, g, z[:P], lr=0.1, momentum=0.9, nesterov=False,
                           weight_decay=0.0, alpha=0.2)
    assert acc is out
    torch.testing.assert_close(out, ref, atol=ATOL * 3, rtol=RTOL)
    torch.testing.assert_close(w, w_ref, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(w_big[:, P:], tail, atol=0, rtol=0)  # columns past P untouched


@pytest.mark.parametrize("case", ["bfloat16 g", "strided columns"])
def test_other_tensors_take_the_torch_path(case):
    w, v, g, z = inputs(2, 64, dtype=torch.bfloat16 if case == "bfloat16 g" else torch.float32)
    if case == "strided columns":
        w = torch.randn(64, 2).t()  # stride(1) = 2
    check(w, v, g, z, lr=0.1, momentum=0.9, nesterov=False, weight_decay=0.0, alpha=0.3)


@pytest.mark.parametrize("devices,P", [(1, 7), (2, 5000), (3, 2049)])
@pytest.mark.parametrize("mu_z", [0.0, 0.9])
def test_central_update_shared_sums_updates_and_copies(devices, P, mu_z):
    """CPU devices sharing one memory: Σ acc_d, the central update and every device's copies of
    z and z_prev in one pass; against the torch steps (sum in device order, update, copy)."""
    gen = torch.Generator().manual_seed(devices)
    parts = [torch.randn(P, generator=gen) for _ in range(devices)]
    z0, zp0 = torch.randn(P, generator=gen), torch.randn(P, generator=gen)
    zs = [z0.clone()] + [torch.full((P,), 5.0) for _ in range(devices - 1)]  # stale copies
    zps = [zp0.clone()] + [torch.full((P,), 5.0) for _ in range(devices - 1)]
    C.central_update_shared(zs, zps, parts, central_momentum=mu_z)
    total = parts[0].clone()
    for part in parts[1:]:
        total += part
    z_ref, zp_ref = z0.clone(), zp0.clone()
    sma_central_update(z_ref, zp_ref, total, central_momentum=mu_z)
    for z, zp in zip(zs, zps):
        torch.testing.assert_close(z, z_ref, atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(zp, z0, atol=0, rtol=0)
    torch.testing.assert_close(zs[-1], zs[0], atol=0, rtol=0)  # the copies are exact


def test_nonfinite_rows():
    g = torch.randn(5, 3000)
    assert C.nonfinite_rows(g) == []
    g[1, 2999], g[3, 0], g[4, 1500] = float("nan"), float("inf"), -float("inf")
    g[0, 10] = 3e38  # large but finite
    g[2, 11] = 1e-45  # subnormal
    assert C.nonfinite_rows(g) == [1, 3, 4]
    assert C.nonfinite_rows(g[2:4]) == [1]
    assert C.nonfinite_rows(g.bfloat16()) is None  # not float32: the caller tests in torch


# the plans of these tests: the kernels' MLP on x [N, 8], SGD with momentum and weight decay
mlp_plan = functools.partial(make_plan, model=MLP, input_shape=(8,),
                             optimizer=cg.SGD(lr=0.1, momentum=0.9, weight_decay=1e-3))


def test_fault_check_in_c_resets_the_same_rows_as_torch():
    out = {}
    for backend in (C, TorchSMAKernels()):
        plan = mlp_plan(replicas=4)
        state = plan.states[0]
        state.g.normal_()
        state.g[2, 5] = float("nan")
        rows = FaultMonitor.find_and_reset(state, 1, 4, kernels=backend)
        out[backend.name] = rows, state.w.clone(), state.g.clone()
        torch.testing.assert_close(state.w[2], state.z, atol=0, rtol=0)
    assert out["c"][0] == out["torch"][0] == [2]
    for a, b in zip(out["c"][1:], out["torch"][1:]):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


@pytest.mark.parametrize("executor", ["inline", "process"])
def test_fit_with_c_kernels_agrees_with_torch(executor):
    """A short fit (2 devices × 2 replicas): the C and torch backends give the same z and
    replicas to float tolerance; the plan lists the C kernels with their source."""
    out = {}
    for backend in ("c", "torch"):
        plan = mlp_plan(replicas=2, devices=2, kernel_backend=backend, executor=executor)
        plan.fit(tiny_data(), 2, seed=3, progress=False)
        out[backend] = plan.replica_weights(), plan.central_weights()
        if backend == "c":
            assert isinstance(plan.rounds.kernels, CK.CSMAKernels)
            assert plan.kernels and all(k.backend == "c" for k in plan.kernels)
            assert "void sma_local(" in plan.kernels[0].source
    w0 = mlp_plan(replicas=2, devices=2).replica_weights()
    assert (out["torch"][0] - w0).abs().max() > 1e-3
    for a, b in zip(out["c"], out["torch"]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.fixture
def fresh_build(monkeypatch, tmp_path):
    """No library loaded yet in this process, and an empty cache directory."""
    monkeypatch.setattr(CK, "_lib", None)
    monkeypatch.setattr(CK, "_load_error", None)
    monkeypatch.setenv("CROSSBOW_GRAPH_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_build_is_cached_and_atomic(fresh_build):
    lib = CK.load_library()
    built = sorted(p.name for p in fresh_build.iterdir())
    assert len(built) == 2 and built[0].startswith("sma_cpu-") and built[0].endswith(".so")
    assert built[1] == built[0] + ".sha256"  # the checksum, written after the library
    stamp = os.stat(fresh_build / built[0]).st_mtime_ns
    assert CK.load_library() is lib  # once per process
    CK._lib = None
    CK.load_library()  # a new process: the cached file, not a new build
    assert sorted(p.name for p in fresh_build.iterdir()) == built
    assert os.stat(fresh_build / built[0]).st_mtime_ns == stamp


def test_without_a_compiler_auto_keeps_torch_and_c_says_why(fresh_build, monkeypatch):
    monkeypatch.setattr(CK, "_compiler", lambda: None)
    assert not CK.c_kernels_available()
    assert isinstance(S.select_backend("auto", "cpu"), TorchSMAKernels)
    with pytest.raises(CK.CompilerError, match="no C compiler found.*kernel_backend='torch'"):
        S.select_backend("c", "cpu")
    plan = mlp_plan(replicas=2)  # kernel_backend="auto": trains with the torch kernels
    assert isinstance(plan.rounds.kernels, TorchSMAKernels)
    plan.fit(tiny_data(16), 1, progress=False)


def test_a_damaged_cached_library_is_rebuilt(fresh_build):
    CK.load_library()
    (lib,) = fresh_build.glob("*.so")
    good = lib.read_bytes()
    damaged = fresh_build / "damaged"
    damaged.write_bytes(good[:30000])  # truncated: loading it would crash the process (SIGBUS)
    os.replace(damaged, lib)  # a new file: this process's mapping of the good one stays valid
    CK._lib = None
    CK.load_library()
    assert lib.read_bytes() == good
    assert not [p for p in fresh_build.iterdir() if p.name.endswith(".tmp")]  # no leftovers


def test_no_home_directory_uses_a_temporary_cache(monkeypatch):
    for var in ("CROSSBOW_GRAPH_CACHE", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)

    def no_home():
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.setattr(Path, "home", staticmethod(no_home))
    assert "crossbow_graph" in CK._cache_dir().name


def test_unwritable_cache_builds_for_this_process_and_warns(fresh_build, monkeypatch, tmp_path, caplog):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("CROSSBOW_GRAPH_CACHE", str(blocker / "cache"))  # mkdir fails, even as root
    with caplog.at_level(logging.WARNING, logger="crossbow_graph.kernels"):
        CK.load_library()
    assert "not writable" in caplog.text and "CROSSBOW_GRAPH_CACHE" in caplog.text


def test_cc_with_arguments_and_a_missing_cc(fresh_build, monkeypatch):
    monkeypatch.setenv("CC", "cc -std=c99")  # a command with arguments, as in make
    assert CK._compiler()[1:] == ["-std=c99"]
    CK.load_library()
    monkeypatch.setattr(CK, "_lib", None)
    monkeypatch.setenv("CC", "/nonexistent/cc")
    with pytest.raises(CK.CompilerError, match=r"\$CC='/nonexistent/cc'.*apt-get install gcc"):
        CK.load_library()


def test_plan_with_c_kernels_deep_copies():
    plan = mlp_plan(replicas=2, kernel_backend="c")
    twin = copy.deepcopy(plan)
    assert isinstance(twin.rounds.kernels, CK.CSMAKernels)
    twin.fit(tiny_data(16), 1, progress=False)


def test_overlapping_or_empty_rows_take_the_torch_path():
    base = torch.zeros(1, 10)
    assert not CK._rows_ok(base.expand(2, 10), (2, 10))  # both rows are one memory
    assert not CK._rows_ok(torch.zeros(0, 10), (0, 10))
    assert CK._rows_ok(torch.zeros(3, 10), (3, 10))


def test_a_failing_compiler_is_reported(fresh_build, monkeypatch, tmp_path):
    bad = tmp_path / "badcc"
    bad.write_text("#!/bin/sh\necho 'cc: fatal error: broken on purpose' >&2\nexit 1\n")
    bad.chmod(0o755)
    monkeypatch.setattr(CK, "_compiler", lambda: [str(bad)])
    with pytest.raises(CK.CompilerError, match="broken on purpose"):
        CK.CSMAKernels()
    assert not fresh_build.exists() or not any(fresh_build.iterdir())  # nothing half-written
