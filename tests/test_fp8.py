"""Tests for FP8 matmuls: `jaxamp.fp8_dot_general`, the ``mixed_float8`` policy under autocast.

Numerics run on the CPU (a plain dot of the FP8 values there). The last
tests compile for an H200 target without a GPU and skip without the CUDA
PJRT plugin. Each test says which fault would make it fail.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxamp

MATMUL = (((1,), (0,)), ((), ()))  # x @ w
E4M3, E5M2 = jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2)


def gaussian(seed, *shape):
    return jax.random.normal(jax.random.key(seed), shape)


def relative_error(value, reference):
    value = jnp.asarray(value, jnp.float32)
    return float(jnp.linalg.norm(value - reference) / jnp.linalg.norm(reference))


def equations(jaxpr, scope=""):
    """(name scope, equation) for every equation of `jaxpr` and of the jaxprs it carries
    (cond branches, custom VJPs, jit); a nested equation's scope includes its parents'."""
    for equation in jaxpr.eqns:
        here = "/".join(part for part in (scope, str(equation.source_info.name_stack)) if part)
        yield here, equation
        for param in equation.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from equations(inner, here)


def dots(fun, *args):
    """(name scope, operand dtypes, precision) of every dot_general `fun` traces to."""
    closed = jax.make_jaxpr(fun)(*args)
    return [
        (scope, tuple(v.aval.dtype for v in eq.invars), eq.params["precision"])
        for scope, eq in equations(closed.jaxpr)
        if eq.primitive is jax.lax.dot_general_p
    ]


# --- the FP8 dot on its own -------------------------------------------------------------


def test_per_tensor_e4m3_on_gaussian_data_is_about_4_percent_off_float32():
    """Measured 3.9% (x 32x64, w 64x48, seeds 0 and 1). Fails if the operands are not
    quantized to FP8 (bfloat16 is 0.3% off) or the scales are wrong (far above 6%)."""
    x, w = gaussian(0, 32, 64), gaussian(1, 64, 48)
    product = jaxamp.fp8_dot_general(x, w, MATMUL)
    assert product.dtype == jnp.bfloat16
    assert 0.02 < relative_error(product, x @ w) < 0.06


def test_both_gradients_take_an_e5m2_cotangent_and_stay_within_8_percent_of_float32():
    """Measured 5.7% (input gradient) and 5.6% (weight gradient). Fails below 4.5% if the
    cotangent were quantized to e4m3 (3.9%, one more mantissa bit) or not at all, above 8%
    if a transpose were wrong, and on dtypes if gradients did not come back in float32."""
    x, w, cotangent = gaussian(0, 32, 64), gaussian(1, 64, 48), gaussian(2, 32, 48)
    _, vjp = jax.vjp(lambda x, w: jaxamp.fp8_dot_general(x, w, MATMUL), x, w)
    x_grad, w_grad = vjp(cotangent.astype(jnp.bfloat16))
    assert (x_grad.dtype, w_grad.dtype) == (jnp.float32, jnp.float32)
    assert 0.045 < relative_error(x_grad, cotangent @ w.T) < 0.08
    assert 0.045 < relative_error(w_grad, x.T @ cotangent) < 0.08


@pytest.mark.parametrize(
    "lhs_shape, rhs_shape, dimension_numbers",
    [
        ((64, 2, 16), (48, 64), (((0,), (1,)), ((), ()))),  # contracts the lhs's first dim
        ((32, 4, 16), (16, 4, 48), (((1, 2), (1, 0)), ((), ()))),  # two contracting dims, swapped
        ((4, 32, 16), (4, 16, 16), (((2,), (1,)), ((0,), (0,)))),  # batch dims
    ],
    ids=["lhs-contracting-first", "two-contracting-dims", "batch-dims"],
)
def test_any_dimension_numbers_give_the_shapes_and_gradients_of_lax_dot_general(
    lhs_shape, rhs_shape, dimension_numbers
):
    """Fails if the FP8 transpose (a port of JAX's) puts an axis in the wrong place:
    shapes differ or the gradients are far (> 8%) from float32's."""
    lhs, rhs = gaussian(0, *lhs_shape), gaussian(1, *rhs_shape)
    fp8, fp8_vjp = jax.vjp(lambda a, b: jaxamp.fp8_dot_general(a, b, dimension_numbers), lhs, rhs)
    exact, exact_vjp = jax.vjp(lambda a, b: jax.lax.dot_general(a, b, dimension_numbers), lhs, rhs)
    assert fp8.shape == exact.shape
    assert relative_error(fp8, exact) < 0.06
    cotangent = gaussian(2, *exact.shape)
    for fp8_grad, exact_grad in zip(fp8_vjp(cotangent.astype(jnp.bfloat16)), exact_vjp(cotangent)):
        assert fp8_grad.shape == exact_grad.shape
        assert relative_error(fp8_grad, exact_grad) < 0.08


def test_the_gradients_come_back_in_each_operands_own_dtype():
    """A float16 lhs and a bfloat16 rhs: their gradients are float16 and bfloat16, whatever the
    result dtype. Fails if a gradient takes the other operand's dtype, the result's, or the
    default float (float32)."""
    x, w = gaussian(0, 16, 32).astype(jnp.float16), gaussian(1, 32, 16).astype(jnp.bfloat16)
    for result_dtype in (jnp.bfloat16, jnp.float32):
        loss = lambda x, w: jaxamp.fp8_dot_general(x, w, MATMUL, result_dtype).astype(jnp.float32).sum()
        x_grad, w_grad = jax.grad(loss, (0, 1))(x, w)
        assert (x_grad.dtype, w_grad.dtype) == (jnp.float16, jnp.bfloat16), result_dtype


@pytest.mark.parametrize(
    "result_dtype, product_dtype",
    [(jnp.bfloat16, jnp.bfloat16), (jnp.float32, jnp.float32), (jnp.float16, jnp.float32)],
)
def test_the_fp8_product_and_its_scaling_run_in_bfloat16_only_for_a_bfloat16_result(
    result_dtype, product_dtype
):
    """A bfloat16 result is asked of the dot itself and scaled in bfloat16 (what XLA fuses into
    the cuBLASLt call); a float32 result, and a float16 one (FP8 products up to 448**2 overflow
    float16), take a float32 product. Fails if the product dtype is chosen otherwise or the
    scales are multiplied in float32 (the product widened to float32 first)."""
    x, w = gaussian(0, 16, 32), gaussian(1, 32, 16)
    closed = jax.make_jaxpr(lambda x, w: jaxamp.fp8_dot_general(x, w, MATMUL, result_dtype))(x, w)
    found = [equation for _, equation in equations(closed.jaxpr)]
    products = [eq.outvars[0].aval.dtype for eq in found if eq.primitive is jax.lax.dot_general_p]
    assert products and set(products) == {jnp.dtype(product_dtype)}
    scalings = [eq.outvars[0].aval for eq in found if eq.primitive is jax.lax.mul_p]
    assert {aval.dtype for aval in scalings if aval.shape == (16, 16)} == {jnp.dtype(product_dtype)}


def test_all_three_gemms_of_a_training_step_take_fp8_operands_with_the_presets_on_cuda():
    """Forward e4m3 x e4m3 with fast accumulation, both backward GEMMs e5m2 (the cotangent) times e4m3 with split
    accumulation, each as a CUDA branch (the preset) and a default branch (plain dot). Fails if
    the backward were JAX's own transpose (bfloat16 or float32 operands)."""
    x, w = gaussian(0, 32, 64), gaussian(1, 64, 48)
    loss = lambda x, w: jaxamp.fp8_dot_general(x, w, MATMUL).astype(jnp.float32).sum()
    found = [(operands, precision) for _, operands, precision in dots(jax.grad(loss, (0, 1)), x, w)]
    fast, split = (
        jax.lax.DotAlgorithmPreset.ANY_F8_ANY_F8_F32_FAST_ACCUM,
        jax.lax.DotAlgorithmPreset.ANY_F8_ANY_F8_F32,
    )
    assert sorted(found, key=str) == sorted(
        [((E4M3, E4M3), fast), ((E4M3, E4M3), None)]
        + [((E5M2, E4M3), split), ((E5M2, E4M3), None)]  # input gradient: g @ w.T
        + [((E4M3, E5M2), split), ((E4M3, E5M2), None)],  # weight gradient: x.T @ g
        key=str,
    )


def test_the_backward_keeps_only_the_fp8_operands_and_their_scales():
    """The residuals of a vjp are FP8 values and float32 scalars. Fails if the float32
    operands were saved for the backward (a 32x64 float32 residual)."""
    x, w = gaussian(0, 32, 64), gaussian(1, 64, 48)
    _, vjp = jax.vjp(lambda x, w: jaxamp.fp8_dot_general(x, w, MATMUL), x, w)
    residuals = [leaf for leaf in jax.tree.leaves(vjp) if hasattr(leaf, "dtype")]
    big = {(leaf.shape, leaf.dtype.name) for leaf in residuals if leaf.size > 1}
    assert big == {((32, 64), "float8_e4m3fn"), ((64, 48), "float8_e4m3fn")}


def test_a_tensor_of_zeros_gives_zeros_and_zero_gradients_never_nan():
    """Fails if the scale divided by a zero amax (NaN or inf everywhere)."""
    zeros = jnp.zeros((16, 16))
    loss = lambda x, w: jaxamp.fp8_dot_general(x, w, MATMUL).astype(jnp.float32).sum()
    assert not jnp.any(jaxamp.fp8_dot_general(zeros, zeros, MATMUL))
    grads = jax.grad(loss, (0, 1))(zeros, zeros)
    assert all(bool(jnp.all(grad == 0)) for grad in grads)


def test_quantization_stats_count_the_values_that_underflow_under_one_outlier():
    """One value of 1e4 sets the scale, so the 255 values of 1e-6 beside it fall below
    float8_e4m3fn's smallest subnormal and quantize to zero. Fails if underflow were not
    counted (0) or zeros were counted as underflow (the rhs's zeros would add)."""
    lhs = jnp.full((16, 16), 1e-6).at[0, 0].set(1e4)
    rhs = jnp.eye(16).at[0, 1].set(1.0)
    stats = jaxamp.diagnostics.fp8_quantization_stats(lambda a, b: a @ b)(lhs, rhs)
    by_role = {tensor.role: tensor for tensor in stats.tensors}
    assert set(by_role) == {"lhs", "rhs"}
    assert (by_role["lhs"].underflowed, by_role["lhs"].nonzero, by_role["lhs"].amax) == (255, 256, 1e4)
    assert by_role["rhs"].underflowed == 0
    assert (stats.underflowed, stats.saturated, stats.non_finite) == (255, 0, 0)
    assert stats.underflow_fraction == 255 / (256 + 17)


def test_quantization_stats_with_gradient_argnums_see_the_backward_cotangent_in_e5m2():
    """Fails if the stats missed the backward's quantization (no cotangent row in e5m2)."""
    x, w = gaussian(0, 16, 32), gaussian(1, 32, 16)
    stats = jaxamp.diagnostics.fp8_quantization_stats(lambda x, w: jnp.sum(x @ w), gradient_argnums=(0, 1))(x, w)
    assert [(t.role, t.shape, t.fp8_dtype) for t in stats.tensors] == [
        ("lhs", (16, 32), "float8_e4m3fn"),
        ("rhs", (32, 16), "float8_e4m3fn"),
        ("cotangent", (16, 16), "float8_e5m2"),
    ]


def test_quantization_stats_take_keyword_arguments_and_differentiate_only_the_argnums_named():
    """`loss(tokens, w, scale=...)` with integer tokens: the stats differentiate with respect to
    `w` alone (an integer argument cannot be differentiated) and pass `scale` on. Fails if the
    keyword arguments were dropped (a TypeError) or `gradient_argnums` ignored (grad of tokens)."""

    def loss(tokens, w, *, scale):
        return scale * jnp.sum(jax.nn.one_hot(tokens, 16) @ w)

    tokens, w = jnp.arange(16) % 5, gaussian(1, 16, 16)
    stats = jaxamp.diagnostics.fp8_quantization_stats(loss, gradient_argnums=1)(tokens, w, scale=2.0)
    assert [tensor.role for tensor in stats.tensors] == ["lhs", "rhs", "cotangent"]
    assert stats.tensors[2].amax == 2.0  # the cotangent of sum(), times the scale passed


def test_quantization_stats_keep_the_functions_name_and_doc_and_not_an_objects_attributes():
    """Fails if the returned function lost `fun`'s name and docstring, or took on the
    attributes of a callable object (its `__dict__`: a model's parameters, say)."""

    def loss(x, w):
        """The loss."""
        return jnp.sum(x @ w)

    stats_fun = jaxamp.diagnostics.fp8_quantization_stats(loss)
    assert (stats_fun.__name__, stats_fun.__doc__, stats_fun.__wrapped__) == ("loss", "The loss.", loss)

    class Model:
        def __init__(self):
            self.weights = gaussian(1, 16, 16)

        def __call__(self, x):
            return jnp.sum(x @ self.weights)

    stats_fun = jaxamp.diagnostics.fp8_quantization_stats(Model())
    assert not hasattr(stats_fun, "weights")
    assert len(stats_fun(gaussian(0, 16, 16)).tensors) == 2


@pytest.mark.parametrize(
    "dtype, values, saturated",
    [
        (E4M3, [float(np.nextafter(np.float32(448), np.float32(np.inf))), 463.0, -465.0, 1000.0, 1.0], 2),
        (E5M2, [float(np.nextafter(np.float32(57344), np.float32(np.inf))), 61000.0, 62000.0, -1e6], 2),
    ],
    ids=["e4m3", "e5m2"],
)
def test_saturated_counts_the_values_beyond_the_format_once_rounded_not_a_scaled_amax_a_hair_above(
    dtype, values, saturated
):
    """Under current scaling a scaled amax can round a hair above the largest value (448.00003),
    and the cast rounds it back to 448: not saturated, as nothing is lost. With a scale of 1 (a
    stale scale, as delayed scaling would give after a jump in amax), the values beyond 464
    (e4m3fn) or 61440 (e5m2), where the format has no value left, are clipped: saturated. Fails
    if the count compares the scaled value with the largest value itself (one more each)."""
    from jaxamp.fp8 import _matmul as fp8

    counted = []
    x = jnp.array(values, jnp.float32)
    largest = float(jnp.finfo(dtype).max)
    stale = fp8.Quantized(jnp.clip(x, -largest, largest).astype(dtype), jnp.float32(1))
    fp8._observe(lambda role, shape, fp8_dtype, counts: counted.append(counts), "lhs", x, stale)
    jax.effects_barrier()
    assert int(counted[0]["saturated"]) == saturated


def test_current_scaling_saturates_nothing_however_far_outside_the_range_the_values_lie():
    """The contract of `Fp8TensorStats.saturated`: zero by construction under current scaling."""
    lhs, rhs = 1e6 * gaussian(6, 64, 16), 1e-9 * gaussian(7, 16, 16)
    stats = jaxamp.diagnostics.fp8_quantization_stats(lambda a, b: jnp.sum(a @ b), gradient_argnums=(0, 1))(lhs, rhs)
    assert [tensor.saturated for tensor in stats.tensors] == [0, 0, 0]
    assert [tensor.underflowed for tensor in stats.tensors] == [0, 0, 0]


# --- magnitudes far outside the formats' range -------------------------------------------
#
# Current scaling maps each tensor's amax onto the format's largest value, so what matters is
# the spread of a tensor's values, not their size: far beyond the largest value (e4m3 448,
# e5m2 57344) or far below the smallest normal (2**-6, 2**-14), a tensor whose values lie
# within a factor of 4 of its amax quantizes with the format's rounding alone. Round to
# nearest is off by at most half a unit in the last place: 2**-4 of the value in e4m3fn
# (3 mantissa bits), 2**-3 in e5m2 (2).

UNIT_ROUNDOFF = {E4M3: 2.0**-4, E5M2: 2.0**-3}
FAR_BEYOND = {E4M3: 1e6, E5M2: 1e9}  # 2,000 and 17,000 times the largest value
FAR_BELOW = {E4M3: 1e-7, E5M2: 1e-10}  # 150,000 and 600,000 times below the smallest normal
SLACK = 1 + 1e-4  # float32 rounding of the scales and the sums


def spread(seed, shape, magnitude):
    """Values of random sign whose magnitudes lie between `magnitude` / 4 and `magnitude`."""
    sign_key, size_key = jax.random.split(jax.random.key(seed))
    sizes = jax.random.uniform(size_key, shape, minval=0.25, maxval=1.0)
    return magnitude * jnp.where(jax.random.bernoulli(sign_key, shape=shape), sizes, -sizes)


@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("where", ["far_beyond_the_largest_value", "far_below_the_smallest_normal"])
def test_values_far_outside_the_format_round_trip_within_its_rounding(dtype, where):
    """Fails if the values are clipped to the format's range before they are scaled (a tensor
    of 1e6 then comes back near 448 x its tiny scale), or scaled by anything but amax."""
    from jaxamp import fp8

    magnitude = (FAR_BEYOND if where.startswith("far_beyond") else FAR_BELOW)[dtype]
    x = spread(0, (8, 16), magnitude).at[0, 0].set(-magnitude)
    quantized = fp8.quantize(x, dtype)
    assert quantized.values.dtype == dtype
    assert float(jnp.max(jnp.abs(quantized.values.astype(jnp.float32)))) == float(jnp.finfo(dtype).max)
    round_trip = quantized.values.astype(jnp.float32) * quantized.scale_inv
    error = jnp.abs(round_trip - x) / jnp.abs(x)
    assert float(jnp.max(error)) <= UNIT_ROUNDOFF[dtype] * SLACK


@pytest.mark.parametrize(
    "lhs_magnitude, rhs_magnitude, cotangent_magnitude",
    [
        (FAR_BEYOND[E4M3], 3 * FAR_BEYOND[E4M3], FAR_BEYOND[E5M2]),
        (FAR_BELOW[E4M3], FAR_BELOW[E4M3] / 3, FAR_BELOW[E5M2]),
        (FAR_BEYOND[E4M3], FAR_BELOW[E4M3], FAR_BELOW[E5M2]),
        (FAR_BELOW[E4M3], FAR_BEYOND[E4M3], FAR_BEYOND[E5M2]),
    ],
    ids=["all_beyond", "all_below", "beyond_below_below", "below_beyond_beyond"],
)
def test_an_fp8_dot_of_operands_and_cotangents_far_outside_the_range_is_off_by_fp8_rounding_alone(
    lhs_magnitude, rhs_magnitude, cotangent_magnitude
):
    """Each product term of the FP8 dot multiplies two rounded values, so each element of the
    result is within (1 + u_lhs)(1 + u_rhs) - 1 of the exact sum of |terms|: 13% for the forward
    (two e4m3 operands), 20% for the gradients (an e5m2 cotangent, an e4m3 operand). Fails if
    operands or cotangents are clipped before they are scaled (results near 448 or 57344 times
    a scale meant for 1e6 or 1e9), or if a scale is applied twice or not at all."""
    x = spread(1, (16, 32), lhs_magnitude)
    w = spread(2, (32, 16), rhs_magnitude)
    cotangent = spread(3, (16, 16), cotangent_magnitude)
    product, vjp = jax.vjp(lambda x, w: jaxamp.fp8_dot_general(x, w, MATMUL, jnp.float32), x, w)
    x_grad, w_grad = vjp(cotangent)

    def within_rounding(value, exact, sum_of_magnitudes, *unit_roundoffs):
        bound = (1 + unit_roundoffs[0]) * (1 + unit_roundoffs[1]) - 1
        return float(jnp.max(jnp.abs(value - exact) / sum_of_magnitudes)) <= bound * SLACK

    u_forward, u_backward = UNIT_ROUNDOFF[E4M3], UNIT_ROUNDOFF[E5M2]
    assert within_rounding(product, x @ w, jnp.abs(x) @ jnp.abs(w), u_forward, u_forward)
    assert within_rounding(
        x_grad, cotangent @ w.T, jnp.abs(cotangent) @ jnp.abs(w).T, u_backward, u_forward
    )
    assert within_rounding(
        w_grad, x.T @ cotangent, jnp.abs(x).T @ jnp.abs(cotangent), u_forward, u_backward
    )


# --- non-finite values keep the skip mechanism honest -----------------------------------


@jax.custom_vjp
def _poison_cotangent(y, value):
    return y


def _poison_forward(y, value):
    return y, value


def _poison_backward(value, cotangent):
    return cotangent.at[0, 0].set(value.astype(cotangent.dtype)), None


_poison_cotangent.defvjp(_poison_forward, _poison_backward)


@pytest.mark.parametrize("bad", [jnp.inf, -jnp.inf, jnp.nan], ids=["inf", "-inf", "nan"])
@pytest.mark.parametrize("where", ["operand", "cotangent"])
def test_a_non_finite_operand_or_cotangent_makes_the_gradients_non_finite_and_the_step_is_skipped(bad, where):
    """An inf or NaN in the input (forward operand) or in the dot's incoming cotangent must not
    vanish in the FP8 cast. Fails if quantization saturated it (inf -> 448 or 57344) into finite
    gradients: the state would take the update instead of being skipped."""
    params = {"w": gaussian(1, 32, 16) * 0.1}
    x = gaussian(0, 16, 32)
    if where == "operand":
        x = x.at[3, 5].set(bad)

    @jaxamp.autocast(policy="mixed_float8")
    def loss_fn(params):
        y = x @ params["w"]
        if where == "cotangent":
            y = _poison_cotangent(y, jnp.float32(bad))
        return jnp.mean(y.astype(jnp.float32) ** 2) if where == "cotangent" else jnp.mean(jnp.tanh(y))

    state = jaxamp.TrainState.create(
        apply_fn=None, params=params, tx=optax.sgd(0.1), loss_scale=jaxamp.DynamicLossScale()
    )
    _, grads, grads_finite = jaxamp.scaled_value_and_grad(loss_fn, state.loss_scale)(state.params)
    new_state = state.apply_gradients(grads=grads, grads_finite=grads_finite)
    assert not bool(grads_finite)
    assert int(new_state.skipped_steps) == 1
    assert bool(jnp.all(new_state.params["w"] == params["w"]))
    assert float(new_state.loss_scale.loss_scale) < float(state.loss_scale.loss_scale)


# --- autocast under mixed_float8 --------------------------------------------------------


def test_autocast_runs_an_eligible_matmul_as_an_fp8_dot_under_the_jaxamp_fp8_scope():
    """Fails if mixed_float8 ran like mixed_bfloat16 (bfloat16 operands, no scope)."""
    x, w = gaussian(0, 16, 32), gaussian(1, 32, 64)
    found = dots(jaxamp.autocast(lambda x, w: x @ w, "mixed_float8"), x, w)
    assert found and all("jaxamp_fp8" in scope and operands == (E4M3, E4M3) for scope, operands, _ in found)


@pytest.mark.parametrize(
    "reason, fun, args, operand_dtype",
    [
        (
            "shape_not_multiple_of_16",
            lambda x, w: x @ w,
            [jnp.ones((16, 32)), jnp.ones((32, 10))],
            jnp.bfloat16,
        ),
        (
            "shape_not_multiple_of_16",
            lambda x, w: x @ w,
            [jnp.ones((16, 24)), jnp.ones((24, 16))],
            jnp.bfloat16,
        ),
        (
            "batch_dims",
            lambda q, k: jnp.einsum("bqd,bkd->bqk", q, k),
            [jnp.ones((2, 16, 16))] * 2,
            jnp.bfloat16,
        ),
        ("integer_operands", lambda x, w: x @ w, [jnp.ones((16, 16), jnp.int32)] * 2, jnp.int32),
    ],
    ids=["n-is-10", "k-is-24", "attention-core", "int32"],
)
def test_an_ineligible_dot_falls_back_under_a_scope_naming_its_reason(reason, fun, args, operand_dtype):
    """Fails if an ineligible dot went to FP8 anyway, ran unnamed, or named another reason."""
    assert reason in jaxamp.diagnostics.FP8_FALLBACK_REASONS
    (found,) = dots(jaxamp.autocast(fun, "mixed_float8"), *args)
    scope, operands, _ = found
    assert f"jaxamp_fp8_fallback_{reason}" in scope
    assert operands == (jnp.dtype(operand_dtype),) * 2


def _conv(images, kernel, feature_group_count=1, stride=1):
    return jax.lax.conv_general_dilated(
        images,
        kernel,
        (stride, stride),
        "SAME",
        dimension_numbers=("NHWC", "HWIO", "NHWC"),
        feature_group_count=feature_group_count,
    )


def convolutions(fun, *args):
    """(name scope, operand dtypes) of every convolution `fun` traces to."""
    closed = jax.make_jaxpr(fun)(*args)
    return [
        (scope, tuple(v.aval.dtype for v in eq.invars))
        for scope, eq in equations(closed.jaxpr)
        if eq.primitive is jax.lax.conv_general_dilated_p
    ]


def test_a_convolution_runs_forward_on_fp8_values_and_backward_in_bfloat16_under_conv_backward():
    """Forward: both operands quantized to e4m3 and handed over as bfloat16 (convert times the
    scale, the pattern XLA rewrites into a cuDNN FP8 graph), about 4% off float32 like a dot.
    Backward: the two gradient convolutions in bfloat16 under the conv_backward scope. Fails if
    the forward skipped quantization (0.3% off) or the backward lost its scope."""
    images, kernel = gaussian(0, 2, 8, 8, 16), gaussian(1, 3, 3, 16, 32) * 0.1
    forward = jaxamp.autocast(_conv, "mixed_float8")(images, kernel)
    assert forward.dtype == jnp.float32  # autocast returns what the function returns
    assert 0.02 < relative_error(forward, _conv(images, kernel)) < 0.06
    loss = lambda images, kernel: jnp.sum(jnp.tanh(_conv(images, kernel)))
    found = convolutions(jax.grad(jaxamp.autocast(loss, "mixed_float8"), (0, 1)), images, kernel)
    assert len(found) == 3
    forward_scope = [scope for scope, _ in found if "conv_backward" not in scope]
    assert len(forward_scope) == 1 and "jaxamp_fp8" in forward_scope[0]
    assert sum("jaxamp_fp8_fallback_conv_backward" in scope for scope, _ in found) == 2
    assert {operands for _, operands in found} == {(jnp.dtype(jnp.bfloat16),) * 2}


def test_a_convolutions_gradients_come_back_in_each_operands_own_dtype():
    """float16 images and a bfloat16 kernel, convolved in bfloat16: the image gradient is
    float16, the kernel gradient bfloat16 (the dtypes the forward saved, one per operand).
    Fails if either gradient takes the other's dtype, the result dtype or the default float."""
    images = gaussian(0, 2, 8, 8, 16).astype(jnp.float16)
    kernel = (gaussian(1, 3, 3, 16, 32) * 0.1).astype(jnp.bfloat16)
    from jaxamp import fp8

    loss = lambda images, kernel: jnp.sum(
        fp8.fp8_convolution(images, kernel, _conv, jnp.bfloat16).astype(jnp.float32)
    )
    image_grad, kernel_grad = jax.grad(loss, (0, 1))(images, kernel)
    assert (image_grad.dtype, kernel_grad.dtype) == (jnp.float16, jnp.bfloat16)
    assert (image_grad.shape, kernel_grad.shape) == (images.shape, kernel.shape)


@pytest.mark.parametrize(
    "reason, images, kernel, groups",
    [
        ("grouped_conv", (2, 8, 8, 32), (3, 3, 16, 32), 2),
        ("shape_not_multiple_of_16", (2, 8, 8, 3), (3, 3, 3, 16), 1),
    ],
    ids=["grouped", "three-input-channels"],
)
def test_an_ineligible_convolution_runs_in_bfloat16_under_its_fallback_scope(reason, images, kernel, groups):
    """Fails if a grouped convolution or a 3-channel first layer went to FP8 or lost its reason."""
    conv = lambda a, b: _conv(a, b, groups)
    ((scope, operands),) = convolutions(
        jaxamp.autocast(conv, "mixed_float8"), jnp.ones(images), jnp.ones(kernel)
    )
    assert f"jaxamp_fp8_fallback_{reason}" in scope
    assert operands == (jnp.dtype(jnp.bfloat16),) * 2


def test_autocast_outside_grad_runs_the_backward_matmuls_as_e4m3_fp8_dots():
    """The documented limit: ``autocast(jax.grad(loss))`` sees the backward matmuls as plain
    matmuls, so all three GEMMs are FP8 but with e4m3 operands only (``grad(autocast(loss))``
    gives the e5m2 cotangent). Fails if a backward matmul escaped FP8 there (bfloat16 operands)."""
    x, w = gaussian(0, 16, 32), gaussian(1, 32, 16)
    loss = lambda x, w: jnp.sum(jnp.tanh(x @ w))
    found = dots(jaxamp.autocast(jax.grad(loss, (0, 1)), "mixed_float8"), x, w)
    assert len(found) == 2 * 3  # three GEMMs, each a CUDA and a default branch
    assert {operands for _, operands, _ in found} == {(E4M3, E4M3)}


def test_mixed_float8_composes_with_jit_vmap_scan_and_remat():
    """A scanned, rematerialized layer under vmap and jit: every dot is FP8 and the gradient
    is close to float32's. Fails if a higher-order rule dropped the FP8 rules (bfloat16 dots)."""
    ws = gaussian(1, 3, 32, 32) * 0.2
    xs = gaussian(0, 2, 16, 32)

    def model(ws, x):
        def layer(h, w):
            return jnp.tanh(h @ w), None

        return jnp.sum(jax.lax.scan(jax.checkpoint(layer), x, ws)[0] ** 2)

    batched = lambda ws, xs: jnp.sum(jax.vmap(model, (None, 0))(ws, xs))
    fp8_grad = jax.jit(jax.grad(jaxamp.autocast(batched, "mixed_float8")))
    found = dots(fp8_grad, ws, xs)
    assert found and all(operands[0].itemsize == 1 and operands[1].itemsize == 1 for _, operands, _ in found)
    assert relative_error(fp8_grad(ws, xs), jax.grad(batched)(ws, xs)) < 0.15


# --- the policy ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec",
    [
        "mixed_float8",
        "MIXED_FP8",
        "p=f32,c=bf16,o=f32,matmul=float8",
        "params=float32,compute=bfloat16,output=float32,m=fp8",
    ],
)
def test_mixed_float8_is_mixed_bfloat16_plus_fp8_matmuls_in_every_spelling(spec):
    """Fails if a spelling were refused or lost the FP8 matmuls."""
    policy = jaxamp.get_policy(spec)
    assert (policy.param_dtype, policy.compute_dtype, policy.output_dtype) == (
        jnp.float32,
        jnp.bfloat16,
        jnp.float32,
    )
    assert policy.matmul_dtype == E4M3 and policy.fp8_matmuls
    assert str(policy) == "params=float32,compute=bfloat16,output=float32,matmul=float8"
    assert jaxamp.get_policy(str(policy)) == policy
    assert policy != jaxamp.get_policy("mixed_bfloat16")
    assert not jaxamp.get_policy("mixed_bfloat16").fp8_matmuls


