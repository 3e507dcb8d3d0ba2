"""Gradient clipping per learner, each row of the flat gradients on its own
(``fit(max_grad_norm=...)``; docs/optimizers.md, Gradient clipping)."""

from __future__ import annotations

import torch

__all__ = ["CLIP_EPS", "clip_rows"]

CLIP_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s term in max_norm / (total_norm + eps)


@torch.no_grad()
def clip_rows(g: torch.Tensor, max_norm: float | None) -> None:
    """Clip every row of ``g [n, P]`` in place: g_j ← g_j · min(1, ``max_norm`` / (‖g_j‖₂ + 1e-6)),
    as ``torch.nn.utils.clip_grad_norm_`` (torch/nn/utils/clip_grad.py) clips one model's
    gradients; the norm in float32 for bfloat16/float16 rows; no host read; a non-finite row stays
    non-finite. ``max_norm`` None: nothing is done."""
    if max_norm is None:
        return
    dtype = torch.promote_types(g.dtype, torch.float32)
    norms = torch.linalg.vector_norm(g, dim=1, dtype=dtype)  # [n]
    scale = torch.clamp(max_norm / (norms + CLIP_EPS), max=1.0)  # [n]
    g.mul_(scale.unsqueeze(1))
