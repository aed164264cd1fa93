"""`jaxamp.autocast`: the dtype rules, the opt-out, the cache, NNX, training.

Model families are in test_autocast_models.py and the higher-order
primitives in test_autocast_higher_order.py.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.extend.core import ClosedJaxpr, Jaxpr, Primitive
from jax.interpreters import mlir

import jaxamp
from tests.autocast_models import NnxMLP, _batch, _dense_params, _xent, plain_mlp


def _all_equations(jaxpr):
    for equation in jaxpr.eqns:
        yield equation
        for value in equation.params.values():
            if isinstance(value, (ClosedJaxpr, Jaxpr)):
                yield from _all_equations(getattr(value, "jaxpr", value))


def _equation_dtypes(fun, *args, primitive):
    """The output dtype of each `primitive` equation in the jaxpr of `fun`, nested jits included."""
    return [
        equation.outvars[0].aval.dtype
        for equation in _all_equations(jax.make_jaxpr(fun)(*args).jaxpr)
        if equation.primitive.name == primitive
    ]


X = jax.random.normal(jax.random.key(0), (4, 8))
W = jax.random.normal(jax.random.key(1), (8, 8)) / 3


def test_outputs_come_back_in_the_dtypes_the_function_returns_for_its_float32_arguments():
    """The function is traced with half arguments; what it returns in half comes back in float32.

    An output the function gives in the compute dtype is returned in the
    dtype of the arguments traced down to it (float32), like the matmul's
    result here; an explicit cast to that dtype cannot be told apart from it
    in the half trace. Other dtypes come back as returned. With the
    arguments traced as given (``float32_argnums``), the trace is the
    float32 program's and every output has its dtype exactly.
    """

    def fun(x, w):
        h = x @ w
        return {
            "f32": h,
            "i32": jnp.argmax(h, axis=-1),
            "bf16": h.astype(jnp.bfloat16),
            "f16": (x @ w).astype(jnp.float16),
        }

    expected = jax.tree.map(lambda leaf: leaf.dtype, fun(X, W))
    widened = {**expected, "f16": jnp.dtype(jnp.float32)}
    assert jax.tree.map(lambda leaf: leaf.dtype, jaxamp.autocast(fun)(X, W)) == widened
    as_given = jaxamp.autocast(fun, float32_argnums=(0, 1))
    assert jax.tree.map(lambda leaf: leaf.dtype, as_given(X, W)) == expected
    assert (
        jax.tree.map(lambda leaf: leaf.dtype, jaxamp.autocast(fun, float32_argnames="w")(X, w=W)) == widened
    )


def test_the_function_is_traced_with_its_floating_arguments_in_the_compute_dtype():
    """And, where that changed a dtype, a second time as given, to read the literals as written."""
    seen = []

    def fun(x, w, steps):
        seen.append((x.dtype, w.dtype, steps.dtype))
        return x @ w

    steps = jnp.arange(3)
    jaxamp.autocast(fun, "mixed_bfloat16")(X, W, steps)
    jaxamp.autocast(fun, "mixed_bfloat16", float32_argnums=1)(X, W, steps)
    jaxamp.autocast(fun, "float32")(X, W, steps)
    bf16, f32, i32 = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32), jnp.dtype(jnp.int32)
    as_given = (f32, f32, i32)
    assert seen == [(bf16, bf16, i32), as_given, (bf16, f32, i32), as_given, as_given]


@pytest.mark.parametrize(
    "bad, match",
    [
        ({"float32_argnums": "0"}, "float32_argnums must be ints"),
        ({"float32_argnames": 1}, "float32_argnames must be strs"),
    ],
)
def test_float32_arguments_named_wrongly_are_an_error(bad, match):
    with pytest.raises(TypeError, match=match):
        jaxamp.autocast(lambda x: x, **bad)


def test_a_scalar_literal_does_not_pull_a_float16_value_back_to_float32():
    assert _equation_dtypes(jaxamp.autocast(lambda x, w: 0.5 * (x @ w)), X, W, primitive="mul") == [
        jnp.float16
    ]


def test_a_mask_constant_that_float16_cannot_hold_keeps_its_select_in_float32():
    """Traced in float16, JAX makes the Python constant -1e9 -inf; autocast reads it as written
    (from a trace as given), so the select that holds it runs in float32, as traced as given, and a
    fully masked row softmaxes to a uniform row as in float32, not to NaN."""
    mask = jnp.tril(jnp.ones((4, 4), bool)).at[0].set(False)

    def attention_weights(q, k):
        logits = jnp.where(mask, q @ k.T, -1e9)
        return jax.nn.softmax(logits, axis=-1)

    q, k = X, X[::-1]
    for fun in (jaxamp.autocast(attention_weights), jaxamp.autocast(attention_weights, float32_argnums=(0, 1))):
        assert _equation_dtypes(fun, q, k, primitive="select_n") == [jnp.float32]
        weights = fun(q, k)
        np.testing.assert_allclose(weights[0], np.full(4, 0.25), rtol=1e-3)
        np.testing.assert_allclose(weights, attention_weights(q, k), atol=2e-2)


def test_a_matmul_output_beyond_float16_range_overflows_unless_bfloat16_or_the_float32_scope():
    x, w = jnp.full((2, 256), 30.0), jnp.full((256, 2), 30.0)  # every output is 230400 > 65504

    def scoped(x, w):
        with jaxamp.float32_scope():
            return x @ w

    assert bool(jnp.all(jnp.isinf(jaxamp.autocast(lambda x, w: x @ w)(x, w))))
    np.testing.assert_allclose(jaxamp.autocast(scoped)(x, w), x @ w)
    np.testing.assert_allclose(jaxamp.autocast(lambda x, w: x @ w, "mixed_bfloat16")(x, w), x @ w, rtol=1e-2)


def test_a_user_written_square_overflows_float16_where_jnp_square_does_not():
    x, w = jnp.full((1, 2), 300.0), jnp.eye(2)  # the matmul output 300 is a float16 value; 300**2 is not

    assert bool(jnp.isinf(jaxamp.autocast(lambda x, w: (x @ w) * (x @ w))(x, w)).all())
    np.testing.assert_allclose(jaxamp.autocast(lambda x, w: jnp.square(x @ w))(x, w), 90000.0)


def test_an_explicit_cast_in_the_users_code_is_honoured():
    def fun(x, w):
        return (x @ w).astype(jnp.bfloat16) * 2

    assert _equation_dtypes(jaxamp.autocast(fun), X, W, primitive="mul") == [jnp.bfloat16]


def test_an_int8_matmul_is_left_alone():
    def fun(x, w):
        return jax.lax.dot(x, w, preferred_element_type=jnp.int32)

    x, w = X.astype(jnp.int8), W.astype(jnp.int8)
    assert _equation_dtypes(jaxamp.autocast(fun), x, w, primitive="dot_general") == [jnp.int32]
    np.testing.assert_array_equal(jaxamp.autocast(fun)(x, w), fun(x, w))


def test_the_float32_scope_keeps_its_matmuls_in_float32_forward_and_backward():
    def loss(x, w):
        h = jnp.tanh(x @ w)
        with jaxamp.float32_scope():
            h = h @ w
        return h.sum()

    forward = jaxamp.precision_report(jaxamp.autocast(loss), X, W)
    assert forward.count_by_dtype() == {"float16": 1, "float32": 1}
    twice = jaxamp.autocast(jaxamp.autocast(loss))  # the rewritten jaxpr keeps the scope's name
    assert jaxamp.precision_report(twice, X, W).count_by_dtype() == {"float16": 1, "float32": 1}
    for backward in (jax.grad(jaxamp.autocast(loss)), jaxamp.autocast(jax.grad(loss))):
        counts = jaxamp.precision_report(backward, X, W).count_by_dtype()
        assert counts["float32"] >= 2 and counts["float16"] >= 1, counts


def test_overrides_change_the_rule_of_a_primitive():
    no_half = jaxamp.autocast(lambda x, w: x @ w, overrides={"dot_general": "float32"})
    assert jaxamp.precision_report(no_half, X, W).fraction(jnp.float32) == 1.0
    # "restore" runs it as traced: in the compute dtype, as the function was traced.
    as_traced = jaxamp.autocast(lambda x, w: x @ w, overrides={"dot_general": "restore"})
    assert jaxamp.precision_report(as_traced, X, W).fraction(jnp.float16) == 1.0
    tanh_in_float32 = jaxamp.autocast(lambda x, w: jnp.tanh(x @ w), overrides={"tanh": "float32"})
    assert _equation_dtypes(tanh_in_float32, X, W, primitive="tanh") == [jnp.float32]


@pytest.mark.parametrize(
    "overrides, error, match",
    [
        ({"exp": "half"}, ValueError, "Unknown autocast rule 'half' for primitive 'exp'.*compute, float32"),
        ({"scan": "follow"}, ValueError, "'scan' carries a jaxpr; its only override is 'restore'"),
        ([("exp", "follow")], TypeError, "must map primitive names to rule names"),
    ],
)
def test_a_bad_override_is_an_error_naming_it(overrides, error, match):
    with pytest.raises(error, match=match):
        jaxamp.autocast(jnp.exp, overrides=overrides)


def _primitive_with_a_body(name, *, lowered=True):
    """A user's own primitive carrying a jaxpr; a real one has a lowering, so JAX registers it."""
    primitive = Primitive(name)
    primitive.def_impl(lambda x, *, body: x)
    primitive.def_abstract_eval(lambda x, *, body: x)
    if lowered:
        mlir.register_lowering(primitive, mlir.lower_fun(lambda x, *, body: x, multiple_results=False))
    body = jax.make_jaxpr(jnp.sin)(1.0)
    return primitive, lambda x: primitive.bind(x, body=body)


