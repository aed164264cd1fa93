"""`jaxamp.low_precision_optimizer`: bfloat16 params and optimizer state that keep small updates."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import optimizer_training
import pytest
from fresh_processes import FreshProcess, xla_flags

import jaxamp
from jaxamp._optimizer.low_precision import LowPrecisionState, stochastic_round

ROUNDINGS = ("nearest", "stochastic", "kahan")
INPUTS = jax.random.normal(jax.random.key(1), (32, 8))
TARGETS = INPUTS @ jnp.linspace(-1.0, 1.0, 8)[:, None]


def bf16_params():
    keys = jax.random.split(jax.random.key(0), 2)
    return {
        "kernel": (0.3 * jax.random.normal(keys[0], (8, 1))).astype(jnp.bfloat16),
        "bias": jnp.zeros((1,), jnp.bfloat16),
    }


def mse(params):
    params = jax.tree.map(lambda p: p.astype(jnp.float32), params)
    return jnp.mean((INPUTS @ params["kernel"] + params["bias"] - TARGETS) ** 2)


def train(tx, params, steps, poison_at=()):
    """`steps` jitted steps of `tx` through jaxamp.TrainState; a step in `poison_at` gets inf gradients."""
    return optimizer_training.train(tx, params, mse, steps, poison_at)


def dtypes(tree):
    return [leaf.dtype for leaf in jax.tree.leaves(tree)]


def tree_bytes(tree):
    return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(tree))


@pytest.mark.parametrize(
    "state_dtype, mu_dtype, nu_dtype",
    [
        (jnp.bfloat16, jnp.bfloat16, jnp.bfloat16),
        ({"mu": jnp.bfloat16, "nu": jnp.float32}, jnp.bfloat16, jnp.float32),
        ({"nu": jnp.bfloat16}, jnp.float32, jnp.bfloat16),
        (
            lambda path, leaf: jnp.float16 if "mu" in jax.tree_util.keystr(path) else None,
            jnp.float16,
            jnp.float32,
        ),
        (jnp.float32, jnp.float32, jnp.float32),
    ],
    ids=["all-bf16", "mu-bf16-nu-f32", "nu-bf16", "callable-mu-f16", "all-f32"],
)
def test_adam_moments_are_stored_in_the_dtypes_asked_after_init_and_after_three_jitted_steps(
    state_dtype, mu_dtype, nu_dtype
):
    tx = jaxamp.low_precision_optimizer(optax.scale_by_adam(), state_dtype=state_dtype)
    state, _ = train(tx, bf16_params(), steps=0)
    for when in ("after init", "after 3 steps"):
        adam = state.opt_state.inner_state
        assert set(dtypes(adam.mu)) == {jnp.dtype(mu_dtype)}, when
        assert set(dtypes(adam.nu)) == {jnp.dtype(nu_dtype)}, when
        assert adam.count.dtype == jnp.int32, when
        assert set(dtypes(state.params)) == {jnp.dtype(jnp.bfloat16)}, when
        state, _ = train(tx, state.params, steps=3)


def test_scalars_of_the_state_such_as_an_injected_learning_rate_keep_their_dtype():
    inner = optax.inject_hyperparams(optax.adam)(learning_rate=optax.linear_schedule(1e-3, 0.0, 10))
    state, _ = train(jaxamp.low_precision_optimizer(inner), bf16_params(), steps=3)
    injected = state.opt_state.inner_state
    assert injected.hyperparams["learning_rate"].dtype == jnp.float32
    # The rate of the last step taken (the third: 1e-3 * 8 / 10), to float32 precision, not bfloat16.
    assert float(injected.hyperparams["learning_rate"]) == pytest.approx(8e-4, rel=1e-6)
    assert set(dtypes(injected.inner_state[0].mu)) == {jnp.dtype(jnp.bfloat16)}


@pytest.mark.parametrize("rounding, bytes_per_param", [("nearest", 6), ("stochastic", 6), ("kahan", 8)])
def test_params_and_adam_state_take_half_the_bytes_of_float32_plus_the_kahan_buffer(
    rounding, bytes_per_param
):
    params = {"kernel": jnp.zeros((256, 256), jnp.bfloat16)}
    params32 = jax.tree.map(lambda p: p.astype(jnp.float32), params)
    float32_bytes = tree_bytes(params32) + tree_bytes(optax.adam(1e-3).init(params32))
    tx = jaxamp.low_precision_optimizer(optax.adam(1e-3), rounding=rounding)
    low_bytes = tree_bytes(params) + tree_bytes(tx.init(params))
    # 12 bytes per param in float32; the extra 12 bytes are the key (8) and Adam's count (4).
    assert float32_bytes == 12 * 256 * 256 + 4
    assert low_bytes == bytes_per_param * 256 * 256 + 12
    assert low_bytes / float32_bytes == pytest.approx(bytes_per_param / 12, abs=1e-4)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_stochastic_rounding_is_unbiased_between_two_neighbours_and_deterministic_for_a_key(dtype):
    low = jnp.asarray(1.0, dtype)
    high = jnp.nextafter(low, jnp.asarray(2.0, dtype))
    value = float(low) + 0.3 * (float(high) - float(low))  # 30% of the way up
    draws = stochastic_round(jnp.full((100_000,), value), dtype, jax.random.key(3))
    assert set(np.unique(np.asarray(draws.astype(jnp.float32)))) == {float(low), float(high)}
    fraction_up = float(jnp.mean(draws == high))
    standard_error = np.sqrt(0.3 * 0.7 / draws.size)
    assert abs(fraction_up - 0.3) < 4 * standard_error
    assert (stochastic_round(jnp.full((1000,), value), dtype, jax.random.key(3)) == draws[:1000]).all()
    assert not (stochastic_round(jnp.full((1000,), value), dtype, jax.random.key(4)) == draws[:1000]).all()


def test_float16_subnormals_round_stochastically_and_unbiased():
    """float16's subnormals (below 6.1e-5, steps of 6e-8) are float32 normals: the float32 arithmetic keeps them."""
    low = jnp.asarray(100 * 2.0**-24, jnp.float16)  # a subnormal: 100 of the smallest steps
    high = jnp.nextafter(low, jnp.asarray(1.0, jnp.float16))
    value = float(low) + 0.3 * (float(high) - float(low))
    draws = stochastic_round(jnp.full((100_000,), value), jnp.float16, jax.random.key(3))
    assert set(np.unique(np.asarray(draws.astype(jnp.float32)))) == {float(low), float(high)}
    assert abs(float(jnp.mean(draws == high)) - 0.3) < 4 * np.sqrt(0.3 * 0.7 / draws.size)


