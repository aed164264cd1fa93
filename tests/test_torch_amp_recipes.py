"""The recipes of docs/guides/from-torch-amp.md and gradient-penalty.md, step by step: each claim, checked.

The page's blocks print their figures (tests/test_docs.py compares them);
these scenarios assert the claims behind them at every step: the clip sees
only unscaled, finite gradients on the steps that are applied; an optax
accumulator never takes an overflowed micro-batch; a gradient penalty through
the loss scale tracks float32, and without it underflows; in the GAN each
train state skips on its own gradients; a custom VJP under `float32_scope`
runs its forward and backward matmuls in float32.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxamp

MIXED = "mixed_float16"


def mlp(params, x):
    h = jax.nn.relu(x @ params["w1"] + params["b1"])
    return h @ params["w2"] + params["b2"]


def classification_loss(params, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(mlp(params, x), y).mean()


def classification_problem():
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    params = {"w1": jax.random.normal(k1, (16, 32)) / 4, "b1": jnp.zeros(32),
              "w2": jax.random.normal(k2, (32, 4)) / 32**0.5, "b2": jnp.zeros(4)}  # fmt: skip
    return params, jax.random.normal(k3, (8, 16)), jnp.arange(8) % 4


def make_train_step(policy):
    policy_loss = jaxamp.autocast(classification_loss, policy)

    @jax.jit
    def train_step(state, x, y):
        loss, grads, grads_finite = jaxamp.scaled_value_and_grad(policy_loss, state.loss_scale)(
            state.params, x, y
        )
        return state.apply_gradients(grads=grads, grads_finite=grads_finite), loss

    return train_step


def same_tree(a, b):
    return all(jax.tree.leaves(jax.tree.map(np.array_equal, a, b)))


# Clipping


class WhatTheClipSaw(NamedTuple):
    """The state of `record_what_the_clip_sees`: the gradients of the last step it was updated on."""

    global_norm: jax.Array
    finite: jax.Array
    updates_seen: jax.Array


def record_what_the_clip_sees() -> optax.GradientTransformation:
    """An identity transformation that keeps, in its state, what the next one in the chain is given."""

    def init(params):
        del params
        return WhatTheClipSaw(jnp.zeros([]), jnp.array(True), jnp.zeros([], jnp.int32))

    def update(updates, state, params=None):
        del params
        return updates, WhatTheClipSaw(
            optax.tree.norm(updates), jaxamp.all_finite(updates), state.updates_seen + 1
        )

    return optax.GradientTransformation(init, update)


@pytest.mark.parametrize(
    "clip", [optax.clip_by_global_norm(0.5), optax.clip(0.05)], ids=["by_global_norm", "by_value"]
)
def test_the_clip_sees_only_unscaled_finite_gradients_and_an_overflowed_step_never_reaches_it(clip):
    params, x, y = classification_problem()
    tx = optax.chain(record_what_the_clip_sees(), clip, optax.adam(1e-2))
    state = jaxamp.TrainState.create(
        apply_fn=None, params=params, tx=tx, loss_scale=jaxamp.DynamicLossScale()
    )
    train_step = make_train_step(MIXED)
    bad_x = x.at[0, 0].set(jnp.inf)

    for batch in [x, x, bad_x, x, bad_x, x]:
        before = state
        state, _ = train_step(state, batch, y)
        seen = state.opt_state[0]
        applied = int(state.step) > int(before.step)
        # The recorder's state is kept on a skipped step, so it has counted applied steps only.
        assert int(seen.updates_seen) == int(state.step)
        assert bool(seen.finite)
        if applied:
            float32_norm = optax.tree.norm(jax.grad(classification_loss)(before.params, batch, y))
            # Unscaled: float32's norm to float16's rounding, not 32768 times it.
            np.testing.assert_allclose(float(seen.global_norm), float(float32_norm), rtol=2e-3)
        else:
            assert not np.all(np.isfinite(batch))
            assert same_tree(state.params, before.params)
            assert same_tree(state.opt_state, before.opt_state)
            assert float(state.loss_scale.loss_scale) == float(before.loss_scale.loss_scale) / 2
    assert (int(state.step), int(state.skipped_steps)) == (4, 2)


# Accumulation


def test_an_overflowed_micro_batch_never_reaches_the_accumulator_and_four_finite_ones_make_the_big_batch_step():
    params, x, y = classification_problem()
    bad_x = x.at[0, 0].set(jnp.inf)
    micro_batches = [
        (x[0:2], y[0:2]),
        (x[2:4], y[2:4]),
        (bad_x[0:2], y[0:2]),
        (x[4:6], y[4:6]),
        (x[6:8], y[6:8]),
    ]
    tx = optax.MultiSteps(optax.sgd(0.1), every_k_schedule=4)
    state = jaxamp.TrainState.create(
        apply_fn=None, params=params, tx=tx, loss_scale=jaxamp.DynamicLossScale()
    )
    train_step = make_train_step(MIXED)

    for index, (batch_x, batch_y) in enumerate(micro_batches):
        before = state
        state, _ = train_step(state, batch_x, batch_y)
        assert jaxamp.all_finite(state.opt_state.acc_grads)
        if index == 2:  # the overflowed one: the accumulator and its count as they were
            assert same_tree(state.opt_state, before.opt_state)
            assert float(state.loss_scale.loss_scale) == 2.0**14
    assert int(state.opt_state.gradient_step) == 1
    assert int(state.skipped_steps) == 1

    full_batch_grads = jax.grad(classification_loss)(params, x, y)
    expected = jax.tree.map(lambda p, g: p - 0.1 * g, params, full_batch_grads)
    assert not same_tree(state.params, params)
    for leaf, expected_leaf in zip(jax.tree.leaves(state.params), jax.tree.leaves(expected)):
        np.testing.assert_allclose(leaf, expected_leaf, atol=1e-4)


# Gradient penalty


def critic(params, x):
    h = jnp.tanh(x @ params["w1"])
    h = jnp.tanh(h @ params["w2"])
    return (h @ params["w3"])[:, 0]


HALF_CRITIC = jaxamp.autocast(critic, MIXED)


def input_grads(critic, params, x, loss_scale=None):
    critic_sum = lambda x: critic(params, x).sum()
    if loss_scale is None:
        return jax.grad(critic_sum)(x)
    return jaxamp.scaled_value_and_grad(critic_sum, loss_scale)(x)[1]


def wgan_gp(grads):
    return 10 * jnp.mean((jnp.linalg.norm(grads, axis=1) - 1) ** 2)


def squared_norm(grads):
    return 10 * jnp.mean(jnp.sum(grads**2, axis=1))


def init_critic(weight_scale):
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    return {"w1": jax.random.normal(k1, (16, 32)) * weight_scale,
            "w2": jax.random.normal(k2, (32, 32)) * weight_scale,
            "w3": jax.random.normal(k3, (32, 1)) * weight_scale}  # fmt: skip


def relative_error(tree, reference):
    return max(
        float(jnp.abs(a - b).max() / jnp.abs(b).max())
        for a, b in zip(jax.tree.leaves(tree), jax.tree.leaves(reference))
    )


INTERPOLATES = jax.random.normal(jax.random.key(1), (8, 16))


def test_a_small_inner_gradient_underflows_in_float16_unless_it_goes_through_the_loss_scale():
    params = init_critic(0.001)  # input gradients of about 1e-7, below float16's normal range
    loss_scale = jaxamp.DynamicLossScale()
    float32 = input_grads(critic, params, INTERPOLATES)
    unscaled = jax.jit(lambda p: input_grads(HALF_CRITIC, p, INTERPOLATES))(params)
    scaled = jax.jit(lambda p: input_grads(HALF_CRITIC, p, INTERPOLATES, loss_scale))(params)

    assert float(jnp.mean(unscaled == 0)) > 0.3
    assert relative_error(unscaled, float32) > 0.1
    assert not np.any(scaled == 0)
    assert relative_error(scaled, float32) < 2e-3


def penalty_param_grads(penalty, params, inner_scale):
    loss_scale = jaxamp.DynamicLossScale()
    inner_loss_scale = loss_scale if inner_scale else None
    loss = lambda p: penalty(input_grads(HALF_CRITIC, p, INTERPOLATES, inner_loss_scale))
    return jax.jit(jaxamp.scaled_value_and_grad(loss, loss_scale))(params)[1]


def test_the_wgan_gp_param_gradient_through_a_scaled_inner_gradient_is_float32s_and_a_squared_norms_is_lost():
    params = init_critic(0.002)
    float32 = jax.grad(lambda p: wgan_gp(input_grads(critic, p, INTERPOLATES)))(params)
    assert relative_error(penalty_param_grads(wgan_gp, params, inner_scale=True), float32) < 2e-3
    assert relative_error(penalty_param_grads(wgan_gp, params, inner_scale=False), float32) > 1e-2

    # The squared norm's derivative is as small as the gradient: it underflows in the outer backward pass.
    squared_grads = penalty_param_grads(squared_norm, params, inner_scale=True)
    assert all(np.all(leaf == 0) for leaf in jax.tree.leaves(squared_grads["w3"]))
    assert (
        relative_error(
            squared_grads, jax.grad(lambda p: squared_norm(input_grads(critic, p, INTERPOLATES)))(params)
        )
        == 1.0
    )


def test_an_inner_gradient_that_overflows_makes_the_outer_gradients_non_finite_so_the_step_is_skipped():
    params = init_critic(0.05)
    loss_scale = jaxamp.DynamicLossScale(2.0**24)  # the inner seed alone is beyond float16's 65504
    inner = input_grads(HALF_CRITIC, params, INTERPOLATES, loss_scale)
    assert not bool(jaxamp.all_finite(inner))

    def critic_loss(params, loss_scale):
        return wgan_gp(input_grads(HALF_CRITIC, params, INTERPOLATES, loss_scale))

    state = jaxamp.TrainState.create(apply_fn=None, params=params, tx=optax.adam(1e-3), loss_scale=loss_scale)
    _, grads, grads_finite = jaxamp.scaled_value_and_grad(critic_loss, state.loss_scale)(
        state.params, state.loss_scale
    )
    assert not bool(grads_finite)
    after = state.apply_gradients(grads=grads, grads_finite=grads_finite)
    assert same_tree(after.params, state.params)
    assert (int(after.step), int(after.skipped_steps), float(after.loss_scale.loss_scale)) == (0, 1, 2.0**23)


def train_critic(critic_fn, loss_scale, scale_inner, applied_steps=30):
    """The page's WGAN-GP critic: the mean input-gradient norm at each applied step, and the final state."""
    real = jax.random.normal(jax.random.key(2), (8, 16)) + 1
    fake = jax.random.normal(jax.random.key(3), (8, 16))
    mix = jax.random.uniform(jax.random.key(4), (8, 1))
    interpolates = mix * real + (1 - mix) * fake

    def critic_loss(params, loss_scale):
        grads = input_grads(critic_fn, params, interpolates, loss_scale if scale_inner else None)
        wasserstein = critic_fn(params, fake).mean() - critic_fn(params, real).mean()
        return wasserstein + wgan_gp(grads), jnp.linalg.norm(grads, axis=1).mean()

    @jax.jit
    def critic_step(state):
        (_, grad_norm), grads, grads_finite = jaxamp.scaled_value_and_grad(
            critic_loss, state.loss_scale, has_aux=True
        )(state.params, state.loss_scale)
        return state.apply_gradients(grads=grads, grads_finite=grads_finite), grad_norm

    state = jaxamp.TrainState.create(
        apply_fn=None, params=init_critic(0.002), tx=optax.adam(1e-3), loss_scale=loss_scale
    )
    by_step = {}
    for _ in range(2 * applied_steps):
        if int(state.step) == applied_steps:
            break
        applied_before = int(state.step)
        state, by_step[applied_before] = critic_step(state)
    return np.array([by_step[step] for step in range(applied_steps)]), state


