"""``crossbow-graph train``'s defaults per machine: what the flags left out mean on a CPU and on a
CUDA GPU (docs/benchmarking.md, "The main job").

On a CPU the defaults are what measures fastest there: one learner at b = 256 with AdamW and a
OneCycle schedule (docs/benchmarking.md: SMA with k = 2 single-threaded learners needs more
epochs than one learner using both cores). On a CUDA GPU the defaults train what CROSSBOW is
about: SMA at a small per-learner batch with several replicas per GPU, the SGD kernels, graph
rounds. That recipe — b = 16, k = 4, SGD with momentum 0.9, η 0.02 ×0.1 at epochs 2 and 4 — is
the one measured on W1 (docs/benchmarking.md, ``crossbow-r2``: 99.0 % at 2.25–2.75 epochs), with
m = 4 replicas on one GPU for its k = 4; LeNet-5 at b = 16 is launch-bound on a GPU, where graph
rounds of m = 4 learners replay a round's ~10² kernels in one launch (first-principles figures:
≥ 200 k samples/s against plain eager's 30–55 k). The GPU choice is a first-principles default
that the GPU acceptance's W1 section (bench/gpu_acceptance.sh) confirms or corrects.
"""

from __future__ import annotations

import argparse
import os

import torch

from .build import resolve_devices

__all__ = ["CPU_DEFAULTS", "GPU_DEFAULTS", "apply_machine_defaults", "graph_rounds_default"]

# flag (argparse dest) → the value a flag left out takes on that machine
CPU_DEFAULTS = {"optimizer": "adamw", "batch_size": 256, "lr_schedule": "onecycle"}
GPU_DEFAULTS = {"optimizer": "sgd", "batch_size": 16, "lr_schedule": "multistep", "replicas": 4}


def apply_machine_defaults(args: argparse.Namespace) -> list[str]:
    """Give every machine-dependent flag left out (None) of ``args`` its value on the machine
    that trains: ``GPU_DEFAULTS`` when the plan's devices are CUDA GPUs (``--devices`` 'auto' or
    a count on a machine with CUDA), else ``CPU_DEFAULTS``; ``--cuda-graphs`` as
    ``graph_rounds_default`` says. ``--replicas`` left out on a CPU stays None (cli_layout.py
    chooses). Returns the GPU defaults applied, as flags (empty on a CPU).

    Raises:
        ValueError: ``--devices`` neither 'auto' nor a count (resolve_devices' message).
    """
    flag = "auto" if args.devices is None else args.devices
    devices = resolve_devices(int(flag) if str(flag).isdigit() else flag)
    gpu = devices[0].startswith("cuda")
    applied = []
    for name, value in (GPU_DEFAULTS if gpu else CPU_DEFAULTS).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
            applied.append(f"--{name.replace('_', '-')} {value}")
    if args.cuda_graphs is None:
        args.cuda_graphs = graph_rounds_default(args, devices)
        if args.cuda_graphs:
            applied.append("--cuda-graphs")
    return applied if gpu else []


def graph_rounds_default(args: argparse.Namespace, devices: list[str]) -> bool:
    """``--cuda-graphs`` left out: on where graph rounds replay (engine/graphs.py ``why_not``):
    one CUDA device, one process (no torchrun group, no ``--fault-tolerant``), SMA with the SGD
    kernels (``--optimizer sgd``), no fp16 loss scaling."""
    return (len(devices) == 1 and devices[0].startswith("cuda")
            and int(os.environ.get("WORLD_SIZE", "1") or 1) == 1 and not args.fault_tolerant
            and args.sync == "sma" and args.optimizer == "sgd" and args.precision != "fp16"
            and torch.cuda.is_available())
