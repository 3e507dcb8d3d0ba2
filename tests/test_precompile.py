"""Triton kernels compiled ahead of their first launch (kernels/precompile.py).

The oracle is Triton's own cache: after ``precompile`` of a plan's specs (``kernel_specs``), the
engine's launches of those kernels, compiled for sm_90 through Triton's JIT as a CUDA launch
compiles them (tests/_launch_hits.py, no GPU needed), find every binary in the cache; before
it, none. The ``gpu`` test launches on the GPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from crossbow_graph.kernels import precompile as PC
from crossbow_graph.kernels.select import UpdateFacts, kernel_specs

pytest.importorskip("triton")

HERE = os.path.dirname(__file__)
M, P = 4, 4096  # one device of 4 replicas, rows P apart


def _specs(P: int, m: int = M) -> list:
    """What a fit of m replicas (SGD with momentum, SMA with μ_z 0.9, τ 1) launches on a CUDA
    device, in eager rounds and in graph rounds."""
    facts = UpdateFacts(momentum=0.9, nesterov=False, weight_decay=0.0, num_learners=m,
                        sync_every=1, central_momentum=0.9)
    return [s for graphs in (False, True)
            for s in kernel_specs(m, P, "cuda", facts, row_stride=P, graphs=graphs)]


def _launch_hits(cache: str) -> list[bool]:
    root = os.path.dirname(os.path.abspath(HERE))  # this checkout's package, installed or not
    env = {**os.environ, "TRITON_CACHE_DIR": cache,
           "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, os.path.join(HERE, "_launch_hits.py"), str(M), str(P)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_precompiled_kernels_are_what_the_engines_launches_find(tmp_path, monkeypatch):
    """Six specs (first and later local steps, the central update; numbers and device-tensor
    hyper-parameters) compiled for sm_90 on two processes into an empty cache: the engine's six
    launches find each in Triton's cache (a launch whose arguments ``launch_args`` got wrong
    would compile anew); a second precompile compiles nothing."""
    cache = str(tmp_path / "cache")
    monkeypatch.setenv("TRITON_CACHE_DIR", cache)
    specs = _specs(P)
    assert len(specs) == 6 and len(set(specs)) == 6
    done = PC.precompile(specs + specs[:2], arch=90, workers=2)  # duplicates compile once
    assert (len(done.compiled), done.failed, done.pending) == (6, [], []), done
    assert "6 Triton kernels compiled for sm_90" in done.line()
    assert _launch_hits(cache) == [True] * 6
    again = PC.precompile(specs, arch=90, workers=2)
    assert (len(again.compiled), len(again.cached)) == (0, 6)


def test_launch_args_are_the_kernels_signature():
    """``launch_args`` gives the kernel's run-time parameters in order: 5 pointers (g of the
    gradients' dtype) and 4 hyper-parameters for the local kernel, 3 and 1 for the central."""
    specs = _specs(P)
    local = next(s for s in specs if s.kind == "sma_local" and s.hyper_ptr)
    central = next(s for s in specs if s.kind == "sma_central" and not s.hyper_ptr)
    assert PC.launch_args(local) == [torch.float32] * 9
    assert PC.launch_args(central) == [torch.float32] * 3 + [0.5]
    facts = UpdateFacts(momentum=0.9, nesterov=False, weight_decay=0.0, num_learners=2,
                        sync_every=1, central_momentum=0.0)
    bf16 = kernel_specs(2, 64, "cuda", facts, dtype=torch.bfloat16)[0]
    assert PC.launch_args(bf16)[2] == torch.bfloat16 and PC.launch_args(bf16)[5:] == [0.5] * 4


@pytest.mark.gpu
def test_gpu_launches_load_the_precompiled_kernels(tmp_path, monkeypatch):
    """On the GPU: specs precompiled for its compute capability, then launched on CUDA tensors
    by TritonSMAKernels: Triton loads every binary from its cache."""
    from triton import knobs

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    major, minor = torch.cuda.get_device_capability()
    n = 12_345  # a P no other test launches: nothing in Triton's in-memory caches
    done = PC.precompile(_specs(n), arch=10 * major + minor, workers=4)
    assert len(done.compiled) == 6 and not done.failed, done
    hits = []
    monkeypatch.setattr(knobs.compilation, "listener", lambda **kw: hits.append(kw["cache_hit"]))
    from crossbow_graph.kernels.triton_sma import TritonSMAKernels

    kernels = TritonSMAKernels()
    w, v, g = (torch.zeros(M, n, device="cuda") for _ in range(3))
    z = torch.zeros(n, device="cuda")
    for graphs in (False, True):
        h = (lambda x: torch.tensor(x, device="cuda")) if graphs else float
        for first in (True, False):
            acc = kernels.local_update(w, v, g, z, lr=h(0.01), momentum=h(0.9), nesterov=False,
                                       weight_decay=0.0, alpha=h(1 / M), first_step=first)
        kernels.central_update(z, z.clone(), acc, central_momentum=h(0.9))
    torch.cuda.synchronize()
    assert hits == [True] * 6, hits
