"""Fused learners: a group of replicas stacked and run as one program with torch.func:
``functional_call`` over ``[n, *shape]`` views of ``w[r0:r1]`` (each its own autograd leaf)
under ``vmap(randomness="different")``, the float buffers gathered in one ``index_select`` and
written back with one ``cat``, the gradients into ``g[r0:r1]`` with one ``cat``
(docs/runtime.md, "Learner modes"; docs/design-overview.md §5). ``vmap_failure`` finds models
vmap cannot run (LSTM, checkpointing) on the example inputs."""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
from torch import nn
from torch.func import functional_call, vmap
from torch.utils._pytree import tree_flatten, tree_map

from ...compiler.outputs import loss_value
from ..data.inputs import example_call, split_inputs
from ..state.flat import DeviceState, copy_module
from ..state.precision import autocast

__all__ = ["FusedProbe", "FusedProgram", "add_replica_hooks", "fused_mode_message", "in_dims", "vmap_failure"]


def fused_mode_message(model_name: str, failure: str) -> str:
    """The error (or warning) text when fused learners cannot run ``model_name``: what failed
    and the fix, ``learner_mode="per_replica"``."""
    return (f"learner_mode='fused' cannot run {model_name}: torch.func.vmap fails on it "
            f"({failure}); use learner_mode='per_replica' (the same mathematics, each replica its "
            "own forward and backward, which runs any model that trains in eager PyTorch)")


def _vmap_error(exc: BaseException) -> bool:
    """Whether ``exc`` comes from torch.func's transforms (a missing batching rule, an op or an
    autograd.Function they cannot run) rather than from the model itself."""
    text = str(exc)
    return any(s in text for s in ("Batching rule", "vmap", "functorch", "escaped from inside a "
                                   "function being vmapped", "setup_context"))