def test_an_unknown_primitive_that_carries_a_jaxpr_is_an_error_naming_it():
    primitive, opaque = _primitive_with_a_body("my_opaque_loop")
    with pytest.raises(
        NotImplementedError, match="'my_opaque_loop'.*overrides=\\{'my_opaque_loop': 'restore'\\}"
    ):
        jaxamp.autocast(opaque)(X)
    # Run as traced: in float16, the dtype X was traced in, and widened back on the way out.
    traced = X.astype(jnp.float16).astype(jnp.float32)
    np.testing.assert_array_equal(jaxamp.autocast(opaque, overrides={"my_opaque_loop": "restore"})(X), traced)
    np.testing.assert_array_equal(jaxamp.autocast(opaque, overrides={primitive: "restore"})(X), traced)


def test_a_primitive_without_a_lowering_is_overridden_by_the_object_not_the_name():
    primitive, opaque = _primitive_with_a_body("my_unlowered_loop", lowered=False)
    with pytest.raises(ValueError, match="'my_unlowered_loop', which JAX does not have.*object itself"):
        jaxamp.autocast(opaque, overrides={"my_unlowered_loop": "restore"})
    as_given = jaxamp.autocast(opaque, overrides={primitive: "restore"}, float32_argnums=0)
    np.testing.assert_array_equal(as_given(X), X)


