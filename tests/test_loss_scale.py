"""Tests for the loss scales: state machines, pytree behaviour, jmp parity.

Every state-machine scenario runs twice, eagerly and under `jax.jit`: jmp's
tests ran only eagerly, which is how its jit-only defects shipped.
"""

import dataclasses
import functools

import hypothesis
import jax
import jax.numpy as jnp
import jmp
import numpy as np
import pytest
from hypothesis import strategies as st

import jaxamp
from jaxamp import DynamicLossScale, NoOpLossScale, StaticLossScale

F32_MAX = float(np.finfo(np.float32).max)
JMP_0_0_4 = pytest.mark.skipif(
    jmp.__version__ != "0.0.4", reason="documents a defect of jmp 0.0.4 specifically"
)

T, F = True, False


def adjust_eagerly(loss_scale, grads_finite):
    return loss_scale.adjust(grads_finite)


adjust_jitted = jax.jit(adjust_eagerly)


@pytest.fixture(params=["eager", "jit"])
def adjust(request):
    """`loss_scale.adjust`, called eagerly or through `jax.jit`."""
    return {"eager": adjust_eagerly, "jit": adjust_jitted}[request.param]


def run(adjust, loss_scale, pattern):
    """Adjusts `loss_scale` once per entry of `pattern`; returns every state."""
    states = []
    for grads_finite in pattern:
        loss_scale = adjust(loss_scale, jnp.asarray(grads_finite))
        states.append(loss_scale)
    return states


def history(states, field):
    return [getattr(state, field).item() for state in states]


def describe(loss_scale):
    """Every dataclass field of a loss scale, with arrays as (dtype, shape, value)."""

    def value(field):
        leaf = getattr(loss_scale, field.name)
        if isinstance(leaf, jax.Array):
            return (leaf.dtype, leaf.shape, leaf.item())
        return leaf

    return {field.name: value(field) for field in dataclasses.fields(loss_scale)}


# --- state machines, step by step ----------------------------------------------

# (initial loss scale, grads_finite per step, expected value of each field
# after each step). Fields not listed must stay at their initial value, except
# the hysteresis bookkeeping, which the hysteresis scenarios spell out.
SCENARIOS = {
    "grows_on_every_period_th_consecutive_finite_step": (
        DynamicLossScale(loss_scale=4, period=3),
        [T, T, T, T, T, T],
        {"loss_scale": [4, 4, 8, 8, 8, 16], "counter": [1, 2, 0, 1, 2, 0]},
    ),
    "an_overflow_halves_the_scale_and_restarts_the_count": (
        DynamicLossScale(loss_scale=4, period=3),
        [T, T, F, T, T, T],
        {
            "loss_scale": [4, 4, 2, 2, 2, 4],
            "counter": [1, 2, 0, 1, 2, 0],
            "skipped_steps": [0, 0, 1, 1, 1, 1],
            "consecutive_skipped_steps": [0, 0, 1, 0, 0, 0],
        },
    ),
    "back_off_stops_at_min_loss_scale": (
        DynamicLossScale(loss_scale=8, period=3, min_loss_scale=2),
        [F, F, F, F, T],
        {
            "loss_scale": [4, 2, 2, 2, 2],
            "counter": [0, 0, 0, 0, 1],
            "skipped_steps": [1, 2, 3, 4, 4],
            "consecutive_skipped_steps": [1, 2, 3, 4, 0],
        },
    ),
    "growth_stops_at_max_loss_scale": (
        DynamicLossScale(loss_scale=8, period=1, factor=3, max_loss_scale=20),
        [T, T, T],
        {"loss_scale": [20, 20, 20]},
    ),
    "factor_sets_both_growth_and_back_off": (
        DynamicLossScale(loss_scale=9, period=2, factor=3),
        [T, T, F, F],
        {
            "loss_scale": [9, 27, 9, 3],
            "counter": [1, 0, 0, 0],
            "skipped_steps": [0, 0, 1, 2],
            "consecutive_skipped_steps": [0, 0, 1, 2],
        },
    ),
    "hysteresis_2_tolerates_one_overflow_until_the_next_growth": (
        DynamicLossScale(loss_scale=8, period=2, hysteresis=2),
        [F, F, T, F, T, T, F],
        {
            "loss_scale": [8, 4, 4, 2, 2, 4, 4],
            "overflows_until_backoff": [1, 0, 0, 0, 0, 2, 1],
            "counter": [0, 0, 1, 0, 1, 0, 0],
            "skipped_steps": [1, 2, 2, 3, 3, 3, 4],
            "consecutive_skipped_steps": [1, 2, 0, 1, 0, 0, 1],
        },
    ),
    "hysteresis_3_tolerates_two_overflows": (
        DynamicLossScale(loss_scale=16, period=10, hysteresis=3),
        [F, F, F, F],
        {
            "loss_scale": [16, 16, 8, 4],
            "overflows_until_backoff": [2, 1, 0, 0],
            "skipped_steps": [1, 2, 3, 4],
            "consecutive_skipped_steps": [1, 2, 3, 4],
        },
    ),
    "a_static_scale_never_changes_and_counts_its_skipped_steps": (
        StaticLossScale(8),
        [F, T, F, F],
        {
            "loss_scale": [8, 8, 8, 8],
            "skipped_steps": [1, 1, 2, 3],
            "consecutive_skipped_steps": [1, 0, 1, 2],
        },
    ),
    "a_no_op_scale_stays_at_one_and_counts_its_skipped_steps": (
        NoOpLossScale(),
        [F, T, F, F],
        {
            "loss_scale": [1, 1, 1, 1],
            "skipped_steps": [1, 1, 2, 3],
            "consecutive_skipped_steps": [1, 0, 1, 2],
        },
    ),
}


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_state_machine_follows_the_hand_written_sequence(adjust, scenario):
    initial, pattern, expected = SCENARIOS[scenario]
    states = run(adjust, initial, pattern)
    for field, sequence in expected.items():
        assert history(states, field) == sequence, field
    untouched = {
        name: value
        for name, value in describe(initial).items()
        if name not in expected and name != "overflows_until_backoff"
    }
    for state in states:
        assert type(state) is type(initial)
        assert {name: value for name, value in describe(state).items() if name in untouched} == untouched


