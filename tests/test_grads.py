"""Tests for `jaxamp.scaled_value_and_grad`, underflow made visible included."""

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import jmp
import numpy as np
import pytest

import jaxamp

LOSS_SCALES = {
    "no_op": jaxamp.NoOpLossScale(),
    "static": jaxamp.StaticLossScale(2.0**10),
    "dynamic": jaxamp.DynamicLossScale(2.0**15),
    "jmp_static": jmp.StaticLossScale(jnp.float32(2.0**8)),
}
PARAMS = {"w": jnp.array([0.5, -1.0, 2.0]), "b": jnp.array(0.25)}
INPUTS = jnp.array([1.0, 2.0, 3.0])


def squared_error(params, inputs):
    return jnp.sum((params["w"] * inputs + params["b"] - 1.0) ** 2)


def squared_error_with_aux(params, inputs):
    predictions = params["w"] * inputs + params["b"]
    return jnp.sum((predictions - 1.0) ** 2), {"predictions": predictions}


def assert_trees_equal(actual, expected):
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    for got, want in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("name", sorted(LOSS_SCALES))
def test_value_is_unscaled_and_float32_grads_equal_jax_value_and_grad(name):
    value, grads, grads_finite = jaxamp.scaled_value_and_grad(squared_error, LOSS_SCALES[name])(
        PARAMS, INPUTS
    )
    expected_value, expected_grads = jax.value_and_grad(squared_error)(PARAMS, INPUTS)
    # A power-of-two scale multiplies and divides float32 exactly.
    assert value == expected_value
    assert_trees_equal(grads, expected_grads)
    assert (grads_finite.shape, grads_finite.dtype, bool(grads_finite)) == ((), jnp.bool_, True)


@pytest.mark.parametrize("name", sorted(LOSS_SCALES))
def test_has_aux_returns_the_loss_and_aux_unscaled(name):
    fun = jaxamp.scaled_value_and_grad(squared_error_with_aux, LOSS_SCALES[name], has_aux=True)
    (loss, aux), grads, grads_finite = fun(PARAMS, INPUTS)
    (expected_loss, expected_aux), expected_grads = jax.value_and_grad(squared_error_with_aux, has_aux=True)(
        PARAMS, INPUTS
    )
    assert loss == expected_loss
    assert_trees_equal(aux, expected_aux)
    assert_trees_equal(grads, expected_grads)
    assert grads_finite


@pytest.mark.parametrize("argnums", [1, (0, 1), (1, 0)])
def test_argnums_selects_the_arguments_to_differentiate(argnums):
    fun = jaxamp.scaled_value_and_grad(squared_error, LOSS_SCALES["dynamic"], argnums=argnums)
    value, grads, grads_finite = fun(PARAMS, INPUTS)
    expected_value, expected_grads = jax.value_and_grad(squared_error, argnums=argnums)(PARAMS, INPUTS)
    assert value == expected_value
    assert_trees_equal(grads, expected_grads)
    assert grads_finite


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_grads_come_back_in_the_dtype_of_their_argument(dtype):
    params = {"half": jnp.array([0.5, 1.0], dtype), "full": jnp.array([2.0])}

    def loss(params):
        return jnp.sum(params["half"].astype(jnp.float32) ** 2) + jnp.sum(params["full"] ** 2)

    value, grads, grads_finite = jaxamp.scaled_value_and_grad(loss, jaxamp.DynamicLossScale(2.0**10))(params)
    assert value.dtype == jnp.float32
    assert (grads["half"].dtype, grads["full"].dtype) == (dtype, jnp.float32)
    np.testing.assert_array_equal(grads["half"], jnp.array([1.0, 2.0], dtype))
    np.testing.assert_array_equal(grads["full"], [4.0])
    assert grads_finite


def float16_mean(x):
    return jnp.mean(x.astype(jnp.float16))


def float32_mean_of_float16(x):
    return jnp.mean(x.astype(jnp.float16).astype(jnp.float32))


