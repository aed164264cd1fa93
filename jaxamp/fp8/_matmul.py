"""FP8 matrix multiplication: per-tensor current scaling and the FP8 dot.

One job: turn a ``dot_general`` into an FP8 GEMM, forward and backward, the
way NVIDIA TransformerEngine does on Hopper GPUs, without state.

The algorithm of `fp8_dot_general(lhs, rhs, dimension_numbers)`:

```text
forward:   q_lhs, s_lhs = quantize(lhs, float8_e4m3fn)
           q_rhs, s_rhs = quantize(rhs, float8_e4m3fn)
           out = dot(q_lhs, q_rhs) * s_lhs * s_rhs    # float32 accumulation,
                                                      # fast accumulation
           return out.astype(result dtype)             # bfloat16 by default
backward:  q_g, s_g = quantize(cotangent, float8_e5m2)
           d_lhs = dot(q_g, q_rhs) * s_g * s_rhs      # split accumulation
           d_rhs = dot(q_lhs, q_g) * s_lhs * s_g      # (as JAX's transpose rules)

quantize(x, fp8):                           # current scaling
    amax  = max(|x|)                        # of the tensor now
    scale = fp8.max / amax   (1 if amax is 0 or not finite)
    q     = clip(x * scale, -fp8.max, fp8.max).astype(fp8)
    s     = 1 / scale        (NaN if amax is not finite)
    return q, s
```

So all three GEMMs of a matmul's training step are FP8 GEMMs, and only the
quantized operands (FP8 values and a float32 scale each) are kept for the
backward. A tensor of zeros has amax 0 and gives zeros, never NaN. An inf
or NaN in an operand or cotangent makes its ``s`` NaN, so the whole result
is NaN: a saturating cast alone would turn inf into 448 and hide an overflow
from `jaxamp.all_finite`, and the train step would not be skipped.

Where it runs: on CUDA the dot carries
``lax.DotAlgorithmPreset.ANY_F8_ANY_F8_F32_FAST_ACCUM`` (forward) or
``ANY_F8_ANY_F8_F32`` (backward), which XLA compiles to cuBLASLt's FP8 GEMM
(``__cublas$lt$matmul$f8``) with the scales fused into it. Elsewhere (CPU)
the presets are refused, so a plain ``dot_general`` of the FP8 operands runs:
the same FP8 products with float32 accumulation, and no speed-up.
`lax.platform_dependent` picks the branch when the program is lowered.

Under delayed scaling (TransformerEngine's recipe, `jaxamp.fp8.delayed_scaling`),
each FP8 site scales from the history's amax
(``scale = fp8.max / amax_in``), so the cast does not wait for the amax of
the tensor now, which is computed beside it and sent out of the step
through a probe's gradient (`jaxamp.fp8._delayed`); the NaN rule above still
holds. Whether XLA reads the tensor once for both is its fusion's choice:
compiled for an H200 it fuses the cast into the transpose that cuBLASLt's
FP8 GEMM needs and keeps the amax a reduction of its own. Before the history's
first step is recorded the sites use current scaling.

`jaxamp.diagnostics.fp8_quantization_stats` reads how many values
underflowed (nonzero values that quantize to zero), saturated and were not
finite, through the kernel's `observer` hook, without changing what
`jaxamp.autocast` computes.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxamp.fp8._delayed import current_fp8_sites

FP8_FORWARD_DTYPE = jnp.dtype(jnp.float8_e4m3fn)
"""Operands of the forward GEMM: 3 mantissa bits, largest value 448."""

FP8_BACKWARD_DTYPE = jnp.dtype(jnp.float8_e5m2)
"""The incoming cotangent of the backward GEMMs: 2 mantissa bits, largest value 57344."""

FP8_SCOPE_NAME = "jaxamp_fp8"
"""The `jax.named_scope` every FP8 GEMM is traced under (it names the op in compiled HLO)."""

FP8_PAYS_SCOPE_NAME = "jaxamp_fp8_pays"
"""An FP8 matmul that a target GPU judged faster in FP8 is traced under this scope too."""

FP8_FALLBACK_SCOPE_PREFIX = "jaxamp_fp8_fallback_"
"""A fallback runs under ``jax.named_scope(FP8_FALLBACK_SCOPE_PREFIX + reason)``."""

FP8_FALLBACK_REASONS: Mapping[str, str] = types.MappingProxyType({
    "shape_not_multiple_of_16": (
        "a dot's M, N or K (the product of the lhs free dims, of the rhs free dims, of the "
        "contracting dims), or a convolution's input or output features, is not a multiple of 16, the FP8 GEMM granularity of cuBLASLt and TransformerEngine. "
        "XLA would pad such an op and still run FP8; jaxamp keeps it in bfloat16 instead, since "
        "such matmuls are small (a classifier head, a projection to a few outputs) and sit where "
        "precision matters most."
    ),
    "shape_not_multiple_of_32": (
        "under mixed_mxfp8, a dot's M, N or K is not a multiple of 32, MXFP8's block size: each of "
        "the three GEMMs of its training step contracts one of them in blocks of 32."
    ),
    "batch_dims": (
        "the dot has batch dimensions: an attention core (queries times keys, probabilities "
        "times values) or another batched matmul; FP8 attention needs its own scaling of the "
        "softmax probabilities, so it stays bfloat16."
    ),
    "integer_operands": "an integer dot (int8 matmuls); runs as traced.",
    "grouped_conv": "a grouped or depthwise convolution (feature or batch groups), kept in bfloat16.",
    "transposed_conv": "a transposed convolution (lhs dilation), kept in bfloat16.",
    "conv_backward": (
        "the two backward convolutions (input and kernel gradients) of an FP8 forward "
        "convolution: XLA rewrites only forward convolutions into cuDNN FP8 graphs, so these run "
        "in bfloat16 on the saved FP8 operands."
    ),
    "ragged_dot": "a ragged (grouped) dot, which has no FP8 form here.",
    "needs_blackwell": (
        "under mixed_mxfp8 or mixed_nvfp4, the target GPU (jaxamp.diagnostics.fp8_target's, else the "
        "GPU run on) has no block-scaled tensor cores (they start with Blackwell, compute capability "
        "10.0), so the matmul runs in the compute dtype."
    ),
    "block_scaled_conv": (
        "a convolution under mixed_mxfp8 or mixed_nvfp4: XLA has no block-scaled convolution, so it "
        "runs in the compute dtype."
    ),
    "too_small_to_pay": (
        "for its shape, the FP8 GEMMs plus their quantization passes are slower on paper than the "
        "same GEMMs in the compute dtype on the target GPU (jaxamp.diagnostics.fp8_matmul_cost; the "
        "target is jaxamp.diagnostics.fp8_target's, else the GPU run on). "
        "fp8_target('everywhere') runs it in FP8 anyway."
    ),
})
"""Why an eligible-looking matmul or convolution did not run in FP8, by slug.

