"""``crossbow-graph train``'s flags that set an option: of ``compile`` (``CompileOptions``), of
``Plan.fit`` (``FitOptions``), of SMA or of ``Distributed``. Each such flag takes its default
and its choices from the option's field (docs/options.md), except where ``CLI_DEFAULTS`` gives
the CLI's own default and the reason; tests/test_options.py holds the two together."""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from typing import Any, get_args

from .compile_options import CompileOptions
from .engine.comm import Distributed
from .engine.sync import SMA
from .training.options import FitOptions

__all__ = ["OPTION_FLAGS", "CLI_DEFAULTS", "BUILDING_FLAGS", "flag_default", "flag_choices",
           "option_field_type", "DefaultsFormatter", "max_grad_norm_arg", "replicas_arg",
           "cpu_threads_arg"]

OPTION_FLAGS: dict[str, tuple[type, str]] = {  # flag → (the dataclass, its field)
    "--batch-size": (CompileOptions, "batch_size"),
    "--devices": (CompileOptions, "devices"),
    "--replicas": (CompileOptions, "replicas"),
    "--learner-mode": (CompileOptions, "learner_mode"),
    "--precision": (CompileOptions, "precision"),
    "--memory-format": (CompileOptions, "memory_format"),
    "--cuda-graphs": (CompileOptions, "cuda_graphs"),
    "--checkpoint-dir": (FitOptions, "checkpoint_dir"),
    "--checkpoint-every": (FitOptions, "checkpoint_every"),
    "--resume": (FitOptions, "resume"),
    "--log-dir": (FitOptions, "log_dir"),
    "--epochs": (FitOptions, "epochs"),
    "--target": (FitOptions, "target_accuracy"),
    "--evals-per-epoch": (FitOptions, "evals_per_epoch"),
    "--bn-recalibration-batches": (FitOptions, "bn_recalibration_batches"),
    "--metrics-every": (FitOptions, "metrics_every"),
    "--seed": (FitOptions, "seed"),
    "--max-grad-norm": (FitOptions, "max_grad_norm"),
    "--cpu-threads": (FitOptions, "cpu_threads"),
    "--alpha": (SMA, "alpha"),
    "--central-momentum": (SMA, "central_momentum"),
    "--sync-every": (SMA, "sync_every"),
    "--dist-timeout": (Distributed, "timeout_s"),
    "--checksum-every": (Distributed, "checksum_every"),
    "--sync-dtype": (Distributed, "sync_dtype"),
    "--fault-tolerant": (Distributed, "fault_tolerant"),
    "--lighthouse": (Distributed, "lighthouse"),
    "--replica-group": (Distributed, "replica_group"),
    "--min-replicas": (Distributed, "min_replicas"),
}

# flag → (the CLI's default, why it is not the option's): the CLI trains the main job of
# docs/benchmarking.md (LeNet-5 on MNIST; on a CPU AdamW with a OneCycle schedule, b = 256,
# 'auto' × 1; on a GPU SMA at b = 16, 4 replicas per GPU, SGD, graph rounds: cli_machine.py).
# --batch-size, --optimizer and --lr-schedule default to None, the machine's (cli_machine.py).
CLI_DEFAULTS: dict[str, tuple[Any, str]] = {
    "--devices": (None, "'auto', or with --replicas alone one device (cli_layout.py)"),
    "--replicas": (None, "4 per GPU (cli_machine.py); on a CPU 1, or as many as a --policy "
                         "needs for k ≥ 2 (cli_layout.py): the auto-tuner only when asked for, "
                         "by --replicas auto"),
    "--cuda-graphs": (None, "on where graph rounds replay: one CUDA device, one process, SMA "
                            "with --optimizer sgd (cli_machine.py); else off"),
    "--epochs": (3, "the main job's length, which its OneCycle schedule spans"),
    "--target": (0.99, "the main job trains to 99 % test accuracy (0: no target)"),
    "--evals-per-epoch": (4, "the main job's time-to-accuracy resolution"),
    "--metrics-every": (None, "50 with a --policy, else 0 (no metrics): a window costs the next "
                              "round's overlap, and only policies read the metrics"),
    "--central-momentum": (None, "SMA's own; None tells --sync diloco that it was not given"),
    "--sync-every": (None, "SMA's τ (1) or, with --sync diloco or local_sgd, their H "
                           "(cli.DILOCO_H)"),
}

# flags named after an option whose value they build from a name and other flags (no default of
# the option to keep): flag → what it builds
BUILDING_FLAGS: dict[str, str] = {
    "--optimizer": "the torch.optim class of cli.OPTIMIZERS, over the model, with --lr, "
                   "--momentum and --weight-decay",
    "--sync": "SMA, DiLoCo or local SGD with their own flags (cli._sync)",
}


class DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a flag's default unless it is None or False (those say what happens in the help)."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False or "(default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def _field(cls: type, name: str) -> dataclasses.Field:
    return {f.name: f for f in dataclasses.fields(cls)}[name]


def option_field_type(cls: type, name: str) -> Any:
    """The type of ``cls``'s field ``name``; an annotation kept as a string (a module with
    ``from __future__ import annotations``) is looked up by name in ``cls``'s module."""
    kind = _field(cls, name).type
    return getattr(sys.modules[cls.__module__], kind, kind) if isinstance(kind, str) else kind


def flag_default(flag: str) -> Any:
    """``flag``'s default: the CLI's own where ``CLI_DEFAULTS`` lists it, else the option's."""
    if flag in CLI_DEFAULTS:
        return CLI_DEFAULTS[flag][0]
    return _field(*OPTION_FLAGS[flag]).default


def flag_choices(flag: str) -> tuple[str, ...]:
    """``flag``'s choices: the strings of its option's ``Literal`` type."""
    return get_args(option_field_type(*OPTION_FLAGS[flag]))


def max_grad_norm_arg(text: str) -> float:
    """``--max-grad-norm``: a positive finite number."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"'{text}': give a positive number, e.g. 1.0 (leave the "
                                         "flag out for no clipping)")
    return value


def replicas_arg(text: str) -> int | str:
    """``--replicas``: 'auto' or a whole number ≥ 1."""
    if text == "auto":
        return text
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"'{text}': give a whole number ≥ 1 or 'auto'")
    return int(text)


def cpu_threads_arg(text: str) -> int | str:
    """``--cpu-threads``: 'auto' or a whole number ≥ 1."""
    if text == "auto":
        return text
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"'{text}': give a whole number ≥ 1 or 'auto'")
    return int(text)
