"""The uniform draws of stochastic rounding: a hash of each element's index, seeded by a PRNG key.

One job: uniform random numbers, one per element (32 bits, or a float32 in
[0, 1)), for
`jaxamp.low_precision_optimizer`'s stochastic rounding of params, state and
8-bit codes, and for NVFP4's stochastic rounding of gradients
(`jaxamp.fp8`). Each element's draw is a hash of its index in its array, a
stream number (the leaf's place in the tree) and a seed of two words drawn
once per step from the PRNG key::

    seed   = jax.random.bits(key, (2,), uint32)            # once per step
    x      = flat index of the element                    # uint32
    x      = mix(x ^ (seed[0] + stream * 0x9E3779B9))
    x      = mix(x ^ seed[1])
    draw   = x, or (x >> 8) * 2**-24 as a float32 in [0, 1)

where ``mix`` is a bijective integer hash (Wellons' lowbias32: two
multiplications and three xor-shifts). A rounding dither needs draws that
are uniform and independent of the values they round, not a cryptographic
generator: ``jax.random.uniform`` runs threefry's twenty rounds per
element, and an optimizer with a few dozen leaves compiled one of those per
leaf, most of the wrapper's compile time. The index is the element's place
in the whole array (``iota`` is global under SPMD), so an array split
across devices draws what it draws on one.
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
    """Each element's index in the flattened array, as uint32, in `shape`."""
    index = jnp.zeros(shape, jnp.uint32)
    stride = 1
    for dimension in reversed(range(len(shape))):
        index = index + jax.lax.broadcasted_iota(jnp.uint32, shape, dimension) * np.uint32(stride)
        stride *= shape[dimension]
    return index


def bits(seed: jax.Array, stream: int, shape: tuple[int, ...]) -> jax.Array:
    """Uniform uint32 draws of `shape`, from `seed` (two uint32 words) and a `stream` number.

    Raises:
        ValueError: the array has more than 2**32 elements (its indices would repeat).
    """
    if math.prod(shape) > 2**32:
        raise ValueError(
            f"stochastic rounding draws for at most 2**32 elements per array; got shape {shape}."
        )
    offset = seed[0] + np.uint32(stream * _GOLDEN % 2**32)
    return _mix(_mix(_flat_index(tuple(shape)) ^ offset) ^ seed[1])


def uniform_of(draws: jax.Array) -> jax.Array:
    """uint32 draws as float32 in [0, 1), from their top 24 bits (float32's precision: every value exact)."""
    return (draws >> 8).astype(jnp.float32) * np.float32(2.0**-24)


def uniform(seed: jax.Array, stream: int, shape: tuple[int, ...]) -> jax.Array:
    """Uniform float32 draws in [0, 1) of `shape`: `uniform_of` `bits`."""
    return uniform_of(bits(seed, stream, shape))
