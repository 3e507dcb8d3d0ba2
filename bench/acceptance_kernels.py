"""The Triton kernels the GPU acceptance check launches, as ``KernelSpec``s: its env section
compiles them in parallel (kernels/precompile.py) while it checks the environment, so that no
later section waits for Triton's JIT (~0.5–2 s a kernel, one after another).

Each list follows what a section (or a gpu-marked test) runs: the model's P, m, the local
optimizer's flags, SMA's μ_z and τ, eager rounds (hyper-parameters as numbers) and graph rounds
(``HYPER_PTR``), rows padded as a CUDA DeviceState pads them. A kernel left out is compiled at
its launch, as before; one listed but never launched costs a worker a second.
"""

from __future__ import annotations

import torch

from crossbow_graph import models
from crossbow_graph.engine.state import row_length
from crossbow_graph.kernels.select import UpdateFacts, kernel_specs
from crossbow_graph.kernels.triton_sma import KernelSpec, central_spec, local_spec

import sma_kernel
from acceptance_common import BNNet

__all__ = ["acceptance_specs", "fit_specs", "num_parameters"]

CUDA = torch.device("cuda")


def num_parameters(name: str) -> int:
    """P of a zoo model (trainable parameters), or of ``sma_kernel.model_shapes``' ResNet-50."""
    if name == "resnet50":
        return sum(int(torch.Size(s).numel()) for s in sma_kernel.model_shapes()[name])
    return sum(p.numel() for p in models.get_model(name).parameters() if p.requires_grad)


def fit_specs(P: int, m: int, *, graphs: tuple[bool, ...] = (False, True), momentum: float = 0.9,
              nesterov: bool = False, weight_decay: float = 0.0, central_momentum: float = 0.9,
              dtype: torch.dtype = torch.float32) -> list[KernelSpec]:
    """What an SMA fit (τ = 1) of m replicas of P parameters on one CUDA device launches, in
    eager rounds and/or graph rounds."""
    facts = UpdateFacts(momentum=momentum, nesterov=nesterov, weight_decay=weight_decay,
                        num_learners=m, sync_every=1, central_momentum=central_momentum)
    return [s for g in graphs for s in kernel_specs(m, P, "cuda", facts, dtype=dtype, graphs=g,
                                                    row_stride=row_length(P, CUDA))]


def _bandwidth_specs() -> list[KernelSpec]:
    """bench/sma_kernel.py ``bench_cuda``: the local update on padded and on contiguous rows
    (later steps, the correction, numbers) and the central update, LeNet-5 / ResNet-32 /
    ResNet-50 at m ∈ {1, 2, 4, 8}."""
    out = []
    for name in ("resnet50", "lenet5", "resnet32"):
        P = num_parameters(name)
        for m in (8, 1, 2, 4):
            for stride in (row_length(P, CUDA), P):
                out.append(local_spec(m, P, torch.float32, "cuda", momentum=sma_kernel.MOMENTUM,
                                      nesterov=False, weight_decay=0.0, first_step=False,
                                      correct=True, row_stride=stride))
        out.append(central_spec(P, "cuda", central_momentum=sma_kernel.MU_Z))
    return out


def _kernel_test_specs() -> list[KernelSpec]:
    """tests/test_kernels.py ``test_gpu_kernels_match_torch``: ResNet-32's P, m ∈ {1, 4, 8, 16},
    float32 and bfloat16 gradients, contiguous and padded rows, three steps (the first, a later
    one, a Nesterov one), and the central update."""
    P, out = 464_154, []
    for m in (1, 4, 8, 16):
        for dtype in (torch.float32, torch.bfloat16):
            for stride in (P, 464_160):
                for first, nesterov in ((True, False), (False, False), (False, True)):
                    out.append(local_spec(m, P, dtype, "cuda", momentum=0.9, nesterov=nesterov,
                                          weight_decay=1e-4, first_step=first, correct=True,
                                          row_stride=stride))
    return out + [central_spec(P, "cuda", central_momentum=0.9)]


def acceptance_specs() -> list[KernelSpec]:
    """Every listed kernel, once, the first sections' first: decisive (LeNet-5, m ∈ {1, 4, 16,
    32}), W1 (the CLI's GPU defaults: LeNet-5, m ∈ {1, 4, 16}), memory (m = 8), throughput
    (ResNet-32, m = 4), the graph tests (LeNet-5 and LeNet-5 with BatchNorm at m = 4; bf16
    gradients), the bandwidth section, the kernel tests, the race and reference fits (BNNet
    and LeNet-5 at m = 2)."""
    lenet, resnet32 = num_parameters("lenet5"), num_parameters("resnet32")
    bnnet = sum(p.numel() for p in BNNet().parameters())
    specs = [s for m in (4, 16, 1, 32, 8) for s in fit_specs(lenet, m)]
    specs += fit_specs(resnet32, 4) + fit_specs(lenet + 12, 4)  # + BatchNorm2d(6)
    specs += fit_specs(lenet, 4, graphs=(True,), dtype=torch.bfloat16)
    specs += _bandwidth_specs() + _kernel_test_specs()
    specs += fit_specs(bnnet, 2, graphs=(False,)) + fit_specs(lenet, 2, graphs=(False,))
    return list(dict.fromkeys(specs))
