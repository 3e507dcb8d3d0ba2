"""The execution backends' protocol, ``Backend`` (docs/runtime.md, "Backends";
docs/design-overview.md §5): a backend runs a round's ``RoundEnv`` over a plan's
``RunContext``."""

from __future__ import annotations

from typing import Any, ContextManager

import torch

from .context import RunContext
from .env import RoundEnv

__all__ = ["Backend", "NULL_CONTEXT"]


class _Null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


NULL_CONTEXT = _Null()


class Backend:
    """Runs rounds (engine/backends/: inline, streams, graphs, process); these defaults are a
    host backend's: no streams, nothing in flight between rounds.

    Attributes:
        ctx: what every backend shares of the plan's engine (``RunContext``)."""

    def __init__(self, ctx: RunContext) -> None:
        self.ctx = ctx

    def run_round(self, env: RoundEnv, indices: torch.Tensor | None,
                  next_indices: torch.Tensor | None) -> None:
        """Run every task of the round ``env`` (its batch None: load the samples ``indices``
        ``[k·b]``); ``next_indices``: the next round's, when nothing writes the replicas between
        the rounds (a backend may learn it ahead).

        Raises:
            TaskError: a task failed."""
        raise NotImplementedError

    def prefetch(self, round_index: int, indices: torch.Tensor, b: int) -> None:
        """Start loading round ``round_index``'s batch of b per learner early (nothing here)."""

    def flush(self) -> None:
        """Complete the work in flight (nothing here)."""

    def join(self) -> None:
        """Order the caller's stream after the work so far (nothing here)."""

    def finish(self) -> None:
        """End of a fit: ``flush``, and every fault still to record is recorded."""
        self.flush()

    def close(self) -> None:
        """Release what the backend holds (processes, streams); it may run rounds again."""

    @property
    def learning_ahead(self) -> bool:
        """Whether the next round's learning is in flight."""
        return False

    @property
    def cuda_streams(self) -> Any:
        """The CudaStreams the rounds run on, or None."""
        return None

    def on_stream(self, kind: str, label: Any, env: RoundEnv, d: int = 0,
                  r0: int = 0) -> ContextManager:
        """The context issuing round ``env``'s work of ``kind`` (a task of device d, its rows from
        r0) on its stream (none here)."""
        return NULL_CONTEXT

    def global_update(self, env: RoundEnv, accs: list[torch.Tensor],
                      bufs: list[torch.Tensor]) -> None:
        """The sync algorithm's global update of the sums ``accs`` (acc_d ``[P]`` in device
        order) and the buffers ``bufs`` (``[m_d, Q]`` per device) on the global stream; then the
        ranks' count of fault events not yet shared, which the transport's all-reduce carried
        (torchrun), shared (``share_faults``)."""
        transport = self.ctx.sync.transport
        with self.on_stream("global", "global_sync", env):
            env.sync.global_update(self.ctx.sync, env, accs, bufs)
            count = transport.take_fault_count()
            if count is not None:
                self.share_faults(count, env.round_index)

    def share_faults(self, count: torch.Tensor, round_index: int) -> None:
        """Under torchrun, after the all-reduce of round ``round_index``: ``count`` (1 element)
        is the ranks' number of fault events not yet shared; share them now if it is > 0
        (``FaultMonitor.share``)."""
        ctx = self.ctx
        if count.item() > 0:
            ctx.faults.share(ctx.comm, round_index, ctx.num_learners, ctx.states[0].z)