@pytest.mark.parametrize(
    "make, error, message",
    [
        (
            lambda: jaxamp.get_policy("p=f32,matmul=f16"),
            ValueError,
            r"Unknown matmul dtype 'f16'.*Valid: f8, fp8, float8",
        ),
        (lambda: jaxamp.get_policy("mixed_float9"), ValueError, r"'mixed_float9'.*mixed_float8"),
        (lambda: jaxamp.Policy("f32", "bf16", "f32", "float16"), ValueError, r"matmul_dtype.*'float16'"),
        (
            lambda: jaxamp.fp8_dot_general(jnp.ones((2, 2), int), jnp.ones((2, 2)), MATMUL),
            TypeError,
            r"lhs is int",
        ),
        (
            lambda: jaxamp.fp8_dot_general(jnp.ones((2, 2)), jnp.ones((2, 2)), (((2,), (0,)), ((), ()))),
            ValueError,
            r"lhs dims \(2,\)",
        ),
        (
            lambda: jaxamp.fp8_dot_general(jnp.ones((2, 2)), jnp.ones((2, 2)), ((1,), (0,))),
            TypeError,
            r"^fp8_dot_general's dimension_numbers must be \(\(lhs_contracting, rhs_contracting\), "
            r"\(lhs_batch, rhs_batch\)\) as for jax\.lax\.dot_general; got \(\(1,\), \(0,\)\)\.$",
        ),
        (
            lambda: jaxamp.fp8_dot_general(jnp.ones((2, 2)), jnp.ones((2, 2)), (((1,), (0, 1)), ((), ()))),
            ValueError,
            r"^fp8_dot_general's dimension_numbers .* pair a different number of lhs and rhs dims; each "
            r"lhs contracting \(batch\) dim needs one rhs contracting \(batch\) dim\.$",
        ),
        (
            lambda: jaxamp.diagnostics.fp8_quantization_stats(jnp.sum, "mixed_bfloat16"),
            ValueError,
            r"'params=float32,compute=bfloat16,output=float32' has none\. Pass 'mixed_float8'",
        ),
    ],
    ids=[
        "bad-matmul-dtype",
        "unknown-name",
        "policy-field",
        "integer-operand",
        "bad-dims",
        "malformed-dims",
        "unpaired-dims",
        "stats-without-fp8",
    ],
)
def test_bad_fp8_inputs_are_refused_naming_the_value_and_the_choices(make, error, message):
    """Fails if a bad input passed silently or the message lost the value or the choices."""
    with pytest.raises(error, match=message):
        make()


