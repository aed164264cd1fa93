"""The overflow-storm guard: a stuck loss scale stops a run with a named error."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxamp


def state_after(finite_flags, loss_scale):
    """A tiny TrainState after one step per flag (True: clean, False: overflowed)."""
    state = jaxamp.TrainState.create(
        apply_fn=None, params={"w": jnp.ones(3)}, tx=optax.sgd(0.1), loss_scale=loss_scale
    )
    for finite in finite_flags:
        grads = {"w": jnp.full(3, 1.0 if finite else jnp.inf)}
        state = state.apply_gradients(grads=grads)
    return state


def test_the_guard_is_off_unless_asked_for():
    state = state_after([False] * 20, jaxamp.DynamicLossScale(2.0**4))
    jaxamp.OverflowGuard().check(state)  # no limit, no error


def test_consecutive_skips_stop_a_dynamic_scale_run_with_the_counters_in_the_error():
    state = state_after([True, False, False, False], jaxamp.DynamicLossScale(2.0**10))
    guard = jaxamp.OverflowGuard(max_consecutive_skips=3)

    with pytest.raises(jaxamp.LossScaleStuckError, match="3 steps in a row overflowed") as raised:
        guard.check(state)

    error = raised.value
    assert (error.steps, error.applied_steps, error.skipped_steps) == (4, 1, 3)
    assert error.consecutive_skipped_steps == 3 and error.loss_scale == 2.0**7
    assert "bfloat16" in str(error) and "learning rate" in str(error)


def test_a_clean_step_resets_the_run_of_skips():
    state = state_after([False, False, True, False, False], jaxamp.DynamicLossScale(2.0**10))
    jaxamp.OverflowGuard(max_consecutive_skips=3).check(state)


def test_overflows_with_the_scale_at_its_minimum_stop_the_run_before_the_skip_limit():
    state = state_after([False] * 3, jaxamp.DynamicLossScale(4.0, min_loss_scale=1.0))
    assert float(state.loss_scale.loss_scale) == 1.0
    guard = jaxamp.OverflowGuard(max_consecutive_skips=100, max_overflows_at_min_scale=3)

    with pytest.raises(jaxamp.LossScaleStuckError, match="at its minimum") as raised:
        guard.check(state)
    assert raised.value.min_loss_scale == 1.0


def test_skips_at_a_scale_above_its_minimum_do_not_count_as_stuck_at_the_minimum():
    state = state_after([False] * 3, jaxamp.DynamicLossScale(2.0**10, min_loss_scale=1.0))
    jaxamp.OverflowGuard(max_overflows_at_min_scale=3).check(state)


@pytest.mark.parametrize(
    "loss_scale", [jaxamp.NoOpLossScale(), jaxamp.StaticLossScale(2.0**8)], ids=["no_op", "static"]
)
def test_static_and_no_op_scales_count_their_skips_so_a_first_check_is_exact(loss_scale):
    # No earlier check to compare with: the run of skips is the loss scale's own counter.
    state = state_after([True, True, False, False, False, False], loss_scale)
    assert int(state.loss_scale.consecutive_skipped_steps) == 4

    with pytest.raises(jaxamp.LossScaleStuckError, match="4 steps in a row") as raised:
        jaxamp.OverflowGuard(max_consecutive_skips=4).check(state)
    assert (raised.value.applied_steps, raised.value.skipped_steps) == (2, 4)


def test_a_clean_step_between_checks_resets_the_run_for_every_loss_scale():
    guard = jaxamp.OverflowGuard(max_consecutive_skips=3)
    for loss_scale in (jaxamp.NoOpLossScale(), jaxamp.StaticLossScale(4.0), jaxamp.DynamicLossScale()):
        guard.check(state_after([False, False], loss_scale))
        guard.check(state_after([False, False, True, False, False], loss_scale))


def test_a_resumed_run_is_judged_on_the_counts_its_checkpoint_holds():
    # A fresh guard (a restarted process) sees the loss scale's counters, not a run restarted at 0.
    state = state_after([True, False, False], jaxamp.DynamicLossScale(2.0**10))
    restored = jax.tree.map(np.asarray, state)  # what a checkpoint round trip gives back
    with pytest.raises(jaxamp.LossScaleStuckError, match="2 steps in a row"):
        jaxamp.OverflowGuard(max_consecutive_skips=2).check(restored)


def test_the_guard_checks_the_optimizer_state_of_loss_scaling_without_a_train_state():
    tx = jaxamp.loss_scaling(optax.sgd(0.1), jaxamp.DynamicLossScale(2.0**10))
    params = {"w": jnp.ones(3)}
    opt_state = tx.init(params)
    for finite in (True, False, False, False):
        _, opt_state = tx.update({"w": jnp.full(3, 1.0 if finite else jnp.inf)}, opt_state, params)

    with pytest.raises(jaxamp.LossScaleStuckError, match="3 steps in a row overflowed") as raised:
        jaxamp.OverflowGuard(max_consecutive_skips=3).check(opt_state)
    error = raised.value
    assert (error.steps, error.applied_steps, error.skipped_steps) == (None, None, 3)
    assert "3 skipped in all, the last 3 in a row" in str(error)


@pytest.mark.parametrize("bad", [-1, 2.5, True, "3"])
def test_a_bad_limit_is_named(bad):
    with pytest.raises(ValueError, match="max_consecutive_skips"):
        jaxamp.OverflowGuard(max_consecutive_skips=bad)


def test_checking_something_that_is_not_a_train_state_says_what_is_missing():
    with pytest.raises(TypeError, match="step, skipped_steps"):
        jaxamp.OverflowGuard(max_consecutive_skips=1).check(jaxamp.DynamicLossScale())
