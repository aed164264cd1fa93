"""MobileNetV2 for 32x32 images, as in the widely used PyTorch CIFAR reference.

Compared with the ImageNet network, the stem and the second stage use stride 1,
so the final feature map is 4x4 rather than 1x1. The reference also uses
`relu` rather than `relu6`, always keeps the expansion 1x1 convolution (even
when the expansion factor is 1), and gives a stride-1 block whose channel count
changes a 1x1 convolution shortcut; this module does the same so that the
parameter count matches.

The modules carry no precision arguments: `jaxamp.apply_policy` decides from
the outside which parts compute in half precision.
"""

import functools
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax.numpy as jnp

ModuleDef = Any

# (expansion, out_channels, num_blocks, stride) of each stage.
CIFAR_STAGES = (
    (1, 16, 1, 1),
    (6, 24, 2, 1),
    (6, 32, 3, 2),
    (6, 64, 4, 2),
    (6, 96, 3, 1),
    (6, 160, 3, 2),
    (6, 320, 1, 1),
)


class InvertedResidual(nn.Module):
    """Expand with 1x1, filter with depthwise 3x3, project with linear 1x1.

    Blocks with stride 1 add a shortcut: the identity when the channel count is
    unchanged, otherwise a 1x1 convolution and norm. Blocks with stride 2 have
    no shortcut.

    Attributes:
      expansion: Ratio of hidden to input channels.
      out_features: Output channels.
      conv: Convolution constructor, without bias.
      norm: BatchNorm constructor, already bound to train or eval mode.
      act: Activation after the expansion and the depthwise convolution.
      strides: Strides of the depthwise convolution.
    """

    expansion: int
    out_features: int
    conv: ModuleDef
    norm: ModuleDef
    act: Callable
    strides: tuple[int, int] = (1, 1)

    @nn.compact
    def __call__(self, x):
        hidden = x.shape[-1] * self.expansion
        y = self.conv(hidden, (1, 1))(x)
        y = self.norm()(y)
        y = self.act(y)
        y = self.conv(hidden, (3, 3), self.strides, feature_group_count=hidden)(y)
        y = self.norm()(y)
        y = self.act(y)
        y = self.conv(self.out_features, (1, 1))(y)
        y = self.norm()(y)

        if self.strides != (1, 1):
            return y
        shortcut = x
        if x.shape[-1] != self.out_features:
            shortcut = self.conv(self.out_features, (1, 1), name="shortcut_conv")(x)
            shortcut = self.norm(name="shortcut_norm")(shortcut)
        return shortcut + y


class MobileNetV2(nn.Module):
    """A CIFAR MobileNetV2: 3x3 stem, inverted residual stages, 1280-wide head.

    Attributes:
      num_classes: Size of the logits.
      stages: `(expansion, out_channels, num_blocks, stride)` per stage; only
        the first block of a stage uses the stage's stride.
      act: Activation used throughout.
    """

    num_classes: int = 10
    stages: tuple[tuple[int, int, int, int], ...] = CIFAR_STAGES
    act: Callable = nn.relu

    @nn.compact
    def __call__(self, x, train: bool = True):
        """Maps images [B, H, W, C] to logits [B, num_classes]."""
        conv = functools.partial(nn.Conv, use_bias=False, padding="SAME")
        norm = functools.partial(nn.BatchNorm, use_running_average=not train, momentum=0.9, epsilon=1e-5)

        x = conv(32, (3, 3), name="conv_init")(x)
        x = norm(name="bn_init")(x)
        x = self.act(x)
        for expansion, out_features, num_blocks, stride in self.stages:
            for j in range(num_blocks):
                strides = (stride, stride) if j == 0 else (1, 1)
                x = InvertedResidual(
                    expansion,
                    out_features,
                    strides=strides,
                    conv=conv,
                    norm=norm,
                    act=self.act,
                )(x)
        x = conv(1280, (1, 1), name="conv_final")(x)
        x = norm(name="bn_final")(x)
        x = self.act(x)
        x = jnp.mean(x, axis=(1, 2))
        return nn.Dense(self.num_classes)(x)
