"""A hand-written SMA reference (docs/design-overview.md §2): eager modules, one parameter tensor at a time."""

from __future__ import annotations

import copy

import torch


def reference_sma(model, batches, *, k, rounds, lr, momentum, weight_decay=0.0, nesterov=False,
                  alpha=None, central_momentum=0.9, loss_fn=torch.nn.functional.cross_entropy):
    """Run SMA by the book; ``batches[t * k + j]`` is learner j's ``(x, y)`` in round t.

    Returns (z, replicas): z as a list of tensors in named_parameters() order, and the k modules.
    """
    replicas = [copy.deepcopy(model) for _ in range(k)]
    params = [[p for p in r.parameters() if p.requires_grad] for r in replicas]
    z = [p.detach().clone() for p in params[0]]
    z_prev = [t.clone() for t in z]
    bufs = [[None] * len(z) for _ in range(k)]
    a = 0.0 if k == 1 else (1.0 / k if alpha is None else alpha)
    for t in range(rounds):
        corrections = [torch.zeros_like(q) for q in z]
        for j, r in enumerate(replicas):
            x, y = batches[t * k + j]
            r.zero_grad(set_to_none=True)
            loss_fn(r(x), y).backward()
            with torch.no_grad():
                for i, p in enumerate(params[j]):
                    g = p.grad if p.grad is not None else torch.zeros_like(p)
                    d = g + weight_decay * p
                    if momentum:
                        bufs[j][i] = d.clone() if bufs[j][i] is None else momentum * bufs[j][i] + d
                        u = d + momentum * bufs[j][i] if nesterov else bufs[j][i]
                    else:
                        u = d
                    c = a * (p - z[i])
                    corrections[i] += c
                    p.sub_(lr * u + c)
        with torch.no_grad():
            if k == 1:
                z_prev = z
                z = [p.detach().clone() for p in params[0]]
            else:
                new = [zi + ci + central_momentum * (zi - zpi) for zi, ci, zpi in zip(z, corrections, z_prev)]
                z_prev, z = z, new
    return z, replicas


def flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1) for t in tensors])