# --- compiled for an H200 ------------------------------------------------------------------


def test_compiled_for_an_h200_all_five_gemms_of_an_mlp_gradient_are_cublaslt_fp8_calls():
    """Two forward GEMMs (fast accumulation) and three backward ones (the hidden activation's
    gradient and both weight gradients, split accumulation) of a 2-layer MLP's gradient are
    ``__cublas$lt$matmul$f8`` custom calls on FP8 operands. Fails if XLA fell back to a bf16
    GEMM (``__cublas$gemm`` / ``__cublas$lt$matmul``) or the backward lost FP8."""
    if not jaxamp.diagnostics._gpu_targets.cuda_plugin_available():
        pytest.skip("needs the CUDA PJRT plugin (pip install 'jax-mixed-precision[gpu-aot]')")
    params = {
        "w1": jax.ShapeDtypeStruct((32, 64), jnp.float32),
        "w2": jax.ShapeDtypeStruct((64, 16), jnp.float32),
    }
    x, y = jax.ShapeDtypeStruct((16, 32), jnp.float32), jax.ShapeDtypeStruct((16, 16), jnp.float32)

    def loss(params, x, y):
        return jnp.mean((jax.nn.relu(x @ params["w1"]) @ params["w2"] - y) ** 2)

    device = jaxamp.diagnostics.gpu_target_device("h200")
    step = jax.jit(jax.grad(jaxamp.autocast(loss, "mixed_float8")))
    text = step.lower(*jaxamp.diagnostics.on_device((params, x, y), device)).compile().as_text()
    calls = [line for line in text.splitlines() if "custom-call(" in line and "__cublas" in line]
    assert len(calls) == 5
    assert all('custom_call_target="__cublas$lt$matmul$f8"' in call for call in calls)
    assert all("jaxamp_fp8" in re.search(r'op_name="([^"]+)"', call).group(1) for call in calls)
    algorithms = sorted(re.search(r'"algorithm":"(\w+)"', call).group(1) for call in calls)
    assert algorithms == ["ALG_DOT_ANY_F8_ANY_F8_F32"] * 3 + ["ALG_DOT_ANY_F8_ANY_F8_F32_FAST_ACCUM"] * 2
    operand_types = []
    for call in calls:
        operands = re.search(r"custom-call\(%([\w.\-]+), %([\w.\-]+)", call).groups()
        operand_types.append(
            {re.search(rf"%{re.escape(name)} = (\w+)\[", text).group(1) for name in operands}
        )
    assert sorted(map(sorted, operand_types)) == [["f8e4m3fn"]] * 2 + [["f8e4m3fn", "f8e5m2"]] * 3
    # The scales ride in the call (its alpha operands), not in a multiply after it.
    scale_operands = [
        re.search(r"custom-call\(%[\w.\-]+, %[\w.\-]+, %([\w.\-]+), %([\w.\-]+)", call).groups()
        for call in calls
    ]
    assert all(not all(name.startswith("constant") for name in names) for names in scale_operands), (
        scale_operands
    )


