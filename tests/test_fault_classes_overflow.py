"""Fault classes of "why was my step skipped": the records of the last skipped step, and the guard.

* The non-finite leaves and the overflow record a state keeps are those of
  the *last* skipped step, never merged with an earlier skipped step's.
* `LossScaleStuckError` names where the non-finite gradients start: the
  deepest layer whose gradients are not finite, by the order the names give
  (``Dense_10`` after ``Dense_9``, nested modules, a list's indices), not the
  params' alphabetical order; and it says so when the names cannot tell.

Each test says which fault would make it fail.
"""

from __future__ import annotations

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxamp
from jaxamp.diagnostics import NonFiniteGradients, OverflowRecord, OverflowSite, nonfinite_grads_of

# --- the last skipped step's leaves, not a merge -----------------------------------------------

# Per step: the leaves made non-finite, and whether the caller lets the step through.
STEPS = [
    ({"a": jnp.inf, "b": jnp.nan}, True),  # skipped: a and b
    ({"c": -jnp.inf}, True),  # skipped: c alone
    ({}, True),  # applied: the record stays c's
    ({}, False),  # skipped by the caller, every leaf finite: no leaf named
    ({"a": jnp.nan}, True),  # skipped: a alone
]
# What the record names after each step: the leaves and the index of the last skipped step.
EXPECTED = [(["a", "b"], 0), (["c"], 1), (["c"], 1), ([], 3), (["a"], 4)]
PARAMS = {"a": jnp.ones(2), "b": jnp.ones(2), "c": jnp.ones(2)}


def grads_of(poisoned):
    return {name: jnp.full(2, poisoned.get(name, 0.5)) for name in PARAMS}


def through_train_state():
    state = jaxamp.TrainState.create(apply_fn=None, params=PARAMS, tx=optax.sgd(0.1))
    step = jax.jit(lambda state, grads, let: state.apply_gradients(grads=grads, grads_finite=let))
    for poisoned, let in STEPS:
        state = step(state, grads_of(poisoned), jnp.logical_and(jaxamp.all_finite(grads_of(poisoned)), let))
        yield state.nonfinite_grads


def through_loss_scaling():
    tx = jaxamp.loss_scaling(optax.sgd(0.1), jaxamp.DynamicLossScale())
    opt_state = tx.init(PARAMS)
    update = jax.jit(lambda grads, opt_state, let: tx.update(grads, opt_state, PARAMS, grads_finite=let)[1])
    for poisoned, let in STEPS:
        opt_state = update(
            grads_of(poisoned), opt_state, jnp.logical_and(jaxamp.all_finite(grads_of(poisoned)), let)
        )
        yield nonfinite_grads_of(opt_state)


def through_the_record_alone():
    record = NonFiniteGradients.for_params(PARAMS)
    after_step = jax.jit(lambda record, leaf_finite, finite: record.after_step(leaf_finite, finite))
    for poisoned, let in STEPS:
        leaf_finite = jnp.array([name not in poisoned for name in PARAMS])
        record = after_step(record, leaf_finite, jnp.logical_and(jnp.all(leaf_finite), let))
        yield record


@pytest.mark.parametrize("records", [through_train_state, through_loss_scaling, through_the_record_alone])
def test_each_skipped_step_names_its_own_nonfinite_leaves_and_none_of_an_earlier_ones(records):
    """Two skipped steps with different bad leaves, an applied step, a step the caller skips with
    every leaf finite, and a third bad step. Fails if a skipped step's leaves were merged (``|``)
    with the earlier ones, kept from the earlier step, or taken from an applied step; or if the
    step index were not the last skipped one's."""
    for index, (record, (paths, skipped_at)) in enumerate(zip(records(), EXPECTED, strict=True)):
        assert (record.nonfinite_paths(), int(record.skipped_at)) == (paths, skipped_at), f"step {index}"
        assert int(record.steps_taken) == index + 1
    assert record.summary() == "step 5 skipped: non-finite grads in 1 of 3 leaves: a"


def record_of(forward, backward):
    sites = tuple(
        OverflowSite(f"Dense_{index}", f"model.py:{index}", "dot_general", "float16", (8, 8))
        for index in range(3)
    )
    return OverflowRecord(jnp.array(forward, jnp.float32), jnp.array(backward, jnp.float32), sites, 0, True)


