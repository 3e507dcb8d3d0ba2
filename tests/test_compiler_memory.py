"""Memory per learner: the estimate against a measurement, and the budget.

Measured on this CPU with torch.profiler's allocator events, one intra-op thread (two eager SGD
steps, momentum 0.9, everything allocated inside the measurement); the estimate excludes the
flat-buffer share, which an eager step does not have:

    model     batch  measured MiB  estimate MiB  error   (AVX2 CPU, oneDNN)
    lenet5       16          1.81          1.91  +5.3%
    lenet5       64          5.12          5.36  +4.9%
    resnet32      8         24.44         25.42  +4.0%
    resnet32     32         81.34         85.70  +5.4%
    vgg16         8        237.02        239.02  +0.8%
    vgg16        32        296.36        304.67  +2.8%

(``python bench/memcheck.py``; the tests run its ``--one`` in a process of their own, so that what
earlier tests left in this one does not enter the measurement). The tests keep the estimate within
[-5%, +10%] of the measurement (VGG-16 only at b=8, to keep the tests short).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch
from torch.nn import functional as F

import crossbow_graph as cg
from crossbow_graph import models
from crossbow_graph.compiler.analysis import estimate_memory, max_replicas_per_device
from crossbow_graph.compiler.passes import library_workspace
from crossbow_graph.compiler.trace import trace_model

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
from memcheck import compare  # noqa: E402  (bench/memcheck.py: the measurement)

LOW, HIGH = -0.05, 0.10


@pytest.mark.parametrize("name, batch_size", [("lenet5", 16), ("lenet5", 64), ("resnet32", 8),
                                               ("resnet32", 32), ("vgg16", 8)])
def test_memory_estimate_is_within_the_measured_tolerance_on_cpu(name, batch_size):
    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench",
                          "memcheck.py")
    out = subprocess.run([sys.executable, script, "--one", name, str(batch_size)],
                         capture_output=True, text=True, check=True).stdout
    measured, estimate = map(int, out.split()[-2:])
    err = estimate / measured - 1
    assert LOW <= err <= HIGH, f"{name} b={batch_size}: estimate {estimate} vs measured {measured} ({err:+.1%})"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name, batch_size", [("lenet5", 64), ("resnet32", 32)])
def test_memory_estimate_against_cuda_max_memory_allocated(name, batch_size):
    """Not yet measured on a GPU (none lent): cuDNN workspaces may differ, hence the wider band."""
    measured, estimate, err = compare(name, batch_size, device="cuda")
    assert -0.10 <= err <= 0.25, f"{name} b={batch_size}: {estimate} vs {measured} ({err:+.1%})"


def test_the_overhanging_convolutions_weight_is_found_and_charged_to_onednn_without_avx512():
    """VGG-16 at 32 × 32 ends with 3 × 3 convolutions of 512 channels over 2 × 2 maps; ResNet-32's
    smallest map (8 × 8) is larger than its kernels. Without AVX-512 oneDNN's backward of such a
    convolution holds 4 × its weight bytes of scratch (docs/compiler.md §3)."""
    vgg = trace_model(models.vgg16(), (torch.randn(2, 3, 32, 32),)).analysis
    resnet = trace_model(models.resnet32(), (torch.randn(2, 3, 32, 32),)).analysis
    assert vgg.overhang_conv_weight_bytes == 512 * 512 * 9 * 4
    assert resnet.overhang_conv_weight_bytes == 0
    without_avx512 = not torch.backends.cpu.get_cpu_capability().startswith("AVX512")
    assert library_workspace(["cpu:0"], vgg) == (4 * 512 * 512 * 9 * 4 if without_avx512 else 0)
    assert library_workspace(["cpu:0"], resnet) == 0
    with torch.backends.mkldnn.flags(enabled=False):
        assert library_workspace(["cpu:0"], vgg) == 0


def test_estimate_parts_by_hand_for_resnet32():
    analysis = trace_model(models.resnet32(), (torch.randn(2, 3, 32, 32),)).analysis
    p, q = 464_154, analysis.num_float_buffers
    assert q == 2 * (16 + 2 * 5 * 16 + 2 * 5 * 32 + 2 * 5 * 64)  # running mean and var per BN channel
    est = estimate_memory(analysis, 16, replicas_per_device=3)
    assert est.params == est.grads == est.optimizer == 4 * p
    assert est.flat_share == math.ceil((3 * 4 * p + 4 * q) / 3)
    assert est.activations == math.ceil(analysis.saved_bytes_per_sample * 16)
    largest = analysis.max_activation_bytes_per_sample * 16
    assert largest == 16 * 16 * 32 * 32 * 4
    assert analysis.max_param_bytes == 64 * 64 * 9 * 4
    assert est.workspace == math.ceil(max(3 * largest, largest + 64 * 64 * 9 * 4))
    assert est.total == est.training_step + est.flat_share
    double = estimate_memory(analysis, 32, replicas_per_device=3)
    assert double.activations == pytest.approx(2 * est.activations, abs=1)
    with pytest.raises(ValueError, match="both must be ≥ 1"):
        estimate_memory(analysis, 0)


def test_too_many_replicas_for_the_budget_raise_plan_error_with_the_arithmetic():
    model, x = models.lenet5(), torch.randn(2, 1, 28, 28)
    per = estimate_memory(trace_model(model, (x,)).analysis, 64, replicas_per_device=3)
    share_total = 3 * per.flat_share
    budget = 2 * (per.total - per.flat_share) + share_total + 1000  # two fit, three do not
    with pytest.raises(cg.PlanError) as info:
        cg.compile(model, (x,), F.cross_entropy, batch_size=64, devices=["cpu:0", "cpu:1"], replicas=3,
                   memory_budget=budget)
    msg = str(info.value)
    assert f"3 replicas × {per.total / 2**20:.1f} MiB per learner" in msg
    assert f"= {3 * per.total / 2**20:.1f} MiB exceed the {budget / 2**20:.1f} MiB budget of cpu:0" in msg
    assert f"activations {per.activations / 2**20:.2f}" in msg and "at batch 64" in msg
    assert "learn:d0:r0, learn:d0:r1, learn:d0:r2" in msg
    assert "at most 2 replica(s) fit" in msg and "raise memory_budget" in msg
    plan = cg.compile(model, (x,), F.cross_entropy, batch_size=64, devices=["cpu:0", "cpu:1"], replicas=2,
                      memory_budget=budget)
    assert plan.num_learners == 4


def test_max_replicas_per_device_is_the_bound_compile_enforces():
    model, x = models.resnet32(), torch.randn(2, 3, 32, 32)
    analysis = trace_model(model, (x,)).analysis
    budget = 300 * 2**20
    m = max_replicas_per_device(analysis, 16, budget)
    assert m == 6  # 6 × 46.4 MiB = 278 MiB fit in 300 MiB; 7 × 46.3 MiB = 324 MiB do not
    cg.compile(model, (x,), F.cross_entropy, batch_size=16, devices=["cpu:0"], replicas=m,
               memory_budget=budget)
    with pytest.raises(cg.PlanError, match=f"at most {m} replica"):
        cg.compile(model, (x,), F.cross_entropy, batch_size=16, devices=["cpu:0"], replicas=m + 1,
                   memory_budget=budget)
    assert max_replicas_per_device(analysis, 16, 1000) == 0


def test_cuda_estimate_adds_cublas_workspace_per_learner_and_the_budget_is_free_memory(monkeypatch):
    """On CUDA each learner's stream gets cuBLAS's workspace (32 MiB on sm_90, 8.125 MiB
    before; CUBLAS_WORKSPACE_CONFIG overrides it), part `library` of the estimate; the budget is
    the free memory plus this process's reserved cache, the smallest over the devices."""
    from crossbow_graph import build
    from crossbow_graph.compiler.analysis import cublas_workspace_bytes
    from crossbow_graph.compiler.passes import library_workspace

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    assert cublas_workspace_bytes((9, 0)) == 32 * 2**20
    assert cublas_workspace_bytes((8, 0)) == (4096 * 2 + 16 * 8) * 1024
    assert cublas_workspace_bytes((9, 0), ":4096:2") == 8 * 2**20
    with pytest.raises(ValueError, match="CUBLAS_WORKSPACE_CONFIG"):
        cublas_workspace_bytes((9, 0), ":4096")
    analysis = trace_model(models.lenet5(), (torch.randn(2, 1, 28, 28),)).analysis
    base = estimate_memory(analysis, 64, 2)
    gpu = estimate_memory(analysis, 64, 2, library_workspace=32 * 2**20)
    assert gpu.total == base.total + 32 * 2**20 and gpu.as_dict()["library"] == 32 * 2**20
    assert gpu.training_step == base.training_step and "library 32.00" in gpu.breakdown()
    assert library_workspace(["cpu:0", "cpu:1"]) == 0
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert library_workspace(["cuda:0"]) == 32 * 2**20
    free = {0: 70 * 2**30, 1: 60 * 2**30}
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: (free[d.index], 80 * 2**30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d: 2**30)
    assert build.cuda_memory_budget(["cuda:0", "cuda:1"]) == 61 * 2**30


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_memory_measurement_does_not_depend_on_earlier_cublas_work():
    """The measured peak is the same before and after cuBLAS work on the default stream (its
    workspace, allocated once per stream, is cleared before each measurement)."""
    from memcheck import measure_training_step_bytes

    first = measure_training_step_bytes(lambda: models.get_model("lenet5"), (1, 28, 28), 64,
                                        device="cuda")
    a = torch.randn(256, 256, device="cuda")
    (a @ a).sum().item()  # cuBLAS on the default stream
    again = measure_training_step_bytes(lambda: models.get_model("lenet5"), (1, 28, 28), 64,
                                        device="cuda")
    assert abs(again - first) <= 0.01 * first, (first, again)
