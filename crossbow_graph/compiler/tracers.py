"""The fx tracers that ``trace_model`` tries, best first — torch.fx, then transformers' for a
HuggingFace model — and torch.fx's TraceError naming the module, the line and the fix
(docs/compiler.md §1)."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import traceback
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx
from torch import nn

from ..errors import TraceError

__all__ = ["fx_tracers"]

_TORCH_DIR = os.path.dirname(torch.__file__)


def fx_tracers(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
               concrete_args: dict[str, Any] | None,
               leaf_modules: Sequence[type[nn.Module]]) -> list[tuple[str, Callable]]:
    """(name, ``make(model, work) -> GraphModule``) of every fx tracer that applies, best first."""
    def torch_fx(model: nn.Module, work: nn.Module) -> fx.GraphModule:
        tracer = _Tracer(leaf_modules)
        try:
            graph = tracer.trace(work, concrete_args=concrete_args)
        except Exception as exc:  # noqa: BLE001 - every tracing failure becomes a TraceError
            raise _trace_error(model, exc) from exc
        return fx.GraphModule(tracer.root, graph, type(model).__name__)

    found = [("torch.fx", torch_fx)]
    hf_fx = _transformers_fx() if type(model).__module__.startswith("transformers.") else None
    if hf_fx is not None:
        names = _argument_names(model, args, kwargs)

        def transformers_fx(model: nn.Module, work: nn.Module) -> fx.GraphModule:
            try:
                return hf_fx.symbolic_trace(work, input_names=names)
            except Exception as exc:  # noqa: BLE001 - unsupported models, ops, arguments
                raise TraceError(f"transformers.utils.fx cannot trace {type(model).__name__}: "
                                 f"{type(exc).__name__}: {exc}") from exc
        found.append(("transformers.fx", transformers_fx))
    return found


def _transformers_fx() -> Any:
    """``transformers.utils.fx`` when the installed transformers has it, else None."""
    try:
        if importlib.util.find_spec("transformers.utils.fx") is None:
            return None
        return importlib.import_module("transformers.utils.fx")
    except Exception:  # noqa: BLE001 - a broken or partial install is as good as none
        return None


def _argument_names(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[str]:
    """The forward's argument names that the example inputs give, in the forward's order."""
    try:
        bound = inspect.signature(model.forward).bind_partial(*args, **kwargs)
    except (TypeError, ValueError):
        return list(kwargs)
    return list(bound.arguments)


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