def test_the_kept_overflow_record_is_the_last_skipped_steps_and_not_the_worst_of_them():
    """Step 1 overflows backward in Dense_2, step 2 forward in Dense_0, step 3 is finite. Fails if
    the state merged the records (`worst`), kept the first one, or took the finite step's."""
    state = jaxamp.TrainState.create(apply_fn=None, params={"w": jnp.ones(2)}, tx=optax.sgd(0.1))
    step = jax.jit(lambda state, record, grads: state.apply_gradients(grads=grads, overflow_record=record))
    inf, finite, bad = jnp.inf, {"w": jnp.ones(2)}, {"w": jnp.full(2, jnp.inf)}
    state = step(state, record_of([1.0, 2.0, 3.0], [5.0, 6.0, inf]), bad)
    assert str(state.overflow_record.first_overflow()).startswith("backward overflow first in Dense_2")
    state = step(state, record_of([inf, 2.0, 3.0], [5.0, 6.0, 7.0]), bad)
    np.testing.assert_array_equal(state.overflow_record.backward_amax, [5.0, 6.0, 7.0])
    assert str(state.overflow_record.first_overflow()).startswith("forward overflow first in Dense_0")
    state = step(state, record_of([1.0, 1.0, 1.0], [1.0, 1.0, 1.0]), finite)
    np.testing.assert_array_equal(state.overflow_record.forward_amax, [inf, 2.0, 3.0])


# --- the guard names where the non-finite gradients start ---------------------------------------


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        for _ in range(3):
            x = nn.relu(nn.Dense(16)(x))
        return nn.Dense(10)(x)


@pytest.fixture(scope="module")
def overflow_storm():
    """A float16 MLP whose last kernel is 10,000 times too large: the cotangent of the third layer's
    output (Dense_3's backward matmul) overflows at every scale the run backs off to, so
    Dense_0 to Dense_2 have non-finite gradients and Dense_3 finite ones, step after step."""
    model = jaxamp.apply_policy(MLP(), "mixed_float16")
    x, labels = jax.random.normal(jax.random.key(0), (8, 32)), jnp.arange(8)
    params = model.init(jax.random.key(1), x)["params"]
    params["Dense_3"]["kernel"] = params["Dense_3"]["kernel"] * 1e4

    @jax.jit
    def train_step(state):
        def loss_fn(params):
            logits = model.apply({"params": params}, x)
            return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

        _, grads, grads_finite, record = jaxamp.scaled_value_and_grad(
            loss_fn, state.loss_scale, record_overflow=True
        )(state.params)
        return state.apply_gradients(grads=grads, grads_finite=grads_finite, overflow_record=record)

    state = jaxamp.TrainState.create(
        apply_fn=model.apply, params=params, tx=optax.adam(1e-3), loss_scale=jaxamp.DynamicLossScale()
    ).with_overflow_record_of(train_step)
    for _ in range(6):
        state = train_step(state)
    return state


def stuck_error(state):
    with pytest.raises(jaxamp.LossScaleStuckError) as raised:
        jaxamp.OverflowGuard(max_consecutive_skips=5).check(state)
    return raised.value


def test_the_guard_names_the_layer_where_the_nonfinite_gradients_start_and_the_record_that_names_the_op(
    overflow_storm,
):
    """Without a kept overflow record, the message names Dense_2 first (its leaves lead the list,
    where alphabetical order cut at four would hide them behind Dense_0 and Dense_1), advises a
    float32 override for it, and says that ``record_overflow=True`` names the op and the pass.
    Fails if the leaves were listed alphabetically, the deepest layer taken as the last one
    alphabetically or as the first, or the record's advice dropped."""
    error = stuck_error(overflow_storm.replace(overflow_record=None))
    assert error.nonfinite_paths == [
        f"Dense_{layer}/{name}" for layer in range(3) for name in ("bias", "kernel")
    ]
    assert error.deepest_layers == ["Dense_2"] and error.first_overflow is None
    message = str(error)
    assert (
        "The last skipped step's non-finite gradients start at Dense_2: the deepest layer whose gradients "
        "are not finite (by the order of the names, no layer after it has one), so the overflow is in its "
        "backward pass or in the op after it. 6 leaves, from there back: Dense_2/bias, Dense_2/kernel, "
        "Dense_1/bias, Dense_1/kernel and 2 more. The gradients overflow whatever the scale: try a float32 "
        "override for Dense_2 or the layer after it,"
    ) in message
    assert (
        "record_overflow=True in jaxamp.scaled_value_and_grad names the op that overflowed first and its "
        "pass (forward or backward)."
    ) in message


