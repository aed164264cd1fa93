"""Tiny models of every family `jaxamp.autocast` supports, as float32 losses.

Each builder returns ``(loss_fn, params, batch)``: ``loss_fn(params, *batch)``
is a scalar float32 loss written with no dtype handling at all, ``params`` a
pytree of float32 arrays. Frameworks that hold state in objects (NNX,
Equinox) are split into arrays and a static rest, and merged inside the loss.
"""

from __future__ import annotations

import functools

import equinox as eqx
import flax.linen as nn
import haiku as hk
import jax
import jax.numpy as jnp
import optax
from flax import nnx

BATCH, FEATURES, CLASSES = 4, 6, 3


def _batch(seed: int = 0, shape: tuple = (BATCH, FEATURES)):
    inputs_key, labels_key = jax.random.split(jax.random.key(seed))
    inputs = jax.random.normal(inputs_key, shape)
    labels = jax.nn.one_hot(jax.random.randint(labels_key, (shape[0],), 0, CLASSES), CLASSES)
    return inputs, labels


def _xent(logits, labels):
    return optax.softmax_cross_entropy(logits, labels).mean()


def _dense_params(key, sizes):
    keys = jax.random.split(key, len(sizes) - 1)
    return [
        {"w": jax.random.normal(k, (m, n)) / jnp.sqrt(m), "b": jnp.zeros(n)}
        for k, m, n in zip(keys, sizes[:-1], sizes[1:])
    ]


def plain_mlp():
    def loss_fn(params, x, y):
        h = x
        for layer in params[:-1]:
            h = jax.nn.gelu(h @ layer["w"] + layer["b"])
            h = 0.5 * h  # a strong float32 literal in the jaxpr
        return _xent(h @ params[-1]["w"] + params[-1]["b"], y)

    return loss_fn, _dense_params(jax.random.key(1), [FEATURES, 8, 8, CLASSES]), _batch()


def scan_rnn():
    def loss_fn(params, xs, y):
        def cell(h, x):
            h = jnp.tanh(h @ params["wh"] + x @ params["wx"] + params["b"])
            return h, h

        h, _ = jax.lax.scan(cell, jnp.zeros((xs.shape[1], 8)), xs)
        return _xent(h @ params["wo"], y)

    k1, k2, k3 = jax.random.split(jax.random.key(2), 3)
    params = {
        "wh": jax.random.normal(k1, (8, 8)) / 3,
        "wx": jax.random.normal(k2, (FEATURES, 8)) / 3,
        "b": jnp.zeros(8),
        "wo": jax.random.normal(k3, (8, CLASSES)) / 3,
    }
    xs, _ = _batch(shape=(5, BATCH, FEATURES))
    return loss_fn, params, (xs, _batch()[1])


def checkpointed_mlp():
    @functools.partial(jax.checkpoint, policy=jax.checkpoint_policies.nothing_saveable)
    def block(layer, h):
        return jax.nn.relu(h @ layer["w"] + layer["b"])

    def loss_fn(params, x, y):
        h = block(params[0], x)
        h = block(params[1], h)
        return _xent(h @ params[2]["w"], y)

    return loss_fn, _dense_params(jax.random.key(3), [FEATURES, 8, 8, CLASSES]), _batch()


@jax.custom_vjp
def clipped_matmul(x, w):
    """``x @ w`` whose backward clips the cotangent: a custom VJP with matmuls in it."""
    return x @ w


def _clipped_matmul_forward(x, w):
    return x @ w, (x, w)


def _clipped_matmul_backward(residuals, cotangent):
    x, w = residuals
    cotangent = jnp.clip(cotangent, -1.0, 1.0)
    return cotangent @ w.T, x.T @ cotangent


clipped_matmul.defvjp(_clipped_matmul_forward, _clipped_matmul_backward)


@jax.custom_jvp
def softplus(x):
    """Softplus with a custom JVP whose rule has a matmul of its own."""
    return jnp.logaddexp(x, 0.0)


@softplus.defjvp
def _softplus_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    return softplus(x), (t * jax.nn.sigmoid(x)) @ jnp.eye(x.shape[-1], dtype=x.dtype)


def control_flow_mix():
    """custom_vjp (whose backward has matmuls), custom_jvp, cond and fori_loop."""

    def loss_fn(params, x, y):
        h = softplus(clipped_matmul(x, params["w1"]))
        h = jax.lax.cond(h.mean() > 0, lambda h: h @ params["w2"], lambda h: -h @ params["w2"], h)
        h = jax.lax.fori_loop(0, 2, lambda i, h: jnp.tanh(h @ params["w3"]), h)
        return _xent(h @ params["wo"], y)

    keys = jax.random.split(jax.random.key(4), 4)
    params = {
        "w1": jax.random.normal(keys[0], (FEATURES, 8)) / 3,
        "w2": jax.random.normal(keys[1], (8, 8)) / 3,
        "w3": jax.random.normal(keys[2], (8, 8)) / 3,
        "wo": jax.random.normal(keys[3], (8, CLASSES)) / 3,
    }
    return loss_fn, params, _batch()


