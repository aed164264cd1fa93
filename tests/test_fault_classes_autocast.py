"""Faults in autocast's machinery (`jaxamp/_autocast/`) that its other tests let through.

Each scenario here was written against mutants that mutation testing found
alive (see docs/dev/fault-classes.md) and checks the class of fault, not the
one mutant: the cache of rewrites bounded and evicting the least recently
used signature; values inside ``shard_map`` keeping the mesh axes they vary
over, on a one-device mesh, in this process (the 8-device checks of
test_autocast_sharded.py run in a subprocess that mutation testing cannot
see into); the user's name scopes and source lines kept; a user's own
primitive an error when it carries jaxprs anywhere in its params, and run
as traced when it carries none; autocast's own arguments (the decorator
factory, overrides and their errors); every operand and param of a
higher-order primitive reaching its rewrite (a loop condition's constants,
integer operands of custom derivatives, a partly manual ``shard_map``, a
reversed unrolled ``scan``); JAX's own upcast before a float32 sum; what
the cache keys a signature by and when a module's state is written back;
JAX's registry of primitives (the releases a primitive is looked up in, a
primitive registered late, what its errors advise); under ``mixed_float8``,
each reason a matmul falls back from FP8, the compute dtype of an FP8 dot's
result, and the quantization statistics of an FP8 convolution; the rewrites
made for policy scopes (a primitive without a rule inside one, a scope that
asks for the policy in force); which matmuls a recording rewrite watches (a
nested ``jit``'s, not a loop's or a checkpoint's); bodies that return a
constant.
"""

from __future__ import annotations

import contextlib
import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import ClosedJaxpr, Primitive
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jaxamp
from jaxamp._autocast import primitives as registry
from jaxamp._autocast.scope import ScopePolicy, policy_scope

X = jax.random.normal(jax.random.key(0), (4, 8))
W = jax.random.normal(jax.random.key(1), (8, 8)) / 3


# --- the cache of rewrites: bounded, least recently used evicted ------------------------------------


def _scaled(x, scale):
    return x * scale


def test_the_rewrite_cache_keeps_64_signatures_and_evicts_the_least_recently_used():
    """A training loop that cycles through signatures neither leaks rewrites nor retraces the hot one.

    Fails if the cache holds more or fewer than 64 entries, evicts the newest
    entry instead of the oldest, or does not count a hit as a use (the hot
    signature, used just before the 65th, would be the one evicted).
    """
    fun = jaxamp.autocast(_scaled)
    for scale in range(64):
        fun(X, scale)
    assert fun.rewrites.traces == 64
    fun(X, 0)  # a hit: 0 becomes the most recently used
    assert fun.rewrites.traces == 64
    fun(X, 64)  # the 65th signature evicts the least recently used one, 1
    assert fun.rewrites.traces == 65
    fun(X, 0)
    fun(X, 64)
    fun(X, 63)
    assert fun.rewrites.traces == 65  # 0, 64 and 63 are all still cached
    fun(X, 1)  # 1 was evicted: traced again
    assert fun.rewrites.traces == 66


# --- shard_map: the per-device body keeps its varying-axes types --------------------------------------


def _one_device_mesh() -> Mesh:
    return Mesh(np.array(jax.devices()[:1]), ("d",))


def _local_loss(x, w):
    """A data-parallel loss: per-device data `x`, replicated weights `w`, summed over the mesh.

    The rows of `x` are scanned over, so the scan's body is traced for one
    slice of a value that varies over the mesh.
    """

    def step(total, row):
        return total + jnp.tanh(row @ w).sum(), None

    total, _ = jax.lax.scan(step, jnp.zeros_like(x[0, 0]), x)  # varies over the mesh, as x does
    return jax.lax.psum(total, "d")


def _equations(closed_jaxpr, name):
    found = []

    def walk(jaxpr):
        for equation in jaxpr.eqns:
            if equation.primitive.name == name:
                found.append(equation)
            for value in equation.params.values():
                inner = getattr(value, "jaxpr", value)
                if isinstance(inner, jax.extend.core.Jaxpr):
                    walk(inner)

    walk(closed_jaxpr.jaxpr)
    return found


@pytest.mark.parametrize("order", ["shard_map(autocast)", "autocast(shard_map)"])
def test_a_replicated_weight_meets_per_device_data_inside_shard_map(order):
    """The body's matmul runs in float16, its psum in float32, and the value matches float32.

    ``shard_map(autocast(f))`` fails if autocast traces the body without the
    mesh axes its values vary over (``dot_general requires varying manual
    axes to match``: JAX inserts a ``pvary`` only for a typed value);
    ``autocast(shard_map(f))`` fails if the rewritten ``shard_map`` loses its
    mesh, specs, manual axes or ``check_vma``. Either way the function is traced
    in the compute dtype: the scan's carry, ``zeros_like`` of the data, is float16.
    """
    mesh = _one_device_mesh()
    specs = {"mesh": mesh, "in_specs": (P("d"), P()), "out_specs": P()}
    if order == "shard_map(autocast)":
        fun = jax.jit(jax.shard_map(jaxamp.autocast(_local_loss), **specs))
    else:
        fun = jax.jit(jaxamp.autocast(jax.shard_map(_local_loss, **specs)))
    reference = jax.jit(jax.shard_map(_local_loss, **specs))
    result = fun(X, W)
    assert result.dtype == jnp.float32
    np.testing.assert_allclose(result, reference(X, W), rtol=2e-3)
    closed = jax.make_jaxpr(fun)(X, W)
    assert [equation.outvars[0].aval.dtype for equation in _equations(closed, "dot_general")] == [jnp.float16]
    (scan,) = _equations(closed, "scan")
    assert [variable.aval.shape for variable in scan.params["jaxpr"].jaxpr.invars[-1:]] == [(8,)]
    assert scan.outvars[0].aval.dtype == jnp.float16  # the carry, traced in the compute dtype
    psums = _equations(closed, "psum") or _equations(closed, "psum_invariant")
    assert [equation.invars[0].aval.dtype for equation in psums] == [jnp.float32]
    (shard_map,) = _equations(closed, "shard_map")
    (traced,) = _equations(jax.make_jaxpr(reference)(X, W), "shard_map")
    assert set(shard_map.params) == set(traced.params)
    for name in sorted(set(traced.params) - {"jaxpr"}):  # mesh, specs, manual axes, check_vma, ...
        assert str(shard_map.params[name]) == str(traced.params[name]), name


# --- names and source lines: the rewritten program keeps the user's ------------------------------------


def _scoped_model(x, w):
    with jax.named_scope("encoder"):
        h = x @ w
    with jaxamp.float32_scope():
        return h @ w


