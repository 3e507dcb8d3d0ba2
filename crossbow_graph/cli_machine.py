"""``crossbow-graph train``'s defaults per machine (docs/benchmarking.md, "The main job"): on a
CPU what measures fastest there (one learner, b = 256, AdamW, OneCycle); on a CUDA GPU SMA at
b = 16 with 4 replicas per GPU, SGD with 10× drops (W1's measured b = 16, k = 4 recipe) in graph
rounds: a first-principles default the GPU acceptance's W1 section confirms or corrects."""

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
    """Give the machine-dependent flags left out (None) of ``args`` their values: ``GPU_DEFAULTS``
    when the plan's devices are CUDA GPUs, else ``CPU_DEFAULTS`` (``--replicas`` stays None for
    cli_layout.py); ``--cuda-graphs`` as ``graph_rounds_default`` says. Returns the GPU defaults
    applied, as flags. Raises ValueError: a bad ``--devices`` (resolve_devices')."""
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
