"""Google DeepMind's Gemma 2 Flax transformer, trained in float16 through jaxamp.

    pip install --no-deps gemma==2.0.8      # its transformer needs only flax and orbax

A model nobody here wrote, tried as a new user would: ``gemma.transformer.
Transformer`` with a tiny random config (2 layers, width 128, grouped-query
attention with 4 query and 2 key-value heads, one sliding-window and one
global layer, attention and final-logit soft-caps; no checkpoint, nothing
downloaded), trained for 40 Adam steps on one fixed batch of random tokens
by `jaxamp.TrainState` and `jaxamp.scaled_value_and_grad`, three ways:
float32, ``jaxamp.apply_policy(model, "mixed_float16")`` and
``jaxamp.autocast(model.apply, "mixed_float16")``, both with a
`jaxamp.DynamicLossScale`. Gemma normalizes with its own class
(``gemma.layers.RMSNorm``), which no list of normalization layers names.

Printed per route: the first and last loss, how many steps were skipped
for non-finite gradients, and the final loss scale. Writes gemma_float16.txt.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import optax

import jaxamp
from experiments.flags import positive_int

ROUTES = ("float32", "apply_policy", "autocast")


def _gemma():
    try:
        from gemma import modules
        from gemma import transformer as gemma_transformer
    except ImportError as error:
        raise SystemExit(
            f"error: gemma-float16 needs the gemma package ({error}); install it with "
            "`pip install --no-deps gemma==2.0.8`."
        ) from None
    config = gemma_transformer.TransformerConfig(
        num_layers=2,
        num_embed=256,
        embed_dim=128,
        hidden_dim=256,
        num_heads=4,
        head_dim=32,
        num_kv_heads=2,
        final_logit_softcap=30.0,
        use_post_attn_norm=True,
        use_post_ffw_norm=True,
        attention_types=(modules.AttentionType.LOCAL_SLIDING, modules.AttentionType.GLOBAL),
        attn_logits_soft_cap=50.0,
        sliding_window_size=8,
        max_cache_length=None,
    )
    return gemma_transformer.Transformer(config), config.num_embed


def model_and_batch(batch: int = 4, length: int = 32):
    """The tiny Gemma, its initial params and one fixed batch of random tokens:
    ``(model, params, (inputs, positions, mask), targets)``."""
    model, vocab = _gemma()
    tokens = jax.random.randint(jax.random.key(0), (batch, length + 1), 0, vocab)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    positions = jnp.broadcast_to(jnp.arange(length), (batch, length))
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((length, length), bool)), (batch, length, length))
    params = model.init(jax.random.key(1), inputs, positions, None, mask)["params"]
    return model, params, (inputs, positions, mask), targets


def train(route: str, steps: int) -> tuple[list[float], int, float]:
    """Losses, skipped steps and the final loss scale of `steps` Adam steps by `route`."""
    model, params, (inputs, positions, mask), targets = model_and_batch()
    if route == "float32":
        apply_fn, loss_scale = model.apply, jaxamp.NoOpLossScale()
    elif route == "apply_policy":
        apply_fn, loss_scale = jaxamp.apply_policy(model, "mixed_float16").apply, jaxamp.DynamicLossScale()
    else:
        apply_fn, loss_scale = jaxamp.autocast(model.apply, "mixed_float16"), jaxamp.DynamicLossScale()
    state = jaxamp.TrainState.create(
        apply_fn=apply_fn, params=params, tx=optax.adam(1e-3), loss_scale=loss_scale
    )

    @jax.jit
    def train_step(state):
        def loss_fn(params):
            logits, _ = state.apply_fn({"params": params}, inputs, positions, None, mask)
            return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets).mean()

        loss, grads, grads_finite = jaxamp.scaled_value_and_grad(loss_fn, state.loss_scale)(state.params)
        return state.apply_gradients(grads=grads, grads_finite=grads_finite), loss, grads_finite

    losses, skipped = [], 0
    for _ in range(steps):
        state, loss, grads_finite = train_step(state)
        losses.append(float(loss))
        skipped += int(not bool(grads_finite))
    return losses, skipped, float(getattr(state.loss_scale, "loss_scale", 1.0))


def _routes(text: str) -> list[str]:
    routes = [route.strip() for route in text.split(",") if route.strip()]
    unknown = sorted(set(routes) - set(ROUTES))
    if unknown or not routes:
        raise argparse.ArgumentTypeError(f"expected some of {', '.join(ROUTES)}, got {text!r}")
    return routes


def add_arguments(parser) -> None:
    parser.add_argument("--steps", type=positive_int, default=40, help="Adam steps per route")
    parser.add_argument("--routes", type=_routes, default=list(ROUTES), help="comma-separated")


def run(args, out) -> None:
    _gemma()  # the package missing: one line saying what to install, before any work
    out.print(f"Gemma 2 (gemma 2.0.8), tiny random config, {args.steps} Adam steps, JAX {jax.__version__}")
    for route in args.routes:
        losses, skipped, scale = train(route, args.steps)
        out.print(
            f"{route:13s} loss {losses[0]:.3f} -> {losses[-1]:.3f}  skipped {skipped}/{args.steps}  "
            f"final loss scale {scale:g}"
        )
    out.save_printed("gemma_float16.txt")
