"""SMA update, torch implementation: the CPU path and the oracle for the Triton kernels.

Both functions work in place on flat per-device buffers (docs/design-overview.md §4): the m
replicas of a device are the rows of ``w [m, P]``; their momentum is ``v [m, P]``; their gradients
``g [m, P]``; the device's copy of the central average model is ``z [P]``. ``w``, ``v``, ``z`` are float32 (for a
bfloat16/float16 model they are the fp32 masters, engine/state.py), or float64 for a float64
model; ``g`` is in the model's dtype and is upcast element by element, so a small correction is
never rounded away.

The run-time hyper-parameters (η, μ_l, λ, α, μ_z) are Python numbers or 0-dim float32 tensors on
the buffers' device: a tensor is read by the operations at run time (a CUDA graph that captured
them reads its current value at every replay), and the branch it controls (momentum, weight
decay, the correction) is taken whatever its value; give the number 0 to leave a branch out.

On the CPU both go over P in column blocks of about BLOCK_BYTES of each ``[m, ·]`` buffer — the
blocking of the Triton kernels — so that a block's temporaries stay in cache instead of streaming
``[m, P]`` through memory once per operation (bench/sma_kernel.py measures it).
"""

from __future__ import annotations

import torch

__all__ = ["sma_local_update", "sma_central_update", "TorchSMAKernels", "BLOCK_BYTES", "Hyper",
           "is_on", "any_tensor"]

BLOCK_BYTES = 1 << 20  # CPU: bytes of each [m, ·] buffer per column block (1 MiB)

Hyper = float | torch.Tensor  # a run-time hyper-parameter: a number or a 0-dim float32 tensor


def any_tensor(*values: Hyper) -> bool:
    """Whether any of these hyper-parameters is a tensor (read on the device at run time)."""
    return any(isinstance(v, torch.Tensor) for v in values)


def is_on(value: Hyper) -> bool:
    """Whether the branch a hyper-parameter controls runs: a tensor always (its value is read on
    the device, never on the host), a number when it is not 0."""
    return isinstance(value, torch.Tensor) or value != 0


