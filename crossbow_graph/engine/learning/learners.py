"""Learner groups of the engine: one learner group's forward/backward, in either learner mode.

A *learner group* is a contiguous block of replicas ``r0 … r1−1`` of one device that run together
(on one CUDA stream, in one worker process, or fused into one vmapped program). Both modes leave
the group's loss gradients in ``state.g[r0:r1]`` and return the per-replica losses."""

from __future__ import annotations

import contextlib
import random
import warnings
from typing import Any, Callable

import numpy as np
import torch
from torch.utils._pytree import tree_map

from ...compiler.outputs import loss_value
from ...config import LEARNER_MODES
from ..data.batches import LearnerBatches, flat_pair, to_device
from ..data.inputs import split_inputs
from ..state.flat import DeviceState
from ..state.precision import autocast
from .clipping import clip_rows
from .fused import FusedProgram

__all__ = ["LEARNER_MODES", "host_rngs_kept", "learn_group", "learner_seed", "seed_host_rngs",
           "seed_rng", "slice_batch"]


def slice_batch(batch: Any, start: int, stop: int, device: torch.device) -> Any:
    """Rows ``[start, stop)`` of every tensor of a collated batch, moved to ``device``; of a
    ``LearnerBatches``, the one learner of those rows' batch as its collate_fn returned it."""
    if isinstance(batch, LearnerBatches):
        mine = batch.rows(start, stop).batches
        assert len(mine) == 1, (start, stop, batch.batch_size)
        return to_device(mine[0], device)
    if flat_pair(batch) and all(t.device == device for t in batch):
        return type(batch)([t[start:stop] for t in batch])
    return tree_map(lambda t: t[start:stop].to(device, non_blocking=True)
                    if isinstance(t, torch.Tensor) else t, batch)


def learner_seed(fit_seed: int, round_index: int, replica: int) -> int:
    """The seed of torch's RNG for global replica j's forward in round t (dropout masks).

    A function of (fit seed, t, j) alone, so masks differ between replicas and rounds, do not
    depend on which executor or process runs the learner, and a resumed fit draws the same ones."""
    return ((fit_seed * 1_000_003 + round_index) * 65_537 + replica) % (2**63 - 1)


def seed_rng(device: torch.device, seed: int) -> None:
    """Seed the generator that ``device``'s random ops (dropout) draw from, and no other.

    Not ``torch.manual_seed``: it also seeds every CUDA, XPU and MTIA device through lazy calls
    that format a stack trace each time on a machine without them (about 0.4 ms per call on this
    CPU, a third of a LeNet-5 learner's forward and backward at b = 8)."""
    if device.type == "cuda":
        with torch.cuda.device(device):
            torch.cuda.manual_seed(seed)
    else:
        torch.default_generator.manual_seed(seed)


@contextlib.contextmanager
def host_rngs_kept():
    """Restore Python's ``random`` and NumPy's global RNG states on exit."""
    py, npy = random.getstate(), np.random.get_state()
    try:
        yield
    finally:
        random.setstate(py)
        np.random.set_state(npy)


def seed_host_rngs(fit_seed: int, round_index: int, rank: int, process: int, *,
                   torch_cpu: bool = False) -> None:
    """Seed this process's Python ``random`` and NumPy global RNG (and, with ``torch_cpu``, torch's
    CPU generator) from (fit seed, round, rank, process) through ``numpy.random.SeedSequence``, as
    a DataLoader seeds its workers: what a Dataset's augmentation draws from, its own stream per
    process and rank, reproducible (docs/runtime.md, Worker processes). The coordinator is seeded
    too, which replaces the caller's global NumPy and ``random`` states."""
    words = np.random.SeedSequence([fit_seed % 2**64, round_index, rank, process]).generate_state(4)
    random.seed(int.from_bytes(words.tobytes(), "little"))
    np.random.seed(words)
    if torch_cpu:
        torch.default_generator.manual_seed(int.from_bytes(words[:2].tobytes(), "little"))


_UNSTACKABLE = ("fused learners stack the learners' batches, but the collate_fn returned batches "
                "of different shapes (padded to their own lengths, say): these learners run one "
                "replica at a time, as learner_mode='per_replica' does")


