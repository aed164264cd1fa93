"""8-bit optimizer state: `low_precision_optimizer(..., state_dtype="int8" or jnp.float8_e4m3fn)`."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import optimizer_training
import pytest

import jaxamp
from jaxamp._optimizer.low_precision import LowPrecisionState
from jaxamp._optimizer.quantized import QuantizedArray, dequantize, quantize, splits_by_rows, unsigned_code
from test_fp8 import equations  # (name scope, equation) of a jaxpr and every jaxpr it carries

FORMATS = ("int8", "float8_e4m3fn")
INPUTS = jax.random.normal(jax.random.key(1), (32, 64))
TARGETS = INPUTS @ (0.1 * jax.random.normal(jax.random.key(2), (64, 64)))


def bf16_params():
    """A 64 x 64 kernel (4096 elements: the smallest leaf whose state is stored in 8 bits) and a bias."""
    kernel = 0.1 * jax.random.normal(jax.random.key(0), (64, 64))
    return {"kernel": kernel.astype(jnp.bfloat16), "bias": jnp.zeros((64,), jnp.bfloat16)}


def mse(params):
    params = jax.tree.map(lambda p: p.astype(jnp.float32), params)
    return jnp.mean((INPUTS @ params["kernel"] + params["bias"] - TARGETS) ** 2)


def train(tx, steps, params=None, poison_at=(), state=None):
    """`steps` jitted steps of `tx` on the regression (tests/optimizer_training.py)."""
    return optimizer_training.train(tx, bf16_params() if params is None else params, mse, steps, poison_at, state)


def tree_bytes(tree):
    return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(tree))


def quantized_leaves(tree):
    return [leaf for leaf in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, QuantizedArray))
            if isinstance(leaf, QuantizedArray)]  # fmt: skip


# --- memory -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "state_dtype, block_size, bytes_per_param",
    [
        ("int8", 256, 2 + 2 * (1 + 4 / 256)),  # 4.03
        (jnp.float8_e4m3fn, 256, 2 + 2 * (1 + 4 / 256)),
        ("int8", 2048, 2 + 2 * (1 + 4 / 2048)),
        ("int8", None, 2 + 2 * 1),  # one scale per leaf
        (jnp.bfloat16, 256, 6),
    ],
)
def test_bfloat16_params_and_adamws_two_8_bit_moments_take_about_4_bytes_a_parameter(
    state_dtype, block_size, bytes_per_param
):
    params = {"kernel": jnp.zeros((1024, 1024), jnp.bfloat16)}
    tx = jaxamp.low_precision_optimizer(optax.adamw(1e-3), state_dtype=state_dtype, block_size=block_size)
    opt_state = tx.init(params)
    measured = (tree_bytes(params) + tree_bytes(opt_state)) / params["kernel"].size
    # Beyond the moments: AdamW's count (4 bytes), the key (8), the scale of a per-leaf moment (4 each).
    overhead = (4 + 8 + (8 if block_size is None and state_dtype == "int8" else 0)) / params["kernel"].size
    assert measured == pytest.approx(bytes_per_param + overhead, rel=1e-9)
    assert measured <= 4.1 or state_dtype == jnp.bfloat16


# --- the codes ----------------------------------------------------------------------


def test_a_leaf_splits_by_rows_where_each_part_holds_whole_blocks_or_it_is_one_block():
    """(codes split, scales split) over 8 parts: 64 x 256 in 64 blocks of 256 (8 rows, 8 blocks a part);
    24 x 640 in 60 blocks (3 rows, 7.5 blocks a part: a block would straddle two parts); 4 x 4096 (fewer
    rows than parts); a leaf of one block splits its codes by rows whenever they divide, its scale whole;
    1 part always splits."""
    assert splits_by_rows((64, 256), 64, 8) == (True, True)
    assert splits_by_rows((24, 640), 60, 8) == (False, False)
    assert splits_by_rows((4, 4096), 64, 8) == (False, False)
    assert splits_by_rows((64, 256), 1, 8) == (True, False)
    assert splits_by_rows((4, 4096), 1, 8) == (False, False)
    assert splits_by_rows((16, 3, 12, 64), 144, 8) == (True, True)
    assert splits_by_rows((8, 640), 20, 8) == (False, False)  # rows divide, blocks do not
    assert splits_by_rows((24, 640), 60, 1) == (True, True)
    assert splits_by_rows((), 1, 8) == (False, False)


def test_the_unsigned_dynamic_code_spans_seven_decades_and_the_signed_one_is_every_other_value():
    code = unsigned_code()
    assert code[0] == 0 and code[1] == np.float32(1e-7) and code[255] == 1
    assert (np.diff(code) > 0).all()
    # 128 values linearly spaced in (0.1, 1], 64 in (0.01, 0.1], ...: one decade per leading zero.
    np.testing.assert_allclose(code[128:], 0.1 + 0.9 * np.arange(1, 129) / 128, rtol=1e-6)
    np.testing.assert_allclose(code[64:128], 0.01 + 0.09 * np.arange(1, 65) / 64, rtol=1e-6)
    # A block with a negative element decodes every code to 0 or +-(an odd entry from 3 on: 1e-6 to 1).
    codes = jnp.arange(-127, 128, dtype=jnp.int8).reshape(1, 255)
    decoded = dequantize(QuantizedArray(codes.reshape(255), jnp.array([-1.0]), "int8"))
    magnitudes = np.concatenate([[0.0], code[3::2]])
    np.testing.assert_array_equal(np.asarray(decoded), np.concatenate([-magnitudes[:0:-1], magnitudes]))


@pytest.mark.parametrize("signed", [False, True], ids=["non-negative block", "block with a negative"])
def test_int8_codes_decoded_by_arithmetic_are_the_tables_values_bit_for_bit(signed):
    """The update decodes the codes it rewrites by arithmetic and the block scales' codes by a lookup in
    the table: both must give every code's value exactly, or a scale would not be its block's largest."""
    every_code = QuantizedArray(
        jnp.arange(-128, 128, dtype=jnp.int32).astype(jnp.int8), jnp.array([-1.0 if signed else 1.0]), "int8"
    )
    by_lookup, by_arithmetic = (
        jax.jit(lambda quantized, lookup=lookup: dequantize(quantized, by_lookup=lookup))(every_code)
        for lookup in (True, False)
    )
    assert np.asarray(by_arithmetic).tobytes() == np.asarray(by_lookup).tobytes()
    magnitudes = unsigned_code()[3::2] if signed else unsigned_code()
    assert set(np.abs(np.asarray(by_lookup))) == set(magnitudes) | {0}


@pytest.mark.parametrize("state_format", FORMATS)
@pytest.mark.parametrize("sign", [1.0, -1.0], ids=["non-negative block", "block with a negative"])
def test_stochastic_codes_are_unbiased_and_nearest_codes_are_not(state_format, sign):
    """Each row is a block: its largest element 1 (exact), one element of `sign` * 0.5 choosing the code,
    and 0.37 elsewhere, between two codes: the decoded mean over 2000 blocks is 0.37 within 0.1%."""
    blocks = jnp.full((2000, 256), 0.37).at[:, 0].set(1.0).at[:, 1].set(sign * 0.5)
    stochastic = dequantize(quantize(blocks, state_format, 256, jax.random.key(0)))
    nearest = dequantize(quantize(blocks, state_format, 256, None))
    assert (stochastic[:, 0] == 1.0).all() and (nearest[:, 0] == 1.0).all()
    assert float(stochastic[:, 2:].mean()) == pytest.approx(0.37, rel=1e-3)
    assert float(nearest[:, 2:].mean()) != pytest.approx(0.37, rel=1e-3)
    assert len(np.unique(np.asarray(stochastic[:, 2:]))) == 2  # the two codes around 0.37


@pytest.mark.parametrize("state_format, smallest", [("int8", 1e-7), ("float8_e4m3fn", (2.0**-9 / 448) ** 2)])
def test_in_a_block_with_no_negative_element_a_positive_value_never_rounds_to_zero(state_format, smallest):
    """A second moment rounded to zero would make Adam's m / (sqrt(v) + eps) explode."""
    block = jnp.zeros((1, 256)).at[0, 0].set(1.0).at[0, 1].set(1e-15)
    for key in (None, *jax.random.split(jax.random.key(0), 20)):
        decoded = dequantize(quantize(block, state_format, 256, key))
        assert float(decoded[0, 1]) == pytest.approx(smallest, rel=1e-6)
        assert float(decoded[0, 2]) == 0.0  # an exact zero stays zero


