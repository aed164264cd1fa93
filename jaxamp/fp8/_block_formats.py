"""Block-scaled formats: MXFP8 and NVFP4, quantized the way NVIDIA TransformerEngine's recipes do.

One job: a matrix in a block-scaled format along its last axis, and back;
with the NVFP4 recipe's three tools (16 x 16 blocks for weights, a random
Hadamard transform, stochastic rounding). `jaxamp.fp8._block_scaled`
builds the matmul from them.

A block-scaled tensor holds narrow values, one scale per block of
consecutive elements along the axis a GEMM contracts, and a float32 tensor
scale; ``x ~ values * block_scale * tensor_scale``::

    MXFP8 (blocks of 32, float8_e4m3fn values, float8_e8m0fnu scales):
        block_scale  = 2 ** ceil(log2(block_amax / 448))   # a power of two:
                                                           # |x / block_scale| <= 448
        values       = (x / block_scale).astype(float8_e4m3fn)
        tensor_scale = 1
    NVFP4 (blocks of 16, float4_e2m1fn values, float8_e4m3fn scales):
        tensor_scale = amax / (448 * 6)                    # amax of the whole tensor
        block_scale  = (block_amax / 6 / tensor_scale).astype(float8_e4m3fn)
        values       = clip(x / (block_scale * tensor_scale), -6, 6)
                       rounded to float4_e2m1fn, to nearest (even) or stochastically

The amax of the whole tensor is the largest block amax, so a tensor is
read twice: once for its block amaxes, once for its values. A tensor of
zeros gives zeros. An inf or NaN never rounds into a finite value that
would hide an overflow from `jaxamp.all_finite`: in NVFP4 it makes the
tensor scale NaN, which every product with the tensor is multiplied by; in
MXFP8 it makes its block's E8M0 scale NaN (the code 0xFF), which the OCP
MX specification reads as NaN for every element of the block.

The NVFP4 recipe's tools:

* 2D blocks (`quantize_2d`): one scale per 16 x 16 tile, so the matrix
  and its transpose hold the same quantized values: the weight's forward
  and backward GEMMs see one weight.
* The random Hadamard transform (`hadamard`): ``x @ H`` in tiles of 16
  along the contracted axis, with ``H = diag(signs) @ H16 / 4`` orthogonal
  and one fixed sign vector shared by every matmul; ``(a H)(b H)^T = a b^T``,
  so applied to both inputs of a GEMM it changes only the rounding, spreading
  a block's outliers over its 16 elements. Written as a product with the
  16 x 16 matrix summed over its 16 terms (one pass that XLA fuses into a
  single kernel), its result in the input's dtype when that is 16 bits
  wide (E2M1 keeps one mantissa bit: rounding the rotated tensor to
  bfloat16 first changes only exact ties).
* Stochastic rounding (`rounding="stochastic"`): each value rounds to one
  of its two neighbours on the E2M1 grid with probability proportional to
  its nearness, so the rounding is unbiased. The uniform draws are a hash
  of each element's index and of a seed taken from the tensor's own bits
  (the sum and the sum of squares of its block amaxes): inside any JAX
  function there is no PRNG key, and a gradient's content changes every
  step.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxamp import _draws


@dataclasses.dataclass(frozen=True)
class BlockFormat:
    """A block-scaled format.

    Attributes:
        name: ``mxfp8`` or ``nvfp4``.
        values_dtype: the narrow values' dtype.
        scale_dtype: the block scales' dtype.
        block_size: elements per block scale, along the contracted axis.
        tensor_scale: whether a float32 scale of the whole tensor sits
            above the block scales (NVFP4).
    """

    name: str
    values_dtype: np.dtype
    scale_dtype: np.dtype
    block_size: int
    tensor_scale: bool

    @property
    def values_max(self) -> float:
        """The largest value of `values_dtype`: 448 (E4M3), 6 (E2M1)."""
        return float(jnp.finfo(self.values_dtype).max)

    @property
    def scale_max(self) -> float:
        """The largest block scale the tensor scale aims at: 448 (E4M3); unused for E8M0."""
        return float(jnp.finfo(self.scale_dtype).max)


MXFP8 = BlockFormat("mxfp8", jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e8m0fnu), 32, False)
"""OCP MXFP8 as TransformerEngine trains with it: E4M3 values forward and backward, an E8M0 scale per 32."""

NVFP4 = BlockFormat("nvfp4", jnp.dtype(jnp.float4_e2m1fn), jnp.dtype(jnp.float8_e4m3fn), 16, True)
"""NVFP4: E2M1 values, an E4M3 scale per 16, a float32 tensor scale."""

BLOCK_FORMATS = {block_format.name: block_format for block_format in (MXFP8, NVFP4)}
"""The block-scaled formats by name."""


class BlockScaled(NamedTuple):
    """A matrix in a block-scaled format, its blocks along the last axis.

    Attributes:
        values: ``[rows, cols]`` narrow values.
        scales: ``[rows, cols / block_size]`` block scales in the format's
            scale dtype.
        tensor_scale: float32 scalar: NVFP4's tensor scale (NaN where the
            tensor held an inf or a NaN); 1 for MXFP8.
    """

    values: jax.Array
    scales: jax.Array
    tensor_scale: jax.Array


ROUNDINGS = ("nearest", "stochastic")

_HADAMARD_SIZE = 16
# One sign vector for every matmul and every step, as TransformerEngine fixes its sign vector once.
_HADAMARD_SIGNS = np.where(np.random.default_rng(51).random(_HADAMARD_SIZE) < 0.5, -1.0, 1.0)


def hadamard_matrix() -> np.ndarray:
    """The random Hadamard transform's 16 x 16 orthogonal matrix, ``diag(signs) @ H16 / 4``."""
    sylvester = np.ones((1, 1))
    while sylvester.shape[0] < _HADAMARD_SIZE:
        sylvester = np.block([[sylvester, sylvester], [sylvester, -sylvester]])
    return (_HADAMARD_SIGNS[:, None] * sylvester / np.sqrt(_HADAMARD_SIZE)).astype(np.float32)


