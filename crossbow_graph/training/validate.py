"""Checks of the training data against the plan, run once at the start of a fit on one batch
(docs/reliability.md, Bad input and the error you get)."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils._pytree import tree_flatten
from torch.utils.data import TensorDataset

from ..compiler.outputs import model_loss
from ..engine.data.batches import single
from ..engine.data.inputs import split_inputs
from .data import CollateFetch, LearnerFetch, collate_of, make_fetch
from .evaluation import eval_samples

if TYPE_CHECKING:
    from .fit_plan import FitPlan

__all__ = ["check_eval_dataset", "check_first_batch"]


def _given_inputs(plan: "FitPlan", args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(label for messages, value, the compiled InputSpec) of a batch's inputs: positional ones
    in the forward's order, keyword ones by name."""
    specs = plan.model_graph.inputs
    by_name = {s.name: s for s in specs}
    given = [(f"input {i} ('{spec.name}')", arg, spec) for i, (arg, spec) in enumerate(zip(args, specs))]
    return given + [(f"input '{name}'", value, by_name[name]) for name, value in kwargs.items()
                    if name in by_name]


_CAST = {torch.float64: ".double()", torch.float32: ".float()", torch.bfloat16: ".bfloat16()",
         torch.float16: ".half()"}


def _run_central(plan: "FitPlan", args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The central model in evaluation mode (no dropout, no BatchNorm update) on ``args``, with
    compile's keyword flags as training passes them."""
    return plan.central.forward(*args, **plan.states[0].call_flags.added(args, kwargs))


@torch.no_grad()
def _check_dtypes(plan: "FitPlan", args: tuple[Any, ...], kwargs: dict[str, Any], what: str) -> None:
    """Floating inputs of another dtype than the example inputs' are an error unless the model
    takes them (a model that casts its inputs)."""
    for label, arg, spec in _given_inputs(plan, args, kwargs):
        want = spec.dtype
        if (not isinstance(arg, torch.Tensor) or not arg.is_floating_point() or want is None
                or not want.is_floating_point or arg.dtype == want):
            continue
        try:
            _run_central(plan, args, kwargs)
        except Exception as exc:  # noqa: BLE001 - the model cannot take this dtype
            model = plan.states[0].dtype
            have = str(arg.dtype).removeprefix("torch.")
            raise ValueError(
                f"{what}: {label} is {arg.dtype}, but the plan was compiled for "
                f"example inputs of {want} (the model's parameters are {model}), and the model "
                f"fails on {have} inputs ({type(exc).__name__}: {exc}); cast the data to {want} "
                f"(e.g. TensorDataset(x{_CAST.get(want, f'.to({want})')}, y)), or compile the "
                f"model in {have} (model{_CAST.get(arg.dtype, f'.to({arg.dtype})')}, with "
                f"{have} example inputs)") from exc
        return  # the model takes them: one forward is enough


def _output_shape(plan: "FitPlan") -> tuple[int, ...] | None:
    return plan.model_graph.output_shape


@torch.no_grad()
def _check_inputs(plan: "FitPlan", args: tuple[Any, ...], kwargs: dict[str, Any], what: str) -> None:
    """Inputs shaped unlike the example inputs are an error unless the model takes them and gives
    an output of the compiled shape (e.g. a globally pooled CNN on larger images)."""
    fix = (f"compile the plan with example_inputs shaped like one sample of {what}, e.g. "
           f"(x,) with x = {what}[0][0].unsqueeze(0)") if what == "train_dataset" else \
        f"give {what} samples shaped like the training data's (the compiled example inputs)"
    for label, arg, spec in _given_inputs(plan, args, kwargs):
        want = spec.shape
        if not isinstance(arg, torch.Tensor) or want is None or tuple(arg.shape[1:]) == tuple(want[1:]):
            continue
        problem = (f"{what}: {label} of a sample has shape {list(arg.shape[1:])}, but "
                   f"the plan was compiled for example inputs of shape {list(want[1:])} per sample")
        try:
            out = _run_central(plan, args, kwargs)
        except Exception as exc:  # noqa: BLE001 - the model cannot take these inputs
            raise ValueError(f"{problem}, and the model fails on them ({type(exc).__name__}: "
                             f"{exc}); {fix}") from exc
        want_out = _output_shape(plan)
        if isinstance(out, torch.Tensor) and want_out is not None and \
                tuple(out.shape[1:]) != tuple(want_out[1:]):
            raise ValueError(f"{problem}, and the model's output per sample would be "
                             f"{list(out.shape[1:])} instead of {list(want_out[1:])}; {fix}")


def _check_keywords(plan: "FitPlan", batch: Any, kwargs: dict[str, Any], what: str) -> None:
    """A dict sample has the target ``loss_fn`` needs (its ``"labels"``), and the model's forward
    takes every keyword input by name (docs/design-overview.md §6)."""
    whole = isinstance(batch, Mapping)  # a dict sample; else a pair whose inputs are a dict
    keys = ", ".join(repr(k) for k in kwargs)
    pairs = ("return (inputs, target) pairs such as (x, y), or a dict such as {'x': x, "
             "'labels': y} whose keys are forward's parameters")
    if whole and "labels" not in kwargs and plan.loss_fn is not model_loss:
        raise ValueError(f"{what}'s samples are dicts ({keys}) without a 'labels' entry: a dict "
                         "sample is the model's keyword inputs, and its target, what loss_fn "
                         f"gets, is its 'labels' entry; {pairs} (samples without a target: "
                         "(inputs, None), and loss_fn gets None)")
    try:
        params = inspect.signature(plan.template.forward).parameters.values()
    except (TypeError, ValueError):  # no signature to read: the first round tells
        return
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return
    names = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    unknown = [k for k in kwargs if k not in names]
    if unknown:
        given = f"dicts ({keys})" if whole else f"pairs whose inputs are dicts ({keys})"
        labels = ", the 'labels' entry too," if whole else ""
        raise ValueError(f"{what}'s samples are {given} of keyword inputs, all passed{labels} "
                         f"to {type(plan.template).__name__}.forward({', '.join(names)}) by name, "
                         f"which takes no {', '.join(repr(k) for k in unknown)}; {pairs}")


def _check_meta(plan: "FitPlan", args: tuple[Any, ...], kwargs: dict[str, Any], target: Any,
                what: str) -> None:
    """A tensor on the meta device (shapes without data) among a batch's inputs or its target is
    an error naming it: no forward or loss can read it."""
    labelled = [(f"{label} of a sample", arg) for label, arg, _ in _given_inputs(plan, args, kwargs)]
    for label, value in labelled + [("the target of a sample", target)]:
        metas = [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor) and t.is_meta]
        if metas:
            raise ValueError(f"{what}: {label} is a tensor on the meta device (a shape, "
                             f"{list(metas[0].shape)} for a batch, without data), which no forward "
                             f"or loss can read; give {what} real tensors (e.g. loaded on the CPU: "
                             "TensorDataset(x, y) with x and y read from the data files)")