@pytest.mark.parametrize("state_format", FORMATS)
def test_a_second_moments_small_values_keep_their_size_where_a_signed_block_loses_them(state_format):
    """Squared gradients a thousand times apart are a million apart: 1e-6 of the largest, both formats
    keep within 30% in a non-negative block; with one negative element the block falls back on the
    signed code (int8: 1e-6 is its smallest value) or on e4m3 itself (its smallest is 4e-6 of the largest)."""
    second_moment = jnp.full((1, 256), 1e-6).at[0, 0].set(1.0)
    decoded = dequantize(quantize(second_moment, state_format, 256, None))
    assert float(decoded[0, 2:].mean()) == pytest.approx(1e-6, rel=0.3)
    signed = dequantize(quantize(second_moment.at[0, 1].set(-1.0), state_format, 256, None))
    error_signed = abs(float(signed[0, 2:].mean()) - 1e-6)
    assert error_signed > 3 * abs(float(decoded[0, 2:].mean()) - 1e-6) or state_format == "int8"


# A momentum's entries, as fractions of their block's largest (1) beside a negative one (-0.5): within
# the codes' range (int8's 1e-6 to 1, e4m3's 4.4e-6 to 1), and below it.
SMALL_ENTRIES = (3.7e-3, -3.7e-3, 4.3e-5, -4.3e-5, 7e-7, -7e-7, 2e-8, -2e-8)


