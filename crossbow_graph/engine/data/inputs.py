"""A collated batch as the model call takes it (docs/design-overview.md §6)."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn

__all__ = ["CallFlags", "NO_FLAGS", "example_call", "split_inputs"]

#: The plain Python values among keyword example inputs that are flags of the call.
_FLAG_TYPES = (bool, int, float, str)


@dataclass(frozen=True)
class CallFlags:
    """compile's keyword example inputs that are plain Python values (bool, int, float, str:
    ``return_loss=True``, ``output_hidden_states=False``): settings of the call, the same for
    every batch, so every forward (training, evaluation, BatchNorm re-estimation) gets them
    where its batch does not give them (docs/design-overview.md §6).

    Attributes:
        values: ``(name, value)`` of each flag.
        positional: the forward's positional parameters in order (a flag a batch gives by
            position is not passed again by name)."""

    values: tuple[tuple[str, Any], ...] = ()
    positional: tuple[str, ...] = ()

    @classmethod
    def of(cls, model: nn.Module, example_inputs: Any) -> "CallFlags":
        """The flags of ``example_inputs`` (a dict of keyword inputs) for ``model``'s forward."""
        if not isinstance(example_inputs, Mapping):
            return NO_FLAGS
        values = tuple((k, v) for k, v in example_inputs.items() if isinstance(v, _FLAG_TYPES))
        if not values:
            return NO_FLAGS
        try:
            params = inspect.signature(model.forward).parameters.values()
        except (TypeError, ValueError):
            params = []
        return cls(values, tuple(p.name for p in params
                                 if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)))

    def added(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        """``kwargs`` with every flag that neither ``kwargs`` nor ``args`` gives."""
        if not self.values:
            return kwargs
        given = set(kwargs).union(self.positional[:len(args)])
        missing = {k: v for k, v in self.values if k not in given}
        return {**kwargs, **missing} if missing else kwargs


NO_FLAGS = CallFlags()


def example_call(example_inputs: tuple[Any, ...] | dict[str, Any]
                 ) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """compile's example inputs → (positional args, keyword args) of the model call: a dict is
    keyword inputs, a tuple (or list) positional ones."""
    if isinstance(example_inputs, dict):
        return (), dict(example_inputs)
    return tuple(example_inputs), {}


def split_inputs(batch: Any, flags: CallFlags = NO_FLAGS) -> tuple[tuple[Any, ...], dict[str, Any], Any]:
    """``(inputs, target)`` (inputs a tensor, a tuple/list or a dict), or a Mapping of keyword
    inputs whose target is its ``"labels"`` entry (kept among the inputs) → (positional args,
    keyword args, target) of the model call, with the ``flags`` the batch does not give
    (docs/design-overview.md §6).

    Raises:
        ValueError: neither a pair nor a dict."""
    args, kwargs, target = _split(batch)
    return args, flags.added(args, kwargs), target


def _split(batch: Any) -> tuple[tuple[Any, ...], dict[str, Any], Any]:
    if isinstance(batch, Mapping):
        return (), dict(batch), batch.get("labels")
    if not isinstance(batch, (list, tuple)) or len(batch) != 2:
        raise ValueError("each sample must be a pair (inputs, target), e.g. (image, label), or a "
                         "dict of keyword inputs, e.g. {'input_ids': ids, 'labels': labels}; got "
                         f"{type(batch).__name__} of length {len(batch) if hasattr(batch, '__len__') else '?'}")
    x, y = batch
    if isinstance(x, Mapping):
        return (), dict(x), y
    if isinstance(x, (list, tuple)):
        return tuple(x), {}, y
    return (x,), {}, y
