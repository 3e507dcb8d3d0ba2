"""Mixed precision of the learners: autocast (``VmapAutocast`` under vmap) and per-replica
dynamic float16 loss scales (docs/runtime.md, "Mixed precision")."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager, Literal, get_args

import torch
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

__all__ = ["Precision", "PRECISIONS", "AUTOCAST_DTYPES", "LossScales", "VmapAutocast", "autocast",
           "check_precision"]

Precision = Literal["fp32", "bf16", "fp16"]
PRECISIONS = get_args(Precision)
AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def check_precision(precision: object, model_dtype: torch.dtype) -> None:
    """Raise ValueError for a precision not in ``PRECISIONS``, or ``"bf16"``/``"fp16"`` with a
    model whose trainable parameters are not float32 (``model_dtype``)."""
    if not isinstance(precision, str) or precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r}: use one of {', '.join(map(repr, PRECISIONS))} "
                         "('fp32', the default, runs without autocast)")
    if precision != "fp32" and model_dtype != torch.float32:
        name = str(model_dtype).removeprefix("torch.")
        how = ("it trains in float64" if model_dtype == torch.float64 else
               f"it trains in {name} with float32 masters already")
        raise ValueError(
            f"precision={precision!r} runs a float32 model's forward under autocast, but this "
            f"model's parameters are {name} ({how}); compile the float32 model "
            f"(model.float()) with precision={precision!r}, or keep precision='fp32'")


def autocast(precision: str, device: torch.device, *, vmapped: bool = False) -> ContextManager:
    """The context of a learner's forward and loss: ``torch.autocast`` of ``device``'s type in
    the precision's dtype (with ``VmapAutocast`` when ``vmapped``), or none for ``"fp32"``."""
    if precision == "fp32":
        return contextlib.nullcontext()
    dtype = AUTOCAST_DTYPES[precision]
    if not vmapped:
        return torch.autocast(device.type, dtype=dtype)
    stack = contextlib.ExitStack()
    stack.enter_context(torch.autocast(device.type, dtype=dtype))
    stack.enter_context(VmapAutocast(dtype, device.type))
    return stack


# autocast's casts by torch function (aten/src/ATen/autocast_mode.cpp): into the low dtype ...
_TO_LOW = frozenset((
    F.conv1d, F.conv2d, F.conv3d, F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d,
    F.linear, F.prelu, F.scaled_dot_product_attention, torch.matmul, torch.Tensor.matmul,
    torch.Tensor.__matmul__, torch.mm, torch.bmm, torch.addmm, torch.baddbmm, torch.addbmm))
# ... into float32: the losses, on the CPU and on CUDA ...
_TO_FLOAT32 = frozenset((
    F.cross_entropy, F.nll_loss, F.mse_loss, F.l1_loss, F.smooth_l1_loss, F.huber_loss, F.kl_div,
    F.binary_cross_entropy, F.binary_cross_entropy_with_logits, F.poisson_nll_loss,
    F.margin_ranking_loss, F.hinge_embedding_loss, F.soft_margin_loss, F.multilabel_margin_loss,
    F.multi_margin_loss, F.triplet_margin_loss, F.cosine_embedding_loss))
# ... and on CUDA also layer and group norm and the softmaxes
_TO_FLOAT32_CUDA = frozenset((F.layer_norm, F.group_norm, F.softmax, F.log_softmax))
# normalisations whose batching rule refuses a low-precision input with float32 parameters:
# computed in float32 and returned in the input's dtype (what the CPU kernels do inside)
_IN_FLOAT32 = frozenset((F.batch_norm, F.instance_norm, F.layer_norm, F.group_norm))


