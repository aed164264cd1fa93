"""CIFAR model zoo: plain Flax modules that jaxamp makes mixed precision.

Every model is called as `model.apply(variables, images, train=..., mutable=...)`
with images [B, 32, 32, 3] and returns logits [B, num_classes]. Look models up
by name with `create_model`, e.g. from a command-line flag.
"""

from collections.abc import Callable

import flax.linen as nn

from experiments.models.mobilenetv2 import InvertedResidual, MobileNetV2
from experiments.models.resnet import (
    BasicBlock,
    Bottleneck,
    ResNet,
    ResNet18,
    ResNet34,
    ResNet50,
    ResNet101,
    ResNet152,
    ResNetTiny,
)

__all__ = [
    "MODELS",
    "BasicBlock",
    "Bottleneck",
    "InvertedResidual",
    "MobileNetV2",
    "ResNet",
    "ResNet18",
    "ResNet34",
    "ResNet50",
    "ResNet101",
    "ResNet152",
    "ResNetTiny",
    "create_model",
]

MODELS: dict[str, Callable[..., nn.Module]] = {
    "resnet18": ResNet18,
    "resnet34": ResNet34,
    "resnet50": ResNet50,
    "resnet101": ResNet101,
    "resnet152": ResNet152,
    "mobilenetv2": MobileNetV2,
    "resnet_tiny": ResNetTiny,
}


def create_model(name: str, num_classes: int = 10) -> nn.Module:
    """Builds a model from the zoo by name.

    Args:
      name: A key of `MODELS`, e.g. `'resnet18'`.
      num_classes: Size of the logits.

    Returns:
      An unbound Flax module.

    Raises:
      ValueError: If `name` is not a key of `MODELS`.

    Examples:
      >>> model = create_model('resnet_tiny')
      >>> model.num_classes
      10
    """
    if name not in MODELS:
        raise ValueError(f"Unknown model {name!r}; choose one of {', '.join(sorted(MODELS))}.")
    return MODELS[name](num_classes=num_classes)