def round_trip(values, state_format, key):
    """`values` (rows of 256, each a block) stored in 8 bits and read back (in float32: the code
    values below are compared within float32's rounding)."""
    return np.asarray(dequantize(quantize(values, state_format, 256, key)), np.float64)


def signed_block_values(state_format):
    """Every value a block with a negative element decodes to, ascending, as fractions of its largest."""
    if state_format == "int8":
        magnitudes = np.concatenate([[0.0], unsigned_code()[3::2]])  # 0 and +-127 values from 1e-6 to 1
    else:
        codes = np.arange(256, dtype=np.uint8).view(jnp.float8_e4m3fn).astype(np.float32)
        magnitudes = np.abs(codes[np.isfinite(codes)]) / np.float32(448)  # decoded in float32
    return np.unique(np.concatenate([-magnitudes, magnitudes]).astype(np.float64))


def momentum_blocks(rows):
    """`rows` blocks per small entry: 1, -0.5, then 254 copies of the entry."""
    entries = jnp.repeat(jnp.asarray(SMALL_ENTRIES), rows)[:, None]
    return jnp.broadcast_to(entries, (entries.shape[0], 256)).at[:, 0].set(1.0).at[:, 1].set(-0.5), rows


@pytest.mark.parametrize("state_format", FORMATS)
def test_a_momentums_small_entries_beside_a_large_one_round_to_the_nearest_value_of_the_signed_code(
    state_format,
):
    """An entry the code cannot hold (2e-8, 7e-7 under e4m3) rounds to zero or its nearest neighbour,
    never up to the code's smallest: e4m3's is 4.4e-6, 6 to 220 times these entries."""
    blocks, rows = momentum_blocks(1)
    decoded = round_trip(blocks, state_format, None)[:, 2:]
    values = signed_block_values(state_format)
    for entry, got in zip(SMALL_ENTRIES, decoded, strict=True):
        nearest = values[np.argmin(np.abs(values - entry))]
        np.testing.assert_allclose(got, nearest, rtol=1e-6, atol=0, err_msg=f"entry {entry}")


