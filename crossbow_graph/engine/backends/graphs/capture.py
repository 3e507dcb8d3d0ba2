"""CUDA-graph rounds: a whole round captured once per key and replayed, inputs on the device
(host batches through pinned staging), one memory pool, hyper-parameters in device tensors, an
eager round with a GraphWarning naming the reason (docs/runtime.md, "CUDA-graph rounds";
docs/design-overview.md §5)."""

from __future__ import annotations

import warnings
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch.utils._pytree import tree_leaves, tree_map

from .probe import CaptureProbe
from ...data.batches import DeviceParts, LearnerBatches
from ...learning.learners import learner_seed, seed_rng
from .inputs import DeviceGather, DeviceHyper, GraphHyper, HostStaging, graph_batch

__all__ = ["RoundGraph", "CudaGraphOps", "GraphWarning", "cuda_graphs_refusal"]


class GraphWarning(RuntimeWarning):
    """CUDA-graph rounds fall back to eager rounds (the message says why)."""


def cuda_graphs_refusal(device_names: list[str]) -> str | None:
    """Why ``compile(..., cuda_graphs=True)`` is refused for these devices, or None."""
    if not all(name.startswith("cuda") for name in device_names):
        return (f"cuda_graphs=True captures rounds in CUDA graphs, but the plan's devices are "
                f"{device_names}: use CUDA devices (devices='auto' on a machine with a GPU), or "
                f"leave cuda_graphs=False")
    return None


class CudaGraphOps:
    """torch.cuda's graphs, as ``RoundGraph`` uses them (``SimulatedGraphs`` implements the same
    on CPU devices)."""

    executes_in_capture = False  # a CUDA capture records the kernels without running them

    def __init__(self) -> None:
        self.pool: Any = None  # one memory pool for every graph (made at the first capture)

    def new_graph(self) -> Any:
        return torch.cuda.CUDAGraph()

    @contextmanager
    def capture(self, graph: Any, device: torch.device) -> Iterator[None]:
        """Context: the work issued on the current stream (a side stream ``torch.cuda.graph``
        makes current) and on every stream forked from it goes into ``graph``. Another thread's
        CUDA calls do not break the capture (``capture_error_mode="thread_local"``); the caller's
        stream is current again afterwards, also when the capture fails (``torch.cuda.graph``'s
        exit raises in ``capture_end`` before it restores the stream)."""
        with torch.cuda.device(device):
            caller = torch.cuda.current_stream(device)
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            try:  # one pool: graphs replay one after another on the caller's stream, never
                # concurrently, so a graph's temporaries may live where another's did
                with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                    yield
            except BaseException:
                self._end_failed_capture(torch.cuda.current_device())
                raise
            finally:
                if torch.cuda.current_stream(device) != caller:
                    torch.cuda.set_stream(caller)

    def _end_failed_capture(self, index: int) -> None:
        """After a failed capture on device ``index``: end the allocator's allocation to the pool
        and release the pool's reference, which ``CUDAGraph::capture_end`` skips when it raises
        (else the allocator stays in capture mode: blocks used on another stream are never
        freed; docs/runtime.md). The next capture takes a new pool."""
        try:
            torch._C._cuda_endAllocateToPool(index, self.pool)
        except RuntimeError:  # not allocating to the pool: the capture never began, or it ended
            pass
        else:
            torch._C._cuda_releasePool(index, self.pool)
        self.pool = None

    def replay(self, graph: Any) -> None:
        graph.replay()


@dataclass(eq=False)
class _Entry:
    batch: Any  # the static input on the device: the round's batch is copied (gathered) here
    staging: HostStaging  # host batches pass through it
    gather: DeviceGather | None = None  # resident data: gathered in the graph from ``indices``
    graph: Any = None
    warm: int = 0  # eager rounds run so far
    losses: list[torch.Tensor] | None = None  # the graph's losses, in learning order
    draws_random: bool | None = None  # whether the body draws random numbers (None: not known)
    doomed: str | None = None  # what a warm-up found that a capture cannot take (CaptureProbe)