def test_overrides_take_the_primitive_objects_jax_exports():
    tanh_in_float32 = jaxamp.autocast(lambda x, w: jnp.tanh(x @ w), overrides={jax.lax.tanh_p: "float32"})
    assert _equation_dtypes(tanh_in_float32, X, W, primitive="tanh") == [jnp.float32]


def test_a_misspelt_primitive_name_is_an_error_suggesting_jaxs_name():
    """main accepted any string, so {"scatter_add": ...} silently changed nothing."""
    suggestion = "'scatter_add', which JAX does not have. Did you mean 'scatter-add'"
    with pytest.raises(ValueError, match=suggestion):
        jaxamp.autocast(jnp.exp, overrides={"scatter_add": "restore"})
    with pytest.raises(TypeError, match="keys must be primitives or their names.*got 3"):
        jaxamp.autocast(jnp.exp, overrides={3: "restore"})


def test_a_second_eager_call_neither_traces_nor_rewrites_again():
    traces = []

    @jaxamp.autocast
    def fun(x, w, *, scale):
        traces.append(scale)
        return jnp.tanh(x @ w) * scale

    first = fun(X, W, scale=2.0)
    np.testing.assert_array_equal(fun(X, W, scale=2.0), first)
    assert (len(traces), fun.rewrites.traces) == (2, 1)  # traced in float16, and as given for its literals
    fun(X[:2], W, scale=2.0)  # a new shape traces again
    fun(X, W, scale=3.0)  # so does a new static argument
    assert (len(traces), fun.rewrites.traces) == (6, 3)


def test_a_second_eager_call_compiles_nothing_even_with_a_nested_jit():
    compiles = []

    def count(event, *args, **kwargs):
        if "compile" in event:
            compiles.append(event)

    fun = jaxamp.autocast(lambda x, w: jax.jit(lambda x, w: jnp.tanh(x @ w))(x, w).sum())
    fun(X, W)
    jax.monitoring.register_event_duration_secs_listener(count)
    try:
        fun(X, W)
        assert compiles == []
        jaxamp.autocast(fun.__wrapped__)(X, W)  # a fresh autocast rewrites and compiles the jit again
        assert compiles != []
    finally:
        jax.monitoring.unregister_event_duration_listener(count)


def test_an_int_and_a_float_static_argument_are_different_signatures():
    fun = jaxamp.autocast(lambda x, power: x**power)
    assert fun(X, 2).dtype == jnp.float32
    assert fun(X, 2.0).dtype == jnp.float32
    assert fun.rewrites.traces == 2