def test_default_period_grows_on_exactly_the_2000th_clean_step():
    @functools.partial(jax.jit, static_argnums=1)
    def clean_steps(loss_scale, count):
        return jax.lax.fori_loop(0, count, lambda _, state: state.adjust(jnp.array(True)), loss_scale)

    after_1999 = clean_steps(DynamicLossScale(), 1999)
    assert after_1999.loss_scale == 2.0**15
    assert after_1999.counter == 1999
    after_2000 = clean_steps(after_1999, 1)
    assert after_2000.loss_scale == 2.0**16
    assert after_2000.counter == 0


@pytest.mark.parametrize(
    "loss_scale, grads_finite, expected",
    [
        (DynamicLossScale(loss_scale=1, period=1, max_loss_scale=F32_MAX), True, F32_MAX),
        (
            DynamicLossScale(loss_scale=F32_MAX, min_loss_scale=2.0**-100, max_loss_scale=F32_MAX),
            False,
            2.0**-100,
        ),
        (DynamicLossScale(loss_scale=2.0**24, period=1), True, 2.0**24),
        (DynamicLossScale(), False, 1.0),
    ],
    ids=[
        "growth_to_float32_max",
        "back_off_to_tiny_floor",
        "growth_to_default_cap",
        "back_off_to_default_floor",
    ],
)
def test_the_scale_never_becomes_inf_or_nan(loss_scale, grads_finite, expected):
    @jax.jit
    def three_hundred_steps(loss_scale):
        def step(state, _):
            state = state.adjust(jnp.array(grads_finite))
            return state, state.loss_scale

        return jax.lax.scan(step, loss_scale, length=300)

    final, scales = three_hundred_steps(loss_scale)
    assert np.all(np.isfinite(scales)) and np.all(scales > 0)
    assert final.loss_scale == np.float32(expected)