class RoundGraph:
    """Captures and replays a GraphBackend's rounds (this module's docstring).

    Args:
        ops: ``CudaGraphOps()`` (default) or ``capture_check.SimulatedGraphs()`` on CPU devices.
        warmup_rounds: eager rounds of each key before its capture (≥ 1).

    Attributes:
        observer: None, or a function of the round index giving a context entered around every
            eager run of the body (``capture_check.CaptureChecker.round``).
        failure: why graph rounds stopped, or None: ``"ExcType: message"`` of a failed capture,
            or what a warm-up round found that a capture cannot take (``CaptureProbe``: that
            capture was never started).
        captures, replays: graphs captured and replayed so far."""

    def __init__(self, ops: Any = None, *, warmup_rounds: int = 2) -> None:
        if warmup_rounds < 1:
            raise ValueError(f"warmup_rounds={warmup_rounds}: at least 1 eager round before a "
                             "capture (it allocates the buffers the graph reuses)")
        self.ops = ops if ops is not None else CudaGraphOps()
        self.warmup_rounds = warmup_rounds
        self.observer: Callable[[int], Any] | None = None
        self.failure: str | None = None
        self._stopped: str | None = None  # why every round runs eagerly (a failed capture)
        self.captures = self.replays = 0
        self.eager_rounds: dict[str, int] = {}  # why a round ran eagerly → rounds
        self._entries: dict[tuple, _Entry] = {}
        self._hyper: dict[int, DeviceHyper] = {}  # id(DeviceState) → its tensors
        self._warned: set[str] = set()

    def clear(self) -> None:
        """Drop every graph and static buffer (a re-plan: other buffers, other tasks)."""
        self._entries.clear()
        self._hyper.clear()

    def hyper_view(self, state: Any, hyper: Any) -> GraphHyper:
        """The round's ``hyper`` as the body reads it: ``state``'s device tensors (``set`` by the
        round's prologue)."""
        return self._hyper[id(state)].view(hyper)

    # -- one round ------------------------------------------------------------------------------

    def run_round(self, backend: Any, env: Any) -> bool:
        """Run round ``env`` (a RoundEnv) of ``backend`` (a GraphBackend) on its batch
        (``graph_batch``'s form; ``env.copied``: the events after its copy ahead to the device,
        or None): eagerly during the warm-up, then captured, then replayed. Returns False, having
        run nothing, when the round runs eagerly instead (``why_not``; a failed capture)."""
        ctx, streams = backend.ctx, backend.cuda_streams
        batch = graph_batch(env.batch)
        reason = self.why_not(backend, env, batch)
        if reason is not None:
            self._eager(reason)
            streams.captured = False
            return False
        device = ctx.states[0].torch_device
        caller = streams.ops.current(device)
        for event in env.copied or ():  # a batch copied ahead: read after its copy
            if event is not None:
                streams.ops.wait(caller, event)
        entry = self._entry(ctx, self._key(ctx, env, batch), batch, streams.ops)
        self._copy_batch(entry, batch, streams.ops, env.copied is not None, caller)
        self._prologue(ctx, env, entry)
        streams.captured = True
        streams.seal()  # the round is ordered after the work so far, and waits for none of it
        if entry.graph is not None:
            self._replay(ctx, entry.graph)
            self.replays += 1
            losses = _copied(entry.losses)
        elif entry.warm < self.warmup_rounds:
            losses = self._warm_up(backend, entry, env)
        else:
            if not self._capture(backend, entry, env):
                streams.captured = False
                return False
            if not self.ops.executes_in_capture:
                self._replay(ctx, entry.graph)
            losses = _copied(entry.losses)
        backend.graph_epilogue(env, losses)
        return True

    def _entry(self, ctx: Any, key: tuple, batch: Any, ops: Any) -> _Entry:
        """The key's entry (its static inputs), made at its first round; one of a round with a
        first step (a new replica's zero momentum: another kernel) is not kept."""
        entry = self._entries.get(key)
        if entry is None:
            entry = _new_entry(batch, ctx.states[0].torch_device, HostStaging(ops))
            if not any(f for s in ctx.states for f in s.first_step):  # a first step: once
                self._entries[key] = entry
        return entry

    def _warm_up(self, backend: Any, entry: _Entry, env: Any) -> list[torch.Tensor]:
        """An eager run of the key's body (under ``observer``): whether it draws random numbers,
        and an op its capture cannot take (``CaptureProbe``: then no capture starts)."""
        device = backend.ctx.states[0].torch_device
        mark, probe = _rng_mark(device), CaptureProbe(device)
        with self.observer(env.round_index) if self.observer is not None else nullcontext(), probe:
            losses = self._body(backend, entry, env)
        entry.draws_random = bool(entry.draws_random) or mark != _rng_mark(device)
        entry.warm += 1
        if entry.doomed is None and probe.problem is not None:
            entry.doomed = probe.problem
        return losses

    def _body(self, backend: Any, entry: _Entry, env: Any) -> list[torch.Tensor]:
        """The round as a graph captures it: resident data's gather, then the tasks."""
        if entry.gather is not None:
            entry.gather.fetch.gather(entry.gather.indices, out=entry.batch)
        return backend.graph_body(entry.batch, env)

    def _copy_batch(self, entry: _Entry, batch: Any, ops: Any, copied_ahead: bool,
                    stream: Any) -> None:
        """The round's batch into the entry's static inputs on the caller's ``stream``, before
        the round: resident data's indices; a device tensor directly (one ``copied_ahead`` on a
        copy stream kept alive until ``stream`` has read it); host tensors through the pinned
        staging."""
        if entry.gather is not None:
            entry.gather.indices.copy_(batch.indices)
            return
        host_statics, host_leaves = [], []
        for static, new in zip(tree_leaves(entry.batch), tree_leaves(batch)):
            if new.device == static.device:
                static.copy_(new)
                if copied_ahead:  # allocated on the copy stream, read here
                    ops.keep_alive(new, stream)
            else:
                host_statics.append(static)
                host_leaves.append(new)
        if host_leaves:
            entry.staging.copy_in(host_statics, host_leaves, stream)

    def record(self) -> dict[str, Any]:
        """The graph rounds so far: ``{"captures", "replays", "eager_rounds": {reason: rounds}}``
        (what ``History.cuda_graphs`` holds)."""
        return {"captures": self.captures, "replays": self.replays,
                "eager_rounds": dict(self.eager_rounds)}

    def _replay(self, ctx: Any, graph: Any) -> None:
        """Replay ``graph``, then move the version counters of the state it writes: a replay
        writes behind autograd's back, and readers that refresh on ``Tensor._version`` (the
        central module's low-precision copy of z, ``DeviceState.bind_central``) must see it."""
        self.ops.replay(graph)
        torch.autograd.graph.increment_version(
            [t for s in ctx.states for t in (s.w, s.v, s.g, s.buf, s.z, s.z_prev, s.zbuf)])

    def why_not(self, backend: Any, env: Any, batch: Any) -> str | None:
        """Why round ``env`` of ``backend`` runs eagerly, or None when a graph can run it."""
        ctx = backend.ctx
        if self._stopped is not None:
            return self._stopped
        if backend.cuda_streams is None:
            return "the round has no CUDA streams (the inline executor on CUDA devices runs them)"
        if len(ctx.states) > 1:
            return "the plan has several devices (a graph captures one device's streams)"
        if not ctx.sync.transport.in_graph:
            return ("under torchrun or torchft the global sync's all-reduce and fault sharing run "
                    "on the host")
        if not env.sync.cuda_graphs:
            return f"sync={type(env.sync).__name__}() runs eagerly (its global sync writes every replica)"
        if not ctx.sync.optimizer.kernel:
            return (f"the local optimizer {type(ctx.sync.optimizer.optimizer).__name__} is a row "
                    "optimizer (torch.optim's step reads its hyper-parameters and step counts on "
                    "the host); the SGD kernels run in graphs")
        if any(s.loss_scales is not None for s in ctx.states):
            return "precision='fp16' settles its loss scales on the host"
        return _batch_refusal(batch, ctx.states[0].torch_device)

    def _key(self, ctx: Any, env: Any, batch: Any) -> tuple:
        h = env.hyper
        states = tuple((s.m, s.w.data_ptr(), s.v.data_ptr(), s.g.data_ptr(), s.z.data_ptr(),
                        s.buf.data_ptr(), tuple(s.first_step)) for s in ctx.states)
        # shapes and dtypes: a batch copied ahead (on the device) and one loaded in the round (on
        # the host, an epoch's first) fill the same static inputs
        inputs = tuple((tuple(shape), dtype) for shape, dtype, _ in
                       (batch.specs() if isinstance(batch, DeviceGather) else
                        ((t.shape, t.dtype, t.device) for t in tree_leaves(batch))))
        return (id(ctx.program), states, inputs, env.b, env.learner_mode, bool(env.synchronise),
                h.momentum != 0, h.nesterov, h.weight_decay != 0, env.alpha != 0,
                h.central_momentum != 0, h.centre_gain != 1, env.max_divergence,
                ctx.fit.max_grad_norm)  # numbers the graph's operations hold

    def _prologue(self, ctx: Any, env: Any, entry: _Entry) -> None:
        """Before the round, on the caller's stream: the round's hyper-parameters (``env.hyper``)
        into the device tensors, and, unless the entry's body draws no random numbers, each
        device's generator seeded from (fit seed, round)."""
        for s in ctx.states:
            hyper = self._hyper.get(id(s))
            if hyper is None:
                hyper = self._hyper[id(s)] = DeviceHyper(s.torch_device)
            hyper.set(env.hyper)
            if entry.draws_random is not False:
                seed_rng(s.torch_device,
                         learner_seed(ctx.fit.seed, env.round_index, ctx.learner_offset))

    def _stop(self, failure: str, reason: str) -> None:
        """Graph rounds stop: this round and every later one run eagerly (``why_not``)."""
        self.failure, self._stopped = failure, reason
        self._eager(reason)

    def _capture(self, backend: Any, entry: _Entry, env: Any) -> bool:
        """Capture the body into a new graph; on failure warn, put back what the capture
        changed on the host (the first-step flags; a simulated capture also its tensors) and
        return False. A key whose warm-up found an op a capture cannot take is not captured."""
        if entry.doomed is not None:
            self._stop(entry.doomed, f"a capture would fail ({entry.doomed}); none was started")
            return False
        graph, states = self.ops.new_graph(), backend.ctx.states
        first_steps = [list(s.first_step) for s in states]
        try:
            with self.ops.capture(graph, states[0].torch_device):
                losses = self._body(backend, entry, env)
        except Exception as exc:  # noqa: BLE001 - any op that cannot be captured: fall back
            for s, flags in zip(states, first_steps):
                s.first_step[:] = flags
            backend.drop_streams()  # new streams: none of a failed capture's state lingers
            failure = _first_failure(exc)
            self._stop(failure, f"a capture failed ({failure})")
            return False
        entry.graph, entry.losses = graph, losses
        self.captures += 1
        return True

    def _eager(self, reason: str) -> None:
        """A round runs eagerly: counted under its reason, warned once per reason."""
        self.eager_rounds[reason] = self.eager_rounds.get(reason, 0) + 1
        if reason not in self._warned:
            self._warned.add(reason)
            warnings.warn(f"cuda_graphs=True: rounds run eagerly, without CUDA graphs: {reason}",
                          GraphWarning, stacklevel=4)


