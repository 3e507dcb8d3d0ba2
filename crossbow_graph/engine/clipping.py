"""Gradient clipping per learner (``fit(max_grad_norm=...)``; docs/optimizers.md, Gradient clipping).

Every learner clips its own gradient g_j, the row ``g[j] [P]`` of its device's flat gradients
(all its trainable parameters: the flat layout holds nothing else, and a row's padding columns
on CUDA lie outside the ``[:, :P]`` view), before its local optimiser's step, as
``torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)`` (``norm_type=2``) clips one
model's gradients:

    scale_j = min(1, max_norm / (‖g_j‖₂ + 1e-6)) ;  g_j ← scale_j · g_j

A group of rows is clipped at once with tensor operations (a row norm, a clamp, a product): no
host read, so the CUDA streams and CUDA-graph rounds run it as they run the rest of the round.
"""

from __future__ import annotations

import torch

__all__ = ["CLIP_EPS", "clip_rows"]

CLIP_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s term in max_norm / (total_norm + eps)


@torch.no_grad()
def clip_rows(g: torch.Tensor, max_norm: float | None) -> None:
    """Clip every row of ``g [n, P]`` in place to a 2-norm of at most ``max_norm``.

    Row j is multiplied by min(1, max_norm / (‖g_j‖₂ + 1e-6)), the factor
    ``torch.nn.utils.clip_grad_norm_`` applies to one model's gradients (source: its foreach
    implementation, torch/nn/utils/clip_grad.py). The norm is computed in float32 for a bfloat16
    or float16 gradient (in the gradient's dtype otherwise). A row holding NaN or Inf stays
    non-finite (its factor is NaN or 0), so the fault monitor still finds it (engine/faults.py).

    Args:
        g: the rows of the learners to clip, ``[n, P]`` (a view of the device's gradients).
        max_norm: the largest 2-norm a row keeps (a positive finite number, checked by
            ``FitOptions``); None: nothing is done.
    """
    if max_norm is None:
        return
    dtype = torch.promote_types(g.dtype, torch.float32)
    norms = torch.linalg.vector_norm(g, dim=1, dtype=dtype)  # [n]
    scale = torch.clamp(max_norm / (norms + CLIP_EPS), max=1.0)  # [n]
    g.mul_(scale.unsqueeze(1))
