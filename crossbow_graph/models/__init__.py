"""Model zoo: ``MODELS`` (name → factory) and ``INPUT_SHAPES`` (name → one sample's shape) of the
models of the CROSSBOW paper, each traceable by torch.fx (docs/compiler.md §7); ``gpt`` (a small
decoder-only transformer of token inputs, models/gpt.py) with its loss ``lm_loss`` and metric
``token_accuracy``."""

from __future__ import annotations

from typing import Callable

from torch import nn

from .gpt import GPT, gpt, lm_loss, token_accuracy
from .lenet import LeNet5, lenet5
from .resnet import CifarResNet, ResNet50, resnet32, resnet50
from .vgg import VGG16BN, vgg16

__all__ = ["LeNet5", "CifarResNet", "ResNet50", "VGG16BN", "GPT", "lenet5", "resnet32", "resnet50",
           "vgg16", "gpt", "lm_loss", "token_accuracy", "MODELS", "INPUT_SHAPES", "get_model", "input_shape"]

MODELS: dict[str, Callable[..., nn.Module]] = {
    "lenet5": lenet5,      # MNIST, 61,706 parameters
    "resnet32": resnet32,  # CIFAR-10, 464,154 parameters
    "vgg16": vgg16,        # CIFAR-100, 15,038,116 parameters
    "resnet50": resnet50,  # ImageNet, 25,557,032 parameters
}

#: One sample's input shape ``(C, H, W)`` per zoo model.
INPUT_SHAPES: dict[str, tuple[int, ...]] = {
    "lenet5": (1, 28, 28),
    "resnet32": (3, 32, 32),
    "vgg16": (3, 32, 32),
    "resnet50": (3, 224, 224),
}


def get_model(name: str, **kwargs) -> nn.Module:
    """A new model of the zoo by name; ValueError listing the known names for another."""
    if name not in MODELS:
        raise ValueError(f"unknown model '{name}'; the zoo has: {', '.join(sorted(MODELS))}")
    return MODELS[name](**kwargs)


def input_shape(name: str) -> tuple[int, ...]:
    """One input sample's shape of zoo model ``name``; ValueError listing the known names."""
    if name not in INPUT_SHAPES:
        raise ValueError(f"unknown model '{name}'; the zoo has: {', '.join(sorted(INPUT_SHAPES))}")
    return INPUT_SHAPES[name]
