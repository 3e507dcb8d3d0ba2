"""What a CUDA-graph capture of a round needs, checked on CPU devices: ``CaptureChecker`` (host
reads, data-dependent shapes, rounds that differ) and ``SimulatedGraphs`` (CUDA-graph semantics
without a GPU), both ``TorchDispatchMode``s (docs/runtime.md, "CUDA-graph rounds")."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_leaves

from ..engine.backends.graphs.probe import capture_problem
from .frames import issuing_frame

__all__ = ["CaptureChecker", "SimulatedGraphs", "SimulatedGraph", "CaptureError"]

aten = torch.ops.aten
_UNDECLARED = {aten.native_batch_norm.default: ("running_mean", "running_var")}  # written, undeclared


class CaptureError(RuntimeError):
    """An op a CUDA graph cannot capture (what ``SimulatedGraph.capture`` raises)."""


def _scalars(args: tuple, kwargs: dict) -> tuple:
    """The Python numbers among an op's arguments, in order (what a capture freezes)."""
    return tuple(v for v in tree_leaves((args, kwargs))
                 if isinstance(v, (int, float)) and not isinstance(v, bool))


class CaptureChecker(TorchDispatchMode):
    """Records the rounds it watches (``with checker.round(t): ...``) and reports what would keep
    each from being captured or replayed as it was.

    Attributes:
        findings: round t → its problems as text: ``capture_problem``'s, and against round t − 1 a
            changed op sequence or Python number (``"aten.add_.Tensor: 0.05 → 0.1"``).
        ops: round t → how many ops it ran."""

    def __init__(self) -> None:
        super().__init__()
        self.findings: dict[int, list[str]] = {}
        self.ops: dict[int, int] = {}
        self._round: int | None = None
        self._log: list[tuple[str, tuple]] = []
        self._last: list[tuple[str, tuple]] | None = None

    @contextmanager
    def round(self, t: int) -> Iterator[None]:
        self._round, self._log = t, []
        self.findings[t] = []
        try:
            with self:
                yield
        finally:
            self._round = None
        self.ops[t] = len(self._log)
        if self._last is not None:
            self.findings[t] += _differences(self._last, self._log)
        self._last = self._log

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self._round is not None:
            problem = capture_problem(func, args, kwargs)
            if problem is not None:
                self.findings[self._round].append(f"{problem} at {issuing_frame()}")
            self._log.append((str(func), _scalars(args, kwargs)))
        return func(*args, **kwargs)


def _differences(before: list[tuple[str, tuple]], now: list[tuple[str, tuple]]) -> list[str]:
    ops_before, ops_now = [op for op, _ in before], [op for op, _ in now]
    if ops_before != ops_now:
        i = next((i for i, (a, b) in enumerate(zip(ops_before, ops_now)) if a != b),
                 min(len(ops_before), len(ops_now)))
        return [f"the op sequence changed at op {i} ({len(ops_before)} → {len(ops_now)} ops: "
                f"{ops_before[i] if i < len(ops_before) else '—'} → "
                f"{ops_now[i] if i < len(ops_now) else '—'})"]
    return [f"{op}: {' '.join(map(str, a))} → {' '.join(map(str, b))}"
            for (op, a), (_, b) in zip(before, now) if a != b]


class SimulatedGraph(TorchDispatchMode):
    """One simulated CUDA graph: its recorded ops."""

    def __init__(self) -> None:
        super().__init__()
        self.recorded: list[tuple[Any, tuple, dict, Any]] = []
        self._journal: dict[int, tuple[torch.UntypedStorage, torch.UntypedStorage]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        problem = capture_problem(func, args, kwargs)
        if problem is not None:
            raise CaptureError(f"operation not permitted when stream is capturing: {problem}")
        for t in _written(func, args, kwargs):
            storage = t.untyped_storage()
            if storage.data_ptr() not in self._journal and storage.nbytes():
                with _disable_current_modes():  # the simulator's own copy: no op of the round
                    self._journal[storage.data_ptr()] = (storage, storage.clone())
        out = func(*args, **kwargs)
        if not _is_view(func):
            self.recorded.append((func, args, kwargs, out))
        return out

    def undo(self) -> None:
        """Put back every tensor the capture wrote."""
        with _disable_current_modes():
            for storage, saved in self._journal.values():
                storage.copy_(saved)
        self._journal.clear()

    @torch.no_grad()
    def replay(self) -> None:
        for func, args, kwargs, out in self.recorded:
            new = func(*args, **kwargs)
            for ret, old, fresh in zip(func._schema.returns, _as_tuple(out), _as_tuple(new)):
                if ret.alias_info is None:  # new memory at capture: the graph's static output
                    for a, b in zip(tree_leaves(old), tree_leaves(fresh)):
                        if isinstance(a, torch.Tensor):
                            a.copy_(b)


class SimulatedGraphs:
    """``graphs.CudaGraphOps`` on CPU devices, whose capture runs the round as it records it."""

    executes_in_capture = True

    def new_graph(self) -> SimulatedGraph:
        return SimulatedGraph()

    @contextmanager
    def capture(self, graph: SimulatedGraph, device: torch.device) -> Iterator[None]:
        graph._journal.clear()
        try:
            with graph:
                yield
        except BaseException:
            graph.undo()
            raise
        graph._journal.clear()

    def replay(self, graph: SimulatedGraph) -> None:
        graph.replay()


def _is_view(func) -> bool:
    """Every output aliases an input without writing it (a view: nothing to replay)."""
    returns = func._schema.returns
    return bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write
                                 for r in returns)


def _written(func, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    hidden = _UNDECLARED.get(func, ())
    out = []
    for i, argument in enumerate(func._schema.arguments):
        value = args[i] if i < len(args) else kwargs.get(argument.name)
        writes = (argument.alias_info is not None and argument.alias_info.is_write) or \
            argument.name in hidden
        if writes:
            out += [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]
    return out


def _as_tuple(x: Any) -> tuple:
    return x if isinstance(x, tuple) else (x,)

