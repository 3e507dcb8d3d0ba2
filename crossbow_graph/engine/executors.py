"""Which backend runs a plan's round: the executor option (``"auto"``, ``"inline"``,
``"process"``), the process backend, and the in-process backend made at first use — plain on
the host, on CUDA streams (or through ``stream_ops``, the seam simulated streams run through),
or captured in CUDA graphs with a ``RoundGraph`` (docs/runtime.md, "Executors", "Backends")."""

from __future__ import annotations

from typing import Any, Literal, get_args

from .backends.graphs.backend import GraphBackend
from .backends.inline import InlineBackend
from .backends.process.backend import ProcessBackend
from .backends.process.mailbox import fork_available
from .backends.streams.backend import StreamsBackend
from .backends.streams.discipline import CUDA_OPS, CudaStreams
from .learning.threads import available_cores
from .rounds.backend import Backend
from .rounds.context import RunContext

__all__ = ["Executors", "Executor", "EXECUTORS"]

Executor = Literal["auto", "inline", "process"]
EXECUTORS = get_args(Executor)


class Executors:
    """The backends of one plan and the choice between them (this module's docstring).

    Args:
        ctx: the plan's RunContext.
        executor: ``"auto"``, ``"inline"`` or ``"process"``.
        round_graph: a ``RoundGraph`` (CUDA-graph rounds), or None.

    Attributes:
        process: the process backend; current: the backend of the round being run (or last run).

    Raises:
        ValueError: an unknown ``executor``, or ``"process"`` with a CUDA device."""

    def __init__(self, ctx: RunContext, executor: Executor, round_graph: Any = None) -> None:
        if executor not in EXECUTORS:
            raise ValueError(f"executor={executor!r}: use one of {EXECUTORS}")
        if executor == "process" and not ctx.on_cpu:
            raise ValueError("executor='process' runs CPU devices only; use 'inline' (CUDA streams) "
                             "or 'auto' for CUDA devices")
        self.ctx, self.executor = ctx, executor
        self._round_graph = round_graph
        self._stream_ops: Any = None
        self._resolved: tuple[int, str] | None = None  # (k, executor) cache
        self.process = ProcessBackend(ctx)
        self._inline: InlineBackend | None = None
        self.current: Backend = self.process

    def resolved(self, sync: Any) -> str:
        """The executor that runs the next round under the sync algorithm ``sync``:
        ``"inline"`` or ``"process"``."""
        if self.executor != "auto":
            return self.executor
        if "process" not in sync.executors:  # e.g. a global sync that writes every replica
            return "inline"
        k = self.ctx.num_learners
        if self._resolved is None or self._resolved[0] != k:
            process = self.ctx.on_cpu and available_cores() >= 2 and k >= 2 and fork_available()
            self._resolved = (k, "process" if process else "inline")
        return self._resolved[1]

    def choose(self, sync: Any, *, indices_only: bool) -> Backend:
        """The backend of the next round (``indices_only``: it has sample indices, no batch):
        the process backend where it is resolved to, else the in-process one (worker processes
        stopped)."""
        if indices_only and self.resolved(sync) == "process":
            self.current = self.process
        else:
            self.process.close()
            self.current = self.inline
        return self.current

    @property
    def inline(self) -> InlineBackend:
        """The in-process backend: on CUDA streams (or ``stream_ops``), captured in CUDA graphs
        with ``round_graph``, else plain inline; made at first use."""
        if self._inline is None:
            ops = self._stream_ops
            if ops is None and not self.ctx.on_cpu:
                ops = CUDA_OPS
            if ops is None:
                self._inline = InlineBackend(self.ctx)
            elif self._round_graph is not None:
                self._inline = GraphBackend(self.ctx, ops, self._round_graph)
            else:
                self._inline = StreamsBackend(self.ctx, ops)
        return self._inline

    @property
    def made(self) -> list[Backend]:
        """The backends made so far (the process backend, the in-process one once made)."""
        return [self.process] + ([self._inline] if self._inline is not None else [])

    @property
    def stream_ops(self) -> Any:
        """The streams' ``StreamOps`` (None: torch.cuda on CUDA devices)."""
        return self._stream_ops

    def use_stream_ops(self, ops: Any) -> None:
        """Run the in-process rounds on CUDA streams through ``ops`` (a ``StreamOps``: the seam
        where crossbow_graph/testing's simulated streams run the CUDA path on CPU devices)."""
        self._stream_ops = ops
        self.drop_inline()

    @property
    def round_graph(self) -> Any:
        """A ``RoundGraph`` capturing the rounds, or None. Setting it re-chooses."""
        return self._round_graph

    @round_graph.setter
    def round_graph(self, graph: Any) -> None:
        self._round_graph = graph
        self.drop_inline()

    def drop_inline(self) -> None:
        """Close the in-process backend; the next round makes one anew."""
        if self._inline is not None:
            self._inline.close()
            self._inline = None

    def replan(self) -> None:
        """A new task graph: the worker processes stop, the streams start after the old work,
        the graphs are captured anew."""
        self.process.close()
        if self._inline is not None:
            self._inline.close()
        if self._round_graph is not None:
            self._round_graph.clear()  # other tasks, other buffers: new graphs

    @property
    def cuda_streams(self) -> CudaStreams | None:
        """The in-process rounds' CudaStreams (engine/backends/streams/discipline.py), or None."""
        return self.inline.cuda_streams
