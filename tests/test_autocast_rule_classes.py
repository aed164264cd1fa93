"""Each class of `jaxamp.autocast` rule, checked for every member it claims.

`autocast`'s docstring promises classes of behaviour, not single cases:
numerically sensitive operations (the exp and log family, roots and powers,
special functions, every reduction, the linear-algebra decompositions) run
in float32; a literal the half dtype cannot hold keeps its operation in
float32; primitives without a rule run exactly as traced; a rewrite is
reused only for the same signature; custom derivatives keep the user's rule,
rewritten. A test of one member of a class (softmax, say) leaves the other
members free to regress, so each scenario below is parametrized over the
whole class and reads dtypes from the rewritten jaxpr (``jax.make_jaxpr`` of
the autocast function), through the public API only.

Negative controls (each confirmed by injecting it by hand and seeing the
tests here fail): moving ``exp`` or ``reduce_sum`` to the follow rule;
checking literal overflow against float32 instead of the half dtype;
dropping the argument dtypes from the rewrite cache key; a restore rule that
no longer casts its inputs back; a custom_jvp rule that runs the call as
traced.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.extend.core import ClosedJaxpr, Jaxpr

import jaxamp

HALF_POLICIES = {"mixed_float16": jnp.float16, "mixed_bfloat16": jnp.bfloat16}


def all_equations(jaxpr):
    """Every equation of `jaxpr`, those of nested jaxprs (jit, scan, custom rules) included."""
    for equation in jaxpr.eqns:
        yield equation
        for value in equation.params.values():
            for candidate in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(candidate, ClosedJaxpr):
                    yield from all_equations(candidate.jaxpr)
                elif isinstance(candidate, Jaxpr):
                    yield from all_equations(candidate)


def equations_of(fun, *args, primitive: str) -> list:
    closed = jax.make_jaxpr(fun)(*args)
    return [equation for equation in all_equations(closed.jaxpr) if equation.primitive.name == primitive]


def floating_dtypes(atoms) -> list:
    return [atom.aval.dtype for atom in atoms if jnp.issubdtype(atom.aval.dtype, jnp.floating)]


def square(dtype, size=4):
    """A well-conditioned, symmetric positive definite matrix with entries in (0, 2)."""
    matrix = np.full((size, size), 0.25) + np.eye(size)
    return jnp.asarray(matrix, dtype)


# Each numerically sensitive primitive, as the user's code produces it, from
# one half-precision square matrix `x` (positive, below 1 off the diagonal).
FLOAT32_CLASS = {
    # the exp and log family
    "exp": jnp.exp,
    "exp2": jnp.exp2,
    "expm1": jnp.expm1,
    "log": jnp.log,
    "log1p": jnp.log1p,
    "logistic": jax.nn.sigmoid,
    # roots and powers
    "sqrt": jnp.sqrt,
    "rsqrt": lax.rsqrt,
    "cbrt": jnp.cbrt,
    "pow": lambda x: lax.pow(x, x),
    "integer_pow": lambda x: x**3,
    "square": jnp.square,
    # special functions
    "erf": lax.erf,
    "erfc": lax.erfc,
    "erf_inv": lambda x: lax.erf_inv(x / 4),
    "lgamma": lax.lgamma,
    "digamma": lax.digamma,
    "polygamma": lambda x: lax.polygamma(jnp.ones_like(x), x),
    "igamma": lambda x: lax.igamma(x, x),
    "igammac": lambda x: lax.igammac(x, x),
    "igamma_grad_a": lambda x: lax.igamma_grad_a(x, x),
    "zeta": lambda x: lax.zeta(x + 2, x),
    "bessel_i0e": lax.bessel_i0e,
    "bessel_i1e": lax.bessel_i1e,
    "regularized_incomplete_beta": lambda x: lax.betainc(x, x, x / 4),
    # trigonometric and hyperbolic functions kept in float32 (as torch does)
    "tan": jnp.tan,
    "acos": lambda x: jnp.arccos(x / 4),
    "asin": lambda x: jnp.arcsin(x / 4),
    "acosh": lambda x: jnp.arccosh(x + 2),
    "asinh": jnp.arcsinh,
    "atanh": lambda x: jnp.arctanh(x / 4),
    "cosh": jnp.cosh,
    "sinh": jnp.sinh,
}

REDUCTIONS = {
    # jnp.sum and jnp.prod widen float16 themselves; lax.reduce does not.
    "reduce_sum": lambda x: lax.reduce(x, np.array(0, x.dtype), lax.add, (1,)),
    "reduce_prod": lambda x: lax.reduce(x, np.array(1, x.dtype), lax.mul, (1,)),
    "reduce_max": lambda x: jnp.max(x, axis=-1),
    "reduce_min": lambda x: jnp.min(x, axis=-1),
    "argmax": lambda x: jnp.argmax(x, axis=-1),
    "argmin": lambda x: jnp.argmin(x, axis=-1),
    "reduce_window_sum": lambda x: lax.reduce_window(x, 0.0, lax.add, (2, 2), (1, 1), "VALID"),
    "reduce_window_max": lambda x: lax.reduce_window(x, -jnp.inf, lax.max, (2, 2), (1, 1), "VALID"),
    "reduce_window_min": lambda x: lax.reduce_window(x, jnp.inf, lax.min, (2, 2), (1, 1), "VALID"),
    "cumsum": lambda x: jnp.cumsum(x, axis=-1),
    "cumprod": lambda x: jnp.cumprod(x, axis=-1),
    "cummax": lambda x: lax.cummax(x, axis=1),
    "cummin": lambda x: lax.cummin(x, axis=1),
    "cumlogsumexp": lambda x: lax.cumlogsumexp(x, axis=1),
}

LINEAR_ALGEBRA = {
    "cholesky": lax.linalg.cholesky,
    "eigh": lax.linalg.eigh,
    "eig": lambda x: lax.linalg.eig(x, compute_left_eigenvectors=False, compute_right_eigenvectors=False),
    "lu": lax.linalg.lu,
    "qr": lax.linalg.qr,
    "svd": lax.linalg.svd,
    "triangular_solve": lambda x: lax.linalg.triangular_solve(x, x, left_side=True, lower=True),
    "tridiagonal_solve": lambda x: lax.linalg.tridiagonal_solve(
        x[0].at[0].set(0), x[1], x[2].at[-1].set(0), x[:, :1]
    ),
    "householder_product": lambda x: lax.linalg.householder_product(x, x[0]),
    "schur": lambda x: lax.linalg.schur(x, compute_schur_vectors=False),
    "hessenberg": lax.linalg.hessenberg,
}

ALL_FLOAT32 = {**FLOAT32_CLASS, **REDUCTIONS, **LINEAR_ALGEBRA}


# JAX 0.12 refuses half-precision inputs to the linear-algebra primitives, so
# user code meets them with half values only where autocast made the values
# half (the matmul scenario below covers them on every JAX).
@pytest.mark.parametrize("policy", sorted(HALF_POLICIES))
@pytest.mark.parametrize("primitive", sorted({**FLOAT32_CLASS, **REDUCTIONS}))
def test_every_numerically_sensitive_primitive_runs_in_float32_on_half_inputs(primitive, policy):
    """Fails if any member of the float32 class follows its half inputs (e.g. ``exp`` moved to follow)."""
    half = HALF_POLICIES[policy]
    fun = ALL_FLOAT32[primitive]
    x = square(half)
    # The premise: the user's code produces this primitive, on half inputs.
    traced = equations_of(fun, x, primitive=primitive)
    assert traced, f"{primitive} is not in the jaxpr of its scenario"
    assert set(floating_dtypes(traced[0].invars)) == {jnp.dtype(half)}

    rewritten = equations_of(jaxamp.autocast(fun, policy), x, primitive=primitive)
    assert len(rewritten) == len(traced)
    for equation in rewritten:
        assert set(floating_dtypes(equation.invars)) == {jnp.dtype(jnp.float32)}, equation
        # The result follows its float32 inputs (integers stay integers: argmax).
        assert set(floating_dtypes(equation.outvars)) <= {jnp.dtype(jnp.float32)}, equation


@pytest.mark.parametrize("policy", sorted(HALF_POLICIES))
@pytest.mark.parametrize("primitive", sorted(ALL_FLOAT32))
def test_a_half_matmul_result_is_widened_to_float32_before_every_sensitive_primitive(primitive, policy):
    """The input made half by autocast itself (a matmul), not by the caller, is widened too."""
    fun = ALL_FLOAT32[primitive]
    x = square(jnp.float32)
    assert equations_of(lambda x: fun(x @ x), x, primitive=primitive)  # the premise
    rewritten_fun = jaxamp.autocast(lambda x: fun(x @ x), policy)
    (dot,) = equations_of(rewritten_fun, x, primitive="dot_general")
    assert dot.outvars[0].aval.dtype == HALF_POLICIES[policy]
    rewritten = equations_of(rewritten_fun, x, primitive=primitive)
    assert rewritten
    for equation in rewritten:
        assert set(floating_dtypes(equation.invars)) == {jnp.dtype(jnp.float32)}, equation


def test_softmax_of_float16_logits_exponentiates_in_float32():
    """Softmax, cross entropy and logsumexp are built from ``exp``/``log`` and reductions."""
    logits = jnp.linspace(-8, 8, 16, dtype=jnp.float16).reshape(2, 8)
    for fun in (jax.nn.softmax, jax.nn.log_softmax, jax.nn.logsumexp):
        for primitive in ("exp", "reduce_sum", "reduce_max"):
            for equation in equations_of(jaxamp.autocast(fun), logits, primitive=primitive):
                assert set(floating_dtypes(equation.invars)) == {jnp.dtype(jnp.float32)}, (fun, equation)


def test_a_float16_exp_beyond_65504_is_finite_in_float32_before_its_log():
    """``log(exp(x))`` at x = 12: exp(12) = 162755 overflows float16, not float32."""
    x = jnp.full((3,), 12.0, jnp.float16)
    result = jaxamp.autocast(lambda x: jnp.log(jnp.exp(x)))(x)
    assert result.dtype == jnp.float16
    np.testing.assert_allclose(np.asarray(result, np.float32), 12.0, rtol=1e-3)


def test_a_float16_sum_beyond_65504_is_finite():
    """1000 float16 values of 100 sum to 1e5: inf if the sum ran in float16."""
    x = jnp.full((1000,), 100.0, jnp.float16)
    fun = jaxamp.autocast(lambda x: lax.reduce(x, np.float16(0), lax.add, (0,)).astype(jnp.float32))
    assert float(fun(x)) == 1e5


def test_a_sum_of_a_float16_matmul_result_beyond_65504_is_finite():
    """``jnp.sum`` of a matmul traced in float32: autocast made its input float16, not the user."""
    x = jnp.full((8, 100), 1.0, jnp.float32)
    w = jnp.full((100, 100), 1.0, jnp.float32)  # each entry of x @ w is 100; all 800 sum to 8e4
    total = jaxamp.autocast(lambda x, w: jnp.sum(x @ w, axis=0).sum())(x, w)
    assert total.dtype == jnp.float32
    assert float(total) == 8e4


# --- literals the half dtype cannot hold ------------------------------------------------------------

# scenario -> (function of a matmul result, the primitive the literal meets)
OVERFLOWING_LITERALS = {
    "mul": (lambda h: h * 1e5, "mul"),
    "mul_literal_first": (lambda h: 1e5 * h, "mul"),
    "add_negative": (lambda h: h + (-7e4), "add"),
    "max": (lambda h: jnp.maximum(h, -7e4), "max"),
    "select_mask": (lambda h: jnp.where(h > 0, h, -1e9), "select_n"),
}


@pytest.mark.parametrize("scenario", sorted(OVERFLOWING_LITERALS))
def test_an_operation_with_a_literal_beyond_float16_range_runs_in_float32(scenario):
    """Fails if the literal is checked against float32 (it fits) instead of the half dtype.

    The argument is traced as given (``float32_argnums``), so the literal is
    float32's; traced in float16, JAX itself would make it infinite.
    """
    fun, primitive = OVERFLOWING_LITERALS[scenario]
    x = square(jnp.float32)

    def model(x):
        return fun(x @ x).astype(jnp.float32)

    cast = jaxamp.autocast(model, float32_argnums=0)
    closed = jax.make_jaxpr(cast)(x)
    (dot,) = [eq for eq in all_equations(closed.jaxpr) if eq.primitive.name == "dot_general"]
    assert dot.outvars[0].aval.dtype == jnp.float16
    (operation,) = [eq for eq in all_equations(closed.jaxpr) if eq.primitive.name == primitive]
    assert set(floating_dtypes(operation.invars)) == {jnp.dtype(jnp.float32)}, operation
    result = cast(x)
    np.testing.assert_allclose(result, model(x), rtol=1e-2)
    assert np.all(np.isfinite(result))


# jnp.where passes its -1e9 into a nested jit as an argument, where it is no
# longer a literal: it keeps its float32 there under either half dtype.
@pytest.mark.parametrize("scenario", sorted(set(OVERFLOWING_LITERALS) - {"select_mask"}))
def test_the_same_literal_fits_bfloat16_and_the_operation_stays_in_bfloat16(scenario):
    """bfloat16 holds 1e5: a check against float16 (or widening for every literal) fails here."""
    fun, primitive = OVERFLOWING_LITERALS[scenario]
    x = square(jnp.float32)
    closed = jax.make_jaxpr(jaxamp.autocast(lambda x: fun(x @ x), "mixed_bfloat16"))(x)
    (operation,) = [eq for eq in all_equations(closed.jaxpr) if eq.primitive.name == primitive]
    assert set(floating_dtypes(operation.invars)) == {jnp.dtype(jnp.bfloat16)}, operation


@pytest.mark.parametrize("literal", [3.4e38, -3.4e38])
def test_a_literal_that_float32_holds_but_bfloat16_cannot_keeps_a_bfloat16_operation_in_float32(literal):
    """bfloat16's largest value is 3.3895e38, float32's 3.4028e38: the check is against the half dtype.

    Fails if literal overflow is checked against float32 (the literal fits it). The argument is
    traced as given, so the literal is float32's.
    """
    closed = jax.make_jaxpr(
        jaxamp.autocast(
            lambda x: jnp.maximum(x @ x, literal) if literal < 0 else jnp.minimum(x @ x, literal),
            "mixed_bfloat16",
            float32_argnums=0,
        )
    )(square(jnp.float32))
    primitive = "max" if literal < 0 else "min"
    (operation,) = [eq for eq in all_equations(closed.jaxpr) if eq.primitive.name == primitive]
    assert set(floating_dtypes(operation.invars)) == {jnp.dtype(jnp.float32)}, operation


def test_a_literal_within_float16_range_stays_weak():
    closed = jax.make_jaxpr(jaxamp.autocast(lambda x: (x @ x) * 6e4))(square(jnp.float32))
    (mul,) = [eq for eq in all_equations(closed.jaxpr) if eq.primitive.name == "mul"]
    assert set(floating_dtypes(mul.invars)) == {jnp.dtype(jnp.float16)}


# --- the rewrite cache: one entry per signature -----------------------------------------------------


def scaled_matmul(x, scale=1.0):
    return (x @ x) * scale


SIGNATURES = {
    "float32": (square(jnp.float32), {}),
    "float16": (square(jnp.float16), {}),
    "bfloat16": (square(jnp.bfloat16), {}),
    "float32_3x3": (square(jnp.float32, 3), {}),
    "float32_scale_2": (square(jnp.float32), {"scale": 2.0}),
    "float32_scale_3": (square(jnp.float32), {"scale": 3.0}),
}


@pytest.mark.parametrize("first", sorted(SIGNATURES))
@pytest.mark.parametrize("second", sorted(SIGNATURES))
def test_a_cached_rewrite_is_never_reused_for_another_signature(first, second):
    """A call after another signature's gives exactly what a fresh autocast gives.

    Fails if the cache key omits the argument dtypes (a float16 call would
    reuse the float32 rewrite and return float32), the shapes, or the static
    arguments (``scale=3`` would reuse ``scale=2``'s constant).
    """
    fun = jaxamp.autocast(scaled_matmul)
    x_first, kwargs_first = SIGNATURES[first]
    x_second, kwargs_second = SIGNATURES[second]
    fun(x_first, **kwargs_first)
    result = fun(x_second, **kwargs_second)
    expected = jaxamp.autocast(scaled_matmul)(x_second, **kwargs_second)
    assert result.dtype == expected.dtype == x_second.dtype
    assert result.shape == expected.shape == x_second.shape
    np.testing.assert_array_equal(np.asarray(result, np.float32), np.asarray(expected, np.float32))
    assert fun.rewrites.traces == (1 if first == second else 2)


def test_a_float16_call_after_a_float32_call_runs_its_matmul_on_float16_operands():
    fun = jaxamp.autocast(lambda x: jnp.exp(x @ x))
    fun(square(jnp.float32))
    closed = jax.make_jaxpr(fun)(square(jnp.float16))
    assert closed.out_avals[0].dtype == jnp.float16
    (exp,) = [eq for eq in all_equations(closed.jaxpr) if eq.primitive.name == "exp"]
    assert exp.invars[0].aval.dtype == jnp.float32


# --- primitives without a rule run as traced --------------------------------------------------------


def test_a_callback_receives_the_dtype_it_was_traced_with_though_its_input_was_computed_in_float16():
    """Fails if the restore rule passes the float16 matmul result through uncast.

    Traced as given (``float32_argnums``) the callback was traced for float32;
    traced in the compute dtype, for float16, which it then receives.
    """
    seen = []

    def host_norm(values):
        seen.append(values.dtype)
        return np.asarray(np.linalg.norm(np.asarray(values, np.float64)), np.float32)

    def model(x):
        h = x @ x
        return jax.pure_callback(host_norm, jax.ShapeDtypeStruct((), jnp.float32), h)

    x = square(jnp.float32)
    cast = jaxamp.autocast(model, float32_argnums=0)
    closed = jax.make_jaxpr(cast)(x)
    (callback,) = [eq for eq in all_equations(closed.jaxpr) if eq.primitive.name == "pure_callback"]
    assert floating_dtypes(callback.invars) == [jnp.dtype(jnp.float32)]
    result = cast(x)
    assert seen[-1] == np.float32
    np.testing.assert_allclose(result, model(x), rtol=1e-2)
    half_trace = jaxamp.autocast(model)(x)
    assert seen[-1] == np.float16
    np.testing.assert_allclose(half_trace, model(x), rtol=1e-2)


def test_a_reduce_with_the_users_own_combiner_runs_as_traced_on_a_float16_matmul_result():
    """``lax.reduce`` with a custom computation carries a jaxpr written for float32.

    Its float32 initial value needs float32 operands, so the argument is traced as given.
    """

    def model(x):
        h = x @ x
        return lax.reduce(h, np.float32(0), lambda a, b: a + jnp.abs(b), (1,))

    x = square(jnp.float32)
    cast = jaxamp.autocast(model, float32_argnums=0)
    closed = jax.make_jaxpr(cast)(x)
    (reduce,) = [eq for eq in all_equations(closed.jaxpr) if eq.primitive.name == "reduce"]
    assert set(floating_dtypes(reduce.invars)) == {jnp.dtype(jnp.float32)}
    np.testing.assert_allclose(cast(x), model(x), rtol=1e-2)


def test_a_scatter_into_a_float16_matmul_result_sees_one_dtype_and_the_traced_values():
    def model(x, updates):
        h = x @ x
        return h.at[0].set(updates)

    x, updates = square(jnp.float32), jnp.arange(4.0)
    closed = jax.make_jaxpr(jaxamp.autocast(model))(x, updates)
    (scatter,) = [eq for eq in all_equations(closed.jaxpr) if eq.primitive.name == "scatter"]
    assert len(set(floating_dtypes(scatter.invars))) == 1
    np.testing.assert_allclose(jaxamp.autocast(model)(x, updates), model(x, updates), rtol=1e-2)


# --- custom derivatives: the user's rule, rewritten, is what runs -----------------------------------


@jax.custom_jvp
def clip_gradient_matmul(x, w):
    """``x @ w`` forward; the JVP the user chose: the true one, times 3 (distinguishable)."""
    return x @ w


@clip_gradient_matmul.defjvp
def _clip_gradient_matmul_jvp(primals, tangents):
    x, w = primals
    dx, dw = tangents
    return x @ w, 3.0 * (dx @ w + x @ dw)


@jax.custom_vjp
def tripled_gradient_matmul(x, w):
    return x @ w


def _tripled_forward(x, w):
    return x @ w, (x, w)


def _tripled_backward(residuals, cotangent):
    x, w = residuals
    return 3.0 * (cotangent @ w.T), 3.0 * (x.T @ cotangent)


tripled_gradient_matmul.defvjp(_tripled_forward, _tripled_backward)

CUSTOM = {"custom_jvp": clip_gradient_matmul, "custom_vjp": tripled_gradient_matmul}


def custom_loss(name):
    return lambda x, w: jnp.sum(CUSTOM[name](x, w))


@pytest.mark.parametrize("name", sorted(CUSTOM))
def test_a_custom_derivatives_forward_matmul_runs_in_float16(name):
    """Fails if the custom_jvp/custom_vjp call is run as traced (its body kept in float32)."""
    x, w = square(jnp.float32), square(jnp.float32)
    closed = jax.make_jaxpr(jaxamp.autocast(CUSTOM[name]))(x, w)
    dots = [eq for eq in all_equations(closed.jaxpr) if eq.primitive.name == "dot_general"]
    assert dots
    assert {eq.outvars[0].aval.dtype for eq in dots} == {jnp.dtype(jnp.float16)}


@pytest.mark.parametrize("name", sorted(CUSTOM))
@pytest.mark.parametrize("order", ["grad(autocast)", "autocast(grad)"])
def test_the_users_derivative_rule_is_what_runs_and_its_matmuls_are_float16(name, order):
    """The gradient is the user's (three times the true one) and every matmul of it is float16."""
    x, w = square(jnp.float32), square(jnp.float32)
    loss = custom_loss(name)
    grad_fn = (
        jax.grad(jaxamp.autocast(loss), argnums=(0, 1))
        if order == "grad(autocast)"
        else jaxamp.autocast(jax.grad(loss, argnums=(0, 1)))
    )
    grads = grad_fn(x, w)
    true_grads = jax.grad(lambda x, w: jnp.sum(x @ w), argnums=(0, 1))(x, w)
    for got, true in zip(grads, true_grads, strict=True):
        assert got.dtype == jnp.float32
        np.testing.assert_allclose(got, 3.0 * true, rtol=1e-2)
    closed = jax.make_jaxpr(grad_fn)(x, w)
    dots = [eq for eq in all_equations(closed.jaxpr) if eq.primitive.name == "dot_general"]
    assert len(dots) >= 3  # forward, and one per differentiated argument
    assert {eq.outvars[0].aval.dtype for eq in dots} == {jnp.dtype(jnp.float16)}


def test_a_jvp_through_a_custom_jvp_uses_the_users_rule_in_float16():
    x, w = square(jnp.float32), square(jnp.float32)
    dx, dw = jnp.ones_like(x), jnp.zeros_like(w)
    fun = jaxamp.autocast(clip_gradient_matmul)
    _, tangent = jax.jvp(fun, (x, w), (dx, dw))
    np.testing.assert_allclose(tangent, 3.0 * (dx @ w), rtol=1e-2)
    closed = jax.make_jaxpr(lambda x, w: jax.jvp(fun, (x, w), (dx, dw)))(x, w)
    dots = [eq for eq in all_equations(closed.jaxpr) if eq.primitive.name == "dot_general"]
    assert dots and {eq.outvars[0].aval.dtype for eq in dots} == {jnp.dtype(jnp.float16)}


# --- edges of the classes ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "primitive, fun",
    [
        ("cumsum", lambda n: jnp.cumsum(n, axis=-1)),
        ("reduce_max", lambda n: jnp.max(n, axis=-1)),
        ("argmax", lambda n: jnp.argmax(n, axis=-1)),
        ("integer_pow", lambda n: n**2),
    ],
)
def test_integer_inputs_of_a_float32_class_primitive_stay_integers(primitive, fun):
    """Only floating inputs are widened: a count or an index stays exact (and usable as an index)."""
    counts = jnp.arange(16, dtype=jnp.int32).reshape(4, 4)
    (equation,) = equations_of(jaxamp.autocast(fun), counts, primitive=primitive)
    assert [atom.aval.dtype for atom in equation.invars] == [jnp.dtype(jnp.int32)]
    np.testing.assert_array_equal(jaxamp.autocast(fun)(counts), fun(counts))


