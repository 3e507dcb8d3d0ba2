"""The errors crossbow_graph raises for what a user can get wrong (docs/api.md, Errors)."""

from __future__ import annotations

import numbers
import os
import sys
import warnings

import torch

__all__ = ["TraceError", "TraceWarning", "PlanError", "TaskError", "DivergenceError", "CheckpointError",
           "DistributedError", "CompilerError", "HookError", "TrainingInterrupted", "is_count", "is_real",
           "check_flag", "check_number", "warn_caller"]


def is_count(value: object, minimum: int = 1) -> bool:
    """True for an ``int`` ≥ ``minimum`` that is not a ``bool``: a valid count of rounds, epochs,
    samples, windows or replicas (the argument checks raise ValueError on anything else)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def is_real(value: object) -> bool:
    """True for a real number (``numbers.Real``: int, float, numpy scalars) that is not a ``bool``."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_number(owner: str, name: str, value: object, example: str) -> None:
    """TypeError unless ``value``, the argument ``name`` of ``owner`` (e.g. ``"SGD"``), is a real
    number (not a bool, not a string); ``example`` shows a valid value (``"lr=0.01"``)."""
    if is_real(value):
        return
    hint = example
    if isinstance(value, str):
        try:
            hint = f"{name}={float(value)!r}"  # '0.1' → lr=0.1
        except ValueError:
            pass
    raise TypeError(f"{owner}({name}={value!r}): must be a number, got {type(value).__name__}; "
                    f"e.g. {hint}")


def warn_caller(message: str) -> None:
    """A UserWarning at the first frame outside this package and torch (its decorators): the
    user's line that led to it, however deep (a hook, a policy, the auto-tuner)."""
    ours = tuple(os.path.dirname(os.path.abspath(m.__file__)) + os.sep
                 for m in (sys.modules[__package__], torch))
    frame, level = sys._getframe(1), 2
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(ours):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, UserWarning, stacklevel=level)


def check_flag(name: str, value: object, owner: str = "") -> None:
    """TypeError unless ``value``, the argument ``name`` (of ``owner``, e.g. ``"SGD"``), is True
    or False: a truthy stand-in (``'no'``, 1, a NumPy bool) would switch it on unnoticed."""
    if isinstance(value, bool):
        return
    what = f"{owner}({name}={value!r})" if owner else f"{name}={value!r}"
    why = (" (a string is not a bool: any non-empty string, 'no' and 'False' too, counts as True)"
           if isinstance(value, str) else "")
    raise TypeError(f"{what}: must be True or False{why}")


class TraceError(ValueError):
    """The example inputs do not run through the model, or (``compile(..., strict_trace=True)``)
    torch.fx cannot trace it; the message names the module, the operation and the fix."""


class TraceWarning(UserWarning):
    """No fx tracer could trace the model: it trains as given (docs/compiler.md §1, Trace fallback)."""


class PlanError(ValueError):
    """The requested plan cannot be built or is unsound (devices, replicas, memory); the message says why."""


class TaskError(RuntimeError):
    """A task failed while the runtime executed the plan; names the task, its device and the round."""

    def __init__(self, message: str, *, task_id: str, device: str, round_index: int) -> None:
        super().__init__(message)
        self.task_id = task_id
        self.device = device
        self.round_index = round_index


class DivergenceError(TaskError):
    """Every replica produced NaN or Inf in the same round (engine/learning/faults.py; docs/api.md, Errors)."""


class DistributedError(TaskError):
    """Processes of a torchrun launch disagree or lost each other (engine/transport/comm.py; docs/api.md,
    Errors); ``round_index`` is −1 at start-up."""


class HookError(RuntimeError):
    """A hook declaring ``mutates_replicas = False`` wrote w, v or z while a round was learned ahead."""


class CheckpointError(RuntimeError):
    """A checkpoint cannot be read, matched or written, or the directory is another fit's
    (docs/reliability.md, Checkpoints)."""


class TrainingInterrupted(SystemExit):
    """A fit stopped by a signal at a round boundary: a ``SystemExit`` of code 128 + the signal
    number (docs/reliability.md, Stopping a fit).

    Attributes:
        signal_number: the signal received (``signal.SIGTERM``).
        rounds_done: the plan's rounds done when the fit stopped.
        checkpoint: the checkpoint file holding that state, or None without a ``checkpoint_dir``."""

    def __init__(self, message: str, *, signal_number: int, rounds_done: int,
                 checkpoint: str | None) -> None:
        super().__init__(128 + signal_number)
        self.message = message
        self.signal_number = signal_number
        self.rounds_done = rounds_done
        self.checkpoint = checkpoint

    def __str__(self) -> str:
        return self.message


class CompilerError(RuntimeError):
    """The C kernels of the CPU (kernels/sma_cpu.c) could not be built or loaded
    (``kernel_backend="c"``; docs/kernels.md, The C kernels)."""