@pytest.mark.parametrize("state_format", FORMATS)
def test_a_momentums_small_entries_beside_a_large_one_decode_unbiased_when_rounded_stochastically(
    state_format,
):
    """Each entry decodes to one of the two code values around it, the upper one as often as makes
    the mean the entry itself: over 400 blocks (101,600 draws) the mean is the entry within five
    standard errors, for entries inside the code's range and far below it (2e-8, a fiftieth of
    int8's smallest)."""
    blocks, rows = momentum_blocks(400)
    decoded = round_trip(blocks, state_format, jax.random.key(0))[:, 2:]
    values = signed_block_values(state_format)
    for index, entry in enumerate(SMALL_ENTRIES):
        got = decoded[index * rows : (index + 1) * rows].ravel()
        lower, upper = values[values <= entry].max(), values[values >= entry].min()
        either = np.isclose(got, lower, rtol=1e-6, atol=0) | np.isclose(got, upper, rtol=1e-6, atol=0)
        assert either.all(), (entry, lower, upper, np.unique(got[~either])[:4])
        p_upper = (entry - lower) / (upper - lower) if upper > lower else 0.0
        standard_error = (upper - lower) * np.sqrt(p_upper * (1 - p_upper) / got.size)
        assert abs(got.mean() - entry) <= 5 * standard_error + 1e-6 * abs(entry), (entry, got.mean())


@pytest.mark.parametrize("state_format", FORMATS)
def test_sgd_momentums_small_entries_come_back_from_8_bit_state_unbiased(state_format):
    """Through the optimizer: a momentum (``optax.trace``, decay 1) holds one step's gradients, whose
    blocks have a large entry and tiny ones; the next step, with zero gradients and the params put
    back at zero, updates by the momentum as stored. The tiny entries (7e-7 of the largest: between
    int8's 0 and 1e-6, e4m3's 0 and 4.4e-6) keep their mean within 5% (five standard errors)."""
    tx = jaxamp.low_precision_optimizer(
        optax.trace(decay=1.0), param_dtype=jnp.float32, state_dtype=state_format, rounding="nearest", key=1
    )
    params = jnp.zeros((256, 256))
    grads = jnp.full((256, 256), -7e-7).at[:, 0].set(1.0)
    _, opt_state = tx.update(grads, tx.init(params), params)
    momentum, _ = tx.update(jnp.zeros_like(grads), opt_state, params)
    assert float(momentum[:, 1:].mean()) == pytest.approx(-7e-7, rel=0.05)
    assert (momentum[:, 0] == 1.0).all()


def test_an_outlier_costs_precision_in_its_own_block_only():
    """Two blocks: one with an outlier 1000 times its other values. The other block keeps its precision
    with a scale per block, and loses it with one scale for the whole array."""
    values = jax.random.uniform(jax.random.key(0), (512,), minval=0.5, maxval=1.0)
    values = values.at[0].set(1000.0)
    for block_size, worst_allowed in ((256, 0.9 / 128 / 2 / 0.5), (None, None)):
        decoded = dequantize(quantize(values, "int8", block_size, None))
        error = float(jnp.max(jnp.abs(decoded[256:] - values[256:]) / values[256:]))
        if worst_allowed:
            assert error <= worst_allowed  # half a step of the top decade (0.9/128/2 of the largest), at 0.5
        else:
            assert error > 0.02


# --- training ------------------------------------------------------------------------

OPTIMIZERS = {
    "adamw": optax.adamw(0.01, weight_decay=1e-4),
    "lion": optax.lion(0.003),
    "sgd momentum": optax.sgd(0.05, momentum=0.9),
    "MultiSteps adam": optax.MultiSteps(optax.adam(0.01), every_k_schedule=2),
    "inject_hyperparams adam": optax.inject_hyperparams(optax.adam)(learning_rate=0.01),
}


