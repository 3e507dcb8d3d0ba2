"""Trace a model and describe it: the ModelGraph, from the best tracer available
(docs/compiler.md §1, "Trace fallback")."""

from __future__ import annotations

import contextlib
import copy
import inspect
import io
import math
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx
from torch.fx.passes.shape_prop import ShapeProp

from torch import nn

from ..errors import TraceError, TraceWarning
from .analysis import ModelAnalysis, NodeCost, analysis_of_totals, analyze, unknown_modules
from .eager import EagerMeasurement, measure_forward
from .outputs import loss_of
from .tracers import fx_tracers

__all__ = ["InputSpec", "ModelGraph", "ParamInfo", "trace_model"]

#: BatchNorm modules, whose input shapes ``ModelGraph.batch_norm_inputs`` records.
BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)

@dataclass(frozen=True, kw_only=True)
class ParamInfo:
    """One parameter or buffer of the model: its state_dict key (a tied parameter's first
    name; ``aliases`` the others), shape, dtype, and whether it requires grad (``trainable``)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    trainable: bool
    aliases: tuple[str, ...] = ()

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


@dataclass(frozen=True, kw_only=True)
class InputSpec:
    """One input of the example batch: its forward argument's name, shape and dtype (None
    for a non-tensor)."""

    name: str
    shape: tuple[int, ...] | None
    dtype: torch.dtype | None


@dataclass(kw_only=True)
class ModelGraph:
    """A traced (or measured) model.

    Attributes:
        name: the model's class name.
        module: the ``fx.GraphModule`` on a deep copy of the model; None without a graph.
        example_batch: dimension 0 of the example's first tensor.
        parameters, buffers: the inventory (tied parameters once), in ``named_*()`` order.
        inputs: the example's inputs, in the forward's argument order.
        output_shape: the output's shape when it is one tensor, else None.
        output_has_loss: the example's output carries a loss (compiler/outputs.py).
        batch_norm_inputs: ``(module path, class name, input shape)`` of every BatchNorm call.
        tracer, lost: ``"torch.fx"``, ``"transformers.fx"``, ``"eager"`` or ``"none"``
            (docs/compiler.md, "Trace fallback"), and what inspection lost with it.
        untraced: every fx tracer's error where none could trace the model, else "".
        node_meta: per fx node name: ``shape``, ``bytes`` and ``dtype`` of its output.
        meta: ``"analysis"`` (the ModelAnalysis), ``"train_flops_per_sample"``, and what
            compiler passes add."""

    name: str
    module: fx.GraphModule | None
    example_batch: int
    parameters: list[ParamInfo]
    buffers: list[ParamInfo]
    inputs: tuple[InputSpec, ...] = ()
    output_shape: tuple[int, ...] | None = None
    output_has_loss: bool = False
    batch_norm_inputs: tuple[tuple[str, str, tuple[int, ...]], ...] = ()
    tracer: str = "torch.fx"
    lost: str = ""
    untraced: str = ""
    node_meta: dict[str, dict[str, Any]] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def analysis(self) -> ModelAnalysis:
        """The model's analysis (FLOPs, activation bytes; compiler/analysis.py)."""
        return self.meta["analysis"]

    @property
    def num_trainable(self) -> int:
        """P: the number of trainable scalars, tied parameters counted once."""
        return sum(p.numel for p in self.parameters if p.trainable)

    @property
    def num_parameters(self) -> int:
        """All parameter scalars (trainable and frozen), tied parameters counted once."""
        return sum(p.numel for p in self.parameters)


class _ShapeProp(ShapeProp):
    """ShapeProp that remembers the node it ran last (to say where example inputs fail)."""

    current: fx.Node | None = None

    def run_node(self, n: fx.Node) -> Any:
        self.current = n
        return super().run_node(n)


def _first_tensor(values: Any) -> torch.Tensor | None:
    if isinstance(values, torch.Tensor):
        return values
    if isinstance(values, (list, tuple)):
        for v in values:
            t = _first_tensor(v)
            if t is not None:
                return t
    if isinstance(values, dict):
        return _first_tensor(list(values.values()))
    return None


