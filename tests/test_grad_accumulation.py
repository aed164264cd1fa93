"""Gradient accumulation: the optax trap reproduced, and jaxamp's path out of it."""

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxamp
from experiments import data as data_lib
from experiments import train
from experiments.grad_accumulation import accumulate_gradients


def test_optax_multisteps_around_apply_if_finite_is_poisoned_for_good_by_one_overflowed_micro_batch():
    # optax issue 828: MultiSteps adds the gradients to its accumulator before
    # apply_if_finite sees them, and resets it by multiplying with 0 (NaN * 0 = NaN).
    optimizer = optax.MultiSteps(
        optax.apply_if_finite(optax.sgd(0.1), max_consecutive_errors=100), every_k_schedule=2
    )
    params = {"w": jnp.ones(3)}
    opt_state = optimizer.init(params)
    for gradient in [np.nan] + [1.0] * 7:  # one bad micro-batch, then only clean ones
        updates, opt_state = optimizer.update({"w": jnp.full(3, gradient, jnp.float32)}, opt_state, params)
        params = optax.apply_updates(params, updates)

    assert np.all(np.isnan(opt_state.acc_grads["w"]))
    np.testing.assert_array_equal(params["w"], np.ones(3))  # never trained again


def linear_problem(batch_size=8):
    rng = np.random.default_rng(0)
    inputs = jnp.asarray(rng.normal(size=(batch_size, 4)), jnp.float32)
    targets = jnp.asarray(rng.normal(size=(batch_size, 2)), jnp.float32)
    params = {"w": jnp.asarray(rng.normal(size=(4, 2)), jnp.float32), "b": jnp.zeros(2)}
    return params, inputs, targets


def accumulated_step(state, inputs, targets, num_micro_batches):
    """One step of a model without batch statistics, over K micro-batches."""

    def micro_batch_grads(params, carry, micro_batch):
        micro_inputs, micro_targets = micro_batch

        def loss_fn(params):
            return jnp.mean((micro_inputs @ params["w"] + params["b"] - micro_targets) ** 2)

        loss, grads, grads_finite = jaxamp.scaled_value_and_grad(loss_fn, state.loss_scale)(params)
        return ({"loss": loss}, carry), grads, grads_finite

    micro_batches = jax.tree.map(lambda array: array.reshape(num_micro_batches, -1, *array.shape[1:]),
                                 (inputs, targets))  # fmt: skip
    _, grads, grads_finite, _ = accumulate_gradients(micro_batch_grads, state.params, None, micro_batches)
    return state.apply_gradients(grads=grads, grads_finite=grads_finite)


def linear_state(params):
    return jaxamp.TrainState.create(
        apply_fn=None,
        params=params,
        tx=optax.sgd(0.1, momentum=0.9),
        loss_scale=jaxamp.DynamicLossScale(2.0**10),
    )


def test_k_accumulated_micro_batches_give_the_update_of_one_batch_k_times_the_size():
    params, inputs, targets = linear_problem()
    step = jax.jit(accumulated_step, static_argnums=3)
    one_batch = step(linear_state(params), inputs, targets, 1)
    four_micro_batches = step(linear_state(params), inputs, targets, 4)

    for name in params:
        assert not np.allclose(one_batch.params[name], params[name])
        np.testing.assert_allclose(
            four_micro_batches.params[name], one_batch.params[name], rtol=1e-6, atol=1e-7
        )


def test_an_overflowed_micro_batch_never_reaches_the_accumulator_and_later_steps_train():
    params, inputs, targets = linear_problem()
    step = jax.jit(accumulated_step, static_argnums=3)
    poisoned = inputs.at[5, 0].set(jnp.inf)  # in the third of four micro-batches

    state = step(linear_state(params), poisoned, targets, 4)
    assert (int(state.step), int(state.skipped_steps)) == (0, 1)
    assert all(jax.tree.leaves(jax.tree.map(np.array_equal, state.params, params)))
    assert all(jax.tree.leaves(jax.tree.map(np.array_equal, state.opt_state, linear_state(params).opt_state)))

    for _ in range(3):
        state = step(state, inputs, targets, 4)
    assert (int(state.step), int(state.skipped_steps)) == (3, 1)
    assert jaxamp.all_finite((state.params, state.opt_state))
    assert not np.allclose(state.params["w"], params["w"])


def test_nan_in_the_input_images_of_a_micro_batch_is_a_counted_skipped_step_of_the_experiment():
    dataset = data_lib.synthetic_dataset(num_train=16, num_test=8, seed=0)
    config = train.TrainConfig(model="resnet_tiny", precision="mixed", batch_size=4, grad_accum=2)
    state = train.create_train_state(config, train.resolve_precision("mixed"), 10, steps_per_epoch=4)
    images = jnp.asarray(dataset.train_images, jnp.float32).at[1, 3, 3, 0].set(jnp.nan)
    labels = jnp.asarray(dataset.train_labels)
    step = jax.jit(train.make_train_step(config, dataset))
    before = state

    state, _ = step(state, images, labels, jnp.arange(4), jax.random.key(0))  # holds image 1
    assert (int(state.step), int(state.skipped_steps)) == (0, 1)
    same = jax.tree.map(
        np.array_equal, (state.params, state.batch_stats), (before.params, before.batch_stats)
    )
    assert all(jax.tree.leaves(same))

    state, metrics = step(state, images, labels, jnp.arange(4) + 4, jax.random.key(1))  # clean images
    assert (int(state.step), int(state.skipped_steps)) == (1, 1)
    assert np.isfinite(float(metrics["loss"])) and train.state_finite(state)
