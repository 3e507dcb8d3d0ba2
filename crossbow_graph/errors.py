"""The errors crossbow_graph raises for what a user can get wrong."""

from __future__ import annotations

import numbers

__all__ = ["TraceError", "TraceWarning", "PlanError", "TaskError", "DivergenceError", "CheckpointError",
           "DistributedError", "CompilerError", "HookError", "TrainingInterrupted", "is_count",
           "check_flag", "check_number"]


def is_count(value: object, minimum: int = 1) -> bool:
    """True for an ``int`` ≥ ``minimum`` that is not a ``bool``: a valid count of rounds, epochs,
    samples, windows or replicas (the argument checks raise ValueError on anything else)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def check_number(owner: str, name: str, value: object, example: str) -> None:
    """TypeError unless ``value``, the argument ``name`` of ``owner`` (e.g. ``"SGD"``), is a real
    number (not a bool, not a string); ``example`` shows a valid value (``"lr=0.01"``)."""
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return
    hint = example
    if isinstance(value, str):
        try:
            hint = f"{name}={float(value)!r}"  # '0.1' → lr=0.1
        except ValueError:
            pass
    raise TypeError(f"{owner}({name}={value!r}): must be a number, got {type(value).__name__}; "
                    f"e.g. {hint}")


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
    """No fx tracer could trace the model (or a module in it could not be measured): it trains
    as given, and the message says what the tracers reported and what inspection lost
    (docs/compiler.md §1, "Trace fallback"). ``compile(..., strict_trace=True)`` raises the
    TraceError instead."""


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
    """Every replica produced NaN or Inf in the same round: training cannot continue.

    Raised at the local synchronisation of the round (engine/faults.py; under torchrun at the
    global sync, on every rank alike, counting every rank's faults). The message names the round
    and says whether the central model z is finite: if it is, z and the last checkpoint on disk
    are intact and the usual fixes apply (a lower learning rate, gradient-safe loss, resuming
    from the last checkpoint). Under torchrun also raised by the z check (``checksum_every``)
    when z holds NaN/Inf on some rank, naming those ranks and the round.
    """


class DistributedError(TaskError):
    """Processes of a torchrun launch disagree or lost each other (engine/comm.py).

    Raised at start-up when the ranks' plans, computations or data sizes differ (the message names
    the difference and each rank's value), when ranks never arrived or left during start-up, when
    a peer rank left the process group (died, or stopped on an error) or did not answer a
    collective within the timeout (the message says which), or when the copies of z differ
    between ranks. ``round_index`` is −1 at start-up.
    """


class HookError(RuntimeError):
    """A hook broke what it declares (training/hooks.py ``Hook``): it wrote the replicas (w, v or
    z) while worker processes learned the next round from them, but declares
    ``mutates_replicas = False``; the message names the hook and the fixes."""


class CheckpointError(RuntimeError):
    """No checkpoint in a directory can be loaded, one does not match the plan or the data, one
    cannot be written (a full disk, a file-size limit), or the directory is another fit's: held
    by a running fit, or holding another run's checkpoints where ``resume=False``.

    The message names the directory or file, what is wrong, and how to fix it.
    """


class TrainingInterrupted(SystemExit):
    """A fit stopped by a signal (SIGTERM: ``docker stop``, SLURM, ``kill``) at a round boundary.

    The fit finishes the round in progress, writes a checkpoint when it has a ``checkpoint_dir``
    (training/signals.py), runs its hooks' ``after_fit`` and raises this. A ``SystemExit`` with
    code 128 + the signal number (143 for SIGTERM): a script that does not catch it ends with
    that status, as a process the signal killed would, and ``except Exception`` does not swallow
    it. The message (``str``) says which signal, after which round, and the checkpoint to resume.

    Attributes:
        signal_number: the signal received (``signal.SIGTERM``).
        rounds_done: the plan's rounds done when the fit stopped.
        checkpoint: the checkpoint file holding that state, or None without a ``checkpoint_dir``.
    """

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
    """The C kernels of the CPU (kernels/sma_cpu.c) could not be built or loaded.

    Raised by ``compile(..., kernel_backend="c")``; ``"auto"`` then keeps the torch kernels. The
    message has the compiler's output and the fixes: install a C compiler, set ``$CC``, or use
    ``kernel_backend="torch"``.
    """