@hypothesis.given(pattern=st.lists(st.booleans(), max_size=40))
def test_dynamic_scale_matches_jmp_on_any_finite_overflow_pattern(pattern):
    ours = DynamicLossScale(loss_scale=2.0**10, period=3, min_loss_scale=2.0**7, max_loss_scale=2.0**60)
    # jmp keeps min_loss_scale only while it never crosses a jit boundary, so
    # it runs eagerly here; with a float32 scale it is right.
    theirs = jmp.DynamicLossScale(jnp.float32(2.0**10), period=3, min_loss_scale=jnp.float32(2.0**7))
    for grads_finite in pattern:
        ours = adjust_jitted(ours, jnp.asarray(grads_finite))
        theirs = theirs.adjust(jnp.asarray(grads_finite))
        assert ours.loss_scale == theirs.loss_scale
        assert ours.counter == theirs.counter


# --- jmp 0.0.4's three defects, fixed ------------------------------------------


def test_min_loss_scale_survives_flatten_unflatten_and_jit():
    loss_scale = DynamicLossScale(loss_scale=64, min_loss_scale=16)
    leaves, treedef = jax.tree.flatten(loss_scale)
    assert jax.tree.unflatten(treedef, leaves).min_loss_scale == 16
    assert jax.jit(lambda state: state)(loss_scale).min_loss_scale == 16
    assert history(run(adjust_jitted, loss_scale, [F, F, F, F]), "loss_scale") == [32, 16, 16, 16]


@JMP_0_0_4
def test_jmp_loses_min_loss_scale_at_a_jit_boundary():
    loss_scale = jmp.DynamicLossScale(jnp.float32(64), min_loss_scale=jnp.float32(16))
    assert jax.jit(lambda state: state)(loss_scale).min_loss_scale == 1
    assert history(run(adjust_jitted, loss_scale, [F, F, F, F]), "loss_scale") == [32, 16, 8, 4]


def test_a_float16_initial_scale_works_in_adjust(adjust):
    loss_scale = DynamicLossScale(jnp.float16(2.0**15), period=1)
    assert loss_scale.loss_scale.dtype == jnp.float32
    backed_off, grown = run(adjust, loss_scale, [F, T])
    assert backed_off.loss_scale.dtype == grown.loss_scale.dtype == jnp.float32
    assert (backed_off.loss_scale.item(), grown.loss_scale.item()) == (2.0**14, 2.0**15)


@JMP_0_0_4
def test_jmp_float16_readme_example_fails_in_adjust():
    with pytest.raises(TypeError):
        jmp.DynamicLossScale(jnp.float16(2.0**15)).adjust(jnp.array(False))


FULLY_SET_DYNAMIC = DynamicLossScale(
    loss_scale=64,
    counter=3,
    period=7,
    factor=4,
    min_loss_scale=2,
    max_loss_scale=2.0**20,
    hysteresis=3,
    overflows_until_backoff=2,
    skipped_steps=5,
    consecutive_skipped_steps=1,
)
LOSS_SCALES = {
    "no_op": NoOpLossScale(),
    "static": StaticLossScale(2.0**10),
    "dynamic_defaults": DynamicLossScale(),
    "dynamic_every_field_set": FULLY_SET_DYNAMIC,
}


@pytest.mark.parametrize("name", sorted(LOSS_SCALES))
def test_jit_lower_accepts_a_loss_scale(name):
    loss_scale = LOSS_SCALES[name]
    one_overflow = jax.jit(lambda state: state.adjust(jnp.array(False)))
    compiled = one_overflow.lower(loss_scale).compile()
    assert describe(compiled(loss_scale)) == describe(one_overflow(loss_scale))
    # Lowering from abstract leaves alone works too (no constructor runs on them).
    abstract = jax.tree.map(lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype), loss_scale)
    assert one_overflow.lower(abstract).compile()(loss_scale).loss_scale == compiled(loss_scale).loss_scale


@JMP_0_0_4
def test_jmp_dynamic_loss_scale_cannot_be_lowered():
    with pytest.raises(TypeError):
        jax.jit(lambda state: state.loss_scale).lower(jmp.DynamicLossScale(jnp.float32(4)))


# --- loss scales are pytrees whose every field survives --------------------------