def learn_group(state: DeviceState, r0: int, r1: int, batch: Any, loss_fn: Callable,
                batch_size: int, mode: str, fused: FusedProgram | None,
                rng_seed: int | None = None, max_grad_norm: float | None = None
                ) -> list[torch.Tensor]:
    """Forward and backward of replicas ``r0 … r1−1`` of ``state`` on their own batches.

    The forward and loss run under ``state.precision`` (engine/state/precision.py; fp16: scaled
    loss, unscaled gradients, an overflow recomputed at a lower scale), so ``g`` holds unscaled
    gradients, each row clipped to ``max_grad_norm`` when given (engine/learning/clipping.py).

    Args:
        state: the device's replicas and flat buffers.
        r0, r1: the group's rows of ``w``/``g`` (``r1 − r0`` replicas).
        batch: the group's collated samples, ``(r1 − r0)·b`` along dimension 0, replica r's at
            ``[(r − r0)·b, (r − r0 + 1)·b)``, already on the device; or a ``LearnerBatches`` of
            the r1 − r0 replicas' batches (fused: stacked, ``LearnerBatches.stacked``; batches
            of different shapes run per replica instead, with a warning).
        loss_fn: ``loss_fn(output, target) -> scalar``.
        batch_size: b.
        mode: ``"per_replica"`` (each replica its own forward/backward) or ``"fused"`` (one vmapped
            program over the stacked replicas, ``fused`` must be given).
        fused: the FusedProgram of the device (fused mode).
        rng_seed: torch's RNG seed of replica r0's forward, ``rng_seed + (r − r0)`` replica r's
            (``learner_seed``; fused: once per group; a float16 recomputation seeds again).
        max_grad_norm: the largest 2-norm of a replica's gradient (``fit(max_grad_norm=...)``),
            or None: not clipped.

    Returns:
        The r1 − r0 losses (0-dim tensors, detached)."""
    if mode == "fused" and isinstance(batch, LearnerBatches):
        try:
            batch = to_device(batch.stacked(), state.torch_device)
        except ValueError:  # batches padded to their own lengths: one replica at a time
            warnings.warn(_UNSTACKABLE, stacklevel=2)  # one text: shown once per process
            mode = "per_replica"
    if mode == "fused":
        assert fused is not None
        reseed = None if rng_seed is None else (lambda: seed_rng(state.torch_device, rng_seed))
        losses = list(fused.step(state, r0, r1, batch, batch_size, reseed=reseed).unbind())
        clip_rows(state.g[r0:r1], max_grad_norm)
        return losses
    state.g[r0:r1].zero_()  # the backward accumulates (fused mode writes every element of g)
    b = batch_size
    losses = []
    for r in range(r0, r1):
        mine = slice_batch(batch, (r - r0) * b, (r - r0 + 1) * b, state.torch_device)
        seed = None if rng_seed is None else rng_seed + (r - r0)
        losses.append(_learn_replica(state, r, mine, loss_fn, seed))
    clip_rows(state.g[r0:r1], max_grad_norm)
    return losses


def _learn_replica(state: DeviceState, r: int, batch: Any, loss_fn: Callable,
                   seed: int | None) -> torch.Tensor:
    """Replica r's forward (under the state's precision) and backward into ``g[r]``; with float16
    loss scales, computed again at half the scale, from the same buffers, while it overflows."""
    args, kwargs, target = split_inputs(batch, state.call_flags)
    module, scales = state.replicas[r], state.loss_scales
    saved = _buffers_of(state, r) if scales is not None else None
    while True:
        if seed is not None:
            seed_rng(state.torch_device, seed)
        with autocast(state.precision, state.torch_device):
            loss = loss_value(loss_fn(module(*args, **kwargs), target))
        if scales is None:
            loss.backward()
            return loss.detach()
        (loss * scales.weights(r, r + 1, loss)[0]).backward()
        if scales.settle(r, r + 1, loss.reshape(1), state.g[r:r + 1]):
            return loss.detach()
        state.g[r].zero_()
        _restore_buffers(state, r, saved)


def _buffers_of(state: DeviceState, r: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Replica r's float buffers ``[Q]`` and integer buffers, copied (before a forward that a
    float16 overflow may make us run again)."""
    ints = {n: t.clone() for n, t in state.replicas[r].named_buffers() if not t.is_floating_point()}
    return state.buf[r].clone(), ints


@torch.no_grad()
def _restore_buffers(state: DeviceState, r: int,
                     saved: tuple[torch.Tensor, dict[str, torch.Tensor]]) -> None:
    state.buf[r].copy_(saved[0])
    named = dict(state.replicas[r].named_buffers())
    for n, t in saved[1].items():
        named[n].copy_(t)