def _first_failure(exc: BaseException) -> str:
    """``"ExcType: message"`` of the first exception of a chain (the op that failed, not the
    TaskError around it or the capture's end that failed after it)."""
    first = exc
    while (first.__cause__ or first.__context__) is not None:
        first = first.__cause__ or first.__context__
    return f"{type(first).__name__}: {first}".strip()


def _copied(losses: list[torch.Tensor]) -> list[torch.Tensor]:
    """The graph's m losses (0-dim tensors it overwrites at every replay) copied out in one
    kernel: views of one new ``[m]`` tensor."""
    return list(torch.stack(losses).unbind()) if losses else []


def _new_entry(batch: Any, device: torch.device, staging: HostStaging) -> _Entry:
    """A key's entry: static inputs on ``device`` of the batch's shapes and dtypes (and, for a
    ``DeviceGather``, static indices)."""
    if isinstance(batch, DeviceGather):
        statics = [torch.empty(shape, dtype=dtype, device=dev) for shape, dtype, dev in batch.specs()]
        return _Entry(statics, staging, DeviceGather(batch.fetch, torch.empty_like(batch.indices)))
    return _Entry(tree_map(lambda x: torch.empty_like(x, device=device)
                           if isinstance(x, torch.Tensor) else x, batch), staging)


