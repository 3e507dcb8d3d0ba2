"""A collated batch as the model call takes it (docs/design-overview.md §6)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["example_call", "split_inputs"]


def example_call(example_inputs: tuple[Any, ...] | dict[str, Any]
                 ) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """compile's example inputs → (positional args, keyword args) of the model call: a dict is
    keyword inputs, a tuple (or list) positional ones."""
    if isinstance(example_inputs, dict):
        return (), dict(example_inputs)
    return tuple(example_inputs), {}


def split_inputs(batch: Any) -> tuple[tuple[Any, ...], dict[str, Any], Any]:
    """``(inputs, target)`` (inputs a tensor, a tuple/list or a dict), or a Mapping of keyword
    inputs whose target is its ``"labels"`` entry (kept among the inputs) → (positional args,
    keyword args, target) of the model call (docs/design-overview.md §6).

    Raises:
        ValueError: neither a pair nor a dict.
    """
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
