"""8-bit optimizer state: codes of one byte per element and a float32 scale per block.

One job: store a float32 array (a leaf of an optimizer's state) in 8 bits
and read it back, for `jaxamp.low_precision_optimizer`'s ``state_dtype="int8"``
or ``jnp.float8_e4m3fn``.

The array is flattened and cut into blocks of `block_size` consecutive
elements (8-bit optimizers via block-wise quantization, Dettmers et al.
2021): each block is divided by its own largest magnitude, so an outlier
costs precision in its own block only. The codes keep the array's shape and
layout, and no dimension is moved: a GPU computes each code where it
computes the value, and a split of the first dimension into parts of whole
blocks (as `jaxamp.fsdp.fsdp_shardings` makes) lets each device quantize its
own part. Per block::

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

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxamp import _draws as index_draws

# As bitsandbytes and torchao do: a leaf smaller than this keeps its float32 state (it costs nothing).
MIN_QUANTIZED_SIZE = 4096

_E4M3_MAX = float(jnp.finfo(jnp.float8_e4m3fn).max)  # 448
_E4M3_SMALLEST = float(jnp.finfo(jnp.float8_e4m3fn).smallest_subnormal)  # 2**-9


# The dynamic code's decades: the n-th (n = 0..7) holds its values in (tops[n - 1], tops[n]], spaced
# linearly: 2**n of them in the unsigned code, 2**(n - 1) in the signed one (which has no decade 0).
_DECADE_TOPS = tuple(np.float32(10.0 ** (decade - 7)) for decade in range(8))


def unsigned_code() -> np.ndarray:
    """The unsigned dynamic code's 256 values, ascending: 0, then ``tops[n] * (0.1 + 0.9 k / 2**n)`` for
    index ``2**n + k - 1`` (n = 0..7, k = 1..2**n), in float32 arithmetic.

    The signed code's magnitudes are 0 and its odd entries from 3 on.
    """
    values = [np.float32(0.0)]
    for index in range(1, 256):
        decade = index.bit_length() - 1
        step = np.float32(index - 2**decade + 1)
        fraction = np.float32(0.1) + (np.float32(0.9) * step) * np.float32(2.0**-decade)
        values.append(_DECADE_TOPS[decade] * fraction)
    return np.asarray(values, np.float32)


def _decade_bits(magnitude: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The decade of each magnitude, the count of ``tops[0..6]`` below it (0 to 7, 0 for NaN), as its
    three bits from the highest: a binary search of three comparisons, not seven."""
    tops = _DECADE_TOPS
    high = magnitude > tops[3]
    middle = magnitude > jnp.where(high, tops[5], tops[1])
    low = magnitude > jnp.where(
        high, jnp.where(middle, tops[6], tops[4]), jnp.where(middle, tops[2], tops[0])
    )
    return high, middle, low


def _pick(bits: tuple[jax.Array, jax.Array, jax.Array], constants) -> jax.Array:
    """``constants[n]`` (8 of them) for the index ``n`` whose bits, highest first, are `bits`: a tree of
    seven selects, which XLA's GPU fuses into the computation around it (XLA's CPU runs it several times
    faster than a gather)."""
    high, middle, low = bits
    pairs = [jnp.where(low, np.float32(constants[2 * k + 1]), np.float32(constants[2 * k])) for k in range(4)]
    return jnp.where(high, jnp.where(middle, pairs[3], pairs[2]), jnp.where(middle, pairs[1], pairs[0]))


