"""The SMA update in torch, in place on a device's flat buffers ``w, v, g [m, P]``, ``z [P]``: the
oracle of the C and Triton kernels (docs/kernels.md, Backends). A hyper-parameter is a number or a
0-dim float32 tensor read at run time, whose branch then always runs (``is_on``)."""

from __future__ import annotations

import torch

__all__ = ["sma_local_update", "sma_central_update", "TorchSMAKernels", "BLOCK_BYTES", "Hyper",
           "is_on", "any_tensor"]

BLOCK_BYTES = 1 << 20  # CPU: bytes of each [m, ·] buffer per column block (1 MiB)

Hyper = float | torch.Tensor  # a run-time hyper-parameter: a number or a 0-dim float32 tensor


def any_tensor(*values: Hyper) -> bool:
    """Whether any of these hyper-parameters is a tensor."""
    return any(isinstance(v, torch.Tensor) for v in values)


def is_on(value: Hyper) -> bool:
    """Whether the branch a hyper-parameter controls runs: for a tensor, or a number ≠ 0."""
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
    """One round's local step and correction for every replica of a device, in place
    (docs/design-overview.md §2, steps 1–2). With ŵ_j = w[j] the pre-step point::

        d_j = g[j] + λ·ŵ_j
        v[j] ← μ_l·v[j] + d_j                    (torch.optim.SGD; on the first step v[j] ← d_j)
        u_j = d_j + μ_l·v[j] if Nesterov else v[j]
        c_j = α·(ŵ_j − z)
        w[j] ← ŵ_j − η·u_j − c_j
        returns acc = Σ_j c_j                     [P]

    Args:
        w, v: ``[m, P]`` parameters and momentum (float32, or float64); v unused without momentum.
        g: ``[m, P]`` gradients at ŵ, float32, bfloat16 or float16 (float64 with float64 ``w``).
        z: ``[P]`` the device's central model; None (or α = 0): no correction, returns None.
        lr, momentum, nesterov, weight_decay: η, μ_l, Nesterov, λ as torch.optim.SGD's.
        alpha: α, the pull toward z.
        first_step: the momentum buffers hold nothing yet.
        out: ``[P]`` in ``w``'s dtype to write acc into (default: a new tensor)."""
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
    """Columns per block: all on an accelerator, about ``BLOCK_BYTES`` per buffer on the CPU."""
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
    """``_local_block`` with hyper-parameters that may be 0-dim tensors."""
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
    """``z_new = z + c + μ_z·(z − z_prev)``, then ``z_prev ← z``, ``z ← z_new``, in place, with
    ``z, z_prev, c [P]`` (c: the sum of every learner's correction) and μ_z =
    ``central_momentum`` (docs/design-overview.md §2, step 3)."""
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
    """The ``SMAKernels`` backend in torch: ``sma_local_update`` and ``sma_central_update``."""

    name = "torch"
    block = None
    local_update = staticmethod(sma_local_update)
    central_update = staticmethod(sma_central_update)

    @staticmethod
    def central_update_shared(zs: list[torch.Tensor], z_prevs: list[torch.Tensor],
                              parts: list[torch.Tensor], *, central_momentum: float) -> bool:
        """Declined: False (the scheduler sums and updates in torch)."""
        return False

    @staticmethod
    def nonfinite_rows(g: torch.Tensor) -> list[int] | None:
        """Declined: None (engine/learning/faults.py tests the rows in torch)."""
        return None
