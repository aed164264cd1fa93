"""Tests for `jaxamp.TrainState`: skipped steps, resumed training, no retrace."""

import functools
import re
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxamp

INPUTS = jax.random.normal(jax.random.key(1), (8, 4))
OTHER_INPUTS = jax.random.normal(jax.random.key(2), (8, 4)) * 3.0 + 1.0
TARGETS = jnp.sum(INPUTS, axis=1, keepdims=True)
CLEAN, INF, NAN = 1.0, float("inf"), float("nan")


class Regressor(nn.Module):
    @nn.compact
    def __call__(self, x, train):
        x = nn.Dense(8)(x)
        x = nn.BatchNorm(use_running_average=not train)(x)
        return nn.Dense(1)(nn.relu(x))


MODEL = jaxamp.apply_policy(Regressor(), "mixed_float16")


@functools.cache
def initial_variables():
    return jax.jit(functools.partial(MODEL.init, train=False))(jax.random.key(0), INPUTS)


def create_state(loss_scale):
    variables = initial_variables()
    return jaxamp.TrainState.create(
        apply_fn=MODEL.apply,
        params=variables["params"],
        tx=optax.adam(1e-2),
        loss_scale=loss_scale,
        batch_stats=variables["batch_stats"],
    )


def make_train_step():
    """A jitted train step, and the list it appends to each time it is traced.

    The step multiplies one gradient leaf by `poison`: 1.0 leaves it alone,
    inf or NaN makes the step's gradients non-finite, as an overflow would.
    """
    traces = []

    @jax.jit
    def train_step(state, inputs, targets, poison):
        traces.append(None)

        def loss_fn(params):
            predictions, updates = state.apply_fn(
                {"params": params, "batch_stats": state.batch_stats},
                inputs,
                train=True,
                mutable=["batch_stats"],
            )
            return jnp.mean((predictions - targets) ** 2), updates["batch_stats"]

        (loss, batch_stats), grads, grads_finite = jaxamp.scaled_value_and_grad(
            loss_fn, state.loss_scale, has_aux=True
        )(state.params)
        kernel = grads["Dense_0"]["kernel"]
        grads = {**grads, "Dense_0": {**grads["Dense_0"], "kernel": kernel * poison}}
        grads_finite = grads_finite & jaxamp.all_finite(grads)
        state = state.apply_gradients(grads=grads, grads_finite=grads_finite, batch_stats=batch_stats)
        return state, loss

    return train_step, traces


@functools.cache
def shared_train_step():
    return make_train_step()[0]


def assert_bit_identical(actual, expected):
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    for got, want in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        got, want = np.asarray(got), np.asarray(want)
        np.testing.assert_array_equal(got, want)
        assert (got.dtype, got.shape, got.tobytes()) == (want.dtype, want.shape, want.tobytes())


def trees_differ(first, second):
    return any(
        not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(second), strict=True)
    )


def test_create_sets_every_field_and_starts_counters_as_int32_arrays():
    state = create_state(jaxamp.DynamicLossScale())
    variables = initial_variables()
    for counter in (state.step, state.skipped_steps):
        assert isinstance(counter, jax.Array)
        assert (counter.shape, counter.dtype, counter.item()) == ((), jnp.int32, 0)
    assert_bit_identical(state.params, variables["params"])
    assert_bit_identical(state.batch_stats, variables["batch_stats"])
    assert_bit_identical(state.opt_state, optax.adam(1e-2).init(variables["params"]))
    assert isinstance(state.loss_scale, jaxamp.DynamicLossScale)
    assert state.apply_fn == MODEL.apply


def test_create_defaults_to_no_loss_scale_and_no_batch_stats_for_a_float32_model():
    state = jaxamp.TrainState.create(apply_fn=None, params={"w": jnp.ones(2)}, tx=optax.sgd(0.1))
    assert isinstance(state.loss_scale, jaxamp.NoOpLossScale)
    assert state.batch_stats is None


@pytest.mark.parametrize(
    ("policy", "expected"),
    [("mixed_float16", jaxamp.DynamicLossScale), ("float16", jaxamp.DynamicLossScale),
     ("mixed_bfloat16", jaxamp.NoOpLossScale), ("float32", jaxamp.NoOpLossScale)],
)  # fmt: skip
def test_create_without_a_loss_scale_gives_a_policy_model_the_one_its_policy_needs(policy, expected):
    """A float16 model made without a loss scale trained with none: its small gradients underflowed."""
    model = jaxamp.apply_policy(Regressor(), policy)
    variables = jax.eval_shape(functools.partial(model.init, train=False), jax.random.key(0), INPUTS)
    state = jaxamp.TrainState.create(apply_fn=model.apply, params=variables["params"], tx=optax.sgd(0.1))
    assert type(state.loss_scale) is expected
    assert state.loss_scale == jaxamp.default_loss_scale(policy)


