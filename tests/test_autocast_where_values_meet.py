"""What ``torch.autocast`` means, where a program's values meet: five classes that differed from it.

Each scenario runs in float16 and bfloat16, by both routes (`jaxamp.autocast` of a function,
`jaxamp.apply_policy` of a Flax model) where both apply, against float32:

1. a constant that enters a nested ``jit``, a ``custom_jvp`` or an integer cast as an argument
   (``jnp.clip(x, 0, 4095)``: the bound reaches ``clip``'s own ``jit`` as an integer);
2. a matmul or convolution whose operands are float32 returns the compute dtype, and so does
   what a layer captures or sows of it;
3. an additive mask built inside the function from constants, with fully masked rows;
4. two calls of one library function whose bodies hold literals (``jnp.where`` twice);
5. a float32 value meeting a half one: a result handed back in float32 is float32's, and a
   difference of products rounds once.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxamp

POLICIES = ["mixed_float16", "mixed_bfloat16"]
HALF = {"mixed_float16": jnp.dtype(jnp.float16), "mixed_bfloat16": jnp.dtype(jnp.bfloat16)}
# The largest integer each half dtype holds with all the integers below it, plus the next odd one.
PAST_EXACT = {"mixed_float16": 4095, "mixed_bfloat16": 257}


def under(route: str, policy: str, function, *args):
    """`function(*args)` by `route`: autocast of the function, or apply_policy of a linen module
    that calls it on its inputs."""
    if route == "autocast":
        return jaxamp.autocast(function, policy)(*args)

    class Model(nn.Module):
        @nn.compact
        def __call__(self, *inputs):
            return function(*inputs)

    model = jaxamp.apply_policy(Model(), policy)
    return model.apply({}, *args)


# --- 1. constants entering a nested call ----------------------------------------------------------


@pytest.mark.parametrize("route", ["autocast", "apply_policy"])
@pytest.mark.parametrize("policy", POLICIES)
def test_a_bound_that_enters_clip_keeps_its_value(policy, route):
    """``jnp.clip(x, 0, 4095)`` bounds by 4095 (4096 in float16 before), ``clip(x, 0, 257)`` by
    257 under bfloat16 (256 before): the bound enters ``clip``'s ``jit`` as an integer argument."""
    bound = PAST_EXACT[policy]
    x = jnp.array([bound + 1000.0, float(bound), 1.0])
    got = under(route, policy, lambda x: jnp.clip(x, 0, bound), x)
    np.testing.assert_array_equal(got, [bound, bound, 1.0])


@pytest.mark.parametrize("policy", POLICIES)
def test_a_jitted_minimum_with_a_python_integer_keeps_the_integer(policy):
    bound = PAST_EXACT[policy]
    x = jnp.array([bound + 1000.0, 3.0])
    got = jaxamp.autocast(lambda x: jax.jit(jnp.minimum)(x, bound), policy)(x)
    np.testing.assert_array_equal(got, [bound, 3.0])


@pytest.mark.parametrize("route", ["autocast", "apply_policy"])
@pytest.mark.parametrize("policy", POLICIES)
def test_one_hot_of_a_clipped_position_keeps_its_last_row(policy, route):
    """``one_hot(clip(pos, 0, 4095).astype(int), 4096)``: position 4095 (and anything past it) is
    the last row, as in float32; a bound rounded to 4096 put them past the table."""
    depth = PAST_EXACT[policy] + 1
    positions = jnp.array([depth - 1.0, depth + 50.0, 3.0])
    got = under(route, policy, lambda pos: jax.nn.one_hot(jnp.clip(pos, 0, depth - 1).astype(int), depth), positions)
    np.testing.assert_array_equal(got[:, -1], [1.0, 1.0, 0.0])


def normalized_by_jitted_epsilon(h):
    """An epsilon handed to a jitted helper as an argument, as a library's norm takes it."""
    scale = jax.jit(lambda h, eps: jax.lax.rsqrt(jnp.mean(h * h, axis=-1) + eps))
    return scale(h, 1e-12)


@pytest.mark.parametrize("route", ["autocast", "apply_policy"])
@pytest.mark.parametrize("policy", POLICIES)
def test_an_epsilon_passed_into_a_jit_keeps_its_value(policy, route):
    """A row of zeros normalizes by ``rsqrt(1e-12)`` = 1e6, not ``rsqrt(0)`` = inf: the epsilon
    reaches the body as a float32 argument, which the body casts to half (0 in float16)."""
    h = jnp.zeros((2, 4)).at[0].set(1.0)
    got = under(route, policy, normalized_by_jitted_epsilon, h)
    np.testing.assert_allclose(got, [1.0, 1e6], rtol=1e-6)