def test_compiled_for_an_h200_a_forward_convolution_is_a_cudnn_fp8_graph_and_its_gradients_bfloat16():
    """The forward convolution is ``__cudnn$convForwardGraph`` on f8e4m3fn operands; the two
    backward ones are bfloat16 cuDNN convolutions under the conv_backward scope. Fails if XLA
    did not rewrite the forward (a plain ``__cudnn$convForward`` on bf16 operands)."""
    if not jaxamp.diagnostics._gpu_targets.cuda_plugin_available():
        pytest.skip("needs the CUDA PJRT plugin (pip install 'jax-mixed-precision[gpu-aot]')")
    images, kernel = (
        jax.ShapeDtypeStruct((8, 16, 16, 32), jnp.float32),
        jax.ShapeDtypeStruct((3, 3, 32, 64), jnp.float32),
    )
    loss = lambda images, kernel: jnp.sum(jnp.tanh(_conv(images, kernel)))
    step = jax.jit(jax.grad(jaxamp.autocast(loss, "mixed_float8"), (0, 1)))
    text = (
        step.lower(*jaxamp.diagnostics.on_device((images, kernel), jaxamp.diagnostics.gpu_target_device("h200"))).compile().as_text()
    )
    calls = [line for line in text.splitlines() if "custom-call(" in line and "__cudnn" in line]
    found = []
    for call in calls:
        target = re.search(r'custom_call_target="([^"]+)"', call).group(1)
        operands = re.search(r"custom-call\(%([\w.\-]+), %([\w.\-]+)", call).groups()
        types = tuple(re.search(rf"%{re.escape(name)} = (\w+)\[", text).group(1) for name in operands)
        backward = "conv_backward" in re.search(r'op_name="([^"]+)"', call).group(1)
        found.append((target, types, backward))
    assert sorted(found) == sorted(
        [("__cudnn$convForwardGraph", ("f8e4m3fn", "f8e4m3fn"), False)]
        + [(target, ("bf16", "bf16"), True) for target, _, backward in found if backward]
    )
    assert sum(backward for *_, backward in found) == 2