def test_the_penalty_recipe_tracks_float32_over_thirty_steps_and_its_skipped_steps_are_retried():
    float32_norms, _ = train_critic(critic, jaxamp.NoOpLossScale(), scale_inner=False)
    scaled_norms, scaled_state = train_critic(HALF_CRITIC, jaxamp.DynamicLossScale(), scale_inner=True)
    unscaled_norms, _ = train_critic(HALF_CRITIC, jaxamp.DynamicLossScale(), scale_inner=False)

    assert float32_norms[-1] > 1e4 * float32_norms[0]  # the run crosses float16's underflow range
    scaled_difference = np.max(np.abs(scaled_norms / float32_norms - 1))
    unscaled_difference = np.max(np.abs(unscaled_norms / float32_norms - 1))
    assert scaled_difference < 1e-3
    assert unscaled_difference > 5 * scaled_difference
    assert int(scaled_state.step) == 30
    # A skip backs the scale off, and nothing else changes it within 30 steps (period 2000).
    assert float(scaled_state.loss_scale.loss_scale) == 2.0**15 / 2 ** int(scaled_state.skipped_steps)


# Multiple models: a GAN with a loss scale per train state


def two_layers(params, x):
    return jnp.tanh(x @ params["w1"] + params["b1"]) @ params["w2"] + params["b2"]