@jax.custom_jvp
def safe_sqrt(x, eps):
    return jnp.sqrt(x + eps)


@safe_sqrt.defjvp
def _safe_sqrt_jvp(primals, tangents):
    x, eps = primals
    dx, _ = tangents
    y = safe_sqrt(x, eps)
    return y, dx / (2 * y)


@pytest.mark.parametrize("policy", POLICIES)
def test_an_epsilon_passed_into_a_custom_jvp_keeps_its_value(policy):
    """``sqrt(h*h + 1e-8)`` of a zero activation is 1e-4 (0 where the epsilon was cast to float16),
    and its gradient finite."""

    def f(x, w):
        h = x @ w
        return safe_sqrt(h * h, 1e-8)

    x, w = jnp.zeros((1, 2)), jnp.ones((2, 2))
    got = jaxamp.autocast(f, policy)(x, w)
    np.testing.assert_allclose(got, np.full((1, 2), 1e-4), rtol=float(jnp.finfo(HALF[policy]).eps))
    grads = jax.grad(lambda x, w: jaxamp.autocast(f, policy)(x, w).sum())(x, w)
    assert np.isfinite(np.asarray(grads)).all()


# --- 2. matmuls and convolutions return the compute dtype -----------------------------------------


class Float32Norm(nn.Module):
    """A model's own normalization that computes in float32 and returns float32 (as flaxmodels'
    BatchNorm does), so the convolution after it is traced with float32 operands."""

    @nn.compact
    def __call__(self, x):
        x = jnp.asarray(x, jnp.float32)
        mean = jnp.mean(x, axis=(0, 1, 2))
        var = jnp.var(x, axis=(0, 1, 2))
        return jnp.asarray((x - mean) * jax.lax.rsqrt(var + 1e-5), jnp.float32)


