"""The last skipped step's overflow record, kept in the train state; micro-batches' records combined.

The 4-layer float16 MLP of `test_overflow_attribution.py`, whose layer 3
overflows in the backward pass when a loss term on its output is added:

* `jaxamp.TrainState.apply_gradients(overflow_record=...)` keeps the record of
  the step it skipped, through later finite steps and a checkpoint;
* `OverflowRecord.worst` combines the records of micro-batches so that one bad
  micro-batch names its layer in the step's record.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from overflow_mlp import MODEL, WIDTH, init_params, new_state

import jaxamp
from experiments.results import skipped_steps_line
from jaxamp.diagnostics import OverflowRecord, OverflowSite

LAYER_3_TERM = 4.0  # its cotangent, times the loss scale 2**15, is beyond float16's 65504


def loss_fn(params, x, layer_3_term):
    out, layer_3 = MODEL(params, x)
    return jnp.mean(out**2) + layer_3_term * jnp.sum(layer_3)


@jax.jit
def train_step(state, x, layer_3_term):
    _, grads, grads_finite, record = jaxamp.scaled_value_and_grad(
        loss_fn, state.loss_scale, record_overflow=True
    )(state.params, x, layer_3_term)
    return state.apply_gradients(grads=grads, grads_finite=grads_finite, overflow_record=record)


X = jax.random.normal(jax.random.key(1), (4, WIDTH))


@pytest.fixture(scope="module")
def after_a_skip_and_a_finite_step():
    state = train_step(new_state(init_params(jax.random.key(0))), X, LAYER_3_TERM)
    return state, train_step(state, X, 0.0)


def test_a_state_without_a_skipped_step_keeps_a_record_without_an_overflow():
    state = train_step(new_state(init_params(jax.random.key(0))), X, 0.0)
    assert int(state.skipped_steps) == 0
    assert state.overflow_record.first_overflow() is None
    assert [site.name for site in state.overflow_record.sites] == ["layer_1", "layer_2", "layer_3", "layer_4"]


def test_the_state_keeps_the_skipped_steps_record_through_a_finite_step(after_a_skip_and_a_finite_step):
    skipped, then_finite = after_a_skip_and_a_finite_step
    for state in (skipped, then_finite):
        first = state.overflow_record.first_overflow()
        assert (first.site.name, first.pass_) == ("layer_3", "backward")
    assert int(then_finite.step) == 1 and int(then_finite.skipped_steps) == 1
    np.testing.assert_array_equal(
        then_finite.overflow_record.backward_amax, skipped.overflow_record.backward_amax
    )


def test_the_report_line_names_the_first_overflow_before_the_leaves(after_a_skip_and_a_finite_step):
    _, state = after_a_skip_and_a_finite_step
    line = skipped_steps_line(state, newly_skipped=1)
    assert line.startswith(
        "1 step skipped since the last report; the last: step 1 skipped: backward overflow"
    )
    assert "first in layer_3 at overflow_mlp.py:" in line
    assert line.endswith("non-finite grads in 6 of 8 leaves: 0/bias, 0/kernel, 1/bias, 1/kernel, ...")


def test_a_step_skipped_without_a_recorded_overflow_says_so():
    """Gradients made non-finite after the backward pass (as --inject-nonfinite does)."""
    state = train_step(new_state(init_params(jax.random.key(0))), X, 0.0)
    poisoned = jax.tree.map(lambda leaf: jnp.full_like(leaf, jnp.nan), state.params)
    state = state.apply_gradients(grads=poisoned, overflow_record=state.overflow_record.cleared())
    line = skipped_steps_line(state, newly_skipped=1)
    assert (
        "step 2 skipped: no overflow in the 4 matmuls and convolutions recorded; non-finite grads in 8"
        in line
    )


def test_without_a_kept_record_the_report_line_names_the_leaves_alone_and_counts_the_steps():
    """A run without --record-overflow: no cause before the leaves; no line without a skip; a
    state built without `create` (no gradient record) gives the count alone."""
    state = new_state(init_params(jax.random.key(0)))
    state = state.apply_gradients(grads=jax.tree.map(lambda leaf: jnp.full_like(leaf, jnp.nan), state.params))
    assert state.overflow_record is None and int(state.skipped_steps) == 1

    assert skipped_steps_line(state, newly_skipped=0) is None
    leaves = "non-finite grads in 8 of 8 leaves: 0/bias, 0/kernel, 1/bias, 1/kernel, ..."
    assert skipped_steps_line(state, newly_skipped=1) == (
        f"1 step skipped since the last report; the last: step 1 skipped: {leaves}"
    )
    assert skipped_steps_line(state, newly_skipped=2) == (
        f"2 steps skipped since the last report; the last: step 1 skipped: {leaves}"
    )
    assert skipped_steps_line(state.replace(nonfinite_grads=None), newly_skipped=3) == (
        "3 steps skipped since the last report"
    )


def test_a_checkpoint_holds_the_kept_record(after_a_skip_and_a_finite_step, tmp_path):
    _, state = after_a_skip_and_a_finite_step
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "state", state)
    checkpointer.wait_until_finished()
    template = train_step(new_state(init_params(jax.random.key(5))), X, 0.0)
    restored = checkpointer.restore(tmp_path / "state", template)
    assert restored.overflow_record.summary() == state.overflow_record.summary()
    assert "backward overflow first in layer_3" in restored.overflow_record.summary()


def test_a_state_started_from_the_steps_cleared_record_keeps_one_structure():
    """`with_overflow_record_of` traces the step abstractly; from its state, two steps trace once."""

    @jax.jit
    def step(state, x, layer_3_term):
        return train_step.__wrapped__(state, x, layer_3_term)

    fresh = new_state(init_params(jax.random.key(0))).with_overflow_record_of(step, X, 0.0)
    assert step._cache_size() == 0, "nothing ran"
    assert fresh.overflow_record.first_overflow() is None
    assert [site.name for site in fresh.overflow_record.sites] == ["layer_1", "layer_2", "layer_3", "layer_4"]
    step(step(fresh, X, LAYER_3_TERM), X, 0.0)
    assert step._cache_size() == 1


def test_a_step_that_keeps_no_record_is_named_as_such():
    @jax.jit
    def plain_step(state, x):
        grads = jax.grad(lambda params: loss_fn(params, x, 0.0))(state.params)
        return state.apply_gradients(grads=grads)

    with pytest.raises(ValueError, match=r"the step keeps no overflow record; pass the record"):
        new_state(init_params(jax.random.key(0))).with_overflow_record_of(plain_step, X)


def test_a_record_of_another_step_function_is_refused():
    state = train_step(new_state(init_params(jax.random.key(0))), X, 0.0)
    other = OverflowRecord(
        jnp.zeros(1), jnp.zeros(1), (OverflowSite("other", "x.py:1", "dot_general", "float16", (4, 8)),)
    )
    with pytest.raises(ValueError, match="records of different step functions"):
        state.apply_gradients(grads=state.params, grads_finite=jnp.array(False), overflow_record=other)
    with pytest.raises(TypeError, match="takes the jaxamp.diagnostics.OverflowRecord"):
        state.apply_gradients(grads=state.params, overflow_record={"forward": jnp.zeros(4)})


def _record(forward, backward):
    sites = tuple(
        OverflowSite(f"layer_{i}", "x.py:1", "dot_general", "float16", (4, 8)) for i in range(len(forward))
    )
    return OverflowRecord(jnp.array(forward, jnp.float32), jnp.array(backward, jnp.float32), sites, 0, True)


def test_the_worst_of_two_records_ranks_inf_above_nan_above_the_larger_finite_amax():
    first = _record([1.0, np.nan, np.inf, 3.0], [np.nan, 2.0, np.nan, np.inf])
    second = _record([2.0, 5.0, np.nan, np.inf], [np.inf, np.nan, np.nan, 1.0])
    expected_forward = [2.0, np.nan, np.inf, np.inf]
    expected_backward = [np.inf, np.nan, np.nan, np.inf]
    for a, b in ((first, second), (second, first)):
        worst = a.worst(b)
        np.testing.assert_array_equal(worst.forward_amax, expected_forward)
        np.testing.assert_array_equal(worst.backward_amax, expected_backward)
    np.testing.assert_array_equal(first.worst(first.cleared()).forward_amax, first.forward_amax)


def test_the_worst_of_records_of_different_programs_is_refused():
    with pytest.raises(ValueError, match="OverflowRecord.worst got records of different step functions"):
        _record([1.0], [1.0]).worst(_record([1.0, 2.0], [1.0, 2.0]))


def test_accumulated_micro_batches_name_the_layer_of_the_one_that_overflowed():
    """Two micro-batches, the second with the layer-3 term: the step's record names layer 3."""
    params = init_params(jax.random.key(0))
    scale = jaxamp.StaticLossScale(2.0**15)

    @jax.jit
    def records(terms):
        def micro_batch(term):
            return jaxamp.scaled_value_and_grad(loss_fn, scale, record_overflow=True)(params, X, term)[3]

        one, two = micro_batch(terms[0]), micro_batch(terms[1])
        return one, one.worst(two)

    only_first, both = records(jnp.array([0.0, LAYER_3_TERM]))
    assert only_first.first_overflow() is None
    first = both.first_overflow()
    assert (first.site.name, first.pass_) == ("layer_3", "backward")