def _rng_mark(device: torch.device) -> Any:
    """Where ``device``'s generator stands (its Philox offset on CUDA, its state on the CPU):
    two marks differ when random numbers were drawn in between."""
    if device.type == "cuda":
        return torch.cuda.default_generators[device.index or 0].get_offset()
    return torch.default_generator.get_state().numpy().tobytes()


def _batch_refusal(batch: Any, device: torch.device) -> str | None:
    """Why a graph round cannot take ``batch`` (its static inputs are tensors of one shape per
    learner on the plan's ``device``), or None."""
    if isinstance(batch, DeviceGather):  # on the plan's device
        return None
    if isinstance(batch, (LearnerBatches, DeviceParts)) or not all(
            isinstance(t, torch.Tensor) for t in tree_leaves(batch)):
        return ("the batch is not a structure of tensors of one shape per learner (a "
                "collate_fn's own batches): graph rounds copy tensor batches into static "
                "inputs; use a TensorDataset (fit(data_on_device=True) keeps it on the GPU) "
                "or a collate_fn of tensors padded to one length")
    elsewhere = {str(t.device) for t in tree_leaves(batch)
                 if t.device.type != "cpu" and t.device != device}
    if elsewhere:
        return (f"the batch lies on {sorted(elsewhere)}, not on the plan's {device}: pass host "
                f"data or fit(data_on_device=True), which moves a TensorDataset to {device}")
    return None