# The transformer block the compiled tests share: attention projections, two attention cores
# (batched dots, which cuBLASLt cannot run in FP8) and an MLP, every width a multiple of 16.
BATCH, LENGTH, WIDTH, HEADS = 2, 32, 64, 2
BLOCK_SHAPES = {"wq": (WIDTH, WIDTH), "wk": (WIDTH, WIDTH), "wv": (WIDTH, WIDTH), "wo": (WIDTH, WIDTH),
                "w1": (WIDTH, 4 * WIDTH), "w2": (4 * WIDTH, WIDTH)}  # fmt: skip
# Forward FLOPs of the projections and the MLP: 2*B*T*D*D for each of wq, wk, wv, wo and
# 2*B*T*D*4D for each of w1, w2.
BLOCK_GEMM_FLOPS = 2 * BATCH * LENGTH * WIDTH * WIDTH * (4 + 2 * 4)


def transformer_block(params, x):
    q, k, v = (
        jnp.einsum("btd,de->bte", x, params[name]).reshape(BATCH, LENGTH, HEADS, WIDTH // HEADS)
        for name in ("wq", "wk", "wv")
    )
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(WIDTH // HEADS)
    attended = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, -1), v).reshape(BATCH, LENGTH, WIDTH)
    x = x + attended @ params["wo"]
    return x + jax.nn.gelu(x @ params["w1"]) @ params["w2"]