def hadamard(x: jax.Array, *, transposed: bool = False) -> jax.Array:
    """``x @ H`` in tiles of 16 along the last axis (its size must be a multiple of 16).

    Accumulated in float32; the result in `x`'s dtype where that is
    float16 or bfloat16, else float32. With `transposed`, ``x.T @ H`` in
    tiles along `x`'s first axis, the transpose folded into the GEMM.
    """
    dtype = x.dtype if x.dtype in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)) else jnp.dtype(jnp.float32)
    matrix = hadamard_matrix()
    rows, cols = x.shape
    if transposed:  # tiles along the rows: [rows / 16, 16, cols], summed over the middle axis
        tiles = x.astype(jnp.float32).reshape(rows // _HADAMARD_SIZE, _HADAMARD_SIZE, 1, cols)
        rotated = jnp.sum(tiles * matrix[None, :, :, None], axis=1).astype(dtype)
        # The barrier keeps the rotated tensor one kernel's result, in its 16-bit dtype, which the
        # quantization's two passes read (not recomputed in float32 inside each).
        return lax.optimization_barrier(rotated).reshape(rows, cols).T
    tiles = x.astype(jnp.float32).reshape(rows, cols // _HADAMARD_SIZE, _HADAMARD_SIZE, 1)
    rotated = jnp.sum(tiles * matrix, axis=2).astype(dtype)
    return lax.optimization_barrier(rotated).reshape(rows, cols)


def _tensor_scale(block_format: BlockFormat, block_amax: jax.Array) -> jax.Array:
    """NVFP4's ``amax / (448 * 6)`` (1 for a tensor of zeros; NaN for a non-finite one), MXFP8's 1.

    The amax is the block amaxes' (the barrier keeps XLA from reading the
    whole tensor again for it).
    """
    if not block_format.tensor_scale:
        return jnp.ones((), jnp.float32)
    amax = jnp.max(lax.optimization_barrier(block_amax))
    scale = jnp.where(amax > 0, amax / (block_format.scale_max * block_format.values_max), 1.0)
    return jnp.where(jnp.isfinite(amax), scale, jnp.nan).astype(jnp.float32)


def _block_scales(block_format: BlockFormat, block_amax: jax.Array, tensor_scale: jax.Array) -> jax.Array:
    """The block scales (float32, each exactly representable in the scale dtype) of blocks with `block_amax`."""
    if block_format.tensor_scale:
        usable = jnp.where(jnp.isfinite(tensor_scale), tensor_scale, 1.0)
        ratio = block_amax / block_format.values_max / usable
        return ratio.astype(block_format.scale_dtype).astype(jnp.float32)
    # E8M0: the power of two at or above amax / 448 (frexp is exact: a power of two stays itself).
    mantissa, exponent = jnp.frexp(block_amax / block_format.values_max)
    exponent = jnp.where(mantissa == 0.5, exponent - 1, exponent)
    exponent = jnp.where(block_amax > 0, jnp.clip(exponent, -126, 127), 0)
    return jnp.where(jnp.isfinite(block_amax), jnp.ldexp(jnp.float32(1.0), exponent), jnp.nan)


def _round_e2m1_stochastic(scaled: jax.Array, uniform: jax.Array) -> jax.Array:
    """`scaled` (within [-6, 6]) on the E2M1 grid, up or down with probability by nearness.

    The grid's spacing is 0.5 below 2, 1 from 2 to 4, 2 from 4 to 6; each
    value lands on ``floor(|x| / step) * step`` or the next grid point.
    """
    magnitude = jnp.abs(scaled)
    step = jnp.where(magnitude < 2.0, 0.5, jnp.where(magnitude < 4.0, 1.0, 2.0))
    below = jnp.floor(magnitude / step) * step
    rounded = below + jnp.where(uniform < (magnitude - below) / step, step, 0.0)
    return jnp.sign(scaled) * jnp.minimum(rounded, 6.0)


def _content_seed(block_amax: jax.Array) -> jax.Array:
    """Two uint32 words from a tensor's block amaxes: their sum and their sum of squares."""
    words = jnp.stack([jnp.sum(block_amax), jnp.sum(block_amax * block_amax)])
    return lax.bitcast_convert_type(words, jnp.uint32)


def _to_values(block_format: BlockFormat, scaled: jax.Array, rounding: str, stream: int, seed) -> jax.Array:
    """`scaled` (already within the values' range) rounded to the values' dtype."""
    if rounding == "stochastic":
        if block_format.values_dtype != NVFP4.values_dtype:
            raise ValueError(f"stochastic rounding is NVFP4's; {block_format.name} rounds to nearest.")
        uniform = _draws.uniform(seed, stream, scaled.shape)
        scaled = _round_e2m1_stochastic(scaled, uniform)
    return scaled.astype(block_format.values_dtype)


def quantize(
    x: jax.Array, block_format: BlockFormat, *, rounding: str = "nearest", stream: int = 0
) -> BlockScaled:
    """The matrix `x` (``[rows, cols]``) in `block_format`, in blocks along its last axis.

    Args:
        x: a floating matrix whose last axis is a multiple of the block size.
        block_format: `MXFP8` or `NVFP4`.
        rounding: ``nearest`` (even) or ``stochastic`` (NVFP4 only).
        stream: the stochastic draws' stream: two quantizations of one
            tensor in one step draw independently when their streams differ.

    Returns:
        The values, block scales and tensor scale (see the module docstring).
    """
    rows, cols = x.shape
    blocks = x.astype(jnp.float32).reshape(rows, cols // block_format.block_size, block_format.block_size)
    block_amax = jnp.max(jnp.abs(blocks), axis=-1)
    tensor_scale = _tensor_scale(block_format, block_amax)
    scales = _block_scales(block_format, block_amax, tensor_scale)
    divisor = scales[..., None] * jnp.where(jnp.isfinite(tensor_scale), tensor_scale, 1.0)
    scaled = jnp.where(divisor > 0, blocks / jnp.where(divisor > 0, divisor, 1.0), 0.0)
    scaled = jnp.clip(scaled, -block_format.values_max, block_format.values_max).reshape(rows, cols)
    seed = _content_seed(block_amax) if rounding == "stochastic" else None
    values = _to_values(block_format, scaled, rounding, stream, seed)
    return BlockScaled(values, scales.astype(block_format.scale_dtype), tensor_scale)


def quantize_2d(x: jax.Array, block_format: BlockFormat) -> tuple[BlockScaled, BlockScaled]:
    """`x` (``[rows, cols]``) with one scale per square tile of block size, as itself and as its transpose.

    Both hold the same values (the second transposed), each with its tile's
    scale repeated along the axis the other contracts, so a GEMM that
    contracts `x` along its columns and one along its rows read one
    quantized matrix. Rounds to nearest.

    Returns:
        ``(along_cols, along_rows)``: `x` in blocks along its last axis, and
        ``x.T`` in blocks along its last axis.
    """
    rows, cols = x.shape
    size = block_format.block_size
    tiles = x.astype(jnp.float32).reshape(rows // size, size, cols // size, size)
    tile_amax = jnp.max(jnp.abs(tiles), axis=(1, 3))
    tensor_scale = _tensor_scale(block_format, tile_amax)
    tile_scales = _block_scales(block_format, tile_amax, tensor_scale)
    divisor = tile_scales[:, None, :, None] * jnp.where(jnp.isfinite(tensor_scale), tensor_scale, 1.0)
    scaled = jnp.where(divisor > 0, tiles / jnp.where(divisor > 0, divisor, 1.0), 0.0)
    scaled = jnp.clip(scaled, -block_format.values_max, block_format.values_max).reshape(rows, cols)
    values = _to_values(block_format, scaled, "nearest", 0, None)
    scales = tile_scales.astype(block_format.scale_dtype)
    along_cols = BlockScaled(values, jnp.repeat(scales, size, axis=0), tensor_scale)
    along_rows = BlockScaled(values.T, jnp.repeat(scales.T, size, axis=0), tensor_scale)
    return along_cols, along_rows


def dequantize(quantized: BlockScaled, dtype: Any = jnp.float32) -> jax.Array:
    """``values * block_scale * tensor_scale`` in `dtype` (float32 arithmetic)."""
    rows, cols = quantized.values.shape
    block_size = cols // quantized.scales.shape[-1]
    scales = jnp.repeat(quantized.scales.astype(jnp.float32), block_size, axis=-1)
    return (quantized.values.astype(jnp.float32) * scales * quantized.tensor_scale).astype(dtype)
