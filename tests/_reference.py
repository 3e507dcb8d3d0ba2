"""Eager PyTorch oracles of the test suite: one learner's optimizer steps, SMA by the book
(docs/design-overview.md §2) one parameter tensor at a time, DiLoCo and EASGD by hand, and the helpers that
flatten models and split data sets as the plans do."""

from __future__ import annotations

import copy
import math
from typing import Callable, Iterable, NamedTuple

import torch
from torch import nn
from torch.utils.data import TensorDataset

__all__ = ["flat", "batches_of", "EagerRun", "eager_steps", "default_alpha", "reference_sma",
           "reference_diloco", "reference_easgd", "rule_lrs"]


def flat(tensors: nn.Module | Iterable[torch.Tensor]) -> torch.Tensor:
    """A sequence of tensors as one 1-D tensor; for a module, its parameters that require grad in
    ``parameters()`` order (the layout of a plan's ``central_weights()``)."""
    if isinstance(tensors, nn.Module):
        tensors = [p for p in tensors.parameters() if p.requires_grad]
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def batches_of(dataset: TensorDataset, batch_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The data set's consecutive batches ``(x, y)`` of ``batch_size`` samples in its order (a plan's
    order with ``shuffle=False``); a last partial batch is dropped."""
    x, y = dataset.tensors
    return [(x[i:i + batch_size], y[i:i + batch_size])
            for i in range(0, len(x) - batch_size + 1, batch_size)]


class EagerRun(NamedTuple):
    """What ``eager_steps`` returns: ``weights[t]`` = ``flat(model)`` after step t; ``grad_norms[t]``
    = step t's gradient norm before clipping (empty without ``max_grad_norm``)."""

    weights: list[torch.Tensor]
    grad_norms: list[float]


def eager_steps(model: nn.Module, optimizer: torch.optim.Optimizer | Callable, batches, *,
                loss_fn=torch.nn.functional.cross_entropy, max_grad_norm: float | None = None,
                lr_scheduler: Callable | None = None) -> EagerRun:
    """One learner in plain PyTorch, the model in the mode it is in: for each ``(x, y)`` of
    ``batches`` in order, zero_grad, ``loss_fn(model(x), y).backward()``, ``clip_grad_norm_`` to
    ``max_grad_norm`` (if given), ``optimizer.step()``, then ``lr_scheduler.step()`` (if given).

    ``optimizer``: a torch.optim optimizer over ``model``'s parameters, or a function of the model
    that builds one; ``lr_scheduler``: a function of the optimizer that builds an LR scheduler.
    """
    opt = optimizer if isinstance(optimizer, torch.optim.Optimizer) else optimizer(model)
    scheduler = lr_scheduler(opt) if lr_scheduler is not None else None
    run = EagerRun([], [])
    for x, y in batches:
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        if max_grad_norm is not None:
            run.grad_norms.append(float(nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)))
        opt.step()
        if scheduler is not None:
            scheduler.step()
        run.weights.append(flat(model))
    return run


def default_alpha(k: int, central_momentum: float = 0.9) -> float:
    """SMA's default α by the book: 0.8 of the pull's stability bound 2(1 + μ_z)/(1 + k + μ_z),
    at least 0.5 (docs/design-overview.md §2); 0 for k = 1."""
    return 0.0 if k == 1 else max(0.8 * 2 * (1 + central_momentum) / (1 + k + central_momentum), 0.5)


def default_centre_rate(k: int, alpha: float, central_momentum: float = 0.9) -> float:
    """SMA's default β (z's rate toward the replicas' mean) at the default α by the book: k·α, at
    most 0.8 of its bound (1 + μ_z)(2 − α) (docs/design-overview.md §2)."""
    return min(k * alpha, 0.8 * (1 + central_momentum) * (2 - alpha))


