"""The overflow-storm guard: a stuck loss scale stops a run with a named error."""

import re

import jax
import jax.numpy as jnp
import jmp
import numpy as np
import optax
import pytest
from flax import struct

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


def test_overflows_at_the_minimum_that_a_clean_step_interrupted_do_not_stop_the_run():
    """The limit counts overflows in a row, not every skip the run has had."""
    state = state_after([False, False, False, True, False, False], jaxamp.DynamicLossScale(4.0, min_loss_scale=1.0))
    assert float(state.loss_scale.loss_scale) == 1.0 and int(state.loss_scale.skipped_steps) == 5
    jaxamp.OverflowGuard(max_consecutive_skips=100, max_overflows_at_min_scale=3).check(state)


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
    assert error.nonfinite_paths == ["w"]  # the optimizer state's own record of the leaves


@pytest.mark.parametrize("bad", [-1, 2.5, True, "3"])
def test_a_bad_limit_is_named(bad):
    with pytest.raises(ValueError, match="max_consecutive_skips"):
        jaxamp.OverflowGuard(max_consecutive_skips=bad)


def test_checking_something_that_is_not_a_train_state_says_what_is_missing():
    message = (
        "OverflowGuard.check needs a train state with step, skipped_steps and loss_scale (a "
        "jaxamp.TrainState) or a jaxamp.loss_scaling optimizer state; got DynamicLossScale."
    )
    with pytest.raises(TypeError, match=f"^{re.escape(message)}$"):
        jaxamp.OverflowGuard(max_consecutive_skips=1).check(jaxamp.DynamicLossScale())


@struct.dataclass
class OwnTrainState:
    """A user's own train state: a step and a loss scale, no record of leaves or overflows."""

    step: jax.Array
    loss_scale: object


def test_a_users_own_train_state_with_a_jaxamp_loss_scale_is_checked_without_records():
    """Fails if the guard read a record the state does not have (an AttributeError)."""
    loss_scale = jaxamp.DynamicLossScale(4.0).adjust(jnp.array(False)).adjust(jnp.array(False))
    with pytest.raises(jaxamp.LossScaleStuckError, match="2 steps in a row overflowed") as raised:
        jaxamp.OverflowGuard(max_consecutive_skips=2).check(OwnTrainState(jnp.array(3), loss_scale))
    assert (raised.value.applied_steps, raised.value.nonfinite_paths, raised.value.first_overflow) == (
        3,
        None,
        None,
    )


def test_a_state_holding_another_librarys_loss_scale_is_refused_naming_its_type():
    message = (
        "OverflowGuard.check needs a jaxamp loss scale, which counts skipped steps; the state holds "
        "StaticLossScale."
    )
    with pytest.raises(TypeError, match=f"^{re.escape(message)}$"):
        jaxamp.OverflowGuard(max_consecutive_skips=1).check(
            OwnTrainState(jnp.array(0), jmp.StaticLossScale(2.0))
        )


GUIDE = "The guide 'Why was my step skipped?' says what each finding means."
TRY = (
    "The gradients overflow whatever the scale: try a float32 override for {layer}, a bfloat16 policy, a "
    "lower learning rate or a static loss scale, and look for inf or NaN in the inputs."
)
RECORD_IT = (
    "record_overflow=True in jaxamp.scaled_value_and_grad names the op that overflowed first and its pass "
    "(forward or backward)."
)


@pytest.mark.parametrize("count, tail", [(4, "Dense_0/kernel."), (5, "Dense_1/kernel and 1 more.")])
def test_the_leaves_named_stop_at_four_and_count_the_rest(count, tail):
    """Fails if "and 0 more" followed exactly four leaves, or one leaf past four went uncounted."""
    error = jaxamp.LossScaleStuckError(
        applied_steps=0,
        skipped_steps=1,
        consecutive_skipped_steps=1,
        loss_scale=1.0,
        min_loss_scale=None,
        reason="1 steps in a row overflowed (limit 1)",
        nonfinite_paths=[f"Dense_{index}/kernel" for index in range(count)],
    )
    assert f"{count} leaves, from there back: Dense_{count - 1}/kernel, " in str(error)
    assert f", {tail} The gradients overflow" in str(error)


