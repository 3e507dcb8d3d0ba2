"""BatchNorm statistics of the central model, re-estimated for z's weights with
``torch.optim.swa_utils.update_bn``'s algorithm (docs/design-overview.md §2, BatchNorm;
Izmailov et al., "Averaging Weights Leads to Wider Optima and Better Generalization", UAI 2018,
§3.2)."""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from ..engine.data.batches import LearnerBatches
from ..engine.data.inputs import NO_FLAGS, CallFlags, split_inputs
from ..engine.learning.learners import host_rngs_kept, seed_rng

__all__ = ["BNRecalibration", "recalibrate_batch_norm"]


def _trained_batch_norms(module: nn.Module) -> list[_BatchNorm]:
    """The BatchNorm layers that track running statistics and are in training mode once
    ``module.train()`` has run (the model's own ``train``); the module is left in training mode."""
    module.train()
    return [m for m in module.modules() if isinstance(m, _BatchNorm) and m.training
            and m.track_running_stats and m.running_mean is not None]


@torch.no_grad()
def recalibrate_batch_norm(module: nn.Module, batches: list[Any], device: torch.device,
                           flags: CallFlags = NO_FLAGS) -> int:
    """Re-estimate the running statistics of ``module``'s BatchNorm layers that train
    (``_trained_batch_norms``), in place: reset, then the cumulative average (``momentum=None``)
    over ``batches`` run forward in training mode without gradients; momenta, the module's mode and
    every other buffer are restored, the parameters unchanged (docs/design-overview.md §2).

    Args:
        module: the model (any mode).
        batches: collated ``(inputs, target)`` batches, as ``engine.inputs.split_inputs`` takes them,
            or ``LearnerBatches`` (a DataLoader's collate_fn per learner batch: each run alone).
        device: where the module is; the batches' tensors are moved there.
        flags: compile's keyword flags (engine/data/inputs.py ``CallFlags``).

    Returns:
        The number of batches run (0: no BatchNorm layer with running statistics trains)."""
    was_training = module.training
    norms = _trained_batch_norms(module)
    if not norms or not batches:
        module.train(was_training)
        return 0
    stats = {id(t) for bn in norms for t in (bn.running_mean, bn.running_var)}
    others = {name: b.clone() for name, b in module.named_buffers() if id(b) not in stats}
    momenta = [bn.momentum for bn in norms]
    move = lambda t: t.to(device, non_blocking=True) if isinstance(t, torch.Tensor) else t  # noqa: E731
    try:
        for bn in norms:
            bn.reset_running_stats()
            bn.momentum = None
        for batch in batches:
            for one in batch.batches if isinstance(batch, LearnerBatches) else [batch]:
                args, kwargs, _ = split_inputs(one, flags)
                module(*(move(a) for a in args), **{k: move(v) for k, v in kwargs.items()})
    finally:
        for bn, momentum in zip(norms, momenta):
            bn.momentum = momentum
        module.train(was_training)
        for name, b in module.named_buffers():
            if name in others:
                b.copy_(others[name])
    return len(batches)


class BNRecalibration:
    """What the central model's BatchNorm statistics are re-estimated on, and when (one per
    Plan; docs/design-overview.md §2, BatchNorm): set by each fit (``use``), reused until z, its
    buffers, b or the data change, skipped with k = 1; the global RNGs are left as they were.

    Attributes:
        batches: training batches per re-estimation, 0: off (z is evaluated with ``zbuf``)."""

    def __init__(self, module: nn.Module) -> None:
        was_training = module.training
        self.has_batch_norm = bool(_trained_batch_norms(module))  # that trains
        module.train(was_training)
        self.batches = 0
        self._fetch: Callable[[torch.Tensor], Any] | None = None
        self._num_samples, self._seed = 0, 0
        self._key: tuple | None = None  # what the evaluated buffers were last computed for

    def use(self, fetch: Callable[[torch.Tensor], Any], num_samples: int, *, batches: int,
            seed: int) -> None:
        """Re-estimate from now on with ``fetch`` (sample indices ``[n]`` → a collated batch)
        over ``num_samples`` training samples, ``batches`` batches, seeded with ``seed``."""
        self._fetch, self._num_samples, self.batches, self._seed = fetch, num_samples, batches, seed
        self._key = None

    def draw(self, batch_size: int, round_index: int) -> list[torch.Tensor]:
        """The sample indices, ``[b]`` each, of up to ``batches`` disjoint batches for the state
        after ``round_index`` rounds (seeded by the fit's seed and ``round_index``)."""
        n = min(self.batches * batch_size, self._num_samples)
        gen = torch.Generator().manual_seed((self._seed * 1_000_003 + round_index) * 65_537 + 7_919)
        order = torch.randperm(self._num_samples, generator=gen)[:n]
        chunks = list(order.split(batch_size))
        if len(chunks) > 1 and len(chunks[-1]) < batch_size:
            chunks.pop()
        return chunks

    def refresh(self, module: nn.Module, buf: torch.Tensor, *, z: torch.Tensor,
                zbuf: torch.Tensor, batch_size: int, num_learners: int, round_index: int,
                flags: CallFlags = NO_FLAGS) -> None:
        """``module``'s float buffers (views of ``buf [Q]``) for z: ``zbuf [Q]`` copied, then,
        when on, with k = ``num_learners`` > 1, the BatchNorm statistics re-estimated on ``draw``
        (the forward passes with compile's keyword ``flags``)."""
        if not (self.batches and self.has_batch_norm and self._fetch is not None
                and num_learners > 1):
            buf.copy_(zbuf)
            self._key = None
            return
        key = (self.batches, round_index, batch_size, float(z.sum(dtype=torch.float64)),
               float(zbuf.sum(dtype=torch.float64)))
        if key == self._key:
            return
        buf.copy_(zbuf)
        devices = [z.device] if z.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices), host_rngs_kept():
            seed_rng(z.device, round_index)  # dropout in the forward passes
            batches = [self._fetch(idx) for idx in self.draw(batch_size, round_index)]
            recalibrate_batch_norm(module, batches, z.device, flags)
        self._key = key