def test_with_a_kept_overflow_record_the_guard_names_the_first_op_that_overflowed(overflow_storm):
    """The record names Dense_3's backward matmul, which hands Dense_2 its overflowed cotangent.
    Fails if the guard ignored the state's record or still advised turning it on."""
    error = stuck_error(overflow_storm)
    assert error.first_overflow.startswith("backward overflow first in Dense_3 at ")
    assert f"The last skipped step's first overflow: {error.first_overflow}." in str(error)
    assert "record_overflow=True" not in str(error)


def nonfinite_in(paths, *layers):
    """A record of `paths` whose leaves under `layers` were not finite in step 1."""
    record = NonFiniteGradients.for_params({path: jnp.zeros(1) for path in paths})
    return record.after_step(
        jnp.array([not any(path.startswith(f"{layer}/") for layer in layers) for path in record.paths]),
        jnp.array(False),
    )


def leaves(*layers):
    return [f"{layer}/{name}" for layer in layers for name in ("bias", "kernel")]


@pytest.mark.parametrize(
    "paths, nonfinite, deepest",
    [
        # Dense_10 comes after Dense_9, though alphabetically it sorts right after Dense_1.
        (leaves(*(f"Dense_{i}" for i in range(12))), [f"Dense_{i}" for i in range(11)], "Dense_10"),
        (leaves(*(f"Dense_{i}" for i in range(12))), [f"Dense_{i}" for i in range(10)], "Dense_9"),
        # Nested modules: the block decides, then the layer inside it.
        (leaves("Block_0/Dense_0", "Block_0/Dense_1", "Block_1/Dense_0", "Block_1/Dense_1"),
         ["Block_0/Dense_0", "Block_0/Dense_1", "Block_1/Dense_0"], "Block_1/Dense_0"),
        (leaves("encoder/layers_9/mlp/Dense_1", "encoder/layers_10/mlp/Dense_0", "encoder/layers_10/mlp/Dense_1"),
         ["encoder/layers_9/mlp/Dense_1", "encoder/layers_10/mlp/Dense_0"], "encoder/layers_10/mlp/Dense_0"),
        # A list of layers (plain JAX): indices.
        (leaves(*map(str, range(12))), [str(i) for i in range(11)], "10"),
    ],
)  # fmt: skip
def test_the_deepest_nonfinite_layer_is_read_from_the_names_order_not_the_alphabet(paths, nonfinite, deepest):
    """Fails if the deepest layer were the last non-finite one in the params' (alphabetical) order
    (Dense_9 for Dense_10, layers_9 for layers_10), compared name by name as text, or if a deeper
    block were outranked by a deeper layer inside an earlier block."""
    record = nonfinite_in(paths, *nonfinite)
    assert record.deepest_layers() == [deepest]
    message = str(error_for(record))
    assert f"non-finite gradients start at {deepest}: " in message
    assert f"from there back: {deepest}/bias, {deepest}/kernel, " in message
    assert f"float32 override for {deepest} or the layer after it" in message


def error_for(record):
    return jaxamp.LossScaleStuckError(
        applied_steps=0,
        skipped_steps=1,
        consecutive_skipped_steps=1,
        loss_scale=1.0,
        min_loss_scale=None,
        reason="1 steps in a row overflowed (limit 1)",
        nonfinite_paths=record.nonfinite_paths(),
    )


@pytest.mark.parametrize(
    "nonfinite, candidates",
    [
        (["Conv_0", "Dense_0"], ["Conv_0", "Dense_0"]),  # two classes: Flax numbers each on its own
        (["decoder", "encoder"], ["decoder", "encoder"]),  # names with no number
        (["Dense_0", "Dense_1", "LayerNorm_0"], ["Dense_1", "LayerNorm_0"]),
        (["mlp", "mlp2"], ["mlp", "mlp2"]),  # a number on one name of a stem alone
    ],
)
def test_when_the_names_do_not_tell_which_layer_is_deepest_the_message_says_so(nonfinite, candidates):
    """Fails if the guard named one of the layers as the deepest (alphabetically last, say) where
    the names give no order between them."""
    record = nonfinite_in(
        leaves("Conv_0", "Dense_0", "Dense_1", "LayerNorm_0", "decoder", "encoder", "mlp", "mlp2"), *nonfinite
    )
    assert record.deepest_layers() == candidates
    message = str(error_for(record))
    assert (
        f"the names do not tell which of {', '.join(candidates)} runs last, so where they start: " in message
    )
    assert "start at" not in message and "float32 override for the layer that overflows" in message