class FusedProgram:
    """The vmapped forward and loss of a device's replicas (one per device; no state of its own
    but cached gather indices).

    Args:
        template: a module of the model's structure (its parameter values are never used).
        loss_fn: ``loss_fn(output, target) -> scalar`` per replica (or a dict of it under
            ``"loss"``, compiler/outputs.py ``loss_value``)."""

    def __init__(self, template: nn.Module, loss_fn: Callable) -> None:
        self.module = template
        self.loss_fn = loss_fn

        def one(params: dict, buffers: dict, args: tuple, kwargs: dict, target: Any) -> torch.Tensor:
            return loss_value(loss_fn(functional_call(self.module, (params, buffers), args, kwargs),
                                      target))

        self._one = one
        self._orders: dict[tuple, torch.Tensor] = {}  # (n, Q, device) -> ``_tensor_major``

    def step(self, state: DeviceState, r0: int, r1: int, batch: Any, b: int, *,
             reseed: Callable[[], None] | None = None) -> torch.Tensor:
        """Forward and backward of replicas ``r0 … r1−1``; gradients into ``state.g[r0:r1]``.

        Precision and float16 loss scales as ``learn_group`` (engine/learning/learners.py); a
        bfloat16/float16 model runs on ``w_model[r0:r1]``, refreshed from the float32 masters.

        Args:
            state: the device's flat buffers and replica modules.
            r0, r1: the group's rows.
            batch: the group's collated samples, ``n·b`` along dimension 0 (n = r1 − r0).
            b: samples per replica (the round's).
            reseed: called before each run of the forward (seeds the dropout RNG; a float16
                recomputation draws the same masks), or None.

        Returns:
            The n losses, ``[n]``, detached.

        Raises:
            RuntimeError: torch.func.vmap cannot run the model or the loss (the message names
                ``learner_mode="per_replica"``)."""
        n = r1 - r0
        args, kwargs, target = split_inputs(batch, state.call_flags)
        stack = lambda t: (t.to(state.torch_device, non_blocking=True).view(n, b, *t.shape[1:])  # noqa: E731
                           if isinstance(t, torch.Tensor) else t)
        args = tuple(stack(a) for a in args)
        kwargs = {k: stack(v) for k, v in kwargs.items()}
        target = stack(target)
        if state.w_model is not state.w:  # a low-precision model: its copy of the masters' rows
            with torch.no_grad():
                state.w_model[r0:r1].copy_(state.w[r0:r1])
        scales = state.loss_scales
        ints = {name: t[r0:r1] for name, t in state.ints.items()}  # updated in place
        saved = {name: t.clone() for name, t in ints.items()} if scales is not None else {}
        while True:
            if reseed is not None:
                reseed()
            stacked, losses = self._run(state, r0, r1, ints, args, kwargs, target)  # g rows set
            if scales is None or scales.settle(r0, r1, losses, state.g[r0:r1]):
                break
            for name, t in saved.items():  # run again from the same buffers
                ints[name].copy_(t)
        if stacked is not None:  # [n·Q] tensor by tensor back to the rows [n, Q]
            n_q = [stacked[n * off:n * (off + k)].view(n, k) for _, _, off, k in state.buffers.entries]
            torch.cat(n_q, dim=1, out=state.buf[r0:r1])
        return losses.detach()

    def _run(self, state: DeviceState, r0: int, r1: int, ints: dict[str, torch.Tensor],
             args: tuple, kwargs: dict, target: Any) -> tuple[torch.Tensor | None, torch.Tensor]:
        """The vmapped forward and backward of rows ``r0 … r1−1``, one autograd leaf
        ``[n, *shape]`` per parameter tensor (one ``[n, P]`` leaf would give every tensor a
        zero-filled ``[n, P]`` gradient); gradients into ``state.g[r0:r1]``, ``ints`` in place.
        Returns (the updated float buffers ``[n·Q]`` or None; the losses ``[n]``)."""
        n = r1 - r0
        flat = (state.w_model if state.w_model is not state.w else state.w)[r0:r1].detach()
        params = {entry[0]: state.params.view(flat, entry).requires_grad_(True)
                  for entry in state.params.entries}
        add_replica_hooks(params, state.grad_hooks)
        # one gather of the rows tensor by tensor, [n·Q], each tensor's [n, *shape] contiguous
        # in it: vmap's batch-norm rule does not write through strided views
        entries = state.buffers.entries
        stacked = torch.index_select(state.buf[r0:r1].reshape(-1), 0,
                                     self._tensor_major(state, n)) if entries else None
        buffers = {name: stacked[n * off:n * (off + k)].view(n, *shape)
                   for name, shape, off, k in entries}
        buffers.update(ints)
        scales = state.loss_scales
        try:
            with autocast(state.precision, state.torch_device, vmapped=True):
                batched = vmap(self._one, in_dims=(0, 0, *in_dims((args, kwargs, target))),
                               randomness="different")
                losses = batched(params, buffers, args, kwargs, target)  # [n]
            total = (losses * scales.weights(r0, r1, losses)).sum() if scales is not None \
                else losses.sum()
            grads = torch.autograd.grad(total, list(params.values()), allow_unused=True)
        except (RuntimeError, NotImplementedError, ValueError) as exc:
            if not _vmap_error(exc):
                raise
            raise RuntimeError(fused_mode_message(type(self.module).__name__,
                                                  f"{type(exc).__name__}: {exc}")) from exc
        _grads_into_rows(state, r0, r1, grads)
        return stacked, losses

    def _tensor_major(self, state: DeviceState, n: int) -> torch.Tensor:
        """Indices ``[n·Q]`` into rows ``[n, Q]`` flattened that order them tensor by tensor:
        element c of replica i's tensor at ``off`` (k elements) goes to ``n·off + i·k + c``."""
        key = (n, state.buffers.size, state.torch_device)
        if key not in self._orders:
            Q = state.buffers.size
            self._orders[key] = torch.cat([
                (torch.arange(n)[:, None] * Q + off + torch.arange(k)[None, :]).reshape(-1)
                for _, _, off, k in state.buffers.entries]).to(state.torch_device)
        return self._orders[key]


def _grads_into_rows(state: DeviceState, r0: int, r1: int, grads: tuple) -> None:
    """The gradients ``[n, *shape]`` per parameter tensor (None: unused, a zero gradient) into
    ``state.g[r0:r1]``: one ``torch.cat`` of their ``[n, k]`` flattenings in the layout's
    order into the rows (the pads of padded rows untouched; a leaf's gradient has its dtype,
    which is g's)."""
    g, n, layout = state.g, r1 - r0, state.params
    parts = []
    for (name, _, _, k), grad in zip(layout.entries, grads):
        if grad is None:
            parts.append(torch.zeros(n, k, dtype=g.dtype, device=g.device))
        else:  # the order of layout.view: [O, kH, kW, I] for a channels-last weight
            parts.append((grad.movedim(-3, -1) if name in layout.channels_last else grad).reshape(n, k))
    torch.cat(parts, dim=1, out=g[r0:r1])  # padded rows: CUDA's cat writes strided output


def in_dims(inputs: Any) -> Any:
    """vmap's ``in_dims`` for a pytree of model inputs: 0 for a tensor (stacked per replica),
    None for any other leaf (None, a bool flag, an int, a string), which every replica gets as
    it is."""
    return tree_map(lambda t: 0 if isinstance(t, torch.Tensor) else None, inputs)


