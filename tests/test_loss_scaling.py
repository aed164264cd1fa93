"""`jaxamp.loss_scaling`: the whole-step skip around any optax optimizer, for any framework."""

import functools
import re

import equinox as eqx
import haiku as hk
import jax
import jax.numpy as jnp
import jmp
import numpy as np
import optax
import pytest
from test_train_state import primitives

import jaxamp

POLICY = jaxamp.get_policy("mixed_float16")
INPUTS = jax.random.normal(jax.random.key(1), (16, 4))
TARGETS = jnp.sum(INPUTS, axis=1, keepdims=True)
CLEAN, INF, NAN = 1.0, float("inf"), float("nan")


def equinox_model():
    """A tiny Equinox MLP, split into its float32 arrays and the static rest."""
    model = eqx.nn.MLP(in_size=4, out_size=1, width_size=16, depth=1, key=jax.random.key(0))
    return eqx.partition(model, eqx.is_inexact_array)


PARAMS, STATIC = equinox_model()


def mse(params, inputs, targets):
    model = eqx.combine(params, STATIC)
    return jnp.mean((jax.vmap(model)(inputs) - targets) ** 2)


HALF_MSE = jaxamp.autocast(mse, POLICY)


def make_train_step(tx, loss_fn=HALF_MSE):
    """A jitted step of `tx`, and the list it appends to each time it is traced.

    The step multiplies every gradient by `poison`: 1.0 leaves them alone, inf
    or NaN makes them non-finite, as an overflow would.
    """
    traces = []

    @jax.jit
    def train_step(params, opt_state, poison):
        traces.append(None)
        loss, grads, grads_finite = jaxamp.scaled_value_and_grad(loss_fn, jaxamp.loss_scale_of(opt_state))(
            params, INPUTS, TARGETS
        )
        grads = jax.tree.map(lambda grad: grad * poison, grads)
        grads_finite = grads_finite & jaxamp.all_finite(grads)
        updates, opt_state = tx.update(grads, opt_state, params, grads_finite=grads_finite)
        return optax.apply_updates(params, updates), opt_state, loss

    return train_step, traces


@functools.cache
def adam_step():
    tx = jaxamp.loss_scaling(optax.adam(3e-2), jaxamp.DynamicLossScale(2.0**10, period=3))
    return tx, make_train_step(tx)[0]


def assert_bit_identical(actual, expected):
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    for got, want in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        got, want = np.asarray(got), np.asarray(want)
        assert (got.dtype, got.shape, got.tobytes()) == (want.dtype, want.shape, want.tobytes())


def trees_differ(first, second):
    return any(
        not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(second), strict=True)
    )


def test_an_equinox_model_trains_in_float16_with_float32_params():
    tx, train_step = adam_step()
    report = jaxamp.precision_report(jax.grad(HALF_MSE), PARAMS, INPUTS, TARGETS)
    assert report.fraction(jnp.float16) == 1.0 and len(report.ops) == 5  # 2 forward, 3 backward

    params, opt_state, losses = PARAMS, tx.init(PARAMS), []
    for _ in range(8):
        params, opt_state, loss = train_step(params, opt_state, CLEAN)
        losses.append(float(loss))
    assert losses[-1] < 0.5 * losses[0] and losses == sorted(losses, reverse=True)
    assert {leaf.dtype for leaf in jax.tree.leaves(params)} == {jnp.dtype(jnp.float32)}
    assert int(jaxamp.loss_scale_of(opt_state).skipped_steps) == 0
    assert int(opt_state.inner_state[0].count) == 8


@pytest.mark.parametrize("poison", [INF, NAN], ids=["inf", "nan"])
def test_a_non_finite_gradient_leaves_params_and_optimizer_state_untouched_and_halves_the_scale(poison):
    tx, train_step = adam_step()
    params, opt_state, _ = train_step(PARAMS, tx.init(PARAMS), CLEAN)

    skipped_params, skipped_state, _ = train_step(params, opt_state, poison)

    assert_bit_identical(skipped_params, params)
    assert_bit_identical(skipped_state.inner_state, opt_state.inner_state)  # moments and adam's count
    assert int(skipped_state.inner_state[0].count) == 1
    scale = jaxamp.loss_scale_of(skipped_state)
    assert float(scale.loss_scale) == 2.0**9
    assert (int(scale.skipped_steps), int(scale.consecutive_skipped_steps), int(scale.counter)) == (1, 1, 0)

    # The next finite step trains again, from where the skipped one left off.
    stepped_params, stepped_state, _ = train_step(skipped_params, skipped_state, CLEAN)
    assert trees_differ(stepped_params, params)
    assert int(stepped_state.inner_state[0].count) == 2
    assert int(jaxamp.loss_scale_of(stepped_state).consecutive_skipped_steps) == 0