@pytest.mark.parametrize(
    "loss_fn, scale, finite",
    [
        (float16_mean, 2.0**15, True),
        (float16_mean, 2.0**16, False),
        (float32_mean_of_float16, 2.0**16, True),
    ],
    ids=["float16_loss_2_15", "float16_loss_2_16", "float32_loss_2_16"],
)
def test_the_backward_pass_starts_from_the_scale_in_the_losss_dtype(loss_fn, scale, finite):
    # The first cotangent is the scale itself, in the loss's dtype: 2**16 is
    # inf in float16, so a float16 loss overflows at the first backward step.
    # A float32 loss carries 2**16 through the mean, and the float16 ops below
    # it get 2**16 / 4, which fits.
    loss_scale = jaxamp.StaticLossScale(scale)
    value, grads, grads_finite = jaxamp.scaled_value_and_grad(loss_fn, loss_scale)(jnp.full(4, 1.0))
    assert (value.dtype, value.item()) == (loss_fn(jnp.ones(1)).dtype, 1.0)
    assert bool(grads_finite) is finite
    if finite:
        np.testing.assert_array_equal(grads, jnp.full(4, 0.25))
    else:
        assert np.all(np.isinf(grads))


def float16_square(x):
    """A loss whose backward pass runs in float16: d/dx = 2x, times the scale."""
    half = x.astype(jnp.float16)
    return jnp.sum(half * half).astype(jnp.float32)


def exp_overflow(x):
    return jnp.sum(jnp.exp(x))


def nan_loss(x):
    return jnp.sum(jnp.sqrt(x))


@pytest.mark.parametrize(
    "fun, x, loss_scale, finite",
    [
        (float16_square, 100.0, jaxamp.NoOpLossScale(), True),
        (float16_square, 100.0, jaxamp.DynamicLossScale(2.0**15), False),
        (float16_square, 100.0, jaxamp.StaticLossScale(2.0**15), False),
        (exp_overflow, 100.0, jaxamp.NoOpLossScale(), False),
        (exp_overflow, 100.0, jaxamp.DynamicLossScale(2.0**15), False),
        (nan_loss, -1.0, jaxamp.NoOpLossScale(), False),
        (nan_loss, -1.0, jaxamp.DynamicLossScale(2.0**15), False),
    ],
    ids=[
        "float16_backward_fits_unscaled",
        "float16_backward_overflows_under_dynamic_scale",
        "float16_backward_overflows_under_static_scale",
        "loss_overflows_float32",
        "loss_overflows_float32_under_scale",
        "nan_loss",
        "nan_loss_under_scale",
    ],
)
def test_grads_finite_reports_overflow_and_nan(fun, x, loss_scale, finite):
    _, grads, grads_finite = jax.jit(jaxamp.scaled_value_and_grad(fun, loss_scale))(jnp.full(3, x))
    assert bool(grads_finite) is finite
    assert bool(jnp.all(jnp.isfinite(grads))) is finite


def test_the_loss_scale_can_be_a_traced_argument_of_a_jitted_step():
    @jax.jit
    def step(params, loss_scale):
        return jaxamp.scaled_value_and_grad(squared_error, loss_scale)(params, INPUTS)

    value, grads, _ = step(PARAMS, jaxamp.DynamicLossScale(2.0**12))
    expected_value, expected_grads = jax.value_and_grad(squared_error)(PARAMS, INPUTS)
    assert value == expected_value
    assert_trees_equal(grads, expected_grads)


def test_keyword_arguments_reach_the_loss_function():
    fun = jaxamp.scaled_value_and_grad(squared_error, LOSS_SCALES["dynamic"])
    value, grads, _ = fun(PARAMS, inputs=INPUTS)
    expected_value, expected_grads = jax.value_and_grad(squared_error)(PARAMS, INPUTS)
    assert value == expected_value
    assert_trees_equal(grads, expected_grads)


def test_a_non_scalar_loss_is_a_type_error():
    fun = jaxamp.scaled_value_and_grad(lambda x: x**2, jaxamp.NoOpLossScale())
    message = (
        "scaled_value_and_grad needs fun to return a scalar loss; got shape (3,). "
        "Reduce it (e.g. with .mean()) first."
    )
    with pytest.raises(TypeError, match=f"^{re.escape(message)}(\n|$)"):
        fun(jnp.ones(3))