def test_a_bfloat16_subnormal_passed_in_rounds_stochastically_and_one_computed_on_the_cpu_is_zero():
    """bfloat16's subnormals are float32 subnormals. Rounded on the bits, one passed in rounds as any value
    does; XLA's CPU flushes float32 arithmetic that small to zero, so one computed there is 0 already."""
    low = jnp.asarray(3e-39, jnp.bfloat16)  # 2**-126 is 1.2e-38
    high = jnp.nextafter(low, jnp.asarray(1.0, jnp.bfloat16))
    value = float(low) + 0.3 * (float(high) - float(low))
    rounded = stochastic_round(jnp.full((100_000,), value), jnp.bfloat16, jax.random.key(3))
    values = np.asarray(rounded.astype(jnp.float32))  # compared in NumPy: XLA's CPU flushes them to zero
    assert set(np.unique(values)) == {float(low), float(high)}
    assert abs(np.mean(values == float(high)) - 0.3) < 4 * np.sqrt(0.3 * 0.7 / values.size)
    computed = jax.jit(lambda x, key: stochastic_round(x * 1e-19, jnp.bfloat16, key))(
        jnp.full((1000,), 3e-20), jax.random.key(3)
    )
    assert (computed.astype(jnp.float32) == 0.0).all()


def test_stochastic_rounding_keeps_representable_values_infinities_and_nans():
    values = jnp.array([1.0, -2.5, 0.0, jnp.inf, -jnp.inf, jnp.nan])
    rounded = stochastic_round(values, jnp.bfloat16, jax.random.key(0)).astype(jnp.float32)
    np.testing.assert_array_equal(rounded, values)


