"""The dtype each first-order primitive runs in under `jaxamp.autocast`.

Like JAX's own ``ad.primitive_transposes``, the rules live in a table keyed
by primitive name (`FIRST_ORDER_RULES`); adding a primitive is adding one
entry. Each rule takes the rewrite context, the traced equation and the
current input values (whose dtypes may differ from the traced ones) and
returns the output values. The four rules, after ``torch.autocast``:

* **compute** (`compute_rule`): matrix multiplications and convolutions with
  floating operands run in the compute dtype, and their result stays in it
  (``preferred_element_type``): a float32 result would make JAX's transpose
  rules feed float32 cotangents to the backward matmuls.
* **float32** (`float32_rule`): numerically sensitive operations (the exp
  and log family, roots and powers, special functions, every reduction, the
  linear-algebra decompositions) take float32 inputs and give float32
  results. Softmax, log-softmax, normalization statistics and losses are
  built from these, so they land in float32 without a list of composites.
* **follow** (`follow_rule`): elementwise and structural operations run in
  the widest dtype among their floating inputs. Scalar literals are weak:
  JAX stages ``0.5 * h`` with a float32 literal, which would otherwise pull
  every half-precision value back to float32; a literal that the chosen
  dtype cannot hold (an attention mask's ``-1e9`` in float16) counts as
  float32 and keeps the operation in float32.
* **restore** (`restore_rule`): everything else (callbacks, scatters, random
  bits, custom calls, Pallas kernels) gets its inputs back in the dtypes
  they were traced with and runs exactly as traced.

``convert_element_type`` is the user's own cast, honoured as written.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import Literal

if TYPE_CHECKING:
    from jaxamp.jaxpr_policy.interpreter import Rewrite

Rule = Callable[["Rewrite", Any, Sequence[Any]], list]


def is_floating(dtype: Any) -> bool:
    """Whether `dtype` is a real floating dtype (float0 and complex are not)."""
    return jnp.issubdtype(dtype, jnp.floating)


def cast(value: Any, dtype: Any) -> Any:
    """`value` in `dtype`; NumPy values (literals, constants) stay NumPy values."""
    if value.dtype == dtype:
        return value
    if isinstance(value, (np.ndarray, np.generic)):
        return np.asarray(value).astype(dtype)
    return lax.convert_element_type(value, dtype)


def _bind_arguments(primitive, params: dict) -> tuple[tuple, dict]:
    """The extra leading arguments and the params that ``primitive.bind`` takes.

    ``get_bind_params`` turns a jaxpr equation's params into bind's (a custom
    derivative's jaxprs into functions): JAX 0.10 returns the params with
    the functions among them, releases before it a ``(functions, params)``
    pair.
    """
    bind_params = primitive.get_bind_params(params)
    if isinstance(bind_params, tuple):
        return tuple(bind_params[0]), bind_params[1]
    return (), bind_params


def bind(equation, invals: Sequence[Any], **param_updates) -> list:
    """Applies `equation`'s primitive to `invals` with its params, some replaced."""
    subfuns, bind_params = _bind_arguments(equation.primitive, {**equation.params, **param_updates})
    outvals = equation.primitive.bind(*subfuns, *invals, **bind_params)
    return list(outvals) if equation.primitive.multiple_results else [outvals]


def traced_dtypes(atoms: Sequence[Any]) -> list:
    """The dtypes `atoms` (jaxpr variables or literals) had when traced."""
    return [atom.aval.dtype for atom in atoms]


def restore_rule(context: Rewrite, equation, invals: Sequence[Any]) -> list:
    """Runs `equation` exactly as traced: inputs cast back to their traced dtypes."""
    return bind(
        equation, [cast(value, dtype) for value, dtype in zip(invals, traced_dtypes(equation.invars))]
    )


def pass_through_rule(context: Rewrite, equation, invals: Sequence[Any]) -> list:
    """Runs `equation` on its inputs as they are (operand-wise ops: barriers, transfers)."""
    return bind(equation, invals)


def compute_rule(context: Rewrite, equation, invals: Sequence[Any]) -> list:
    """Matmul or convolution in the compute dtype, result in the compute dtype.

    Integer operands (int8 matmuls) are left as traced.
    """
    if not all(is_floating(dtype) for dtype in traced_dtypes(equation.invars)):
        return restore_rule(context, equation, invals)
    dtype = context.compute_dtype
    return bind(equation, [cast(value, dtype) for value in invals], preferred_element_type=dtype)


def float32_rule(context: Rewrite, equation, invals: Sequence[Any]) -> list:
    """Floating inputs in float32 (or wider, if traced wider); the result follows."""
    casted = [
        cast(value, jnp.promote_types(jnp.float32, dtype)) if is_floating(dtype) else value
        for value, dtype in zip(invals, traced_dtypes(equation.invars))
    ]
    return bind(equation, casted)


def _literal_fits(literal: Literal, dtype: Any) -> bool:
    """Whether the finite values of `literal` are within the range of `dtype`."""
    values = np.asarray(literal.val, dtype=np.float64)
    finite = values[np.isfinite(values)]
    return bool(np.all(np.abs(finite) <= float(jnp.finfo(dtype).max)))


def follow_rule(context: Rewrite, equation, invals: Sequence[Any]) -> list:
    """Runs in the widest dtype among the floating inputs; literals are weak.

    The algorithm::

        strong = current dtypes of the floating non-literal inputs
        dtype = promote(strong)              # no strong input: keep as traced
        for each floating literal that dtype cannot hold:
            dtype = promote(dtype, its traced dtype)
        cast every floating input to dtype
    """
    floating = [index for index, atom in enumerate(equation.invars) if is_floating(atom.aval.dtype)]
    strong = [invals[index].dtype for index in floating if not isinstance(equation.invars[index], Literal)]
    if not strong:
        return bind(equation, invals)
    dtype = jnp.result_type(*strong)
    for index in floating:
        atom = equation.invars[index]
        if isinstance(atom, Literal) and not _literal_fits(atom, dtype):
            dtype = jnp.promote_types(dtype, atom.aval.dtype)
    casted = list(invals)
    for index in floating:
        casted[index] = cast(invals[index], dtype)
    return bind(equation, casted)


def convert_rule(context: Rewrite, equation, invals: Sequence[Any]) -> list:
    """The user's explicit ``astype``: honoured, whatever the input's current dtype."""
    return bind(equation, invals)


_COMPUTE = ("dot_general", "conv_general_dilated")

_FLOAT32 = (
    # exp / log family, roots, powers
    "exp", "exp2", "expm1", "log", "log1p", "logistic", "sqrt", "rsqrt", "cbrt",
    "pow", "integer_pow", "square",
    # special functions
    "erf", "erfc", "erf_inv", "lgamma", "digamma", "polygamma", "igamma", "igammac",
    "igamma_grad_a", "random_gamma_grad", "zeta", "bessel_i0e", "bessel_i1e",
    "regularized_incomplete_beta",
    # trigonometric and hyperbolic functions that torch keeps in float32
    "tan", "acos", "asin", "acosh", "asinh", "atanh", "cosh", "sinh",
    # reductions, windowed reductions, cumulative reductions
    "reduce_sum", "reduce_prod", "reduce_max", "reduce_min", "argmax", "argmin",
    "reduce_window_sum", "reduce_window_max", "reduce_window_min",
    "cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp",
    # linear algebra
    "cholesky", "eigh", "eig", "lu", "qr", "svd", "triangular_solve", "tridiagonal_solve",
    "householder_product", "schur", "hessenberg", "fft",
)  # fmt: skip

_FOLLOW = (
    # arithmetic and comparisons
    "add", "add_any", "sub", "mul", "div", "rem", "max", "min", "neg", "sign", "abs",
    "floor", "ceil", "round", "nextafter", "is_finite", "eq", "ne", "lt", "le", "gt", "ge",
    "select_n", "clamp", "tanh", "sin", "cos", "atan", "atan2", "reduce_precision", "copy", "copy_p",
    # structure
    "broadcast_in_dim", "reshape", "squeeze", "expand_dims", "transpose", "rev", "slice",
    "dynamic_slice", "dynamic_update_slice", "gather", "concatenate", "pad", "sort", "top_k",
    "split", "select_and_gather_add", "select_and_scatter_add", "sharding_constraint", "stop_gradient",
)  # fmt: skip

# Operand-wise primitives: each output is its own operand, so no promotion.
_PASS_THROUGH = ("optimization_barrier", "device_put")

# Primitives that carry a jaxpr of their own but run as traced (their update or
# reduction computation is dtype-specific, or a kernel is written for its dtypes).
_RESTORE = (
    "scatter", "scatter_add", "scatter_sub", "scatter_mul", "scatter_min", "scatter_max",
    "reduce", "reduce_window", "select_and_scatter", "pallas_call", "linear_solve",
)  # fmt: skip

FIRST_ORDER_RULES: dict[str, Rule] = {
    **{name: compute_rule for name in _COMPUTE},
    **{name: float32_rule for name in _FLOAT32},
    **{name: follow_rule for name in _FOLLOW},
    **{name: pass_through_rule for name in _PASS_THROUGH},
    **{name: restore_rule for name in _RESTORE},
    "convert_element_type": convert_rule,
}
"""Primitive name -> rule, for primitives without a jaxpr to rewrite."""

RULES_BY_NAME: dict[str, Rule] = {
    "compute": compute_rule,
    "float32": float32_rule,
    "follow": follow_rule,
    "restore": restore_rule,
}
"""The rule names that ``autocast(..., overrides={primitive: name})`` accepts."""