def _texts(value: Any) -> list[str]:
    """The strings of a collated value: a str, or a list or tuple of them (``default_collate``
    of str samples); else none."""
    items = value if isinstance(value, (list, tuple)) else [value]
    return list(items) if items and all(isinstance(v, str) for v in items) else []


def _check_text(plan: "FitPlan", args: tuple[Any, ...], kwargs: dict[str, Any], target: Any,
                what: str) -> None:
    """Text where the model takes a tensor (the compiled example input is one), or as the
    target, is an error naming the input and the fix: the model and the loss take tensors."""
    for label, arg, spec in _given_inputs(plan, args, kwargs):
        texts = _texts(arg)
        if texts and spec.shape is not None:
            raise ValueError(f"{what}: {label} of a sample is a str ({texts[0][:40]!r}), but the "
                             f"model takes a tensor there (compiled for example inputs of shape "
                             f"{list(spec.shape[1:])} per sample); turn the text into tensors "
                             "first: token ids from a tokenizer in the Dataset's __getitem__, or "
                             "a DataLoader collate_fn that tokenizes and pads each batch")
    texts = _texts(target)
    if texts and plan.loss_fn is not model_loss:
        raise ValueError(f"{what}: the target of a sample is a str ({texts[0][:40]!r}), but "
                         "loss_fn takes tensors; map the class names to integer class indices "
                         "(e.g. torch.tensor(classes.index(name))) in the Dataset's __getitem__")


def _all_labels(dataset: Any, first_targets: torch.Tensor) -> torch.Tensor:
    """Every label when they are one tensor (TensorDataset, ImageDataset), else the first batch's."""
    base = getattr(dataset, "base", dataset)  # augmented views keep the labels of their base
    if isinstance(base, TensorDataset) and isinstance(base.tensors[-1], torch.Tensor):
        return base.tensors[-1]
    return first_targets


def _describe(sample: Any) -> str:
    if isinstance(sample, torch.Tensor):
        return f"a Tensor of shape {list(sample.shape)}"
    if isinstance(sample, (list, tuple)):
        return f"a {type(sample).__name__} of {len(sample)} items"
    return "None" if sample is None else f"a {type(sample).__name__}"


