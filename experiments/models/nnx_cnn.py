"""A small CNN written in Flax NNX: plain NNX with no precision argument anywhere, as the linen models are.

Two 3x3 convolutions with batch normalization and ReLU, each followed by a
2x2 max pool, dropout, and a dense classifier. Images [B, 32, 32, 3] in,
logits [B, num_classes] out; `jaxamp.apply_policy` makes it mixed precision.
"""

from __future__ import annotations

import jax
from flax import nnx


class NNXSmallCNN(nnx.Module):
    """Conv-BN-ReLU-pool twice, dropout, dense.

    Args:
        rngs: the parameters' initialisation and the dropout's stream.
        num_classes: the size of the logits.
        width: the first convolution's channels (the second has twice as many).
        dropout: the dropout rate before the classifier.
    """

    def __init__(self, rngs: nnx.Rngs, num_classes: int = 10, width: int = 16, dropout: float = 0.1):
        self.conv1 = nnx.Conv(3, width, (3, 3), rngs=rngs)
        self.norm1 = nnx.BatchNorm(width, rngs=rngs)
        self.conv2 = nnx.Conv(width, 2 * width, (3, 3), rngs=rngs)
        self.norm2 = nnx.BatchNorm(2 * width, rngs=rngs)
        self.dropout = nnx.Dropout(dropout, rngs=rngs)
        self.classifier = nnx.Linear(2 * width * 8 * 8, num_classes, rngs=rngs)

    def __call__(self, images: jax.Array) -> jax.Array:
        x = nnx.max_pool(nnx.relu(self.norm1(self.conv1(images))), (2, 2), (2, 2))
        x = nnx.max_pool(nnx.relu(self.norm2(self.conv2(x))), (2, 2), (2, 2))
        return self.classifier(self.dropout(x.reshape(x.shape[0], -1)))
