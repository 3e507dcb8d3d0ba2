"""Trace a model with torch.fx and describe it: the ModelGraph (docs/design-overview.md §1, compiler/trace.py)."""

from __future__ import annotations

import contextlib
import copy
import inspect
import io
import os
import traceback
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torch.fx as fx
from torch.fx.passes.shape_prop import ShapeProp

from ..errors import TraceError
from .analysis import ModelAnalysis, analyze

__all__ = ["ModelGraph", "ParamInfo", "trace_model"]

_TORCH_DIR = os.path.dirname(torch.__file__)


@dataclass(frozen=True, kw_only=True)
class ParamInfo:
    """One parameter or buffer of the model.

    Attributes:
        name: state_dict key (the first name, for a tied parameter).
        shape: its shape.
        dtype: its dtype.
        trainable: a parameter with ``requires_grad`` (False for frozen parameters and buffers).
        aliases: the other names of a tied (shared) parameter.
    """

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


@dataclass(kw_only=True)
class ModelGraph:
    """A traced model: the fx GraphModule with shapes, and its parameter inventory.

    Attributes:
        module: the ``torch.fx.GraphModule``, built on a deep copy of the model; its state_dict
            keys are the model's.
        example_batch: the batch size of the example inputs (dimension 0 of the first tensor).
        parameters: every distinct parameter (tied ones once), in ``named_parameters()`` order.
        buffers: every buffer, in ``named_buffers()`` order.
        node_meta: per fx node name: ``shape`` (tuple or None) and ``bytes`` of its output at the
            example batch.
        meta: extra analysis: ``"analysis"`` (the ModelAnalysis: per-node FLOPs and bytes,
            totals per sample) and ``"train_flops_per_sample"``; compiler passes may add more.
    """

    module: fx.GraphModule
    example_batch: int
    parameters: list[ParamInfo]
    buffers: list[ParamInfo]
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


class _Tracer(fx.Tracer):
    """An fx tracer that remembers which module was being traced when tracing failed."""

    def __init__(self, leaf_modules: Sequence[type[torch.nn.Module]] = ()) -> None:
        super().__init__()
        self._leaf_types = tuple(leaf_modules)

    def is_leaf_module(self, m: torch.nn.Module, module_qualified_name: str) -> bool:
        if self._leaf_types and isinstance(m, self._leaf_types):
            return True
        return super().is_leaf_module(m, module_qualified_name)

    def call_module(self, m, forward, args, kwargs):
        try:
            return super().call_module(m, forward, args, kwargs)
        except Exception as exc:
            if not hasattr(exc, "_cg_module"):
                exc._cg_module = (self.path_of_module(m) or "<root>", type(m).__name__)
            raise


def _user_frame(exc: BaseException) -> traceback.FrameSummary | None:
    """The innermost traceback frame outside torch: the user's line that failed."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.startswith(_TORCH_DIR)]
    frames = [f for f in frames if os.sep + "crossbow_graph" + os.sep + "compiler" not in f.filename]
    return frames[-1] if frames else None


def _trace_error(model: torch.nn.Module, exc: BaseException) -> TraceError:
    path, cls = getattr(exc, "_cg_module", ("<root>", type(model).__name__))
    frame = _user_frame(exc)
    where = f"{frame.filename}:{frame.lineno}: `{(frame.line or '').strip()}`" if frame else "(unknown line)"
    text = str(exc)
    leaf = f"compile(..., leaf_modules=[{cls}])"
    if "control flow" in text or "iteration" in text or "bool" in text:
        fix = (
            "Python control flow (if/while/assert) on a tensor's value cannot be traced: replace a "
            "tensor-dependent `if` by torch.where, pass fixed values for arguments that steer it "
            f"with compile(..., concrete_args={{...}}), or call the module as a whole with {leaf}."
        )
    elif "Proxy" in text or "not supported in symbolic tracing" in text:
        fix = (
            "Python builtins (len, range, int, float) on traced tensors or shapes cannot be traced: "
            "keep shapes symbolic with tensor methods (x.size(0), x.flatten(1), "
            "x.view(x.size(0), -1)), wrap the helper with torch.fx.wrap, or call the module as a "
            f"whole with {leaf}."
        )
    else:
        fix = (
            f"Call the module as a whole with {leaf}, or pass fixed values with "
            "compile(..., concrete_args={...})."
        )
    return TraceError(
        f"torch.fx cannot trace {type(model).__name__}: in module '{path}' ({cls}) at {where}: "
        f"{type(exc).__name__}: {text}. {fix}"
    )


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


def _positional(gm: fx.GraphModule, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    """The example inputs as the GraphModule's positional arguments (placeholder order)."""
    sig = inspect.signature(gm.forward)
    try:
        bound = sig.bind(*args, **kwargs)
    except TypeError as exc:
        raise TraceError(
            f"the example inputs do not match the model's forward{sig}: {exc}. Pass a tuple of "
            "positional inputs, e.g. (x,), or a dict of keyword inputs, e.g. {'x': x, 'mask': m}."
        ) from exc
    bound.apply_defaults()
    return [bound.arguments[name] for name in sig.parameters]