def _bits_of(index: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The three low bits of int32 `index`, highest first, as bools."""
    return tuple((index & bit) != 0 for bit in (4, 2, 1))


@struct.dataclass
class QuantizedArray:
    """A float32 array stored as 8-bit codes of its shape and a float32 scale per block.

    A `flax.struct` dataclass: a pytree of its codes and scales, which
    `flax.serialization` (``to_bytes``, ``to_state_dict``) and orbax save and
    restore as two arrays, and whose format is static.

    Attributes:
        codes: int8 or float8_e4m3fn codes, shaped like the array.
        scales: ``(num_blocks,)`` float32: each block's largest magnitude,
            negative for a block with a negative element (the signed code).
        format: ``"int8"`` or ``"float8_e4m3fn"`` (static).
    """

    codes: jax.Array
    scales: jax.Array
    format: str = struct.field(pytree_node=False)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.codes.shape)

    @property
    def block_size(self) -> int:
        return math.prod(self.codes.shape) // self.scales.shape[0]


def quantized_shapes(shape: tuple[int, ...], block_size: int | None) -> tuple[int, int]:
    """``(num_blocks, block_size)`` for an array of `shape`: blocks of `block_size`, or one block when None."""
    size = math.prod(shape)
    block = size if block_size is None else block_size
    return size // block, block


def splits_by_rows(shape: tuple[int, ...], num_blocks: int, parts: int) -> tuple[bool, bool]:
    """Whether an 8-bit leaf of `shape` in `num_blocks` blocks splits along its first dimension into
    `parts` equal parts without a block straddling two: ``(codes split, scales split)``.

    Blocks are runs of the flattened leaf, so a part of its rows holds whole blocks when the rows and
    the blocks both divide into `parts`; then each part holds its blocks' codes and scales. A leaf of
    one block (a scale per leaf) splits its codes by rows whenever the rows divide, its one scale on
    every part. Otherwise neither splits.
    """
    rows_divide = bool(shape) and shape[0] % parts == 0
    if num_blocks == 1:
        return rows_divide, False
    whole_blocks = rows_divide and num_blocks % parts == 0
    return whole_blocks, whole_blocks


def _per_element(per_block: jax.Array, like: jax.Array) -> jax.Array:
    """A value per block, repeated over the block's elements, in the shape (and, under a mesh of explicit
    axes, the layout) of `like`."""
    num_blocks = per_block.shape[0]
    repeated = jnp.broadcast_to(per_block[:, None], (num_blocks, like.size // num_blocks))
    repeated = repeated.reshape(-1).reshape(like.shape)  # through one dimension: see `_blocks`
    sharding = explicit_sharding(like)
    if sharding is None or explicit_sharding(repeated).spec == sharding.spec:
        return repeated
    return jax.sharding.reshard(repeated, sharding)  # one block: its scale, on every device


def explicit_sharding(array: jax.Array):
    """`array`'s sharding in its type when it lies on a mesh of explicit axes (`jax.sharding.AxisType`),
    else None."""
    sharding = jax.typeof(array).sharding
    explicit = jax.sharding.AxisType.Explicit
    return sharding if any(axis_type == explicit for axis_type in sharding.mesh.axis_types) else None


def _whole_blocks(values: jax.Array, block_size: int | None) -> jax.Array:
    """`values` laid out so that each shard holds whole blocks: under a mesh of explicit axes, its mesh
    axes moved to its first dimension (a no-op where they are there already; else one all-to-all);
    elsewhere as it is (XLA places the blocks itself).

    Raises:
        ValueError: under a mesh of explicit axes, the first dimension does not split among the
            devices into parts of whole blocks (`splits_by_rows`).
    """
    sharding = explicit_sharding(values)
    if sharding is None:
        return values
    axes = tuple(
        axis
        for entry in sharding.spec
        if entry is not None
        for axis in (entry if isinstance(entry, tuple) else (entry,))
    )
    spec = jax.sharding.PartitionSpec(
        None if not axes else axes[0] if len(axes) == 1 else axes, *([None] * (values.ndim - 1))
    )
    devices = math.prod(sharding.mesh.shape[axis] for axis in axes)
    num_blocks, block = quantized_shapes(values.shape, block_size)
    if not splits_by_rows(values.shape, num_blocks, devices)[0]:
        raise ValueError(
            "8-bit optimizer state on a mesh of explicit axes is laid out by whole blocks: the mesh axes "
            f"{axes} on the array's first dimension, each device's rows holding whole blocks of "
            f"{block} elements of the flattened array. The array "
            f"{jax.typeof(values).str_short()} (first dimension {values.shape[0]}, {devices} devices) does "
            "not split so: keep this leaf's state in bfloat16 (a per-leaf state_dtype), or choose a "
            "block size that divides each device's rows."
        )
    if tuple(sharding.spec) + (None,) * (values.ndim - len(sharding.spec)) != tuple(spec):
        values = jax.sharding.reshard(values, jax.sharding.NamedSharding(sharding.mesh, spec))
    return values


def _blocks(values: jax.Array, block_size: int | None) -> jax.Array:
    """`values` as ``(num_blocks, block_size)``, through one dimension: under a mesh of explicit axes,
    JAX shards each step (merging the dimensions, then splitting the blocks off) where the array's
    shards are whole blocks (`_whole_blocks`), and refuses a reshape done in one."""
    return values.reshape(-1).reshape(quantized_shapes(values.shape, block_size))


def block_scales(values: jax.Array, block_size: int | None) -> tuple[jax.Array, jax.Array]:
    """Each block's largest magnitude and whether it has a negative element: what `quantize` scales it by.

    Returns:
        ``(absmax, signed)``, each of shape ``(num_blocks,)``: float32 and bool.
    """
    blocks = _blocks(_whole_blocks(jnp.asarray(values, jnp.float32), block_size), block_size)
    return jnp.max(jnp.abs(blocks), axis=1), jnp.any(blocks < 0, axis=1)


def quantize(
    values: jax.Array,
    format: str,
    block_size: int | None,
    key: jax.Array | None,
    *,
    scales: tuple[jax.Array, jax.Array] | None = None,
    draws: jax.Array | None = None,
) -> QuantizedArray:
    """`values` (float32) as a `QuantizedArray` of `format`, in blocks of `block_size` (None: one block).

    Args:
        values: the array; its size must be a multiple of `block_size`.
        format: ``"int8"`` or ``"float8_e4m3fn"``.
        block_size: elements per block, or None for one scale for the whole array.
        key: a PRNG key for stochastic rounding (unbiased: the expected
            decoded value is `values`), or None to round to the nearest code.
        scales: `block_scales` of `values`, computed apart (from `values`
            when None). A GPU program then computes the values twice, once
            for the blocks' largest magnitudes and once for the codes,
            instead of writing them in float32 and reading them back.
        draws: uniform draws in [0, 1) of `values`' shape for stochastic
            rounding, in place of a `key`'s (`jaxamp._draws`).

    Returns:
        The codes and scales.
    """
    values = _whole_blocks(jnp.asarray(values, jnp.float32), block_size)
    absmax, signed = block_scales(values, block_size) if scales is None else scales
    # Codes are computed in the array's shape, each element beside its block's scale: XLA's GPU then
    # fuses the quantization into the computation of the values.
    ratios = values / _per_element(jnp.where(absmax > 0, absmax, 1.0), values)
    uniform = draws
    if uniform is None and key is not None:
        uniform = index_draws.uniform(index_draws.seed_of(key), 0, values.shape)
    encode = _encode_int8 if format == "int8" else _encode_e4m3
    codes = encode(ratios, _per_element(signed, values), uniform)
    return QuantizedArray(codes, jnp.where(signed, -absmax, absmax), format)


def dequantize(quantized: QuantizedArray, *, by_lookup: bool = False) -> jax.Array:
    """The float32 array `quantized` stands for.

    Args:
        quantized: the codes and scales.
        by_lookup: decode int8 codes by a lookup in the code's table (a
            gather) instead of computing each value: the same values, bit for
            bit. XLA's GPU fuses a lookup into a reduction over the values
            (the block scales' pass), and the computed values into the kernel
            that rewrites the codes in place, but not the other way round (a
            lookup in a kernel that writes its own codes makes XLA copy them
            first, and the computed values fused into a reduction are written
            out in float32 instead).
    """
    signed = _per_element(quantized.scales < 0, quantized.codes)
    if quantized.format == "int8":
        values = (_decode_int8_by_lookup if by_lookup else _decode_int8)(quantized.codes, signed)
    else:
        values = _decode_e4m3(quantized.codes, signed)
    return values * _per_element(jnp.abs(quantized.scales), quantized.codes)


def _round_between(low, high, position, uniform):
    """`high` where `position` (in [0, 1] from `low` to `high`) rounds up, else `low`: nearest or at random."""
    up = position >= 0.5 if uniform is None else uniform < position
    return jnp.where(up, high, low)


def _encode_int8(ratios, signed, uniform):
    """int8 codes: ``sign * c`` in a signed block (c in 0..127), ``c - 128`` in the others (c in 0..255).

    The value's decade ``n`` comes from comparisons with the decades' tops,
    its position in the decade from one multiplication, so that the two codes
    around it and the chance of the upper one take no division or lookup::

        n     = count of tops[0..6] below |r|, at least 1 in a signed block
        f     = n, or n - 1 in a signed block          # fraction bits of the decade
        step  = 0.9 * tops[n] / 2**f                   # tops[n] in the lowest decade (0 .. tops[n])
        base  = 0.1 * tops[n]                          # 0 in the lowest decade
        k     = floor((|r| - base) / step)             # the code below: c = 2**f + k - 1
        c     = c + 1 with probability (|r| - base - k step) / step  (or where that is at least 1/2)
    """
    magnitude = jnp.abs(ratios)
    decade_bits = _decade_bits(magnitude)
    high, middle, low = decade_bits
    decade = 4 * high.astype(jnp.int32) + 2 * middle.astype(jnp.int32) + low.astype(jnp.int32)
    # A signed block has no decade 0: its lowest decade is 1 (0 .. tops[1], in steps of 2**0).
    in_decade_zero = signed & (decade == 0)
    decade = jnp.where(in_decade_zero, 1, decade)
    fraction_bits = decade - signed.astype(jnp.int32)
    steps = jax.lax.shift_left(1, fraction_bits).astype(jnp.float32)
    reciprocals = [np.float32(1.0 / top) for top in _DECADE_TOPS]
    # in (0.1, 1]
    scaled = magnitude * jnp.where(in_decade_zero, reciprocals[1], _pick(decade_bits, reciprocals))
    position = jnp.where(fraction_bits == 0, scaled, (scaled - np.float32(0.1)) * (steps / np.float32(0.9)))
    below = jnp.clip(jnp.floor(position), 0.0, steps)
    code = (steps - 1 + below).astype(jnp.int32)
    code = _round_between(code, code + 1, jnp.clip(position - below, 0.0, 1.0), uniform)
    code = jnp.minimum(code, jnp.where(signed, 127, 255))
    # A non-negative block's positive element never rounds to zero (the second moment's zero point).
    code = jnp.where(~signed & (magnitude > 0), jnp.maximum(code, 1), code)
    return jnp.where(signed, jnp.where(ratios < 0, -code, code), code - 128).astype(jnp.int8)


def _unsigned_index(codes, signed):
    """Each int8 code's index in the unsigned code: ``c + 128`` in a block of the unsigned code, and for a
    signed code ``j`` the index of its magnitude, ``2|j| + 1`` (0 for 0)."""
    codes = codes.astype(jnp.int32)
    magnitude = jnp.minimum(jnp.abs(codes), 127)
    return jnp.where(signed, jnp.where(magnitude > 0, 2 * magnitude + 1, 0), codes + 128)


def _decode_int8_by_lookup(codes, signed):
    """The values of int8 codes, looked up in `unsigned_code`'s table."""
    index = _unsigned_index(codes, signed)
    # Under a mesh of explicit axes JAX asks a gather for its output's sharding: the index's.
    value = jnp.asarray(unsigned_code()).at[index].get(out_sharding=explicit_sharding(index))
    return jnp.where(signed & (codes < 0), -value, value)


def _decode_int8(codes, signed):
    """The values of int8 codes, each computed as `unsigned_code` computes its entry, in the same float32
    operations (bit for bit its table; the power of two of the decade from its bits)."""
    index = _unsigned_index(codes, signed)
    # floor(log2(index)) for index 1..255: the exponent of its float32 value (exact); 0 for index 0.
    exponent_bits = jax.lax.bitcast_convert_type(index.astype(jnp.float32), jnp.int32)
    decade = jnp.maximum(jax.lax.shift_right_logical(exponent_bits, 23) - 127, 0)
    step = (index + 1 - jax.lax.shift_left(1, decade)).astype(jnp.float32)
    two_to_minus_decade = jax.lax.bitcast_convert_type(jax.lax.shift_left(127 - decade, 23), jnp.float32)
    fraction = np.float32(0.1) + (np.float32(0.9) * step) * two_to_minus_decade
    value = jnp.where(index > 0, _pick(_bits_of(decade), _DECADE_TOPS) * fraction, np.float32(0.0))
    return jnp.where(signed & (codes < 0), -value, value)


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