def add_replica_hooks(params: dict[str, torch.Tensor], hooks: dict[str, list[Callable]]) -> None:
    """Register the user's gradient hooks (``DeviceState.grad_hooks``) on stacked parameters
    ``[n, *shape]``: each hook is called on every replica's gradient ``[*shape]`` in turn, as
    on a per-replica learner's parameter (a hook that returns None leaves it as it is)."""
    for name, fns in hooks.items():
        for fn in fns:
            params[name].register_hook(functools.partial(_per_replica, fn))


def _per_replica(fn: Callable, grads: torch.Tensor) -> torch.Tensor:
    """``fn`` on each row of ``grads [n, *shape]``, stacked back ``[n, *shape]``."""
    return torch.stack([g if (out := fn(g)) is None else out for g in grads.unbind(0)])


class FusedProbe:
    """Why fused learners cannot run a model (``vmap_failure`` on a copy of its example inputs),
    probed once, when first asked (``Plan.fused_failure``; docs/runtime.md)."""

    def __init__(self, template: nn.Module, example_inputs: Any) -> None:
        self._template = template
        self._inputs = tree_map(lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t,
                                example_inputs)
        self._found: tuple[str | None] | None = None  # (failure,) once probed

    @property
    def failure(self) -> str | None:
        """torch.func.vmap's error in a dry run, or None."""
        if self._found is None:
            self._found = (None if self._inputs is None else
                           vmap_failure(self._template, self._inputs),)
        return self._found[0]


def vmap_failure(template: nn.Module, example_inputs: tuple[Any, ...] | dict[str, Any], *,
                 replicas: int = 2, rows: int = 2) -> str | None:
    """Why fused learners cannot run ``template``, or None when they can (or when it cannot tell).

    A dry run of ``FusedProgram.step`` on copies (``replicas`` stacked, the first ``rows``
    samples): a vmapped forward and the backward of the sum of every floating output; a module
    backward hook (vmap skips it silently) is a failure too. When the model fails eagerly as well,
    None (training reports it). Neither ``template`` nor any RNG is changed.

    Args:
        template: the model in the mode it trains in (training mode).
        example_inputs: compile's example inputs, a tuple of positional inputs or a dict of
            keyword inputs, batch along dimension 0.

    Returns:
        ``"ExcType: message"`` of vmap's failure, or None."""
    hooked = [name or "<root>" for name, m in template.named_modules()
              if m._backward_hooks or m._backward_pre_hooks]
    if hooked:  # functional_call under vmap skips them silently
        return (f"module '{hooked[0]}' has a backward hook (register_full_backward_hook or "
                "register_full_backward_pre_hook), which torch.func's transforms do not call")
    args, kwargs = example_call(example_inputs)
    first = lambda t: t[:rows] if isinstance(t, torch.Tensor) and t.dim() > 0 else t  # noqa: E731
    args, kwargs = tree_map(first, args), tree_map(first, kwargs)
    stacked = lambda t: t.detach().unsqueeze(0).repeat(replicas, *[1] * t.dim())  # noqa: E731
    params = {n: stacked(p).requires_grad_(True) for n, p in template.named_parameters() if p.requires_grad}
    buffers = {n: stacked(b) for n, b in template.named_buffers()}
    bargs = tree_map(lambda t: stacked(t) if isinstance(t, torch.Tensor) else t, (args, kwargs))

    def total(out: Any) -> torch.Tensor:
        leaves = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.is_floating_point()]
        return sum(t.sum() for t in leaves) if leaves else torch.zeros(())

    def one(p: dict, b: dict, a: tuple, kw: dict) -> torch.Tensor:
        return total(functional_call(template, (p, b), a, kw))

    devices = [p.device for p in params.values() if p.device.type == "cuda"][:1]
    with torch.random.fork_rng(devices=devices), torch.enable_grad():  # callers may be in no_grad
        try:
            vmap(one, in_dims=(0, 0, *in_dims(bargs)), randomness="different")(
                params, buffers, *bargs).sum().backward()
            return None
        except Exception as exc:  # noqa: BLE001 - any failure: is it vmap's?
            failure = f"{type(exc).__name__}: {exc}".strip()
        try:
            eager = copy_module(template)
            out = total(eager(*args, **kwargs))
            if out.requires_grad:
                out.backward()
        except Exception:  # noqa: BLE001 - the model fails without vmap: not vmap's failure
            return None
    return failure
