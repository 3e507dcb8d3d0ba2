"""A collated batch as the model call takes it (docs/design-overview.md §6)."""

from __future__ import annotations

from typing import Any

__all__ = ["split_inputs"]


def split_inputs(batch: Any) -> tuple[tuple[Any, ...], dict[str, Any], Any]:
    """``(inputs, target)`` → (positional args, keyword args, target) of the model call.

    A sample is ``(x, y)``: x a tensor (one input), a tuple/list (several inputs) or a dict
    (keyword inputs); y the target given to ``loss_fn``.
    """
    if not isinstance(batch, (list, tuple)) or len(batch) != 2:
        raise ValueError("each sample must be a pair (inputs, target), e.g. (image, label); got "
                         f"{type(batch).__name__} of length {len(batch) if hasattr(batch, '__len__') else '?'}")
    x, y = batch
    if isinstance(x, dict):
        return (), x, y
    if isinstance(x, (list, tuple)):
        return tuple(x), {}, y
    return (x,), {}, y