def init_two_layers(key, sizes):
    k1, k2 = jax.random.split(key)
    return {"w1": jax.random.normal(k1, sizes[:2]) / sizes[0] ** 0.5, "b1": jnp.zeros(sizes[1]),
            "w2": jax.random.normal(k2, sizes[1:]) / sizes[1] ** 0.5, "b2": jnp.zeros(sizes[2])}  # fmt: skip


def discriminator_loss(d_params, g_params, z, real):
    fake = jax.lax.stop_gradient(two_layers(g_params, z))
    return (
        jax.nn.softplus(-two_layers(d_params, real)).mean()
        + jax.nn.softplus(two_layers(d_params, fake)).mean()
    )


def generator_loss(g_params, d_params, z):
    return jax.nn.softplus(-two_layers(d_params, two_layers(g_params, z))).mean()


def make_gan_step(policy):
    d_loss = jaxamp.autocast(discriminator_loss, policy)
    g_loss = jaxamp.autocast(generator_loss, policy)

    @jax.jit
    def gan_step(d_state, g_state, z, real):
        _, d_grads, d_finite = jaxamp.scaled_value_and_grad(d_loss, d_state.loss_scale)(
            d_state.params, g_state.params, z, real
        )
        d_state = d_state.apply_gradients(grads=d_grads, grads_finite=d_finite)
        _, g_grads, g_finite = jaxamp.scaled_value_and_grad(g_loss, g_state.loss_scale)(
            g_state.params, d_state.params, z
        )
        return d_state, g_state.apply_gradients(grads=g_grads, grads_finite=g_finite)

    return gan_step