def reference_sma(model: nn.Module, batches, *, lr: float, momentum: float, k: int | None = None,
                  rounds: int | None = None, ks: list[int] | None = None, weight_decay: float = 0.0,
                  nesterov: bool = False, alpha: float | None = None, central_momentum: float = 0.9,
                  loss_fn=torch.nn.functional.cross_entropy, max_grad_norm: float | None = None,
                  frozen: tuple[int, ...] = (), scale_lr: bool = True,
                  epoch_samples: int | None = None, centre_rate: float | None = None):
    """Run SMA by the book (docs/design-overview.md §2) on copies of ``model``.

    Round t has ``ks[t]`` learners (or ``k`` learners in each of ``rounds`` rounds); its learners
    take the next batches of ``batches`` (a list of ``(x, y)``): learner j of round t takes
    ``batches[ks[0] + … + ks[t-1] + j]``. Each learner steps SGD (``weight_decay``, ``momentum``,
    ``nesterov`` as torch.optim.SGD) plus the correction α(w − z), α = 0.8·2(1 + μ_z)/(1 + k + μ_z)
    (0.8 of the pull's stability bound, at least 0.5) unless ``alpha`` is given (0 for k = 1, where
    z follows the single replica); z moves by β·(the replicas' mean − z) plus
    ``central_momentum``·(z − z_prev), β = ``centre_rate``, else ``default_centre_rate`` with the
    default α and k·α (the sum of the corrections) with ``alpha`` given. When k grows, new replicas are z with zero momentum; when it
    shrinks, the last replicas go. ``max_grad_norm``: each learner's gradient clipped by
    ``torch.nn.utils.clip_grad_norm_`` before its step. ``frozen``: replicas that neither learn nor
    are corrected (they keep their weights, their batches go unused; α's k still counts them).
    ``scale_lr``: SMA's η rule (design-overview §2): round t steps at ``lr``·f_t, f moving
    linearly from the factor in force (1 at the start) to √min(k, 16) over a quarter of
    ``epoch_samples`` (default: every sample of ``batches``) after every change of k.

    Returns (z, replicas): z as a list of tensors in ``parameters()`` order (those that require
    grad), and the last round's replicas as modules.
    """
    if ks is None:
        ks = [k] * rounds
    replicas = [copy.deepcopy(model)]
    params = [[p for p in replicas[0].parameters() if p.requires_grad]]
    z = [p.detach().clone() for p in params[0]]
    z_prev = [t.clone() for t in z]
    bufs = [[None] * len(z)]
    pos = 0
    etas = rule_lrs(lr, ks, len(batches[0][1]), epoch_samples or len(batches) * len(batches[0][1])) \
        if scale_lr else [lr] * len(ks)
    for k, lr in zip(ks, etas):
        while len(replicas) < k:  # a new replica: z, zero momentum
            r = copy.deepcopy(model)
            ps = [p for p in r.parameters() if p.requires_grad]
            with torch.no_grad():
                for p, zi in zip(ps, z):
                    p.copy_(zi)
            replicas.append(r)
            params.append(ps)
            bufs.append([None] * len(z))
        del replicas[k:], params[k:], bufs[k:]
        a = default_alpha(k, central_momentum) if alpha is None else (0.0 if k == 1 else alpha)
        beta = centre_rate if centre_rate is not None else \
            default_centre_rate(k, a, central_momentum) if alpha is None else k * a
        offsets = [torch.zeros_like(q) for q in z]  # Σ_j (ŵ_j − z)
        for j, r in enumerate(replicas):
            if j in frozen:
                continue
            x, y = batches[pos + j]
            r.zero_grad(set_to_none=True)
            loss_fn(r(x), y).backward()
            if max_grad_norm is not None:
                nn.utils.clip_grad_norm_(params[j], max_grad_norm)
            with torch.no_grad():
                for i, p in enumerate(params[j]):
                    g = p.grad if p.grad is not None else torch.zeros_like(p)
                    d = g + weight_decay * p
                    if momentum:
                        bufs[j][i] = d.clone() if bufs[j][i] is None else momentum * bufs[j][i] + d
                        u = d + momentum * bufs[j][i] if nesterov else bufs[j][i]
                    else:
                        u = d
                    offsets[i] += p - z[i]
                    p.sub_(lr * u + a * (p - z[i]))
        pos += k
        with torch.no_grad():
            if k == 1:
                z_prev = z
                z = [p.detach().clone() for p in params[0]]
            else:
                new = [zi + (beta / k) * oi + central_momentum * (zi - zpi)
                       for zi, oi, zpi in zip(z, offsets, z_prev)]
                z_prev, z = z, new
    return z, replicas


