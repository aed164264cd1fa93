"""Blackwell's block-scaled formats: ``mixed_mxfp8`` and ``mixed_nvfp4``, their recipes and their rule.

The numerics run on the CPU, where each GEMM is a float32 GEMM of the
dequantized values; the jaxpr still holds the CUDA branch
(`jax.nn.scaled_matmul`), whose operand shapes say along which axis each
GEMM's operands were quantized. The last tests compile for a B200 target
without a GPU and skip without the CUDA PJRT plugin. Each test says which
fault would make it fail.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxamp
from jaxamp.fp8 import _block_formats as formats
from test_fp8 import equations  # (name scope, equation) of a jaxpr and every jaxpr it carries

MATMUL = (((1,), (0,)), ((), ()))  # x @ w
M, K, N = 64, 96, 32  # three sizes, each a multiple of 32, none equal


def gaussian(seed, *shape):
    return jax.random.normal(jax.random.key(seed), shape)


def relative_error(value, reference):
    value, reference = jnp.asarray(value, jnp.float32), jnp.asarray(reference, jnp.float32)
    return float(jnp.linalg.norm(value - reference) / jnp.linalg.norm(reference))


def block_scaled_gemms(fun, *args):
    """(values shapes, scales shapes, values dtype) of every `jax.nn.scaled_matmul` `fun` traces to."""
    closed = jax.make_jaxpr(fun)(*args)
    return [
        (
            tuple(tuple(v.aval.shape) for v in eq.invars[:2]),
            tuple(tuple(v.aval.shape) for v in eq.invars[2:]),
            eq.invars[0].aval.dtype,
        )
        for _, eq in equations(closed.jaxpr)
        if eq.primitive.name == "scaled_matmul_wrapper"
    ]


def dot_scopes(fun, *args):
    """(name scope, operand dtypes) of every dot_general `fun` traces to, outside the block-scaled kernels."""
    closed = jax.make_jaxpr(fun)(*args)
    return [
        (scope, tuple(v.aval.dtype.name for v in eq.invars))
        for scope, eq in equations(closed.jaxpr)
        if eq.primitive is jax.lax.dot_general_p and "jaxamp_fp8/" not in scope + "/"
    ]


# --- the formats ------------------------------------------------------------------------


def test_mxfp8_rounds_each_value_to_e4m3_at_its_blocks_power_of_two_scale():
    """Each element within half an E4M3 step of itself (2**-4 relative, or 2**-10 of its block's
    scale where E4M3 is subnormal). Fails if the scale were not applied, or taken per tensor (a
    block of small values beside a block of large ones would round to zero)."""
    x = gaussian(0, 8, 128) * jnp.repeat(jnp.array([1e-3, 1.0, 30.0, 1e4]), 32)
    quantized = formats.quantize(x, formats.MXFP8)
    scale = jnp.repeat(quantized.scales.astype(jnp.float32), 32, axis=-1)
    error = jnp.abs(formats.dequantize(quantized) - x)
    assert quantized.values.dtype == jnp.float8_e4m3fn and quantized.scales.shape == (8, 4)
    assert bool(jnp.all(error <= jnp.maximum(jnp.abs(x) * 2.0**-4, scale * 2.0**-10)))


def test_mxfp8_scales_are_powers_of_two_that_fit_each_blocks_amax_under_448():
    """E8M0: 2**ceil(log2(amax / 448)): the block's largest value lands in (224, 448]. Fails if the
    exponent rounded down (values above 448 would clip) or the scale kept a mantissa."""
    x = gaussian(1, 16, 64) * jnp.exp(gaussian(2, 16, 64) * 4)
    quantized = formats.quantize(x, formats.MXFP8)
    scales = np.asarray(quantized.scales.astype(jnp.float32))
    assert quantized.scales.dtype == jnp.float8_e8m0fnu
    np.testing.assert_array_equal(np.log2(scales), np.round(np.log2(scales)))
    block_amax = np.abs(np.asarray(x)).reshape(16, 2, 32).max(-1)
    assert np.all(block_amax / scales <= 448) and np.all(block_amax / scales > 224)


def test_nvfp4_rounds_to_the_e2m1_grid_under_an_e4m3_block_scale_and_a_float32_tensor_scale():
    """Each element within half a grid step (0.5 below 2, 1 below 4, 2 up to 6) at its block's
    scale; dequantizing and quantizing again changes nothing. Fails if the tensor scale were
    left out (E4M3 block scales of a large tensor overflow to NaN) or the grid were wrong."""
    x = gaussian(3, 8, 64) * 1e4
    quantized = formats.quantize(x, formats.NVFP4)
    assert (quantized.values.dtype, quantized.scales.dtype) == (jnp.float4_e2m1fn, jnp.float8_e4m3fn)
    assert quantized.scales.shape == (8, 4) and quantized.tensor_scale.dtype == jnp.float32
    scale = jnp.repeat(quantized.scales.astype(jnp.float32), 16, axis=-1) * quantized.tensor_scale
    scaled = jnp.abs(x) / scale
    half_step = jnp.where(scaled < 2, 0.25, jnp.where(scaled < 4, 0.5, 1.0)) * scale
    dequantized = formats.dequantize(quantized)
    assert bool(jnp.all(jnp.abs(dequantized - x) <= half_step * 1.0001))
    np.testing.assert_array_equal(formats.dequantize(formats.quantize(dequantized, formats.NVFP4)), dequantized)


@pytest.mark.parametrize(
    ("block_format", "nan_rows"), [(formats.MXFP8, 3), (formats.NVFP4, slice(None))], ids=["mxfp8", "nvfp4"]
)
def test_zeros_stay_zeros_and_an_inf_makes_the_product_nan(block_format, nan_rows):
    """A zero tensor gives zeros, not NaN (no 0/0); an inf in an operand gives NaN, so an
    overflowed step is skipped: in MXFP8 the rows its block's NaN scale reaches, in NVFP4 the
    whole product (the tensor scale is NaN). Fails if either NaN rule were dropped (a saturating
    cast turns inf into 448 or 6)."""
    zeros = formats.quantize(jnp.zeros((4, 64)), block_format)
    assert bool(jnp.all(formats.dequantize(zeros) == 0))
    x = gaussian(4, 32, 64).at[3, 5].set(jnp.inf)
    y = jaxamp.fp8.block_scaled_dot_general(x, gaussian(5, 64, 32), MATMUL, block_format.name)
    assert bool(jnp.isnan(y[nan_rows]).all())


def test_nvfp4_weight_tiles_hold_one_quantized_matrix_in_both_directions():
    """16 x 16 tiles: the copy along the columns and the one along the rows dequantize to one
    matrix, transposed. Fails if either copy used 1 x 16 blocks (they would differ)."""
    w = gaussian(6, 64, 48)
    along_cols, along_rows = formats.quantize_2d(w, formats.NVFP4)
    np.testing.assert_array_equal(formats.dequantize(along_cols), formats.dequantize(along_rows).T)
    one_d = formats.quantize(w.T, formats.NVFP4)
    assert not np.array_equal(formats.dequantize(one_d), formats.dequantize(along_rows))


def test_the_hadamard_transform_is_orthogonal_and_keeps_a_products_value():
    """``H H^T = I`` and ``(a H)(b H)^T = a b^T`` over tiles of 16. Fails on a wrong sign vector
    scaling, a missing 1/4, or tiles taken along the wrong axis."""
    matrix = formats.hadamard_matrix()
    np.testing.assert_allclose(matrix @ matrix.T, np.eye(16), atol=1e-6)
    assert set(np.unique(np.abs(matrix))) == {0.25}
    a, b = gaussian(7, 8, 64), gaussian(8, 12, 64)
    np.testing.assert_allclose(formats.hadamard(a) @ formats.hadamard(b).T, a @ b.T, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(formats.hadamard(a.T, transposed=True), formats.hadamard(a), atol=1e-6)


def test_stochastic_rounding_is_unbiased_where_nearest_rounding_is_not():
    """Values between two grid points round up with probability by nearness: the mean error over
    61,440 elements is within 5 standard errors of 0 (nearest rounding is off by 0.4). Fails if
    the draws were not uniform or did not depend on the element (every element would round the
    same way)."""
    x = jnp.full((256, 256), 2.6).at[:, ::16].set(6.0)  # each block's amax 6: a block scale of about 1
    errors = np.asarray(formats.dequantize(formats.quantize(x, formats.NVFP4, rounding="stochastic")) - x)
    errors = np.delete(errors, np.s_[::16], axis=1)
    assert abs(errors.mean()) < 5 * errors.std() / np.sqrt(errors.size)
    assert set(np.round(np.unique(errors + 2.6), 3)) == {2.0, 3.0}
    nearest = np.asarray(formats.dequantize(formats.quantize(x, formats.NVFP4)) - x)
    assert abs(np.delete(nearest, np.s_[::16], axis=1).mean() - 0.4) < 1e-3


def test_stochastic_draws_change_with_the_tensor():
    """The seed is the tensor's own (no PRNG key inside a function): another gradient draws
    otherwise. Fails if the seed were a constant (the same elements would round up every step)."""
    x = jnp.full((64, 64), 2.6).at[:, ::16].set(6.0)
    first = formats.quantize(x, formats.NVFP4, rounding="stochastic").values
    again = formats.quantize(x, formats.NVFP4, rounding="stochastic").values
    other = formats.quantize(x.at[0, 0].set(5.9), formats.NVFP4, rounding="stochastic").values
    np.testing.assert_array_equal(first, again)
    assert np.mean(np.asarray(first[1:]) != np.asarray(other[1:])) > 0.2


# --- the three GEMMs --------------------------------------------------------------------


@pytest.mark.parametrize(("matmul_format", "block"), [("mxfp8", 32), ("nvfp4", 16)])
def test_each_gemm_quantizes_both_operands_along_the_axis_it_contracts(matmul_format, block):
    """Forward contracts K, dgrad N, wgrad M: the three block-scaled GEMMs take [1, P, C] values
    with [1, P, C / block] scales, C = K, N and M. Fails if the backward reused the forward's
    copies (blocks along K for a GEMM contracting N or M)."""
    x, w = gaussian(9, M, K), gaussian(10, K, N)

    def loss(x, w):
        return jaxamp.fp8.block_scaled_dot_general(x, w, MATMUL, matmul_format).astype(jnp.float32).sum()

    gemms = block_scaled_gemms(jax.grad(loss, argnums=(0, 1)), x, w)
    contracted = sorted(values[0][-1] for values, _, _ in gemms)
    assert contracted == sorted([K, N, M]) and len(gemms) == 3
    for values, scales, dtype in gemms:
        assert values[0][-1] == values[1][-1] and scales[0][-1] == scales[1][-1] == values[0][-1] // block
        assert dtype == formats.BLOCK_FORMATS[matmul_format].values_dtype


def test_the_hadamard_transform_reaches_the_wgrad_gemm_only():
    """Without the transform, the forward and dgrad are bit for bit the same and only the weight
    gradient changes. Fails if the transform reached the forward or dgrad operands (which need
    it on both sides of their GEMM) or never ran."""
    x, w = gaussian(11, M, K) * jnp.exp(gaussian(12, M, K)), gaussian(13, K, N)

    def run():
        y, vjp = jax.vjp(lambda x, w: jaxamp.fp8.block_scaled_dot_general(x, w, MATMUL, "nvfp4"), x, w)
        return (y, *vjp(jnp.ones_like(y)))

    with jaxamp.fp8.block_recipe(stochastic_gradients=False):
        y, d_x, d_w = run()
    with jaxamp.fp8.block_recipe(stochastic_gradients=False, hadamard=False):
        y_plain, d_x_plain, d_w_plain = run()
    np.testing.assert_array_equal(y, y_plain)
    np.testing.assert_array_equal(d_x, d_x_plain)
    assert not np.array_equal(d_w, d_w_plain)
    exact = x.T @ jnp.ones((M, N))
    assert relative_error(d_w, exact) < 0.2 and relative_error(d_w_plain, exact) < 0.2


@pytest.mark.parametrize(
    ("policy", "bound"), [("mixed_mxfp8", 0.1), ("mixed_nvfp4", 0.35)], ids=["mxfp8", "nvfp4"]
)
def test_a_tiny_mlps_gradients_are_finite_and_near_float32s(policy, bound):
    """Measured against float32 (batch 256): mixed_bfloat16 0.5%, mixed_mxfp8 3% and 6%,
    mixed_nvfp4 15% and 24%. Fails if a GEMM used the wrong operand copy or a wrong scale
    (far off), or if the rule did not run (0.5%, as bfloat16)."""
    keys = jax.random.split(jax.random.key(0), 3)
    params = {"w1": jax.random.normal(keys[0], (64, 128)) / 8, "w2": jax.random.normal(keys[1], (128, 32)) / 11}
    x = jax.random.normal(keys[2], (256, 64))

    def mlp(params, x):
        return jnp.mean((jax.nn.gelu(x @ params["w1"]) @ params["w2"]) ** 2)

    reference = jax.grad(mlp)(params, x)
    grads = jax.jit(jax.grad(jaxamp.autocast(mlp, policy)))(params, x)
    for name in grads:
        assert bool(jnp.all(jnp.isfinite(grads[name])))
        assert 0.02 < relative_error(grads[name], reference[name]) < bound, name


# --- the policies and the rule ----------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "matmul_format"),
    [("mixed_mxfp8", "mxfp8"), ("mixed_nvfp4", "nvfp4"), ("p=f32,c=bf16,o=f32,matmul=NVFP4", "nvfp4")],
)
def test_the_block_scaled_policies_are_mixed_bfloat16_with_a_matmul_format(spec, matmul_format):
    policy = jaxamp.get_policy(spec)
    assert (policy.param_dtype, policy.compute_dtype, policy.output_dtype) == (
        jnp.float32, jnp.bfloat16, jnp.float32
    )  # fmt: skip
    assert policy.fp8_matmuls and policy.matmul_format == matmul_format
    assert jaxamp.get_policy(str(policy)) == policy
    assert jaxamp.get_policy("mixed_float8").matmul_format == "float8"


def test_a_mistyped_format_is_answered_with_the_formats():
    with pytest.raises(ValueError, match=r"Unknown matmul dtype 'mxfp4'.*float8.*mxfp8, nvfp4"):
        jaxamp.get_policy("p=f32,c=bf16,matmul=mxfp4")
    with pytest.raises(ValueError, match=r"Did you mean mixed_nvfp4\?"):
        jaxamp.get_policy("mixed_nvfp8")
    with pytest.raises(ValueError, match=r"Unknown block-scaled format 'fp4'; choose one of mxfp8, nvfp4"):
        jaxamp.fp8.block_scaled_dot_general(jnp.ones((32, 32)), jnp.ones((32, 32)), MATMUL, "fp4")


def test_eligible_matmuls_run_block_scaled_and_the_others_fall_back_by_name():
    """Under mixed_mxfp8: x @ w runs block-scaled; a dot with N = 48 (not a multiple of 32)
    falls back as shape_not_multiple_of_32, an attention-like batched dot as batch_dims, a
    convolution as block_scaled_conv. Fails if the eligibility check used per-tensor FP8's 16,
    or a fallback lost its name."""
    x, w, w48 = gaussian(14, M, K), gaussian(15, K, N), gaussian(16, K, 48)
    q, images, kernel = gaussian(17, 2, 32, 32), gaussian(18, 1, 8, 8, 32), gaussian(19, 3, 3, 32, 32)

    def fun(x, w, w48, q, images, kernel):
        scores = jnp.einsum("bqd,bkd->bqk", q, q)
        conv = jax.lax.conv_general_dilated(images, kernel, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
        return (x @ w).sum() + (x @ w48).sum() + scores.sum() + conv.sum()

    args = (x, w, w48, q, images, kernel)
    assert len(block_scaled_gemms(jaxamp.autocast(fun, "mixed_mxfp8"), *args)) == 1
    scopes = " ".join(scope for scope, _ in dot_scopes(jaxamp.autocast(fun, "mixed_mxfp8"), *args))
    assert "jaxamp_fp8_fallback_shape_not_multiple_of_32" in scopes
    assert "jaxamp_fp8_fallback_batch_dims" in scopes
    closed = jax.make_jaxpr(jaxamp.autocast(fun, "mixed_mxfp8"))(*args)
    convolutions = [s for s, eq in equations(closed.jaxpr) if eq.primitive.name == "conv_general_dilated"]
    assert convolutions and all("jaxamp_fp8_fallback_block_scaled_conv" in s for s in convolutions)
    for reason in ("shape_not_multiple_of_32", "block_scaled_conv", "needs_blackwell"):
        assert reason in jaxamp.diagnostics.FP8_FALLBACK_REASONS


def test_a_gpu_before_blackwell_keeps_every_matmul_in_bfloat16():
    """On an H200 target the block-scaled policies fall back as needs_blackwell. Fails if the
    rule ran block-scaled GEMMs where there are no block-scaled tensor cores."""
    x, w = gaussian(20, M, K), gaussian(21, K, N)
    with jaxamp.diagnostics.fp8_target("h200"):
        found = dot_scopes(jaxamp.autocast(lambda x, w: x @ w, "mixed_nvfp4"), x, w)
    assert len(found) == 1 and "jaxamp_fp8_fallback_needs_blackwell" in found[0][0]
    assert found[0][1] == ("bfloat16", "bfloat16")


def test_a_layer_class_may_run_another_format_than_the_model():
    """TransformerEngine's advice for NVFP4: the last layers in a wider format. An override to
    mixed_mxfp8 runs the head in E4M3 while the rest runs E2M1; one to mixed_bf16 in bfloat16.
    Fails if a policy scope forgot its format (the head would run NVFP4)."""
    import flax.linen as nn  # pylint: disable=import-outside-toplevel

    class Head(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(32)(x)

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            return Head()(nn.gelu(nn.Dense(64)(x)))

    x = jnp.ones((32, 64))
    for head_policy, head_dtype in (("mixed_mxfp8", "float8_e4m3fn"), ("mixed_bf16", "bfloat16")):
        model = jaxamp.apply_policy(Model(), "mixed_nvfp4", overrides={Head: head_policy})
        variables = model.init(jax.random.key(0), x)
        step = jax.grad(lambda v, model=model: model.apply(v, x).sum())
        # MXFP8's gradients are E4M3 too: per-tensor FP8 would show a float8_e5m2 cotangent.
        assert set(jaxamp.precision_report(step, variables).flops_by_dtype()) == {"float4_e2m1fn", head_dtype}


# --- the cost model and the B200 program ------------------------------------------------


def test_the_block_scaled_cost_model_needs_a_blackwell_gpu():
    with pytest.raises(ValueError, match=r"H200 has no block-scaled tensor cores.*b200"):
        jaxamp.diagnostics.fp8_matmul_cost(4096, 4096, 4096, "h200", matmul_format="nvfp4")
    with pytest.raises(ValueError, match=r"Unknown matmul_format 'fp4'"):
        jaxamp.diagnostics.fp8_matmul_cost(4096, 4096, 4096, "b200", matmul_format="fp4")


def test_nvfp4_pays_later_than_mxfp8_and_both_later_than_per_tensor_fp8_on_a_b200():
    """With XLA's unfused quantization passes, on paper at 4096^3: FP8 1.39x, MXFP8 1.22x, NVFP4
    1.04x bfloat16; at GPT-2's 8192 x 768 x 3072 none of the block formats pays. Fails if the
    quantization passes were left out (NVFP4's GEMMs alone are 4x bfloat16's)."""
    cost = {
        fmt: jaxamp.diagnostics.fp8_matmul_cost(4096, 4096, 4096, "b200", matmul_format=fmt).speedup
        for fmt in ("float8", "mxfp8", "nvfp4")
    }
    assert cost["float8"] > cost["mxfp8"] > cost["nvfp4"] > 1
    small = jaxamp.diagnostics.fp8_matmul_cost(8192, 768, 3072, "b200", matmul_format="nvfp4")
    assert not small.pays


def _needs_plugin():
    if not jaxamp.diagnostics.cuda_plugin_available():
        pytest.skip("needs the CUDA PJRT plugin (pip install 'jax-mixed-precision[gpu-aot]')")


@pytest.mark.parametrize(("matmul_format", "dtype"), [("mxfp8", "float8_e4m3fn"), ("nvfp4", "float4_e2m1fn")])
def test_compiled_for_a_b200_the_three_gemms_are_cudnn_block_scaled_dots(matmul_format, dtype):
    """With cuDNN 9.10 stated, XLA rewrites the three GEMMs of one matmul's training pass into
    cuDNN's block-scaled dot; the cost model's bytes are within 5% of the compiled kernels'.
    Fails if a GEMM ran in bfloat16 or the model's passes drifted from what XLA compiles."""
    _needs_plugin()
    m, k, n = 2048, 1024, 4096
    device = jaxamp.diagnostics.gpu_target_device("b200", cudnn_version=(9, 10))

    def step(x, w, g):
        y, vjp = jax.vjp(lambda x, w: jaxamp.fp8.block_scaled_dot_general(x, w, MATMUL, matmul_format), x, w)
        return y, vjp(g)

    structs = [jax.ShapeDtypeStruct(shape, jnp.bfloat16) for shape in ((m, k), (k, n), (m, n))]
    text = jax.jit(step).lower(*jaxamp.diagnostics.on_device(structs, device)).compile().as_text()
    roofline = jaxamp.diagnostics.kernel_roofline(text, "b200")
    gemms = [kernel for kernel in roofline.kernels if kernel.flops]
    assert [kernel.kind for kernel in gemms] == ["__cudnn$blockScaledDot"] * 3
    assert all(set(kernel.flops) == {dtype} for kernel in gemms)
    model = jaxamp.diagnostics.fp8_matmul_cost(m, k, n, "b200", matmul_format=matmul_format)
    assert model.fp8_s == pytest.approx(roofline.per_kernel_s, rel=0.05)
