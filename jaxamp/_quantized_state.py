"""8-bit optimizer state: codes of one byte per element and a float32 scale per block.

One job: store a float32 array (a leaf of an optimizer's state) in 8 bits
and read it back, for `jaxamp.low_precision_optimizer`'s ``state_dtype="int8"``
or ``jnp.float8_e4m3fn``.

The array, its largest dimension moved first, is flattened and cut into
blocks of `block_size` consecutive elements (8-bit optimizers via block-wise
quantization, Dettmers et al. 2021): each block is divided by its own
largest magnitude, so an outlier costs precision in its own block only.
Moving the largest dimension first makes a split of that dimension, the one
`jaxamp.fsdp.fsdp_shardings` splits a leaf along, a split into whole blocks:
each device quantizes its own part. Per block::

    absmax = max(|block|)
    r      = block / absmax                     # in [-1, 1]
    codes  = round(r) in the format's code      # stochastically: unbiased
    scale  = -absmax if any(block < 0) else +absmax
    block  = decode(codes) * |scale|            # when read back

The sign of the scale says which code the block uses. An optimizer's second
moment (Adam's ``nu``) is never negative, and its range is wide: a squared
gradient a thousand times smaller than its block's largest is a millionth of
it, and rounded to zero it would make Adam's step ``m / (sqrt(v) + eps)``
explode. The anchors give such a state a code of its own (bitsandbytes'
and torchao's unsigned dynamic code; torchao's 4-bit second moment has no
zero in its code). Here any block with no negative element, which is every
block of a second moment, whatever the optimizer calls it, gets:

* ``int8``: the unsigned dynamic code: the sign bit becomes one more bit of
  fraction in each decade and one more decade (256 values from 1e-7 to 1,
  and 0), where a block with negatives uses the signed code (0 and +-127
  values from 1e-6 to 1: every other value of the unsigned code);
* ``float8_e4m3fn``: the square root of ``r``, scaled to 448: half the
  range in decades (a fixed case of COAT's dynamic range expansion,
  Xi et al. 2024, ``sign(x) |x|**k``), so that e4m3's 2**-9 .. 448 holds
  ratios down to 2e-11 instead of 4e-6;

and a positive element of such a block never rounds to zero, only down to
the code's smallest positive value (1e-7 of the block's largest, or 2e-11
under e4m3).

The dynamic code (Dettmers 2016) spends a decade per leading zero: in the
unsigned code an index ``i`` in 1..255 with ``n = floor(log2(i))`` stands for
``10**-(7 - n) * (0.1 + 0.9 * (i - 2**n + 1) / 2**n)``: 128 values spaced
linearly in (0.1, 1], 64 in (0.01, 0.1], ..., and 1e-7 alone.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

# As bitsandbytes and torchao do: a leaf smaller than this keeps its float32 state (it costs nothing).
MIN_QUANTIZED_SIZE = 4096

_E4M3_MAX = float(jnp.finfo(jnp.float8_e4m3fn).max)  # 448
_E4M3_SMALLEST = float(jnp.finfo(jnp.float8_e4m3fn).smallest_subnormal)  # 2**-9


# The unsigned dynamic code's decades: the n-th (n = 0..7) holds its 2**n values in (tops[n - 1], tops[n]].
_DECADE_TOPS = tuple(np.float32(10.0 ** (decade - 7)) for decade in range(8))


def _decade_top(decade: jax.Array) -> jax.Array:
    """``10**(decade - 7)`` in float32, exactly the constant, for int32 `decade` in 0..7."""
    top = jnp.full(decade.shape, _DECADE_TOPS[0])
    for index in range(1, 8):
        top = jnp.where(decade == index, _DECADE_TOPS[index], top)
    return top


def _code_value(index: jax.Array) -> jax.Array:
    """The unsigned code's value of int32 `index` in 0..255: 0, or ``tops[n] * (0.1 + 0.9 k / 2**n)``
    with ``n = floor(log2(index))`` and ``k = index - 2**n + 1`` (computed, not looked up: XLA's CPU
    gathers from a table several times slower)."""
    decade = 31 - jax.lax.clz(jnp.maximum(index, 1))
    step = (index - (1 << decade) + 1).astype(jnp.float32)
    fraction = np.float32(0.1) + (np.float32(0.9) * step) * jnp.ldexp(np.float32(1.0), -decade)
    return jnp.where(index > 0, _decade_top(decade) * fraction, 0.0)


def _code_below(magnitude: jax.Array) -> jax.Array:
    """The unsigned code's last index whose value is at most `magnitude` (in [0, 1])."""
    decade = sum((magnitude > top).astype(jnp.int32) for top in _DECADE_TOPS[:7])
    position = (magnitude / _decade_top(decade) - np.float32(0.1)) * (
        jnp.ldexp(np.float32(1.0), decade) / np.float32(0.9)
    )
    below = jnp.clip((1 << decade) - 1 + jnp.maximum(jnp.floor(position).astype(jnp.int32), 0), 0, 255)
    # The float32 position can be one off at a value of the code: compare with the values themselves.
    below = jnp.where(_code_value(below) > magnitude, below - 1, below)
    above = jnp.minimum(below + 1, 255)
    return jnp.where((below < 255) & (_code_value(above) <= magnitude), above, below)