def jitted_loss():
    inner, params, batch = plain_mlp()
    return jax.jit(inner), params, batch


class PinnedCNN(nn.Module):
    """A published-model habit: every layer pinned to float32."""

    @nn.compact
    def __call__(self, x):
        x = nn.Conv(4, (3, 3), dtype=jnp.float32, param_dtype=jnp.float32)(x)
        x = nn.LayerNorm(dtype=jnp.float32)(nn.relu(x))
        x = nn.avg_pool(x, (2, 2), (2, 2))
        return nn.Dense(CLASSES, dtype=jnp.float32)(x.reshape((x.shape[0], -1)))


def linen_pinned_cnn():
    model = PinnedCNN()
    x, y = _batch(shape=(BATCH, 6, 6, 2))
    params = model.init(jax.random.key(5), x)["params"]
    return (lambda params, x, y: _xent(model.apply({"params": params}, x), y)), params, (x, y)


class AttentionBlock(nn.Module):
    @nn.compact
    def __call__(self, x):
        mask = nn.make_causal_mask(x[..., 0])  # masked logits become finfo(float32).min
        x = x + nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=8)(x, mask=mask)
        return nn.Dense(CLASSES)(nn.LayerNorm()(x).mean(axis=1))


def linen_attention():
    model = AttentionBlock()
    x, y = _batch(shape=(BATCH, 5, FEATURES))
    params = model.init(jax.random.key(6), x)["params"]
    return (lambda params, x, y: _xent(model.apply({"params": params}, x), y)), params, (x, y)


class _Step(nn.Module):
    @nn.compact
    def __call__(self, h, _):
        return jnp.tanh(nn.Dense(8)(h)), None


class ScannedRemat(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.Dense(8)(x)
        layers = nn.scan(nn.remat(_Step), variable_axes={"params": 0}, split_rngs={"params": True}, length=3)
        h, _ = layers()(h, None)
        return nn.Dense(CLASSES)(h)


def linen_scan_remat():
    model = ScannedRemat()
    x, y = _batch()
    params = model.init(jax.random.key(7), x)["params"]
    return (lambda params, x, y: _xent(model.apply({"params": params}, x), y)), params, (x, y)


class NnxMLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, use_running_average: bool = True):
        self.hidden = nnx.Linear(FEATURES, 8, rngs=rngs)
        self.norm = nnx.BatchNorm(8, use_running_average=use_running_average, rngs=rngs)
        self.out = nnx.Linear(8, CLASSES, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.relu(self.norm(self.hidden(x))))


def nnx_mlp():
    # Batch statistics in inference mode: under plain jax.grad an NNX module
    # cannot update them (the write-back has its own test).
    graphdef, params, rest = nnx.split(NnxMLP(nnx.Rngs(8)), nnx.Param, ...)

    def loss_fn(params, rest, x, y):
        model = nnx.merge(graphdef, params, rest)
        return _xent(model(x), y)

    return loss_fn, params, (rest, *_batch())


def equinox_mlp():
    model = eqx.nn.MLP(FEATURES, CLASSES, width_size=8, depth=2, key=jax.random.key(9))
    params, static = eqx.partition(model, eqx.is_array)

    def loss_fn(params, x, y):
        return _xent(jax.vmap(eqx.combine(params, static))(x), y)

    return loss_fn, params, _batch()


def haiku_mlp():
    model = hk.without_apply_rng(hk.transform(lambda x: hk.nets.MLP([8, 8, CLASSES])(x)))
    x, y = _batch()
    params = model.init(jax.random.key(10), x)
    return (lambda params, x, y: _xent(model.apply(params, x), y)), params, (x, y)


FAMILIES = {
    "plain_mlp": plain_mlp,
    "scan_rnn": scan_rnn,
    "checkpointed_mlp": checkpointed_mlp,
    "control_flow_mix": control_flow_mix,
    "jitted_loss": jitted_loss,
    "linen_pinned_cnn": linen_pinned_cnn,
    "linen_attention": linen_attention,
    "linen_scan_remat": linen_scan_remat,
    "nnx_mlp": nnx_mlp,
    "equinox_mlp": equinox_mlp,
    "haiku_mlp": haiku_mlp,
}