def flatten_unflatten(loss_scale):
    leaves, treedef = jax.tree.flatten(loss_scale)
    return jax.tree.unflatten(treedef, leaves)


ROUND_TRIPS = {
    "flatten_unflatten": flatten_unflatten,
    "jit_in_and_out": jax.jit(lambda state: state),
    "tree_map": lambda state: jax.tree.map(lambda leaf: leaf, state),
    "tree_map_copy": lambda state: jax.tree.map(jnp.copy, state),
    "lower_compile": lambda state: jax.jit(lambda inner: inner).lower(state).compile()(state),
    "device_put": jax.device_put,
}


@pytest.mark.parametrize("round_trip", sorted(ROUND_TRIPS))
@pytest.mark.parametrize("name", sorted(LOSS_SCALES))
def test_every_field_survives(name, round_trip):
    loss_scale = LOSS_SCALES[name]
    survivor = ROUND_TRIPS[round_trip](loss_scale)
    assert type(survivor) is type(loss_scale)
    assert describe(survivor) == describe(loss_scale)
    assert survivor.loss_scale.item() == loss_scale.loss_scale.item()


def test_state_leaves_are_arrays_and_settings_are_static():
    leaves, treedef = jax.tree.flatten(FULLY_SET_DYNAMIC)
    assert [(leaf.dtype, leaf.shape) for leaf in leaves] == [(jnp.float32, ())] + [(jnp.int32, ())] * 4
    assert [leaf.item() for leaf in leaves] == [64.0, 3, 2, 5, 1]
    # The settings are part of the structure: jit specialises on them.
    assert treedef != jax.tree.structure(dataclasses.replace(FULLY_SET_DYNAMIC, period=8))


def test_leaves_are_named_by_their_field_in_key_paths():
    paths = [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(FULLY_SET_DYNAMIC)[0]]
    assert paths == [
        ".loss_scale",
        ".counter",
        ".overflows_until_backoff",
        ".skipped_steps",
        ".consecutive_skipped_steps",
    ]


def test_a_dynamic_scale_can_be_built_inside_jit_from_a_traced_value():
    build = jax.jit(lambda scale: DynamicLossScale(scale, period=5, min_loss_scale=2))
    loss_scale = build(jnp.float16(8))
    assert (loss_scale.loss_scale.dtype, loss_scale.loss_scale.item()) == (jnp.float32, 8.0)
    assert (loss_scale.period, loss_scale.min_loss_scale) == (5, 2)


@pytest.mark.parametrize("name", sorted(LOSS_SCALES))
def test_every_loss_scale_follows_the_protocol(name):
    assert isinstance(LOSS_SCALES[name], jaxamp.LossScale)


# --- the scale itself and scale/unscale ------------------------------------------


@pytest.mark.parametrize(
    "loss_scale, value",
    [
        (NoOpLossScale(), 1.0),
        (StaticLossScale(4), 4.0),
        (StaticLossScale(np.float64(0.5)), 0.5),
        (StaticLossScale(jnp.float16(8)), 8.0),
        (StaticLossScale(jnp.bfloat16(16)), 16.0),
        (DynamicLossScale(), 2.0**15),
        (DynamicLossScale(np.int32(8)), 8.0),
        (DynamicLossScale(jnp.bfloat16(2.0**10)), 2.0**10),
        (DynamicLossScale().adjust(jnp.array(False)), 2.0**14),
    ],
)
def test_loss_scale_is_a_scalar_float32_array(loss_scale, value):
    assert isinstance(loss_scale.loss_scale, jax.Array)
    assert (loss_scale.loss_scale.shape, loss_scale.loss_scale.dtype) == ((), jnp.float32)
    assert loss_scale.loss_scale.item() == value