def unsigned_code() -> np.ndarray:
    """The unsigned dynamic code's 256 values, ascending: 0, then ``10**-(7-n) * (0.1 + 0.9 k / 2**n)``.

    The signed code's magnitudes are 0 and its odd entries from 3 on.
    """
    return np.asarray(_code_value(jnp.arange(256, dtype=jnp.int32)))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedArray:
    """A float32 array stored as 8-bit codes and a float32 scale per block.

    Attributes:
        codes: ``(num_blocks, block_size)`` codes, int8 or float8_e4m3fn.
        scales: ``(num_blocks,)`` float32: each block's largest magnitude,
            negative for a block with a negative element (the signed code).
        format: ``"int8"`` or ``"float8_e4m3fn"`` (static).
        shape: the array's shape (static).
    """

    codes: jax.Array
    scales: jax.Array
    format: str = dataclasses.field(metadata={"static": True})
    shape: tuple[int, ...] = dataclasses.field(metadata={"static": True})

    @property
    def block_size(self) -> int:
        return self.codes.shape[-1]


def quantized_shapes(shape: tuple[int, ...], block_size: int | None) -> tuple[int, int]:
    """``(num_blocks, block_size)`` for an array of `shape`: blocks of `block_size`, or one block when None."""
    size = math.prod(shape)
    block = size if block_size is None else block_size
    return size // block, block


def _leading_dimension(shape: tuple[int, ...]) -> int:
    """The dimension the blocks are laid out along first: the largest (the first of equals), as FSDP splits."""
    return max(range(len(shape)), key=lambda dimension: (shape[dimension], -dimension), default=0)


def _to_blocks(values: jax.Array, block_size: int | None) -> jax.Array:
    """`values` with its leading dimension first, as ``(num_blocks, block_size)``."""
    moved = jnp.moveaxis(values, _leading_dimension(values.shape), 0) if values.ndim else values
    return moved.reshape(quantized_shapes(values.shape, block_size))


