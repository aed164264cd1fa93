"""`scaled_value_and_grad` unscales with the scale the loss was scaled with.

The scale changes only between steps (``adjust`` after the step), so a step
whose gradients come out of `scaled_value_and_grad` must divide by the scale
it multiplied the loss by, whatever ``adjust`` would make of it: at a growth
step an unscale by the adjusted scale halves every gradient (the defect held
against mpx in the README), at a back-off step it doubles the finite ones.
Every scale here is a power of two, so unscaling is exact and the gradients
must equal ``jax.grad``'s to the bit.
"""

import jax
import jax.numpy as jnp
import jmp
import numpy as np
import pytest

import jaxamp

PARAMS = {"w": jnp.array([0.5, -1.0, 2.0]), "b": jnp.array(0.25)}
INPUTS = jnp.array([1.0, 2.0, 3.0])


def squared_error(params, inputs):
    return jnp.sum((params["w"] * inputs + params["b"] - 1.0) ** 2)


def assert_grads_equal(actual, expected):
    for got, want in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        np.testing.assert_array_equal(got, want)


# Scales on the step where `adjust` changes them (the counter one short of
# the period: the next clean step grows the scale).
AT_A_GROWTH_STEP = {
    "dynamic": jaxamp.DynamicLossScale(2.0**10, period=3, counter=2),
    "dynamic_period_1": jaxamp.DynamicLossScale(2.0**10, period=1),
    "jmp_dynamic": jmp.DynamicLossScale(jnp.float32(2.0**10), counter=jnp.int32(2), period=3),
    "static": jaxamp.StaticLossScale(2.0**10),
}


@pytest.mark.parametrize("name", sorted(AT_A_GROWTH_STEP))
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_at_a_growth_step_the_gradients_are_unscaled_by_the_scale_before_it_grows(name, jit):
    """Fails if the gradients are unscaled by ``loss_scale.adjust(finite)``: they come out halved."""
    loss_scale = AT_A_GROWTH_STEP[name]
    if name.startswith("dynamic"):
        # The premise: this step grows the scale.
        assert float(loss_scale.adjust(jnp.array(True)).loss_scale) == 2.0**11

    def step(loss_scale, params, inputs):
        return jaxamp.scaled_value_and_grad(squared_error, loss_scale)(params, inputs)

    step = jax.jit(step) if jit else step
    loss, grads, grads_finite = step(loss_scale, PARAMS, INPUTS)
    expected_loss, expected_grads = jax.value_and_grad(squared_error)(PARAMS, INPUTS)
    assert bool(grads_finite)
    assert float(loss) == float(expected_loss)
    assert_grads_equal(grads, expected_grads)


def overflowing_in_b(params, inputs):
    """Its gradient w.r.t. ``b`` is 1e36: finite, but not once scaled by 2**10."""
    return jnp.sum(params["w"] * inputs) + 1e36 * params["b"]


AT_A_BACK_OFF_STEP = {
    "dynamic": jaxamp.DynamicLossScale(2.0**10),
    "dynamic_hysteresis_2_last_overflow": jaxamp.DynamicLossScale(
        2.0**10, hysteresis=2, overflows_until_backoff=1
    ),
    "jmp_dynamic": jmp.DynamicLossScale(jnp.float32(2.0**10)),
    "static": jaxamp.StaticLossScale(2.0**10),
}


@pytest.mark.parametrize("name", sorted(AT_A_BACK_OFF_STEP))
def test_at_a_back_off_step_the_finite_gradients_are_unscaled_by_the_scale_before_it_shrinks(name):
    """Fails if unscaled by the backed-off scale: the finite ``w`` gradient comes out doubled."""
    loss_scale = AT_A_BACK_OFF_STEP[name]
    if name.startswith("dynamic"):
        assert float(loss_scale.adjust(jnp.array(False)).loss_scale) == 2.0**9
    _, grads, grads_finite = jaxamp.scaled_value_and_grad(overflowing_in_b, loss_scale)(PARAMS, INPUTS)
    assert not bool(grads_finite)
    assert np.isinf(grads["b"])
    np.testing.assert_array_equal(grads["w"], INPUTS)


def test_a_training_loop_through_growth_and_back_off_gets_jax_grads_at_every_clean_step():
    """Step by step, adjusting after each: the scale grows twice, backs off once, grads stay exact."""
    loss_scale = jaxamp.DynamicLossScale(2.0**4, period=2)
    expected_grads = jax.grad(squared_error)(PARAMS, INPUTS)
    step = jax.jit(
        lambda loss_scale, params, inputs: jaxamp.scaled_value_and_grad(squared_error, loss_scale)(
            params, inputs
        )
    )
    scales = []
    for step_index in range(6):
        scales.append(float(loss_scale.loss_scale))
        _, grads, grads_finite = step(loss_scale, PARAMS, INPUTS)
        assert bool(grads_finite)
        assert_grads_equal(grads, expected_grads)
        # Step 3 is told it overflowed (as a skipped step would be): the scale backs off.
        loss_scale = loss_scale.adjust(jnp.array(step_index != 3))
    assert scales == [2.0**4, 2.0**4, 2.0**5, 2.0**5, 2.0**4, 2.0**4]
