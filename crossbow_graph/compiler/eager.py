"""Eager analysis: FLOPs, saved and activation bytes of one forward measured while it runs, in
total and per submodule, for what has no fx graph (docs/compiler.md, "Trace fallback")."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.flop_counter import FlopCounterMode

__all__ = ["EagerCost", "EagerMeasurement", "measure_forward"]


@dataclass(kw_only=True)
class EagerCost:
    """What one scope's forward cost at the example batch: ``flops`` (FlopCounterMode's count),
    ``saved_bytes`` (storages autograd keeps, each once, parameters and buffers excluded),
    ``activation_bytes`` of every new tensor and the largest (``max_activation_bytes``), ``calls``,
    and the shapes of the first call's first tensor input and output (None: no tensor)."""

    flops: int = 0
    saved_bytes: int = 0
    activation_bytes: int = 0
    max_activation_bytes: int = 0
    calls: int = 0
    input_shape: tuple[int, ...] | None = None
    output_shape: tuple[int, ...] | None = None
    output_dtype: torch.dtype | None = None


@dataclass(kw_only=True)
class EagerMeasurement:
    """One measured forward: ``total``, ``scopes`` (path → EagerCost) and ``output`` (detached)."""

    total: EagerCost
    scopes: dict[str, EagerCost] = field(default_factory=dict)
    output: Any = None


def _first_tensor(values: Any) -> torch.Tensor | None:
    return next((t for t in tree_flatten(values)[0] if isinstance(t, torch.Tensor)), None)


class _Recorder(TorchDispatchMode):
    """Counts the bytes of the tensors every op creates, for the total and the active scopes."""

    def __init__(self, total: EagerCost, active: list[EagerCost]) -> None:
        super().__init__()
        self.total, self.active = total, active

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        returns = func._schema.returns
        if returns and returns[0].alias_info is None:  # a new tensor, not a view or in-place op
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    self.count(t.numel() * t.element_size())
        return out

    def count(self, nbytes: int) -> None:
        for cost in (self.total, *self.active):
            cost.activation_bytes += nbytes
            cost.max_activation_bytes = max(cost.max_activation_bytes, nbytes)


def _scope_hooks(root: nn.Module, scopes: Sequence[str], costs: dict[str, EagerCost],
                 active: list[EagerCost]) -> list[Any]:
    """Forward (pre-)hooks that keep ``active`` the stack of running scopes and record their calls
    and shapes."""
    handles = []
    for path in scopes:
        module, cost = root.get_submodule(path), costs[path]

        def enter(mod, args, kwargs, cost=cost):
            cost.calls += 1
            first = _first_tensor((args, kwargs))
            if cost.input_shape is None and first is not None:
                cost.input_shape = tuple(first.shape)
            active.append(cost)

        def leave(mod, args, kwargs, output, cost=cost):
            if active and active[-1] is cost:
                active.pop()
            first = _first_tensor(output)
            if cost.output_shape is None and first is not None:
                cost.output_shape, cost.output_dtype = tuple(first.shape), first.dtype

        handles.append(module.register_forward_pre_hook(enter, with_kwargs=True))
        handles.append(module.register_forward_hook(leave, with_kwargs=True, always_call=True))
    return handles


def measure_forward(module: nn.Module, args: Sequence[Any], kwargs: dict[str, Any] | None = None,
                    *, scopes: Sequence[str] = (), devices: Sequence[int] = (),
                    training: bool = True) -> EagerMeasurement:
    """The EagerMeasurement of one ``module(*args, **kwargs)`` with autograd on, in training mode
    (or evaluation mode when not ``training``), with ``scopes`` (submodule paths) measured apart;
    the module's mode and buffers and torch's RNG (CPU and CUDA ``devices``) are restored.
    Whatever the forward raises propagates."""
    kwargs = kwargs or {}
    total = EagerCost(calls=1)
    costs = {path: EagerCost() for path in scopes}
    active: list[EagerCost] = []
    known = {t.untyped_storage().data_ptr() for t in (*module.parameters(), *module.buffers())}
    saved: dict[int, torch.Tensor] = {}  # storage → one saved tensor (kept alive: no address reuse)

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key not in known and key not in saved and storage.nbytes():
            saved[key] = t
            for cost in (total, *active):
                cost.saved_bytes += storage.nbytes()
        return t

    buffers = {name: b.detach().clone() for name, b in module.named_buffers()}
    was_training = module.training
    handles = _scope_hooks(module, scopes, costs, active)
    counter = FlopCounterMode(display=False)
    try:
        module.train(training)
        with torch.random.fork_rng(devices=list(devices)), torch.enable_grad(), \
                torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), counter, \
                _Recorder(total, active):
            output = module(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
        module.train(was_training)
        with torch.no_grad():
            for name, b in module.named_buffers():
                if name in buffers:
                    b.copy_(buffers[name])
    flops = counter.get_flop_counts()
    total.flops = int(counter.get_total_flops())
    root = type(module).__name__  # FlopCounterMode names modules by the root's class and path
    for path, cost in costs.items():
        cost.flops = int(sum(flops.get(f"{root}.{path}", {}).values()))
    first = _first_tensor(output)
    if first is not None:
        total.output_shape, total.output_dtype = tuple(first.shape), first.dtype
    with contextlib.suppress(Exception):  # an output tree_map cannot rebuild stays as it is
        output = tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, output)
    return EagerMeasurement(total=total, scopes=costs, output=output)