def _from_blocks(blocks: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    if not shape:
        return blocks.reshape(shape)
    leading = _leading_dimension(shape)
    moved = (shape[leading], *shape[:leading], *shape[leading + 1 :])
    return jnp.moveaxis(blocks.reshape(moved), 0, leading)


def quantize(values: jax.Array, format: str, block_size: int | None, key: jax.Array | None) -> QuantizedArray:
    """`values` (float32) as a `QuantizedArray` of `format`, in blocks of `block_size` (None: one block).

    Args:
        values: the array; its size must be a multiple of `block_size`.
        format: one of `STATE_FORMATS`.
        block_size: elements per block, or None for one scale for the whole array.
        key: a PRNG key for stochastic rounding (unbiased: the expected
            decoded value is `values`), or None to round to the nearest code.

    Returns:
        The codes and scales.
    """
    blocks = _to_blocks(jnp.asarray(values, jnp.float32), block_size)
    absmax = jnp.max(jnp.abs(blocks), axis=1)
    signed = jnp.any(blocks < 0, axis=1)
    ratios = blocks / jnp.where(absmax > 0, absmax, 1.0)[:, None]
    uniform = None if key is None else jax.random.uniform(key, blocks.shape, jnp.float32)
    encode = _encode_int8 if format == "int8" else _encode_e4m3
    codes = encode(ratios, signed[:, None], uniform)
    return QuantizedArray(codes, jnp.where(signed, -absmax, absmax), format, tuple(values.shape))


def dequantize(quantized: QuantizedArray) -> jax.Array:
    """The float32 array `quantized` stands for."""
    signed = (quantized.scales < 0)[:, None]
    decode = _decode_int8 if quantized.format == "int8" else _decode_e4m3
    ratios = decode(quantized.codes, signed)
    return _from_blocks(ratios * jnp.abs(quantized.scales)[:, None], quantized.shape)


def _round_between(low, high, position, uniform):
    """`high` where `position` (in [0, 1] from `low` to `high`) rounds up, else `low`: nearest or at random."""
    up = position >= 0.5 if uniform is None else uniform < position
    return jnp.where(up, high, low)


def _encode_int8(ratios, signed, uniform):
    """int8 codes: in a signed block ``sign * j`` (magnitude ``unsigned_code()[2j + 1]``, or 0 for j = 0),
    else ``i - 128`` for the unsigned code's entry i."""
    magnitude = jnp.abs(ratios)
    below = _code_below(magnitude)
    # A signed block rounds between the odd entries from 3 on (1e-6 to 1) and 0: j stands for entry 2j + 1.
    signed_below = jnp.maximum((below - 1) // 2, 0)
    low = jnp.where(signed, jnp.where(signed_below > 0, 2 * signed_below + 1, 0), below)
    high = jnp.minimum(jnp.where(signed, 2 * signed_below + 3, below + 1), 255)
    low_value, high_value = _code_value(low), _code_value(high)
    gap = high_value - low_value
    position = jnp.where(gap > 0, (magnitude - low_value) / jnp.where(gap > 0, gap, 1.0), 0.0)
    index = _round_between(low, high, position, uniform)
    # A non-negative block's positive element never rounds to zero (the second moment's zero point).
    index = jnp.where(~signed & (magnitude > 0), jnp.maximum(index, 1), index)
    signed_code = jnp.where(ratios < 0, -1, 1) * (index // 2)
    return jnp.where(signed, signed_code, index - 128).astype(jnp.int8)


def _decode_int8(codes, signed):
    codes = codes.astype(jnp.int32)
    magnitude = jnp.minimum(jnp.abs(codes), 127)
    signed_value = jnp.sign(codes) * _code_value(jnp.where(magnitude > 0, 2 * magnitude + 1, 0))
    return jnp.where(signed, signed_value, _code_value(codes + 128))


def _encode_e4m3(ratios, signed, uniform):
    """float8_e4m3fn codes of ``r * 448``, or of ``sqrt(r) * 448`` in a block with no negative element.

    The two codes around the value are e4m3's neighbours of the scaled value;
    the chance of the upper one is the value's position between the two
    *decoded* values, so that the square root does not bias the decoded mean.
    """
    scaled = jnp.where(signed, ratios, jnp.sqrt(jnp.abs(ratios))) * _E4M3_MAX
    nearest = scaled.astype(jnp.float8_e4m3fn)
    # e4m3fn has no infinity: step toward the largest finite value on the value's side.
    toward = jnp.where(nearest.astype(jnp.float32) < scaled, _E4M3_MAX, -_E4M3_MAX).astype(jnp.float8_e4m3fn)
    other = jnp.nextafter(nearest, toward)
    if uniform is None:
        codes = nearest
    else:
        nearest_value, other_value = _decode_e4m3(nearest, signed), _decode_e4m3(other, signed)
        gap = other_value - nearest_value
        position = jnp.where(gap != 0, (ratios - nearest_value) / jnp.where(gap != 0, gap, 1.0), 0.0)
        codes = _round_between(nearest, other, position, uniform)
    smallest = jnp.asarray(_E4M3_SMALLEST, jnp.float8_e4m3fn)
    return jnp.where(~signed & (scaled > 0) & (codes.astype(jnp.float32) == 0), smallest, codes)


def _decode_e4m3(codes, signed):
    ratios = codes.astype(jnp.float32) / _E4M3_MAX
    return jnp.where(signed, ratios, ratios * ratios)
