"""ResNets for 32x32 images, as in the widely used PyTorch CIFAR reference.

The generic `ResNet` is specialised into families with `functools.partial`,
as in the Flax ImageNet example. Unlike the ImageNet variant, the stem is a
single 3x3 convolution with stride 1 and no max-pool, so the first stage sees
the full 32x32 image.

The modules carry no precision arguments: `jaxamp.apply_policy` decides from
the outside which parts compute in half precision.
"""

import functools
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax.numpy as jnp

ModuleDef = Any


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with an identity or projection shortcut.

    Attributes:
      filters: Output channels of both convolutions.
      conv: Convolution constructor, without bias.
      norm: BatchNorm constructor, already bound to train or eval mode.
      act: Activation applied after each norm and after the sum.
      strides: Strides of the first convolution and of the projection.
    """

    expansion = 1

    filters: int
    conv: ModuleDef
    norm: ModuleDef
    act: Callable
    strides: tuple[int, int] = (1, 1)

    @nn.compact
    def __call__(self, x):
        residual = x
        y = self.conv(self.filters, (3, 3), self.strides)(x)
        y = self.norm()(y)
        y = self.act(y)
        y = self.conv(self.filters, (3, 3))(y)
        y = self.norm()(y)

        if residual.shape != y.shape:
            residual = self.conv(self.filters, (1, 1), self.strides, name="proj_conv")(residual)
            residual = self.norm(name="proj_norm")(residual)

        return self.act(residual + y)


class Bottleneck(nn.Module):
    """A 1x1 reduce, 3x3, 1x1 expand bottleneck with 4x channel expansion.

    The stride sits on the 3x3 convolution, as in the PyTorch reference.

    Attributes:
      filters: Channels of the inner convolutions; the block outputs
        `filters * 4` channels.
      conv: Convolution constructor, without bias.
      norm: BatchNorm constructor, already bound to train or eval mode.
      act: Activation applied after the inner norms and after the sum.
      strides: Strides of the 3x3 convolution and of the projection.
    """

    expansion = 4

    filters: int
    conv: ModuleDef
    norm: ModuleDef
    act: Callable
    strides: tuple[int, int] = (1, 1)

    @nn.compact
    def __call__(self, x):
        residual = x
        y = self.conv(self.filters, (1, 1))(x)
        y = self.norm()(y)
        y = self.act(y)
        y = self.conv(self.filters, (3, 3), self.strides)(y)
        y = self.norm()(y)
        y = self.act(y)
        y = self.conv(self.filters * self.expansion, (1, 1))(y)
        y = self.norm()(y)

        if residual.shape != y.shape:
            residual = self.conv(self.filters * self.expansion, (1, 1), self.strides, name="proj_conv")(
                residual
            )
            residual = self.norm(name="proj_norm")(residual)

        return self.act(residual + y)


class ResNet(nn.Module):
    """A CIFAR ResNet: 3x3 stem, residual stages, global average pool, Dense.

    Stage `i` has `num_filters * 2**i` filters; every stage after the first
    halves the spatial size in its first block.

    Attributes:
      stage_sizes: Number of blocks in each stage.
      block_cls: `BasicBlock` or `Bottleneck`.
      num_classes: Size of the logits.
      num_filters: Channels of the stem and of the first stage.
      act: Activation used throughout.
    """

    stage_sizes: Sequence[int]
    block_cls: ModuleDef
    num_classes: int = 10
    num_filters: int = 64
    act: Callable = nn.relu

    @nn.compact
    def __call__(self, x, train: bool = True):
        """Maps images [B, H, W, C] to logits [B, num_classes]."""
        conv = functools.partial(nn.Conv, use_bias=False, padding="SAME")
        norm = functools.partial(nn.BatchNorm, use_running_average=not train, momentum=0.9, epsilon=1e-5)

        x = conv(self.num_filters, (3, 3), name="conv_init")(x)
        x = norm(name="bn_init")(x)
        x = self.act(x)
        for i, block_size in enumerate(self.stage_sizes):
            for j in range(block_size):
                strides = (2, 2) if i > 0 and j == 0 else (1, 1)
                x = self.block_cls(
                    self.num_filters * 2**i,
                    strides=strides,
                    conv=conv,
                    norm=norm,
                    act=self.act,
                )(x)
        x = jnp.mean(x, axis=(1, 2))
        return nn.Dense(self.num_classes)(x)


ResNet18 = functools.partial(ResNet, stage_sizes=[2, 2, 2, 2], block_cls=BasicBlock)
ResNet34 = functools.partial(ResNet, stage_sizes=[3, 4, 6, 3], block_cls=BasicBlock)
ResNet50 = functools.partial(ResNet, stage_sizes=[3, 4, 6, 3], block_cls=Bottleneck)
ResNet101 = functools.partial(ResNet, stage_sizes=[3, 4, 23, 3], block_cls=Bottleneck)
ResNet152 = functools.partial(ResNet, stage_sizes=[3, 8, 36, 3], block_cls=Bottleneck)

# About 78k parameters: small enough to train on CPU in minutes, deep enough
# to exercise BatchNorm, projections and residual sums like the big models.
ResNetTiny = functools.partial(ResNet, stage_sizes=[1, 1, 1], block_cls=BasicBlock, num_filters=16)