The slug is what the compiled program's op names carry
(``jaxamp_fp8_fallback_<slug>``); the value says what it means."""

_FORWARD_PRESET = lax.DotAlgorithmPreset.ANY_F8_ANY_F8_F32_FAST_ACCUM
_BACKWARD_PRESET = lax.DotAlgorithmPreset.ANY_F8_ANY_F8_F32

DimensionNumbers = tuple[tuple[Sequence[int], Sequence[int]], tuple[Sequence[int], Sequence[int]]]


class Quantized(NamedTuple):
    """A tensor in FP8 with its per-tensor scale.

    Attributes:
        values: the FP8 values, ``x * scale`` rounded.
        scale_inv: float32 scalar, ``1 / scale``: ``values * scale_inv``
            approximates ``x``. NaN when ``x`` held an inf or a NaN.
    """

    values: jax.Array
    scale_inv: jax.Array


def quantize(x: jax.Array, dtype: Any = FP8_FORWARD_DTYPE) -> Quantized:
    """`x` in FP8 with current per-tensor scaling (the amax of `x` now).

    Args:
        x: a floating array.
        dtype: ``jnp.float8_e4m3fn`` or ``jnp.float8_e5m2``.

    Returns:
        The FP8 values and the inverse scale (see the module docstring for
        the algorithm, zeros and non-finite values).
    """
    return _quantize(x, dtype)[0]


def _quantize(x: jax.Array, dtype: Any, scale_amax: jax.Array | None = None) -> tuple[Quantized, jax.Array]:
    """`x` in FP8, scaled by `scale_amax` (delayed) or by its own amax (current); and its amax.

    With `scale_amax` given, the scale is known before the cast, and the amax
    (which only the history and the NaN flag read) can be computed in the same
    pass over `x` where XLA fuses the two; current scaling must finish the
    amax first.
    """
    fp8_max = float(jnp.finfo(dtype).max)
    x32 = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x32))
    basis = amax if scale_amax is None else scale_amax.astype(jnp.float32)
    usable = jnp.isfinite(basis) & (basis > 0)
    scale = jnp.where(usable, fp8_max / jnp.where(usable, basis, 1.0), 1.0)
    values = jnp.clip(x32 * scale, -fp8_max, fp8_max).astype(dtype)
    # The NaN scale is what carries an inf or NaN through: see the module docstring.
    scale_inv = jnp.where(jnp.isfinite(amax), 1.0 / scale, jnp.nan).astype(jnp.float32)
    return Quantized(values, scale_inv), amax


def _scaled_dot(
    lhs: Quantized, rhs: Quantized, dimension_numbers: DimensionNumbers, preset: Any, result_dtype: Any
) -> jax.Array:
    """``dot(lhs, rhs) * scales`` as `result_dtype`, accumulated in float32; the preset on CUDA only.

    A bfloat16 result is asked of the dot itself, the scales multiplied in
    bfloat16: XLA then fuses both into the cuBLASLt call, which writes the
    bfloat16 result directly. A float32 product cast afterwards costs one more
    kernel that reads 4 and writes 2 bytes per element of the result (the FP8
    results page, docs/results/fp8.md, measures it). Rounding the product and the scales to
    bfloat16 costs at most 2**-8 of relative error, far below FP8's own.
    float16 results stay on the float32 path: an unscaled product of FP8
    values (up to 448**2 per term) overflows float16.
    """
    product_dtype = jnp.bfloat16 if jnp.dtype(result_dtype) == jnp.bfloat16 else jnp.float32

    def scaled(lhs_values, rhs_values, lhs_scale_inv, rhs_scale_inv, *, precision):
        product = lax.dot_general(
            lhs_values,
            rhs_values,
            dimension_numbers,
            precision=precision,
            preferred_element_type=product_dtype,
        )
        # Inside each branch, so that XLA fuses the scales into the cuBLASLt call.
        return (product * (lhs_scale_inv * rhs_scale_inv).astype(product_dtype)).astype(result_dtype)

    return lax.platform_dependent(
        lhs.values,
        rhs.values,
        lhs.scale_inv,
        rhs.scale_inv,
        cuda=functools.partial(scaled, precision=preset),
        default=functools.partial(scaled, precision=None),
    )


def _ranges_like(*sequences: Sequence[int]) -> list[list[int]]:
    start, ranges = 0, []
    for sequence in sequences:
        ranges.append(list(range(start, start + len(sequence))))
        start += len(sequence)
    return ranges


def _remaining(dims: range, *excluded: Sequence[int]) -> list[int]:
    taken = {int(dim) for group in excluded for dim in group}
    return [dim for dim in dims if dim not in taken]


def _operand_gradient(
    g: Quantized, other: Quantized, ndim: int, dimension_numbers, operand_is_lhs: bool, result_dtype: Any
) -> jax.Array:
    """The cotangent of one operand of ``dot_general(lhs, rhs)``, as an FP8 dot in `result_dtype`.

    As JAX's transpose rule (``_dot_general_transpose_lhs``), the cotangent
    `g` is contracted with the other operand's kept dims and the result's
    axes are put back in the operand's order. Of the two operand orders,
    ``dot(g, other)`` and ``dot(other, g)``, the one whose result is already
    in the operand's axis order is taken when there is one (the weight
    gradient ``x.T @ g`` of ``x @ w`` is ``dot(x, g)``): XLA fuses the scales
    into the cuBLASLt call only when no transpose follows it.

    Args:
        g: the quantized cotangent of the product.
        other: the other operand, quantized.
        ndim: the rank of the operand whose gradient this is.
        dimension_numbers: ``((contract, other_contract), (batch, other_batch))``,
            this operand's first.
        operand_is_lhs: whether this operand was the product's lhs.
        result_dtype: the operand's dtype, which its cotangent takes.
    """
    (contract, other_contract), (batch, other_batch) = dimension_numbers
    kept = _remaining(range(ndim), contract, batch)
    other_kept = _remaining(range(other.values.ndim), other_contract, other_batch)
    if operand_is_lhs:
        ans_batch, _, ans_other = _ranges_like(batch, kept, other_kept)
    else:
        ans_batch, ans_other, _ = _ranges_like(batch, other_kept, kept)
    contract_by_other = [int(dim) for dim in np.take(contract, np.argsort(other_contract))]
    g_first = list(batch) + kept + contract_by_other
    other_first = list(batch) + contract_by_other + kept
    if other_first == sorted(other_first) and g_first != sorted(g_first):
        dims = ((other_kept, ans_other), (list(other_batch), ans_batch))
        product = _scaled_dot(other, g, dims, _BACKWARD_PRESET, result_dtype)
        unsorted_axes = other_first
    else:
        dims = ((ans_other, other_kept), (ans_batch, list(other_batch)))
        product = _scaled_dot(g, other, dims, _BACKWARD_PRESET, result_dtype)
        unsorted_axes = g_first
    permutation = tuple(int(axis) for axis in np.argsort(unsorted_axes))
    if permutation == tuple(range(ndim)):
        return product
    return lax.transpose(product, permutation)


def _observe(observer: Callable | None, role: str, x: jax.Array, quantized: Quantized) -> None:
    """Sends `x`'s quantization counts to `observer` (a `fp8_quantization_stats` run only)."""
    if observer is None:
        return
    x32 = x.astype(jnp.float32)
    dtype = quantized.values.dtype
    finite = jnp.isfinite(x32)
    scaled = x32 / jnp.where(jnp.isnan(quantized.scale_inv), 1.0, quantized.scale_inv)
    # Saturated: what the cast alone would make non-finite (NaN in e4m3fn, inf in e5m2), so that a
    # scaled amax rounded a hair above the largest value (the cast rounds it back) is not counted.
    beyond_range = ~jnp.isfinite(scaled.astype(dtype).astype(jnp.float32))
    counts = {
        "elements": jnp.asarray(x32.size, jnp.int32),
        "nonzero": jnp.sum(x32 != 0, dtype=jnp.int32),
        "underflowed": jnp.sum(
            finite & (x32 != 0) & (quantized.values.astype(jnp.float32) == 0), dtype=jnp.int32
        ),
        "saturated": jnp.sum(finite & beyond_range, dtype=jnp.int32),
        "non_finite": jnp.sum(~finite, dtype=jnp.int32),
        "amax": jnp.max(jnp.abs(x32)),
    }
    jax.debug.callback(functools.partial(observer, role, tuple(x.shape), dtype.name), counts)


