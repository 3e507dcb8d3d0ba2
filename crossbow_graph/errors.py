"""The errors crossbow_graph raises for what a user can get wrong."""

from __future__ import annotations

__all__ = ["TraceError", "TraceWarning", "PlanError", "TaskError", "DivergenceError", "CheckpointError",
           "DistributedError", "CompilerError", "is_count"]


def is_count(value: object, minimum: int = 1) -> bool:
    """True for an ``int`` ≥ ``minimum`` that is not a ``bool``: a valid count of rounds, epochs,
    samples, windows or replicas (the argument checks raise ValueError on anything else)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


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


class CheckpointError(RuntimeError):
    """No checkpoint in a directory can be loaded, or one does not match the plan or the data.

    The message names the directory or file, what is wrong, and how to fix it.
    """


class CompilerError(RuntimeError):
    """The C kernels of the CPU (kernels/sma_cpu.c) could not be built or loaded.

    Raised by ``compile(..., kernel_backend="c")``; ``"auto"`` then keeps the torch kernels. The
    message has the compiler's output and the fixes: install a C compiler, set ``$CC``, or use
    ``kernel_backend="torch"``.
    """