@pytest.mark.parametrize(
    ("poisoned", "d_skips", "g_skips"),
    [("real", True, False), ("noise", True, True), (None, False, False)],
    ids=["inf_in_the_real_batch_skips_the_discriminator_only", "nan_in_the_noise_skips_both", "clean"],
)
@pytest.mark.parametrize("policy", ["float32", MIXED])
def test_each_gan_train_state_skips_on_its_own_gradients_and_halves_only_its_own_scale(
    policy, poisoned, d_skips, g_skips
):
    k_d, k_g, k_real = jax.random.split(jax.random.key(0), 3)
    d_state, g_state = (
        jaxamp.TrainState.create(
            apply_fn=None, params=params, tx=optax.adam(1e-3), loss_scale=jaxamp.default_loss_scale(policy)
        )
        for params in (init_two_layers(k_d, (8, 16, 1)), init_two_layers(k_g, (4, 16, 8)))
    )
    gan_step = make_gan_step(policy)
    for iteration in range(3):
        z = jax.random.normal(jax.random.fold_in(k_g, iteration), (8, 4))
        real = 2 + 0.5 * jax.random.normal(jax.random.fold_in(k_real, iteration), (8, 8))
        if iteration == 2 and poisoned == "real":
            real = real.at[0, 0].set(jnp.inf)
        if iteration == 2 and poisoned == "noise":
            z = z.at[0, 0].set(jnp.nan)  # an inf would be saturated by the generator's tanh
        d_before, g_before = d_state, g_state
        d_state, g_state = gan_step(d_state, g_state, z, real)

    for before, after, skipped in ((d_before, d_state, d_skips), (g_before, g_state, g_skips)):
        assert int(after.step) == int(before.step) + (not skipped)
        assert int(after.skipped_steps) == int(skipped)
        assert same_tree(after.params, before.params) == skipped
        assert same_tree(after.opt_state, before.opt_state) == skipped
        scale_ratio = float(after.loss_scale.loss_scale) / float(before.loss_scale.loss_scale)
        assert scale_ratio == (0.5 if skipped and policy == MIXED else 1.0)


