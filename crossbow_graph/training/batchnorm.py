"""BatchNorm statistics of the central model, re-estimated for z's weights
(docs/design-overview.md §2, BatchNorm).

The replicas' mean running statistics (``zbuf``) are not the statistics of z's weights: z is an
average of the replicas (with momentum), and its activations have other means and variances than
any replica's (Izmailov et al., "Averaging Weights Leads to Wider Optima and Better
Generalization", UAI 2018, §3.2). Before z is evaluated (``Plan.evaluate``, the fit's
evaluations, ``Plan.central_forward``) and in ``Plan.central_model()``, every BatchNorm layer of
the central model that trains (in training mode after the model's own ``train()``: a frozen
backbone kept in evaluation mode keeps its statistics) gets the cumulative average
(``momentum=None``) of the batch statistics of ``batches`` training batches of b samples run
through z in training mode, without gradients:
``torch.optim.swa_utils.update_bn``'s algorithm. It writes the evaluated copy's buffers only:
``zbuf``, which the synchronisation updates, checkpoints hold and new or reset replicas clone,
stays the replicas' mean, so training is the same with or without it.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from ..engine.conv_choice import host_rngs_kept
from ..engine.inputs import split_inputs
from ..engine.learners import seed_rng

__all__ = ["BNRecalibration", "recalibrate_batch_norm"]


def _trained_batch_norms(module: nn.Module) -> list[_BatchNorm]:
    """The BatchNorm layers whose running statistics training updates: those in training mode,
    tracking running statistics, once ``module.train()`` has run (the model's own ``train``: a
    backbone an override keeps in evaluation mode, the fine-tuning idiom, is left out). The
    module is left in training mode."""
    module.train()
    return [m for m in module.modules() if isinstance(m, _BatchNorm) and m.training
            and m.track_running_stats and m.running_mean is not None]


@torch.no_grad()
def recalibrate_batch_norm(module: nn.Module, batches: list[Any], device: torch.device) -> int:
    """Re-estimate the running statistics of ``module``'s BatchNorm layers that train, in place.

    ``torch.optim.swa_utils.update_bn``'s algorithm, over the layers in training mode once
    ``module.train()`` has run (``_trained_batch_norms``; a frozen backbone that the model's
    ``train`` override keeps in evaluation mode keeps its statistics): each such layer's running
    statistics are reset, its momentum set to None (a cumulative average: after n batches,
    running_mean is the mean of the n batch means and running_var that of the n unbiased batch
    variances), the module runs forward in training mode on each batch, without gradients;
    then momenta and the module's
    mode are restored, and every other buffer (``num_batches_tracked``, a model's own counters or
    averages) is put back as it was: only the BatchNorm layers' running means and variances
    change. The parameters are not changed.

    Args:
        module: the model (any mode).
        batches: collated ``(inputs, target)`` batches, as ``engine.inputs.split_inputs`` takes them.
        device: where the module is; tensors of the batches are moved there.

    Returns:
        The number of batches run (0: no BatchNorm layer with running statistics trains).
    """
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
            args, kwargs, _ = split_inputs(batch)
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
    """What the central model's BatchNorm statistics are re-estimated on, and when (one per Plan).

    Each fit sets its training data (``use``); ``refresh`` is called before every read of the
    central model and re-estimates only when z, its buffers, b or the data changed since the last
    time. With k = 1 learner z is the replica itself, and its own running statistics (those plain
    PyTorch's training gives) are kept. The batches are ``batches`` disjoint batches of b samples
    (b in force), drawn from the training data with a generator seeded with (the fit's seed, the
    plan's rounds done): the same state evaluates the same, and a resumed fit evaluates as an
    uninterrupted one. Torch's, Python's and NumPy's global RNGs are as before (dropout in the
    forward passes, a Dataset's augmentation).

    Cost: ``batches`` forward passes of b samples through z and their fetches, once per state of z
    that is read (0.48 s for 20 batches of 16 on bench/bn_central.py's MobileNet, one core).

    It keeps the last fit's ``fetch`` (and with it the training data) until the next fit.

    Attributes:
        batches: training batches per re-estimation, 0: off (z is evaluated with ``zbuf``, the
            replicas' mean).
    """

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
        """The sample indices of the batches for the state after ``round_index`` rounds: up to
        ``batches`` disjoint batches of ``batch_size``, ``[b]`` each (fewer when the data is
        smaller; a last partial batch only when it is the only one)."""
        n = min(self.batches * batch_size, self._num_samples)
        gen = torch.Generator().manual_seed((self._seed * 1_000_003 + round_index) * 65_537 + 7_919)
        order = torch.randperm(self._num_samples, generator=gen)[:n]
        chunks = list(order.split(batch_size))
        if len(chunks) > 1 and len(chunks[-1]) < batch_size:
            chunks.pop()
        return chunks

    def refresh(self, module: nn.Module, buf: torch.Tensor, *, z: torch.Tensor,
                zbuf: torch.Tensor, batch_size: int, num_learners: int, round_index: int) -> None:
        """Make ``module``'s float buffers (views of ``buf [Q]``) right for z: ``zbuf [Q]``
        copied, then, when on, with k = ``num_learners`` > 1 and a model with BatchNorm, the
        BatchNorm statistics re-estimated (``recalibrate_batch_norm``) on
        ``draw(batch_size, round_index)``."""
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
            recalibrate_batch_norm(module, batches, z.device)
        self._key = key
