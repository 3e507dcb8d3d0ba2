"""ResNets: ResNet-32 for CIFAR (He et al. 2016, §4.2) and ResNet-50 for ImageNet (§3.4, Table 1)."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["CifarResNet", "ResNet50", "resnet32", "resnet50"]


class _PadShortcut(nn.Module):
    """Option A shortcut (He et al. 2016, §4.2), stride-2 subsampling and zero channel padding:
    ``[N, C, H, W]`` → ``[N, C + 2·pad, H/2, W/2]``, no parameters."""

    def __init__(self, pad: int) -> None:
        super().__init__()
        self.pad = pad

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.pad(x[:, :, ::2, ::2], (0, 0, 0, 0, self.pad, self.pad))


class _BasicBlock(nn.Module):
    """Two 3×3 convolutions with batch norm and an identity (or option A) shortcut."""

    def __init__(self, in_planes: int, planes: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_planes != planes:
            self.shortcut = _PadShortcut((planes - in_planes) // 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class CifarResNet(nn.Module):
    """ResNet-(6n+2) (He et al. 2016, §4.2): 16/32/64 filters, n blocks each; n = 5 is ResNet-32.
    ``[N, 3, 32, 32]`` → ``[N, num_classes]`` logits (docs/compiler.md §7)."""

    def __init__(self, n: int = 5, num_classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(16)
        blocks: list[nn.Module] = []
        in_planes = 16
        for planes, stride in ((16, 1), (32, 2), (64, 2)):
            for i in range(n):
                blocks.append(_BasicBlock(in_planes, planes, stride if i == 0 else 1))
                in_planes = planes
        self.layers = nn.Sequential(*blocks)
        self.fc = nn.Linear(64, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.layers(out)
        out = F.adaptive_avg_pool2d(out, 1).flatten(1)
        return self.fc(out)


class _Bottleneck(nn.Module):
    """1×1 → 3×3 (stride) → 1×1 convolutions, expansion 4, projection shortcut when shapes change."""

    def __init__(self, in_planes: int, planes: int, stride: int) -> None:
        super().__init__()
        out_planes = 4 * planes
        self.conv1 = nn.Conv2d(in_planes, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, out_planes, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_planes)
        self.downsample: nn.Module = nn.Identity()
        if stride != 1 or in_planes != out_planes:
            self.downsample = nn.Sequential(
                nn.Conv2d(in_planes, out_planes, 1, stride=stride, bias=False),
                nn.BatchNorm2d(out_planes),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = F.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return F.relu(out + self.downsample(x))


class ResNet50(nn.Module):
    """ResNet-50 (He et al. 2016, Table 1; stride on the 3×3 conv): ``[N, 3, 224, 224]`` →
    ``[N, num_classes]`` logits (docs/compiler.md §7)."""

    def __init__(self, num_classes: int = 1000) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False), nn.BatchNorm2d(64), nn.ReLU(),
            nn.MaxPool2d(3, stride=2, padding=1),
        )
        stages: list[nn.Module] = []
        in_planes = 64
        for planes, count, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
            blocks = []
            for i in range(count):
                blocks.append(_Bottleneck(in_planes, planes, stride if i == 0 else 1))
                in_planes = 4 * planes
            stages.append(nn.Sequential(*blocks))
        self.stages = nn.Sequential(*stages)
        self.fc = nn.Linear(2048, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.stages(self.stem(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(out, 1), 1))


def resnet32(num_classes: int = 10) -> CifarResNet:
    """A new ResNet-32 for CIFAR (see CifarResNet)."""
    return CifarResNet(n=5, num_classes=num_classes)


def resnet50(num_classes: int = 1000) -> ResNet50:
    """A new ResNet-50 for ImageNet (see ResNet50)."""
    return ResNet50(num_classes=num_classes)