@pytest.mark.parametrize("state_format", FORMATS)
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_every_optimizer_trains_with_8_bit_state_as_with_bfloat16_state(name, state_format):
    """60 steps: the loss falls by as much as with bfloat16 state, within 10% of it."""
    _reference, reference_losses = train(jaxamp.low_precision_optimizer(OPTIMIZERS[name]), steps=60)
    tx = jaxamp.low_precision_optimizer(OPTIMIZERS[name], state_dtype=state_format)
    state, losses = train(tx, steps=60)
    assert losses[-1] < 0.2 * losses[0]
    assert losses[-1] == pytest.approx(reference_losses[-1], rel=0.1)
    stored = quantized_leaves(state.opt_state)
    assert stored and {leaf.format for leaf in stored} == {state_format}
    # Codes shaped like the kernel, a scale per 256 of its 4096 elements.
    assert all(leaf.codes.shape == (64, 64) and leaf.scales.shape == (16,) for leaf in stored)
    # The bias (64 elements) keeps its float32 state, the count its int32.
    small = [
        leaf for leaf in jax.tree.leaves(state.opt_state.inner_state) if leaf.ndim == 1 and leaf.size == 64
    ]
    assert small and {leaf.dtype for leaf in small} == {jnp.dtype(jnp.float32)}


class HeldMovingAverage:
    """An optax-style transformation: an average of squared gradients, ``v = b2 v + (1 - b2) g**2``,
    that starts at 0.5 but for the first element of each block of 256, held at 1 by a gradient of 1; the
    others get none."""

    @staticmethod
    def init(params):
        return {"v": jnp.full(params.shape, 0.5).at[::256].set(1.0)}

    @staticmethod
    def update(grads, state, params=None):
        del params
        return grads, {"v": 0.999 * state["v"] + 0.001 * grads**2}


@pytest.mark.parametrize("state_format", FORMATS)
def test_a_second_moment_in_8_bits_decays_by_b2_each_step_below_its_blocks_steady_largest(state_format):
    """0.1% a step is far below a code's step near 0.5 (1.4% for int8, 10% of the square root for e4m3):
    rounded to the nearest code, the moment would stay put; rounded stochastically, after 1000 steps the
    mean over 16 blocks is its stored start (0.5 rounded to its nearest code by `init`: 0.510 in e4m3)
    times 0.999**1000, within 2%."""
    tx = jaxamp.low_precision_optimizer(
        optax.GradientTransformation(HeldMovingAverage.init, HeldMovingAverage.update),
        state_dtype=state_format, key=3,
    )  # fmt: skip
    params = jnp.zeros((4096,), jnp.bfloat16)
    grads = jnp.zeros((4096,)).at[::256].set(1.0)  # the first element of each block held at 1

    @jax.jit
    def run(params):
        step = lambda _, opt_state: tx.update(grads, opt_state, params)[1]
        return jax.lax.fori_loop(0, 1000, step, tx.init(params))

    start = dequantize(tx.init(params).inner_state["v"]).reshape(16, 256)
    v = dequantize(run(params).inner_state["v"]).reshape(16, 256)
    assert (v[:, 0] == 1.0).all()
    assert float(start[:, 1:].mean()) == pytest.approx(0.5, rel=0.03)
    assert float(v[:, 1:].mean()) == pytest.approx(float(start[:, 1:].mean()) * 0.999**1000, rel=0.02)


@pytest.mark.parametrize("state_format", FORMATS)
@pytest.mark.parametrize("rounding", ["stochastic", "kahan"])
def test_a_skipped_step_leaves_every_byte_of_the_8_bit_state_identical(state_format, rounding):
    tx = jaxamp.low_precision_optimizer(optax.adam(1e-2), rounding=rounding, state_dtype=state_format)
    before, _ = train(tx, steps=2)
    state, _ = train(tx, steps=3, poison_at=(2,))
    assert int(state.skipped_steps) == 1
    leaves, expected = (
        jax.tree.leaves((state.params, state.opt_state)),
        jax.tree.leaves((before.params, before.opt_state)),
    )
    assert len(leaves) == len(expected)
    for kept, want in zip(leaves, expected, strict=True):
        assert kept.dtype == want.dtype and np.asarray(kept).tobytes() == np.asarray(want).tobytes()
    assert quantized_leaves(state.opt_state)