def mixed_tree():
    return {
        "f16": jnp.array([1.0, -2.0], jnp.float16),
        "bf16": jnp.array([0.5, 3.0], jnp.bfloat16),
        "f32": jnp.array([[1.5]], jnp.float32),
        "numpy": np.array([0.25], np.float32),
        "labels": jnp.arange(3),
        "step": 7,
    }


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("name", ["no_op", "static", "dynamic_every_field_set"])
def test_scale_and_unscale_multiply_floating_leaves_and_keep_their_dtype(name, jit):
    loss_scale = LOSS_SCALES[name]
    factor = loss_scale.loss_scale.item()
    tree = mixed_tree()
    scale, unscale = loss_scale.scale, loss_scale.unscale
    if jit:
        scale, unscale = (jax.jit(fun) for fun in (scale, unscale))
        tree.pop("step")  # a Python int would become a traced int32 array
    scaled = scale(tree)
    restored = unscale(scaled)
    for key, leaf in tree.items():
        if hasattr(leaf, "dtype") and jnp.issubdtype(leaf.dtype, jnp.floating):
            assert scaled[key].dtype == restored[key].dtype == leaf.dtype, key
            np.testing.assert_array_equal(
                np.asarray(scaled[key], np.float32), np.asarray(leaf, np.float32) * factor
            )
            np.testing.assert_array_equal(restored[key], leaf)
        elif jit:
            np.testing.assert_array_equal(scaled[key], leaf)
            assert scaled[key].dtype == leaf.dtype
        else:
            assert scaled[key] is leaf and restored[key] is leaf, key


@pytest.mark.parametrize(
    "make_loss_scale",
    [StaticLossScale, functools.partial(DynamicLossScale, max_loss_scale=2.0**25)],
    ids=["static", "dynamic"],
)
@pytest.mark.parametrize(
    "scale, gradient",
    [
        # The scale itself is inf in float16: dividing by it there gives 0.
        (2.0**16, 4.0),
        # The reciprocal 2**-25 is 0 in float16: multiplying by it there gives 0.
        (2.0**25, 60000.0),
        # The result is a float16 subnormal (3 * 2**-24), kept exactly.
        (2.0**10, 3 * 2.0**-14),
    ],
    ids=["scale_beyond_float16_max", "reciprocal_below_float16_min", "subnormal_result"],
)
def test_unscaling_float16_gradients_divides_in_float32_and_rounds_once(make_loss_scale, scale, gradient):
    loss_scale = make_loss_scale(scale)
    scaled = jnp.array([gradient], jnp.float16)
    expected = np.float16(np.float32(gradient) / np.float32(scale))
    assert expected != 0
    for unscale in (loss_scale.unscale, jax.jit(loss_scale.unscale)):
        unscaled = unscale(scaled)
        assert unscaled.dtype == jnp.float16
        assert unscaled.item() == expected


@pytest.mark.parametrize("loss_scale_class", [NoOpLossScale, StaticLossScale, DynamicLossScale])
def test_skip_counters_saturate_instead_of_wrapping(adjust, loss_scale_class):
    int32_max = int(np.iinfo(np.int32).max)
    settings = {"loss_scale": 8.0} if loss_scale_class is StaticLossScale else {}
    loss_scale = loss_scale_class(**settings, skipped_steps=int32_max, consecutive_skipped_steps=int32_max)
    (state,) = run(adjust, loss_scale, [F])
    assert (state.skipped_steps.item(), state.consecutive_skipped_steps.item()) == (int32_max, int32_max)


def test_adjust_needs_a_scalar_flag():
    with pytest.raises(ValueError, match="scalar"):
        DynamicLossScale().adjust(jnp.array([True, False]))


# --- construction --------------------------------------------------------------


