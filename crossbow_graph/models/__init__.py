"""Model zoo: the models of the CROSSBOW paper, each traceable by torch.fx."""

from __future__ import annotations

from typing import Callable

from torch import nn

from .lenet import LeNet5, lenet5

__all__ = ["LeNet5", "lenet5", "MODELS", "get_model"]

MODELS: dict[str, Callable[..., nn.Module]] = {"lenet5": lenet5}


def get_model(name: str, **kwargs) -> nn.Module:
    """A new model of the zoo by name (see ``MODELS``).

    Raises:
        ValueError: an unknown name; the message lists the known ones.
    """
    if name not in MODELS:
        raise ValueError(f"unknown model '{name}'; the zoo has: {', '.join(sorted(MODELS))}")
    return MODELS[name](**kwargs)
