"""The process backend: rounds on a ``ProcessExecutor``'s learner groups in worker processes
(docs/runtime.md, "Worker processes"; docs/design-overview.md §5)."""

from __future__ import annotations

import torch

from ...rounds.backend import Backend
from ...rounds.context import RunContext
from ...rounds.env import RoundEnv
from .executor import ProcessExecutor

__all__ = ["ProcessBackend"]


class ProcessBackend(Backend):
    """Runs rounds on a ``ProcessExecutor``, started at the first round and again after
    ``close`` or a failed task.

    Attributes:
        executor: the running ProcessExecutor, or None."""

    def __init__(self, ctx: RunContext) -> None:
        super().__init__(ctx)
        self.executor: ProcessExecutor | None = None

    def run_round(self, env: RoundEnv, indices: torch.Tensor | None,
                  next_indices: torch.Tensor | None) -> None:
        """Run round ``env`` on the samples ``indices`` (its batch is None)."""
        if self.executor is None:
            self.executor = ProcessExecutor(self.ctx, env, self.global_update,
                                            seed=self.ctx.fit.seed + env.round_index)
        try:
            self.executor.run_round(env, indices, next_indices)
        finally:
            if self.executor.closed:  # a task failed: the executor stopped its workers
                self.executor = None

    @property
    def learning_ahead(self) -> bool:
        return self.executor is not None and self.executor.ahead is not None

    def close(self) -> None:
        """Stop the worker processes (cancelling a speculative round)."""
        if self.executor is not None:
            executor, self.executor = self.executor, None
            executor.close()
