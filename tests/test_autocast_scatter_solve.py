"""Scatters with combiners and linear solves under `jaxamp.autocast`.

Each program here failed on main with ``NotImplementedError: jaxamp.autocast
has no rule for the higher-order primitive 'scatter-add'`` (or
'scatter-mul', 'scatter-min', 'scatter-max', 'custom_linear_solve'): the
rules table spelt them ``scatter_add`` and ``linear_solve``, names JAX does
not use. Each now matches float32 within float16 rounding (the tolerance of
test_autocast_models.py), and where the program has matmuls every matmul
FLOP is float16.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxamp

RTOL = ATOL = 2e-2

KEYS = jax.random.split(jax.random.key(0), 4)
X = jax.random.normal(KEYS[0], (8, 6))
W = jax.random.normal(KEYS[1], (6, 5)) / 3
LABELS = jax.random.randint(KEYS[2], (8,), 0, 5)
IDS = jnp.array([0, 3, 3, 1, 4, 0, 2, 3])


def assert_matches_float32(fun, *args):
    expected, actual = fun(*args), jaxamp.autocast(fun)(*args)
    assert jax.tree.map(lambda leaf: leaf.dtype, actual) == jax.tree.map(lambda leaf: leaf.dtype, expected)
    for got, want in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
        np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)


def assert_matmuls_in_float16(fun, *args):
    report = jaxamp.precision_report(jaxamp.autocast(fun), *args)
    assert report.ops and report.fraction(jnp.float16) == 1.0, str(report)


def integer_label_loss(w, x, labels):
    return optax.softmax_cross_entropy_with_integer_labels(jnp.tanh(x @ w) @ w.T @ w, labels).mean()


def embedding_loss(table, w, ids):
    return jnp.tanh(table[ids] @ w).sum()  # the gradient of the gather is a scatter-add


@pytest.mark.parametrize(
    "loss, args",
    [(integer_label_loss, (W, X, LABELS)), (embedding_loss, (jax.random.normal(KEYS[3], (5, 6)), W, IDS))],
    ids=["integer_label_cross_entropy", "embedding_gather"],
)
def test_autocast_of_the_gradient_of_a_gathering_loss(loss, args):
    assert_matches_float32(jax.grad(loss, argnums=(0, 1)), *args)
    assert_matmuls_in_float16(jax.grad(loss, argnums=(0, 1)), *args)


SCATTERS = {
    "segment_sum": lambda h, ids: jax.ops.segment_sum(h, ids, num_segments=5),
    "at_add": lambda h, ids: jnp.zeros((5, h.shape[1])).at[ids].add(h),
    "at_min": lambda h, ids: jnp.zeros((5, h.shape[1])).at[ids].min(h),
    "at_max": lambda h, ids: jnp.zeros((5, h.shape[1])).at[ids].max(h),
    "at_multiply": lambda h, ids: jnp.ones((5, h.shape[1])).at[ids].multiply(h),
    "at_subtract": lambda h, ids: jnp.zeros((5, h.shape[1])).at[ids].subtract(h),
    # plain scatter: main ran it forward; its gradient (a gather, then scatter-add) failed
    "at_set": lambda h, ids: jnp.zeros((5, h.shape[1])).at[ids].set(h),
}


@pytest.mark.parametrize("name", SCATTERS)
def test_a_scatter_of_matmul_outputs_matches_float32(name):
    def fun(x, w, ids):
        return SCATTERS[name](jnp.tanh(x @ w), ids)

    assert_matches_float32(fun, X, W, IDS)
    if name != "at_multiply":  # JAX differentiates scatter-mul only with unique indices
        assert_matches_float32(jax.grad(lambda x, w, ids: fun(x, w, ids).sum(), argnums=(0, 1)), X, W, IDS)
    assert_matmuls_in_float16(fun, X, W, IDS)


def test_bincount_with_and_without_weights_matches_float32():
    weights = jnp.linspace(0.0, 1.0, IDS.shape[0])
    assert_matches_float32(lambda ids: jnp.bincount(ids, length=5), IDS)
    assert_matches_float32(lambda ids, weights: jnp.bincount(ids, weights, length=5), IDS, weights)


A = jnp.eye(4) * 3 + jax.random.normal(KEYS[3], (4, 4)) / 4
SPD = A @ A.T  # symmetric positive definite, for the conjugate gradient
B = jax.random.normal(KEYS[2], (4, 2))

SOLVES = {
    "solve": lambda a, b: jnp.linalg.solve(a, b),
    "inv": lambda a, b: jnp.linalg.inv(a) * b[:, :1],
    "cg": lambda a, b: jax.scipy.sparse.linalg.cg(lambda v: a @ v, b, tol=1e-6)[0],
}


@pytest.mark.parametrize("name", SOLVES)
def test_a_linear_solve_runs_as_traced_in_float32_and_matches_float32(name):
    a = SPD if name == "cg" else A
    fun = SOLVES[name]
    assert_matches_float32(fun, a, B)
    assert_matches_float32(jax.grad(lambda a, b: fun(a, b).sum(), argnums=(0, 1)), a, B)
    # Kept whole, the solve is exact to float32 rounding, not float16's.
    np.testing.assert_allclose(jaxamp.autocast(fun)(a, B), fun(a, B), rtol=1e-5, atol=1e-5)


def test_the_matvec_of_a_conjugate_gradient_stays_float32_inside_the_solve():
    closed = jax.make_jaxpr(jaxamp.autocast(SOLVES["cg"]))(SPD, B)
    (solve,) = [equation for equation in closed.jaxpr.eqns if equation.primitive is jax.lax.linear_solve_p]
    matvec = solve.params["jaxprs"].matvec
    assert [eq.outvars[0].aval.dtype for eq in matvec.jaxpr.eqns if eq.primitive.name == "dot_general"] == [
        jnp.float32
    ]


def test_a_ragged_dot_runs_in_float16_with_its_integer_group_sizes_as_given():
    """A compute rule that required every operand floating left the ragged dot in float32."""
    lhs, rhs = X, jnp.stack([W, -W])
    group_sizes = jnp.array([3, 5], jnp.int32)

    def fun(lhs, rhs):
        return jax.lax.ragged_dot(lhs, rhs, group_sizes)

    closed = jax.make_jaxpr(jaxamp.autocast(fun))(lhs, rhs)
    (ragged,) = [eq for eq in closed.jaxpr.eqns if eq.primitive.name == "ragged_dot_general"]
    assert ragged.outvars[0].aval.dtype == jnp.float16
    assert_matches_float32(fun, lhs, rhs)