def _check_samples(dataset: Any, first: int, what: str, pairs: bool = True) -> None:
    """The last index ``len − 1`` and ``dataset[first]`` give ``(inputs, target)`` pairs (with
    ``pairs=False``, for a collate_fn that makes the pairs: they are read without error)."""
    last = len(dataset) - 1
    for i in dict.fromkeys((last, first)):
        try:
            sample = dataset[i]
        except Exception as exc:  # noqa: BLE001 - the dataset's own error, named with the index
            hint = (f"; {what} says len() = {last + 1}: make __len__ return the number of samples "
                    "that __getitem__ can return") if i == last else ""
            raise ValueError(f"{what}[{i}] fails ({type(exc).__name__}: {exc}){hint}") from exc
        if pairs and not isinstance(sample, Mapping) and \
                (not isinstance(sample, (list, tuple)) or len(sample) != 2):
            raise ValueError(f"{what}[{i}] is {_describe(sample)}, not an (inputs, target) pair; "
                             "make __getitem__ return a pair such as (image, label), or a dict of "
                             "keyword inputs such as {'input_ids': ids, 'labels': labels}")


def _check_label_form(loss_fn: Any, target: torch.Tensor, out_shape: tuple[int, ...],
                      what: str) -> None:
    """Labels of a class-index loss: integer (int64 or uint8) class indices shaped like the
    output without its class dimension, or (cross_entropy only) float class probabilities
    shaped like the output."""
    name = "nll_loss" if loss_fn is F.nll_loss or isinstance(loss_fn, nn.NLLLoss) else "cross_entropy"
    index_shape, per_sample = list(out_shape[2:]), list(target.shape[1:])
    problem = f"{what}'s labels are {target.dtype} of shape {list(target.shape)}"
    if target.is_floating_point():
        if name == "cross_entropy" and per_sample == list(out_shape[1:]):
            return  # class probabilities [N, C, ...]
        probs = (f"cross_entropy reads float labels as class probabilities of shape "
                 f"[N, {', '.join(map(str, out_shape[1:]))}] and class indices as integers"
                 ) if name == "cross_entropy" else "nll_loss takes class indices as integers"
        raise ValueError(f"{problem}: {probs}; for class indices convert them: y.long()")
    if per_sample == [1] + index_shape:
        raise ValueError(f"{problem}, but {name} takes class indices of shape "
                         f"[N{''.join(f', {d}' for d in index_shape)}]; squeeze the labels: "
                         "y.squeeze(1)")
    if per_sample != index_shape:
        raise ValueError(f"{problem}, but {name} with a model output of shape [N, "
                         f"{', '.join(map(str, out_shape[1:]))}] takes class indices of shape "
                         f"[N{''.join(f', {d}' for d in index_shape)}]; reshape the labels")
    if target.dtype not in (torch.int64, torch.uint8):
        raise ValueError(f"{problem}, but {name} takes class indices as torch.int64 (or uint8); "
                         "convert them: y.long()")