def test_the_message_of_an_optimizer_state_at_its_floor_with_two_leaves_reads_whole():
    """No applied-step count, a floor, every leaf shown (no "and N more"), the record's advice."""
    error = jaxamp.LossScaleStuckError(
        applied_steps=None,
        skipped_steps=5,
        consecutive_skipped_steps=3,
        loss_scale=1.0,
        min_loss_scale=1.0,
        reason="3 steps in a row overflowed (limit 3)",
        nonfinite_paths=["Dense_0/kernel", "Dense_1/kernel"],
    )
    assert (error.reason, error.steps, error.deepest_layers) == (
        "3 steps in a row overflowed (limit 3)",
        None,
        ["Dense_1"],
    )
    assert str(error) == " ".join(
        [
            "Loss scale stuck: 3 steps in a row overflowed (limit 3). With 5 skipped in all, the last 3 in a",
            "row, the loss scale is 1 (its minimum is 1). The last skipped step's non-finite gradients start",
            "at Dense_1: the deepest layer whose gradients are not finite (by the order of the names, no",
            "layer after it has one), so the overflow is in its backward pass or in the op after it. 2",
            "leaves, from there back: Dense_1/kernel, Dense_0/kernel.",
            TRY.format(layer="Dense_1 or the layer after it"),
            RECORD_IT,
            GUIDE,
        ]
    )


def test_the_message_of_a_train_state_without_a_floor_or_leaves_names_the_kept_first_overflow():
    """Applied steps counted, no floor, no record of the leaves (None), a kept record's first
    overflow in place of the advice to record one."""
    error = jaxamp.LossScaleStuckError(
        applied_steps=2,
        skipped_steps=3,
        consecutive_skipped_steps=3,
        loss_scale=256.0,
        min_loss_scale=None,
        reason="3 steps in a row overflowed (limit 3)",
        first_overflow="forward overflow first in Dense_1 (dot_general, float16, amax inf)",
    )
    assert (error.steps, error.nonfinite_paths, error.deepest_layers) == (5, None, None)
    assert str(error) == " ".join(
        [
            "Loss scale stuck: 3 steps in a row overflowed (limit 3). At step 5 (2 applied, 3 skipped in all,",
            "the last 3 in a row) the loss scale is 256.",
            TRY.format(layer="the layer that overflows"),
            "The last skipped step's first overflow: forward overflow first in Dense_1 (dot_general, float16,",
            "amax inf).",
            GUIDE,
        ]
    )


def test_a_limit_of_zero_turns_it_off_and_each_limit_is_checked_when_the_other_is_none():
    """Fails if 0 were refused (it turns a limit off) or the second limit went unchecked."""
    jaxamp.OverflowGuard(max_consecutive_skips=0, max_overflows_at_min_scale=0).check(
        state_after([False] * 3, jaxamp.DynamicLossScale(4.0, min_loss_scale=1.0))
    )
    with pytest.raises(ValueError, match=r"max_overflows_at_min_scale must be None or an integer >= 0"):
        jaxamp.OverflowGuard(max_overflows_at_min_scale=-1)


def test_a_state_that_keeps_no_record_of_the_leaves_is_still_stopped_without_them():
    """A state made without a NonFiniteGradients record (a restored older state, a hand-made one):
    the error has no leaves to name. Fails if the guard read the missing record."""
    state = state_after([False, False], jaxamp.DynamicLossScale(2.0**10)).replace(nonfinite_grads=None)
    with pytest.raises(jaxamp.LossScaleStuckError) as raised:
        jaxamp.OverflowGuard(max_consecutive_skips=2).check(state)
    assert raised.value.nonfinite_paths is None and raised.value.deepest_layers is None
    assert "non-finite gradients" not in str(raised.value)