def _inventory(module: torch.nn.Module) -> tuple[list[ParamInfo], list[ParamInfo]]:
    seen: dict[int, str] = {}
    aliases: dict[str, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            aliases[seen[id(p)]].append(name)
        else:
            seen[id(p)] = name
            aliases[name] = []
    params = [
        ParamInfo(name=n, shape=tuple(p.shape), dtype=p.dtype, trainable=p.requires_grad,
                  aliases=tuple(aliases[n]))
        for n, p in module.named_parameters()
    ]
    buffers = [
        ParamInfo(name=n, shape=tuple(b.shape), dtype=b.dtype, trainable=False)
        for n, b in module.named_buffers()
    ]
    return params, buffers


def _working_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A deep copy of ``model`` to trace and run: tracing may add attributes to the module it
    traces, and the forward of shape propagation may update buffers (an EMA, a call counter)."""
    try:
        return copy.deepcopy(model)
    except Exception as exc:  # noqa: BLE001 - any failure to copy gets the same advice
        raise TypeError(
            f"{type(model).__name__} cannot be deep-copied ({type(exc).__name__}: {exc}); compile() "
            "traces a copy of the model and trains copies of it, so its attributes must support "
            "copy.deepcopy (keep open files, locks and the like outside the module)"
        ) from exc


def _cuda_indices(model: torch.nn.Module, inputs: list[Any]) -> list[int]:
    """The CUDA devices of the model's tensors and of the example inputs."""
    tensors = [*model.parameters(), *model.buffers(), *(t for t in inputs if isinstance(t, torch.Tensor))]
    return sorted({t.device.index or 0 for t in tensors if t.is_cuda})


class _InputsError(TraceError):
    """The example inputs do not run through the traced graph (made ``_public`` on leaving)."""


def _public(exc: TraceError) -> TraceError:
    """``exc`` as the public TraceError, with its message and cause."""
    if type(exc) is TraceError:
        return exc
    public = TraceError(str(exc))
    public.__cause__ = exc.__cause__
    return public


def _positional(gm: fx.GraphModule, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    """The example inputs as the GraphModule's positional arguments (placeholder order)."""
    sig = inspect.signature(gm.forward)
    try:
        bound = sig.bind(*args, **kwargs)
    except TypeError as exc:
        raise _InputsError(
            f"the example inputs do not match the model's forward{sig}: {exc}. Pass a tuple of "
            "positional inputs, e.g. (x,), or a dict of keyword inputs, e.g. {'x': x, 'mask': m}."
        ) from exc
    bound.apply_defaults()
    return [bound.arguments[name] for name in sig.parameters]


def _fixed_defaults(model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                    concrete_args: dict[str, Any] | None) -> dict[str, Any] | None:
    """``concrete_args`` plus every forward argument the example inputs leave at its default
    (docs/compiler.md §1)."""
    try:
        sig = inspect.signature(model.forward)
        bound = sig.bind_partial(*args, **kwargs)
    except (TypeError, ValueError):
        return concrete_args
    fixed = dict(concrete_args or {})
    for name, param in sig.parameters.items():
        if (name not in bound.arguments and name not in fixed
                and param.default is not inspect.Parameter.empty
                and param.kind in (param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY)):
            fixed[name] = param.default
    return fixed or None


def trace_model(
    model: torch.nn.Module,
    example_inputs: tuple[Any, ...] | dict[str, Any],
    *,
    concrete_args: dict[str, Any] | None = None,
    leaf_modules: Sequence[type[torch.nn.Module]] = (),
    strict: bool = False,
) -> ModelGraph:
    """The ModelGraph of ``model`` traced by the best tracer available, shape-propagated on
    ``example_inputs`` and analysed (docs/compiler.md §1, §2); ``model`` and torch's RNG are
    left as they were.

    Args:
        model: any ``nn.Module``.
        example_inputs: one batch: a tuple of positional inputs, e.g. ``(x,)`` with
            ``x [N, C, H, W]``, or a dict of keyword inputs.
        concrete_args: ``{forward argument: fixed value}``, as ``torch.fx.symbolic_trace``'s.
        leaf_modules: module classes called as a whole instead of traced through.
        strict: raise TraceError when no fx tracer can trace the model, instead of the eager
            analysis (with its ``TraceWarning``).

    Raises:
        TraceError: the example inputs do not run through the model; or, with ``strict``,
            torch.fx cannot trace it (names the module, the line and the fix).
        TypeError: ``model`` is not an ``nn.Module`` or cannot be deep-copied, or
            ``example_inputs`` is neither a tuple nor a dict."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"compile() takes an nn.Module, got {type(model).__name__}")
    if isinstance(example_inputs, dict):
        args, kwargs = (), dict(example_inputs)
    elif isinstance(example_inputs, tuple):
        args, kwargs = example_inputs, {}
    else:
        raise TypeError(
            f"example_inputs must be a tuple of the model's positional inputs, e.g. (x,), or a "
            f"dict of its keyword inputs, e.g. {{'x': x}}; got {type(example_inputs).__name__}"
        )
    concrete_args = _fixed_defaults(model, args, kwargs, concrete_args)
    devices = _cuda_indices(model, list(args) + list(kwargs.values()))
    # tracing and shape propagation run the forward on a copy, and torch's RNG (dropout, randn in
    # a forward) is restored afterwards: the model and the random stream are as they were
    with torch.random.fork_rng(devices=devices):
        work = _working_copy(model)
        if leaf_modules and isinstance(work, tuple(leaf_modules)):  # the root as a leaf
            return _eager_graph(model, work, args, kwargs, devices, failures=[], asked=True)
        failures: list[tuple[str, TraceError]] = []
        for name, make in fx_tracers(model, args, kwargs, concrete_args, leaf_modules):
            try:
                return _fx_graph(model, work, name, make, args, kwargs, devices)
            except TraceError as exc:
                failures.append((name, exc))
        if strict:
            raise _public(failures[0][1])
        return _eager_graph(model, work, args, kwargs, devices, failures=failures)


def _fx_graph(model: nn.Module, work: nn.Module, tracer: str, make: Callable,
              args: tuple[Any, ...], kwargs: dict[str, Any], devices: list[int]) -> ModelGraph:
    """The ModelGraph of ``work`` (a copy of ``model``) traced by ``make``, shape-propagated on
    the example inputs and analysed, its unknown modules measured eagerly."""
    gm = make(model, work)
    first = _first_tensor(list(args) + list(kwargs.values()))
    example_batch = int(first.shape[0]) if first is not None and first.dim() > 0 else 1
    positional = _positional(gm, args, kwargs)
    output = _propagate(model, gm, positional, args, kwargs)
    node_meta: dict[str, dict[str, Any]] = {}
    for node in gm.graph.nodes:
        tm = node.meta.get("tensor_meta")
        if tm is not None and hasattr(tm, "shape"):
            shape = tuple(tm.shape)
            nbytes = math.prod(shape) * torch.empty((), dtype=tm.dtype).element_size()
            node_meta[node.name] = {"shape": shape, "bytes": nbytes, "dtype": tm.dtype}
        else:
            node_meta[node.name] = {"shape": None, "bytes": 0, "dtype": None}
    params, buffers = _inventory(model)
    measured = _measure_modules(model, gm, positional, devices)
    analysis = analyze(gm, example_batch, parameters=params, buffers=buffers, measured=measured)
    nodes = list(gm.graph.nodes)
    out_node = next(n for n in reversed(nodes) if n.op == "output")
    norms = tuple((str(n.target), type(gm.get_submodule(str(n.target))).__name__,
                   node_meta[n.name]["shape"]) for n in nodes
                  if n.op == "call_module" and isinstance(gm.get_submodule(str(n.target)), BATCH_NORMS)
                  and node_meta[n.name]["shape"] is not None)
    return ModelGraph(
        name=type(model).__name__, module=gm, example_batch=example_batch, parameters=params,
        buffers=buffers, node_meta=node_meta, tracer=tracer,
        inputs=tuple(InputSpec(name=str(n.target), shape=node_meta[n.name]["shape"],
                               dtype=node_meta[n.name]["dtype"]) for n in nodes if n.op == "placeholder"),
        output_shape=node_meta[out_node.name]["shape"], output_has_loss=loss_of(output) is not None,
        batch_norm_inputs=norms,
        meta={"analysis": analysis, "train_flops_per_sample": analysis.train_flops_per_sample})


def _propagate(model: nn.Module, gm: fx.GraphModule, positional: list[Any],
               args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``gm``'s output on the example inputs, shapes propagated, in evaluation mode without
    autograd. Raises TraceError naming the module or node when the inputs do not run through."""
    was_training = gm.training
    prop = _ShapeProp(gm)
    try:
        gm.eval()
        # ShapeProp prints the traceback itself; the TraceError below says what matters
        with torch.no_grad(), contextlib.redirect_stderr(io.StringIO()):
            return prop.propagate(*positional)
    except Exception as exc:  # noqa: BLE001
        cause = exc.__cause__ or exc  # ShapeProp wraps the model's own error
        node = prop.current
        where = ""
        if node is not None and node.op == "call_module":
            where = f" in module '{node.target}' ({type(gm.get_submodule(node.target)).__name__})"
        elif node is not None:
            where = f" at node '{node.name}' ({getattr(node.target, '__name__', node.target)})"
        raise _inputs_error(model, args, kwargs, cause, where) from exc
    finally:
        gm.train(was_training)


def _inputs_error(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                  cause: BaseException, where: str = "") -> TraceError:
    shapes = [list(t.shape) for t in list(args) + list(kwargs.values()) if isinstance(t, torch.Tensor)]
    return _InputsError(
        f"the example inputs (shapes {shapes}) do not run through {type(model).__name__}"
        f"{where}: {type(cause).__name__}: {cause}. Pass example_inputs=(x,) with x one batch "
        "shaped like the training data (e.g. x = train_dataset[0][0].unsqueeze(0)).")


def _measure_modules(model: nn.Module, gm: fx.GraphModule, positional: list[Any],
                     devices: list[int]) -> dict[str, Any]:
    """Eager costs of the graph's modules without a cost formula, or {} with a TraceWarning."""
    targets = unknown_modules(gm)
    if not targets:
        return {}
    error = None
    for training in (True, False):
        try:
            return measure_forward(gm, positional, scopes=targets, devices=devices,
                                   training=training).scopes
        except Exception as exc:  # noqa: BLE001 - the fx analysis stands without it
            error = error or exc
    warnings.warn(f"{type(model).__name__}: the modules {targets} cannot be measured eagerly "
                  f"({type(error).__name__}: {error}); their FLOPs and memory are the op "
                  "vocabulary's guess (docs/compiler.md §2)", TraceWarning, stacklevel=6)
    return {}


def _eager_graph(model: nn.Module, work: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                 devices: list[int], *, failures: list[tuple[str, TraceError]],
                 asked: bool = False) -> ModelGraph:
    """The ModelGraph of one measured forward of ``work``, with a TraceWarning unless ``asked``."""
    children = [name for name, _ in work.named_children()]
    norms = [name for name, m in work.named_modules() if isinstance(m, BATCH_NORMS)]
    measurement, error = None, None
    for training in (True, False):
        try:
            measurement = measure_forward(work, args, kwargs, scopes=children + norms,
                                          devices=devices, training=training)
            break
        except Exception as exc:  # noqa: BLE001 - tried again in evaluation mode, then plainly
            error = error or exc
    params, buffers = _inventory(model)
    first = _first_tensor(list(args) + list(kwargs.values()))
    example_batch = int(first.shape[0]) if first is not None and first.dim() > 0 else 1
    if measurement is None:
        output = _plain_forward(model, work, args, kwargs, failures, error)
        analysis = analysis_of_totals([], example_batch, parameters=params, buffers=buffers,
                                      forward_flops=0, activation_bytes=0, saved_bytes=0,
                                      max_activation_bytes=0, residual_joins=None)
        tracer, lost = "none", (
            f"the eager measurement failed too ({type(error).__name__}: {error}): FLOPs and "
            "activation memory are unknown (0 in plan.summary(); memory_budget bounds "
            "parameters, gradients and momentum only) and there is no per-op table")
    else:
        output = measurement.output
        analysis = _eager_analysis(work, measurement, children, example_batch, params, buffers)
        tracer, lost = "eager", (
            "FLOPs count matrix products, convolutions and attention only (FlopCounterMode; "
            "element-wise ops and norms are left out), activation memory is one measured "
            "forward, parameter bytes come from the module; there is no fx graph "
            "(plan.model_graph.module is None), and analysis.table() lists the top-level "
            "modules instead of every op")
    untraced = "; ".join(str(exc).rstrip(".") for _, exc in failures)
    if not asked:
        _warn_untraced(type(model).__name__, failures)
    scopes = measurement.scopes if measurement is not None else {}
    batch_norms = tuple((path, type(work.get_submodule(path)).__name__, scopes[path].input_shape)
                        for path in norms if path in scopes and scopes[path].input_shape)
    shape = tuple(output.shape) if isinstance(output, torch.Tensor) else None
    return ModelGraph(
        name=type(model).__name__, module=None, example_batch=example_batch, parameters=params,
        buffers=buffers, inputs=_bound_inputs(model, args, kwargs), output_shape=shape,
        output_has_loss=loss_of(output) is not None, batch_norm_inputs=batch_norms,
        tracer=tracer, lost=lost, untraced=untraced,
        meta={"analysis": analysis, "train_flops_per_sample": analysis.train_flops_per_sample})


_WARNED_UNTRACED: set[str] = set()  # model classes whose TraceWarning this process has shown


def _warn_untraced(name: str, failures: list[tuple[str, TraceError]]) -> None:
    """One line, once per model class and process: no fx graph, the first tracer's reason in
    short, and where the detail is (``plan.summary()``; docs/compiler.md, Trace fallback)."""
    if name in _WARNED_UNTRACED:
        return
    _WARNED_UNTRACED.add(name)
    reason = ""
    if failures:
        tracer, exc = failures[0]
        cause = exc.__cause__ or exc
        text = str(cause).strip().splitlines()[0] if str(cause).strip() else ""
        reason = f" ({tracer}: {type(cause).__name__}: {text[:80]}{'…' if len(text) > 80 else ''})"
    warnings.warn(f"{name} has no fx graph{reason}; it trains as given, with an approximate "
                  "analysis: plan.summary() says what inspection lost and why; "
                  "strict_trace=True raises the TraceError instead", TraceWarning, stacklevel=6)


def _plain_forward(model: nn.Module, work: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                   failures: list[tuple[str, TraceError]], error: BaseException | None) -> Any:
    """``work``'s output on the example inputs, in evaluation mode without autograd; TraceError
    (shape propagation's, when there was one) when they do not run through."""
    was_training = work.training
    try:
        work.eval()
        with torch.no_grad():
            return work(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001
        found = next((e for _, e in failures if isinstance(e, _InputsError)), None)
        raise _public(found or _inputs_error(model, args, kwargs, exc)) from exc
    finally:
        work.train(was_training)


def _eager_analysis(work: nn.Module, measurement: EagerMeasurement, children: list[str],
                    example_batch: int, params: list[ParamInfo], buffers: list[ParamInfo]) -> ModelAnalysis:
    """A ModelAnalysis of one measured forward: a node per top-level module, and ``rest``."""
    nodes = []
    for path in children:
        c = measurement.scopes[path]
        if c.calls:
            nodes.append(NodeCost(name=path, op="module", target=f"{path} ({type(work.get_submodule(path)).__name__})",
                                  shape=c.output_shape, dtype=c.output_dtype, flops=c.flops,
                                  bytes=c.activation_bytes, saved_bytes=c.saved_bytes))
    t = measurement.total
    nodes.append(NodeCost(name="rest", op="rest", target=f"{type(work).__name__}'s own ops",
                          shape=t.output_shape, dtype=t.output_dtype,
                          flops=max(t.flops - sum(n.flops for n in nodes), 0),
                          bytes=max(t.activation_bytes - sum(n.bytes for n in nodes), 0),
                          saved_bytes=max(t.saved_bytes - sum(n.saved_bytes for n in nodes), 0)))
    return analysis_of_totals(nodes, example_batch, parameters=params, buffers=buffers,
                              forward_flops=t.flops, activation_bytes=t.activation_bytes,
                              saved_bytes=t.saved_bytes, max_activation_bytes=t.max_activation_bytes,
                              residual_joins=None)


def _bound_inputs(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[InputSpec, ...]:
    """The example's inputs by forward argument, ``*args`` and ``**kwargs`` one by one."""
    try:
        bound = inspect.signature(model.forward).bind(*args, **kwargs)
    except (TypeError, ValueError):
        named = [(f"input{i}", a) for i, a in enumerate(args)] + list(kwargs.items())
    else:
        named = []
        params = inspect.signature(model.forward).parameters
        for name, value in bound.arguments.items():
            kind = params[name].kind
            if kind is inspect.Parameter.VAR_POSITIONAL:
                named += [(f"{name}[{i}]", v) for i, v in enumerate(value)]
            elif kind is inspect.Parameter.VAR_KEYWORD:
                named += list(value.items())
            else:
                named.append((name, value))
    return tuple(InputSpec(name=name, shape=tuple(v.shape) if isinstance(v, torch.Tensor) else None,
                           dtype=v.dtype if isinstance(v, torch.Tensor) else None) for name, v in named)
