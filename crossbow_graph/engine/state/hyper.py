"""A round's hyper-parameters: one snapshot of the run settings, taken once per round, that the
local and global updates read (``Hyper``; docs/design-overview.md §5, Run settings)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from .optim import LocalOptimizer

__all__ = ["Hyper"]


@dataclass(frozen=True)
class Hyper:
    """The hyper-parameters of one round, as the updates read them.

    Attributes:
        groups: per param group of the local optimizer, its ``hyper_keys`` → the value in force
            (η as ``"lr"``, momentum, weight decay, betas, ...): what the row optimizers step with.
        lr, momentum, weight_decay, nesterov: the first group as the SGD kernels take it (η, μ_l,
            λ; 0 where the optimizer has no such key).
        alpha: α of the round's local updates (the algorithm's, for the round's k).
        central_momentum: μ_z of the central update (0 where z moves otherwise).
        centre_gain: γ, the share of the corrections' sum C that moves z (z ← z + γ·C + ...;
            1 in CROSSBOW's update, ``SMA.centre_gain``)."""

    groups: tuple[dict[str, Any], ...]
    lr: float
    momentum: float
    weight_decay: float
    nesterov: bool
    alpha: float
    central_momentum: float
    centre_gain: float = 1.0

    @classmethod
    def of(cls, optimizer: LocalOptimizer, *, alpha: float, central_momentum: float,
           centre_gain: float = 1.0) -> "Hyper":
        """The snapshot of ``optimizer``'s param groups now, with α, μ_z and γ; each group's lr
        times ``optimizer.lr_factor`` (SMA's η rule, training/sma_lr.py; the groups untouched)."""
        groups = tuple({k: optimizer.round_hyper(g, k) for k in optimizer.hyper_keys}
                       for g in optimizer.optimizer.param_groups)
        return cls.from_groups(groups, optimizer, alpha=alpha, central_momentum=central_momentum,
                               centre_gain=centre_gain)

    @classmethod
    def from_groups(cls, groups: tuple[dict[str, Any], ...], optimizer: LocalOptimizer, *,
                    alpha: float, central_momentum: float, centre_gain: float = 1.0) -> "Hyper":
        g0, first = groups[0], optimizer.optimizer.param_groups[0]
        return cls(groups, float(g0["lr"]), float(g0.get("momentum", 0.0)),
                   float(g0.get("weight_decay", 0.0)), bool(first.get("nesterov", False)),
                   float(alpha), float(central_momentum), float(centre_gain))

    def kernel_args(self, correction: bool) -> dict[str, Any]:
        """The SGD kernels' ``lr``, ``momentum``, ``weight_decay`` and ``alpha`` (0 without the
        correction)."""
        return {"lr": self.lr, "momentum": self.momentum, "weight_decay": self.weight_decay,
                "alpha": self.alpha if correction else 0.0}

    def central(self) -> Any:
        """μ_z as the central update kernel takes it."""
        return self.central_momentum

    def gain(self) -> Any:
        """γ as the central update takes it (1: C as summed)."""
        return self.centre_gain

    # a worker process receives the snapshot as numbers (engine/backends/process/)
    def vector(self) -> list[float]:
        """α, μ_z, γ, then every group's values in key order (tuples element by element)."""
        out = [self.alpha, self.central_momentum, self.centre_gain]
        for g in self.groups:
            for v in g.values():
                out.extend(float(x) for x in v) if isinstance(v, tuple) else out.append(float(v))
        return out

    @classmethod
    def from_vector(cls, values: Sequence[float], optimizer: LocalOptimizer) -> "Hyper":
        """The snapshot whose ``vector()`` is ``values``, its groups shaped as ``optimizer``'s."""
        it = iter(values)
        alpha, central_momentum, centre_gain = next(it), next(it), next(it)
        groups = tuple({k: tuple(next(it) for _ in g[k]) if isinstance(g[k], tuple) else next(it)
                        for k in optimizer.hyper_keys} for g in optimizer.optimizer.param_groups)
        return cls.from_groups(groups, optimizer, alpha=alpha, central_momentum=central_momentum,
                               centre_gain=centre_gain)

    @staticmethod
    def vector_size(optimizer: LocalOptimizer) -> int:
        """Length of ``vector()`` for ``optimizer``'s groups."""
        return 3 + sum(len(g[k]) if isinstance(g[k], tuple) else 1
                       for g in optimizer.optimizer.param_groups for k in optimizer.hyper_keys)
