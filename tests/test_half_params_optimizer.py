"""Half params and the optimizer: refused where the update would be computed in half, reported where broken.

An optax optimizer computes its update and keeps its state in the params'
dtype: on float16 params Adam's ``eps=1e-8`` is 0 and the first applied step
wrote NaN params, after which `jaxamp.OverflowGuard` blamed a backward
overflow. `jaxamp.TrainState.create` and `jaxamp.NNXOptimizer` refuse half
params whose optimizer is not `jaxamp.low_precision_optimizer`, naming it;
params that an applied step made non-finite are reported as that.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxamp
from jaxamp._optimizer.low_precision import LowPrecisionState

X = jax.random.normal(jax.random.key(0), (32, 64))
Y = jnp.arange(32) % 10


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(10)(nn.relu(nn.Dense(256)(x)))


def linen_state(policy, tx, loss_scale=None):
    model = jaxamp.apply_policy(MLP(), policy)
    params = model.init(jax.random.key(1), X)["params"]
    loss_scale = jaxamp.default_loss_scale(policy) if loss_scale is None else loss_scale
    return jaxamp.TrainState.create(apply_fn=model.apply, params=params, tx=tx, loss_scale=loss_scale)


@jax.jit
def train_step(state):
    def loss_fn(params):
        logits = state.apply_fn({"params": params}, X).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, Y).mean()

    loss, grads, grads_finite = jaxamp.scaled_value_and_grad(loss_fn, state.loss_scale)(state.params)
    return state.apply_gradients(grads=grads, grads_finite=grads_finite), loss


def refusal(make) -> str:
    with pytest.raises(ValueError) as raised:
        make()
    return str(raised.value)


@pytest.mark.parametrize("policy", ["float16", "bfloat16"])
def test_half_params_with_a_plain_optimizer_are_refused_in_one_line_naming_the_wrapper(policy):
    message = refusal(lambda: linen_state(policy, optax.adam(1e-3)))
    dtype = jnp.dtype(policy).name
    assert message.startswith(f"TrainState.create: the param at ['Dense_0']['bias'] is {dtype}")
    assert "jaxamp.low_precision_optimizer(tx" in message and "\n" not in message


@pytest.mark.parametrize(
    ("policy", "fix"),
    [
        ("float16", "low_precision_optimizer(tx, param_dtype=jnp.float16, state_dtype=jnp.float32)"),
        ("bfloat16", "low_precision_optimizer(tx) (bfloat16 state, updates rounded stochastically)"),
    ],
)
def test_the_refusal_gives_the_wrapper_call_that_fits_the_params_dtype(policy, fix):
    """float16 params need float32 state (Adam's eps is 0 in float16); bfloat16 ones the default."""
    assert fix in refusal(lambda: linen_state(policy, optax.adam(1e-3)))


@pytest.mark.parametrize("policy", ["float16", "bfloat16"])
def test_an_nnx_model_with_half_params_and_a_plain_optimizer_is_refused_naming_the_wrapper(policy):
    model = jaxamp.apply_policy(nnx.Linear(4, 8, rngs=nnx.Rngs(0)), policy)
    message = refusal(lambda: jaxamp.NNXOptimizer(model, optax.adam(1e-3)))
    assert message.startswith(f"jaxamp.NNXOptimizer: the param at ['bias'] is {jnp.dtype(policy).name}")
    assert "jaxamp.low_precision_optimizer(tx" in message


def test_the_float16_mlp_that_plain_adam_broke_trains_with_the_wrapper_the_message_names():
    tx = jaxamp.low_precision_optimizer(optax.adam(1e-3), param_dtype=jnp.float16, state_dtype=jnp.float32)
    state = linen_state("float16", tx)
    losses = []
    for _ in range(3):
        state, loss = train_step(state)
        losses.append(float(loss))
    assert int(state.step) == 3 and int(state.skipped_steps) == 0
    assert losses[2] < losses[0]
    assert all(np.isfinite(np.asarray(leaf, np.float32)).all() for leaf in jax.tree.leaves(state.params))


@pytest.mark.parametrize(
    "tx",
    [
        optax.chain(optax.clip_by_global_norm(1.0), jaxamp.low_precision_optimizer(optax.adam(1e-3))),
        optax.MultiSteps(jaxamp.low_precision_optimizer(optax.adam(1e-3)), every_k_schedule=2),
        jaxamp.low_precision_optimizer(optax.MultiSteps(optax.adam(1e-3), every_k_schedule=2)),
    ],
    ids=["in a chain", "inside MultiSteps", "around MultiSteps"],
)
def test_the_wrapper_anywhere_in_the_optimizer_is_accepted(tx):
    state = linen_state("bfloat16", tx)
    assert int(train_step(state)[0].skipped_steps) == 0


def test_float32_params_keep_a_plain_optimizer():
    tx = optax.adam(1e-3)
    assert linen_state("mixed_bfloat16", tx).tx is tx


@pytest.mark.parametrize("policy, state_dtype", [("float16", jnp.float32), ("bfloat16", jnp.bfloat16)])
def test_a_policy_with_half_params_gets_an_optimizer_that_computes_in_float32(policy, state_dtype):
    tx = jaxamp.optimizer_for_policy(optax.adam(1e-3), policy)
    state, loss = train_step(linen_state(policy, tx))
    assert isinstance(state.opt_state, LowPrecisionState)
    adam = state.opt_state.inner_state[0]
    assert {leaf.dtype for leaf in jax.tree.leaves((adam.mu, adam.nu))} == {jnp.dtype(state_dtype)}
    assert {leaf.dtype for leaf in jax.tree.leaves(state.params)} == {jnp.dtype(policy)}
    assert int(state.step) == 1 and np.isfinite(float(loss))


def test_params_an_applied_step_made_non_finite_are_reported_as_that_not_as_an_overflow():
    """An update of inf (a diverging learning rate) is applied: its gradients were finite. Every later
    step's gradients are NaN, whatever the scale."""
    state = linen_state("mixed_float16", optax.sgd(jnp.inf), jaxamp.DynamicLossScale(2.0**10))
    for _ in range(4):
        state, _ = train_step(state)
    assert int(state.step) == 1 and int(state.loss_scale.consecutive_skipped_steps) == 3

    with pytest.raises(jaxamp.LossScaleStuckError) as raised:
        jaxamp.OverflowGuard(max_consecutive_skips=3).check(state)

    message = str(raised.value)
    assert raised.value.nonfinite_params == ["Dense_0/bias", "Dense_0/kernel", "Dense_1/bias", "Dense_1/kernel"]
    assert "The params are not finite (4 leaves: Dense_0/bias" in message
    assert message.startswith("Loss scale stuck: 3 steps in a row were skipped (limit 3).")
    assert "an applied step wrote them" in message and "float32 override" not in message


def test_an_nnx_models_non_finite_params_are_read_from_the_params_passed():
    model = nnx.Linear(4, 8, rngs=nnx.Rngs(0))
    optimizer = jaxamp.NNXOptimizer(model, optax.sgd(0.1), jaxamp.DynamicLossScale())
    nan_grads = jax.tree.map(lambda grad: jnp.full_like(grad, jnp.nan), nnx.state(model, nnx.Param))
    for _ in range(2):
        optimizer.update(model, nan_grads)
    guard = jaxamp.OverflowGuard(max_consecutive_skips=2)

    with pytest.raises(jaxamp.LossScaleStuckError) as finite:
        guard.check(optimizer, params=nnx.state(model, nnx.Param))
    model.kernel[...] = model.kernel[...].at[0, 0].set(jnp.nan)
    with pytest.raises(jaxamp.LossScaleStuckError) as broken:
        guard.check(optimizer, params=nnx.state(model, nnx.Param))

    assert finite.value.nonfinite_params == [] and "float32 override" in str(finite.value)
    assert broken.value.nonfinite_params == ["kernel"] and "The params are not finite" in str(broken.value)
