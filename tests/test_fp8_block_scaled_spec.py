"""Blackwell's block-scaled formats against what they promise: scales, result dtypes, the recipe's
switches and the rule's choices, in cases the format tests do not reach.

All on the CPU (each GEMM a float32 GEMM of the dequantized values). Each
test says which fault would make it fail.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxamp
from jaxamp.fp8 import _block_formats as formats
from test_fp8 import equations  # (name scope, equation) of a jaxpr and every jaxpr it carries

MATMUL = (((1,), (0,)), ((), ()))  # x @ w
M, K, N = 64, 96, 32


def gaussian(seed, *shape):
    return jax.random.normal(jax.random.key(seed), shape)


# --- the formats ------------------------------------------------------------------------


def test_nvfp4s_tensor_scale_puts_the_largest_block_scale_at_448_so_a_small_block_keeps_its_precision():
    """The tensor scale is amax / (448 * 6): the largest block's E4M3 scale is 448, and a block a
    thousand times smaller gets a normal E4M3 scale (about 0.45), so it rounds like the others.
    Fails if the tensor scale left out the 448 (block scales in (0, 1], the small block's in E4M3's
    subnormals)."""
    x = gaussian(0, 8, 64) * jnp.repeat(jnp.array([1.0, 1e-3, 1.0, 1.0]), 16)
    quantized = formats.quantize(x, formats.NVFP4)
    assert float(quantized.scales.astype(jnp.float32).max()) == 448.0
    small = x[:, 16:32]
    error = formats.dequantize(quantized)[:, 16:32] - small
    assert float(jnp.linalg.norm(error) / jnp.linalg.norm(small)) < 0.15


def test_an_mxfp8_block_whose_amax_is_448_times_a_power_of_two_gets_that_power_as_its_scale():
    """2**ceil(log2(amax / 448)) is the power itself when amax / 448 is one: the block's largest
    value lands on 448, and values E4M3 holds at that scale come back exactly. Fails if an exact
    power of two were rounded up to the next (a scale twice too large, one bit of precision lost)."""
    powers = jnp.array([1.0, 2.0**-3, 2.0**-10])
    x = jnp.repeat(powers, 32)[None, :] * jnp.tile(jnp.array([448.0, -416.0, 13.0, 0.875] * 8), 3)[None, :]
    quantized = formats.quantize(x, formats.MXFP8)
    np.testing.assert_array_equal(quantized.scales.astype(jnp.float32)[0], powers)
    np.testing.assert_array_equal(formats.dequantize(quantized), x)


def test_stochastic_draws_differ_between_streams():
    """Two quantizations of one tensor in one step draw independently when their streams
    differ. Fails if the stream were ignored (both would round the same elements up)."""
    x = jnp.full((64, 64), 2.6).at[:, ::16].set(6.0)
    first = formats.quantize(x, formats.NVFP4, rounding="stochastic", stream=0).values
    second = formats.quantize(x, formats.NVFP4, rounding="stochastic", stream=1).values
    assert np.mean(np.asarray(first) != np.asarray(second)) > 0.2


# --- the GEMMs --------------------------------------------------------------------------


def test_the_product_is_bfloat16_by_default_and_exact_in_float32_when_asked():
    """Small integers are exact in MXFP8 (scale 2**-5 for an amax of 8), so a float32 result is
    their exact product. Fails if the default result dtype changed, or a float32 result were
    computed through a bfloat16 product (sums above 256 would round)."""
    x = jax.random.randint(jax.random.key(1), (M, K), -8, 9).astype(jnp.float32)
    w = jax.random.randint(jax.random.key(2), (K, N), -8, 9).astype(jnp.float32)
    by_default = jax.eval_shape(lambda x, w: jaxamp.fp8.block_scaled_dot_general(x, w, MATMUL), x, w)
    assert by_default.dtype == jnp.bfloat16

    def product(x, w):
        return jaxamp.fp8.block_scaled_dot_general(x, w, MATMUL, "mxfp8", preferred_element_type=jnp.float32)

    y = jax.jit(product)(x, w)
    assert y.dtype == jnp.float32 and float(jnp.abs(x @ w).max()) > 256
    np.testing.assert_array_equal(y, jnp.dot(x, w, precision=jax.lax.Precision.HIGHEST))


@pytest.mark.parametrize("matmul_format", ["mxfp8", "nvfp4"])
def test_the_forward_is_the_product_of_the_activation_in_1x_blocks_and_the_weight_in_the_recipes_blocks(
    matmul_format,
):
    """MXFP8: x and w each in 1 x 32 blocks along K, as TransformerEngine's MXFP8 recipe; NVFP4:
    w in 16 x 16 tiles, both tensor scales applied. The weight's output columns span three
    decades, so a tile across them would flush the small ones. Fails if MXFP8's weight took
    NVFP4's square tiles, or a tensor scale were dropped."""
    block_format = formats.BLOCK_FORMATS[matmul_format]
    x, w = gaussian(3, M, K) * 3, gaussian(4, K, N) * jnp.logspace(-3, 0, N)

    def product(x, w):
        return jaxamp.fp8.block_scaled_dot_general(x, w, MATMUL, matmul_format, jnp.float32)

    y = jax.jit(product)(x, w)
    x_q = formats.dequantize(formats.quantize(x, block_format))
    if matmul_format == "nvfp4":
        w_q = formats.dequantize(formats.quantize_2d(w.T, block_format)[0])
    else:
        w_q = formats.dequantize(formats.quantize(w.T, block_format))
    expected = jax.lax.dot_general(x_q, w_q, (((1,), (1,)), ((), ())), precision=jax.lax.Precision.HIGHEST)
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5)


