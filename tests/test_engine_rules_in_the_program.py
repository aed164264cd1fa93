"""The engine's rules, read from the rewritten program rather than from its outputs.

`jaxamp.autocast` hands its outputs back in the caller's dtype, so an output alone cannot say in
which dtype an op inside ran. Each scenario here reads the dtype an op computes in from the
rewritten jaxpr, inside the bodies where lineages meet (nested ``jit``, ``cond``, ``scan``,
``custom_jvp``), and the literals it reads:

* which constants half holds (float16's subnormals do, what flushes to zero does not, an
  infinite fill does);
* how a ``cond`` joins its branches' lineages, and an island meeting an activation;
* which literals are read as written (a literal the half trace rounded) and which are not (a
  dtype-dependent one, an op the half trace alone has), and a pairing that cannot decide.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jaxamp
from jaxamp._autocast.primitives import subjaxprs
from jaxamp._autocast.reference import recovered

F16, F32 = jnp.dtype(jnp.float16), jnp.dtype(jnp.float32)
X, W = jnp.ones((2, 4)), jnp.full((4, 4), 0.25)


def equations(closed, name: str) -> list:
    """Every equation of `name` in the program, nested bodies included, in program order."""
    found, seen = [], set()

    def walk(jaxpr):
        if id(jaxpr) in seen:
            return
        seen.add(id(jaxpr))
        for equation in jaxpr.eqns:
            if equation.primitive.name == name:
                found.append(equation)
            for body in subjaxprs(equation.params):
                walk(body)

    walk(closed.jaxpr)
    return found


def computes_in(closed, name: str) -> list:
    """Per `name` equation, the dtype of its floating operands (one dtype each, or a set)."""
    dtypes = []
    for equation in equations(closed, name):
        floating = {atom.aval.dtype for atom in equation.invars if jnp.issubdtype(atom.aval.dtype, jnp.floating)}
        dtypes.append(floating.pop() if len(floating) == 1 else floating)
    return dtypes


def program(function, *args, policy="mixed_float16"):
    return jax.make_jaxpr(jaxamp.autocast(function, policy))(*args)


# --- constants half holds -------------------------------------------------------------------------


def test_a_constant_in_float16s_subnormal_range_leaves_the_op_in_float16():
    """1e-7 is a float16 subnormal (5.96e-8 is the smallest): ``h * 1e-7`` stays float16. 1e-8
    flushes to zero in float16: ``h * 1e-8`` computes in float32."""
    held = program(lambda x, w: (x @ w) * 1e-7, X, W)
    flushed = program(lambda x, w: (x @ w) * 1e-8, X, W)
    assert computes_in(held, "mul") == [F16]
    assert computes_in(flushed, "mul") == [F32]


def test_an_infinite_fill_is_held_by_float16():
    """``where(mask, h, -inf)``: float16 holds -inf, so the select stays float16; -1e9 does not."""
    mask = jnp.array([True, False, True, False])
    with_inf = program(lambda x, w: jnp.where(mask, x @ w, -jnp.inf), X, W)
    with_big = program(lambda x, w: jnp.where(mask, x @ w, -1e9), X, W)
    assert computes_in(with_inf, "select_n") == [F16]
    assert computes_in(with_big, "select_n") == [F32]


# --- lineages meeting inside bodies ---------------------------------------------------------------


def test_a_cond_of_an_activation_and_a_constant_is_an_activation():
    """The join of an activation and a constant decides like the activation: adding a float32
    param after it computes in float32 and is rounded to float16 (a param does not decide)."""

    def f(x, w, bias, pick):
        h = lax.cond(pick, lambda h: h, lambda h: jnp.zeros_like(h), x @ w)
        return jnp.tanh(h + bias)

    closed = program(f, X, W, jnp.ones(4), True)
    (tanh,) = equations(closed, "tanh")
    assert tanh.invars[0].aval.dtype == F16


def test_a_cond_of_an_island_and_an_activation_is_an_island():
    """One branch computes in a float32 island: the join decides float32 for what follows."""

    def f(x, w, pick):
        def island(h):
            with jaxamp.float32_scope():
                return h * 2.0

        h = lax.cond(pick, island, lambda h: h, x @ w)
        return jnp.tanh(h)

    closed = program(f, X, W, True)
    (tanh,) = equations(closed, "tanh")
    assert tanh.invars[0].aval.dtype == F32


@jax.custom_jvp
def combine(a, b):
    return a + b


combine.defjvp(lambda primals, tangents: (combine(*primals), tangents[0] + tangents[1]))


def test_an_island_meeting_an_activation_inside_a_custom_jvp_body_computes_in_float32():
    def f(x, w):
        h = x @ w
        with jaxamp.float32_scope():
            island = jnp.sin(x) * 3.0
        return jnp.tanh(combine(island, h))

    closed = program(f, X, W)
    inside = computes_in(closed, "add")
    assert inside and all(dtype == F32 for dtype in inside)
    (tanh,) = equations(closed, "tanh")
    assert tanh.invars[0].aval.dtype == F32


def test_a_param_meeting_an_activation_in_a_nested_jit_computes_in_float32_and_gives_float16():
    """The bias add inside a jitted layer computes in float32 (the param is read in its width) and
    its result is float16 (the activation decides), which the tanh after it reads."""
    layer = jax.jit(lambda h, bias: h + bias)

    closed = program(lambda x, w, bias: jnp.tanh(layer(x @ w, bias)), X, W, jnp.ones(4))
    assert computes_in(closed, "add") == [F32]
    (tanh,) = equations(closed, "tanh")
    assert tanh.invars[0].aval.dtype == F16


def test_a_scan_carry_keeps_its_traced_dtype_while_a_param_meets_it():
    """Inside a ``scan`` body the carry (traced float16) meets a float32 param: the add computes in
    float32, and the carry leaves each step in float16, its traced dtype."""

    def f(x, w, bias):
        def step(carry, _):
            return jnp.tanh(carry + bias), None

        final, _ = lax.scan(step, x @ w, None, length=3)
        return final

    closed = program(f, X, W, jnp.ones(4))
    (scan,) = equations(closed, "scan")
    assert computes_in(closed, "add") == [F32]
    carry_out = scan.outvars[0]
    assert carry_out.aval.dtype == F16


# --- literals read as written, and those that are not --------------------------------------------


def test_a_dtype_dependent_literal_keeps_the_half_traces_value():
    """``jnp.finfo(h.dtype).eps`` is float16's eps in the half trace and float32's in the
    reference; it is no rounding of float32's, so the program reads float16's."""

    def f(x, w):
        h = x @ w
        return h + jnp.finfo(h.dtype).eps

    got = jaxamp.autocast(f)(jnp.zeros((2, 4)), W)
    np.testing.assert_array_equal(got, np.full((2, 4), float(jnp.finfo(F16).eps)))


def test_an_integer_argument_made_floating_by_the_program_is_cast_as_written():
    """A positions argument the program casts to the activation's dtype is data, not a constant:
    the cast goes to float16 and the product with the activation computes in float16."""

    def f(x, w, positions):
        h = x @ w
        return h * positions.astype(h.dtype)

    closed = program(f, X, W, jnp.arange(4))
    assert computes_in(closed, "mul") == [F16]


def only_in_the_half_trace(x):
    if x.dtype != jnp.float32:  # an op the reference does not have
        x = x * 1.0001
    return (x + 1.0) * 1.0004


def test_an_op_only_the_half_trace_has_keeps_its_own_literal():
    """The half trace's extra ``x * 1.0001`` has no twin; the product after it reads 1.0004, its
    own written value (pairing by position would give it to the extra op)."""
    x = jnp.array([3.0, -2.0])
    got = jaxamp.autocast(only_in_the_half_trace)(x)
    np.testing.assert_allclose(got, (x + 1.0) * 1.0004, rtol=1e-7)


def scaled_by(factor):
    """A jitted helper whose body's literal is `factor` (one piece of code for every factor)."""
    return jax.jit(lambda x: x * factor)


