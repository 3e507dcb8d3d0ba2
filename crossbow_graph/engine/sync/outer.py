"""DiLoCo's outer optimizer over the central model z (docs/design-overview.md §2, "Outer
optimizers"; Douillard et al. 2023, Algorithm 1; torchft's ``DiLoCo``).

``DiLoCo.bind`` builds the named torch.optim optimizer once over a leaf ``[P]`` sharing the
storage of the first device's z; at every outer sync ``DiLoCo.global_update`` sets
Δ = z − mean_j w_j as its ``grad`` and steps, writing z in place (the other devices copy it).
Every rank steps on the same all-reduced Δ; checkpoints hold its ``state_dict``."""

from __future__ import annotations

from typing import Any, Callable

import torch

from .base import SyncState

__all__ = ["OuterOptimizer"]


class OuterOptimizer(SyncState):
    """The outer optimizer of ``sync=DiLoCo(...)``: a torch.optim optimizer over ``[z]``.

    Args:
        factory: ``DiLoCo.outer_optimizer``, called once with ``[z_param]``.
        z: the first device's central model ``[P]`` (float32 masters, or float64).

    Attributes:
        optimizer: what ``factory`` built (its ``param_groups`` hold lr, momentum, ...).
        z_param: the leaf tensor ``[P]`` it optimises, a view of ``z``'s storage.
        state_class: the optimizer's class (``"torch.optim.sgd.SGD"``), what checkpoints name.

    Raises:
        TypeError: calling ``factory`` raised TypeError, it returned something other than a
            torch.optim optimizer, an optimizer over other tensors than ``[z_param]``, or one
            that needs a closure (LBFGS).
        ValueError: calling ``factory`` raised ValueError (e.g. torch.optim's "Invalid
            learning rate")."""

    def __init__(self, factory: Callable[[list[torch.Tensor]], torch.optim.Optimizer],
                 z: torch.Tensor) -> None:
        self.z_param = torch.nn.Parameter(z, requires_grad=False)  # shares z's storage
        example = "e.g. functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)"
        try:
            opt = factory([self.z_param])
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"DiLoCo(outer_optimizer={factory!r}): calling it with [z] raised "
                            f"{type(exc).__name__}: {exc}; pass a factory of a torch.optim "
                            f"optimizer, {example}") from exc
        if not isinstance(opt, torch.optim.Optimizer):
            raise TypeError(f"DiLoCo(outer_optimizer={factory!r}) returned "
                            f"{type(opt).__name__}, not a torch.optim optimizer; {example}")
        params = [p for g in opt.param_groups for p in g["params"]]
        if len(params) != 1 or params[0] is not self.z_param:
            raise TypeError(f"DiLoCo(outer_optimizer=...) built {type(opt).__name__} over "
                            f"{len(params)} other tensor(s); it must optimise the list it is "
                            f"called with ([z]), {example}")
        if isinstance(opt, torch.optim.LBFGS):
            raise TypeError("DiLoCo(outer_optimizer=LBFGS): LBFGS re-evaluates a loss through a "
                            "closure, and the outer step has only a pseudo-gradient; use SGD "
                            "(Nesterov) or Adam")
        self.optimizer = opt
        self.state_class = f"{type(opt).__module__}.{type(opt).__qualname__}"

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The optimizer's param groups (lr, momentum, ...; a resumed fit may choose anew)."""
        return self.optimizer.param_groups

    @torch.no_grad()
    def step(self, z: torch.Tensor, delta: torch.Tensor) -> None:
        """One outer step: ``z.grad = delta`` (Δ ``[P]``, z's dtype and device), then the
        optimizer's ``step``, which moves ``z`` in place."""
        if self.z_param.data_ptr() != z.data_ptr():  # z's storage was replaced: follow it
            self.z_param.data = z
        self.z_param.grad = delta
        self.optimizer.step()
        self.z_param.grad = None

    def describe(self) -> dict[str, Any]:
        """The class and every group's settings (plain values): the summary, the torchrun
        agreement."""
        groups = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()
                   if k != "params" and (v is None or isinstance(v, (bool, int, float, str, tuple)))}
                  for g in self.optimizer.param_groups]
        return {"class": self.state_class, "groups": groups}

    def state_dict(self) -> dict[str, Any]:
        """torch.optim's ``state_dict()`` (momentum buffers, steps, group settings), tensors as
        CPU copies."""
        sd = self.optimizer.state_dict()
        state = {i: {k: (t.detach().cpu().clone() if isinstance(t, torch.Tensor) else t)
                     for k, t in per_param.items()} for i, per_param in sd["state"].items()}
        return {"state": state, "param_groups": sd["param_groups"]}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """Restore ``state_dict()`` (torch.optim moves the tensors to z's device and dtype).

        Raises:
            ValueError: the saved state is of another optimizer (other groups or parameters)."""
        self.optimizer.load_state_dict(saved)