def test_the_leaves_are_listed_from_the_deepest_layer_back_in_the_names_order():
    """Twelve blocks of one one-leaf layer, the last finite. Fails if the leaves were listed in
    the params' (alphabetical) order, or each path were ordered as one name."""
    paths = [f"layers_{index}/mlp/kernel" for index in range(12)]
    record = nonfinite_in(paths, *(f"layers_{index}/mlp" for index in range(11)))
    message = str(error_for(record))
    shown = ", ".join(f"layers_{index}/mlp/kernel" for index in (10, 9, 8, 7))
    assert f"11 leaves, from there back: {shown} and 7 more." in message


def test_a_step_skipped_with_every_leaf_finite_names_no_layer():
    """Fails if an empty record named a layer, or its leaves' sentence were written with none."""
    error = error_for(nonfinite_in(leaves("Dense_0")))
    assert error.deepest_layers == [] and "non-finite gradients" not in str(error)
    assert "float32 override for the layer that overflows" in str(error)


# --- what the records say, read whole ------------------------------------------------------------


def test_the_summaries_of_the_leaves_read_whole_from_no_skip_to_exactly_the_limit():
    """Fails if a summary's words changed, or "..." followed exactly `limit` leaves."""
    record = NonFiniteGradients.for_params(PARAMS)
    assert record.summary() == "no step skipped"
    skipped_for_another_reason = record.after_step(jnp.ones(3, bool), jnp.array(False))
    assert skipped_for_another_reason.summary() == (
        "step 1 skipped: every gradient leaf finite (the step was skipped for another reason)"
    )
    two_bad = record.after_step(jnp.array([False, False, True]), jnp.array(False))
    assert two_bad.summary(limit=2) == "step 1 skipped: non-finite grads in 2 of 3 leaves: a, b"
    assert two_bad.summary(limit=1) == "step 1 skipped: non-finite grads in 2 of 3 leaves: a, ..."


def test_a_records_summary_names_what_it_watched_and_an_op_named_by_its_source_line_once():
    """A forward-only record with unwatched matmuls and no overflow; a record whose first
    overflow is at a site named by its source line (NNX, plain JAX). Fails if a part of the
    line were dropped or reworded, or the source line written twice ("x.py:3 at x.py:3")."""
    record = record_of([1.0, 2.0, 3.0], [0.0, 0.0, 0.0])
    forward_only = record.replace(unrecorded=2, backward_recorded=False)
    assert forward_only.summary() == (
        "no overflow (3 matmuls and convolutions watched, 2 not (inside loops, conditionals, "
        "checkpoints or custom rules), forward only)"
    )
    at_a_line = OverflowSite("model.py:7", "model.py:7", "conv_general_dilated", "bfloat16", (2, 8))
    overflowed = record_of([1.0, 2.0, 3.0], [0.0, jnp.nan, 0.0]).replace(
        sites=(*record.sites[:1], at_a_line, record.sites[2])
    )
    first = overflowed.first_overflow()
    assert (first.site, first.pass_, first.index) == (at_a_line, "backward", 1)
    assert overflowed.summary() == (
        "backward overflow first in model.py:7 (conv_general_dilated, bfloat16, amax nan; the dtype's max "
        "is 3.38953e+38) (3 matmuls and convolutions watched, forward and backward)"
    )


def test_the_worst_of_two_records_takes_inf_over_nan_and_the_larger_finite_amax_site_by_site():
    """The micro-batches of one step are combined by `worst`: an inf (an overflow) outranks a NaN
    (what an inf turns into further on), and of two finite amaxes the larger is the one to report."""
    nan, inf = jnp.nan, jnp.inf
    combined = record_of([nan, 2.0, 5.0], [inf, 1.0, 3.0]).worst(record_of([inf, 4.0, 1.0], [nan, nan, 7.0]))
    np.testing.assert_array_equal(combined.forward_amax, [inf, 4.0, 5.0])
    np.testing.assert_array_equal(combined.backward_amax, [inf, nan, 7.0])


def test_records_of_different_step_functions_are_not_combined_naming_both_site_counts():
    message = (
        "OverflowRecord.worst got records of different step functions: one watches 3 sites, the other 2, "
        "or their sites differ. Combine or keep only the records of one step function (the micro-batches "
        "of one step, the steps of one run)."
    )
    two_sites = record_of([1.0] * 3, [1.0] * 3).replace(
        forward_amax=jnp.ones(2), backward_amax=jnp.ones(2), sites=record_of([1.0] * 3, [1.0] * 3).sites[:2]
    )
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        record_of([1.0] * 3, [1.0] * 3).worst(two_sites)