def test_create_without_a_loss_scale_gives_float16_params_a_dynamic_one():
    params = {"w": jnp.ones(2, jnp.float16), "b": jnp.zeros(1)}
    tx = jaxamp.low_precision_optimizer(optax.sgd(0.1), param_dtype=None, state_dtype=jnp.float32)
    state = jaxamp.TrainState.create(apply_fn=None, params=params, tx=tx)
    assert state.loss_scale == jaxamp.DynamicLossScale()


def test_create_without_a_loss_scale_gives_bfloat16_params_none():
    """bfloat16 holds float32's range: no loss scale to grow or skip steps by."""
    params = {"w": jnp.ones(2, jnp.bfloat16), "b": jnp.zeros(1)}
    tx = jaxamp.low_precision_optimizer(optax.sgd(0.1), param_dtype=None, state_dtype=jnp.float32)
    state = jaxamp.TrainState.create(apply_fn=None, params=params, tx=tx)
    assert state.loss_scale == jaxamp.NoOpLossScale()


class TrainStateWithAverage(jaxamp.TrainState):
    """A subclass with one more field, as users add one for an EMA of the params."""

    average: Any = None


class InitOnly:
    """Half an optimizer: `init` but no `update`."""

    def init(self, params):
        return ()

    def __repr__(self):
        return "InitOnly()"


@pytest.mark.parametrize("tx, shown", [("sgd", "'sgd'"), (InitOnly(), "InitOnly()")], ids=["string", "init_only"])
def test_create_needs_an_optax_optimizer(tx, shown):
    message = f"TrainState.create needs tx to be an optax optimizer (with init and update); got {shown}."
    with pytest.raises(TypeError, match=f"^{re.escape(message)}$"):
        jaxamp.TrainState.create(apply_fn=None, params={"w": jnp.ones(2)}, tx=tx)


def test_create_passes_the_fields_of_a_subclass_on():
    state = TrainStateWithAverage.create(
        apply_fn=None, params={"w": jnp.ones(2)}, tx=optax.sgd(0.1), average={"w": jnp.zeros(2)}
    )
    np.testing.assert_array_equal(state.average["w"], jnp.zeros(2))


def test_the_optimizer_sees_the_params_so_weight_decay_applies():
    params = {"w": jnp.full(2, 2.0)}
    state = jaxamp.TrainState.create(
        apply_fn=None, params=params, tx=optax.adamw(0.5, weight_decay=0.1), loss_scale=jaxamp.DynamicLossScale()
    )
    stepped = state.apply_gradients(grads={"w": jnp.zeros(2)}, grads_finite=jnp.array(True))
    # Zero gradients leave only the decoupled decay: w - lr * weight_decay * w.
    np.testing.assert_allclose(stepped.params["w"], [2.0 - 0.5 * 0.1 * 2.0] * 2, rtol=1e-6)


@pytest.mark.parametrize(
    "loss_scale, poison, scale_after_overflow",
    [
        (jaxamp.DynamicLossScale(2.0**10), INF, 2.0**9),
        (jaxamp.DynamicLossScale(2.0**10), NAN, 2.0**9),
        (jaxamp.StaticLossScale(2.0**10), INF, 2.0**10),
        (jaxamp.NoOpLossScale(), NAN, 1.0),
    ],
    ids=["dynamic-inf", "dynamic-nan", "static-inf", "no_op-nan"],
)
def test_an_overflow_leaves_the_state_untouched_then_clean_steps_resume_training(
    loss_scale, poison, scale_after_overflow
):
    train_step = shared_train_step()
    trained, _ = train_step(create_state(loss_scale), INPUTS, TARGETS, CLEAN)
    assert trained.step == 1

    # A finite step on these inputs would move the batch statistics...
    stepped, _ = train_step(trained, OTHER_INPUTS, TARGETS, CLEAN)
    assert trees_differ(stepped.batch_stats, trained.batch_stats)
    # ...an overflowed one changes nothing but the scale and the skip counters.
    skipped, _ = train_step(trained, OTHER_INPUTS, TARGETS, poison)
    assert_bit_identical(skipped.params, trained.params)
    assert_bit_identical(skipped.opt_state, trained.opt_state)
    assert_bit_identical(skipped.batch_stats, trained.batch_stats)
    assert_bit_identical(skipped.step, trained.step)
    assert skipped.skipped_steps.item() == 1
    assert skipped.loss_scale.loss_scale.item() == scale_after_overflow
    if isinstance(loss_scale, jaxamp.DynamicLossScale):
        assert skipped.loss_scale.skipped_steps.item() == 1

    state, losses = skipped, []
    for expected_step in range(2, 7):
        previous = state
        state, loss = train_step(state, INPUTS, TARGETS, CLEAN)
        losses.append(loss.item())
        assert state.step.item() == expected_step
        assert trees_differ(state.params, previous.params)
        assert trees_differ(state.batch_stats, previous.batch_stats)
    assert state.skipped_steps.item() == 1
    assert losses[-1] < losses[0]


