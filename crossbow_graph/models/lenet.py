"""LeNet-5 (LeCun et al. 1998), as CROSSBOW trains it on MNIST."""

from __future__ import annotations

from torch import nn

__all__ = ["LeNet5", "lenet5"]


class LeNet5(nn.Module):
    """LeNet-5, conv(6, 5×5, pad 2) → pool → conv(16, 5×5) → pool → 120 → 84 → classes, ReLU and
    max pooling: ``[N, 1, 28, 28]`` → ``[N, num_classes]`` logits (docs/compiler.md §7)."""

    def __init__(self, num_classes: int = 10, in_channels: int = 1) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, 6, kernel_size=5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(6, 16, kernel_size=5), nn.ReLU(), nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(
            nn.Flatten(), nn.Linear(16 * 5 * 5, 120), nn.ReLU(), nn.Linear(120, 84), nn.ReLU(),
            nn.Linear(84, num_classes),
        )

    def forward(self, x):
        return self.classifier(self.features(x))


def lenet5(num_classes: int = 10, in_channels: int = 1) -> LeNet5:
    """A new LeNet-5 (see LeNet5)."""
    return LeNet5(num_classes=num_classes, in_channels=in_channels)
