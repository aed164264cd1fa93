"""Where the engine reads what the program wrote, and what it hands back.

* literals the half trace rounded, read as written in a ``cond`` branch or a loop body, after a
  step only the half trace takes, in every layer of a long program, and without a warning;
* what a float32 island and a matmul inside a ``custom_jvp`` hand on;
* the dtypes a model's outputs come back in: each output of a model with two heads, and a float32
  statistic under a policy whose output dtype is half, by both Flax routes.
"""

from __future__ import annotations

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import lax

import jaxamp
from jaxamp._autocast import reference
from jaxamp._autocast.reference import LiteralNotRecoveredWarning

ROW_OF_ZEROS = jnp.zeros((2, 4)).at[0].set(1.0)


def log_energy(h):
    return jnp.log(h * h + 1e-12)


# --- literals read as written, wherever the half trace holds them ----------------------------------


@pytest.mark.parametrize(
    "body",
    [
        pytest.param(lambda h: lax.cond(True, log_energy, lambda h: h, h), id="cond-branch"),
        pytest.param(lambda h: lax.fori_loop(0, 1, lambda _, h: log_energy(h), h), id="scan-body"),
        pytest.param(
            lambda h: lax.while_loop(lambda c: c[0] < 1, lambda c: (c[0] + 1, log_energy(c[1])), (0, h))[1],
            id="while-body",
        ),
    ],
)
def test_an_epsilon_inside_a_branch_or_a_loop_body_keeps_its_value(body):
    """``log(h*h + 1e-12)`` of a zero is -27.6 inside a ``cond`` branch or a loop body, as at the
    top level (``1e-12`` is 0 in float16: -inf)."""
    got = jaxamp.autocast(body, "mixed_float16")(ROW_OF_ZEROS)
    np.testing.assert_allclose(got, body(ROW_OF_ZEROS), rtol=1e-3)


def rounded_in_half_only(x):
    if x.dtype != jnp.float32:  # a step the program takes only for half inputs
        x = jnp.round(x * 1.0)
    return jnp.mean(x * 1.0004)


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_a_step_only_the_half_trace_takes_keeps_its_own_literal_and_the_next_lines(policy):
    """The half trace's extra ``x * 1.0`` has no twin in the reference; the ``x * 1.0004`` after
    the rounding reads 1.0004 (1.0 in both half dtypes). Given to the extra step instead, 1.0004
    would be rounded away: 3.0, not 3.0012."""
    got = jaxamp.autocast(rounded_in_half_only, policy)(jnp.array([2.6, 2.6]))
    np.testing.assert_allclose(got, 3.0 * 1.0004, rtol=1e-7)


def deep_stack(x):
    h = jnp.mean(x, axis=-1)  # a half mean: the half trace casts around it, the reference does not
    for _ in range(250):  # the same line run once per layer
        h = h * 1.0004
    return h


def test_a_literal_written_once_per_layer_of_a_deep_stack_is_read_as_written_in_every_layer():
    """A program of hundreds of equations whose keys repeat (one line per layer) pairs each layer's
    ``1.0004`` (1.0 in float16) with its twin: 1.0004**250, not 1."""
    x = jnp.array([1.0, 3.0])
    got = jaxamp.autocast(deep_stack, "mixed_float16")(x)
    np.testing.assert_allclose(got, deep_stack(x), rtol=1e-6)


def test_a_literal_read_as_written_says_nothing():
    """Recovering a literal is the normal case: no `LiteralNotRecoveredWarning` (the warning is
    once per process, so an earlier one is forgotten first)."""
    reference._warn_once.cache_clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error", LiteralNotRecoveredWarning)
        got = jaxamp.autocast(log_energy, "mixed_float16")(ROW_OF_ZEROS)
    assert np.isfinite(np.asarray(got)).all()


# --- what islands and custom rules hand on ---------------------------------------------------


def scaled_in_an_island(x, w):
    h = x @ w
    with jaxamp.float32_scope():
        return h * 1000.0


def test_a_float32_islands_output_comes_back_in_float32_where_half_cannot_hold_it():
    """Half arguments, the last op in a float32 island: 2e5 comes back in float32, not as
    float16's inf."""
    x, w = jnp.full((1, 2), 10.0, jnp.float16), jnp.full((2, 2), 10.0, jnp.float16)
    got = jaxamp.autocast(scaled_in_an_island, "mixed_float16")(x, w)
    assert got.dtype == jnp.float32
    np.testing.assert_array_equal(got, np.full((1, 2), 2e5))


@jax.custom_jvp
def float32_dense(x, w):
    return x.astype(jnp.float32) @ w.astype(jnp.float32)  # a layer written to ask for float32


float32_dense.defjvp(lambda p, t: (float32_dense(*p), float32_dense(t[0], p[1]) + float32_dense(p[0], t[1])))


def test_a_matmul_inside_a_custom_jvp_hands_on_the_compute_dtype():
    """A matmul computes and returns the compute dtype inside a custom derivative too: the tanh
    after it reads float16, as after the same matmul written inline."""
    inline = lambda x, w: jnp.tanh(x.astype(jnp.float32) @ w.astype(jnp.float32))  # noqa: E731
    wrapped = lambda x, w: jnp.tanh(float32_dense(x, w))  # noqa: E731
    x, w = jnp.ones((2, 4)), jnp.ones((4, 4))
    for function in (inline, wrapped):
        closed = jax.make_jaxpr(jaxamp.autocast(function, "mixed_float16"))(x, w)
        (tanh,) = [equation for equation in closed.jaxpr.eqns if equation.primitive.name == "tanh"]
        assert tanh.invars[0].aval.dtype == jnp.float16


# --- a model's outputs come back in the output dtype ------------------------------------------------


class TwoHeads(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = jnp.asarray(nn.LayerNorm(dtype=jnp.float32)(x), jnp.float32)
        return nn.Dense(3)(x), nn.Dense(2)(h)  # the second head reads float32: traced in float32


def test_every_output_of_a_model_with_two_heads_comes_back_in_the_output_dtype():
    x = jnp.ones((2, 4))
    variables = TwoHeads().init(jax.random.key(0), x)
    outputs = jaxamp.apply_policy(TwoHeads(), "mixed_float16").apply(variables, x)
    assert [output.dtype for output in outputs] == [jnp.float32, jnp.float32]


class Pooled(nn.Module):
    @nn.compact
    def __call__(self, x):
        return jnp.mean(nn.Dense(3)(x).astype(jnp.float32), axis=-1)  # a float32 statistic


class NnxPooled(nnx.Module):
    def __init__(self):
        self.dense = nnx.Linear(4, 3, rngs=nnx.Rngs(0))

    def __call__(self, x):
        return jnp.mean(self.dense(x).astype(jnp.float32), axis=-1)


def pooled_under(route: str, policy):
    x = jnp.ones((2, 4))
    if route == "linen":
        variables = Pooled().init(jax.random.key(0), x)
        return jaxamp.apply_policy(Pooled(), policy).apply(variables, x)
    return jaxamp.apply_policy(NnxPooled(), policy)(x)


@pytest.mark.parametrize("route", ["linen", "nnx"])
def test_a_float32_statistic_a_model_returns_comes_back_in_a_half_output_dtype(route):
    """Under a policy whose output dtype is float16, a model that returns a float32 mean gives
    float16, as the policy says (the rules keep a statistic in float32 inside the program)."""
    got = pooled_under(route, jaxamp.get_policy("p=f32,c=f16,o=f16"))
    assert got.dtype == jnp.float16