@torch.no_grad()
def _check_class_dimension(plan: "FitPlan", args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """A class-index loss over an output without a class dimension (``[N]``: one score per
    sample) is an error naming the output, the loss and the two fixes. The example's output
    was 1-d (or 0-d); the model runs once on the batch to tell a model that squeezes a batch of
    one from one that gives a score per sample."""
    out = _run_central(plan, args, kwargs)
    if not isinstance(out, torch.Tensor) or out.dim() >= 2:
        return
    name = "nll_loss" if plan.loss_fn is F.nll_loss or isinstance(plan.loss_fn, nn.NLLLoss) \
        else "cross_entropy"
    raise ValueError(
        f"{plan.model_graph.name}'s output on a batch has shape {list(out.shape)} "
        f"({'one score per sample' if out.dim() else 'one number per batch'}), but {name} "
        "takes class scores [N, C] with class indices [N]: for C classes end the model with C "
        "outputs (e.g. nn.Linear(features, 2) for two classes) and keep the loss; or, for one "
        "score of a binary label, use loss_fn=lambda out, y: "
        "F.binary_cross_entropy_with_logits(out, y.float())")


def _class_index_loss(loss_fn: Any) -> int | None:
    """The ignore_index of a loss whose integer targets are class indices, else None."""
    if loss_fn in (F.cross_entropy, F.nll_loss):
        return -100  # their default ignore_index
    if isinstance(loss_fn, (nn.CrossEntropyLoss, nn.NLLLoss)):
        return loss_fn.ignore_index
    return None


def check_first_batch(plan: "FitPlan", dataset: Any, fetch: Callable[[torch.Tensor], Any],
                      indices: torch.Tensor, what: str = "train_dataset") -> None:
    """Check one batch of ``dataset`` against the plan: ``(inputs, target)`` pairs (the first
    sample and the last index), the inputs' dtypes and per-sample shapes against the example
    inputs' (the model runs once, in evaluation mode, only where they differ), and a class-index
    loss's labels (docs/reliability.md, Bad input); ``loss_fn`` is not called.

    Args:
        plan: the compiled Plan.
        dataset: the dataset (training or evaluation).
        fetch: indices ``[n]`` → a collated batch.
        indices: the samples to check, ``[b]``.
        what: the argument's name for messages.

    Raises:
        ValueError: a mismatch; the message names the input or label, the numbers and the fix."""
    last = len(dataset) - 1
    if fetch == getattr(dataset, "get_batch", None):  # read in batches only: one call, with len − 1
        indices = torch.cat([indices, torch.tensor([last])])
        try:
            batch = fetch(indices)
        except IndexError as exc:
            raise ValueError(f"{what}.get_batch fails on index {last} ({exc}); {what} says len() = "
                             f"{last + 1}: make __len__ return the number of samples it has") from exc
    elif isinstance(fetch, (LearnerFetch, CollateFetch)):  # a DataLoader's collate_fn makes pairs
        _check_samples(dataset, int(indices[0]), what, pairs=False)
        batch = single(fetch(indices))
        if not isinstance(batch, (list, tuple)) or len(batch) != 2:
            raise ValueError(f"{what}'s collate_fn returned {_describe(batch)} for a batch of "
                             f"{len(indices)} samples, not an (inputs, target) pair; make it "
                             "return a pair such as (padded_tokens, labels)")
    else:
        _check_samples(dataset, int(indices[0]), what)
        try:
            batch = fetch(indices)
        except RuntimeError as exc:
            if "stack expects each tensor to be equal size" not in str(exc):
                raise
            raise ValueError(f"{what}'s samples have tensors of different sizes ({exc}), which "
                             "the default collation cannot stack; pass a DataLoader with a "
                             "collate_fn that pads them, e.g. DataLoader(dataset, batch_size=b, "
                             "collate_fn=pad)") from exc
    args, kwargs, target = split_inputs(batch)
    if kwargs:
        _check_keywords(plan, batch, kwargs, what)
    _check_meta(plan, args, kwargs, target, what)
    _check_text(plan, args, kwargs, target, what)
    _check_dtypes(plan, args, kwargs, what)
    _check_inputs(plan, args, kwargs, what)
    _check_labels(plan, dataset, args, kwargs, target, what)


def _check_labels(plan: "FitPlan", dataset: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                  target: Any, what: str) -> None:
    """Under a class-index loss: a target, an output with a class dimension, labels of its
    form, every label (a tensor dataset's all, else the batch's) among its classes or the
    ignore_index."""
    ignore = _class_index_loss(plan.loss_fn)
    out_shape = _output_shape(plan)
    if ignore is not None and target is None:
        name = "nll_loss" if plan.loss_fn is F.nll_loss or isinstance(plan.loss_fn, nn.NLLLoss) \
            else "cross_entropy"
        raise ValueError(f"{what}'s samples have no target (None), but loss_fn is {name}, which "
                         "takes class indices; give (inputs, label) pairs, or a loss_fn that "
                         "needs no target (it gets None), or loss_fn=None for the model's own loss")
    if ignore is not None and out_shape is not None and len(out_shape) < 2:
        _check_class_dimension(plan, args, kwargs)
    if ignore is None or out_shape is None or len(out_shape) < 2 or not isinstance(target, torch.Tensor):
        return
    _check_label_form(plan.loss_fn, target, out_shape, what)
    if target.is_floating_point():
        return
    classes = out_shape[1]
    labels = _all_labels(dataset, target)
    bad = labels[((labels < 0) | (labels >= classes)) & (labels != ignore)]
    if len(bad):
        lo, hi = int(labels.min()), int(labels.max())
        raise ValueError(
            f"{what} has label {int(bad[0])}, outside the model's {classes} classes [0, "
            f"{classes - 1}] (labels range over [{lo}, {hi}]); "
            + (f"remap the labels to 0 … {classes - 1}, or mark the ones to skip with the loss's "
               f"ignore_index ({ignore})" if int(bad[0]) < 0 else
               f"build the model with num_classes={hi + 1} or remap the labels to 0 … C−1")
        )


def check_eval_dataset(plan: "FitPlan", data: Any) -> None:
    """``check_first_batch`` of an evaluation set (a Dataset or DataLoader) as evaluation reads
    it: its first b samples (those its sampler yields), collated by its collate_fn; the one check
    of ``fit(eval_dataset=)`` and ``Plan.evaluate``.

    Raises:
        TypeError, ValueError: as ``eval_samples`` and ``check_first_batch``, naming
            ``eval_dataset``."""
    evals = eval_samples(data)  # the samples evaluation scores
    check_first_batch(plan, evals, make_fetch(evals, collate_of(data)),
                      torch.arange(min(plan.settings.batch_size, len(evals))), what="eval_dataset")
