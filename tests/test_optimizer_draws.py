"""The draws of stochastic rounding: uniform, independent between leaves, and one seed per step, not a
threefry per leaf (which made the wrapper's first step compile three times as long as optax's)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxamp
from jaxamp import _draws as draws
from jaxamp._optimizer.low_precision import round_with_draws


def test_the_draws_are_uniform_and_independent_between_streams_and_neighbours():
    seed = draws.seed_of(jax.random.key(0))
    first, second = (np.asarray(draws.uniform(seed, stream, (512, 256))).ravel() for stream in (0, 1))
    assert first.min() >= 0.0 and first.max() < 1.0
    assert abs(first.mean() - 0.5) < 0.005 and abs(first.var() - 1 / 12) < 0.002
    counts = np.histogram(first, bins=16, range=(0.0, 1.0))[0] / first.size
    np.testing.assert_allclose(counts, 1 / 16, atol=0.003)
    assert abs(np.corrcoef(first, second)[0, 1]) < 0.01  # two leaves
    assert abs(np.corrcoef(first[:-1], first[1:])[0, 1]) < 0.01  # two neighbours in a leaf
    other_step = np.asarray(draws.uniform(draws.seed_of(jax.random.key(1)), 0, (512, 256))).ravel()
    assert abs(np.corrcoef(first, other_step)[0, 1]) < 0.01


def test_a_draw_is_its_elements_whatever_the_arrays_shape():
    """The index of an element in its array decides its draw: a reshaped array draws the same."""
    seed = draws.seed_of(jax.random.key(3))
    np.testing.assert_array_equal(draws.uniform(seed, 5, (64, 32)).ravel(), draws.uniform(seed, 5, (2048,)))


@pytest.mark.parametrize("state_dtype", [jnp.bfloat16, "int8"])
def test_the_update_draws_from_one_seed_per_step_however_many_leaves(state_dtype):
    def threefry_calls(leaves):
        params = {f"layer_{index}": jnp.zeros((64, 64), jnp.bfloat16) for index in range(leaves)}
        tx = jaxamp.low_precision_optimizer(optax.adam(1e-3), state_dtype=state_dtype, rounding="kahan")
        return jax.jit(tx.update).lower(params, tx.init(params), params).as_text().count("call @threefry2x32")

    assert threefry_calls(8) == threefry_calls(2) == 2  # the key's split, and the two seeds in one call


def test_every_element_of_a_four_dimensional_array_draws_its_own_number():
    """A convolution kernel's draws: each of its 4 * 3 * 5 * 7 elements has an index of its own."""
    drawn = np.asarray(draws.bits(draws.seed_of(jax.random.key(4)), 0, (4, 3, 5, 7)))
    assert len(np.unique(drawn)) == drawn.size


def test_two_seeds_that_share_their_first_word_draw_differently():
    """Both words of a step's seed change the draws, not the first alone."""
    first = draws.bits(jnp.array([7, 1], jnp.uint32), 0, (256,))
    second = draws.bits(jnp.array([7, 2], jnp.uint32), 0, (256,))
    assert np.mean(np.asarray(first) == np.asarray(second)) < 0.01


def test_an_array_of_two_to_the_thirty_two_elements_draws_and_one_more_is_refused():
    """Indices are uint32: 2**32 elements have each their own (checked on shapes, nothing allocated)."""
    seed = jax.ShapeDtypeStruct((2,), jnp.uint32)
    assert jax.eval_shape(lambda s: draws.bits(s, 0, (2**16, 2**16)), seed).shape == (2**16, 2**16)
    with pytest.raises(ValueError, match="at most 2\\*\\*32 elements"):
        jax.eval_shape(lambda s: draws.bits(s, 0, (2**16, 2**16 + 1)), seed)


def test_a_stream_seed_computed_apart_draws_what_its_stream_number_draws():
    """`streams` gives each stream's seed as a value of its own; its draws are `bits`' for that number."""
    seed = draws.seed_of(jax.random.key(5))
    stream_seeds = jax.jit(lambda seed: draws.streams(seed, 130))(seed)  # three groups of streams
    assert len(stream_seeds) == 130
    for stream in (0, 1, 6, 63, 64, 65, 129):
        np.testing.assert_array_equal(
            draws.stream_bits(stream_seeds[stream], (16, 8)), draws.bits(seed, stream, (16, 8))
        )
    assert draws.streams(seed, 0) == []