def test_the_rewritten_program_keeps_the_users_scopes_and_source_lines():
    """Profiles, compiled programs and errors name the user's layers and lines, not autocast's.

    Fails if autocast's rules run outside each equation's name stack (the
    ``encoder`` scope is lost, and a second rewrite no longer sees the
    `float32_scope`, so its matmul turns float16) or outside its traceback
    (the equations point at jaxamp's own files).
    """
    from jax._src import source_info_util  # the summary JAX prints in errors: file:line (function)

    closed = jax.make_jaxpr(jaxamp.autocast(_scoped_model))(X, W)
    dots = _equations(closed, "dot_general")
    assert [str(equation.source_info.name_stack) for equation in dots] == ["encoder", "jaxamp_float32"]
    for equation in dots:
        assert __file__ in source_info_util.summarize(equation.source_info), source_info_util.summarize(
            equation.source_info
        )
    twice = jax.make_jaxpr(jaxamp.autocast(jaxamp.autocast(_scoped_model)))(X, W)
    assert [equation.outvars[0].aval.dtype for equation in _equations(twice, "dot_general")] == [
        jnp.float16,
        jnp.float32,
    ]


# --- an unknown primitive that carries jaxprs: an error, wherever its params hold them -------------------


def _body_held_as(kind):
    closed = jax.make_jaxpr(jnp.sin)(1.0)
    return {
        "closed jaxpr": closed,
        "open jaxpr": closed.jaxpr,
        "tuple of jaxprs": (closed, closed),  # as lax.cond holds its branches
    }[kind]


@pytest.mark.parametrize("kind", ["closed jaxpr", "open jaxpr", "tuple of jaxprs"])
def test_an_unknown_primitive_is_an_error_wherever_its_params_hold_its_jaxprs(kind):
    """A user's higher-order primitive that autocast cannot rewrite is never silently run as traced.

    Fails if the check for a carried jaxpr looks only at single params (a
    ``cond``-like tuple of branches slips through and runs in float32 with
    no word), or only at closed jaxprs.
    """
    primitive = Primitive(f"my_branching_op_{kind.replace(' ', '_')}")
    primitive.def_abstract_eval(lambda x, *, bodies: x)
    bodies = _body_held_as(kind)
    with pytest.raises(NotImplementedError, match=f"'{primitive.name}'.*params: bodies"):
        jax.make_jaxpr(jaxamp.autocast(lambda x: primitive.bind(x, bodies=bodies)))(X)


def test_the_unknown_higher_order_primitive_error_lists_its_params_and_both_ways_forward():
    """The whole message, for a primitive with two params: each named, then the two fixes.

    Fails if the params are joined otherwise or the advice is reworded.
    """
    primitive = Primitive("my_scaled_branching_op")
    primitive.def_abstract_eval(lambda x, *, scale, bodies: x)
    bodies = _body_held_as("closed jaxpr")
    message = (
        "jaxamp.autocast has no rule for the higher-order primitive 'my_scaled_branching_op' "
        "(params: bodies, scale), so it cannot rewrite the jaxpr it carries. Run it as traced with "
        "autocast(..., overrides={'my_scaled_branching_op': 'restore'}) (or the primitive object itself "
        "as the key), or wrap that code in jaxamp.float32_scope()."
    )
    with pytest.raises(NotImplementedError) as raised:
        jax.make_jaxpr(jaxamp.autocast(lambda x: primitive.bind(x, scale=2.0, bodies=bodies)))(X)
    assert str(raised.value) == message


def test_a_users_first_order_primitive_without_a_rule_runs_as_traced():
    """No jaxpr to rewrite, so no error: its inputs are cast back to the dtypes they were traced with.

    Fails if every primitive missing from the table is taken for a
    higher-order one (an error), or if it follows its float16 input. The
    arguments are traced as given (float32), so "as traced" is float32.
    """
    primitive = Primitive("my_first_order_op")
    primitive.def_abstract_eval(lambda x, *, scale: x)
    as_given = jaxamp.autocast(lambda x, w: primitive.bind(x @ w, scale=2.0), float32_argnums=(0, 1))
    with pytest.warns(jaxamp.NoAutocastRuleWarning, match="no rule for the primitive 'my_first_order_op'"):
        closed = jax.make_jaxpr(as_given)(X, W)
    (equation,) = _equations(closed, "my_first_order_op")
    assert equation.invars[0].aval.dtype == jnp.float32
    assert [equation.outvars[0].aval.dtype for equation in _equations(closed, "dot_general")] == [jnp.float16]


def test_a_users_first_order_primitive_without_a_rule_runs_as_traced_inside_a_float32_scope():
    """A policy scope's rewrite runs a primitive it has no rule for as traced, as the model's does.

    Traced in float16, the primitive reads the float32 matmul of the scope cast back to float16.
    Fails if the rewrites made for scopes lose the as-traced rule (the call then fails).
    """
    primitive = Primitive("my_first_order_op_in_a_scope")
    primitive.def_abstract_eval(lambda x, *, scale: x)

    def in_scope(x, w):
        with jaxamp.float32_scope():
            return primitive.bind(x @ w, scale=2.0)

    with pytest.warns(jaxamp.NoAutocastRuleWarning, match="'my_first_order_op_in_a_scope'"):
        closed = jax.make_jaxpr(jaxamp.autocast(in_scope))(X, W)
    (equation,) = _equations(closed, "my_first_order_op_in_a_scope")
    assert equation.invars[0].aval.dtype == jnp.float16
    assert [equation.outvars[0].aval.dtype for equation in _equations(closed, "dot_general")] == [jnp.float32]


def _abstract_identity(name):
    primitive = Primitive(name)
    primitive.def_abstract_eval(lambda x: x)
    return primitive


def test_a_primitive_without_a_rule_is_named_in_one_warning_per_process_however_often_it_is_rewritten():
    """Two programs rewritten with the primitive (two rewrites, each meeting it) warn once, with
    the whole message; another such primitive gets its own warning."""
    primitive, other = _abstract_identity("my_op_warned_once"), _abstract_identity("my_other_op_warned_once")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        jax.make_jaxpr(jaxamp.autocast(lambda x, w: primitive.bind(x @ w)))(X, W)
        jax.make_jaxpr(jaxamp.autocast(lambda x, w: primitive.bind(x @ w) * 2))(X, W)
        jax.make_jaxpr(jaxamp.autocast(lambda x, w: other.bind(x @ w)))(X, W)

    assert [warning.category for warning in caught] == [jaxamp.NoAutocastRuleWarning] * 2
    assert str(caught[0].message) == (
        "jaxamp.autocast has no rule for the primitive 'my_op_warned_once', so it runs in the dtypes "
        "it was traced with (correct, but not in half precision where it could be). To choose its "
        "rule, pass autocast(..., overrides={'my_op_warned_once': 'follow'}) (or 'compute', "
        "'float32', 'restore'; the primitive object works as the key too). Shown once per primitive "
        "and process."
    )
    assert "'my_other_op_warned_once'" in str(caught[1].message)