def test_finite_steps_grow_the_scale_after_the_period_and_the_jitted_step_traces_once():
    tx = jaxamp.loss_scaling(optax.sgd(0.05), jaxamp.DynamicLossScale(2.0**10, period=2))
    train_step, traces = make_train_step(tx)
    params, opt_state = PARAMS, tx.init(PARAMS)
    scales = []
    for poison in [CLEAN, CLEAN, CLEAN, INF, CLEAN, CLEAN]:
        params, opt_state, _ = train_step(params, opt_state, jnp.float32(poison))
        scales.append(float(jaxamp.loss_scale_of(opt_state).loss_scale))
    assert scales == [2.0**10, 2.0**11, 2.0**11, 2.0**10, 2.0**10, 2.0**11]
    assert len(traces) == 1
    assert int(jaxamp.loss_scale_of(opt_state).skipped_steps) == 1


def test_the_state_survives_jit_tree_map_and_lower():
    tx = jaxamp.loss_scaling(optax.adam(1e-3), jaxamp.DynamicLossScale(2.0**10, period=7, min_loss_scale=4))
    opt_state = tx.init(PARAMS)
    for survivor in [
        jax.jit(lambda state: state)(opt_state),
        jax.tree.map(lambda leaf: leaf, opt_state),
        jax.jit(lambda state: state).lower(opt_state).compile()(opt_state),
    ]:
        assert type(survivor) is jaxamp.LossScalingState
        assert_bit_identical(survivor, opt_state)
        assert (survivor.loss_scale.period, survivor.loss_scale.min_loss_scale) == (7, 4)

    update = jax.jit(lambda grads, state, params: tx.update(grads, state, params))
    abstract = jax.tree.map(
        lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype), (PARAMS, opt_state, PARAMS)
    )
    compiled = update.lower(*abstract).compile()
    _, stepped = compiled(jax.tree.map(jnp.ones_like, PARAMS), opt_state, PARAMS)
    assert int(stepped.inner_state[0].count) == 1


def test_skipping_is_a_select_with_no_branch_and_no_host_callback():
    tx = jaxamp.loss_scaling(optax.adam(1e-3), jaxamp.DynamicLossScale())
    jaxpr = jax.make_jaxpr(lambda grads, state, params: tx.update(grads, state, params))(
        PARAMS, tx.init(PARAMS), PARAMS
    )
    used = primitives(jaxpr.jaxpr)
    assert "select_n" in used
    assert not used & {"cond", "while", "pure_callback", "io_callback", "debug_callback"}


def test_a_skipped_step_keeps_even_negative_zero_params_bit_for_bit():
    params = {"w": jnp.array([-0.0, 0.0, 1.5, -2.0])}
    tx = jaxamp.loss_scaling(optax.sgd(0.1), jaxamp.StaticLossScale(8.0))
    updates, opt_state = tx.update({"w": jnp.full(4, jnp.nan)}, tx.init(params), params)
    assert_bit_identical(optax.apply_updates(params, updates), params)
    assert int(opt_state.loss_scale.skipped_steps) == 1 and float(opt_state.loss_scale.loss_scale) == 8.0


def test_grads_finite_given_by_the_caller_decides_the_skip():
    params = {"w": jnp.ones(3)}
    tx = jaxamp.loss_scaling(optax.sgd(0.5), jaxamp.DynamicLossScale(8.0))
    # Finite gradients, but the caller's own check (a NaN loss, say) failed.
    updates, opt_state = tx.update({"w": jnp.ones(3)}, tx.init(params), params, grads_finite=jnp.array(False))
    assert_bit_identical(optax.apply_updates(params, updates), params)
    assert float(opt_state.loss_scale.loss_scale) == 4.0
    # Without the argument, the wrapper checks the gradients itself.
    updates, opt_state = tx.update({"w": jnp.ones(3)}, opt_state, params)
    np.testing.assert_array_equal(optax.apply_updates(params, updates)["w"], [0.5, 0.5, 0.5])


def test_an_overflow_never_reaches_the_accumulator_of_multisteps_inside():
    params = {"w": jnp.ones(3)}
    tx = jaxamp.loss_scaling(optax.MultiSteps(optax.sgd(0.1), every_k_schedule=2), jaxamp.DynamicLossScale())
    _, opt_state = tx.update({"w": jnp.ones(3)}, tx.init(params), params)
    _, skipped = tx.update({"w": jnp.full(3, jnp.inf)}, opt_state, params)
    assert_bit_identical(skipped.inner_state, opt_state.inner_state)
    updates, _ = tx.update({"w": jnp.ones(3)}, skipped, params)
    np.testing.assert_allclose(optax.apply_updates(params, updates)["w"], [0.9, 0.9, 0.9], rtol=1e-6)


