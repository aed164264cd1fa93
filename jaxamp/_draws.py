"""The uniform draws of stochastic rounding: a hash of each element's index, seeded by a PRNG key.

One job: uniform random numbers, one per element (32 bits, or a float32 in
[0, 1)), for
`jaxamp.low_precision_optimizer`'s stochastic rounding of params, state and
8-bit codes, and for NVFP4's stochastic rounding of gradients
(`jaxamp.fp8`). Each element's draw is a hash of its index in its array and
of one word for its stream (the leaf's place in the tree), made from a seed
of two words drawn once per step from the PRNG key::

    seed   = jax.random.bits(key, (2,), uint32)                # once per step
    word   = (seed[0] + stream * 0x9E3779B9) ^ seed[1]         # once per stream
    x      = flat index of the element                        # uint32
    draw   = mix(x ^ word), or (draw >> 8) * 2**-24 as a float32 in [0, 1)

where ``mix`` is a bijective integer hash (Wellons' lowbias32: two
multiplications and three xor-shifts). Each draw is exactly uniform: for a
given element, ``x ^ word`` is uniform over the step's random word, and a
bijection keeps it so; the steps' words are independent, so are an
element's draws from step to step. A rounding dither needs no more than
that and a hash whose outputs for neighbouring indices look unrelated, not
a cryptographic generator: ``jax.random.uniform`` runs threefry's twenty
rounds per element, and an optimizer with a few dozen leaves compiled one
of those per leaf, most of the wrapper's compile time. One ``mix``, not
two: every operation of the hash is repeated in each leaf's kernel (three
times with bfloat16 params and state), and XLA's fusion pass takes time in
proportion to them (with a second round, the small language model's train
step with bfloat16 state took 1.12 to 1.25 times as long to lower and
compile for an H200, in two comparisons). The index is the element's
place in the whole array (``iota`` is global under SPMD), so an array split
across devices draws what it draws on one. `streams` gives each stream's
word as a value of its own, so that the arrays of one shape that draw from
different streams compile to one kernel.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

_GOLDEN = 0x9E3779B9  # 2**32 / the golden ratio: streams spread over the words


def seed_of(key: jax.Array) -> jax.Array:
    """Two uint32 words from a PRNG key (typed, or the raw data of a default-implementation key)."""
    return jax.random.bits(key, (2,), jnp.uint32)


def _mix(x: jax.Array) -> jax.Array:
    """Wellons' lowbias32: a bijection of uint32 whose every output bit depends on every input bit."""
    x = x ^ (x >> 16)
    x = x * np.uint32(0x7FEB352D)
    x = x ^ (x >> 15)
    x = x * np.uint32(0x846CA68B)
    return x ^ (x >> 16)


def _flat_index(shape: tuple[int, ...]) -> jax.Array:
    """Each element's index in the flattened array, as uint32, in `shape`.

    One iota, reshaped, which XLA fuses into each kernel that reads it. Built
    from an iota per dimension times its stride, the small arrays of the
    strides were computed once and shared by every leaf of a shape, and XLA's
    GPU merged the kernels that shared them (sibling multi-output fusion)
    into one that read the new state in float32: with one round of the hash,
    GPT-2's int8 update moved 31.37 bytes per parameter for an H200, 16.33
    from one iota.
    """
    return jax.lax.iota(jnp.uint32, math.prod(shape)).reshape(shape)


def bits(seed: jax.Array, stream: int, shape: tuple[int, ...]) -> jax.Array:
    """Uniform uint32 draws of `shape`, from `seed` (two uint32 words) and a `stream` number.

    Raises:
        ValueError: the array has more than 2**32 elements (its indices would repeat).
    """
    return stream_bits((seed[0] + np.uint32(stream * _GOLDEN % 2**32)) ^ seed[1], shape)


_STREAMS_PER_REDUCTION = 64


def streams(seed: jax.Array, count: int) -> list[jax.Array]:
    """The words of streams ``0 .. count - 1`` of `seed`, for `stream_bits`: ``stream_bits(streams(seed,
    n)[k], shape)`` draws what ``bits(seed, k, shape)`` draws.

    Each stream's word, ``(seed[0] + k * 0x9E3779B9) ^ seed[1]``, comes out of one
    reduction with an output per stream rather than from an addition of its
    own. An addition of the constant would be fused into the kernel of the
    array that draws from it, and every array would then compile to a kernel
    of its own; a word computed apart is an argument of the kernel, and the
    arrays of one shape (the layers of a model) share one kernel. With a few
    dozen arrays, that is most of the compile time of an optimizer that
    rounds stochastically. The streams go in groups of `_STREAMS_PER_REDUCTION`,
    one reduction each, so that the reductions' size grows with `count`, not
    with its square.
    """
    words = []
    for first in range(0, count, _STREAMS_PER_REDUCTION):
        group = min(_STREAMS_PER_REDUCTION, count - first)
        offsets = (seed[0] + (first + jnp.arange(group, dtype=jnp.uint32)) * np.uint32(_GOLDEN)) ^ seed[1]
        position = jnp.arange(group, dtype=jnp.uint32)
        # Each operand keeps one stream's word and zeroes the rest: the bitwise or of its elements is that word.
        words += jax.lax.reduce(
            tuple(jnp.where(position == index, offsets, np.uint32(0)) for index in range(group)),
            (np.uint32(0),) * group,
            lambda left, right: tuple(a | b for a, b in zip(left, right, strict=True)),
            (0,),
        )
    return list(words)


def stream_bits(word: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """Uniform uint32 draws of `shape` from one stream's word (a uint32 scalar, from `streams`).

    Raises:
        ValueError: the array has more than 2**32 elements (its indices would repeat).
    """
    if math.prod(shape) > 2**32:
        raise ValueError(
            f"stochastic rounding draws for at most 2**32 elements per array; got shape {shape}."
        )
    return _mix(_flat_index(tuple(shape)) ^ word)


def uniform_of(draws: jax.Array) -> jax.Array:
    """uint32 draws as float32 in [0, 1), from their top 24 bits (float32's precision: every value exact)."""
    return (draws >> 8).astype(jnp.float32) * np.float32(2.0**-24)


def uniform(seed: jax.Array, stream: int, shape: tuple[int, ...]) -> jax.Array:
    """Uniform float32 draws in [0, 1) of `shape`: `uniform_of` `bits`."""
    return uniform_of(bits(seed, stream, shape))
