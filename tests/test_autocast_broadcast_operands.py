"""Per-feature float32 values follow the float16 activation they meet; statistics stay float32.

Under `jaxamp.autocast` a bias, a normalization's scale and offset and its
float32 mean and variance are broadcast along the activation's other axes;
an elementwise op of such a value and a float16 activation gives float16,
computed in float32 and rounded once per chain (`jaxamp._autocast.rules.follow`).
A broadcast literal (``lax.full_like(g, 0)``) is as weak as the literal, and
a custom JVP (``jax.nn.relu``) is rewritten for its inputs' current dtypes
(`jaxamp._autocast.higher_order.custom_jvp_rule`). Each test here fails on
the rules before that change (run against its parent commit).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from test_autocast_rule_classes import all_equations

import jaxamp


def equations(fun, *args, primitive):
    return [eq for eq in all_equations(jax.make_jaxpr(fun)(*args).jaxpr) if eq.primitive.name == primitive]


def floating_dtypes(atoms) -> set:
    return {atom.aval.dtype for atom in atoms if jnp.issubdtype(atom.aval.dtype, jnp.floating)}


X = jax.random.normal(jax.random.key(0), (16, 8))
W = jax.random.normal(jax.random.key(1), (8, 8)) / 3
BIAS = jnp.linspace(-1.0, 1.0, 8)


def test_a_float32_bias_added_to_a_float16_matmul_result_gives_float16():
    """The next op (``tanh``, which follows) sees float16; before, the bias made the sum float32."""
    (tanh,) = equations(jaxamp.autocast(lambda x, w, b: jnp.tanh(x @ w + b)), X, W, BIAS, primitive="tanh")
    assert floating_dtypes(tanh.invars) == {jnp.dtype(jnp.float16)}


def test_two_full_size_operands_still_promote_to_the_wider():
    """A float32 activation of the result's shape is no per-feature value: the sum stays float32.

    Traced in float16, the argument ``x`` is a float16 value of the program
    whose float32 original the sum reads: the sum is computed in float32 and
    rounded to float16, as ``x`` cast at entry would give.
    """
    fun = lambda x, w: jnp.tanh(x @ w + x)
    (tanh,) = equations(jaxamp.autocast(fun, float32_argnums=0), X, W, primitive="tanh")
    assert floating_dtypes(tanh.invars) == {jnp.dtype(jnp.float32)}
    (tanh,) = equations(jaxamp.autocast(fun), X, W, primitive="tanh")
    assert floating_dtypes(tanh.invars) == {jnp.dtype(jnp.float16)}


def normalize(h, scale, bias):
    """A batch norm written by hand: statistics of `h`, then per-feature ops."""
    mean = jnp.mean(h, axis=0, keepdims=True)
    variance = jnp.mean(jnp.square(h - mean), axis=0, keepdims=True)
    return (h - mean) * (lax.rsqrt(variance + 1e-5) * scale) + bias


def test_a_normalization_of_a_float16_activation_is_float16_rounded_once_from_float32():
    """Equal to the float32 normalization of the float16 matmul result, rounded once.

    Rounding after each of its three per-feature ops, or not at all (the old
    rule: a float32 result), differs from it.
    """
    x = jax.random.normal(jax.random.key(2), (64, 8)) * 3 + 5
    scale = jnp.linspace(0.5, 2.0, 8)

    def layer(x, w, scale, bias):
        return normalize(x @ w, scale, bias)

    then_tanh = jaxamp.autocast(lambda *args: jnp.tanh(layer(*args)))
    (tanh,) = equations(then_tanh, x, W, scale, BIAS, primitive="tanh")
    assert floating_dtypes(tanh.invars) == {jnp.dtype(jnp.float16)}
    h = jnp.dot(x.astype(jnp.float16), W.astype(jnp.float16), preferred_element_type=jnp.float16)
    expected = normalize(h.astype(jnp.float32), scale, BIAS).astype(jnp.float16)
    # The program reads the value rounded once (an op after it, here `* 1.0`, takes it in float16);
    # handed back in float32, the layer's own output is float32's, unrounded.
    read_on = jaxamp.autocast(lambda *args: layer(*args) * 1.0)(x, W, scale, BIAS)
    np.testing.assert_array_equal(read_on, expected.astype(jnp.float32))
    handed_back = jaxamp.autocast(layer)(x, W, scale, BIAS)
    np.testing.assert_allclose(handed_back, normalize(h.astype(jnp.float32), scale, BIAS), rtol=1e-6)


def test_batchnorm_statistics_and_running_averages_stay_float32_while_its_output_is_float16():
    class ConvBatchNorm(nn.Module):
        @nn.compact
        def __call__(self, x):
            y = nn.BatchNorm(use_running_average=False)(nn.Conv(8, (3, 3))(x))
            return jnp.tanh(y)

    images = jax.random.normal(jax.random.key(3), (4, 8, 8, 3))
    model = ConvBatchNorm()
    variables = model.init(jax.random.key(4), images)
    fun = jaxamp.autocast(lambda v, x: model.apply(v, x, mutable=["batch_stats"]))
    (tanh,) = equations(fun, variables, images, primitive="tanh")
    assert floating_dtypes(tanh.invars) == {jnp.dtype(jnp.float16)}
    sums = equations(fun, variables, images, primitive="reduce_sum")
    assert len(sums) == 2  # the mean and the mean of squares
    for reduction in sums:
        assert (
            floating_dtypes(reduction.invars)
            == floating_dtypes(reduction.outvars)
            == {jnp.dtype(jnp.float32)}
        )
    (output, updates), (want, want_updates) = (
        fun(variables, images),
        model.apply(variables, images, mutable=["batch_stats"]),
    )
    assert jax.tree.map(lambda leaf: leaf.dtype, updates) == jax.tree.map(
        lambda leaf: leaf.dtype, want_updates
    )
    np.testing.assert_allclose(output, want, atol=2e-2)
    for got, expected in zip(jax.tree.leaves(updates), jax.tree.leaves(want_updates)):
        np.testing.assert_allclose(got, expected, rtol=1e-2, atol=1e-3)


@pytest.mark.parametrize("float32_argnums", [(), (0, 1)], ids=["traced in float16", "traced as given"])
def test_a_broadcast_zero_is_as_weak_as_the_literal(float32_argnums):
    """``lax.full_like(g, 0)`` (relu's derivative) no longer pulls a float16 select to float32.

    Traced as given (``float32_argnums``), the zero is a float32 broadcast
    while the matmul result it meets runs in float16: the interpreter must
    remember which literal it broadcasts for the select to take it as weak.
    """

    def masked(x, w):
        h = x @ w
        return lax.select(h > 0, h, lax.full_like(h, 0.0))

    fun = jaxamp.autocast(masked, float32_argnums=float32_argnums)
    (select,) = equations(fun, X, W, primitive="select_n")
    assert floating_dtypes(select.invars) == {jnp.dtype(jnp.float16)}


# Traced in float16, JAX itself casts -1e9 to float16 (-inf), and numpy warns of the overflow: expected.
@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
@pytest.mark.parametrize("float32_argnums", [(), (0, 1)], ids=["traced in float16", "traced as given"])
def test_a_broadcast_literal_float16_cannot_hold_keeps_the_select_in_float32(float32_argnums):
    """The fill is float32's -1e9 as written, whatever the trace rounded it to, which keeps the select
    in float32 and the result finite."""

    def masked(x, w):
        h = x @ w
        return lax.select(h > 0, h, lax.full_like(h, -1e9))

    fun = jaxamp.autocast(masked, float32_argnums=float32_argnums)
    (select,) = equations(fun, X, W, primitive="select_n")
    assert floating_dtypes(select.invars) == {jnp.dtype(jnp.float32)}
    assert bool(jnp.all(jnp.isfinite(fun(X, W))))


def test_relu_of_float16_and_its_derivative_stay_float16_and_match_float32():
    """``jax.nn.relu`` is a custom JVP: its body and its rule follow the float16 input."""

    def loss(w, x):
        return jnp.sum(jax.nn.relu(x @ w) @ w)

    grad = jax.grad(jaxamp.autocast(loss))
    (relu_call,) = equations(jaxamp.autocast(loss), W, X, primitive="custom_jvp_call")
    assert floating_dtypes(relu_call.outvars) == {jnp.dtype(jnp.float16)}
    selects = equations(grad, W, X, primitive="select_n")
    assert selects
    for select in selects:
        assert floating_dtypes(select.invars) == {jnp.dtype(jnp.float16)}, select
    np.testing.assert_allclose(grad(W, X), jax.grad(loss)(W, X), rtol=2e-2, atol=2e-2)
    # relu's derivative at 0 is the user's rule (0), not max's tie-splitting 0.5.
    at_zero = jax.grad(jaxamp.autocast(lambda x: jnp.sum(jax.nn.relu(x))))(jnp.zeros(4))
    np.testing.assert_array_equal(at_zero, np.zeros(4))
