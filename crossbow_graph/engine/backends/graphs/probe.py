"""What a CUDA-graph capture of a round cannot take, found in an eager warm-up round before any
capture starts: a host read of device data, an output shape that depends on the data
(``capture_problem``, ``CaptureProbe``; docs/runtime.md, "CUDA-graph rounds")."""

from __future__ import annotations

import os
import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["CaptureProbe", "capture_problem"]

aten = torch.ops.aten
_HOST_READS = {aten._local_scalar_dense.default, aten.is_nonzero.default, aten.equal.default}
_DATA_DEPENDENT = {aten.nonzero.default, aten.masked_select.default, aten.unique_dim.default,
                   aten._unique2.default, aten.unique_consecutive.default,
                   aten.repeat_interleave.Tensor, aten.nonzero_static.default}
_BOOL_INDEXED = {aten.index.Tensor, aten.index_put_.default, aten.index_put.default}


def capture_problem(func, args: tuple, kwargs: dict) -> str | None:
    """Why ``func(*args, **kwargs)`` cannot be captured in a CUDA graph (a host read of device
    data, a data-dependent output shape), or None."""
    if func in _HOST_READS:
        return f"{func._schema.name} reads device data on the host (.item(), bool(tensor))"
    if func in _DATA_DEPENDENT:
        return f"{func._schema.name}'s output shape depends on the data"
    if func in _BOOL_INDEXED and any(t.dtype == torch.bool for t in tree_leaves(args[1:2])
                                     if isinstance(t, torch.Tensor)):
        return f"{func._schema.name} with a boolean mask (a data-dependent shape)"
    return None


class CaptureProbe(TorchDispatchMode):
    """Watches an eager run of a round's body (a warm-up round) for an op its CUDA-graph capture
    cannot take, so that a doomed capture is never started. ``problem``: the first
    ``capture_problem`` seen and where, or None; on a CUDA ``device`` only ops on its tensors
    count, on a CPU device (simulated graphs) every op."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device_type = device.type
        self.problem: str | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.problem is None and (self.device_type == "cpu" or any(
                isinstance(t, torch.Tensor) and t.device.type == self.device_type
                for t in tree_leaves((args, kwargs)))):
            problem = capture_problem(func, args, kwargs)
            if problem is not None:
                self.problem = f"{problem} at {_issuer()}"
        return func(*args, **kwargs)


_TORCH_DIR = os.path.dirname(torch.__file__)


def _issuer() -> str:
    """The innermost frame outside torch and this module issuing the op (a model's forward, or
    crossbow_graph's engine): ``path:line (function)``."""
    for frame in reversed(traceback.extract_stack(limit=80)):
        if not frame.filename.startswith(_TORCH_DIR) and frame.filename != __file__:
            where = "/".join(frame.filename.split(os.sep)[-2:])
            return f"{where}:{frame.lineno} ({frame.name})"
    return "inside torch"