@pytest.mark.parametrize("state_format", FORMATS)
def test_a_run_resumed_from_the_8_bit_state_is_bit_exact(state_format):
    tx = jaxamp.low_precision_optimizer(optax.adam(1e-2), state_dtype=state_format, key=jax.random.key(5))
    whole, _ = train(tx, steps=4)
    half, _ = train(tx, steps=2)
    checkpoint = jax.tree.map(np.asarray, half)  # every leaf of the train state to NumPy, and back
    resumed, _ = train(tx, steps=2, state=jax.tree.map(jnp.asarray, checkpoint))
    assert quantized_leaves(resumed.opt_state)
    for got, expected in zip(jax.tree.leaves(resumed), jax.tree.leaves(whole), strict=True):
        assert np.asarray(got).tobytes() == np.asarray(expected).tobytes()


def test_the_8_bit_state_passes_through_jit_tree_map_and_lower():
    tx = jaxamp.low_precision_optimizer(optax.adam(1e-3), state_dtype="int8")
    params = bf16_params()
    opt_state = jax.jit(tx.init)(params)
    assert isinstance(opt_state, LowPrecisionState) and quantized_leaves(opt_state)
    assert jax.tree.structure(jax.tree.map(lambda leaf: leaf, opt_state)) == jax.tree.structure(opt_state)
    grads = jax.tree.map(jnp.ones_like, params)
    assert "func" in jax.jit(tx.update).lower(grads, opt_state, params).as_text()
    abstract = jax.eval_shape(tx.update, grads, opt_state, params)[1]
    assert [leaf.dtype for leaf in jax.tree.leaves(abstract)] == [
        leaf.dtype for leaf in jax.tree.leaves(opt_state)
    ]


def clipped_adamw_update(state_dtype, shapes):
    """``(params, state, grads) -> (new params, state)`` of AdamW clipped by the global norm, with its state in
    `state_dtype`, and the abstract arguments for bfloat16 params of `shapes` (a mapping from names)."""
    tx = jaxamp.low_precision_optimizer(
        optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3)), state_dtype=state_dtype
    )

    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    params = {name: jax.ShapeDtypeStruct(shape, jnp.bfloat16) for name, shape in shapes.items()}
    return step, (params, jax.eval_shape(tx.init, params), params)


@pytest.mark.parametrize("state_format", FORMATS)
def test_an_8_bit_updates_two_computations_of_the_new_state_share_the_gradients_and_params(state_format):
    """The block scales come from a computation of the new state of their own, and the codes from one that
    reads the stored state through a barrier: the gradients and params go behind no barrier, so that XLA
    computes what depends on them alone once (clipping's global norm reads the gradients once)."""
    step, args = clipped_adamw_update(state_format, {"kernel": (64, 64)})
    closed = jax.make_jaxpr(step)(*args)
    argument_names = dict(zip(
        closed.jaxpr.invars,
        [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(args)[0]],
    ))  # fmt: skip
    behind_barriers = [
        argument_names.get(operand, "a computed value")
        for _, equation in equations(closed.jaxpr) if equation.primitive.name == "optimization_barrier"
        for operand in equation.invars
    ]  # fmt: skip
    assert "[1].inner_state[1][0].mu['kernel'].codes" in behind_barriers
    assert not [name for name in behind_barriers if name.startswith(("[0]", "[2]"))]  # params, grads