def test_the_report_lists_each_primitive_without_a_rule_once_sorted_nested_bodies_included():
    """One at the top level, one in a nested jit, a loop and a checkpoint (whose body is a bare
    jaxpr, not a closed one), one in a conditional's second branch alone (the branches are a
    tuple of jaxprs); sin and the matmul have rules."""
    top, nested = _abstract_identity("zz_unruled_top"), _abstract_identity("aa_unruled_nested")
    in_a_branch = _abstract_identity("mm_unruled_in_a_branch")

    def program(x, w):
        h = jnp.sin(top.bind(x @ w))
        h = jax.jit(nested.bind)(h)
        h, _ = jax.lax.scan(lambda carry, _: (nested.bind(carry), None), h, None, length=2)
        h = jax.lax.cond(h[0, 0] > 0, lambda v: v, in_a_branch.bind, h)
        return jax.checkpoint(nested.bind)(h)

    report = jaxamp.precision_report(program, X, W)
    assert report.without_rule == ("aa_unruled_nested", "mm_unruled_in_a_branch", "zz_unruled_top")
    assert (
        "no autocast rule (run as traced): aa_unruled_nested, mm_unruled_in_a_branch, zz_unruled_top"
        in str(report)
    )
    checkpointed = jaxamp.precision_report(jax.checkpoint(nested.bind), X)
    assert checkpointed.without_rule == ("aa_unruled_nested",)


_layer = jax.jit(lambda x, w: jnp.tanh(x @ w))


def test_a_scope_that_asks_for_the_policy_in_force_shares_its_rewrites():
    """Under a float32 policy ``float32_scope`` changes nothing: a jitted layer called inside and
    outside it is rewritten once, so XLA compiles one body.

    Fails if a scope with the compute dtype already in force gets a rewrite of its own (with its
    own memo of rewritten bodies).
    """

    def inside_and_outside(x, w):
        outside = _layer(x, w)
        with jaxamp.float32_scope():
            inside = _layer(-x, w)
        return outside + inside

    first, second = _equations(jax.make_jaxpr(jaxamp.autocast(inside_and_outside, "float32"))(X, W), "jit")
    assert first.params["jaxpr"] is second.params["jaxpr"]


# --- autocast's own arguments: the decorator factory, overrides and their errors ------------------------


def _dot_and_tanh_dtypes(fun):
    closed = jax.make_jaxpr(fun)(X, W)
    return [
        [equation.outvars[0].aval.dtype for equation in _equations(closed, name)]
        for name in ("dot_general", "tanh")
    ]


def test_autocast_called_with_only_its_options_is_a_decorator_that_keeps_every_option():
    """``@jaxamp.autocast(policy=..., overrides=...)`` applies both to the function it decorates.

    Fails if the factory form (no function given) drops the policy or the
    overrides, or passes them to something other than `autocast`: the
    matmul would be float16 instead of bfloat16, or ``tanh`` would follow
    its bfloat16 input instead of running in float32.
    """

    @jaxamp.autocast(policy="mixed_bfloat16", overrides={"tanh": "float32"})
    def layer(x, w):
        return jnp.tanh(x @ w)

    @jaxamp.autocast()
    def default_layer(x, w):
        return jnp.tanh(x @ w)

    assert _dot_and_tanh_dtypes(layer) == [[jnp.bfloat16], [jnp.float32]]
    assert _dot_and_tanh_dtypes(default_layer) == [[jnp.float16], [jnp.float16]]


def _scanned_layer(x, w):
    def step(total, row):
        return total + jnp.tanh(row @ w), None

    return jax.lax.scan(step, jnp.zeros(w.shape[1]), x)[0]


@pytest.mark.parametrize("key", ["scan", jax.lax.scan_p], ids=["by name", "by object"])
def test_a_primitive_that_carries_a_jaxpr_takes_restore_and_then_runs_as_traced(key):
    """'restore', the one override a higher-order primitive accepts, is accepted and runs its body in float32.

    Fails if the check that refuses every other rule refuses 'restore' too,
    or if the override is dropped (the scan's matmul would be float16). The
    arguments are traced as given (float32), so "as traced" is float32.
    """
    assert _dot_and_tanh_dtypes(jaxamp.autocast(_scanned_layer))[0] == [jnp.float16]
    restored = jaxamp.autocast(_scanned_layer, overrides={key: "restore"}, float32_argnums=(0, 1))
    assert _dot_and_tanh_dtypes(restored) == [
        [jnp.float32],
        [jnp.float32],
    ]


def test_overrides_that_are_not_a_mapping_are_an_error_naming_the_type_given():
    """Fails if the message names some other type than the value the user passed."""
    with pytest.raises(TypeError, match="must map primitive names to rule names.*got list"):
        jaxamp.autocast(jnp.exp, overrides=[("exp", "follow")])
    with pytest.raises(TypeError, match="must map primitive names to rule names.*got str"):
        jaxamp.autocast(jnp.exp, overrides="exp")


def _override_error(name):
    with pytest.raises(ValueError, match=f"{name!r}, which JAX does not have") as error:
        jaxamp.autocast(jnp.exp, overrides={name: "restore"})
    return str(error.value)


def test_an_unknown_primitive_name_suggests_at_most_three_real_names_and_nothing_when_none_is_close():
    """The hint lists JAX's names closest first, joined by "or"; a name like no primitive gets no hint.

    Fails if the hint is shown with nothing to suggest (``Did you mean ?``)
    or replaced by other text, lists more than three names, or joins them so
    that they no longer read as names.
    """
    from jaxamp._autocast.table import rules_table

    known = {repr(primitive.name) for primitive in rules_table()}
    message = _override_error("scatter_ad")
    suggested = message.split("Did you mean ", 1)[1].split("?", 1)[0].split(" or ")
    assert suggested[0] == "'scatter-add'" and len(suggested) == 3 and set(suggested) <= known, message
    message = _override_error("qqqq")
    assert "which JAX does not have. Use JAX's own name" in message, message


class _ScaledModel:
    """A callable object holding a parameter, as a module does."""

    def __init__(self, scale):
        self.scale = scale

    def __call__(self, x):
        return x * self.scale


def test_autocast_of_a_module_keeps_its_name_but_not_a_copy_of_its_attributes():
    """The function reads the module when called; it carries no snapshot of the module's attributes.

    Fails if ``functools.wraps`` copies the module's ``__dict__`` onto the
    function: ``fun.scale`` would then keep the value of the moment autocast
    wrapped it (2.0) while calls use the module's current one.
    """
    model = _ScaledModel(2.0)
    fun = jaxamp.autocast(model)
    model.scale = 3.0
    assert not hasattr(fun, "scale")
    assert fun.__wrapped__ is model
    np.testing.assert_array_equal(fun(X), X * 3.0)


# --- higher-order primitives: every operand and param of the original reaches the rewrite --------------


