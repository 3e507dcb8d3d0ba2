"""The computation's fingerprint: what a process computes (modules, forward, loss function) as
text that identical processes write identically, which the ranks of a torchrun launch compare
at start-up (docs/distributed.md, Running)."""

from __future__ import annotations

import functools
import hashlib
import inspect
import re
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import nn

__all__ = ["Fingerprint", "computation_fingerprint", "first_difference"]

_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
_PLAIN = (bool, int, float, complex, str, bytes, type(None))


@dataclass(frozen=True)
class Fingerprint:
    """The computation's description (``lines``) and its ``digest`` (16 hex digits of SHA-256)."""

    lines: tuple[str, ...]

    @property
    def digest(self) -> str:
        return _sha("\n".join(self.lines))


def computation_fingerprint(model: nn.Module, graph: torch.fx.GraphModule | None,
                            loss_fn: Callable | None) -> Fingerprint:
    """The Fingerprint of training ``model`` run as ``graph`` (the traced GraphModule, or None) on
    ``loss_fn`` (None: the model's own loss); identical processes give identical lines."""
    lines = [f"module {name or '(root)'}: {_module_text(m)}" for name, m in model.named_modules()]
    if graph is not None:
        lines += [f"forward: {line.strip()}" for line in graph.code.splitlines() if line.strip()]
    else:
        user = dict.fromkeys(type(m) for m in model.modules() if not _in_torch(type(m)))
        lines += [f"forward of {_name(cls)}: source {_source_digest(cls.forward)}" for cls in user]
    lines.append(f"loss_fn: {_callable_text(loss_fn)}")
    return Fingerprint(tuple(_ADDRESS.sub("", line) for line in lines))


def first_difference(lines_by_rank: Sequence[Sequence[str]]) -> str:
    """Each disagreeing rank's first fingerprint line that differs from rank 0's, for an error
    message (line number included)."""
    ref, said = lines_by_rank[0], []
    for rank, lines in enumerate(lines_by_rank[1:], start=1):
        if tuple(lines) == tuple(ref):
            continue
        i = next(i for i in range(max(len(lines), len(ref)))
                 if i >= len(lines) or i >= len(ref) or lines[i] != ref[i])
        mine = f"runs `{lines[i]}`" if i < len(lines) else "has nothing more"
        theirs = f"runs `{ref[i]}`" if i < len(ref) else "has nothing more"
        said.append(f"rank {rank} {mine} where rank 0 {theirs} (line {i + 1} of the computation's "
                    "fingerprint)")
    return "; ".join(said)


def _module_text(m: nn.Module) -> str:
    return f"{type(m).__name__}({m.extra_repr()})"


def _callable_text(fn: Any, depth: int = 0) -> str:
    """A loss function's identity; ``depth`` > 0: name and source only (ends a recursion)."""
    if fn is None:
        return "None (the loss the model's output carries)"
    if isinstance(fn, functools.partial):
        return (f"partial({_callable_text(fn.func, depth)}, args={_value_text(fn.args, depth)}, "
                f"keywords={_value_text(sorted(fn.keywords.items()), depth)})")
    if isinstance(fn, nn.Module):
        attributes = sorted((k, v) for k, v in vars(fn).items()
                            if not k.startswith("_") and k != "training" and _is_plain(v))
        tensors = [(n, _value_text(t)) for n, t in fn.state_dict().items()]
        return f"{_module_text(fn)} attributes {_value_text(attributes)} tensors {tensors}"
    if inspect.isfunction(fn) or inspect.ismethod(fn):
        name = f"{fn.__module__}.{fn.__qualname__}"
        if _in_torch(fn):
            return name
        func = fn.__func__ if inspect.ismethod(fn) else fn
        if depth:
            return f"{name} source {_source_digest(func)}"
        cells = [c.cell_contents for c in func.__closure__ or () if _filled(c)]
        return (f"{name} source {_source_digest(func)} closes over {_value_text(cells, 1)} "
                f"defaults {_value_text((func.__defaults__, func.__kwdefaults__), 1)}")
    if callable(fn) and not inspect.isbuiltin(fn) and not isinstance(fn, type):
        kind = type(fn)  # an instance with __call__: its class, its call's source, its attributes
        attributes = sorted((k, v) for k, v in vars(fn).items() if _is_plain(v)) \
            if hasattr(fn, "__dict__") else []
        return (f"{_name(kind)} instance, __call__ source {_source_digest(kind.__call__)}, "
                f"attributes {_value_text(attributes)}")
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def _value_text(value: Any, depth: int = 0) -> str:
    """``repr`` of a plain value; a tensor's shape, dtype and digest; a function's identity."""
    if isinstance(value, torch.Tensor):
        data = value.detach().cpu().contiguous().reshape(-1).view(torch.uint8)  # its bytes
        return f"tensor{list(value.shape)} {value.dtype} {_sha(data.numpy().tobytes())}"
    if isinstance(value, (list, tuple)):
        return "(" + ", ".join(_value_text(v, depth) for v in value) + ")"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k!r}: {_value_text(v, depth)}" for k, v in value.items()) + "}"
    if callable(value) and not isinstance(value, _PLAIN):
        return _callable_text(value, depth + 1)
    return _ADDRESS.sub("", repr(value))


def _is_plain(value: Any) -> bool:
    if isinstance(value, (list, tuple)):
        return all(_is_plain(v) for v in value)
    return isinstance(value, _PLAIN)


def _filled(cell: Any) -> bool:
    try:
        cell.cell_contents
    except ValueError:  # an empty cell (a name assigned after the closure was made)
        return False
    return True


def _source_digest(fn: Any) -> str:
    """16 hex digits of SHA-256 of ``fn``'s source (lines stripped), else of its code object."""
    fn = inspect.unwrap(fn)
    try:
        source = "\n".join(line.strip() for line in inspect.getsource(fn).splitlines())
    except (OSError, TypeError):
        code = getattr(fn, "__code__", None)
        source = repr(type(fn)) if code is None else _code_text(code)
    return _sha(source)


def _code_text(code: Any) -> str:
    consts = [_code_text(c) if inspect.iscode(c) else repr(c) for c in code.co_consts]
    return f"{code.co_code.hex()} {code.co_names} {consts}"


def _in_torch(obj: Any) -> bool:
    module = getattr(obj, "__module__", None) or ""
    return module == "torch" or module.startswith("torch.")


def _name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _sha(text: str | bytes) -> str:
    return hashlib.sha256(text.encode() if isinstance(text, str) else text).hexdigest()[:16]