def test_loss_scale_of_finds_the_state_inside_a_chain_and_names_the_fix_when_there_is_none():
    tx = optax.chain(
        optax.clip_by_global_norm(1.0), jaxamp.loss_scaling(optax.sgd(0.1), jaxamp.StaticLossScale(4.0))
    )
    opt_state = tx.init(PARAMS)
    assert float(jaxamp.loss_scale_of(opt_state).loss_scale) == 4.0
    updates, opt_state = tx.update(
        jax.tree.map(lambda p: jnp.full_like(p, jnp.inf), PARAMS), opt_state, PARAMS
    )
    assert int(jaxamp.loss_scale_of(opt_state).skipped_steps) == 1

    with pytest.raises(ValueError, match=r"holds 0\. Build the optimizer as jaxamp\.loss_scaling"):
        jaxamp.loss_scale_of(optax.adam(1e-3).init(PARAMS))


def test_a_plain_jax_and_a_haiku_model_take_the_same_skip():
    net = hk.without_apply_rng(hk.transform(lambda x: hk.nets.MLP([8, 1])(x)))
    haiku_params = net.init(jax.random.key(0), INPUTS)
    haiku_loss = jaxamp.autocast(lambda params, x, y: jnp.mean((net.apply(params, x) - y) ** 2), POLICY)
    plain_params = {"w": jnp.zeros((4, 1))}
    plain_loss = jaxamp.autocast(lambda params, x, y: jnp.mean((x @ params["w"] - y) ** 2), POLICY)

    for params, loss_fn in [(haiku_params, haiku_loss), (plain_params, plain_loss)]:
        tx = jaxamp.loss_scaling(optax.adam(1e-2), jaxamp.DynamicLossScale(2.0**10))
        train_step, _ = make_train_step(tx, loss_fn)
        trained, opt_state, first_loss = train_step(params, tx.init(params), CLEAN)
        skipped, skipped_state, _ = train_step(trained, opt_state, INF)
        assert_bit_identical(skipped, trained)
        assert_bit_identical(skipped_state.inner_state, opt_state.inner_state)
        assert float(skipped_state.loss_scale.loss_scale) == 2.0**9
        for _ in range(5):
            skipped, skipped_state, loss = train_step(skipped, skipped_state, CLEAN)
        assert float(loss) < float(first_loss)


@pytest.mark.parametrize(
    "build",
    [
        lambda scale: jaxamp.loss_scaling(optax.sgd(0.1), scale),
        lambda scale: jaxamp.TrainState.create(
            apply_fn=None, params={"w": jnp.ones(2)}, tx=optax.sgd(0.1), loss_scale=scale
        ),
    ],
    ids=["loss_scaling", "TrainState.create"],
)
def test_a_loss_scale_that_counts_no_skipped_steps_is_refused_with_the_jaxamp_equivalent(build):
    with pytest.raises(
        TypeError, match=re.escape("jaxamp.DynamicLossScale(scale.loss_scale, period=scale.period)")
    ):
        build(jmp.DynamicLossScale(jnp.float32(2.0**10)))


def test_an_inner_that_is_no_optimizer_is_named():
    with pytest.raises(
        TypeError, match=r"^loss_scaling needs inner to be an optax optimizer .*got 'adam'\.$"
    ):
        jaxamp.loss_scaling("adam", jaxamp.DynamicLossScale())


def test_the_train_state_and_the_wrapper_skip_alike():
    # TrainState is a thin layer over loss_scaling: the same grads give the same params and state.
    params = {"w": jnp.array([1.0, -2.0, 3.0])}
    state = jaxamp.TrainState.create(
        apply_fn=None, params=params, tx=optax.adam(0.1), loss_scale=jaxamp.DynamicLossScale(8.0)
    )
    tx = jaxamp.loss_scaling(optax.adam(0.1), jaxamp.DynamicLossScale(8.0))
    opt_state = tx.init(params)
    for value in [1.0, jnp.inf, 0.5, jnp.nan, 2.0]:
        grads = {"w": jnp.full(3, value)}
        state = state.apply_gradients(grads=grads)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
    assert_bit_identical(state.params, params)
    assert_bit_identical((state.opt_state, state.loss_scale), (opt_state.inner_state, opt_state.loss_scale))
    assert (int(state.step), int(state.skipped_steps)) == (3, 2)