def _loop_while_large(x, w, limit):
    """A loop whose condition closes over traced values (the weights and a threshold) and runs a matmul."""

    def cond(carry):
        steps, h = carry
        return (steps < 3) & (jnp.abs(h @ w).max() > limit)

    def body(carry):
        steps, h = carry
        return steps + 1, jnp.tanh(h @ w)

    return jax.lax.while_loop(cond, body, (0, x))[1]


def test_a_while_loops_condition_is_rewritten_with_the_values_it_closes_over():
    """The condition's matmul runs in float16 like the body's, on the weights and threshold it closes over.

    Fails if the condition's constants are traced as something else than
    the values given (the rewrite cannot start), if their count is changed,
    or if the condition is left as traced (its matmul stays float32).
    """
    limit = jnp.float32(0.1)
    fun = jaxamp.autocast(_loop_while_large)
    got, want = jax.jit(lambda *args: (fun(*args), _loop_while_large(*args)))(X, W, limit)
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2)
    closed = jax.make_jaxpr(fun)(X, W, limit)
    (loop,) = _equations(closed, "while")
    assert [dot.outvars[0].aval.dtype for dot in _equations(loop.params["cond_jaxpr"], "dot_general")] == [
        jnp.float16
    ]
    assert [dot.outvars[0].aval.dtype for dot in _equations(loop.params["body_jaxpr"], "dot_general")] == [
        jnp.float16
    ]


@jax.custom_jvp
def _shifted_tanh(h, shift):
    """``tanh(h) + shift`` for an integer `shift` per column, and each row's count of entries above it."""
    y = jnp.tanh(h) + shift
    return y, (y > shift).sum(axis=-1)


@_shifted_tanh.defjvp
def _shifted_tanh_jvp(primals, tangents):
    (h, shift), (dh, _) = primals, tangents
    y, count = _shifted_tanh(h, shift)
    true_tangent = dh * (1 - jnp.tanh(h) ** 2)
    return (y, count), (3 * true_tangent, np.zeros(count.shape, jax.dtypes.float0))  # 3x: the user's rule


@jax.custom_vjp
def _shifted_tanh_vjp(h, shift):
    y = jnp.tanh(h) + shift
    return y, (y > shift).sum(axis=-1)


def _shifted_forward(h, shift):
    return _shifted_tanh_vjp(h, shift), (h, shift)


def _shifted_backward(residuals, cotangents):
    h, shift = residuals
    return 3 * cotangents[0] * (1 - jnp.tanh(h) ** 2), np.zeros(np.shape(shift), jax.dtypes.float0)


_shifted_tanh_vjp.defvjp(_shifted_forward, _shifted_backward)


@pytest.mark.parametrize("custom", [_shifted_tanh, _shifted_tanh_vjp], ids=["custom_jvp", "custom_vjp"])
def test_a_custom_derivative_with_an_integer_input_and_output_differentiates_by_the_users_rule(custom):
    """Integer operands and outputs of a custom derivative get float0 tangents; the float ones the user's rule.

    Fails if autocast takes every operand or output of a custom_jvp or
    custom_vjp for floating (it asks the user's rule for an integer's
    tangent) or none of them (the float gradient is lost), or if the zero
    tangent of an integer is not a float0 of its shape. (A custom_vjp that
    takes every operand for floating still works: JAX gives and takes
    float0 cotangents for integers.)
    """
    shift = jnp.arange(8, dtype=jnp.int32) % 3  # not scalars: a zero tangent of the wrong shape fails

    def loss(x, w):
        y, count = custom(x @ w, shift)
        return y.sum() + count.sum()

    def all_three(x, w):  # one compile for the three
        return (
            jax.grad(loss, argnums=(0, 1))(x, w),  # 3x the true gradient: the user's rule
            jax.grad(jaxamp.autocast(loss), argnums=(0, 1))(x, w),
            jaxamp.autocast(jax.grad(loss, argnums=(0, 1)))(x, w),
        )

    expected, *autocast_grads = jax.jit(all_three)(X, W)
    for grads in autocast_grads:
        for got, want in zip(grads, expected):
            assert got.dtype == jnp.float32
            np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2)


def test_a_partly_manual_shard_map_without_vma_checks_keeps_both_settings():
    """``axis_names`` (the axes made manual) and ``check_vma=False`` survive the rewrite; so do the others.

    The one-device test above uses the defaults (every axis manual, checks
    on), which a rewrite that drops either setting reproduces; here both
    differ from their defaults, on a 1 x 1 mesh with only ``d`` manual.
    """
    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("d", "m"))
    sharded = jax.shard_map(
        lambda x, w: jnp.tanh(x @ w),
        mesh=mesh,
        in_specs=(P("d"), P()),
        out_specs=P("d"),
        axis_names={"d"},
        check_vma=False,
    )
    (rewritten,) = _equations(jax.make_jaxpr(jaxamp.autocast(sharded))(X, W), "shard_map")
    (traced,) = _equations(jax.make_jaxpr(sharded)(X, W), "shard_map")
    assert set(rewritten.params) == set(traced.params)
    for name in sorted(set(traced.params) - {"jaxpr"}):
        assert str(rewritten.params[name]) == str(traced.params[name]), name
    assert [
        dot.outvars[0].aval.dtype
        for dot in _equations(ClosedJaxpr(rewritten.params["jaxpr"], ()), "dot_general")
    ] == [jnp.float16]


def test_a_reversed_unrolled_scan_keeps_its_length_direction_and_unrolling():
    """Fails if the rewritten ``scan`` drops ``reverse``, ``unroll`` or ``length`` (each set off its default)."""

    def scanned(x, w):
        def step(h, row):
            h = jnp.tanh(h + row @ w)
            return h, h.sum()

        return jax.lax.scan(step, jnp.zeros(w.shape[1]), x, reverse=True, unroll=2)

    (rewritten,) = _equations(jax.make_jaxpr(jaxamp.autocast(scanned))(X, W), "scan")
    (traced,) = _equations(jax.make_jaxpr(scanned)(X, W), "scan")
    kept = {name: rewritten.params[name] for name in ("length", "reverse", "unroll")}
    assert kept == {name: traced.params[name] for name in kept} == {"length": 4, "reverse": True, "unroll": 2}