def _quantize_operands(lhs, rhs, scale_amax, observer: Callable | None) -> tuple:
    """Both forward operands in ``float8_e4m3fn``, their counts sent to `observer`; and their amaxes.

    `scale_amax` is the site's row of delayed amaxes (lhs, rhs, cotangent), or None for current scaling.
    """
    lhs_amax, rhs_amax = (None, None) if scale_amax is None else (scale_amax[0], scale_amax[1])
    q_lhs, amax_lhs = _quantize(lhs, FP8_FORWARD_DTYPE, lhs_amax)
    q_rhs, amax_rhs = _quantize(rhs, FP8_FORWARD_DTYPE, rhs_amax)
    _observe(observer, "lhs", lhs, q_lhs)
    _observe(observer, "rhs", rhs, q_rhs)
    return q_lhs, q_rhs, jnp.stack([amax_lhs, amax_rhs])


def _delayed_residuals(scale_amax, probe, forward_amax) -> tuple:
    """What the backward needs of delayed scaling: the cotangent's amax to scale by (None: current
    scaling) and the forward amaxes to send out (None: no probe, nothing sent)."""
    return (None if scale_amax is None else scale_amax[2], None if probe is None else forward_amax)


def _probe_gradient(forward_amax, cotangent_amax) -> jax.Array | None:
    """The derivative of a site's probe row: its amaxes (lhs, rhs, cotangent); None without a probe."""
    if forward_amax is None:
        return None
    return jnp.concatenate([forward_amax, jnp.reshape(cotangent_amax, (1,))]).astype(jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _fp8_dot(lhs, rhs, scale_amax, probe, dimension_numbers, result_dtype, observer):
    return _fp8_dot_forward(lhs, rhs, scale_amax, probe, dimension_numbers, result_dtype, observer)[0]


def _fp8_dot_forward(lhs, rhs, scale_amax, probe, dimension_numbers, result_dtype, observer):
    with jax.named_scope(FP8_SCOPE_NAME):
        q_lhs, q_rhs, forward_amax = _quantize_operands(lhs, rhs, scale_amax, observer)
        out = _scaled_dot(q_lhs, q_rhs, dimension_numbers, _FORWARD_PRESET, result_dtype)
    # Only the FP8 values, their scales and the operands' dtypes are kept (and delayed scaling's amaxes).
    dtypes = (np.zeros((), lhs.dtype), np.zeros((), rhs.dtype))
    return out, (q_lhs, q_rhs, dtypes, _delayed_residuals(scale_amax, probe, forward_amax))


def _fp8_dot_backward(dimension_numbers, result_dtype, observer, residuals, cotangent):
    q_lhs, q_rhs, (lhs_dtype, rhs_dtype), (cotangent_scale_amax, forward_amax) = residuals
    with jax.named_scope(FP8_SCOPE_NAME):
        q_cotangent, cotangent_amax = _quantize(cotangent, FP8_BACKWARD_DTYPE, cotangent_scale_amax)
        _observe(observer, "cotangent", cotangent, q_cotangent)
        (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = dimension_numbers
        rhs_first = ((rhs_contract, lhs_contract), (rhs_batch, lhs_batch))
        d_lhs = _operand_gradient(
            q_cotangent, q_rhs, q_lhs.values.ndim, dimension_numbers, True, lhs_dtype.dtype
        )
        d_rhs = _operand_gradient(q_cotangent, q_lhs, q_rhs.values.ndim, rhs_first, False, rhs_dtype.dtype)
    # The history's amaxes are not differentiated: their cotangent is zero (None).
    return d_lhs, d_rhs, None, _probe_gradient(forward_amax, cotangent_amax)


_fp8_dot.defvjp(_fp8_dot_forward, _fp8_dot_backward)


def _dequantize(quantized: Quantized, dtype: Any) -> jax.Array:
    return quantized.values.astype(dtype) * quantized.scale_inv.astype(dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _fp8_convolution(lhs, rhs, scale_amax, probe, convolution, result_dtype, observer):
    return _fp8_convolution_forward(lhs, rhs, scale_amax, probe, convolution, result_dtype, observer)[0]


def _fp8_convolution_forward(lhs, rhs, scale_amax, probe, convolution, result_dtype, observer):
    with jax.named_scope(FP8_SCOPE_NAME):
        q_lhs, q_rhs, forward_amax = _quantize_operands(lhs, rhs, scale_amax, observer)
        # convert(f8) times a scalar scale on both operands: the pattern that XLA
        # rewrites into a cuDNN FP8 convolution graph.
        out = convolution(_dequantize(q_lhs, result_dtype), _dequantize(q_rhs, result_dtype))
    dtypes = (np.zeros((), lhs.dtype), np.zeros((), rhs.dtype))
    return out, (q_lhs, q_rhs, dtypes, None if probe is None else forward_amax)


def _fp8_convolution_backward(convolution, result_dtype, observer, residuals, cotangent):
    q_lhs, q_rhs, (lhs_dtype, rhs_dtype), forward_amax = residuals
    with jax.named_scope(FP8_FALLBACK_SCOPE_PREFIX + "conv_backward"):
        lhs, rhs = _dequantize(q_lhs, result_dtype), _dequantize(q_rhs, result_dtype)
        cotangent = cotangent.astype(result_dtype)
        # Transposed one operand at a time: a vjp would trace the forward convolution again.
        (d_lhs,) = jax.linear_transpose(lambda lhs: convolution(lhs, rhs), lhs)(cotangent)
        (d_rhs,) = jax.linear_transpose(lambda rhs: convolution(lhs, rhs), rhs)(cotangent)
    # The cotangent is not quantized (bfloat16 backward): its amax slot stays 0.
    probe_gradient = _probe_gradient(forward_amax, jnp.zeros((), jnp.float32))
    return d_lhs.astype(lhs_dtype.dtype), d_rhs.astype(rhs_dtype.dtype), None, probe_gradient


_fp8_convolution.defvjp(_fp8_convolution_forward, _fp8_convolution_backward)


def _next_site() -> tuple[jax.Array | None, jax.Array | None]:
    """This FP8 site's row of delayed amaxes and of the probe, under `delayed_scaling`; else Nones."""
    sites = current_fp8_sites()
    if sites is None:
        return None, None
    amax, probe = sites.rows(1)
    return (None if amax is None else amax[0]), probe[0]


def fp8_convolution(
    lhs: jax.Array,
    rhs: jax.Array,
    convolution: Callable[[jax.Array, jax.Array], jax.Array],
    result_dtype: Any = jnp.bfloat16,
    *,
    _observer: Callable | None = None,
) -> jax.Array:
    """A convolution whose forward takes FP8 operands; its two backward convolutions bfloat16.

    ``convolution(lhs, rhs)`` is the convolution in `result_dtype` (a
    ``lax.conv_general_dilated`` with its options bound). Both operands are
    quantized to ``float8_e4m3fn`` with current scaling (see `quantize`)
    and handed to it as ``convert(fp8) * scale``, which XLA rewrites into a
    cuDNN FP8 convolution (``__cudnn$convForwardGraph`` on FP8 operands) on
    a Hopper GPU. The backward differentiates ``convolution`` on the saved
    FP8 operands in `result_dtype`, under the ``conv_backward`` fallback
    scope: XLA has no FP8 rewrite for backward convolutions.

    Args:
        lhs: floating input.
        rhs: floating kernel.
        convolution: a function of (input, kernel), linear in each.
        result_dtype: dtype of the result and of the backward convolutions.

    Returns:
        The convolution's result in `result_dtype`; gradients in the operands' dtypes.
    """
    scale_amax, probe = _next_site()
    return _fp8_convolution(lhs, rhs, scale_amax, probe, convolution, jnp.dtype(result_dtype), _observer)


def _canonical_dimension_numbers(dimension_numbers: Any, lhs_ndim: int, rhs_ndim: int) -> tuple:
    try:
        (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = dimension_numbers
        canonical = tuple(
            tuple(tuple(int(dim) for dim in dims) for dims in pair)
            for pair in ((lhs_contract, rhs_contract), (lhs_batch, rhs_batch))
        )
    except (TypeError, ValueError) as error:
        raise TypeError(
            "fp8_dot_general's dimension_numbers must be ((lhs_contracting, rhs_contracting), "
            f"(lhs_batch, rhs_batch)) as for jax.lax.dot_general; got {dimension_numbers!r}."
        ) from error
    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = canonical
    if len(lhs_contract) != len(rhs_contract) or len(lhs_batch) != len(rhs_batch):
        raise ValueError(
            f"fp8_dot_general's dimension_numbers {dimension_numbers!r} pair a different number of "
            "lhs and rhs dims; each lhs contracting (batch) dim needs one rhs contracting (batch) dim."
        )
    for dims, ndim, side in (
        (lhs_contract + lhs_batch, lhs_ndim, "lhs"),
        (rhs_contract + rhs_batch, rhs_ndim, "rhs"),
    ):
        if any(not 0 <= dim < ndim for dim in dims) or len(set(dims)) != len(dims):
            raise ValueError(
                f"fp8_dot_general's dimension_numbers {dimension_numbers!r} name {side} dims "
                f"{dims}, which must be distinct and within the {side}'s {ndim} dims."
            )
    return canonical


def fp8_dot_general(
    lhs: jax.Array,
    rhs: jax.Array,
    dimension_numbers: Any,
    preferred_element_type: Any = jnp.bfloat16,
    *,
    _observer: Callable | None = None,
) -> jax.Array:
    """``lax.dot_general`` as an FP8 GEMM, forward and backward, with current scaling.

    Each operand is quantized to ``float8_e4m3fn`` with its own scale (its
    amax now), the product is accumulated in float32 and returned in
    `preferred_element_type`; the gradient quantizes the incoming cotangent
    to ``float8_e5m2`` and runs both backward GEMMs in FP8 (a custom VJP).
    The module docstring writes out the algorithm. On a CUDA GPU these are
    cuBLASLt FP8 GEMMs (fast accumulation forward, split accumulation
    backward); on CPU a plain dot of the FP8 values, numerically the same
    products. Traced under ``jax.named_scope("jaxamp_fp8")``.

    Usable on its own (in a layer's ``dot_general`` argument) or through
    ``jaxamp.autocast(f, "mixed_float8")``, which sends every eligible
    matmul here.

    Examples:
        >>> x = jax.random.normal(jax.random.key(0), (32, 64))
        >>> w = jax.random.normal(jax.random.key(1), (64, 16))
        >>> y = jaxamp.fp8_dot_general(x, w, (((1,), (0,)), ((), ())))
        >>> y.dtype
        dtype(bfloat16)

    Args:
        lhs: floating array.
        rhs: floating array.
        dimension_numbers: as for `jax.lax.dot_general`.
        preferred_element_type: dtype of the result (bfloat16 by default).

    Returns:
        The product in `preferred_element_type`; gradients come back in the
        operands' dtypes. Non-finite operands or cotangents give NaN results
        (and gradients), never finite ones.

    Raises:
        TypeError: an operand is not floating, or `dimension_numbers` is malformed.
        ValueError: `dimension_numbers` names dims the operands do not have.
    """
    for name, operand in (("lhs", lhs), ("rhs", rhs)):
        if not jnp.issubdtype(jnp.result_type(operand), jnp.floating):
            raise TypeError(
                f"fp8_dot_general needs floating operands; {name} is {jnp.result_type(operand)}. "
                "Integer matmuls have no FP8 form: use jax.lax.dot_general for them."
            )
    lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
    dimension_numbers = _canonical_dimension_numbers(dimension_numbers, lhs.ndim, rhs.ndim)
    result_dtype = jnp.dtype(preferred_element_type)
    scale_amax, probe = _next_site()
    return _fp8_dot(lhs, rhs, scale_amax, probe, dimension_numbers, result_dtype, _observer)