def add_tiny_updates(rounding, steps, update=1e-4, width=1000, tx=None):
    """`steps` additions of `update` to `width` bfloat16 ones, under jit (by `tx` where given)."""
    tx = tx or jaxamp.low_precision_optimizer(optax.sgd(update), rounding=rounding, key=7)
    params = jnp.ones((width,), jnp.bfloat16)

    def step(_, carry):
        params, opt_state = carry
        updates, opt_state = tx.update(-jnp.ones_like(params), opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    params, opt_state = jax.jit(lambda params: jax.lax.fori_loop(0, steps, step, (params, tx.init(params))))(
        params
    )
    return params.astype(jnp.float32), opt_state


def test_two_params_with_the_same_values_and_gradients_round_with_independent_draws():
    """Each leaf draws its own random numbers: one draw for all would round twin params alike and
    make their rounding errors add up instead of averaging out."""
    twin = jnp.full((4096,), 1.0, jnp.bfloat16)
    params = {"a": twin, "b": twin}
    tx = jaxamp.low_precision_optimizer(optax.sgd(1e-3), rounding="stochastic", key=0)
    grads = jax.tree.map(lambda p: jnp.full(p.shape, 1.0, jnp.float32), params)
    updates, _ = tx.update(grads, tx.init(params), params)
    new = optax.apply_updates(params, updates)
    assert not np.array_equal(np.asarray(new["a"]), np.asarray(new["b"]))


def test_one_update_below_half_an_ulp_is_lost_to_nearest_and_kept_in_kahans_buffer():
    """bfloat16's half ulp at 1.0 is 0.0039; 1e-4 cannot move the param, and Kahan keeps it for later."""
    nearest, _ = add_tiny_updates("nearest", steps=1)
    kahan, opt_state = add_tiny_updates("kahan", steps=1)
    assert (nearest == 1.0).all() and (kahan == 1.0).all()
    assert float(opt_state.compensation.astype(jnp.float32).mean()) == pytest.approx(1e-4, rel=1e-3)


def test_ten_thousand_tiny_updates_end_near_the_float32_sum_except_under_nearest_rounding():
    """10,000 steps of +1e-4 on 1.0: float32 ends at 2.0."""
    float32_sum = 1.0 + 10_000 * float(np.float32(1e-4))
    nearest, _ = add_tiny_updates("nearest", steps=10_000)
    assert (nearest == 1.0).all()
    stochastic, _ = add_tiny_updates("stochastic", steps=10_000)
    # Each param is a random walk (spread 0.09 over the 1000); their mean lands within 4 standard errors.
    assert float(stochastic.mean()) == pytest.approx(float32_sum, abs=0.012)
    kahan, _ = add_tiny_updates("kahan", steps=10_000)
    assert (kahan == 2.0).all()


def test_after_a_thousand_tiny_updates_kahan_holds_bfloat16s_nearest_to_the_float32_sum():
    kahan, opt_state = add_tiny_updates("kahan", steps=1000)
    assert (kahan == float(jnp.asarray(1.1, jnp.bfloat16))).all()  # 1.1015625
    total = kahan + opt_state.compensation.astype(jnp.float32)
    assert float(total.mean()) == pytest.approx(1.1, abs=2e-4)


def test_after_a_step_that_more_than_doubles_a_param_kahans_buffer_holds_where_it_landed():
    """Params from 1 to 200 become 2.7 p + 0.3 in one SGD step. ``new_p - p`` is then not exact in
    bfloat16 for some of them, so ``optax.apply_updates`` lands them a bfloat16 ulp (up to 2.0 at
    these sizes) from the nearest value; the buffer must carry what was lost from where the param
    really landed, so that param + buffer is the float32 sum within the buffer's own rounding."""
    params = jnp.linspace(1.0, 200.0, 4096).astype(jnp.bfloat16)
    exact = 2.7 * params.astype(jnp.float32) + 0.3
    grads = params.astype(jnp.float32) - exact  # SGD(1.0) adds -grads
    tx = jaxamp.low_precision_optimizer(optax.sgd(1.0), rounding="kahan", key=0)
    updates, opt_state = tx.update(grads, tx.init(params), params)
    landed = optax.apply_updates(params, updates).astype(jnp.float32)
    nearest = exact.astype(jnp.bfloat16).astype(jnp.float32)
    assert float(jnp.max(jnp.abs(landed - nearest))) == 2.0, "the scenario: some params land an ulp off"
    total = landed + opt_state.compensation.astype(jnp.float32)
    # The buffer is at most an ulp of the param (2.0): bfloat16 holds it within 2**-7 of itself.
    assert float(jnp.max(jnp.abs(total - exact))) < 0.02


@pytest.mark.parametrize("rounding", ROUNDINGS)
def test_a_skipped_step_leaves_params_moments_buffer_and_key_bit_identical(rounding):
    tx = jaxamp.low_precision_optimizer(optax.adam(1e-2), rounding=rounding)
    before, _ = train(tx, bf16_params(), steps=2)
    state, _ = train(tx, bf16_params(), steps=3, poison_at=(2,))
    assert int(state.skipped_steps) == 1
    assert int(state.step) == 2
    leaves = jax.tree.leaves((state.params, state.opt_state))
    # The run with its third step skipped holds exactly the state of two clean steps.
    for kept, expected in zip(leaves, jax.tree.leaves((before.params, before.opt_state)), strict=True):
        assert kept.dtype == expected.dtype
        assert np.asarray(kept).tobytes() == np.asarray(expected).tobytes()
    assert isinstance(state.opt_state, LowPrecisionState)


@pytest.mark.parametrize("rounding", ROUNDINGS)
def test_a_resumed_run_is_bit_exact_against_an_uninterrupted_one(rounding):
    tx = jaxamp.low_precision_optimizer(optax.adam(1e-2), rounding=rounding, key=jax.random.key(5))
    whole, _ = train(tx, bf16_params(), steps=6)
    half, _ = train(tx, bf16_params(), steps=3)
    # A checkpoint: every leaf to NumPy and back.
    params, opt_state = jax.tree.map(
        lambda leaf: jnp.asarray(np.asarray(leaf)), (half.params, half.opt_state)
    )
    resumed = jaxamp.TrainState.create(
        apply_fn=None, params=params, tx=tx, loss_scale=jaxamp.DynamicLossScale()
    )
    resumed = resumed.replace(opt_state=opt_state)
    resumed, _ = _continue(resumed, steps=3)
    for got, expected in zip(
        jax.tree.leaves((resumed.params, resumed.opt_state)),
        jax.tree.leaves((whole.params, whole.opt_state)),
        strict=True,
    ):
        assert np.asarray(got).tobytes() == np.asarray(expected).tobytes()


def test_a_key_of_another_implementation_than_the_default_stays_that_implementation_through_updates():
    """An "rbg" key's data is 4 words, the default's 2: update must not rewrap it as the default."""
    rbg = jax.random.key(5, impl="rbg")
    tx = jaxamp.low_precision_optimizer(optax.adam(1e-2), key=rbg)
    state, losses = train(tx, bf16_params(), steps=3)
    assert losses[-1] < losses[0]
    expected = rbg
    for _ in range(3):
        expected = jax.random.split(expected, 3)[0]
    assert np.asarray(state.opt_state.key).tobytes() == np.asarray(jax.random.key_data(expected)).tobytes()
    threefry, _ = train(jaxamp.low_precision_optimizer(optax.adam(1e-2), key=5), bf16_params(), steps=3)
    assert state.opt_state.key.shape == (4,) and threefry.opt_state.key.shape == (2,)


def _continue(state, steps):
    @jax.jit
    def train_step(state):
        loss, grads, grads_finite = jaxamp.scaled_value_and_grad(mse, state.loss_scale)(state.params)
        return state.apply_gradients(grads=grads, grads_finite=grads_finite), loss

    for _ in range(steps):
        state, loss = train_step(state)
    return state, loss


def test_the_state_passes_through_jit_tree_map_and_lower():
    tx = jaxamp.low_precision_optimizer(optax.adam(1e-3), rounding="kahan")
    params = bf16_params()
    opt_state = jax.jit(tx.init)(params)
    assert isinstance(opt_state, LowPrecisionState)
    assert jax.tree.structure(jax.tree.map(lambda leaf: leaf, opt_state)) == jax.tree.structure(opt_state)
    grads = jax.tree.map(jnp.ones_like, params)
    lowered = jax.jit(tx.update).lower(grads, opt_state, params)
    assert "stablehlo" in lowered.as_text() or "func" in lowered.as_text()
    abstract = jax.eval_shape(tx.update, grads, opt_state, params)[1]
    assert dtypes(abstract) == dtypes(opt_state)


OPTIMIZERS = {
    "scale_by_adam": optax.chain(optax.scale_by_adam(), optax.scale(-0.05)),
    "adamw": optax.adamw(0.05, weight_decay=1e-4),
    "lion": optax.lion(0.03),
    "sgd momentum": optax.sgd(0.05, momentum=0.9),
    "adafactor": optax.adafactor(0.05),
    "MultiSteps adam": optax.MultiSteps(optax.adam(0.05), every_k_schedule=2),
}


@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_every_optimizer_trains_with_bfloat16_state_and_params(name, rounding):
    tx = jaxamp.low_precision_optimizer(OPTIMIZERS[name], rounding=rounding)
    state, losses = train(tx, bf16_params(), steps=40)
    assert losses[-1] < 0.5 * losses[0], losses
    floating = [
        leaf
        for leaf in jax.tree.leaves(state.opt_state.inner_state)
        if jnp.issubdtype(leaf.dtype, jnp.floating)
    ]
    assert floating and {leaf.dtype for leaf in floating} == {jnp.dtype(jnp.bfloat16)}
    assert set(dtypes(state.params)) == {jnp.dtype(jnp.bfloat16)}


def test_mixed_param_dtypes_need_param_dtype_none():
    params = {"kernel": jnp.ones((2, 2), jnp.bfloat16), "scale": jnp.ones((2,), jnp.float32)}
    with pytest.raises(ValueError, match=r"\['scale'\] is float32.*param_dtype=None"):
        jaxamp.low_precision_optimizer(optax.adam(1e-3)).init(params)
    tx = jaxamp.low_precision_optimizer(optax.adam(1e-3), param_dtype=None, rounding="kahan")
    updates, opt_state = tx.update(jax.tree.map(jnp.ones_like, params), tx.init(params), params)
    assert dtypes(updates) == dtypes(params) == dtypes(opt_state.compensation)


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"rounding": "round"}, r"rounding must be one of 'nearest', 'stochastic', 'kahan'; got 'round'"),
        ({"param_dtype": jnp.int8}, r"param_dtype must be a floating dtype such as jnp.bfloat16.*int8"),
        ({"state_dtype": "bf16"}, r"state_dtype must be a floating dtype.*'bf16'"),
        ({"state_dtype": {"m": jnp.bfloat16}}, r"names 'm', which .* fields are 'count', 'mu', 'nu'"),
        ({"state_dtype": lambda path, leaf: jnp.int32}, r"state_dtype \(at .*\) must be a floating dtype"),
        ({"key": 1.5}, r"key must be a PRNG key \(jax.random.key\(0\), of any implementation\), the raw uint32 data"),
        ({"key": jnp.zeros(4, jnp.uint32)}, r"raw uint32 data of a key of the default implementation.*uint32"),
        ({"key": jnp.zeros((3, 2), jnp.uint32)}, r"or an int seed; got Array\(\[\[0, 0\]"),
    ],
)
def test_bad_settings_name_the_valid_choices(settings, message):
    with pytest.raises(ValueError, match=message):
        jaxamp.low_precision_optimizer(optax.scale_by_adam(), **settings).init(bf16_params())