def test_a_rewritten_body_with_constants_takes_them_as_its_leading_operands():
    """``remat``, ``scan`` and ``while`` bodies must be constant-free, so `lift_consts` turns the
    constants a rewrite gives a body into its first operands, in order.

    No program tried on JAX 0.10.2 or 0.12 gives a rewritten body constants (the rewrite hoists
    them; see docs/dev/fault-classes.md), so the body here is a traced jaxpr that closes over a
    weight and a bias. Fails if the constants are dropped, kept as constants, put after the
    arguments or swapped, or if a constant-free body is not handed back as it is.
    """
    from jax.extend.core import jaxpr_as_fun

    from jaxamp._autocast.interpreter import lift_consts

    weight, bias = np.arange(16.0, dtype=np.float32).reshape(8, 2), np.array([1.0, -1.0], np.float32)
    body = jax.make_jaxpr(lambda x: x @ weight - bias)(X)
    assert len(body.jaxpr.constvars) == 2  # the scenario: a body with constants

    lifted, consts = lift_consts(body)
    assert lifted.constvars == [] and len(lifted.invars) == 3
    np.testing.assert_array_equal(consts[0], weight)
    np.testing.assert_array_equal(consts[1], bias)
    (result,) = jaxpr_as_fun(ClosedJaxpr(lifted, ()))(*consts, X)
    np.testing.assert_allclose(result, X @ weight - bias, rtol=1e-6)

    constant_free = jax.make_jaxpr(lambda x: x * 2)(X)
    assert lift_consts(constant_free) == (constant_free.jaxpr, [])


# --- values that feed only a float32 reduction: JAX's own upcast is part of the chain -------------------


def test_the_square_of_a_float16_argument_before_jaxs_upcast_to_a_float32_sum_runs_in_float32():
    """``mean(h * h)`` of a float16 argument: JAX casts ``h * h`` to float32 for the sum; the square runs there too.

    One entry of 300 squares to 90000, beyond float16's 65504, while the
    mean (2813) fits float16. Fails if the cast to float32 between the
    square and the sum is not taken as part of the chain (its producer,
    the square, then follows its float16 inputs and the mean is ``inf``),
    as when the check of the cast's target dtype is inverted or compares
    with something other than float32.
    """
    h = jnp.ones((4, 8), jnp.float16).at[1, 2].set(300)

    def mean_square(h):
        return jnp.mean(h * h)

    fun = jaxamp.autocast(mean_square)
    as_written, autocast, float32 = jax.jit(
        lambda h: (mean_square(h), fun(h), mean_square(h.astype(jnp.float32)))  # one compile
    )(h)
    assert not np.isfinite(as_written)  # float16 arithmetic
    np.testing.assert_allclose(np.float32(autocast), float32, rtol=1e-3)
    closed = jax.make_jaxpr(fun)(h)
    assert [equation.outvars[0].aval.dtype for equation in _equations(closed, "mul")] == [jnp.float32]


# --- the cache key and the write-back: what a signature is, and when a module is updated ----------------


def test_one_autocast_function_in_two_shard_maps_is_rewritten_for_each_replication_of_its_weights():
    """Weights sharded in one ``shard_map`` and replicated in the other: the same shapes, two signatures.

    Inside ``shard_map`` a value's type says which mesh axes it varies
    over. Fails if the cache keys a rewrite by shape and dtype alone: the
    second call reuses the rewrite traced for varying weights, with no
    ``pvary`` for the replicated ones, and JAX refuses the matmul (or, on
    other releases, gets values of the wrong type).
    """
    mesh = _one_device_mesh()
    fun = jaxamp.autocast(lambda x, w: jnp.tanh(x @ w))

    def both(x, w):
        sharded = jax.shard_map(fun, mesh=mesh, in_specs=(P("d"), P("d")), out_specs=P("d"))(x, w)
        replicated = jax.shard_map(fun, mesh=mesh, in_specs=(P("d"), P()), out_specs=P("d"))(x, w)
        return sharded, replicated

    closed = jax.make_jaxpr(both)(X, W)
    assert fun.rewrites.traces == 2
    assert [dot.outvars[0].aval.dtype for dot in _equations(closed, "dot_general")] == [jnp.float16] * 2


def test_a_module_whose_call_changes_no_state_works_closed_over_by_plain_jit():
    """Nothing to write back, so nothing is written: NNX would refuse it under plain ``jax.jit``.

    Fails if autocast writes back every module after every call (the state
    it compares with read from something other than the module), which
    raises NNX's trace-context error for any module a plain transformation
    closes over.
    """
    from flax import nnx

    model = nnx.Linear(8, 8, rngs=nnx.Rngs(0))
    out, reference = jax.jit(lambda x: (jaxamp.autocast(model)(x), model(x)))(X)
    np.testing.assert_allclose(out, reference, rtol=2e-2, atol=2e-2)


def test_a_jitted_layer_called_twice_is_rewritten_once_and_both_calls_share_it():
    """Two calls of one ``jit`` on inputs of one signature: one rewritten body, so XLA compiles it once.

    Fails if a rewrite is not kept for the next equation that needs it
    (kept as nothing, the second call breaks; not kept, each call gets a
    body of its own).
    """
    layer = jax.jit(lambda x, w: jnp.tanh(x @ w))

    def twice(x, w):
        return layer(x, w) + layer(-x, w)

    fun = jaxamp.autocast(twice)
    got, want = jax.jit(lambda x, w: (fun(x, w), twice(x, w)))(X, W)
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2)
    first, second = _equations(jax.make_jaxpr(fun)(X, W), "jit")
    assert first.params["jaxpr"] is second.params["jaxpr"]


class _UnhashableConfig:
    """A static argument that compares by value and so has no hash (as a non-frozen dataclass)."""

    __hash__ = None

    def __init__(self, scale):
        self.scale = scale

    def __eq__(self, other):
        return isinstance(other, _UnhashableConfig) and other.scale == self.scale


def test_an_unhashable_static_argument_is_traced_at_every_call_instead_of_cached():
    """Fails if a static argument without a hash breaks the call, or if its rewrite is kept and reused."""
    fun = jaxamp.autocast(lambda x, config: x * config.scale)
    np.testing.assert_array_equal(fun(X, _UnhashableConfig(2.0)), X * 2.0)
    np.testing.assert_array_equal(fun(X, _UnhashableConfig(3.0)), X * 3.0)
    assert fun.rewrites.traces == 2


def test_a_rewrite_that_closed_over_another_traces_values_is_never_reused():
    """A function reading weights that a ``jit`` traces: each ``jit`` gets a rewrite of its own.

    Fails if the rewrite traced inside the first ``jit`` (its constants are
    that trace's tracers) is kept and reused by the second, where those
    tracers are dead.
    """
    weights = {}
    fun = jaxamp.autocast(lambda x: jnp.tanh(x @ weights["w"]))

    def call_with(w):
        weights["w"] = w
        return fun(X)

    jax.jit(call_with)(W)
    second = jax.jit(lambda w: call_with(w))(2 * W)  # a new jit: traced again
    np.testing.assert_allclose(second, jnp.tanh(X @ (2 * W)), rtol=2e-2, atol=2e-2)
    assert fun.rewrites.traces == 2


# --- JAX's registry of primitives: growth, and what it does when it cannot be read ----------------


