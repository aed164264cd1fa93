"""Each higher-order primitive under `jaxamp.autocast`, through every transformation.

Every function below runs its matmul inside one higher-order primitive
(nested ``jit``, ``checkpoint``, ``scan``, ``while_loop``, ``cond``,
``custom_jvp``, ``custom_vjp``). Each is checked forward, and under
``jax.grad``, ``jax.jit``, ``jax.vmap`` and ``jax.jvp``, each on either side
of autocast: the same transformation of the float32 function is the
reference (values within float16 rounding, see test_autocast_models.py,
and identical dtypes), and the matmuls, forward and backward, are float16.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jaxamp
from tests.autocast_models import clipped_matmul, softplus


def with_jit(x, w):
    return jax.jit(lambda x, w: jnp.tanh(x @ w), donate_argnums=())(x, w)


def with_checkpoint(x, w):
    return jax.checkpoint(lambda x, w: jnp.tanh(x @ w))(x, w)


def with_scan(x, w):
    def step(h, _):
        h = jnp.tanh(h @ w + x)
        return h, h.sum()

    h, _ = lax.scan(step, jnp.zeros_like(x), None, length=3)
    return h


def with_while(x, w):
    _, h = lax.while_loop(
        lambda carry: carry[0] < 3, lambda carry: (carry[0] + 1, jnp.tanh(carry[1] @ w)), (0, x)
    )
    return h


def with_cond(x, w):
    return lax.cond(x.sum() > 0, lambda x: jnp.tanh(x @ w), lambda x: -(x @ w), x)


def with_custom_jvp(x, w):
    return softplus(x @ w)


def with_custom_vjp(x, w):
    return jnp.tanh(clipped_matmul(x, w))


def _sum_of(f):
    return lambda x, w: f(x, w).sum()


TRANSFORMS = {
    "forward": lambda f, cast: cast(f),
    "grad(autocast)": lambda f, cast: jax.grad(_sum_of(cast(f)), argnums=(0, 1)),
    "autocast(grad)": lambda f, cast: cast(jax.grad(_sum_of(f), argnums=(0, 1))),
    "jit(autocast)": lambda f, cast: jax.jit(cast(f)),
    "autocast(jit)": lambda f, cast: cast(jax.jit(f)),
    "vmap": lambda f, cast: jax.vmap(cast(f), in_axes=(0, None)),
    "autocast(vmap)": lambda f, cast: cast(jax.vmap(f, in_axes=(0, None))),
    "jvp(autocast)": lambda f, cast: lambda x, w: jax.jvp(lambda x: cast(f)(x, w), (x,), (jnp.ones_like(x),)),
    "autocast(jvp)": lambda f, cast: cast(lambda x, w: jax.jvp(lambda x: f(x, w), (x,), (jnp.ones_like(x),))),
}

FUNCTIONS = {
    "jit": with_jit,
    "checkpoint": with_checkpoint,
    "scan": with_scan,
    "while": with_while,
    "cond": with_cond,
    "custom_jvp": with_custom_jvp,
    "custom_vjp": with_custom_vjp,
}

# What JAX itself cannot do to these functions, autocast or not.
UNSUPPORTED = {
    ("while", "grad(autocast)"),  # reverse mode through a while_loop
    ("while", "autocast(grad)"),
    ("custom_vjp", "jvp(autocast)"),  # forward mode through a custom_vjp
    ("custom_vjp", "autocast(jvp)"),
}


def _inputs(transform_name):
    x = jax.random.normal(jax.random.key(0), (3, 4)) / 2
    w = jax.random.normal(jax.random.key(1), (4, 4)) / 2
    if "vmap" in transform_name:
        x = jnp.stack([x, -x])
    return x, w


CASES = [
    pytest.param(function_name, transform_name, id=f"{function_name}-{transform_name}")
    for function_name in FUNCTIONS
    for transform_name in TRANSFORMS
    if (function_name, transform_name) not in UNSUPPORTED
]


@pytest.mark.parametrize("function_name, transform_name", CASES)
def test_autocast_matches_float32_in_value_and_dtype(function_name, transform_name):
    function, transform = FUNCTIONS[function_name], TRANSFORMS[transform_name]
    x, w = _inputs(transform_name)
    expected = transform(function, lambda f: f)(x, w)
    actual = transform(function, jaxamp.autocast)(x, w)
    assert jax.tree.map(lambda leaf: leaf.dtype, actual) == jax.tree.map(lambda leaf: leaf.dtype, expected)
    for got, want in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
        np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("function_name, transform_name", CASES)
def test_every_matmul_runs_in_float16(function_name, transform_name):
    function, transform = FUNCTIONS[function_name], TRANSFORMS[transform_name]
    report = jaxamp.precision_report(transform(function, jaxamp.autocast), *_inputs(transform_name))
    assert report.ops
    assert report.fraction(jnp.float16) == 1.0, str(report)


def _equations(closed_jaxpr, name):
    return [equation for equation in closed_jaxpr.jaxpr.eqns if equation.primitive.name == name]


def test_a_nested_jit_keeps_its_donation_and_name():
    def fun(x, w):
        return jax.jit(lambda x, w: x @ w, donate_argnums=0)(x, w)

    x, w = _inputs("forward")
    original = _equations(jax.make_jaxpr(fun)(x, w), "jit") + _equations(jax.make_jaxpr(fun)(x, w), "pjit")
    rewritten = _equations(jax.make_jaxpr(jaxamp.autocast(fun))(x, w), "jit") + _equations(
        jax.make_jaxpr(jaxamp.autocast(fun))(x, w), "pjit"
    )
    assert len(original) == len(rewritten) == 1
    for param in ("donated_invars", "name", "in_shardings", "out_shardings", "keep_unused", "inline"):
        assert rewritten[0].params[param] == original[0].params[param], param
    assert rewritten[0].params["jaxpr"].out_avals[0].dtype == jnp.float16


def test_a_checkpoint_keeps_its_policy_and_prevent_cse():
    policy = jax.checkpoint_policies.dots_saveable

    def fun(x, w):
        return jax.checkpoint(lambda x, w: jnp.tanh(x @ w), policy=policy, prevent_cse=False)(x, w)

    closed = jax.make_jaxpr(jaxamp.autocast(fun))(*_inputs("forward"))
    (remat,) = [equation for equation in closed.jaxpr.eqns if "remat" in equation.primitive.name]
    assert remat.params["policy"] is policy
    assert remat.params["prevent_cse"] is False


@pytest.mark.parametrize(
    "float32_argnums, carry_dtype", [((), jnp.float16), ((0, 1), jnp.float32)], ids=["half_trace", "as_given"]
)
def test_a_scan_carry_keeps_its_traced_dtype_while_the_body_matmul_is_float16(float32_argnums, carry_dtype):
    """The carry (``zeros_like(x)``) is pinned to the dtype it was traced with: float16 when the
    function is traced in the compute dtype, float32 when its arguments are traced as given."""
    cast = jaxamp.autocast(with_scan, float32_argnums=float32_argnums)
    closed = jax.make_jaxpr(cast)(*_inputs("forward"))
    (scan,) = _equations(closed, "scan")
    body = scan.params["jaxpr"]
    assert body.out_avals[0].dtype == carry_dtype  # the carry, pinned
    dots = [equation for equation in body.jaxpr.eqns if equation.primitive.name == "dot_general"]
    assert [dot.outvars[0].aval.dtype for dot in dots] == [jnp.float16]


def test_cond_branches_that_compute_in_different_dtypes_are_unified():
    def fun(x, w):
        # One branch's result is a float16 matmul, the other's a float32 reduction.
        return lax.cond(x.sum() > 0, lambda x: x @ w, lambda x: jnp.broadcast_to(x.sum(), (3, 4)), x)

    x, w = _inputs("forward")
    closed = jax.make_jaxpr(jaxamp.autocast(fun))(x, w)
    (cond,) = _equations(closed, "cond")
    assert [branch.out_avals[0].dtype for branch in cond.params["branches"]] == [jnp.float32, jnp.float32]
    np.testing.assert_allclose(jaxamp.autocast(fun)(x, w), fun(x, w), rtol=2e-2, atol=2e-2)
