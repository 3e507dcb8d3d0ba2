"""Evaluation of a model on a data set for any output: mean loss and accuracy, a metric, or
why there is none (docs/api.md, Evaluation; docs/design-overview.md §6)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch.utils._pytree import tree_map
from torch.utils.data import DataLoader, Dataset, Subset

from ..compiler.outputs import describe_output, logits_of, loss_extras, loss_value
from ..engine.data.inputs import NO_FLAGS, CallFlags, split_inputs
from .collate import collate
from .data import as_dataset, make_fetch, yields_every_sample

__all__ = ["Evaluation", "batch_correct", "eval_samples", "evaluate_model"]


@dataclass(frozen=True, kw_only=True)
class Evaluation:
    """A model's results on a data set.

    Attributes:
        accuracy: the mean accuracy (or ``metric_fn``) over the samples, in [0, 1] for an
            accuracy; None when it cannot be computed.
        loss: the mean loss over the samples.
        unscored: why there is no accuracy (empty when there is one).
        extras: the other scalar entries of a dict ``loss_fn`` returns, averaged over the
            samples (compiler/outputs.py ``loss_extras``); {} otherwise."""

    accuracy: float | None
    loss: float
    unscored: str = ""
    extras: dict[str, float] = field(default_factory=dict)


def eval_samples(data: Any, what: str = "eval_dataset") -> Dataset:
    """The samples an evaluation scores: a Dataset's, or those a DataLoader's ``batch_sampler`` or
    ``sampler`` yields (a ``Subset``; each as often as yielded; torch's RNG left as it was).

    Raises:
        TypeError, ValueError: as ``as_dataset``; ValueError: the sampler yields no sample."""
    dataset = as_dataset(data, what)
    if not isinstance(data, DataLoader):
        return dataset
    batches = data.batch_size is None and data.batch_sampler is not None
    if not batches and yields_every_sample(data):
        return dataset
    source = data.batch_sampler if batches else data.sampler
    with torch.random.fork_rng(devices=[]):  # torch's global generator stays where it was
        drawn = list(itertools.chain.from_iterable(source) if batches else source)
    if not drawn:
        raise ValueError(f"{what} is a DataLoader whose {'batch_sampler' if batches else 'sampler'}"
                         f" ({type(source).__name__}) yields no sample of its {len(dataset)}; "
                         "give it a sampler that yields the samples to score")
    return Subset(dataset, [int(i) for i in drawn])


def batch_correct(output: Any, target: Any) -> int | None:
    """Samples of a batch whose class scores' argmax equals the target: ``logits_of(output)``
    ``[N, C]`` against integer classes ``[N]``; None for any other output or target."""
    logits = logits_of(output)
    if (isinstance(logits, torch.Tensor) and logits.dim() == 2 and isinstance(target, torch.Tensor)
            and not target.is_floating_point() and tuple(target.shape) == tuple(logits.shape[:1])):
        return int((logits.argmax(dim=1) == target).sum())
    return None


def _why_unscored(output: Any, target: Any) -> str:
    if target is None:
        return ("the samples have no target (None), so there is no class accuracy to compute; "
                "pass fit(..., metric_fn=fn), fn(output, None) -> the batch's score in [0, 1], "
                "to measure one")
    have = (f"Tensor [{', '.join(map(str, target.shape))}] of {target.dtype}"
            if isinstance(target, torch.Tensor) else type(target).__name__)
    return (f"the output ({describe_output(output)}) with targets ({have}) gives no accuracy: "
            "it needs class scores [N, C] (the output, output.logits, or the first tensor of a "
            "tuple or dict) and integer class targets [N]; pass fit(..., metric_fn=fn), "
            "fn(output, target) -> the batch's accuracy in [0, 1]")


def _batches(dataset: Dataset, batch_size: int, collate_fn: Callable[[list], Any] | None,
             workers_of: DataLoader | None) -> Iterator[tuple[int, Any]]:
    """(samples, collated batch) of ``dataset`` in order, ``batch_size`` at a time: loaded by a
    DataLoader with ``workers_of``'s worker settings (``num_workers``, ``prefetch_factor``,
    ``pin_memory``, ``worker_init_fn``, ``timeout``, ``multiprocessing_context``) when it has
    workers, with a generator of its own (the workers' seeds; torch's global RNG is left as it
    was), else read here (``make_fetch``)."""
    n, like = len(dataset), workers_of
    if like is None or like.num_workers == 0:
        fetch = make_fetch(dataset, collate_fn)
        for start in range(0, n, batch_size):
            yield min(batch_size, n - start), fetch(torch.arange(start, min(start + batch_size, n)))
        return
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=False,
                        collate_fn=collate_fn or collate, num_workers=like.num_workers,
                        pin_memory=like.pin_memory, timeout=like.timeout,
                        worker_init_fn=like.worker_init_fn, prefetch_factor=like.prefetch_factor,
                        multiprocessing_context=like.multiprocessing_context,
                        generator=torch.Generator().manual_seed(0),
                        pin_memory_device=like.pin_memory_device)
    for i, batch in enumerate(loader):
        yield min(batch_size, n - i * batch_size), batch


@torch.no_grad()
def evaluate_model(forward: Callable[..., Any], loss_fn: Callable[[Any, Any], torch.Tensor],
                   dataset: Any, *, batch_size: int, device: torch.device,
                   metric_fn: Callable[[Any, Any], Any] | None = None,
                   collate_fn: Callable[[list], Any] | None = None,
                   flags: CallFlags = NO_FLAGS,
                   workers_of: DataLoader | None = None) -> Evaluation:
    """Mean loss and accuracy of ``forward`` on ``dataset``, in batches of ``batch_size``.

    Args:
        forward: the model call, ``forward(*args, **kwargs) -> output``.
        loss_fn: ``loss_fn(output, target) -> scalar`` (mean over the batch), or a dict whose
            ``"loss"`` entry is it (compiler/outputs.py ``loss_value``).
        dataset: a Dataset of ``(inputs, target)`` pairs or dicts of keyword inputs
            (engine/data/inputs.py ``split_inputs``).
        batch_size: samples per batch (the last one may be smaller).
        device: where the model is; every tensor of a batch is moved there.
        metric_fn: ``metric_fn(output, target) -> float`` (or a 0-dim tensor), the batch's mean
            accuracy, averaged over the batches weighted by their sizes; None: class accuracy
            (``batch_correct``).
        collate_fn: a DataLoader's collate_fn for each batch's samples (training/data.py
            ``collate_of``); None: the default collation.
        flags: compile's keyword flags, passed where a batch does not give them
            (engine/data/inputs.py ``CallFlags``).
        workers_of: a DataLoader whose worker processes load the batches (its ``num_workers``
            and their settings; its samples are ``dataset``'s), or None: read in this process.

    Returns:
        The Evaluation."""
    correct, loss_sum, n, unscored = 0.0, 0.0, 0, ""
    extras: dict[str, float] = {}
    for size, batch in _batches(dataset, batch_size, collate_fn, workers_of):
        batch = tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, batch)
        args, kwargs, y = split_inputs(batch, flags)
        out = forward(*args, **kwargs)
        loss = loss_fn(out, y)
        loss_sum += float(loss_value(loss)) * size
        for key, v in loss_extras(loss).items():
            extras[key] = extras.get(key, 0.0) + v * size
        n += size
        if unscored:
            continue
        if metric_fn is not None:
            correct += float(metric_fn(out, y)) * size
            continue
        hits = batch_correct(out, y)
        if hits is None:
            unscored = _why_unscored(out, y)
        else:
            correct += hits
    return Evaluation(accuracy=None if unscored else correct / n, loss=loss_sum / n,
                      unscored=unscored, extras={k: v / n for k, v in extras.items()})