def block_loss(params, x):
    return jnp.mean(transformer_block(params, x) ** 2)


def block_arguments():
    """The block's float32 params and input, as shapes placed on an H200 target."""
    params = {name: jax.ShapeDtypeStruct(shape, jnp.float32) for name, shape in BLOCK_SHAPES.items()}
    x = jax.ShapeDtypeStruct((BATCH, LENGTH, WIDTH), jnp.float32)
    return jaxamp.diagnostics.on_device((params, x), jaxamp.diagnostics.gpu_target_device("h200"))


def test_compiled_for_an_h200_a_transformer_blocks_projections_are_fp8_and_its_attention_cores_bfloat16():
    """Every cuBLAS call of a transformer block's gradient (attention projections and MLP,
    forward and backward) is ``__cublas$lt$matmul$f8`` under the jaxamp_fp8 scope; the
    attention cores (batched dots) run in bfloat16 under the batch_dims fallback scope. XLA
    merges FP8 GEMMs that share an operand (q, k and v's projections), so there are fewer
    calls than the block's 18 projection GEMMs. Fails if any projection GEMM ran in bfloat16
    (a ``__cublas$gemm`` or bf16 ``__cublas$lt$matmul`` call) or a core lost its reason."""
    if not jaxamp.diagnostics._gpu_targets.cuda_plugin_available():
        pytest.skip("needs the CUDA PJRT plugin (pip install 'jax-mixed-precision[gpu-aot]')")
    step = jax.jit(jax.grad(jaxamp.autocast(block_loss, "mixed_float8")))
    text = step.lower(*block_arguments()).compile().as_text()
    op_names = lambda lines: [re.search(r'op_name="([^"]+)"', line).group(1) for line in lines]
    cublas = [line for line in text.splitlines() if "custom-call(" in line and "__cublas" in line]
    assert cublas and all('custom_call_target="__cublas$lt$matmul$f8"' in line for line in cublas)
    assert all("jaxamp_fp8" in name and "fallback" not in name for name in op_names(cublas))
    cores = [line for line in text.splitlines() if re.search(r"= bf16\[[^=]*\bdot\(", line)]
    assert len(cores) == 6  # two cores forward, four backward
    assert all("jaxamp_fp8_fallback_batch_dims" in name for name in op_names(cores))