def _lowbias32(x: int) -> int:
    """Wellons' lowbias32 on a Python int, as its author publishes it."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) % 2**32
    x ^= x >> 15
    x = (x * 0x846CA68B) % 2**32
    return x ^ (x >> 16)


def test_each_draw_is_the_documented_hash_of_its_index_and_its_streams_word():
    """``draw = lowbias32(index ^ ((seed[0] + stream * 0x9E3779B9) ^ seed[1]))``, for streams past 0
    too, in every group of `streams`, element by element."""
    seed = (0xDEADBEEF, 0x01234567)
    for stream in (0, 1, 5, 100):
        word = ((seed[0] + stream * 0x9E3779B9) % 2**32) ^ seed[1]
        expected = [_lowbias32(index ^ word) for index in range(24)]
        drawn = draws.bits(jnp.array(seed, jnp.uint32), stream, (2, 3, 4))
        assert np.asarray(drawn).ravel().tolist() == expected
        assert int(draws.stream_bits(draws.streams(jnp.array(seed, jnp.uint32), 101)[stream], (1,))[0]) == expected[0]


def test_the_low_bits_of_neighbouring_draws_are_unrelated():
    """The draws' low bits, not only the high ones stochastic rounding to bfloat16 reads: the pairs of
    neighbours' lowest four bits fill 16 x 16 cells evenly (a chi-squared test, 255 degrees of
    freedom: 400 is far beyond its 99.99th percentile, about 360)."""
    drawn = np.asarray(draws.bits(draws.seed_of(jax.random.key(8)), 3, (512, 512))).ravel() & 0xF
    counts = np.bincount(drawn[:-1:2] * 16 + drawn[1::2], minlength=256)
    expected = counts.sum() / 256
    assert np.sum((counts - expected) ** 2 / expected) < 400


def _distinct_kernels(compiled_text: str) -> int:
    """The fused computations of a compiled CPU program, counted once per distinct body."""
    bodies = set()
    for computation in re.split(r"\n(?=\S)", compiled_text):
        if computation.startswith("%fused") or computation.startswith("%wrapped"):
            body = computation.split("\n", 1)[1]
            bodies.add(re.sub(r", metadata=\{[^}]*\}", "", re.sub(r"[\w\-]+\.\d+", "x", body)))
    return len(bodies)


@pytest.mark.parametrize("state_dtype", [jnp.bfloat16, "int8"])
def test_layers_of_one_shape_compile_to_the_kernels_of_one(state_dtype):
    """Each leaf's stream is an argument of its kernel, not a constant in it: six layers of one shape
    compile to as many distinct kernels as two (as plain optax's update does), not three times as many."""

    def kernels(layers):
        params = {f"layer_{index}": jnp.zeros((64, 64), jnp.bfloat16) for index in range(layers)}
        tx = jaxamp.low_precision_optimizer(optax.adam(1e-3), state_dtype=state_dtype)
        compiled = jax.jit(tx.update).lower(params, tx.init(params), params).compile()
        return _distinct_kernels(compiled.as_text())

    assert kernels(6) == kernels(2)


def test_the_params_and_the_state_round_with_the_seeds_of_their_own_keys():
    """As the algorithm of `low_precision_optimizer` says: ``split(key, 3)`` gives the next key, the
    params' key and the state's; each param and each state leaf draws from its key's seed, in the stream
    of its place in its tree."""
    params = {"w": jnp.linspace(-1.0, 1.0, 256, dtype=jnp.bfloat16)}
    grads = {"w": jnp.linspace(0.3, -0.2, 256)}
    tx = jaxamp.low_precision_optimizer(optax.adam(1e-3), key=7)
    state = tx.init(params)
    updates, new_state = jax.jit(tx.update)(grads, state, params)

    _, params_key, state_key = jax.random.split(jax.random.wrap_key_data(state.key), 3)
    params32 = {"w": params["w"].astype(jnp.float32)}
    adam = optax.adam(1e-3)
    exact_updates, exact_state = jax.jit(adam.update)(grads, adam.init(params32), params32)
    drawn = lambda key, stream: draws.bits(draws.seed_of(key), stream, (256,))
    expected_param = round_with_draws(params32["w"] + exact_updates["w"], jnp.bfloat16, drawn(params_key, 0))
    landed = optax.apply_updates(params, updates)["w"]
    assert np.asarray(landed).tobytes() == np.asarray(expected_param).tobytes()
    rounded = 0
    for stream, (stored, exact) in enumerate(
        zip(jax.tree.leaves(new_state.inner_state), jax.tree.leaves(exact_state), strict=True)
    ):
        if stored.dtype == jnp.bfloat16:
            expected = round_with_draws(exact, jnp.bfloat16, drawn(state_key, stream))
            assert np.asarray(stored).tobytes() == np.asarray(expected).tobytes()
            rounded += 1
    assert rounded == 2  # Adam's two moments