def test_a_primitive_registered_after_the_first_lookup_is_found_by_name(monkeypatch):
    """A JAX module imported late (``jax.experimental.sparse``) registers its primitives after the
    registry was first read, and a registry can lose a primitive as well as gain one. Fails if the
    lookup by name is cached without regard to the registry's growth (the late primitive would stay
    unknown, and its rule unresolved), or only to its size (a registry that lost one primitive and
    gained another would still name the lost one)."""
    from jax._src.interpreters import ad

    assert registry.find("scatter-add") == [jax.lax.scatter_add_p]  # the registry read, and cached
    late = Primitive("jaxamp_late_primitive")
    monkeypatch.setitem(ad.primitive_jvps, late, lambda primals, tangents: (primals, tangents))
    assert registry.find("jaxamp_late_primitive") == [late]

    replacement = Primitive("jaxamp_replacement_primitive")
    monkeypatch.delitem(ad.primitive_jvps, late)
    monkeypatch.setitem(ad.primitive_jvps, replacement, lambda primals, tangents: (primals, tangents))
    assert registry.find("jaxamp_replacement_primitive") == [replacement]
    assert registry.find("jaxamp_late_primitive") == []


def test_a_registry_keyed_by_names_or_moved_degrades_with_a_warning_that_says_what_still_works(monkeypatch):
    """A JAX whose tables changed their keys, or moved, is not refused: autocast keeps the rules of
    the primitives JAX exports. Fails if the registry raises, returns nothing, or the warning loses
    what it falls back to."""
    from jax._src.interpreters import ad, mlir

    registry._warn_unreadable.cache_clear()
    monkeypatch.setitem(ad.primitive_jvps, "add", None)  # a table keyed by names, not primitives
    with pytest.warns(RuntimeWarning) as warned:
        primitives = registry.registered_primitives()
    assert jax.lax.exp_p in primitives
    message = str(warned[0].message)
    assert "(its rule tables are no longer keyed by primitives)" in message
    assert (
        "apply to the primitives JAX exports (jax.lax, jax.lax.linalg, jax.extend.core.primitives)" in message
    )
    monkeypatch.delattr(mlir, "_lowerings")
    with pytest.warns(RuntimeWarning, match="AttributeError"):
        assert jax.lax.exp_p in registry.registered_primitives()
    registry._warn_unreadable.cache_clear()


# --- mixed_float8: each fallback reason, the FP8 dot's result dtype, convolution statistics -------------


def _scoped_equations(jaxpr, name, scope=""):
    """(name scope, equation) of every `name` equation of `jaxpr` and of the jaxprs it carries."""
    for equation in jaxpr.eqns:
        here = "/".join(part for part in (scope, str(equation.source_info.name_stack)) if part)
        if equation.primitive.name == name:
            yield here, equation
        for value in equation.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if isinstance(inner, jax.extend.core.Jaxpr):
                    yield from _scoped_equations(inner, name, here)


def _conv(images, kernel, **options):
    return jax.lax.conv_general_dilated(
        images, kernel, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"), **options
    )


def _transposed_conv(images, kernel):
    return jax.lax.conv_transpose(images, kernel, (2, 2), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))


def _ragged(lhs, rhs):
    return jax.lax.ragged_dot(lhs, rhs, jnp.array([8, 8], jnp.int32))


@pytest.mark.parametrize(
    "reason, fun, shapes",
    [
        ("shape_not_multiple_of_16", lambda x, w: x @ w, [(10, 32), (32, 16)]),
        ("shape_not_multiple_of_16", _conv, [(2, 8, 8, 16), (3, 3, 16, 8)]),
        ("grouped_conv", lambda a, b: _conv(a, b, batch_group_count=2), [(4, 8, 8, 16), (3, 3, 16, 32)]),
        ("transposed_conv", _transposed_conv, [(2, 8, 8, 16), (3, 3, 16, 16)]),
        ("ragged_dot", _ragged, [(16, 32), (2, 32, 16)]),
        ("integer_operands", _conv, [(2, 8, 8, 16), (3, 3, 16, 16)]),
    ],
    ids=["m-is-10", "eight-output-channels", "batch-grouped", "transposed", "ragged", "int32-conv"],
)
def test_each_matmul_that_fp8_cannot_take_runs_in_bfloat16_under_its_reason(reason, fun, shapes):
    """The cases the FP8 tests leave out, one per test of the eligibility rules.

    Fails if the rows of a dot (m = 10) or the output channels of a
    convolution are not checked against 16, a batch-grouped convolution (the
    kernel gradient of a grouped one) or a transposed one (lhs dilation) is
    sent to FP8, a ragged dot loses its fallback rule or scope, or an
    integer convolution is not named as one (it runs as traced, in int32).
    """
    assert reason in jaxamp.diagnostics.FP8_FALLBACK_REASONS
    dtype = jnp.dtype(jnp.int32 if reason == "integer_operands" else jnp.bfloat16)
    args = [jnp.ones(shape, jnp.int32 if reason == "integer_operands" else jnp.float32) for shape in shapes]
    closed = jax.make_jaxpr(jaxamp.autocast(fun, "mixed_float8"))(*args)
    found = [
        (scope, equation)
        for primitive in ("dot_general", "conv_general_dilated", "ragged_dot_general")
        for scope, equation in _scoped_equations(closed.jaxpr, primitive)
    ]
    assert len(found) == 1, found
    ((scope, equation),) = found
    assert f"jaxamp_fp8_fallback_{reason}" in scope
    assert [atom.aval.dtype for atom in equation.invars[:2]] == [dtype] * 2
    assert equation.outvars[0].aval.dtype == dtype


@pytest.mark.parametrize(
    "policy, compute", [("mixed_float8", jnp.bfloat16), ("p=f32,c=f16,o=f32,matmul=float8", jnp.float16)]
)
@pytest.mark.parametrize(
    "matmul, shapes, options",
    [
        ("dot_general", [(16, 32), (32, 16)], {}),
        ("conv_general_dilated", [(2, 8, 8, 16), (3, 3, 16, 16)], {}),
        ("conv_general_dilated", [(2, 8, 8, 16), (3, 3, 16, 16)], {"preferred_element_type": jnp.float32}),
    ],
    ids=["dot", "conv", "conv-asking-float32"],
)
def test_an_fp8_matmul_gives_its_result_in_the_policys_compute_dtype(
    matmul, shapes, options, policy, compute
):
    """An FP8 dot's or convolution's result reaches the next op in the compute dtype, like the
    matmul it replaces.

    Fails if the result were left in float32 (twice the bytes written, and
    the ops after it in float32), or if `fp8_dot_general` or
    `fp8_convolution` were left at their default bfloat16 under a float16
    compute dtype, or a convolution traced with a float32
    ``preferred_element_type`` kept it.
    """
    matmul_fun = (lambda x, w: x @ w) if matmul == "dot_general" else functools.partial(_conv, **options)
    fun = jaxamp.autocast(lambda x, w: jnp.tanh(matmul_fun(x, w)), policy)
    closed = jax.make_jaxpr(fun)(*[jnp.ones(shape) for shape in shapes])
    found = list(_scoped_equations(closed.jaxpr, matmul))
    assert found
    for scope, equation in found:
        assert "jaxamp_fp8" in scope and "fallback" not in scope
        # A dot takes the FP8 values; a convolution takes them handed over in `compute`.
        operand = jnp.float8_e4m3fn if matmul == "dot_general" else compute
        assert [atom.aval.dtype for atom in equation.invars] == [jnp.dtype(operand)] * 2
    ((_, tanh),) = _scoped_equations(closed.jaxpr, "tanh")
    assert tanh.invars[0].aval.dtype == compute


