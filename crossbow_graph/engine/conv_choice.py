"""Which library runs the worker processes' convolutions on the CPU, oneDNN or ATen's own
kernels, measured once per model and batch size (docs/runtime.md, "Executors")."""

from __future__ import annotations

import contextlib
import copy
import random
import time
from typing import TYPE_CHECKING, Any, Callable, Literal, get_args

import numpy as np
import torch

from ..compiler.outputs import loss_value
from .batches import single
from .inputs import split_inputs

if TYPE_CHECKING:
    from .scheduler import Scheduler

__all__ = ["choose_onednn", "CpuConv", "CPU_CONV_CHOICES", "host_rngs_kept"]

CpuConv = Literal["auto", "onednn", "aten"]
CPU_CONV_CHOICES = get_args(CpuConv)
BIG_STEP_S = 0.3  # choose_onednn: a learner step slower than this is not measured (oneDNN)

_ONEDNN_CHOICES: dict[tuple, bool] = {}  # choose_onednn's measurements in this process


def choose_onednn(scheduler: "Scheduler", fetch: Callable[[torch.Tensor], Any]) -> bool:
    """Whether the worker processes run convolutions with oneDNN, else ATen's kernels:
    ``scheduler.cpu_conv`` ``"onednn"`` or ``"aten"``, or with ``"auto"`` measured on a copy of the
    model and the dataset's first b samples, single-threaded (``MEASURE_REPS``, ``MEASURE_STEPS``,
    ``MEASURE_S``, ``BIG_STEP_S``; ATen when ≥ 5 % faster), kept per scheduler and b and per
    (model class, parameters, b, input shapes) in this process. Torch's RNG and the replicas are
    untouched (docs/runtime.md, "Executors")."""
    if scheduler.cpu_conv != "auto":
        return scheduler.cpu_conv == "onednn"
    b = scheduler.batch_size
    cached = scheduler.onednn_choices.get(b)
    if cached is not None:
        return cached
    state = scheduler.states[0]
    with torch.random.fork_rng(devices=[]), host_rngs_kept():  # as if never fetched
        batch = single(fetch(torch.arange(b)))  # one learner's
    args, kwargs, target = split_inputs(batch, state.call_flags)
    shapes = tuple((tuple(t.shape), t.dtype) for t in (*args, *kwargs.values(), target)
                   if isinstance(t, torch.Tensor))
    key = (type(state.template).__qualname__, state.params.size, state.buffers.size, b, shapes)
    choice = _ONEDNN_CHOICES.get(key)
    if choice is None:
        model = copy.deepcopy(state.template).train()
        saved_threads, saved_onednn = torch.get_num_threads(), torch.backends.mkldnn.enabled
        try:
            torch.set_num_threads(1)
            with torch.random.fork_rng(devices=[]):
                best = _step_seconds(model, scheduler.loss_fn, args, kwargs, target)
        except Exception:  # noqa: BLE001 - a failing model fails in its first round, as a TaskError
            return True
        finally:
            torch.set_num_threads(saved_threads)
            torch.backends.mkldnn.enabled = saved_onednn
        choice = _ONEDNN_CHOICES[key] = not best[False] < 0.95 * best[True]
    scheduler.onednn_choices[b] = choice
    return choice


MEASURE_REPS, MEASURE_STEPS, MEASURE_S = 3, 5, 0.02  # choose_onednn's measurement


@contextlib.contextmanager
def host_rngs_kept():
    """Restore Python's ``random`` and NumPy's global RNG states on exit."""
    py, npy = random.getstate(), np.random.get_state()
    try:
        yield
    finally:
        random.setstate(py)
        np.random.set_state(npy)


def _step_seconds(model, loss_fn, args, kwargs, target) -> dict[bool, float]:
    """The fastest forward + backward step by oneDNN on/off; ``{True: 0.0, False: inf}`` after
    one step slower than ``BIG_STEP_S``."""
    best = {True: float("inf"), False: float("inf")}
    for _ in range(MEASURE_REPS):
        for onednn in (True, False):
            torch.backends.mkldnn.enabled = onednn
            start = time.perf_counter()
            loss_value(loss_fn(model(*args, **kwargs), target)).backward()  # warm-up
            end = time.perf_counter()
            if onednn and end - start > BIG_STEP_S:  # a large model: oneDNN, unmeasured
                return {True: 0.0, False: float("inf")}
            steps, t0 = 0, end  # ≥ MEASURE_STEPS steps and MEASURE_S, ≤ 5·MEASURE_S (≥ 1 step)
            while steps < 1 or ((steps < MEASURE_STEPS or end - t0 < MEASURE_S)
                                and end - t0 < 5 * MEASURE_S):
                start = time.perf_counter()
                loss_value(loss_fn(model(*args, **kwargs), target)).backward()
                end = time.perf_counter()
                best[onednn] = min(best[onednn], end - start)
                steps += 1
    return best