@pytest.mark.parametrize(
    "order, backward_operands",
    [
        # autocast outside grad sees the backward GEMMs as plain matmuls: e4m3 operands only
        # (the documented limit), still FP8.
        ("autocast(grad)", {("float8_e4m3fn", "float8_e4m3fn")}),
        # grad outside autocast: the FP8 matmul's own backward, with the e5m2 cotangent.
        ("grad(autocast)", {("float8_e4m3fn", "float8_e5m2"), ("float8_e5m2", "float8_e4m3fn")}),
    ],
)
def test_compiled_for_an_h200_at_least_95_percent_of_a_transformer_blocks_gemm_flops_are_cublaslt_fp8(
    order, backward_operands
):
    """The share, from `PrecisionReport.fp8_rows` of the block's gradient (params and input)
    compiled for an H200: of the projection and MLP GEMM FLOPs (every matmul but the
    attention cores), the share in ``__cublas$lt$matmul$f8`` calls, forward and backward.
    Measured: 100.0% forward (6.29 MFLOP) and 100.0% backward (12.58 MFLOP, both GEMMs of
    each layer: input and weight gradients, twice the forward); the six attention cores
    (two forward, four backward, 1.57 MFLOP) are bfloat16 fallbacks with the reason
    batch_dims. Fails if a projection or MLP GEMM ran wider than FP8 (the share drops below
    95%, or it shows as "requested, not fp8"), if a backward GEMM went missing from FP8
    (backward FP8 FLOPs below twice the forward's), or if a core lost its reason."""
    if not jaxamp.diagnostics._gpu_targets.cuda_plugin_available():
        pytest.skip("needs the CUDA PJRT plugin (pip install 'jax-mixed-precision[gpu-aot]')")
    gradient = (
        jaxamp.autocast(jax.grad(block_loss, (0, 1)), "mixed_float8")
        if order == "autocast(grad)"
        else jax.grad(jaxamp.autocast(block_loss, "mixed_float8"), (0, 1))
    )
    # So small a block's GEMMs do not pay on an H200: FP8 is forced to prove every call.
    with jaxamp.diagnostics.fp8_target("everywhere"):
        rows = jaxamp.precision_report(gradient, *block_arguments(), compiled=True).fp8_rows()
    cores = [row for row in rows if row.reason == "batch_dims"]
    gemms = [row for row in rows if row.reason != "batch_dims"]
    for direction, flops in (("forward", BLOCK_GEMM_FLOPS), ("backward", 2 * BLOCK_GEMM_FLOPS)):
        in_fp8 = sum(
            row.flops
            for row in gemms
            if row.direction == direction and row.status == "fp8" and row.primitive == "__cublas$lt$matmul$f8"
        )
        total = sum(row.flops for row in gemms if row.direction == direction)
        assert total == flops and in_fp8 / total >= 0.95, (direction, in_fp8, total, rows)
    assert {row.operand_dtypes for row in gemms if row.direction == "backward"} == backward_operands
    assert {(row.status, row.direction, row.operand_dtypes, row.ops) for row in cores} == {
        ("fallback", "forward", ("bfloat16", "bfloat16"), 2),
        ("fallback", "backward", ("bfloat16", "bfloat16"), 4),
    }