def test_update_without_params_and_a_non_optimizer_say_what_is_needed():
    tx = jaxamp.low_precision_optimizer(optax.adam(1e-3))
    params = bf16_params()
    with pytest.raises(ValueError, match=r"needs the params"):
        tx.update(params, tx.init(params))
    with pytest.raises(TypeError, match="needs inner to be an optax optimizer"):
        jaxamp.low_precision_optimizer("adam")


# --- policies that name the rounding ---------------------------------------------


@pytest.mark.parametrize("rounding", ROUNDINGS)
def test_the_rounding_a_policy_names_is_the_one_that_lands_the_updates(rounding):
    """bfloat16_<rounding> builds the wrapper with that rounding: a thousand steps of +1e-4 end bit for
    bit where the wrapper built by hand ends, which differs by rounding (1.0, about 1.1, 1.1015625)."""
    tx = jaxamp.optimizer_for_policy(optax.sgd(1e-4), f"bfloat16_{rounding}", key=7)
    by_policy = add_tiny_updates(rounding, steps=1000, tx=tx)
    by_hand = add_tiny_updates(rounding, steps=1000)
    for leaf, expected in zip(jax.tree.leaves(by_policy), jax.tree.leaves(by_hand), strict=True):
        assert leaf.dtype == expected.dtype
        assert np.asarray(leaf).tobytes() == np.asarray(expected).tobytes()
    params, opt_state = by_policy
    assert (opt_state.compensation is not None) == (rounding == "kahan")
    expected_mean = {"nearest": 1.0, "stochastic": 1.1, "kahan": 1.1015625}[rounding]
    assert float(params.mean()) == pytest.approx(expected_mean, abs=0.005)