def test_has_aux_needs_a_loss_aux_pair():
    fun = jaxamp.scaled_value_and_grad(lambda x: [jnp.sum(x)], jaxamp.NoOpLossScale(), has_aux=True)
    message = "scaled_value_and_grad(has_aux=True) needs fun to return a (loss, aux) pair; it returned list."
    # JAX appends a note on its filtered traceback after the message.
    with pytest.raises(TypeError, match=f"^{re.escape(message)}(\n|$)"):
        fun(jnp.ones(3))


@pytest.mark.parametrize(
    "loss_scale, hint",
    [
        (2.0, " For a fixed scale of 2.0 pass jaxamp.StaticLossScale(2.0)."),
        (None, ""),
        (jnp.float32(2.0), ""),
    ],
)
def test_something_that_is_no_loss_scale_is_a_type_error_naming_the_type_needed(loss_scale, hint):
    """It was AttributeError: 'float' object has no attribute 'scale', at the first call."""
    message = (
        "scaled_value_and_grad needs a loss scale (jaxamp.NoOpLossScale, StaticLossScale or "
        f"DynamicLossScale, or a jmp loss scale) as loss_scale; got {loss_scale!r} of type "
        f"{type(loss_scale).__name__}.{hint}"
    )
    with pytest.raises(TypeError, match=f"^{re.escape(message)}$"):
        jaxamp.scaled_value_and_grad(lambda x: jnp.sum(x), loss_scale)


# --- underflow made visible --------------------------------------------------------


class TinyMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(2)(nn.tanh(nn.Dense(8)(x)))


# Multiplying the loss by 1e-8 makes every per-element gradient about 1e-9 to
# 1e-11, far below float16's smallest subnormal (about 6e-8): the float16
# backward pass rounds the incoming cotangent itself to zero.
TINY = 1e-8
# Scaled float16 gradients must match the float32 ones to 1% of each leaf's
# largest float32 gradient (float16 keeps 11 significant bits).
TOLERANCE = 1e-2


def tiny_loss(model, inputs):
    def loss(params):
        return TINY * jnp.mean((model.apply({"params": params}, inputs) - 1.0) ** 2)

    return loss


@pytest.fixture(scope="module")
def underflow_setup():
    inputs = jax.random.normal(jax.random.key(1), (4, 3))
    params = TinyMLP().init(jax.random.key(0), inputs)["params"]
    float32_grads = jax.jit(jax.grad(tiny_loss(TinyMLP(), inputs)))(params)
    mixed = jaxamp.apply_policy(TinyMLP(), "mixed_float16")
    return params, tiny_loss(mixed, inputs), float32_grads


def test_float16_gradients_flush_to_zero_without_loss_scaling(underflow_setup):
    params, mixed_loss, float32_grads = underflow_setup
    _, grads, grads_finite = jax.jit(jaxamp.scaled_value_and_grad(mixed_loss, jaxamp.NoOpLossScale()))(params)
    for float32_grad, grad in zip(jax.tree.leaves(float32_grads), jax.tree.leaves(grads), strict=True):
        # Real, non-zero gradients, every one below float16's smallest subnormal.
        assert 0 < float(jnp.max(jnp.abs(float32_grad))) < 2.0**-24
        assert grad.dtype == jnp.float32
        np.testing.assert_array_equal(grad, jnp.zeros_like(grad))
    # Zeros are finite: nothing but the comparison with float32 shows the loss.
    assert grads_finite


@pytest.mark.parametrize(
    "loss_scale",
    [jaxamp.DynamicLossScale(), jaxamp.StaticLossScale(2.0**15)],
    ids=["dynamic", "static"],
)
def test_loss_scaling_recovers_the_float32_gradients(underflow_setup, loss_scale):
    params, mixed_loss, float32_grads = underflow_setup
    _, grads, grads_finite = jax.jit(jaxamp.scaled_value_and_grad(mixed_loss, loss_scale))(params)
    assert grads_finite
    for float32_grad, grad in zip(jax.tree.leaves(float32_grads), jax.tree.leaves(grads), strict=True):
        assert grad.dtype == jnp.float32
        scale = float(jnp.max(jnp.abs(float32_grad)))
        np.testing.assert_allclose(grad, float32_grad, rtol=0, atol=TOLERANCE * scale)