# --- the recipe -------------------------------------------------------------------------


def nvfp4_step(x, w):
    """The NVFP4 dot's output and both gradients (float32, so every bit shows), traced afresh
    (the recipe is read when a function is traced)."""

    def product(x, w):
        return jaxamp.fp8.block_scaled_dot_general(x, w, MATMUL, "nvfp4", preferred_element_type=jnp.float32)

    def step(x, w):
        y, vjp = jax.vjp(product, x, w)
        return (y, *vjp(jnp.cos(y)))

    return jax.jit(step)(x, w)


def test_the_full_recipe_is_the_default_and_each_switch_takes_out_its_tool_inside_its_block_only():
    """Outside any block, and in `block_recipe()`, the same numbers; each switch off changes
    them; after a block the full recipe is back. Fails if a default were off (in the recipe or
    in the context), a switch did nothing, or the recipe leaked out of its block."""
    x, w = gaussian(5, M, K) * jnp.exp(gaussian(6, M, K)), gaussian(7, K, N)
    default = nvfp4_step(x, w)
    with jaxamp.fp8.block_recipe():
        for value, full in zip(nvfp4_step(x, w), default):
            np.testing.assert_array_equal(value, full)
    for switch in ("hadamard", "stochastic_gradients", "two_d_weights"):
        with jaxamp.fp8.block_recipe(**{switch: False}):
            ablated = nvfp4_step(x, w)
        assert any(not np.array_equal(a, b) for a, b in zip(ablated, default)), switch
    for value, full in zip(nvfp4_step(x, w), default):
        np.testing.assert_array_equal(value, full)


def test_a_recipe_switch_that_is_not_a_bool_is_refused_naming_it():
    """Fails if 0 or 1 passed as a switch (a bool is an int)."""
    with pytest.raises(TypeError, match=r"block_recipe's hadamard must be True or False; got 0"):
        with jaxamp.fp8.block_recipe(hadamard=0):
            pass


def test_an_autocast_function_traced_again_under_another_recipe_is_rewritten_in_it():
    """The recipe is part of the rewrite's key: the same autocast function's gradient under the
    full recipe and without the Hadamard transform differ. Fails if the second trace reused the
    first's rewrite."""
    x, w = gaussian(8, M, K) * jnp.exp(gaussian(9, M, K)), gaussian(10, K, N)
    loss = jaxamp.autocast(lambda x, w: jnp.sum(jnp.sin(x @ w)), "mixed_nvfp4")
    with jaxamp.fp8.block_recipe(stochastic_gradients=False):
        full = jax.jit(jax.grad(loss, argnums=1))(x, w)
    with jaxamp.fp8.block_recipe(stochastic_gradients=False, hadamard=False):
        plain = jax.jit(jax.grad(loss, argnums=1))(x, w)
    assert not np.array_equal(full, plain)