def _fixed_defaults(model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                    concrete_args: dict[str, Any] | None) -> dict[str, Any] | None:
    """``concrete_args`` plus every forward argument the example inputs leave at its default.

    The runtime calls the model with the same inputs as the example (training/data.py), so an
    argument left out (``mask=None``) keeps its default in training too; fixing it lets Python
    code such as ``if mask is not None`` trace the branch that will run.
    """
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
) -> ModelGraph:
    """Trace ``model`` with torch.fx, propagate the example inputs' shapes, and analyse it.

    Args:
        model: any ``nn.Module``; it is not modified (its parameters, buffers, modes and
            attributes, and torch's global RNG state, are as before): the tracer and shape
            propagation work on a deep copy, which ``ModelGraph.module`` holds.
        example_inputs: one batch (any batch size) as the runtime passes it to the model
            (engine/inputs.py ``split_inputs``): a tuple of positional inputs, e.g. ``(x,)`` with
            ``x [N, C, H, W]`` or ``(tokens, mask)``, or a dict of keyword inputs,
            e.g. ``{"x": x, "mask": mask}``.
        concrete_args: fixed values for arguments that steer Python control flow
            (``torch.fx.symbolic_trace``'s ``concrete_args``); forward arguments that the example
            inputs leave out are fixed to their defaults as well.
        leaf_modules: module classes called as a whole instead of traced through.

    Returns:
        The ModelGraph, with ``meta["analysis"]`` (compiler/analysis.py) and
        ``meta["train_flops_per_sample"]``.

    Raises:
        TraceError: torch.fx cannot trace the model (names the module, the line and the fix), or
            the example inputs do not run through the traced model.
        TypeError: ``model`` is not an ``nn.Module``, cannot be deep-copied, or ``example_inputs``
            is neither a tuple nor a dict.
    """
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
    # tracing and shape propagation run the forward on a copy, and torch's RNG (dropout, randn in
    # a forward) is restored afterwards: the model and the random stream are as they were
    with torch.random.fork_rng(devices=_cuda_indices(model, list(args) + list(kwargs.values()))):
        return _trace_copy(model, _working_copy(model), args, kwargs, concrete_args, leaf_modules)


def _trace_copy(model: torch.nn.Module, work: torch.nn.Module, args: tuple[Any, ...],
                kwargs: dict[str, Any], concrete_args: dict[str, Any] | None,
                leaf_modules: Sequence[type[torch.nn.Module]]) -> ModelGraph:
    """``trace_model`` on ``work``, a copy of ``model`` (the inventory and messages use ``model``)."""
    tracer = _Tracer(leaf_modules)
    try:
        graph = tracer.trace(work, concrete_args=concrete_args)
    except Exception as exc:  # noqa: BLE001 - every tracing failure becomes a TraceError
        raise _trace_error(model, exc) from exc
    gm = fx.GraphModule(tracer.root, graph, type(model).__name__)
    first = _first_tensor(list(args) + list(kwargs.values()))
    example_batch = int(first.shape[0]) if first is not None and first.dim() > 0 else 1
    positional = _positional(gm, args, kwargs)
    node_meta: dict[str, dict[str, Any]] = {}
    was_training = gm.training
    prop = _ShapeProp(gm)
    try:
        gm.eval()  # shape propagation must not touch BatchNorm statistics
        # ShapeProp prints the traceback itself; the TraceError below says what matters
        with torch.no_grad(), contextlib.redirect_stderr(io.StringIO()):
            prop.propagate(*positional)
    except Exception as exc:  # noqa: BLE001
        cause = exc.__cause__ or exc  # ShapeProp wraps the model's own error
        node = prop.current
        where = ""
        if node is not None and node.op == "call_module":
            where = f" in module '{node.target}' ({type(gm.get_submodule(node.target)).__name__})"
        elif node is not None:
            where = f" at node '{node.name}' ({getattr(node.target, '__name__', node.target)})"
        shapes = [list(t.shape) for t in list(args) + list(kwargs.values())
                  if isinstance(t, torch.Tensor)]
        raise TraceError(
            f"the example inputs (shapes {shapes}) do not run through {type(model).__name__}"
            f"{where}: {type(cause).__name__}: {cause}. Pass example_inputs=(x,) with x one batch "
            "shaped like the training data (e.g. x = train_dataset[0][0].unsqueeze(0))."
        ) from exc
    finally:
        gm.train(was_training)
    for node in gm.graph.nodes:
        tm = node.meta.get("tensor_meta")
        if tm is not None and hasattr(tm, "shape"):
            shape = tuple(tm.shape)
            nbytes = 1
            for s in shape:
                nbytes *= s
            nbytes *= torch.empty((), dtype=tm.dtype).element_size()
            node_meta[node.name] = {"shape": shape, "bytes": nbytes, "dtype": tm.dtype}
        else:
            node_meta[node.name] = {"shape": None, "bytes": 0, "dtype": None}
    params, buffers = _inventory(model)
    analysis = analyze(gm, example_batch, parameters=params, buffers=buffers)
    return ModelGraph(module=gm, example_batch=example_batch, parameters=params, buffers=buffers,
                      node_meta=node_meta,
                      meta={"analysis": analysis,
                            "train_flops_per_sample": analysis.train_flops_per_sample})