def calls(first, second):
    """Two jitted calls, traced by one piece of code."""

    def f(x):
        return first(x), second(x)

    return f


def test_a_body_shared_by_two_calls_whose_twins_disagree_keeps_the_half_literal_and_says_so():
    """In the half trace one jitted body serves both calls; the reference has two bodies whose
    literals differ (both round to the half one). Neither written value is taken for both: the
    literal stays as the half trace rounded it, with one warning."""
    shared = scaled_by(1.0001)
    half = jax.make_jaxpr(calls(shared, shared))(jnp.ones(2, F16))
    reference = jax.make_jaxpr(calls(scaled_by(1.0001), scaled_by(1.0002)))(jnp.ones(2, F32))
    (first_body, second_body) = (eq.params["jaxpr"].jaxpr for eq in half.jaxpr.eqns)
    assert first_body is second_body
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        found = recovered(half.jaxpr, reference.jaxpr, calls(None, None).__code__)
    assert found == {}
    assert any(issubclass(w.category, jaxamp.diagnostics.LiteralNotRecoveredWarning) for w in caught) or _warned_before()


def _warned_before() -> bool:
    """The warning is once per process: it may have been given by an earlier test."""
    from jaxamp._autocast import reference

    return reference._warn_once.cache_info().currsize > 0


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_a_literal_inside_a_body_called_twice_with_one_value_is_recovered(policy):
    """``rsqrt(mean(h*h) + 1e-12)`` in one jitted helper called twice: both calls read 1e-12."""
    norm = jax.jit(lambda h: lax.rsqrt(jnp.mean(h * h, axis=-1) + 1e-12))
    h = jnp.zeros((2, 4)).at[0].set(1.0)
    got = jaxamp.autocast(lambda h: (norm(h), norm(h * 2.0)), policy)(h)
    np.testing.assert_allclose(got[0], [1.0, 1e6], rtol=1e-6)
    np.testing.assert_allclose(got[1], [0.5, 1e6], rtol=1e-6)