@pytest.mark.parametrize(
    "spec, dtype",
    [("bfloat16_stochastic", jnp.bfloat16), ("bf16_kahan", jnp.bfloat16), ("p=f16,u=kahan", jnp.float16)],
)
def test_a_policy_with_an_update_rounding_stores_params_and_adam_state_in_its_param_dtype(spec, dtype):
    tx = jaxamp.optimizer_for_policy(optax.adam(1e-3), spec)
    params = jax.tree.map(lambda p: p.astype(dtype), bf16_params())
    state, _ = train(tx, params, steps=2)
    adam_state = state.opt_state.inner_state[0]  # optax.adam: scale_by_adam's state, then the schedule's
    assert set(dtypes((state.params, adam_state.mu, adam_state.nu))) == {jnp.dtype(dtype)}
    if jaxamp.split_precision(spec)[1].rounding == "kahan":
        assert set(dtypes(state.opt_state.compensation)) == {jnp.dtype(dtype)}


@pytest.mark.parametrize("spec", ["mixed_bf16", "fp32", jaxamp.get_policy("mixed")])
def test_a_policy_with_float32_params_and_no_update_rounding_leaves_the_optimizer_as_it_is(spec):
    inner = optax.adam(1e-3)
    assert jaxamp.optimizer_for_policy(inner, spec) is inner


