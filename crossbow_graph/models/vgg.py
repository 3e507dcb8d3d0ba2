"""VGG-16 with batch normalisation for CIFAR-100 (Simonyan & Zisserman 2015, configuration D;
batch norm and the 512-wide classifier of Zagoruyko's CIFAR VGG, "92.45% on CIFAR-10 in Torch", 2015)."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["VGG16BN", "vgg16", "VGG16_CONFIG"]

#: Configuration D: output channels of each 3×3 convolution, "M" for 2×2 max pooling.
VGG16_CONFIG = (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M",
                512, 512, 512, "M")


class VGG16BN(nn.Module):
    """VGG-16, 13 convolutions each followed by BatchNorm2d and ReLU, classifier dropout →
    Linear(512, 512) → BatchNorm1d → ReLU → dropout → Linear(512, classes): ``[N, 3, 32, 32]`` →
    ``[N, num_classes]`` logits (parameter counts: docs/compiler.md §7)."""

    def __init__(self, num_classes: int = 100, dropout: float = 0.5) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        in_channels = 3
        for v in VGG16_CONFIG:
            if v == "M":
                layers.append(nn.MaxPool2d(2))
            else:
                layers += [nn.Conv2d(in_channels, v, 3, padding=1), nn.BatchNorm2d(v), nn.ReLU()]
                in_channels = v
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Sequential(
            nn.Flatten(), nn.Dropout(dropout), nn.Linear(512, 512), nn.BatchNorm1d(512), nn.ReLU(),
            nn.Dropout(dropout), nn.Linear(512, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


def vgg16(num_classes: int = 100) -> VGG16BN:
    """A new VGG-16 with batch norm for CIFAR-100 (see VGG16BN)."""
    return VGG16BN(num_classes=num_classes)