def test_record_overflow_of_something_not_callable_is_refused_naming_it():
    with pytest.raises(TypeError, match=r"^record_overflow needs a function; got int: 3\.$"):
        jaxamp.diagnostics.record_overflow(3)


def test_a_records_table_has_a_row_per_site_with_both_amaxes_to_four_digits():
    """Fails if a row, a column or the header changed, the amaxes were not to four significant
    digits, or a record without a backward pass showed its zeros instead of a dash."""
    record = record_of([1.5, jnp.inf, 12345.678], [jnp.nan, 2.0, 0.25])
    rows = [
        "| # | op | primitive | dtype | forward amax | backward amax |",
        "|---:|---|---|---|---:|---:|",
        "| 0 | Dense_0 | dot_general | float16 | 1.5 | {} |",
        "| 1 | Dense_1 | dot_general | float16 | inf | {} |",
        "| 2 | Dense_2 | dot_general | float16 | 1.235e+04 | {} |",
    ]
    assert record.table() == "\n".join(rows).format("nan", "2", "0.25")
    assert record.replace(backward_recorded=False).table() == "\n".join(rows).format("-", "-", "-")


MATMUL = jaxamp.autocast(lambda x, w: x @ w, "mixed_float16")


@pytest.mark.parametrize(
    "x, w, expected",
    [
        (jnp.full((1, 4), -2.0), jnp.ones((4, 1)), 8.0),  # one element
        (jnp.ones((0, 4)), jnp.ones((4, 3)), 0.0),  # no element
        (jnp.full((2, 4), jnp.nan), jnp.ones((4, 3)), jnp.nan),
        (jnp.array([[jnp.nan, 1.0], [jnp.inf, 1.0]]), jnp.ones((2, 3)), jnp.inf),  # an inf beats a NaN
    ],
    ids=["one element", "empty", "nan", "inf and nan"],
)
def test_a_matmuls_forward_amax_is_its_largest_magnitude_an_inf_before_a_nan(x, w, expected):
    """Fails if a one-element output were read as empty, an empty one failed, or a float16 NaN
    were taken for an inf (or the other way round)."""
    _, record = jaxamp.diagnostics.record_overflow(MATMUL)(x, w)
    np.testing.assert_array_equal(record.forward_amax, [expected])


def test_a_function_that_calls_no_autocast_records_no_site_and_no_pass():
    """Fails if the record of no call had amaxes, sites, unwatched ops or a backward pass."""
    output, record = jaxamp.diagnostics.record_overflow(lambda x: x * 2)(jnp.ones(3))
    np.testing.assert_array_equal(output, [2.0, 2.0, 2.0])
    assert (record.forward_amax.shape, record.backward_amax.shape, record.forward_amax.dtype) == (
        (0,),
        (0,),
        jnp.float32,
    )
    assert (record.sites, record.unrecorded, record.backward_recorded) == ((), 0, False)
    assert record.summary() == "no overflow (0 matmuls and convolutions watched, forward only)"


def test_the_leaves_of_an_equinox_model_are_named_by_their_attributes():
    """Equinox modules name their leaves by attribute (`GetAttrKey`). Fails if those names were
    read from another attribute of the key (``.weight`` or ``None`` in their place)."""
    import equinox as eqx

    model = eqx.nn.MLP(2, 2, width_size=3, depth=1, key=jax.random.key(0))
    record = NonFiniteGradients.for_params(eqx.filter(model, eqx.is_array))
    assert record.paths == ("layers/0/weight", "layers/0/bias", "layers/1/weight", "layers/1/bias")


def test_the_record_keeps_one_bool_per_leaf_through_a_step_so_a_jitted_step_keeps_its_structure():
    """Fails if the flags started as another dtype (float32 zeros) than a step makes (bool)."""
    record = NonFiniteGradients.for_params(PARAMS)
    after = record.after_step(jnp.array([True, False, True]), jnp.array(False))
    assert record.nonfinite.dtype == after.nonfinite.dtype == jnp.bool_
    assert jax.tree.structure(record) == jax.tree.structure(after)


def test_gradients_of_another_structure_are_refused_naming_the_params_and_the_fix():
    record = NonFiniteGradients.for_params({name: jnp.zeros(2) for name in "abcde"})
    message = (
        "The gradients have 3 leaves, but the optimizer state was made for params with 5 (a, b, c, ...). "
        "Pass gradients with the structure of the params the state was initialized with."
    )
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        record.after_step(jnp.ones([3], bool), jnp.array(False))