def test_a_bad_policy_for_the_optimizer_names_the_valid_roundings():
    with pytest.raises(
        ValueError, match=r"Unknown update rounding 'sr' .* Valid: nearest, stochastic, kahan"
    ):
        jaxamp.optimizer_for_policy(optax.adam(1e-3), "p=bf16,update=sr")


# --- 8 virtual CPU devices -------------------------------------------------------

SHARDED = FreshProcess("sharded_run", "tests/low_precision_sharded_run.py", env={"XLA_FLAGS": xla_flags()})


@pytest.fixture(scope="module")
def sharded_run():
    return SHARDED.last_json_line()


@pytest.mark.parametrize("rounding", ["stochastic", "kahan"])
def test_on_eight_devices_the_buffers_shard_like_the_params_and_the_steps_match_one_device(
    sharded_run, rounding
):
    """Five Adam steps with the state placed by jaxamp.fsdp.fsdp_shardings (tests/low_precision_sharded_run.py).

    With gradients that need no cross-device sum, params, moments, buffer and
    key match one device bit for bit: the stochastic rounding draws the same
    numbers however the arrays are split.
    """
    run = sharded_run[rounding]
    assert sharded_run["devices"] == 8
    assert run["param_specs"] == ["P('data',)", "P(None, 'data')", "P('data',)"]
    assert all(run["buffers_sharded_like_params"].values()), run["buffers_sharded_like_params"]
    expected = {"mu", "nu", "compensation"} if rounding == "kahan" else {"mu", "nu"}
    assert run["buffer_dtypes"] == {name: ["bfloat16"] for name in expected}
    assert run["state_bit_identical"]
    assert run["params_changed"] > 0.9


@pytest.mark.parametrize("rounding", ["stochastic", "kahan"])
def test_through_fsdp_loss_the_sharded_run_is_as_close_to_one_device_as_optax_on_bfloat16_params(
    sharded_run, rounding
):
    """Summed in another order, bfloat16 gradients differ in their last bits; Adam turns that into
    a difference of about 2% of the largest param after five steps, with or without the wrapper."""
    run = sharded_run[rounding]
    assert (
        run["mlp_params_max_relative_difference"]
        <= 2 * sharded_run["optax_adam_bfloat16_mlp_params_max_relative_difference"]
    )
    assert sharded_run["optax_adam_float32_mlp_params_max_relative_difference"] < 1e-6
    assert max(run["mlp_loss_after"]) < 0.5 * sharded_run["loss_before"]


@pytest.mark.parametrize("state_format", ["int8", "float8_e4m3fn"])
def test_on_eight_devices_8_bit_moments_split_by_whole_blocks_and_the_steps_match_one_device(
    sharded_run, state_format
):
    """Adam with both moments in 8 bits, placed by jaxamp.fsdp.fsdp_shardings (and kept there by the
    step's out_shardings, as an FSDP loop does): kernels of 64 x 256 and 256 x 64, 64 blocks of 256
    each. Their codes split along the first dimension, so every device holds 8 whole blocks of each and
    exactly those blocks' scales after five jitted steps; params and state match one device bit for bit."""
    run = sharded_run[state_format]
    assert run["quantized_leaves"] == 4  # mu and nu of both kernels; the bias is too small
    assert run["codes_specs"] == ["P('data',)"] and run["scales_specs"] == ["P('data',)"]
    assert run["rows_per_device"] == [8, 32]
    assert run["blocks_whole_on_each_device"]
    assert run["state_bit_identical"]
    assert run["params_changed"] > 0.9
    # On a (4, 2) mesh a leaf splits over the named axis's 4 devices, not over all 8.
    assert sharded_run["two_axis_mesh_quantized_specs"] == ["P('data',)", "P('data',)"]


