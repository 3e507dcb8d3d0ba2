"""The errors crossbow_graph raises for what a user can get wrong."""

from __future__ import annotations

__all__ = ["TraceError", "PlanError", "TaskError"]


class TraceError(ValueError):
    """The model cannot be traced by torch.fx; the message names the module, the operation and the fix."""


class PlanError(ValueError):
    """The requested plan cannot be built or is unsound (devices, replicas, memory); the message says why."""


class TaskError(RuntimeError):
    """A task failed while the runtime executed the plan; names the task, its device and the round."""

    def __init__(self, message: str, *, task_id: str, device: str, round_index: int) -> None:
        super().__init__(message)
        self.task_id = task_id
        self.device = device
        self.round_index = round_index