def test_the_jitted_step_traces_once_from_create_through_skipped_and_clean_steps():
    train_step, traces = make_train_step()
    state = create_state(jaxamp.DynamicLossScale(2.0**10, period=2))
    for poison in [CLEAN, INF, CLEAN, CLEAN, NAN, CLEAN]:
        state, _ = train_step(state, INPUTS, TARGETS, jnp.float32(poison))
    assert len(traces) == 1
    assert (state.step.item(), state.skipped_steps.item()) == (4, 2)


def test_the_state_survives_jit_tree_map_and_lower():
    state = create_state(jaxamp.DynamicLossScale(2.0**10, period=7, min_loss_scale=4))
    for survivor in [
        jax.jit(lambda s: s)(state),
        jax.tree.map(lambda leaf: leaf, state),
        jax.jit(lambda s: s).lower(state).compile()(state),
    ]:
        assert type(survivor) is jaxamp.TrainState
        assert_bit_identical(survivor, state)
        assert (survivor.loss_scale.period, survivor.loss_scale.min_loss_scale) == (7, 4)
        assert survivor.apply_fn == state.apply_fn and survivor.tx is state.tx


def primitives(jaxpr):
    """Names of every primitive in `jaxpr`, nested jaxprs included."""
    names = set()
    for equation in jaxpr.eqns:
        names.add(equation.primitive.name)
        for param in equation.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    names |= primitives(sub.jaxpr)
                elif isinstance(sub, jax.extend.core.Jaxpr):
                    names |= primitives(sub)
    return names


def test_skipping_is_a_select_with_no_branch_and_no_host_callback():
    state = create_state(jaxamp.DynamicLossScale())
    jaxpr = jax.make_jaxpr(
        lambda state, grads, grads_finite: state.apply_gradients(
            grads=grads, grads_finite=grads_finite, batch_stats=state.batch_stats
        )
    )(state, state.params, jnp.array(True))
    used = primitives(jaxpr.jaxpr)
    assert "select_n" in used
    assert not used & {"cond", "while", "pure_callback", "io_callback", "debug_callback"}


def source(jaxpr, var):
    """`var` traced back through casts and broadcasts to where its value comes from."""
    producers = {outvar: equation for equation in jaxpr.eqns for outvar in equation.outvars}
    while var in producers and producers[var].primitive.name in ("convert_element_type", "broadcast_in_dim"):
        var = producers[var].invars[0]
    return var


def find_select(jaxpr, var):
    """(predicate, on_false, on_true) of the select that produces `var`, or None.

    Follows `var` into the nested jaxpr of a ``jit`` (``jnp.where`` is one) and
    maps the select's operands back to variables of `jaxpr`.
    """
    var = source(jaxpr, var)
    producer = next((equation for equation in jaxpr.eqns if var in equation.outvars), None)
    if producer is None:
        return None
    if producer.primitive.name == "select_n" and len(producer.invars) == 3:
        return tuple(source(jaxpr, operand) for operand in producer.invars)
    inner = producer.params.get("jaxpr")
    if isinstance(inner, jax.extend.core.ClosedJaxpr):
        found = find_select(inner.jaxpr, inner.jaxpr.outvars[producer.outvars.index(var)])
        if found is None:
            return None
        outer_of = dict(zip(inner.jaxpr.invars, producer.invars, strict=True))
        return tuple(source(jaxpr, outer_of.get(operand, operand)) for operand in found)
    return None


def test_every_param_and_optimizer_state_leaf_is_a_select_on_grads_finite_keeping_the_old_value():
    state = create_state(jaxamp.DynamicLossScale())

    def apply_gradients(state, grads, grads_finite):
        return state.apply_gradients(grads=grads, grads_finite=grads_finite, batch_stats=state.batch_stats)

    args = (state, state.params, jnp.array(True))
    jaxpr = jax.make_jaxpr(apply_gradients)(*args).jaxpr
    input_paths = [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(args)[0]]
    input_of = dict(zip(input_paths, jaxpr.invars, strict=True))
    grads_finite = jaxpr.invars[-1]
    output = jax.eval_shape(apply_gradients, *args)
    output_paths = [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(output)[0]]

    checked = 0
    for path, outvar in zip(output_paths, jaxpr.outvars, strict=True):
        if not path.startswith((".params", ".opt_state")):
            continue
        select = find_select(jaxpr, outvar)
        assert select is not None, f"{path} is not selected"
        predicate, on_false, _ = select
        assert predicate is grads_finite, path
        assert on_false is input_of[f"[0]{path}"], path
        checked += 1
    params_and_opt_state = jax.tree.leaves((state.params, state.opt_state))
    assert checked == len(params_and_opt_state) > 8