def rule_lrs(lr: float, ks: list[int], b: int, epoch_samples: int) -> list[float]:
    """η of each round under SMA's η rule, by hand: ``lr``·f, f = √min(k, 16) reached linearly
    over round(epoch_samples / 4) samples from the value in force when k changed."""
    ramp = max(1, round(0.25 * epoch_samples))
    out, f, k_was, start, origin, target, done = [], 1.0, None, 0, 1.0, 1.0, 0
    for k in ks:
        if k != k_was:
            k_was, start, origin, target = k, done, f, math.sqrt(min(k, 16))
        frac = min(1.0, (done - start) / ramp)
        f = target if frac >= 1.0 else origin + (target - origin) * frac
        out.append(lr if f == 1.0 else lr * f)
        done += k * b
    return out


def reference_diloco(model: nn.Module, batches, *, k: int, rounds: int, H: int, inner, outer,
                     max_grad_norm: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """DiLoCo (Douillard et al. 2023, Algorithm 1) by hand: k model copies, each with its own
    ``inner(params)`` optimizer, learner j taking ``batches[t·k + j]`` (a list of ``(x, y)``) in
    round t; after every H-th round Δ = z − mean_j w_j is the gradient of ``outer([z])``, and
    every copy restarts from z with its optimizer state kept; ``max_grad_norm``: each copy's
    gradient clipped by ``torch.nn.utils.clip_grad_norm_`` before its step. Cross-entropy loss.
    Returns (z ``[P]``, the replicas ``[k, P]``)."""
    copies = [copy.deepcopy(model) for _ in range(k)]
    inners = [inner(c.parameters()) for c in copies]
    z = [p.detach().clone() for p in model.parameters()]
    outer_opt = outer(z)
    for t in range(rounds):
        for j, (c, opt) in enumerate(zip(copies, inners)):
            x, y = batches[t * k + j]
            opt.zero_grad()
            torch.nn.functional.cross_entropy(c(x), y).backward()
            if max_grad_norm is not None:
                nn.utils.clip_grad_norm_(c.parameters(), max_grad_norm)
            opt.step()
        if (t + 1) % H == 0:
            with torch.no_grad():
                for i, zi in enumerate(z):
                    zi.grad = zi - torch.stack([list(c.parameters())[i] for c in copies]).mean(0)
                outer_opt.step()
                for c in copies:
                    for p, zi in zip(c.parameters(), z):
                        p.copy_(zi)
    return flat(z), torch.stack([flat(c) for c in copies])


def reference_easgd(model: nn.Module, batches, *, k: int, rounds: int, lr: float, momentum: float,
                    alpha: float, beta: float, tau: int = 1,
                    loss_fn=torch.nn.functional.cross_entropy):
    """Synchronous EASGD by the paper (Zhang, Choromanska and LeCun 2015, eqs. 5–6) on copies of
    ``model``, k learners: in round t learner j takes ``batches[t·k + j]`` and steps SGD
    (``momentum`` as torch.optim.SGD) from x_j; in every τ-th round also the elastic terms from
    the same x_j and the centre x̃: x_j ← x_j − η·u_j − α·(x_j − x̃), x̃ ← x̃ + β·(mean_j x_j − x̃).
    Returns (x̃ as a list of tensors, the replicas as modules)."""
    replicas = [copy.deepcopy(model) for _ in range(k)]
    params = [[p for p in r.parameters() if p.requires_grad] for r in replicas]
    centre = [p.detach().clone() for p in params[0]]
    velocity = [[None] * len(centre) for _ in range(k)]
    for t in range(rounds):
        elastic = (t + 1) % tau == 0
        before = [[p.detach().clone() for p in ps] for ps in params]  # x_j of the round
        for j, r in enumerate(replicas):
            x, y = batches[t * k + j]
            r.zero_grad(set_to_none=True)
            loss_fn(r(x), y).backward()
            with torch.no_grad():
                for i, p in enumerate(params[j]):
                    g = p.grad
                    if momentum:
                        v = velocity[j][i]
                        velocity[j][i] = g.clone() if v is None else momentum * v + g
                        g = velocity[j][i]
                    p.sub_(lr * g)
                    if elastic:
                        p.sub_(alpha * (before[j][i] - centre[i]))
        if elastic:
            with torch.no_grad():
                centre = [c + beta * (sum(b[i] for b in before) / k - c) for i, c in enumerate(centre)]
    return centre, replicas