@torch.no_grad()
def sma_local_update(
    w: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    z: torch.Tensor | None,
    *,
    lr: Hyper,
    momentum: Hyper,
    nesterov: bool,
    weight_decay: Hyper,
    alpha: Hyper,
    first_step: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """One round's local step and correction for every replica of a device
    (docs/design-overview.md §2, steps 1–2).

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
        g: replicas' loss gradients at ŵ, ``[m, P]``, float32, bfloat16 or float16 (float64 with
            float64 ``w``; not modified).
        z: the device's copy of the central average model, ``[P]``; ``None`` (or ``alpha == 0``)
            skips the correction (a round without synchronisation, or k = 1) and returns ``None``.
        lr: learning rate η (per sample-mean loss, as torch.optim.SGD).
        momentum: local momentum μ_l.
        nesterov: Nesterov momentum, as torch.optim.SGD.
        weight_decay: λ (L2 added to the gradient, as torch.optim.SGD).
        alpha: α, the pull toward z.
        first_step: the momentum buffers hold nothing yet (torch.optim.SGD copies d into them).
        out: ``[P]`` in ``w``'s dtype to write acc into (default: a new tensor).

    ``lr``, ``momentum``, ``weight_decay`` and ``alpha`` may be 0-dim float32 tensors on ``w``'s
    device (this module's docstring): the same equations, read at run time.

    Returns:
        ``acc [P]``, the device's sum of corrections, or ``None`` without a correction.
    """
    m, P = w.shape
    correct = z is not None and is_on(alpha)
    acc = (out if out is not None else torch.empty(P, dtype=w.dtype, device=w.device)) if correct else None
    step = _block_columns(w, m)
    for a in range(0, P, step):
        b = min(a + step, P)
        _local_block(w[:, a:b], v[:, a:b], g[:, a:b], z[a:b] if correct else None,
                     acc[a:b] if correct else None, lr=lr, momentum=momentum, nesterov=nesterov,
                     weight_decay=weight_decay, alpha=alpha, first_step=first_step)
    return acc


def _block_columns(w: torch.Tensor, m: int) -> int:
    """Columns per block: all of them on an accelerator (one launch per op); on the CPU about
    BLOCK_BYTES of each ``[m, ·]`` buffer, so a block's temporaries stay in cache."""
    if w.device.type != "cpu":
        return max(1, w.shape[1])
    return max(1024, BLOCK_BYTES // (w.element_size() * m))


def _local_block(w, v, g, z, acc, *, lr, momentum, nesterov, weight_decay, alpha, first_step):
    # as few passes over the [m, n] block as the equations allow (each costs about as much as the
    # arithmetic on this CPU): v in one fused add, c_j = α·e_j folded into w's update and acc
    if any_tensor(lr, momentum, weight_decay, alpha):
        _local_block_read(w, v, g, z, acc, lr=lr, momentum=momentum, nesterov=nesterov,
                          weight_decay=weight_decay, alpha=alpha, first_step=first_step)
        return
    d = g if weight_decay == 0 else g.add(w, alpha=weight_decay)
    if momentum != 0:
        if first_step:
            v.copy_(d)
        else:
            torch.add(d, v, alpha=momentum, out=v)  # v ← μ_l·v + d
        u = d.add(v, alpha=momentum) if nesterov else v
    else:
        u = d
    if z is None:
        w.add_(u, alpha=-lr)
        return
    e = torch.sub(w, z)  # ŵ_j − z, [m, n], at the pre-step point
    w.add_(u, alpha=-lr).add_(e, alpha=-alpha)  # ŵ_j − η·u_j − c_j
    m = e.shape[0]
    if m > 4:  # acc = Σ_j c_j = α·Σ_j e_j; a few rows add faster than a reduction over dim 0
        torch.sum(e, dim=0, out=acc)
    elif m == 1:
        acc.copy_(e[0])
    else:
        torch.add(e[0], e[1], out=acc)
        for j in range(2, m):
            acc.add_(e[j])
    acc.mul_(alpha)


def _local_block_read(w, v, g, z, acc, *, lr, momentum, nesterov, weight_decay, alpha,
                      first_step):
    """``_local_block`` with hyper-parameters that may be 0-dim tensors (read at run time): the
    same equations, each product its own operation (no Python number is baked in)."""
    d = g if not is_on(weight_decay) else g + weight_decay * w
    if is_on(momentum):
        if first_step:
            v.copy_(d)
        else:
            v.mul_(momentum).add_(d)  # v ← μ_l·v + d
        u = d + momentum * v if nesterov else v
    else:
        u = d
    if z is None:
        w.sub_(lr * u)
        return
    e = torch.sub(w, z)  # ŵ_j − z, [m, n]
    w.sub_(lr * u).sub_(alpha * e)
    torch.sum(e, dim=0, out=acc)
    acc.mul_(alpha)


@torch.no_grad()
def sma_central_update(
    z: torch.Tensor, z_prev: torch.Tensor, c: torch.Tensor, *, central_momentum: Hyper
) -> None:
    """The central average model's update (docs/design-overview.md §2, step 3), in place.

    ``z_new = z + c + μ_z·(z − z_prev)``; then ``z_prev ← z`` and ``z ← z_new``.

    Args:
        z: central average model, ``[P]``.
        z_prev: its value before the previous update, ``[P]``.
        c: sum of all learners' corrections over every device and process, ``[P]``.
        central_momentum: μ_z, a number or a 0-dim float32 tensor on z's device.
    """
    P = z.shape[0]
    n = _block_columns(z.view(1, P), 1)
    for a in range(0, P, n):
        zb, zpb, cb = z[a:a + n], z_prev[a:a + n], c[a:a + n]
        if not is_on(central_momentum):
            zpb.copy_(zb)
            zb.add_(cb)
            continue
        moved = torch.lerp(zb, zpb, -central_momentum)  # z + μ_z·(z − z_prev), one pass
        zpb.copy_(zb)
        torch.add(moved, cb, out=zb)


class TorchSMAKernels:
    """The SMA update backend in torch (a ``kernels.protocol.SMAKernels``): the oracle of the C
    and Triton backends, and the CPU's backend when no C compiler is there.

    ``local_update`` and ``central_update`` are ``sma_local_update`` and ``sma_central_update``;
    the fused passes are the C backend's: ``central_update_shared`` declines (False) and
    ``nonfinite_rows`` leaves the rows to the caller's torch test (None).
    """

    name = "torch"
    block = None
    local_update = staticmethod(sma_local_update)
    central_update = staticmethod(sma_central_update)

    @staticmethod
    def central_update_shared(zs: list[torch.Tensor], z_prevs: list[torch.Tensor],
                              parts: list[torch.Tensor], *, central_momentum: float) -> bool:
        """No one-pass update here: False (the scheduler sums and updates in torch)."""
        return False

    @staticmethod
    def nonfinite_rows(g: torch.Tensor) -> list[int] | None:
        """No row test here: None (engine/faults.py tests the rows in torch)."""
        return None
