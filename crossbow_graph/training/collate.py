"""How samples become a batch the learners take (docs/design-overview.md §6; docs/runtime.md,
Your DataLoader): ``collate``, torch's ``default_collate`` with ``None`` targets, keyword flags
and sparse tensors; ``plain_batch``, every tensor of a batch detached and dense."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.utils._pytree import tree_map
from torch.utils.data import default_collate
from torch.utils.data._utils.collate import collate as _torch_collate
from torch.utils.data._utils.collate import default_collate_fn_map

__all__ = ["collate", "plain_batch", "plain_tensor"]


def plain_tensor(t: torch.Tensor) -> torch.Tensor:
    """``t`` as the learners take it: detached (a dataset tensor that requires grad is data, not
    a parameter: no graph through it, no ``.grad`` filled) and dense (a sparse COO or CSR
    tensor's values, ``to_dense()``; the model gets what ``default_collate`` would stack)."""
    if t.requires_grad:
        t = t.detach()
    return t if t.layout is torch.strided else t.to_dense()


def _needs_plain(value: Any) -> bool:
    """Whether a tensor of ``value`` (nested in lists, tuples and dicts) requires grad or is
    sparse (a walk cheaper than pytree's flattening: once per learner batch and round)."""
    if isinstance(value, torch.Tensor):
        return value.requires_grad or value.layout is not torch.strided
    if isinstance(value, (list, tuple)):
        return any(_needs_plain(v) for v in value)
    if isinstance(value, Mapping):
        return any(_needs_plain(v) for v in value.values())
    return False


def plain_batch(batch: Any) -> Any:
    """``batch`` (what a DataLoader's collate_fn returned) with every tensor ``plain_tensor``;
    ``batch`` itself when none needs it."""
    if not _needs_plain(batch):
        return batch
    return tree_map(lambda t: plain_tensor(t) if isinstance(t, torch.Tensor) else t, batch)


def _collate_none(batch: list[Any], *, collate_fn_map: Any = None) -> None:
    """A ``None`` in every sample (a target-less sample ``(inputs, None)``) collates to None."""
    if any(item is not None for item in batch):
        raise ValueError("some samples give None where others give a value (a target of None in "
                         f"one sample, {type(next(i for i in batch if i is not None)).__name__} in "
                         "another); give None in every sample (no target) or in none")
    return None


def _collate_tensor(batch: list[torch.Tensor], *, collate_fn_map: Any = None) -> torch.Tensor:
    """Tensors stacked as ``default_collate`` does, sparse ones made dense first."""
    return default_collate([plain_tensor(t) for t in batch])


_COLLATE_MAP = {**default_collate_fn_map, type(None): _collate_none, torch.Tensor: _collate_tensor}


def _flags(samples: list[Mapping]) -> dict[str, Any]:
    """The entries of dict samples that are flags: a bool, or None, the same in every sample
    (``return_loss=True``), which the model takes as they are, not as a tensor of b of them;
    never ``'labels'`` (bool labels are data)."""
    first = samples[0]
    return {key: value for key, value in first.items()
            if (value is None or isinstance(value, bool)) and key != "labels"
            and all(isinstance(s, Mapping) and key in s and s[key] is value for s in samples)}


def _collate_keywords(samples: list[Mapping]) -> dict[str, Any]:
    """Dict samples (keyword inputs): the flags kept as they are, the rest collated."""
    flags = _flags(samples)
    rest = [{k: v for k, v in s.items() if k not in flags} for s in samples]
    collated = _torch_collate(rest, collate_fn_map=_COLLATE_MAP) if rest[0] else {}
    return {key: flags[key] if key in flags else collated[key] for key in samples[0]}


def collate(samples: list[Any]) -> Any:
    """``default_collate`` of ``samples`` (the plan's collation where no DataLoader gives a
    collate_fn), but: a ``None`` in every sample collates to None (``(inputs, None)`` samples:
    ``loss_fn`` gets None, or the model's own loss trains); in dict samples a bool or None the
    same in every sample stays a flag (``return_loss=True``), not a tensor ``[b]``; sparse
    tensors are made dense and tensors that require grad detached (``plain_tensor``).

    Raises:
        ValueError: None in some samples and a value in others at the same place."""
    first = samples[0]
    if isinstance(first, Mapping):
        return _collate_keywords(samples)
    if isinstance(first, (tuple, list)) and len(first) == 2 and isinstance(first[0], Mapping) \
            and all(isinstance(s, (tuple, list)) and len(s) == 2 for s in samples):
        inputs = _collate_keywords([s[0] for s in samples])
        target = _torch_collate([s[1] for s in samples], collate_fn_map=_COLLATE_MAP)
        return [inputs, target]  # a list, as default_collate makes of tuples too
    return _torch_collate(samples, collate_fn_map=_COLLATE_MAP)
