"""Checks of the training data against the plan, run once at the start of a fit on one batch.

Per-round checks would cost every round; these run once, on learner 0's first batch of b samples,
with the central model in evaluation mode (no dropout randomness, no BatchNorm update, no
gradients), before the fit seeds its random number generators.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch
from torch.utils.data import TensorDataset

from .data import split_inputs

if TYPE_CHECKING:
    from ..api import Plan

__all__ = ["check_first_batch"]


def _placeholder_shapes(plan: "Plan") -> list[tuple[str, tuple[int, ...] | None]]:
    graph = plan.model_graph
    return [(str(n.target), graph.node_meta.get(n.name, {}).get("shape"))
            for n in graph.module.graph.nodes if n.op == "placeholder"]


def _output_shape(plan: "Plan") -> tuple[int, ...] | None:
    graph = plan.model_graph
    for n in graph.module.graph.nodes:
        if n.op == "output":
            return graph.node_meta.get(n.name, {}).get("shape")
    return None


def _check_inputs(plan: "Plan", args: tuple[Any, ...], what: str) -> None:
    fix = (f"compile the plan with example_inputs shaped like one sample of {what}, e.g. "
           f"(x,) with x = {what}[0][0].unsqueeze(0)")
    placeholders = _placeholder_shapes(plan)
    for i, (arg, (name, want)) in enumerate(zip(args, placeholders)):
        if not isinstance(arg, torch.Tensor) or want is None:
            continue
        if tuple(arg.shape[1:]) != tuple(want[1:]):
            raise ValueError(
                f"{what}: input {i} ('{name}') of a sample has shape {list(arg.shape[1:])}, but "
                f"the plan was compiled for example inputs of shape {list(want[1:])} per sample; {fix}"
            )


def _all_labels(dataset: Any, first_targets: torch.Tensor) -> torch.Tensor:
    """Every label when they are one tensor (TensorDataset, ImageDataset), else the first batch's."""
    base = getattr(dataset, "base", dataset)  # augmented views keep the labels of their base
    if isinstance(base, TensorDataset) and isinstance(base.tensors[-1], torch.Tensor):
        return base.tensors[-1]
    return first_targets


@torch.no_grad()
def check_first_batch(plan: "Plan", dataset: Any, fetch: Callable[[torch.Tensor], Any],
                      indices: torch.Tensor, what: str = "train_dataset") -> None:
    """Run one batch of ``dataset`` through the central model and the loss, and check them.

    Checks: every input's per-sample shape equals the compiled example input's; integer class
    labels lie in [0, C) for a model with C output scores (all labels of a tensor dataset, else the
    batch's); ``loss_fn`` returns a scalar; the forward pass runs.

    Args:
        plan: the compiled Plan.
        dataset: the training dataset.
        fetch: indices ``[n]`` → a collated batch.
        indices: the samples to check, ``[b]``.
        what: the argument's name for messages.

    Raises:
        ValueError: a mismatch; the message names the input or label, the numbers and the fix.
    """
    batch = fetch(indices)
    args, kwargs, target = split_inputs(batch)
    _check_inputs(plan, args, what)
    out_shape = _output_shape(plan)
    if (isinstance(target, torch.Tensor) and not target.is_floating_point()
            and target.dtype != torch.bool and out_shape is not None and len(out_shape) == 2):
        classes = out_shape[1]
        labels = _all_labels(dataset, target)
        lo, hi = int(labels.min()), int(labels.max())
        if lo < 0 or hi >= classes:
            bad = lo if lo < 0 else hi
            raise ValueError(
                f"{what} has label {bad}, outside the model's {classes} classes [0, {classes - 1}] "
                f"(labels range over [{lo}, {hi}]); build the model with num_classes={hi + 1} "
                "or remap the labels to 0 … C−1"
            )
    device = plan.states[0].torch_device
    args = tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)
    target = target.to(device) if isinstance(target, torch.Tensor) else target
    plan._refresh_central()
    try:
        out = plan._central(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - any failure here is a data/model mismatch
        raise ValueError(f"{what}: the first batch does not run through the model: "
                         f"{type(exc).__name__}: {exc}; check that the dataset's samples are "
                         "(inputs, target) pairs shaped like the example inputs") from exc
    loss = plan.loss_fn(out, target)
    if not (isinstance(loss, torch.Tensor) and loss.dim() == 0):
        got = f"shape {list(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise ValueError(
            f"loss_fn must return a scalar tensor (the mean loss of the batch), got {got} on the "
            f"first batch of {what}; reduce it, e.g. loss_fn=torch.nn.functional.cross_entropy "
            "(reduction='mean') or return loss.mean()"
        )
