"""The module given to ``compile``, held weakly: checked at the start of every fit, and holding
z after it, in place, so that a plain loop's ``test(model)`` and ``torch.save(model.state_dict())``
see the trained model (docs/api.md, Your model after a fit)."""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn

from ..errors import TrainingInterrupted

if TYPE_CHECKING:
    from .central import CentralModel

__all__ = ["UserModel"]


class UserModel:
    """The user's module behind a plan.

    Args:
        model: the module given to ``compile``.
        template: the plan's copy of it (``Plan.template``), whose trainable parameters are the
            ones the plan trains."""

    def __init__(self, model: nn.Module, template: nn.Module) -> None:
        self._ref = weakref.ref(model)
        self.trained = _trainable(template)  # names of the parameters the plan trains

    @property
    def module(self) -> nn.Module | None:
        """The user's module, or None once the caller dropped it."""
        return self._ref()

    def check_frozen(self) -> None:
        """Refuse a fit when the user's module freezes or unfreezes parameters since ``compile``
        (the plan's set of trained parameters is fixed at compile: its flat layout).

        Raises:
            ValueError: naming the parameters whose ``requires_grad`` changed, and the fix."""
        model = self.module
        if model is None:
            return
        now = _trainable(model)
        frozen = [n for n in self.trained if n not in now]
        thawed = [n for n in now if n not in self.trained]
        if not frozen and not thawed:
            return
        said = []
        if frozen:
            said.append(f"{_names(frozen)} have requires_grad=False now, but the plan trains "
                        "them")
        if thawed:
            said.append(f"{_names(thawed)} have requires_grad=True now, but the plan was "
                        "compiled with them frozen and never changes them")
        raise ValueError(
            f"{type(model).__name__}'s parameters {'; and '.join(said)}: a plan trains the "
            "parameters that required gradients at compile (it trains its own copy of the "
            "model); freeze or unfreeze them before compile. After a fit the model holds the "
            "trained weights, so a head-only phase and then full fine-tuning are two plans: "
            "model.backbone.requires_grad_(False); plan = cg.compile(model, ...); plan.fit(...); "
            "model.backbone.requires_grad_(True); plan2 = cg.compile(model, ..., optimizer="
            "torch.optim.AdamW(model.parameters(), ...)); plan2.fit(...)")

    def around_fit(self, central: CentralModel, run: Callable[[], Any], *, comm: Any,
                   last_round: Callable[[], int]) -> Any:
        """``run()`` (a fit) after ``check_frozen``; the user's module then holds z (``update``):
        the last whole round's when SIGTERM stopped the fit (``TrainingInterrupted``, re-raised),
        else under torchrun with rank 0's integer buffers (of round ``last_round()``)."""
        self.check_frozen()  # ValueError before anything else
        try:
            result = run()
        except TrainingInterrupted:
            self.update(central)
            raise
        if comm is not None:
            central.int_buffers_from_rank0(replicas=False, round_index=last_round())
        self.update(central)
        return result

    @torch.no_grad()
    def update(self, central: CentralModel) -> None:
        """Copy the central model's state (``CentralModel.state``: z, its buffers refreshed)
        into the user's module in place: every entry of its ``state_dict`` of the same name and
        shape (cast to its dtype, moved to its device); nothing, and no refresh, when the caller
        dropped the module."""
        model = self.module
        if model is None:
            return
        state = central.state()
        for name, tensor in model.state_dict(keep_vars=True).items():
            source = state.get(name)
            if source is not None and source.shape == tensor.shape:
                tensor.copy_(source)


def _trainable(module: nn.Module) -> list[str]:
    return [n for n, p in module.named_parameters() if p.requires_grad]


def _names(names: list[str], most: int = 4) -> str:
    shown = ", ".join(repr(n) for n in names[:most])
    return f"{shown} (and {len(names) - most} more)" if len(names) > most else shown
