"""compile's tracing arguments, checked before any tracing (docs/reliability.md, "Bad input and
the error you get"; docs/compiler.md §1)."""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import keystr, tree_flatten_with_path

__all__ = ["check_trace_arguments"]


def check_trace_arguments(model: nn.Module, example_inputs: Any, concrete_args: Any,
                          leaf_modules: Any) -> None:
    """Raise a ValueError/TypeError naming the argument, the value and the fix for an
    ``example_inputs`` tensor on the meta device; ``concrete_args`` other than None or a dict of
    ``model.forward``'s argument names; ``leaf_modules`` other than a list or tuple of
    ``nn.Module`` subclasses."""
    for path, leaf in tree_flatten_with_path(example_inputs)[0]:
        if isinstance(leaf, torch.Tensor) and leaf.is_meta:
            raise ValueError(
                f"example_inputs{keystr(path)} is a tensor of shape {list(leaf.shape)} on the "
                "meta device (no data), which no forward can run; pass real tensors, one batch "
                "shaped like the training data, e.g. example_inputs=(train_dataset[0][0]"
                ".unsqueeze(0),)")
    _check_concrete_args(model, concrete_args)
    _check_leaf_modules(model, leaf_modules)


def _check_concrete_args(model: nn.Module, concrete_args: Any) -> None:
    if concrete_args is None:
        return
    if not isinstance(concrete_args, dict):
        raise TypeError(f"concrete_args={concrete_args!r:.80}: must be a dict of forward argument "
                        "names to fixed values, as torch.fx takes it, e.g. concrete_args={'mask': "
                        "None}, or None")
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):  # a forward without a readable signature: torch.fx decides
        return
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    names = [n for n, p in params.items() if p.kind is not inspect.Parameter.VAR_POSITIONAL]
    for key in concrete_args:
        if key not in names:
            forward = f"{type(model).__name__}.forward{inspect.signature(model.forward)}"
            raise ValueError(f"concrete_args={{{key!r}: ...}}: {key!r} is not an argument of "
                             f"{forward}; name one of its arguments {names}, or drop it")


def _check_leaf_modules(model: nn.Module, leaf_modules: Any) -> None:
    if isinstance(leaf_modules, (type, str, nn.Module)):  # one leaf, not in a list
        raise TypeError(f"leaf_modules={_shown(leaf_modules)}: must be a list of module classes, "
                        f"e.g. leaf_modules=[{_class_fix(model, leaf_modules)}]")
    if not isinstance(leaf_modules, (list, tuple)):
        raise TypeError(f"leaf_modules={leaf_modules!r:.80}: must be a list of nn.Module classes, "
                        "e.g. leaf_modules=[nn.LSTM]")
    for item in leaf_modules:
        if isinstance(item, type) and issubclass(item, nn.Module):
            continue
        what = ("a class name: torch.fx picks leaf modules by class, not by name"
                if isinstance(item, str) else "a module instance: pass its class"
                if isinstance(item, nn.Module) else "not an nn.Module class")
        shown = ", ".join(_shown(i) for i in leaf_modules)
        raise TypeError(f"leaf_modules=[{shown:.120}]: {_shown(item)} is {what}; e.g. "
                        f"leaf_modules=[{_class_fix(model, item)}]")


def _shown(item: Any) -> str:
    """A class as its name (``nn.Linear``), anything else as its repr."""
    return _class_name(item) if isinstance(item, type) else repr(item)


def _class_fix(model: nn.Module, item: Any) -> str:
    """The class meant by ``item`` (a class, an instance, or a class name among ``model``'s
    modules) as written in code; an example class when unknown."""
    if isinstance(item, nn.Module):
        item = type(item)
    if isinstance(item, str):
        item = next((type(m) for m in model.modules() if type(m).__name__ == item), item)
    if isinstance(item, type) and issubclass(item, nn.Module):
        return _class_name(item)
    return "nn.LSTM"


def _class_name(cls: type) -> str:
    """``nn.Linear`` for a torch.nn class, else ``module.QualName``."""
    if getattr(nn, cls.__name__, None) is cls:
        return f"nn.{cls.__name__}"
    return f"{cls.__module__}.{cls.__qualname__}"