@pytest.mark.parametrize("state_format", FORMATS)
def test_an_8_bit_update_compiled_for_an_h200_moves_the_bytes_of_a_bfloat16_one(state_format):
    """Reading the gradients and the codes once more for the block scales (2 + 1 + 1 bytes a parameter)
    costs what 8-bit state saves on writing the moments: bfloat16 state's bytes moved, within 5%, for
    several leaves of one shape (as a model's layers have: GPT-2's 12 attention kernels). That needs the
    codes rewritten in place (a copy would cost 2 bytes more), the global norm computed once (2 more),
    and no kernel merged over the leaves that writes the new state in float32 (with the draws' index
    built from a small array per dimension, shared by the leaves, XLA merged them: 40 bytes)."""
    if not jaxamp.diagnostics.cuda_plugin_available():
        pytest.skip("needs the CUDA PJRT plugin (pip install 'jax-mixed-precision[gpu-aot]')")
    device = jaxamp.diagnostics.gpu_target_device("h200")
    shapes = {f"layer{index}": (768, 3, 12, 64) for index in range(12)}

    def bytes_per_param(state_dtype):
        step, args = clipped_adamw_update(state_dtype, shapes)
        arguments = jaxamp.diagnostics.on_device(args, device)
        compiled = jax.jit(step, donate_argnums=(0, 1)).lower(*arguments).compile()
        return jaxamp.diagnostics.bytes_accessed(compiled.as_text()) / (12 * 768 * 3 * 12 * 64)

    assert bytes_per_param(state_format) <= 1.05 * bytes_per_param(jnp.bfloat16)


def test_a_mapping_stores_one_moment_in_8_bits_and_the_other_in_bfloat16():
    tx = jaxamp.low_precision_optimizer(optax.adam(1e-3), state_dtype={"mu": jnp.bfloat16, "nu": "int8"})
    adam = tx.init(bf16_params())[0][0]
    assert adam.mu["kernel"].dtype == jnp.bfloat16 and adam.mu["bias"].dtype == jnp.bfloat16
    assert isinstance(adam.nu["kernel"], QuantizedArray) and adam.nu["bias"].dtype == jnp.float32


# --- errors -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "settings, message",
    [
        (
            {"state_dtype": "int4"},
            (r"^low_precision_optimizer's state_dtype must be a floating dtype such as jnp.bfloat16, jnp.float16 "
            r"or jnp.float32 \(stored as is\), or an 8-bit format with a scale per block of block_size "
            r"elements: 'int8', 'float8_e4m3fn' \(or jnp.int8, jnp.float8_e4m3fn\); got int4\.$"),
        ),
        ({"state_dtype": jnp.int16}, r"8-bit format .*; got int16\.$"),
        ({"state_dtype": jnp.float8_e5m2}, r"8-bit format .*; got float8_e5m2\.$"),
        ({"state_dtype": {"mu": "int8", "nu": jnp.uint8}}, r"^low_precision_optimizer's state_dtype\['nu'\] must be .*; got uint8\.$"),
        (
            {"state_dtype": "int8", "block_size": 300},
            (r"^low_precision_optimizer's block_size must be a power of two \(elements per scale of an 8-bit "
            r"state leaf, which must divide the leaf's size; 256 by default, bitsandbytes uses 2048\) or None "
            r"\(one scale per leaf\); got 300\.$"),
        ),
        ({"state_dtype": "int8", "block_size": 0}, r"block_size must be a power of two .*; got 0\.$"),
        ({"state_dtype": "int8", "block_size": 2.5}, r"block_size must be a power of two .*; got 2.5\.$"),
        ({"state_dtype": "int8", "block_size": True}, r"block_size must be a power of two .*; got True\.$"),
    ],
    ids=["int4", "int16", "float8_e5m2", "uint8-in-mapping", "block-300", "block-0", "block-2.5", "block-True"],
)  # fmt: skip
def test_settings_bad_in_themselves_are_refused_when_the_optimizer_is_built(settings, message):
    with pytest.raises(ValueError, match=message):
        jaxamp.low_precision_optimizer(optax.scale_by_adam(), **settings)