@pytest.mark.parametrize(
    "build, error, match",
    [
        (lambda: DynamicLossScale(period=0), ValueError, "period"),
        (lambda: DynamicLossScale(period=2.5), ValueError, "period"),
        (lambda: DynamicLossScale(period=True), ValueError, "period"),
        (lambda: DynamicLossScale(hysteresis=0), ValueError, "hysteresis"),
        (lambda: DynamicLossScale(factor=1), ValueError, "factor"),
        (lambda: DynamicLossScale(factor=0.5), ValueError, "factor"),
        (lambda: DynamicLossScale(factor=None), TypeError, "factor"),
        (lambda: DynamicLossScale(min_loss_scale=0), ValueError, "min_loss_scale"),
        (
            lambda: DynamicLossScale(loss_scale=4, min_loss_scale=8, max_loss_scale=2),
            ValueError,
            "min_loss_scale",
        ),
        (lambda: DynamicLossScale(max_loss_scale=float("inf")), ValueError, "max_loss_scale"),
        (lambda: DynamicLossScale(max_loss_scale=1e39), ValueError, "float32"),
        (lambda: DynamicLossScale(loss_scale=0), ValueError, "loss_scale"),
        (lambda: DynamicLossScale(loss_scale=float("nan")), ValueError, "loss_scale"),
        (lambda: DynamicLossScale(loss_scale=2.0**30), ValueError, "max_loss_scale"),
        (lambda: DynamicLossScale(loss_scale=0.5), ValueError, "min_loss_scale"),
        (lambda: DynamicLossScale(loss_scale=[1.0, 2.0]), ValueError, "scalar"),
        (lambda: DynamicLossScale(counter=-1), ValueError, "counter"),
        (lambda: StaticLossScale(0), ValueError, "loss_scale"),
        (lambda: StaticLossScale(-2), ValueError, "loss_scale"),
        (lambda: StaticLossScale(float("inf")), ValueError, "loss_scale"),
        (lambda: StaticLossScale([2.0, 2.0]), ValueError, "scalar"),
    ],
)
def test_bad_settings_are_rejected_with_a_message_naming_them(build, error, match):
    with pytest.raises(error, match=match):
        build()


def test_dynamic_defaults_take_jmps_period_factor_and_floor_and_cap_the_scale_at_2_24():
    loss_scale = DynamicLossScale()
    # jmp has no default initial scale and no cap; torch starts at 2**16 and
    # has no cap either. 2**15 and 2**24 are jaxamp's own choices.
    theirs = jmp.DynamicLossScale(jnp.float32(2.0**15))
    assert (loss_scale.period, loss_scale.factor, loss_scale.min_loss_scale) == (
        theirs.period,
        theirs.factor,
        float(theirs.min_loss_scale),
    )
    assert (loss_scale.period, loss_scale.factor, loss_scale.min_loss_scale) == (2000, 2, 1)
    assert (loss_scale.loss_scale.item(), loss_scale.max_loss_scale) == (2.0**15, 2.0**24)
    assert loss_scale.hysteresis == 1 and loss_scale.overflows_until_backoff.item() == 1
    assert (loss_scale.counter.item(), loss_scale.skipped_steps.item()) == (0, 0)
    assert loss_scale.consecutive_skipped_steps.item() == 0


@pytest.mark.parametrize(
    "policy, expected",
    [
        ("mixed_float16", DynamicLossScale),
        ("mixed", DynamicLossScale),
        ("float16", DynamicLossScale),
        ("c=f16", DynamicLossScale),
        (jmp.get_policy("p=f32,c=f16,o=f32"), DynamicLossScale),
        (jaxamp.Policy(jnp.float32, jnp.float16, jnp.float32), DynamicLossScale),
        ("float32", NoOpLossScale),
        ("mixed_bfloat16", NoOpLossScale),
        ("bf16", NoOpLossScale),
    ],
)
def test_default_loss_scale_scales_only_float16_compute(policy, expected):
    loss_scale = jaxamp.default_loss_scale(policy)
    assert type(loss_scale) is expected
    if expected is DynamicLossScale:
        assert describe(loss_scale) == describe(DynamicLossScale())


def test_a_dynamic_scale_may_be_pinned_by_equal_bounds():
    loss_scale = DynamicLossScale(loss_scale=4, min_loss_scale=4, max_loss_scale=4, period=1)
    assert history(run(adjust_jitted, loss_scale, [T, F, T]), "loss_scale") == [4, 4, 4]


def test_dynamic_loss_scale_takes_its_settings_positionally_in_the_documented_order():
    loss_scale = jaxamp.DynamicLossScale(2.0**10, 100, 4, 2, 2.0**20, 3)
    assert (float(loss_scale.loss_scale), loss_scale.period, loss_scale.factor) == (1024.0, 100, 4.0)
    assert (loss_scale.min_loss_scale, loss_scale.max_loss_scale, loss_scale.hysteresis) == (2.0, 2.0**20, 3)
    assert int(loss_scale.counter) == 0
