"""The study's CIFAR models in PyTorch, for the side-by-side benchmark.

The same architectures as `experiments.models` (the widely used PyTorch
CIFAR reference: a 3x3 stride-1 stem, no max-pool; MobileNetV2 with stride-1
stem and second stage, relu, and a 1x1 shortcut where a stride-1 block
changes its width), with equal parameter counts (``tests/test_benchmark.py``
checks them). BatchNorm momentum 0.1 and epsilon 1e-5 are Flax's 0.9 and
1e-5.

PyTorch is optional: this module imports ``torch`` at import time, so import
it only where torch is known to be installed (`torch_available`).
"""

from __future__ import annotations

import torch
from torch import nn

from experiments.models.mobilenetv2 import CIFAR_STAGES


def _conv_bn(in_channels: int, out_channels: int, kernel: int, stride: int = 1, groups: int = 1) -> list:
    return [
        nn.Conv2d(in_channels, out_channels, kernel, stride, kernel // 2, groups=groups, bias=False),
        nn.BatchNorm2d(out_channels),
    ]


class _Residual(nn.Module):
    """``relu_after(body(x) + shortcut(x))``; the shortcut projects when shapes differ."""

    def __init__(self, body: list, in_channels: int, out_channels: int, stride: int, relu_after: bool = True):
        super().__init__()
        self.body = nn.Sequential(*body)
        projects = stride != 1 or in_channels != out_channels
        self.shortcut = (
            nn.Sequential(*_conv_bn(in_channels, out_channels, 1, stride)) if projects else nn.Identity()
        )
        self.relu_after = relu_after

    def forward(self, x):
        y = self.body(x) + self.shortcut(x)
        return torch.relu(y) if self.relu_after else y


def basic_block(in_channels: int, filters: int, stride: int) -> nn.Module:
    body = [*_conv_bn(in_channels, filters, 3, stride), nn.ReLU(), *_conv_bn(filters, filters, 3)]
    return _Residual(body, in_channels, filters, stride)


def bottleneck(in_channels: int, filters: int, stride: int) -> nn.Module:
    body = [
        *_conv_bn(in_channels, filters, 1),
        nn.ReLU(),
        *_conv_bn(filters, filters, 3, stride),
        nn.ReLU(),
        *_conv_bn(filters, 4 * filters, 1),
    ]
    return _Residual(body, in_channels, 4 * filters, stride)


class ResNet(nn.Module):
    """A CIFAR ResNet: 3x3 stem, four stages, global average pool, linear head."""

    def __init__(self, stage_sizes, block, expansion: int, num_classes: int = 10, num_filters: int = 64):
        super().__init__()
        layers = [*_conv_bn(3, num_filters, 3), nn.ReLU()]
        channels = num_filters
        for stage, size in enumerate(stage_sizes):
            for index in range(size):
                stride = 2 if stage > 0 and index == 0 else 1
                layers.append(block(channels, num_filters * 2**stage, stride))
                channels = num_filters * 2**stage * expansion
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(channels, num_classes)

    def forward(self, x):
        return self.head(self.features(x).mean(dim=(2, 3)))


def inverted_residual(in_channels: int, expansion: int, out_channels: int, stride: int) -> nn.Module:
    hidden = in_channels * expansion
    body = [
        *_conv_bn(in_channels, hidden, 1),
        nn.ReLU(),
        *_conv_bn(hidden, hidden, 3, stride, groups=hidden),
        nn.ReLU(),
        *_conv_bn(hidden, out_channels, 1),
    ]
    if stride != 1:
        return nn.Sequential(*body)
    return _Residual(body, in_channels, out_channels, 1, relu_after=False)


class MobileNetV2(nn.Module):
    """A CIFAR MobileNetV2: 3x3 stem, inverted residual stages, 1280-wide head."""

    def __init__(self, num_classes: int = 10):
        super().__init__()
        layers = [*_conv_bn(3, 32, 3), nn.ReLU()]
        channels = 32
        for expansion, out_channels, num_blocks, stride in CIFAR_STAGES:
            for index in range(num_blocks):
                layers.append(
                    inverted_residual(channels, expansion, out_channels, stride if index == 0 else 1)
                )
                channels = out_channels
        layers += [*_conv_bn(channels, 1280, 1), nn.ReLU()]
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(1280, num_classes)

    def forward(self, x):
        return self.head(self.features(x).mean(dim=(2, 3)))


MODELS = {
    "resnet18": lambda: ResNet((2, 2, 2, 2), basic_block, 1),
    "resnet50": lambda: ResNet((3, 4, 6, 3), bottleneck, 4),
    "resnet101": lambda: ResNet((3, 4, 23, 3), bottleneck, 4),
    "mobilenetv2": MobileNetV2,
    "resnet_tiny": lambda: ResNet((1, 1, 1), basic_block, 1, num_filters=16),
}


def create_model(name: str) -> nn.Module:
    """A PyTorch reference model by the name `experiments.models` uses."""
    if name not in MODELS:
        raise ValueError(f"No PyTorch reference for model {name!r}; choose one of {', '.join(MODELS)}.")
    return MODELS[name]()


def parameter_count(model: nn.Module) -> int:
    """Trainable parameters (BatchNorm running statistics are buffers, not counted)."""
    return sum(parameter.numel() for parameter in model.parameters())