def test_one_skip_decision_for_both_gan_states_keeps_their_two_copies_of_the_scale_equal():
    """The page's alternative: one combined flag passed to both apply_gradients calls."""
    d_loss, g_loss = jaxamp.autocast(discriminator_loss, MIXED), jaxamp.autocast(generator_loss, MIXED)

    @jax.jit
    def joint_step(d_state, g_state, z, real):
        _, d_grads, d_finite = jaxamp.scaled_value_and_grad(d_loss, d_state.loss_scale)(
            d_state.params, g_state.params, z, real
        )
        _, g_grads, g_finite = jaxamp.scaled_value_and_grad(g_loss, g_state.loss_scale)(
            g_state.params, d_state.params, z
        )
        both_finite = d_finite & g_finite
        return (d_state.apply_gradients(grads=d_grads, grads_finite=both_finite),
                g_state.apply_gradients(grads=g_grads, grads_finite=both_finite))  # fmt: skip

    k_d, k_g = jax.random.split(jax.random.key(0))
    d_state, g_state = (
        jaxamp.TrainState.create(
            apply_fn=None, params=params, tx=optax.adam(1e-3), loss_scale=jaxamp.DynamicLossScale()
        )
        for params in (init_two_layers(k_d, (8, 16, 1)), init_two_layers(k_g, (4, 16, 8)))
    )
    z = jax.random.normal(jax.random.key(1), (8, 4))
    real = 2 + 0.5 * jax.random.normal(jax.random.key(2), (8, 8))
    for batch in [real, real.at[0, 0].set(jnp.inf), real]:  # the inf reaches the discriminator's loss only
        d_before, g_before = d_state, g_state
        d_state, g_state = joint_step(d_state, g_state, z, batch)
        both_skipped = not np.all(np.isfinite(batch))
        assert same_tree(d_state.params, d_before.params) == both_skipped
        assert same_tree(g_state.params, g_before.params) == both_skipped
        assert same_tree(d_state.loss_scale, g_state.loss_scale)
    assert (int(d_state.step), int(g_state.step), int(g_state.skipped_steps)) == (2, 2, 1)
    assert float(g_state.loss_scale.loss_scale) == 2.0**14


# Custom derivatives


@jax.custom_vjp
def custom_matmul(x, w):
    return x @ w


def _custom_matmul_fwd(x, w):
    return x @ w, (x, w)


def _custom_matmul_bwd(residuals, cotangent):
    x, w = residuals
    return cotangent @ w.T, x.T @ cotangent


custom_matmul.defvjp(_custom_matmul_fwd, _custom_matmul_bwd)

# The custom function's weight has a dimension (24) that no other operand has, so its matmuls are recognizable.
CUSTOM_WIDTH = 24


def dot_generals(jaxpr):
    """Every dot_general of a jaxpr and of the jaxprs nested in it."""
    for equation in jaxpr.eqns:
        if equation.primitive.name == "dot_general":
            yield equation
        for param in equation.params.values():
            for sub in param if isinstance(param, (tuple, list)) else [param]:
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    yield from dot_generals(sub.jaxpr)
                elif isinstance(sub, jax.extend.core.Jaxpr):
                    yield from dot_generals(sub)


@pytest.mark.parametrize("scoped", [False, True], ids=["custom_vjp", "custom_vjp_in_float32_scope"])
def test_a_custom_vjp_in_float32_scope_runs_its_forward_and_backward_matmuls_in_float32(scoped):
    def float32_matmul(x, w):  # the page's counterpart of custom_fwd(cast_inputs=torch.float32)
        with jaxamp.float32_scope():
            return custom_matmul(x.astype(jnp.float32), w.astype(jnp.float32))

    matmul = float32_matmul if scoped else custom_matmul

    def loss(w1, w2, x):
        h = jnp.tanh(x @ w1)
        return jnp.tanh(matmul(h, w2)).sum()

    w1, w2, x = jnp.ones((16, 32)) / 16, jnp.ones((32, CUSTOM_WIDTH)) / 32, jnp.ones((8, 16))
    grad_fn = jax.grad(jaxamp.autocast(loss, MIXED), argnums=(0, 1))
    dots = list(dot_generals(jax.make_jaxpr(grad_fn)(w1, w2, x).jaxpr))

    def dtypes(equation):
        return {var.aval.dtype for var in [*equation.invars, *equation.outvars]}

    custom = [eq for eq in dots if any(CUSTOM_WIDTH in var.aval.shape for var in [*eq.invars, *eq.outvars])]
    ordinary = [eq for eq in dots if eq not in custom]
    assert (len(custom), len(ordinary)) == (3, 2)  # the custom forward and its two backward matmuls
    for equation in custom:
        assert dtypes(equation) == ({jnp.dtype("float32")} if scoped else {jnp.dtype("float16")})
    for equation in ordinary:
        assert dtypes(equation) == {jnp.dtype("float16")}

    float32_grads = jax.grad(loss, argnums=(0, 1))(w1, w2, x)
    np.testing.assert_allclose(grad_fn(w1, w2, x)[1], float32_grads[1], rtol=1e-5 if scoped else 5e-3)