def test_a_function_closing_over_traced_params_differentiates_through_them():
    def loss(w):
        return jaxamp.autocast(lambda x: jnp.tanh(x @ w).sum())(X)

    np.testing.assert_allclose(
        jax.grad(loss)(W), jax.grad(lambda w: jnp.tanh(X @ w).sum())(W), rtol=2e-2, atol=2e-2
    )


def test_decorator_forms_take_the_policy():
    @jaxamp.autocast
    def default(x, w):
        return x @ w

    @functools.partial(jaxamp.autocast, policy="mixed_bfloat16")
    def bfloat16(x, w):
        return x @ w

    assert jaxamp.precision_report(default, X, W).fraction(jnp.float16) == 1.0
    assert jaxamp.precision_report(bfloat16, X, W).fraction(jnp.bfloat16) == 1.0
    assert default.__name__ == "default"


def test_a_float32_policy_changes_nothing():
    loss_fn, params, batch = plain_mlp()
    assert (
        jaxamp.precision_report(jaxamp.autocast(loss_fn, "float32"), params, *batch).fraction(jnp.float32)
        == 1.0
    )
    np.testing.assert_allclose(
        jaxamp.autocast(loss_fn, "float32")(params, *batch), loss_fn(params, *batch), rtol=1e-6
    )


def test_autocast_of_something_that_is_not_a_function_says_so():
    with pytest.raises(TypeError, match="autocast needs a function to transform; got Array"):
        jaxamp.autocast(X)
    with pytest.raises(ValueError, match="unknown precision policy 'half_float'"):
        jaxamp.autocast(jnp.exp, "half_float")


def test_jit_of_autocast_compiles_the_same_matmuls_as_a_hand_written_float16_model():
    loss_fn, params, (x, y) = plain_mlp()

    def hand_written(params, x, y):
        h = x.astype(jnp.float16)
        for layer in params[:-1]:
            h = jax.nn.gelu(h @ layer["w"].astype(jnp.float16) + layer["b"].astype(jnp.float16))
            h = 0.5 * h
        logits = h @ params[-1]["w"].astype(jnp.float16) + params[-1]["b"].astype(jnp.float16)
        return _xent(logits.astype(jnp.float32), y)

    def dots(fun):
        text = jax.jit(fun).lower(params, x, y).as_text()
        return [line.split("->")[-1].strip() for line in text.splitlines() if "dot_general" in line]

    assert dots(jaxamp.autocast(loss_fn)) == dots(hand_written)
    assert all("f16" in dot for dot in dots(jaxamp.autocast(loss_fn)))


def test_nnx_batch_statistics_are_written_back_eagerly_and_under_nnx_jit():
    x, _ = _batch()
    reference = NnxMLP(nnx.Rngs(0), use_running_average=False)
    reference(x)
    expected_mean = reference.norm.mean[...]

    eager = NnxMLP(nnx.Rngs(0), use_running_average=False)
    jaxamp.autocast(eager)(x)
    jitted = NnxMLP(nnx.Rngs(0), use_running_average=False)
    nnx.jit(jaxamp.autocast(lambda model, x: model(x)))(jitted, x)

    for model in (eager, jitted):
        assert model.norm.mean[...].dtype == jnp.float32
        assert not np.allclose(model.norm.mean[...], 0.0)
        np.testing.assert_allclose(model.norm.mean[...], expected_mean, rtol=2e-2, atol=1e-3)


def test_a_module_closed_over_by_plain_jit_cannot_take_its_new_statistics_and_says_what_to_use():
    model = NnxMLP(nnx.Rngs(0), use_running_average=False)
    with pytest.raises(ValueError, match="could not write the changed state.*NnxMLP.*Use nnx.jit"):
        jax.jit(lambda x: jaxamp.autocast(model)(x))(_batch()[0])


def test_training_with_scaled_value_and_grad_and_train_state():
    loss_fn, params, (x, y) = plain_mlp()
    policy = jaxamp.get_policy("mixed_float16")
    state = jaxamp.TrainState.create(
        apply_fn=None, params=params, tx=optax.adam(1e-2), loss_scale=jaxamp.default_loss_scale(policy)
    )

    @jax.jit
    def train_step(state, x, y):
        loss, grads, grads_finite = jaxamp.scaled_value_and_grad(
            jaxamp.autocast(loss_fn, policy), state.loss_scale
        )(state.params, x, y)
        return state.apply_gradients(grads=grads, grads_finite=grads_finite), loss, grads_finite

    losses = []
    for _ in range(5):
        state, loss, grads_finite = train_step(state, x, y)
        assert bool(grads_finite)
        losses.append(float(loss))
    assert losses[-1] < losses[0]
    assert jax.tree.map(lambda leaf: leaf.dtype, state.params) == jax.tree.map(
        lambda leaf: leaf.dtype, params
    )


