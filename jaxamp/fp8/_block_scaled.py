"""Block-scaled matrix multiplication: MXFP8 and NVFP4 training GEMMs, forward and backward.

One job: turn a ``dot_general`` without batch dims into the three
block-scaled GEMMs of its training step, the way NVIDIA TransformerEngine's
MXFP8 and NVFP4 recipes run a linear layer on Blackwell GPUs. The formats
and the recipe's tools are `jaxamp.fp8._block_formats`'.

Every GEMM contracts both of its operands along their blocks, so each
tensor is quantized once per GEMM that reads it, along the axis that GEMM
contracts. For ``out[M, N] = x[M, K] @ w[K, N]`` with cotangent ``g[M, N]``::

    forward:  out = gemm(q(x, along K),            q(w, along K))
    dgrad:    dx  = gemm(q(g, along N, SR),        q(w, along N))
    wgrad:    dw  = gemm(q(H(g), along M, SR),     q(H(x), along M))

    gemm(a, b)  = sum over blocks of (a.values * a.scales)(b.values * b.scales)
                  * a.tensor_scale * b.tensor_scale          # float32 accumulation
    SR          = stochastic rounding (NVFP4)
    H           = the random Hadamard transform along M (NVFP4)

With NVFP4 the weight ``w`` is quantized once in 16 x 16 tiles, so its
forward and dgrad copies hold one quantized weight. The forward keeps for
the backward only the copies the backward reads: ``x`` along M and ``w``
along N, in the narrow format (TransformerEngine quantizes both
directions from the high-precision tensor too).

Which operand is the weight: the rhs, as in ``x @ w`` (Flax's ``Dense``,
``DenseGeneral`` and ``Embed.attend`` all put it there).

Where it runs: on CUDA each GEMM is `jax.nn.scaled_matmul`, which JAX
lowers to ``__op$block_scaled_dot`` and XLA (with cuDNN 9.10 or later) to
cuDNN's ``__cudnn$blockScaledDot``. Elsewhere (XLA's CPU has no
block-scaled GEMM) both operands are dequantized and multiplied in
float32: the same products of the same quantized values, at float32 speed.
`lax.platform_dependent` picks the branch when the program is lowered.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxamp.fp8._block_formats import (
    BLOCK_FORMATS,
    NVFP4,
    BlockFormat,
    BlockScaled,
    dequantize,
    hadamard,
    quantize,
    quantize_2d,
)
from jaxamp.fp8._matmul import FP8_SCOPE_NAME
from jaxamp.fp8._recipe import BlockRecipe, current_block_recipe


def _gemm(lhs: BlockScaled, rhs: BlockScaled, block_format: BlockFormat, result_dtype: Any) -> jax.Array:
    """``lhs @ rhs.T`` (``[P, C] x [Q, C] -> [P, Q]``), both in blocks along C, as `result_dtype`.

    The product is asked in bfloat16 for a bfloat16 result and in float32
    otherwise (an unscaled float16 product of E2M1 values and E4M3 scales can
    overflow), then multiplied by both tensor scales where the format has
    them (NVFP4; XLA fuses the multiply into the result's consumer).
    """
    product_dtype = jnp.bfloat16 if jnp.dtype(result_dtype) == jnp.bfloat16 else jnp.float32

    def block_scaled(lhs_values, rhs_values, lhs_scales, rhs_scales):
        product = jax.nn.scaled_matmul(
            lhs_values[None], rhs_values[None], lhs_scales[None], rhs_scales[None], preferred_element_type=product_dtype
        )
        return product[0]

    def emulated(lhs_values, rhs_values, lhs_scales, rhs_scales):
        unit = jnp.ones((), jnp.float32)
        lhs32 = dequantize(BlockScaled(lhs_values, lhs_scales, unit))
        rhs32 = dequantize(BlockScaled(rhs_values, rhs_scales, unit))
        product = lax.dot_general(
            lhs32, rhs32, (((1,), (1,)), ((), ())), precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32
        )
        return product.astype(product_dtype)

    product = lax.platform_dependent(
        lhs.values, rhs.values, lhs.scales, rhs.scales, cuda=block_scaled, default=emulated
    )
    if block_format.tensor_scale:
        product = product * (lhs.tensor_scale * rhs.tensor_scale).astype(product_dtype)
    return product.astype(result_dtype)


def _operand_gradient(
    cotangent: BlockScaled,
    other: BlockScaled,
    block_format: BlockFormat,
    shape: tuple[int, ...],
    contract: tuple[int, ...],
    dtype: Any,
) -> jax.Array:
    """An operand's gradient from its GEMM, ``[free, contracted]`` or ``[contracted, free]``.

    Of the two orders of the GEMM, the one whose result is already in the
    operand's layout is taken where there is one (the weight gradient of
    ``x @ w[K, N]`` comes out ``[K, N]``), so no transpose follows it.

    Args:
        cotangent: the cotangent, in blocks along the axis this GEMM contracts
            (``[free, contracted_by_gemm]``).
        other: the other operand, likewise (``[contracted, contracted_by_gemm]``).
        shape: the operand's shape.
        contract: the operand's contracting dims.
        dtype: the operand's dtype.
    """
    free = tuple(dim for dim in range(len(shape)) if dim not in contract)
    if contract + free == tuple(range(len(shape))):
        return _gemm(other, cotangent, block_format, dtype).reshape(shape)
    return _from_matrix(_gemm(cotangent, other, block_format, dtype), shape, contract)


def _as_matrix(x: jax.Array, contract: tuple[int, ...]) -> jax.Array:
    """`x` as ``[free, contracted]``: its free dims first, then `contract` in that order, each group flattened."""
    free = [dim for dim in range(x.ndim) if dim not in contract]
    rows = int(np.prod([x.shape[dim] for dim in free], dtype=np.int64))
    cols = int(np.prod([x.shape[dim] for dim in contract], dtype=np.int64))
    return lax.transpose(x, (*free, *contract)).reshape(rows, cols)


def _from_matrix(matrix: jax.Array, shape: tuple[int, ...], contract: tuple[int, ...]) -> jax.Array:
    """The inverse of `_as_matrix`: ``[free, contracted]`` back to an operand of `shape`."""
    free = [dim for dim in range(len(shape)) if dim not in contract]
    order = (*free, *contract)
    unflattened = matrix.reshape([shape[dim] for dim in order])
    return lax.transpose(unflattened, tuple(int(axis) for axis in np.argsort(order)))


def _quantize_weight(rhs: jax.Array, block_format: BlockFormat, recipe: BlockRecipe) -> tuple[BlockScaled, BlockScaled]:
    """The weight ``[N, K]`` along K (forward) and along N (dgrad): NVFP4's 16 x 16 tiles, else 1D twice."""
    if block_format == NVFP4 and recipe.two_d_weights:
        return quantize_2d(rhs, block_format)
    return quantize(rhs, block_format), quantize(rhs.T, block_format)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def _block_scaled_dot(lhs, rhs, dimension_numbers, block_format, recipe, result_dtype):
    return _block_scaled_dot_forward(lhs, rhs, dimension_numbers, block_format, recipe, result_dtype)[0]