def test_a_literal_equal_to_the_largest_float16_fits_and_stays_weak():
    """65504 is float16's largest finite value: it fits, so the multiply stays float16."""
    closed = jax.make_jaxpr(jaxamp.autocast(lambda x: (x @ x) * 65504.0))(square(jnp.float32))
    (mul,) = [eq for eq in all_equations(closed.jaxpr) if eq.primitive.name == "mul"]
    assert set(floating_dtypes(mul.invars)) == {jnp.dtype(jnp.float16)}


def test_operand_wise_primitives_keep_each_operands_current_dtype():
    """``optimization_barrier`` and ``device_put`` neither promote nor restore their operands."""

    def model(x):
        h = x @ x
        h_barrier, x_barrier = lax.optimization_barrier((h, x))
        return jax.device_put(h_barrier) + x_barrier

    closed = jax.make_jaxpr(jaxamp.autocast(model))(square(jnp.float32))
    (barrier,) = [eq for eq in all_equations(closed.jaxpr) if eq.primitive.name == "optimization_barrier"]
    assert [atom.aval.dtype for atom in barrier.outvars] == [jnp.dtype(jnp.float16), jnp.dtype(jnp.float32)]
    (put,) = [eq for eq in all_equations(closed.jaxpr) if eq.primitive.name == "device_put"]
    assert [atom.aval.dtype for atom in put.outvars] == [jnp.dtype(jnp.float16)]
