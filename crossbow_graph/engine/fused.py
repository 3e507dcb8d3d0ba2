"""Fused learners: a group of replicas stacked and run as one program with torch.func
(docs/design-overview.md §5).

The group's parameters are the rows ``w[r0:r1] [n, P]`` viewed per tensor as ``[n, *shape]``; the
float buffers are ``buf[r0:r1] [n, Q]`` copied per tensor to ``[n, *shape]`` and written back
after the step (BatchNorm statistics stay per replica; vmap's in-place running-stat updates do not
write through strided views, hence the copies); integer
buffers (``num_batches_tracked``) are stacked from the replicas' modules and written back.
``torch.func.functional_call`` runs the model on them under ``torch.func.vmap`` with
``randomness="different"`` (every replica draws its own dropout mask); the sum of the n mean losses
is backpropagated once, which gives each replica the gradient of its own loss.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn
from torch.func import functional_call, vmap

from .inputs import split_inputs
from .precision import autocast
from .settings import RunSettings, settings_view
from .state import DeviceState

__all__ = ["FusedProgram"]


class FusedProgram:
    """The vmapped forward and loss of a device's replicas (one per device; no state of its own).

    Args:
        template: a module of the model's structure (its parameter values are never used).
        loss_fn: ``loss_fn(output, target) -> scalar`` per replica.
        settings: the plan's RunSettings; b is read from it at every step.
    """

    batch_size = settings_view("batch_size", "b, samples per replica (read-only: the plan's settings).")

    def __init__(self, template: nn.Module, loss_fn: Callable, settings: RunSettings) -> None:
        self.module = template
        self.loss_fn = loss_fn
        self.settings = settings

        def one(params: dict, buffers: dict, args: tuple, kwargs: dict, target: Any) -> torch.Tensor:
            loss = loss_fn(functional_call(self.module, (params, buffers), args, kwargs), target)
            if not (isinstance(loss, torch.Tensor) and loss.dim() == 0):
                raise ValueError(
                    f"loss_fn must return a scalar tensor, got {tuple(getattr(loss, 'shape', ()))}; "
                    "reduce it, e.g. with reduction='mean'")
            return loss

        self._batched = vmap(one, randomness="different")

    def step(self, state: DeviceState, r0: int, r1: int, batch: Any, *,
             reseed: Callable[[], None] | None = None) -> torch.Tensor:
        """Forward and backward of replicas ``r0 … r1−1``; gradients into ``state.g[r0:r1]``.

        The forward runs under the state's precision (engine/precision.py); with float16 loss
        scales the program backpropagates Σ_j S_j·ℓ_j, and runs again from the same buffers
        while some row overflows (``LossScales.settle``). A bfloat16/float16 model runs on its
        low-precision copy ``w_model[r0:r1]``, refreshed from the float32 masters first.

        Args:
            state: the device's flat buffers and replica modules.
            r0, r1: the group's rows.
            batch: the group's collated samples, ``n·b`` along dimension 0 (n = r1 − r0).
            reseed: called before each run of the forward (seeds the dropout RNG; a float16
                recomputation draws the same masks), or None.

        Returns:
            The n losses, ``[n]``, detached.
        """
        n, b = r1 - r0, self.settings.batch_size
        args, kwargs, target = split_inputs(batch)
        stack = lambda t: (t.to(state.torch_device, non_blocking=True).view(n, b, *t.shape[1:])  # noqa: E731
                           if isinstance(t, torch.Tensor) else t)
        args = tuple(stack(a) for a in args)
        kwargs = {k: stack(v) for k, v in kwargs.items()}
        target = stack(target)
        if state.w_model is not state.w:  # a low-precision model: its copy of the masters' rows
            with torch.no_grad():
                state.w_model[r0:r1].copy_(state.w[r0:r1])
        ints = [name for name, t in state.replicas[r0].named_buffers() if not t.is_floating_point()]
        scales = state.loss_scales
        while True:
            if reseed is not None:
                reseed()
            w, buffers, losses = self._run(state, r0, r1, ints, args, kwargs, target)  # w: [n, P]
            if scales is None:
                losses.sum().backward()
                break
            (losses * scales.weights(r0, r1, losses)).sum().backward()
            if scales.settle(r0, r1, losses, w.grad):
                break
        state.g[r0:r1].copy_(w.grad)
        for name, shape, off, k in state.buffers.entries:
            state.buf[r0:r1, off:off + k].copy_(buffers[name].reshape(n, k))
        for name in ints:
            for i, r in enumerate(range(r0, r1)):
                state.replicas[r].get_buffer(name).copy_(buffers[name][i])
        return losses.detach()

    def _run(self, state: DeviceState, r0: int, r1: int, ints: list[str], args: tuple,
             kwargs: dict, target: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
        """The vmapped forward of rows ``r0 … r1−1`` from their current parameters and buffers:
        (the rows as a leaf ``[n, P]`` sharing storage with the state, the buffers the forward
        updated, the losses ``[n]``)."""
        n = r1 - r0
        flat = state.w_model if state.w_model is not state.w else state.w
        w = flat[r0:r1].detach().requires_grad_(True)  # [n, P], shares storage with the state
        params = {name: w[:, off:off + k].view(n, *shape)
                  for name, shape, off, k in state.params.entries}
        # contiguous copies: vmap's batch-norm rule does not write through strided views
        buffers = {name: state.buf[r0:r1, off:off + k].reshape(n, *shape).clone()
                   for name, shape, off, k in state.buffers.entries}
        for name in ints:
            buffers[name] = torch.stack([state.replicas[r].get_buffer(name) for r in range(r0, r1)])
        with autocast(state.precision, state.torch_device, vmapped=True):
            losses = self._batched(params, buffers, args, kwargs, target)  # [n]
        return w, buffers, losses