class VmapAutocast(TorchFunctionMode):
    """autocast's casts applied to the arguments of torch functions under ``torch.func.vmap``,
    beside ``torch.autocast``, for ``dtype`` (bfloat16 or float16) on ``device_type``: into
    ``dtype`` for convolutions, linear layers and matrix products, into float32 for losses (on CUDA
    also layer/group norm and softmaxes); normalisations of a low-precision input in float32
    (docs/runtime.md, "Mixed precision", fused learners)."""

    def __init__(self, dtype: torch.dtype, device_type: str) -> None:
        super().__init__()
        self.dtype = dtype
        self.to_float32 = _TO_FLOAT32 | _TO_FLOAT32_CUDA if device_type == "cuda" else _TO_FLOAT32

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in _TO_LOW:
            return func(*_cast(args, self.dtype), **_cast(kwargs, self.dtype))
        if func in self.to_float32:
            return func(*_cast(args, torch.float32), **_cast(kwargs, torch.float32))
        if func in _IN_FLOAT32 and args and isinstance(args[0], torch.Tensor) \
                and args[0].dtype in AUTOCAST_DTYPES.values():
            out = func(args[0].float(), *args[1:], **kwargs)
            return out.to(args[0].dtype)
        return func(*args, **kwargs)


def _cast(tree: Any, dtype: torch.dtype) -> Any:
    """``tree`` with its floating tensors (not float64) in ``dtype``, as autocast casts."""
    return tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point()
                    and t.dtype != torch.float64 and t.dtype != dtype else t, tree)


class LossScales:
    """One dynamic float16 loss scale per replica of a device (torch.amp.GradScaler's rule per
    replica, recomputing instead of skipping a step).

    Attributes:
        scale: ``[m]`` float32 on the CPU, S_j (a power of two, ≥ ``FLOOR``).
        good: ``[m]`` int64 on the CPU, finite steps of replica j since S_j last changed."""

    INIT = 2.0 ** 16
    GROWTH_INTERVAL = 2000
    FLOOR = 1.0

    def __init__(self, m: int) -> None:
        self.scale = torch.full((m,), self.INIT, dtype=torch.float32)
        self.good = torch.zeros(m, dtype=torch.int64)

    def weights(self, r0: int, r1: int, like: torch.Tensor) -> torch.Tensor:
        """S_j of rows ``r0 … r1−1``, ``[r1 − r0]`` in ``like``'s dtype and device."""
        return self.scale[r0:r1].to(device=like.device, dtype=like.dtype)

    @torch.no_grad()
    def settle(self, r0: int, r1: int, losses: torch.Tensor, grads: torch.Tensor) -> bool:
        """After the backward of Σ_j S_j·ℓ_j over rows ``r0 … r1−1``: False, S_j halved, when
        a row's gradient overflowed (its loss finite, S_j > 1); else True, ``grads [r1 − r0, P]``
        divided by S_j in place and S_j doubled after ``GROWTH_INTERVAL`` finite steps. One host
        read."""
        finite = torch.isfinite(grads).all(dim=1).cpu()  # [n]
        loss_ok = torch.isfinite(losses.detach().float()).cpu()  # [n]
        scale, good = self.scale[r0:r1], self.good[r0:r1]  # views
        overflow = ~finite & loss_ok & (scale > self.FLOOR)
        if bool(overflow.any()):
            scale[overflow] = (scale[overflow] * 0.5).clamp_min(self.FLOOR)
            good[overflow] = 0
            return False
        grads.div_(self.weights(r0, r1, grads).unsqueeze(1))
        ok = finite & loss_ok
        good.copy_(torch.where(ok, good + 1, torch.zeros_like(good)))
        grow = good >= self.GROWTH_INTERVAL
        scale[grow] *= 2.0
        good[grow] = 0
        return True

    def resized(self, m: int) -> "LossScales":
        """The scales for ``m`` replicas; a new one starts at the smallest kept scale."""
        out = LossScales(m)
        keep = min(m, self.scale.shape[0])
        out.scale[:keep] = self.scale[:keep]
        out.good[:keep] = self.good[:keep]
        out.scale[keep:] = self.scale[:keep].min()
        return out

    def share_memory(self) -> None:
        """Move ``scale`` and ``good`` to shared memory."""
        self.scale.share_memory_()
        self.good.share_memory_()