def poisoned(grads, value):
    return jax.tree.map(lambda grad: grad.at[0].set(value) if grad.ndim else jnp.asarray(value), grads)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_apply_gradients_computes_grads_finite_when_not_given(jit):
    state = jaxamp.TrainState.create(
        apply_fn=None, params={"w": jnp.ones(3)}, tx=optax.sgd(0.5), loss_scale=jaxamp.DynamicLossScale(8.0)
    )
    grads = {"w": jnp.ones(3)}

    def apply_gradients(state, grads):
        return state.apply_gradients(grads=grads)

    apply_gradients = jax.jit(apply_gradients) if jit else apply_gradients
    skipped = apply_gradients(state, poisoned(grads, INF))
    assert_bit_identical(skipped.params, state.params)
    assert (skipped.step.item(), skipped.skipped_steps.item(), skipped.loss_scale.loss_scale.item()) == (
        0,
        1,
        4.0,
    )
    stepped = apply_gradients(skipped, grads)
    np.testing.assert_array_equal(stepped.params["w"], [0.5, 0.5, 0.5])
    assert (stepped.step.item(), stepped.skipped_steps.item()) == (1, 1)


@pytest.mark.parametrize(
    "field", ["params", "step", "opt_state", "loss_scale", "skipped_steps", "tx", "apply_fn"]
)
def test_fields_that_apply_gradients_manages_cannot_be_passed_as_updates(field):
    state = create_state(jaxamp.NoOpLossScale())
    with pytest.raises(TypeError, match=field):
        state.apply_gradients(grads=state.params, **{field: getattr(state, field)})


def test_managed_fields_passed_as_updates_are_named_together_with_the_way_out():
    state = create_state(jaxamp.NoOpLossScale())
    message = (
        "apply_gradients manages params, step itself; pass only other fields "
        "(e.g. batch_stats=...) as updates."
    )
    with pytest.raises(TypeError, match=f"^{re.escape(message)}$"):
        state.apply_gradients(grads=state.params, step=state.step, params=state.params)


def test_an_unknown_update_name_lists_the_updatable_fields_of_the_class():
    state = TrainStateWithAverage.create(apply_fn=None, params={"w": jnp.ones(2)}, tx=optax.sgd(0.1))
    message = "TrainState has no field batch_statz, statz; fields that can be updated: average, batch_stats."
    with pytest.raises(TypeError, match=f"^{re.escape(message)}$"):
        state.apply_gradients(grads=state.params, statz=1, batch_statz=state.batch_stats)


def test_an_update_of_another_structure_is_rejected():
    state = create_state(jaxamp.NoOpLossScale())
    expected = (
        r"^apply_gradients got batch_stats with a structure different from the state's: "
        rf"{re.escape(str(jax.tree.structure({})))} vs "
        rf"{re.escape(str(jax.tree.structure(state.batch_stats)))}\. "
        r"Create the state with batch_stats= its initial value\.$"
    )
    with pytest.raises(ValueError, match=expected):
        state.apply_gradients(grads=state.params, batch_stats={})


def test_an_overflow_never_reaches_a_gradient_accumulator_so_multisteps_stays_clean():
    # optax.MultiSteps around optax.apply_if_finite keeps the inf in its
    # accumulator; here a skipped step never reaches the optimizer at all.
    variables = initial_variables()
    state = jaxamp.TrainState.create(
        apply_fn=MODEL.apply,
        params=variables["params"],
        tx=optax.MultiSteps(optax.sgd(0.1), every_k_schedule=2),
        loss_scale=jaxamp.DynamicLossScale(),
        batch_stats=variables["batch_stats"],
    )
    train_step = shared_train_step()
    state, _ = train_step(state, INPUTS, TARGETS, CLEAN)
    skipped, _ = train_step(state, INPUTS, TARGETS, INF)
    assert_bit_identical(skipped.opt_state, state.opt_state)

    for _ in range(4):
        skipped, _ = train_step(skipped, INPUTS, TARGETS, CLEAN)
    assert jaxamp.all_finite((skipped.params, skipped.opt_state)).item()
    assert trees_differ(skipped.params, state.params)