def _final_training_loss(policy, steps=60):
    inputs = jax.random.normal(jax.random.key(11), (64, 6))
    labels = jax.nn.one_hot((inputs[:, 0] + inputs[:, 1] > 0).astype(jnp.int32), 3)
    params = _dense_params(jax.random.key(12), [6, 16, 3])
    optimizer = optax.adam(3e-2)

    def loss_fn(params):
        h = jax.nn.relu(inputs @ params[0]["w"] + params[0]["b"])
        return _xent(h @ params[1]["w"] + params[1]["b"], labels)

    loss_fn = jaxamp.autocast(loss_fn, policy)

    @jax.jit
    def train(params):
        def step(carry, _):
            params, opt_state = carry
            loss, grads = jax.value_and_grad(loss_fn)(params)
            updates, opt_state = optimizer.update(grads, opt_state)
            return (optax.apply_updates(params, updates), opt_state), loss

        (params, _), losses = jax.lax.scan(step, (params, optimizer.init(params)), None, length=steps)
        return loss_fn(params), losses[0]

    return train(params)


def test_bfloat16_without_a_loss_scale_trains_a_small_model_as_well_as_float32():
    final32, initial32 = _final_training_loss("float32")
    final16, _ = _final_training_loss("mixed_bfloat16")
    assert final32 < 0.3 * initial32  # the task is learnable
    assert abs(float(final16) - float(final32)) < 0.1 * float(initial32)


def test_a_checkpoint_name_passes_the_float16_value_through():
    """main had no rule for `name` and ran it as traced: the named value went back to float32."""

    def fun(x, w):
        return jnp.tanh(checkpoint_name(x @ w, "hidden"))

    assert _equation_dtypes(jaxamp.autocast(fun), X, W, primitive="name") == [jnp.float16]
    assert _equation_dtypes(jaxamp.autocast(fun), X, W, primitive="tanh") == [jnp.float16]


def _called(fun, x):
    return fun(x)


def _recorded(fun, x):
    from jaxamp.diagnostics import record_overflow

    return record_overflow(fun)(x)[0]


def _under_delayed_scaling(fun, x):
    from jaxamp import fp8

    with fp8.delayed_scaling(fp8.Fp8History.create(rows=1, length=2)):  # a row for the matmul
        return fun(x)


@pytest.mark.parametrize(
    "call", [_called, _recorded, _under_delayed_scaling], ids=lambda call: call.__name__[1:]
)
def test_outputs_that_were_no_arrays_when_traced_come_back_as_they_were(call):
    """A Python number, a string or None among the outputs is returned, not turned into an array,
    also by the rewrites that record overflows or take FP8 delayed scaling's rows.

    Fails if autocast handed back ``3`` as a JAX array (as tracing it alone would), or if a
    rewrite lost the outputs that are no arrays.
    """

    def fun(x):
        return {"doubled": x @ x, "layers": 3, "name": "mlp", "nothing": None}

    cast = jaxamp.autocast(fun)
    outputs = call(cast, jnp.ones((2, 2)))
    assert outputs["doubled"].dtype == jnp.float32
    assert outputs["layers"] == 3 and type(outputs["layers"]) is int
    assert outputs["name"] == "mlp" and outputs["nothing"] is None
    assert call(cast, jnp.ones((2, 2)))["layers"] == 3  # from the cached rewrite too


def test_a_static_float_argument_of_either_sign_or_nan_traces_its_own_program():
    """0.0 == -0.0, so a cache keyed on equality reused 1 / (x * 0.0)'s program for -0.0 (inf, not
    -inf); nan != nan, so it traced again on every call."""
    fun = jaxamp.autocast(lambda x, s: 1.0 / (x * s), "float32")
    x = jnp.ones(2)
    assert bool(jnp.all(fun(x, 0.0) == jnp.inf))
    assert bool(jnp.all(fun(x, -0.0) == -jnp.inf))
    traces = fun.rewrites.traces
    assert bool(jnp.all(jnp.isnan(fun(x, float("nan")))))
    assert bool(jnp.all(jnp.isnan(fun(x, float("nan")))))
    assert fun.rewrites.traces == traces + 1
