"""SMA update, torch implementation: the CPU path and the oracle for the Triton kernels.

Both functions work in place on flat per-device buffers (DESIGN.md §4): the m replicas of a device
are the rows of ``w [m, P]``; their momentum is ``v [m, P]``; their gradients ``g [m, P]``; the
device's copy of the central average model is ``z [P]``. ``w``, ``v``, ``z`` are float32 (for a
bfloat16/float16 model they are the fp32 masters, runtime/state.py); ``g`` is in the model's dtype
and is upcast element by element, so a small correction is never rounded away.
"""

from __future__ import annotations

import torch

__all__ = ["sma_local_update", "sma_central_update", "TorchSMAKernels"]


@torch.no_grad()
def sma_local_update(
    w: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    z: torch.Tensor | None,
    *,
    lr: float,
    momentum: float,
    nesterov: bool,
    weight_decay: float,
    alpha: float,
    first_step: bool = False,
) -> torch.Tensor | None:
    """One round's local step and correction for every replica of a device (DESIGN.md §2, steps 1–2).

    With ŵ_j = w[j] (the pre-step point)::

        d_j = g[j] + λ·ŵ_j
        v[j] ← μ_l·v[j] + d_j                    (torch.optim.SGD; on the first step v[j] ← d_j)
        u_j = d_j + μ_l·v[j] if Nesterov else v[j]
        c_j = α·(ŵ_j − z)
        w[j] ← ŵ_j − η·u_j − c_j
        returns acc = Σ_j c_j                     [P]

    Args:
        w: replicas' parameters, ``[m, P]``, updated in place.
        v: replicas' momentum buffers, ``[m, P]``, updated in place (unused if ``momentum == 0``).
        g: replicas' loss gradients at ŵ, ``[m, P]``, float32, bfloat16 or float16 (not modified).
        z: the device's copy of the central average model, ``[P]``; ``None`` (or ``alpha == 0``)
            skips the correction (a round without synchronisation, or k = 1) and returns ``None``.
        lr: learning rate η (per sample-mean loss, as torch.optim.SGD).
        momentum: local momentum μ_l.
        nesterov: Nesterov momentum, as torch.optim.SGD.
        weight_decay: λ (L2 added to the gradient, as torch.optim.SGD).
        alpha: α, the pull toward z.
        first_step: the momentum buffers hold nothing yet (torch.optim.SGD copies d into them).

    Returns:
        ``acc [P]``, the device's sum of corrections, or ``None`` without a correction.
    """
    d = g if weight_decay == 0 else g.add(w, alpha=weight_decay)
    if momentum != 0:
        if first_step:
            v.copy_(d)
        else:
            v.mul_(momentum).add_(d)
        u = d.add(v, alpha=momentum) if nesterov else v
    else:
        u = d
    if z is None or alpha == 0:
        w.add_(u, alpha=-lr)
        return None
    c = torch.sub(w, z).mul_(alpha)  # [m, P], at the pre-step point
    w.add_(u, alpha=-lr).sub_(c)
    return c.sum(dim=0)


@torch.no_grad()
def sma_central_update(
    z: torch.Tensor, z_prev: torch.Tensor, c: torch.Tensor, *, central_momentum: float
) -> None:
    """The central average model's update (DESIGN.md §2, step 3), in place.

    ``z_new = z + c + μ_z·(z − z_prev)``; then ``z_prev ← z`` and ``z ← z_new``.

    Args:
        z: central average model, ``[P]``.
        z_prev: its value before the previous update, ``[P]``.
        c: sum of all learners' corrections over every device and process, ``[P]``.
        central_momentum: μ_z.
    """
    step = c if central_momentum == 0 else c.add(z - z_prev, alpha=central_momentum)
    z_prev.copy_(z)
    z.add_(step)


class TorchSMAKernels:
    """The SMA update backend in torch (CPU default, and the oracle of the Triton backend).

    A backend has two methods with the signatures of ``sma_local_update`` and
    ``sma_central_update``; the scheduler calls nothing else.
    """

    name = "torch"
    local_update = staticmethod(sma_local_update)
    central_update = staticmethod(sma_central_update)