@pytest.mark.parametrize(
    "settings, params, message",
    [
        (
            {"state_dtype": "int8", "block_size": 4096},
            {"kernel": jnp.zeros((96, 64), jnp.bfloat16)},
            (r"^low_precision_optimizer's block_size 4096 does not divide the state leaf at .*\['kernel'\] "
            r"\(shape \(96, 64\), 6144 elements\), which is stored in int8 in blocks of block_size elements\. "
            r"Choose a block_size that divides it \(the largest power of two that does: 2048\), block_size=None "
            r"for one scale per leaf, or keep that field in a floating dtype"),
        ),
        (
            {"state_dtype": lambda path, leaf: jnp.uint8},
            None,
            r"state_dtype \(at .*mu.*\) must be .*; got uint8\.$",
        ),
        ({"state_dtype": {"momentum": "int8"}}, None, r"state_dtype names 'momentum', which the inner optimizer"),
        (
            {"state_dtype": "int8"},
            {"kernel": jnp.zeros((8, 8), jnp.bfloat16)},
            (r"asks for 8-bit state \(int8\), but no floating leaf .* has 4096 elements or more .*"
            r"are \.mu\['kernel'\] \(8, 8\), \.nu\['kernel'\] \(8, 8\)\)\. Leave state_dtype at a floating"),
        ),
    ],
    ids=["block-does-not-divide", "callable-returns-uint8", "mapping-names-no-field", "too-small"],
)  # fmt: skip
def test_settings_that_depend_on_the_state_are_refused_at_init_naming_the_leaf(settings, params, message):
    """What the inner optimizer's state holds is known at ``init``, from the params: built, the optimizer
    has no complaint yet."""
    tx = jaxamp.low_precision_optimizer(optax.scale_by_adam(), **settings)
    with pytest.raises(ValueError, match=message):
        tx.init(bf16_params() if params is None else params)


@pytest.mark.parametrize("inner", [optax.sgd(0.1), optax.scale(-0.1)], ids=["sgd", "scale"])
def test_an_optimizer_without_floating_state_asked_for_8_bits_says_there_is_nothing_to_quantize(inner):
    with pytest.raises(
        ValueError, match=r"has no floating leaf to store in it .* optax.sgd without momentum"
    ):
        jaxamp.low_precision_optimizer(inner, state_dtype=jnp.float8_e4m3fn).init(bf16_params())


# --- policies -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec, state_format, num_blocks",
    [
        ("bfloat16_int8", "int8", 16),
        ("bf16_fp8", "float8_e4m3fn", 16),
        ("bfloat16_int8_per_tensor", "int8", 1),
        ("p=bf16,u=kahan,state=float8,block=64", "float8_e4m3fn", 64),
    ],
)
def test_a_policy_naming_an_8_bit_state_stores_adams_moments_in_it(spec, state_format, num_blocks):
    policy = jaxamp.get_policy(spec)
    assert jaxamp.get_policy(str(policy)) == policy
    state, losses = train(jaxamp.optimizer_for_policy(optax.adam(1e-2), policy, key=0), steps=3)
    assert losses[-1] < losses[0]
    adam = state.opt_state.inner_state[0]
    for moment in (adam.mu["kernel"], adam.nu["kernel"]):
        assert isinstance(moment, QuantizedArray)
        assert moment.format == state_format and moment.codes.shape == (64, 64)
        assert moment.scales.shape == (num_blocks,)
    assert (state.opt_state.compensation is not None) == (policy.update_rounding == "kahan")


@pytest.mark.parametrize(
    "spec, message",
    [
        ("p=bf16,state=int8", r"names an optimizer state format without an update rounding: add ',update=stochastic'"),
        ("p=bf16,u=stochastic,block=64", r"gives a block size but no optimizer state format: add ',state=int8'"),
        ("p=bf16,u=stochastic,state=int4", (r"Unknown optimizer state format 'int4' .* Valid: int8, float8_e4m3fn, "
                                           r"float8, fp8, f8")),
        ("p=bf16,u=stochastic,state=int8,block=-4", r"Unknown block size '-4' .* a positive integer .* or 'tensor'"),
    ],
)  # fmt: skip
def test_a_bad_8_bit_state_in_a_policy_names_the_fix(spec, message):
    with pytest.raises(ValueError, match=message):
        jaxamp.get_policy(spec)
