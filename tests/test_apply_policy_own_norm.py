"""A model that brings its own normalization class trains in float16 through `apply_policy`.

Published models rarely use Flax's normalization classes: Gemma has
``gemma.layers.RMSNorm``, and every other family brings its own. This model
is written the same way (a Gemma-style RMSNorm with a ``1 + scale`` gain, a
residual stream of a few hundred, as a deep model's reaches), and
`apply_policy` is told nothing about its norm class. The op-level rules put
the mean of squares and the root in float32 without knowing the class, so
the model trains as in float32: no step is skipped once the loss scale has
settled, and the loss lands within 3% of float32's. A per-layer engine that
ran the unknown class in float16 squared values of a few hundred past
float16's 65504 and never trained.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

import jaxamp

VOCAB, WIDTH, BATCH, LENGTH = 32, 64, 8, 16
STEPS, SETTLED_AFTER = 40, 12


class RMSNorm(nn.Module):
    """Gemma's form: ``x * rsqrt(mean(x**2) + eps) * (1 + scale)``."""

    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", nn.initializers.zeros_init(), (x.shape[-1],))
        variance = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
        return x * jax.lax.rsqrt(variance + 1e-6) * (1 + scale)


class TinyLM(nn.Module):
    """Two pre-norm MLP blocks on a residual stream of magnitude ~300."""

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(VOCAB, WIDTH, embedding_init=nn.initializers.normal(1.0))(tokens) * 300.0
        for _ in range(2):
            h = nn.Dense(4 * WIDTH)(RMSNorm()(x))
            x = x + nn.Dense(WIDTH)(nn.gelu(h))
        return nn.Dense(VOCAB)(RMSNorm()(x))


def _train(policy):
    """Losses and skipped-step flags of `STEPS` Adam steps on one fixed batch."""
    tokens = jax.random.randint(jax.random.key(0), (BATCH, LENGTH + 1), 0, VOCAB)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    model = TinyLM() if policy is None else jaxamp.apply_policy(TinyLM(), policy)
    params = model.init(jax.random.key(1), inputs)["params"]
    loss_scale = jaxamp.NoOpLossScale() if policy is None else jaxamp.DynamicLossScale()
    state = jaxamp.TrainState.create(
        apply_fn=model.apply, params=params, tx=optax.adam(3e-3), loss_scale=loss_scale
    )

    @jax.jit
    def train_step(state):
        def loss_fn(params):
            logits = state.apply_fn({"params": params}, inputs)
            return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

        loss, grads, grads_finite = jaxamp.scaled_value_and_grad(loss_fn, state.loss_scale)(state.params)
        return state.apply_gradients(grads=grads, grads_finite=grads_finite), loss, grads_finite

    losses, skipped = [], []
    for _ in range(STEPS):
        state, loss, grads_finite = train_step(state)
        losses.append(float(loss))
        skipped.append(not bool(grads_finite))
    return losses, skipped


def test_a_model_with_its_own_rms_norm_class_trains_in_float16_as_in_float32():
    float32_losses, _ = _train(None)
    float16_losses, skipped = _train("mixed_float16")

    assert not any(skipped[SETTLED_AFTER:]), skipped
    assert float16_losses[-1] < 0.7 * float16_losses[0], float16_losses
    assert abs(float16_losses[-1] - float32_losses[-1]) <= 0.03 * float32_losses[-1], (
        float16_losses[-1],
        float32_losses[-1],
    )