# --- the rule ---------------------------------------------------------------------------


def block_scaled_and_fallbacks(fun, *args):
    """The number of block-scaled GEMMs `fun` traces to, and the name scopes of its other dots."""
    closed = jax.make_jaxpr(fun)(*args)
    found = list(equations(closed.jaxpr))
    gemms = sum(eq.primitive.name == "scaled_matmul_wrapper" for _, eq in found)
    others = [s for s, eq in found if eq.primitive is jax.lax.dot_general_p and "jaxamp_fp8/" not in s + "/"]
    return gemms, others


def test_nvfp4_runs_a_matmul_whose_sizes_are_multiples_of_16_but_not_32():
    """N = 48: NVFP4's blocks of 16 divide it. Fails if NVFP4 asked MXFP8's 32."""
    x, w = gaussian(11, M, K), gaussian(12, K, 48)
    gemms, others = block_scaled_and_fallbacks(jaxamp.autocast(lambda x, w: x @ w, "mixed_nvfp4"), x, w)
    assert (gemms, others) == (1, [])


@pytest.mark.parametrize("policy", ["mixed_mxfp8", "mixed_nvfp4"])
def test_a_hopper_target_keeps_both_block_scaled_formats_in_bfloat16(policy):
    """Fails if one of the formats skipped the needs_blackwell check."""
    x, w = gaussian(13, M, K), gaussian(14, K, N)
    with jaxamp.diagnostics.fp8_target("h200"):
        gemms, others = block_scaled_and_fallbacks(jaxamp.autocast(lambda x, w: x @ w, policy), x, w)
    assert gemms == 0 and len(others) == 1 and "jaxamp_fp8_fallback_needs_blackwell" in others[0]


def test_on_a_b200_the_rule_prices_a_matmul_in_the_policys_format():
    """At 2048 x 2048 x 2048 per-tensor FP8 pays on a B200 (1.07x bfloat16 on paper) and MXFP8
    does not (0.88x); at 4096 MXFP8 pays. Fails if the rule priced a block-scaled format as
    per-tensor FP8 (the 2048 matmul would run MXFP8)."""
    fun = jaxamp.autocast(lambda x, w: x @ w, "mixed_mxfp8")
    with jaxamp.diagnostics.fp8_target("b200"):
        for size, pays in ((2048, False), (4096, True)):
            square = jax.ShapeDtypeStruct((size, size), jnp.float32)
            gemms, others = block_scaled_and_fallbacks(fun, square, square)
            if pays:
                assert gemms == 1 and others == [], size
            else:
                assert gemms == 0 and "jaxamp_fp8_fallback_too_small_to_pay" in others[0], size


def test_a_block_scaled_matmul_returns_the_policys_compute_dtype():
    """A policy computing in float16 with MXFP8 matmuls: the block-scaled product is float16.
    Fails if the rule left the product in block_scaled_dot_general's default bfloat16."""
    x, w = gaussian(15, M, K), gaussian(16, K, N)
    closed = jax.make_jaxpr(jaxamp.autocast(lambda x, w: x @ w, "p=f32,c=f16,o=f32,matmul=mxfp8"))(x, w)
    results = {
        eq.outvars[0].aval.dtype.name
        for scope, eq in equations(closed.jaxpr)
        if "jaxamp_fp8" in scope and eq.outvars and eq.outvars[0].aval.shape == (M, N)
    }
    assert "float16" in results and "bfloat16" not in results


@pytest.mark.parametrize(("matmul_format", "shape"), [("mxfp8", (48, K)), ("nvfp4", (40, K))])
def test_a_batch_the_blocks_do_not_divide_is_refused_though_k_and_n_are_multiples(matmul_format, shape):
    """M is contracted by the weight gradient's GEMM: 48 rows (MXFP8) or 40 (NVFP4) are refused,
    naming the sizes and the block. Fails if only K (the forward's) were checked."""
    sizes = rf"\(here \({shape[0]}, {N}, {K}\)\)"
    with pytest.raises(ValueError, match=rf"{matmul_format} needs M, N and K {sizes} to be multiples"):
        jaxamp.fp8.block_scaled_dot_general(jnp.ones(shape), jnp.ones((K, N)), MATMUL, matmul_format)