def _resnet_style(params, images):
    """A first convolution on 3 RGB channels, two more (one strided), global pooling, a head."""
    hidden = jax.nn.relu(_conv(images, params["stem"]))
    hidden = jax.nn.relu(_conv(hidden, params["conv1"]))
    hidden = jax.nn.relu(_conv(hidden, params["conv2"], stride=2))
    return jnp.mean(hidden, (1, 2)) @ params["head"]


def test_compiled_for_an_h200_a_resnet_style_nets_forward_convolutions_are_fp8_and_its_backward_bfloat16():
    """The shares, from `PrecisionReport.fp8_rows` of a small ResNet-style net's gradient
    (batch 8, 16x16 images) compiled for an H200. Forward: the two convolutions on 16 and
    32 channels are ``__cudnn$convForwardGraph`` calls on e4m3 operands; the stem, on 3
    input channels, stays bfloat16 with the reason shape_not_multiple_of_16: measured
    28.31 of 30.08 MFLOP, 94.1% of the forward convolution FLOPs in FP8. Backward: every
    convolution bfloat16, under conv_backward (the stem's filter gradient under its shape
    reason): 0% in FP8, by design. Fails if XLA stopped rewriting a forward convolution
    into the cuDNN FP8 graph, if the stem were sent to FP8, or if a backward convolution
    lost its reason."""
    if not jaxamp.diagnostics._gpu_targets.cuda_plugin_available():
        pytest.skip("needs the CUDA PJRT plugin (pip install 'jax-mixed-precision[gpu-aot]')")
    shapes = {"stem": (3, 3, 3, 16), "conv1": (3, 3, 16, 32), "conv2": (3, 3, 32, 32), "head": (32, 16)}
    params = {name: jax.ShapeDtypeStruct(shape, jnp.float32) for name, shape in shapes.items()}
    images = jax.ShapeDtypeStruct((8, 16, 16, 3), jnp.float32)
    loss = lambda params, images: jnp.mean(_resnet_style(params, images) ** 2)
    arguments = jaxamp.diagnostics.on_device((params, images), jaxamp.diagnostics.gpu_target_device("h200"))
    report = jaxamp.precision_report(
        jax.grad(jaxamp.autocast(loss, "mixed_float8")), *arguments, compiled=True
    )
    convolutions = [row for row in report.fp8_rows() if "conv" in row.primitive]
    # Output pixels x kernel window x input channels x 2, per convolution (SAME padding).
    stem, conv1, conv2 = (
        2 * 8 * 16 * 16 * 9 * 3 * 16,
        2 * 8 * 16 * 16 * 9 * 16 * 32,
        2 * 8 * 8 * 8 * 9 * 32 * 32,
    )
    forward = [row for row in convolutions if row.direction == "forward"]
    assert {(row.status, row.primitive, row.operand_dtypes, row.reason, row.flops) for row in forward} == {
        ("fp8", "__cudnn$convForwardGraph", ("float8_e4m3fn", "float8_e4m3fn"), "", conv1 + conv2),
        ("fallback", "__cudnn$convForward", ("bfloat16", "bfloat16"), "shape_not_multiple_of_16", stem),
    }
    forward_share = (conv1 + conv2) / sum(row.flops for row in forward)
    assert forward_share == pytest.approx(0.941, abs=0.001)
    backward = [row for row in convolutions if row.direction == "backward"]
    assert all(
        row.status == "fallback" and row.operand_dtypes == ("bfloat16", "bfloat16") for row in backward
    )
    # Each FP8 convolution's two gradients (input and filter) and the stem's filter gradient
    # (its input gradient is not needed). The strided convolution's input gradient is a
    # convolution dilated over the 16x16 input, whose FLOPs count the dilation's zeros: four
    # times its forward's.
    backward_flops = {
        reason: sum(row.flops for row in backward if row.reason == reason)
        for reason in {r.reason for r in backward}
    }
    assert backward_flops == {
        "conv_backward": 2 * conv1 + conv2 + 4 * conv2,
        "shape_not_multiple_of_16": stem,
    }