def _block_scaled_dot_forward(lhs, rhs, dimension_numbers, block_format, recipe, result_dtype):
    (lhs_contract, rhs_contract), _ = dimension_numbers
    # Under the FP8 scope too: one name for "ran narrow" in the compiled reports.
    with jax.named_scope(FP8_SCOPE_NAME):
        x = _as_matrix(lhs, lhs_contract)  # [M, K]
        w = _as_matrix(rhs, rhs_contract)  # [N, K]
        x_along_k = quantize(x, block_format)
        x_t = hadamard(x, transposed=True) if block_format == NVFP4 and recipe.hadamard else x.T
        x_along_m = quantize(x_t, block_format)
        w_along_k, w_along_n = _quantize_weight(w, block_format, recipe)
        out = _gemm(x_along_k, w_along_k, block_format, result_dtype)
    out_shape = [lhs.shape[dim] for dim in range(lhs.ndim) if dim not in lhs_contract]
    out_shape += [rhs.shape[dim] for dim in range(rhs.ndim) if dim not in rhs_contract]
    # Only the backward's quantized copies are kept, with the operands' shapes and dtypes.
    operands = (jax.ShapeDtypeStruct(lhs.shape, lhs.dtype), jax.ShapeDtypeStruct(rhs.shape, rhs.dtype))
    return out.reshape(out_shape), (x_along_m, w_along_n, operands)


def _block_scaled_dot_backward(dimension_numbers, block_format, recipe, result_dtype, residuals, cotangent):
    del result_dtype
    x_along_m, w_along_n, (lhs_struct, rhs_struct) = residuals
    (lhs_contract, rhs_contract), _ = dimension_numbers
    rows = x_along_m.values.shape[1]  # M
    stochastic = block_format == NVFP4 and recipe.stochastic_gradients
    rounding = "stochastic" if stochastic else "nearest"
    with jax.named_scope(FP8_SCOPE_NAME):
        g = cotangent.reshape(rows, -1)  # [M, N]
        g_along_n = quantize(g, block_format, rounding=rounding, stream=0)
        g_t = hadamard(g, transposed=True) if block_format == NVFP4 and recipe.hadamard else g.T
        g_along_m = quantize(g_t, block_format, rounding=rounding, stream=1)
        d_x = _operand_gradient(g_along_n, w_along_n, block_format, lhs_struct.shape, lhs_contract, lhs_struct.dtype)
        d_w = _operand_gradient(g_along_m, x_along_m, block_format, rhs_struct.shape, rhs_contract, rhs_struct.dtype)
    return d_x, d_w