def test_quantization_statistics_count_a_convolutions_fp8_operands():
    """`fp8_quantization_stats` sees the convolutions autocast sends to FP8, as it sees the dots.

    Fails if the convolution rule drops the observer (no rows: the statistics
    would call every convolutional network's quantization clean).
    """
    images, kernel = jnp.ones((2, 8, 8, 16)), jnp.ones((3, 3, 16, 32)).at[0, 0, 0, 0].set(1e4)
    stats = jaxamp.diagnostics.fp8_quantization_stats(_conv)(images, kernel)
    assert [(tensor.role, tensor.shape) for tensor in stats.tensors] == [
        ("lhs", (2, 8, 8, 16)),
        ("rhs", (3, 3, 16, 32)),
    ]
    assert stats.tensors[1].amax == 1e4


def test_a_misspelt_fallback_reason_in_the_fp8_rules_fails_when_the_table_is_built():
    """A guard on jaxamp's own table: the scope names only documented reasons. Fails if the guard
    lets an unknown reason through or its message stops naming the valid ones."""
    from jaxamp._autocast import fp8_rules, rules

    with pytest.raises(ValueError, match=r"Unknown FP8 fallback reason 'ragged'; valid: .*, ragged_dot"):
        fp8_rules._in_fallback_scope("ragged", rules.compute_rule)


# --- the first-order rules: a matmul's operands, a refusal's reason, a table's duplicates ---------------


@pytest.mark.parametrize("policy, half", [("mixed_float16", jnp.float16), ("mixed_bfloat16", jnp.bfloat16)])
def test_a_float32_matmul_and_convolution_take_half_operands_not_only_give_a_half_result(policy, half):
    """The compute rule casts the operands; asking for a half result is not enough.

    Fails if the operands were left in float32 with only ``preferred_element_type``
    set to the half dtype: the result's dtype is the same, but the matmul
    reads float32 operands (twice the bytes, and no half-precision tensor cores).
    """

    def layer(x, w, images, kernel):
        return x @ w, _conv(images, kernel)

    args = (X, W, jnp.ones((2, 4, 4, 8)), jnp.ones((3, 3, 8, 8)))
    closed = jax.make_jaxpr(jaxamp.autocast(layer, policy))(*args)
    for name in ("dot_general", "conv_general_dilated"):
        ((_, equation),) = _scoped_equations(closed.jaxpr, name)
        assert [atom.aval.dtype for atom in equation.invars] == [jnp.dtype(half)] * 2, name
        assert equation.outvars[0].aval.dtype == half


def test_a_refused_primitive_carries_its_reason_and_the_table_refuses_a_primitive_given_two_rules():
    """Fails if the refusing rule's ``reason`` (what the documentation lists) is lost, or if the
    table builder lets a primitive take two rules silently, or says so without naming it."""
    from jaxamp._autocast import rules

    rule = rules.unsupported("JAX uses it only while it linearizes")
    assert rule.reason == "JAX uses it only while it linearizes"
    with pytest.raises(ValueError, match=r"^'add' has two rules in the autocast table\.$"):
        rules._table({rules.follow_rule: ("add",), rules.restore_rule: ("mul", "add")})


# --- record_overflow: which matmuls a recording rewrite watches -----------------------------------------


@jax.jit
def _jitted_layer(x, w):
    with jax.named_scope("inner"):
        return jnp.tanh(x @ w)


def _four_matmuls(x, w):
    """One matmul in a nested ``jit``, one in a ``jax.checkpoint`` block, one in a ``scan`` body, one plain."""
    with jax.named_scope("jitted"):
        x = _jitted_layer(x, w)
    x = jax.checkpoint(lambda x: jnp.tanh(x @ w))(x)
    x, _ = jax.lax.scan(lambda carry, _: (jnp.tanh(carry @ w), None), x, None, length=2)
    with jax.named_scope("head"):
        return x @ w


def test_a_record_watches_the_matmuls_of_nested_jits_and_counts_those_of_loops_and_checkpoints_apart():
    """A recording rewrite inlines a nested ``jit`` and watches its matmul, named under the call's
    scopes; a checkpoint block's and a loop body's matmuls are counted as unrecorded, and the
    program computes what it computes without a record, forward and backward.

    Fails if the nested ``jit`` is rewritten without the recorder (its matmul is then not watched,
    and the record has fewer sites than the probe has rows), or if the bodies of other primitives
    are rewritten with it (their taps and amaxes would be values of the body's own trace, which
    leak out of the loop or the checkpoint).
    """
    from jaxamp.diagnostics import record_overflow

    fun = jaxamp.autocast(_four_matmuls, "mixed_float16")
    outputs, record = record_overflow(fun)(X, W)
    np.testing.assert_array_equal(outputs, fun(X, W))
    assert [(site.name, site.dtype, site.shape) for site in record.sites] == [
        ("jitted/inner", "float16", (4, 8)),
        ("head", "float16", (4, 8)),
    ]
    assert record.unrecorded == 2
    assert record.forward_amax.shape == (2,) and bool(np.all(np.isfinite(record.forward_amax)))

    def loss(w):
        return jnp.sum(fun(X, w).astype(jnp.float32))

    loss_scale = jaxamp.StaticLossScale(2.0**4)
    _, grads, finite, record = jaxamp.scaled_value_and_grad(loss, loss_scale, record_overflow=True)(W)
    _, expected_grads, _ = jaxamp.scaled_value_and_grad(loss, loss_scale)(W)
    assert bool(finite) and record.backward_recorded and record.unrecorded == 2
    assert [site.name for site in record.sites] == ["jitted/inner", "head"]
    assert bool(np.all(record.backward_amax > 0))
    np.testing.assert_array_equal(grads, expected_grads)


def _matmuls_in_loops_nested_in_a_jit_and_a_loop(x, w):
    """One watched matmul and three in loops: a scan inside a nested jit, and a scan inside a scan
    beside the outer scan's own matmul."""

    def scanned(h):
        return jax.lax.scan(lambda carry, _: (jnp.tanh(carry @ w), None), h, None, length=2)[0]

    def outer_body(carry, _):
        return scanned(jnp.tanh(carry @ w)), None

    h = jax.jit(scanned)(x @ w)
    return jax.lax.scan(outer_body, h, None, length=2)[0]