class ConvNet(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(Float32Norm()(nn.Conv(8, (3, 3), use_bias=False)(x)))
        x = nn.Conv(8, (3, 3), use_bias=False)(x)
        self.sow("intermediates", "after_second_conv", x)
        return nn.Dense(4)(x.mean(axis=(1, 2)))


@pytest.mark.parametrize("policy", POLICIES)
def test_a_convolution_after_a_float32_norm_returns_the_compute_dtype(policy):
    """Both convolutions compute and return the compute dtype, as ``torch.autocast``'s do; their
    captured and sown values are in it too, the model's own float32 norm's in float32, and the
    model's output in the policy's output dtype."""
    x = jax.random.normal(jax.random.key(0), (2, 8, 8, 3))
    variables = ConvNet().init(jax.random.key(1), x)
    model = jaxamp.apply_policy(ConvNet(), policy)
    out, state = model.apply(variables, x, capture_intermediates=True, mutable=["intermediates"])
    captured = state["intermediates"]
    assert out.dtype == jnp.float32
    assert captured["Conv_0"]["__call__"][0].dtype == HALF[policy]
    assert captured["Conv_1"]["__call__"][0].dtype == HALF[policy]
    assert captured["after_second_conv"][0].dtype == HALF[policy]
    assert captured["Float32Norm_0"]["__call__"][0].dtype == jnp.float32


@pytest.mark.parametrize("policy", POLICIES)
def test_a_matmul_of_float32_operands_computes_and_returns_half_inside_the_program(policy):
    """The program's own ``astype(float32)`` before a matmul does not keep the matmul in float32:
    its operands and result are half in the rewritten program (its output, handed back, float32)."""

    def f(x, w):
        return jnp.tanh(x.astype(jnp.float32) @ w.astype(jnp.float32))

    jaxpr = jax.make_jaxpr(jaxamp.autocast(f, policy))(jnp.ones((2, 3)), jnp.ones((3, 4)))
    (dot,) = [eqn for eqn in jaxpr.jaxpr.eqns if eqn.primitive.name == "dot_general"]
    assert [var.aval.dtype for var in (*dot.invars, *dot.outvars)] == [HALF[policy]] * 3
    (tanh,) = [eqn for eqn in jaxpr.jaxpr.eqns if eqn.primitive.name == "tanh"]
    assert tanh.outvars[0].aval.dtype == HALF[policy]


# --- 3. masks built inside the function -----------------------------------------------------------

T, D = 4, 8


def attention_with_an_inner_mask(x, pad, wq, wk):
    """A Haiku-style attention that builds its causal and padding mask itself."""
    causal = jnp.tril(jnp.ones((T, T), bool))
    valid = causal[None] & pad[:, None, :] & pad[:, :, None]
    scores = jnp.einsum("btd,bsd->bts", x @ wq, x @ wk) / math.sqrt(D)
    return jax.nn.softmax(scores + jnp.where(valid, 0.0, -1e9), axis=-1)


@pytest.mark.parametrize("route", ["autocast", "apply_policy"])
@pytest.mark.parametrize("policy", POLICIES)
def test_an_additive_mask_built_inside_the_function_gives_float32s_rows(policy, route):
    """Padded query rows are fully masked: uniform, as in float32 (NaN under float16 before)."""
    keys = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(keys[0], (2, T, D))
    wq, wk = (jax.random.normal(key, (D, D)) / math.sqrt(D) for key in keys[1:])
    pad = jnp.array([[True, True, True, False], [True, True, False, False]])
    expected = attention_with_an_inner_mask(x, pad, wq, wk)
    got = under(route, policy, attention_with_an_inner_mask, x, pad, wq, wk)
    assert np.isfinite(np.asarray(got)).all()
    np.testing.assert_allclose(got[0, 3], np.full(T, 0.25), rtol=1e-6)
    np.testing.assert_allclose(got[1, 2:], np.full((2, T), 0.25), rtol=1e-6)
    np.testing.assert_allclose(got, expected, atol=2e-2)


# --- 4. repeated library calls --------------------------------------------------------------------

KEEP = jnp.array([[True, True, False, False], [False] * 4])
FILL = jnp.zeros((2, 4))


def where_twice(x, w):
    """``jnp.where`` twice: first against a float32 array (the half trace adds a cast in its body),
    then with a -1e9 fill; the second call's literal must pair with the second call's."""
    h = x @ w
    kept = jnp.where(KEEP, h, FILL)
    return jax.nn.softmax(jnp.where(KEEP, h, -1e9), axis=-1), kept


@pytest.mark.parametrize("policy", POLICIES)
def test_two_calls_of_where_each_read_their_own_fill(policy):
    probabilities, kept = jaxamp.autocast(where_twice, policy)(jnp.ones((2, 3)), jnp.ones((3, 4)))
    np.testing.assert_allclose(probabilities[0], [0.5, 0.5, 0.0, 0.0], atol=1e-6)
    np.testing.assert_allclose(probabilities[1], np.full(4, 0.25), rtol=1e-6)
    np.testing.assert_array_equal(kept, [[3.0, 3.0, 0.0, 0.0], [0.0] * 4])


# --- 5. float32 meeting half ----------------------------------------------------------------------


@pytest.mark.parametrize("policy", POLICIES)
def test_a_sum_handed_back_in_float32_is_float32s(policy):
    """``x + y`` of a float32 70000 and a half 1, returned in float32: 70001, as torch's promotion
    gives (inf in float16 before: the sum was rounded to half before it was widened)."""
    got = jaxamp.autocast(jnp.add, policy)(jnp.float32(70000.0), jnp.asarray(1.0, HALF[policy]))
    assert got.dtype == jnp.float32
    assert float(got) == 70001.0


@pytest.mark.parametrize("policy", POLICIES)
def test_a_cross_product_of_nearly_parallel_vectors_rounds_once(policy):
    """``cross(a, b)`` of a float32 ``a`` and a half ``b`` nearly parallel to it: each component is
    float32's to within one rounding of itself (the products rounded before their difference
    cancelled to 40% errors)."""
    a = jnp.array([1.0, 2.0, 3.0])
    b = (a + jnp.array([1e-3, -2e-3, 1e-3])).astype(HALF[policy])
    expected = jnp.cross(a, b.astype(jnp.float32))
    got = jaxamp.autocast(jnp.cross, policy)(a, b)
    eps = float(jnp.finfo(HALF[policy]).eps)
    np.testing.assert_allclose(got, expected, rtol=eps, atol=0)


@pytest.mark.parametrize("policy", POLICIES)
def test_a_product_with_a_float32_param_minus_an_activation_rounds_once(policy):
    """``a * c - b`` of half activations ``a``, ``b`` and a float32 param ``c``: the product is read
    unrounded by the difference, which cancels to float32's 1.0767e-3 (rounded to half once), not
    the 9.766e-4 of a product rounded before it (a 10% error in float16)."""

    def f(x, w, v, c):
        a, b = x @ w, x @ v
        return jnp.tanh(a * c - b)

    x, w, v, c = jnp.ones((1, 2)) / 2, jnp.eye(2) * 1.000977, jnp.eye(2), jnp.full(2, 1.0001)
    a = (x @ w).astype(HALF[policy]).astype(jnp.float32)
    b = (x @ v).astype(HALF[policy]).astype(jnp.float32)
    expected = jnp.tanh((a * c - b).astype(HALF[policy]).astype(jnp.float32))
    got = jaxamp.autocast(f, policy)(x, w, v, c)
    np.testing.assert_allclose(got, expected, rtol=float(jnp.finfo(HALF[policy]).eps))