@pytest.mark.parametrize("state_format", ["int8", "float8_e4m3fn"])
def test_on_eight_devices_8_bit_moments_with_a_scale_per_leaf_split_their_codes_and_match_one_device(
    sharded_run, state_format
):
    """The same five steps with one scale per leaf (``block_size=None``, the ``_per_tensor`` precisions):
    fsdp_shardings splits each moment's codes by rows as it splits the params (8 and 32 rows a device),
    its one scale on every device, where it kept the whole leaf on every device before; params and
    state match one device bit for bit (the leaf's largest magnitude is a max over the devices)."""
    run = sharded_run[f"{state_format}_per_tensor"]
    assert run["quantized_leaves"] == 4
    assert run["codes_specs"] == ["P('data',)"] and run["scales_specs"] == ["P(None,)"]
    assert run["rows_per_device"] == [8, 32]
    assert run["state_bit_identical"]
    assert run["params_changed"] > 0.9


@pytest.mark.parametrize("state_format", ["int8", "float8_e4m3fn"])
def test_on_a_mesh_of_explicit_axes_8_bit_moments_lie_by_whole_blocks_and_the_steps_match_one_device(
    sharded_run, state_format
):
    """Under `jax.set_mesh` of an explicit axis, where JAX types each array by its sharding: the same
    five steps match one device bit for bit, the codes split by whole blocks along the first dimension;
    a kernel sharded by columns gets its moments laid out so; one with 4 rows for 8 devices is refused
    with what to change."""
    run = sharded_run[f"{state_format}_explicit"]
    assert run["quantized_leaves"] == 4
    assert run["codes_specs"] == ["P('data',)"] and run["scales_specs"] == ["P('data',)"]
    assert run["blocks_whole_on_each_device"]
    assert run["state_bit_identical"]
    assert run["column_sharded_codes_spec"] == "P('data', None)" and run["column_sharded_blocks_whole"]
    assert "first dimension 4, 8 devices" in run["too_few_rows_refused"]
    assert "keep this leaf's state in bfloat16" in run["too_few_rows_refused"]


@pytest.mark.parametrize("state_format", ["int8", "float8_e4m3fn"])
def test_on_explicit_meshes_of_other_shapes_8_bit_moments_still_lie_by_whole_blocks(sharded_run, state_format):
    """One block per leaf on row-sharded params (its scale on every device); a kernel split over two
    explicit axes, one per dimension (both axes go to the first); a kernel sharded by columns over
    the explicit axis of a mesh that also has an automatic one: two steps match one device bit for
    bit. A kernel whose one row per device splits a block (640 elements, blocks of 256) is refused."""
    run = sharded_run[f"{state_format}_explicit"]
    assert run["one_block_by_rows"] == {"codes_spec": "P('data', None)", "scales_spec": "P(None,)", "bit_identical": True}
    assert run["two_axes_one_on_each_dimension"] == {
        "codes_spec": "P(('x', 'y'), None)", "scales_spec": "P(('x', 'y'),)", "bit_identical": True
    }
    assert run["explicit_and_auto_axes_by_columns"] == {
        "codes_spec": "P('e', None)", "scales_spec": "P('e',)", "bit_identical": True
    }
    # Compiled ahead of time outside jax.set_mesh (its layouts resharded by NamedSharding, not by spec).
    assert run["compiled_without_set_mesh"] == {
        "by_columns": ["P('data', None)", "P('data',)"], "one_block_by_rows": ["P('data', None)", "P(None,)"]
    }
    # Two rows split over the explicit axis's 2 devices, though not over the mesh's 8.
    assert run["explicit_and_auto_axes_two_rows"] == {
        "codes_spec": "P('e', None)", "scales_spec": "P('e',)", "bit_identical": True
    }
    assert "first dimension 8, 8 devices" in run["block_split_by_a_shard_refused"]