def test_a_record_counts_each_matmul_of_a_loop_once_inside_a_nested_jit_or_another_loop():
    from jaxamp.diagnostics import record_overflow

    outputs, record = record_overflow(jaxamp.autocast(_matmuls_in_loops_nested_in_a_jit_and_a_loop))(X, W)
    assert len(record.sites) == 1 and record.unrecorded == 3
    assert outputs.shape == (4, 8)


def test_a_site_inside_a_float32_scope_is_named_by_the_users_scopes_alone():
    """jaxamp's own scope between the user's two is left out of the site's name."""
    from jaxamp.diagnostics import record_overflow

    def program(x, w):
        with jax.named_scope("block"), jaxamp.float32_scope(), jax.named_scope("dense"):
            return x @ w

    _, record = record_overflow(jaxamp.autocast(program, "mixed_float16"))(X, W)
    assert [(site.name, site.dtype) for site in record.sites] == [("block/dense", "float32")]


def test_a_record_reads_the_cotangent_of_the_differentiated_operand_and_not_of_the_data():
    """``sum(x @ w)`` differentiated for ``w`` alone, with ``x`` all ones (4 x 8) and ``w`` all tens
    (8 x 16): the cotangents are 1 (the output's), 4 (``w``'s) and 160 (``x``'s, which nobody
    asks for). The site's backward amax is 4.

    Fails if the recording rewrite taps the data too (160, and a whole matmul computed for it) or
    taps the data instead of the parameter (160), or if it is traced again for the same call.
    """
    fun = jaxamp.autocast(lambda w, x: jnp.sum(x @ w), "mixed_float16")
    w, x = jnp.full((8, 16), 10.0), jnp.ones((4, 8))
    _, grads, finite, record = jaxamp.scaled_value_and_grad(
        fun, jaxamp.NoOpLossScale(), record_overflow=True
    )(w, x)
    assert bool(finite) and [site.shape for site in record.sites] == [(4, 16)]
    np.testing.assert_array_equal(grads, jnp.full((8, 16), 4.0))
    np.testing.assert_array_equal(record.backward_amax, [4.0])
    traces = fun.rewrites.traces
    jaxamp.scaled_value_and_grad(fun, jaxamp.NoOpLossScale(), record_overflow=True)(w, x)
    assert fun.rewrites.traces == traces  # the recording rewrite is kept


# --- bodies whose outputs are constants -----------------------------------------------------------------


def _jit_returning_a_constant(x, w):
    h, zero = jax.jit(lambda x: (jnp.tanh(x @ w), 0.0))(x)
    return h + zero


def _scan_returning_a_constant(x, w):
    return jax.lax.scan(lambda total, row: (total + jnp.tanh(row @ w), 1.0), jnp.zeros(8), x)


@pytest.mark.parametrize("fun", [_jit_returning_a_constant, _scan_returning_a_constant], ids=["jit", "scan"])
def test_a_body_that_returns_a_constant_beside_computed_values_is_rewritten(fun):
    """A nested ``jit`` or a ``scan`` body whose jaxpr has a literal among its outputs.

    Fails if the policy scopes of a body's outputs are looked up for a literal as for a variable
    (JAX's literals have no hash).
    """
    got = jaxamp.autocast(fun)(X, W)
    jax.tree.map(lambda got, want: np.testing.assert_allclose(got, want, atol=2e-2), got, fun(X, W))


# --- values made inside a policy scope in a loop body or a branch ----------------------------------------

_FLOAT32_OUT_FLOAT16 = ScopePolicy(np.dtype(jnp.float32), False, np.dtype(jnp.float16))


def _scoped_layer(h, w):
    with policy_scope(_FLOAT32_OUT_FLOAT16):
        return jnp.tanh(h @ w)


def _loop_of_scoped_layers(x, w):
    def body(carry):
        step, h = carry
        return step + 1, _scoped_layer(h, w)

    return jax.lax.while_loop(lambda carry: carry[0] < 2, body, (0, x))[1] * 2.0


def _branch_of_a_scoped_layer(x, w):
    # The scoped branch first: JAX lists a cond's false branch before its true one.
    return jax.lax.cond(jnp.sum(x) > 0, lambda x: x, lambda x: _scoped_layer(x, w), x) * 2.0


@pytest.mark.parametrize(
    "fun", [_loop_of_scoped_layers, _branch_of_a_scoped_layer], ids=["while_loop", "cond"]
)
def test_a_value_made_inside_a_scope_in_a_loop_or_one_branch_leaves_it_where_the_program_reads_it(fun):
    """A layer that computes in float32 and hands on float16 (``p=f32,c=f32,o=f16``) in a
    ``while_loop`` body, or in one branch of a ``cond`` whose other branch returns its input. Traced
    as given, the loop's carry and the cond's result are float32; the product after them reads
    them as they leave the layer's scope, in float16.

    Fails if the scopes of a body's outputs stop at the loop's condition (one output, the
    predicate, before the body's), or keep only the last branch's scopes (the plain one).
    """
    cast = jaxamp.autocast(fun, float32_argnums=(0, 1))
    (product,) = [eq for eq in jax.make_jaxpr(cast)(X, W).jaxpr.eqns if eq.primitive.name == "mul"]
    assert [str(atom.aval.dtype) for atom in product.invars] == ["float16", "float16"]
    np.testing.assert_allclose(cast(X, W), fun(X, W), atol=2e-2)


def _two_scoped_layers(x, w, *, checkpoint: bool, block: str | None):
    first = jax.checkpoint(_scoped_layer) if checkpoint else _scoped_layer
    with jax.named_scope(block) if block else contextlib.nullcontext():
        h = first(x, w)
    return _scoped_layer(h, w)


@pytest.mark.parametrize("block", [None, "block"], ids=["top_level", "in_a_named_scope"])
def test_a_checkpoint_around_a_scoped_layer_leaves_what_the_next_one_reads_unchanged(block):
    """Two layers under one policy scope (``p=f32,c=f32,o=f16``), the first at the top level or in a
    named scope of its own. The second reads the first's result as made where it was made under
    its own scope's name, rounded to float16 where it left a scope of another name. Wrapping the
    first in ``jax.checkpoint`` changes neither: the results are the same to the bit.

    Fails if the scopes a body's outputs were made in are not named from the equation that holds
    the body (the checkpoint inside the named scope would then be read as made), or are named
    from nothing (the checkpoint at the top level would then be rounded).
    """
    plain = jaxamp.autocast(functools.partial(_two_scoped_layers, checkpoint=False, block=block))
    checkpointed = jaxamp.autocast(functools.partial(_two_scoped_layers, checkpoint=True, block=block))
    np.testing.assert_array_equal(checkpointed(X, W), plain(X, W))