_block_scaled_dot.defvjp(_block_scaled_dot_forward, _block_scaled_dot_backward)


def block_scaled_dot_general(
    lhs: jax.Array,
    rhs: jax.Array,
    dimension_numbers: Any,
    matmul_format: str = "mxfp8",
    preferred_element_type: Any = jnp.bfloat16,
) -> jax.Array:
    """``lax.dot_general`` without batch dims as block-scaled GEMMs, forward and backward.

    The forward and both gradients run as MXFP8 or NVFP4 GEMMs, each operand
    quantized in blocks along the axis its GEMM contracts (the module
    docstring writes out the algorithm; the NVFP4 recipe's options are
    `jaxamp.fp8.block_recipe`'s). On a CUDA GPU these are cuDNN's
    block-scaled GEMMs; on CPU float32 GEMMs of the dequantized values,
    numerically the same products. Traced under
    ``jax.named_scope("jaxamp_fp8")``.

    Usable on its own or through ``jaxamp.autocast(f, "mixed_mxfp8")`` (or
    ``"mixed_nvfp4"``), which sends every eligible matmul here.

    Examples:
        >>> x = jax.random.normal(jax.random.key(0), (32, 64))
        >>> w = jax.random.normal(jax.random.key(1), (64, 32))
        >>> y = jaxamp.fp8.block_scaled_dot_general(x, w, (((1,), (0,)), ((), ())), "nvfp4")
        >>> y.dtype
        dtype(bfloat16)

    Args:
        lhs: floating array (the activations).
        rhs: floating array (the weight).
        dimension_numbers: as for `jax.lax.dot_general`, without batch dims.
        matmul_format: ``mxfp8`` or ``nvfp4``.
        preferred_element_type: dtype of the result (bfloat16 by default).

    Returns:
        The product in `preferred_element_type`; gradients in the operands'
        dtypes. A non-finite operand or cotangent gives NaN results.

    Raises:
        ValueError: an unknown format, batch dims, or a size the format's
            blocks do not divide.
        TypeError: an operand is not floating.
    """
    if matmul_format not in BLOCK_FORMATS:
        raise ValueError(
            f"Unknown block-scaled format {matmul_format!r}; choose one of {', '.join(BLOCK_FORMATS)}."
        )
    block_format = BLOCK_FORMATS[matmul_format]
    for name, operand in (("lhs", lhs), ("rhs", rhs)):
        if not jnp.issubdtype(jnp.result_type(operand), jnp.floating):
            raise TypeError(
                f"block_scaled_dot_general needs floating operands; {name} is {jnp.result_type(operand)}."
            )
    lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = dimension_numbers
    if lhs_batch or rhs_batch:
        raise ValueError(
            f"block_scaled_dot_general takes no batch dims; got {dimension_numbers!r}. Batched matmuls "
            "(attention) stay in the compute dtype under mixed_mxfp8 and mixed_nvfp4."
        )
    lhs_contract, rhs_contract = tuple(int(d) for d in lhs_contract), tuple(int(d) for d in rhs_contract)
    sizes = block_scaled_sizes(lhs.shape, rhs.shape, lhs_contract, rhs_contract)
    if any(size % block_format.block_size for size in sizes):
        raise ValueError(
            f"{matmul_format} needs M, N and K (here {sizes}) to be multiples of its block size, "
            f"{block_format.block_size}: each is contracted by one of the three GEMMs."
        )
    dims = ((lhs_contract, rhs_contract), ((), ()))
    return _block_scaled_dot(lhs, rhs, dims, block_format, current_block_recipe(), jnp.dtype(preferred_element_type))


def block_scaled_sizes(lhs_shape, rhs_shape, lhs_contract, rhs_contract) -> tuple[int, int, int]:
    """``(M, N, K)`` of a dot without batch dims: lhs free, rhs free, contracted."""
    lhs_free = [lhs_shape[dim] for dim in range(len(lhs_shape)) if dim not in lhs_contract]
    rhs_free = [rhs_shape[dim] for dim in range(len(rhs_shape)) if dim not in rhs_contract]
    contracted = [lhs_shape[dim] for dim in lhs_contract]
    return (
        int(np.prod(lhs_free, dtype=np.int64)),
        int(np.prod(rhs_free, dtype=np.int64)),
        int(np.prod(contracted, dtype=np.int64)),
    )
