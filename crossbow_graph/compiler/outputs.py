"""A model output's loss and class scores, whatever its form (tensor, tuple, dict, HuggingFace
``ModelOutput``; docs/compiler.md §1)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["describe_output", "logits_of", "loss_of", "loss_extras", "loss_value", "model_loss"]


def loss_of(output: Any) -> torch.Tensor | None:
    """The loss the model computed, ``output.loss`` or ``output["loss"]``, or None."""
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, Mapping):
        loss = output.get("loss")
    return loss if isinstance(loss, torch.Tensor) else None


def model_loss(output: Any, target: Any = None) -> torch.Tensor:
    """The loss function of ``compile(..., loss_fn=None)``: ``loss_of(output)`` (``target`` unused).
    Raises ValueError, saying what the output holds, when it carries no loss."""
    loss = loss_of(output)
    if loss is None:
        raise ValueError(
            f"loss_fn=None trains on the loss the model computes (output.loss or "
            f"output['loss']), but its output ({describe_output(output)}) has none: give the "
            "inputs its loss needs in every batch (the labels of a model with a head, e.g. "
            "{'input_ids': ids, 'labels': labels}; a flag such as CLIP's return_loss=True among "
            "compile's example inputs, which every forward gets), or pass a "
            "loss_fn(output, target)")
    return loss


def loss_value(loss: Any) -> torch.Tensor:
    """The 0-dim tensor that ``loss_fn`` returned, or its dict's ``"loss"`` entry.
    Raises ValueError naming what it got and the fix for anything else."""
    fix = "return the loss as a 0-dim tensor, or a dict whose 'loss' entry is one"
    if isinstance(loss, Mapping):
        if "loss" not in loss:
            raise ValueError(f"loss_fn returned a {type(loss).__name__} with keys "
                             f"{sorted(map(str, loss))} but no 'loss' entry; training reads "
                             "out['loss']: put the scalar loss under the key 'loss'")
        return _scalar(loss["loss"], "loss_fn's 'loss' entry must be", fix)
    if isinstance(loss, (tuple, list)):
        items = ", ".join(f"tensor {list(t.shape)}" if isinstance(t, torch.Tensor) else
                          type(t).__name__ for t in loss)
        raise ValueError(f"loss_fn returned a {type(loss).__name__} of {len(loss)} items "
                         f"({items}); {fix}, e.g. {{'loss': loss, 'aux': aux}}")
    return _scalar(loss, "loss_fn must return", fix)


def loss_extras(loss: Any) -> dict[str, float]:
    """The other scalar entries of a dict ``loss_fn`` returned, as floats; else {}."""
    if not isinstance(loss, Mapping):
        return {}
    return {str(k): float(v) for k, v in loss.items() if k != "loss" and (
        (isinstance(v, (int, float)) and not isinstance(v, bool))
        or (isinstance(v, torch.Tensor) and v.numel() == 1))}


def _scalar(loss: Any, what: str, fix: str) -> torch.Tensor:
    if isinstance(loss, torch.Tensor) and loss.dim() == 0:
        return loss
    if isinstance(loss, torch.Tensor):
        raise ValueError(f"{what} a scalar tensor, got a tensor of shape "
                         f"{list(loss.shape)}; reduce it over the batch, e.g. with "
                         "reduction='mean' or .mean()")
    raise ValueError(f"{what} a scalar tensor that autograd can differentiate, got "
                     f"{type(loss).__name__}; {fix}")


def logits_of(output: Any) -> torch.Tensor | None:
    """The class scores of an output: the tensor itself, ``output.logits`` / ``output["logits"]``,
    else the first tensor of ≥ 1 dimension of a tuple, list or dict; None when there is none."""
    if isinstance(output, torch.Tensor):
        return output
    logits = getattr(output, "logits", None)
    if logits is None and isinstance(output, Mapping):
        logits = output.get("logits")
    if isinstance(logits, torch.Tensor):
        return logits
    values = list(output.values()) if isinstance(output, Mapping) else \
        list(output) if isinstance(output, (list, tuple)) else []
    return next((v for v in values if isinstance(v, torch.Tensor) and v.dim() > 0), None)


def describe_output(output: Any) -> str:
    """A short text of an output's form, e.g. ``"Tensor [4, 10]"``."""
    def shape(t: Any) -> str:
        return f"[{', '.join(map(str, t.shape))}]" if isinstance(t, torch.Tensor) else type(t).__name__
    if isinstance(output, torch.Tensor):
        return f"Tensor {shape(output)}"
    if isinstance(output, Mapping):
        fields = ", ".join(f"{k} {shape(v)}" for k, v in output.items())
        return f"{type(output).__name__} with {fields or 'no fields'}"
    if isinstance(output, (list, tuple)):
        return f"{type(output).__name__} of {', '.join(shape(v) for v in output) or 'nothing'}"
    return type(output).__name__
