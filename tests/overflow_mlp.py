"""The 4-layer float16 MLP of test_overflow_attribution.py, shared with its 8-device checks."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxamp

WIDTH = 8
SCALE = 2.0**15


def init_params(key, width=WIDTH):
    keys = jax.random.split(key, 4)
    return [
        {"kernel": jax.random.normal(k, (width, width)) / np.sqrt(width), "bias": jnp.zeros(width)}
        for k in keys
    ]


def mlp(params, x):
    """Returns the output and layer 3's output, each layer under its own named scope."""
    h, layer_3 = x, None
    for index, layer in enumerate(params, start=1):
        with jax.named_scope(f"layer_{index}"):
            h = h @ layer["kernel"] + layer["bias"]
            if index < 4:
                h = jnp.tanh(h)
        if index == 3:
            layer_3 = h
    return h, layer_3


MODEL = jaxamp.autocast(mlp, "mixed_float16")


def new_state(params):
    return jaxamp.TrainState.create(
        apply_fn=None, params=params, tx=optax.adam(1e-3), loss_scale=jaxamp.StaticLossScale(SCALE)
    )
