"""The dtype each first-order primitive runs in under `jaxamp.autocast`.

Like JAX's own ``ad.primitive_transposes``, the rules live in a table, keyed
by JAX's names for the primitives (`FIRST_ORDER_RULES`) and resolved to the
running JAX's primitive objects when `autocast` is applied
(`jaxamp._autocast.table`), never on import. Adding a primitive is adding
one entry; the tests check every name against the primitives of each
supported JAX release (``tests/jax_primitives/``) and that every primitive
the installed JAX registers has an entry. Each rule takes the rewrite,
the traced equation and the current input values (whose dtypes may differ
from the traced ones) and returns the output values. The rules, after
``torch.autocast``:

* **compute** (`compute_rule`, "down"): matrix multiplications and
  convolutions with floating operands run in the compute dtype, and their
  result stays in it (``preferred_element_type``): a float32 result would
  make JAX's transpose rules feed float32 cotangents to the backward matmuls.
* **float32** (`float32_rule`, "up"): numerically sensitive operations (the
  exp and log family, roots and powers, special functions, every reduction,
  the linear-algebra decompositions) take float32 inputs and give float32
  results. Softmax, log-softmax, normalization statistics and losses are
  built from these, so they land in float32 without a list of composites.
* **follow** (`follow_rule`): elementwise and structural operations run in
  the widest dtype among their floating inputs. Scalar literals are weak:
  JAX stages ``0.5 * h`` with a float32 literal, which would otherwise pull
  every half-precision value back to float32; a literal that the chosen
  dtype cannot hold (an attention mask's ``-1e9`` in float16) counts as
  float32 and keeps the operation in float32. In the arithmetic ops that
  broadcast (``add``, ``sub``, ``mul``, ``div``, ``max``, ``min``), an
  operand broadcast along some axis of the result (a per-feature value: a
  bias, a normalization's scale and offset, its float32 mean and variance)
  is weak for the result: the op runs in the widest dtype of all its
  inputs, and its result returns to the dtype of its full-size operands,
  so ``(h - mean) * inv * scale + bias`` of a float16 ``h`` is float16, as a
  cuDNN batch norm returns half for half input under ``torch.autocast``.
* **restore** (`restore_rule`): the operation gets its inputs back in the
  dtypes they were traced with and runs exactly as traced: scatters (whose
  update computation is a jaxpr traced for one dtype), collectives (a
  collective keeps the dtype the program gave it), random bits, callbacks,
  custom calls and kernels written for their dtypes, mutable references.
* **pass-through** (`pass_through_rule`): operand-wise operations (barriers,
  transfers, sharding and layout constraints) run on their inputs as they
  are, so a float16 value stays float16 across them.
* **unsupported** (`unsupported`): primitives that cannot occur in a traced
  program; meeting one raises ``NotImplementedError`` with the reason.

``convert_element_type`` is the user's own cast, honoured as written.
Primitives that carry jaxprs are in `jaxamp._autocast.higher_order`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import Literal

from jaxamp._autocast.context import Rewrite, Rule


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

    Integer operands (int8 matmuls) are left as traced. The two operands
    come first; what follows is integer metadata (a ragged dot's group
    sizes), passed as it is.
    """
    dtypes = traced_dtypes(equation.invars)
    if not all(is_floating(dtype) for dtype in dtypes[:2]):
        return restore_rule(context, equation, invals)
    dtype = context.compute_dtype
    casted = [cast(value, dtype) if is_floating(traced) else value for value, traced in zip(invals, dtypes)]
    return bind(equation, casted, preferred_element_type=dtype, **_algorithm_for(equation, dtype))


def _algorithm_for(equation, operand_dtype: Any) -> dict:
    """``precision=None`` where the traced matmul names a dot algorithm for other operand dtypes.

    A program traced in half may ask for ``DotAlgorithmPreset.F16_F16_F32``
    (``jax.nn.dot_product_attention`` does); run with float32 operands it
    would be refused.
    """
    precision = equation.params.get("precision")
    algorithms = (lax.DotAlgorithmPreset, lax.DotAlgorithm)
    if isinstance(precision, algorithms) and equation.invars[0].aval.dtype != operand_dtype:
        return {"precision": None}
    return {}


def float32_rule(context: Rewrite, equation, invals: Sequence[Any]) -> list:
    """Floating inputs in float32 (or wider, if traced wider); the result follows.

    A matmul's or convolution's ``preferred_element_type`` is widened with
    its operands (it names the traced result dtype: half, in a half trace).
    """
    casted = [
        cast(value, jnp.promote_types(jnp.float32, dtype)) if is_floating(dtype) else value
        for value, dtype in zip(invals, traced_dtypes(equation.invars))
    ]
    preferred = equation.params.get("preferred_element_type")
    if preferred is not None and is_floating(preferred):
        wide = jnp.promote_types(jnp.float32, preferred)
        return bind(
            equation, casted, preferred_element_type=wide, **_algorithm_for(equation, casted[0].dtype)
        )
    return bind(equation, casted)


def widened_rule(context: Rewrite, equation, invals: Sequence[Any]) -> list:
    """An op that would follow its inputs, run in float32 (in a float32 policy scope).

    As `float32_rule`, but a rule of its own: the interpreter hands
    `float32_rule` the unrounded value of a rounded chain, which suits a
    reduction fused with its inputs, not a normalization's full-size
    arithmetic, whose float32 operands the backward pass would keep.
    """
    return float32_rule(context, equation, invals)


def _literal_fits(literal: Literal, dtype: Any) -> bool:
    """Whether the finite values of `literal` are within the range of `dtype`."""
    values = np.asarray(literal.val, dtype=np.float64)
    finite = values[np.isfinite(values)]
    return bool(np.all(np.abs(finite) <= float(jnp.finfo(dtype).max)))


BROADCASTING = frozenset(("add", "sub", "mul", "div", "max", "min"))
"""The follow-rule primitives whose result takes the dtype of their full-size operands."""


def _promote(dtypes: Sequence[Any], literals: Sequence[Literal]) -> Any:
    """The widest of `dtypes`, widened further by each literal it cannot hold."""
    dtype = jnp.result_type(*dtypes)
    for literal in literals:
        if not _literal_fits(literal, dtype):
            dtype = jnp.promote_types(dtype, literal.aval.dtype)
    return dtype


def _wider(dtype: Any, traced: Any) -> bool:
    """Whether a value of `dtype` is wider than the program traced it: a float32 original of a
    param traced in half, or the result of an operation the rules ran in float32."""
    return dtype != traced and jnp.promote_types(dtype, traced) == dtype


def _is_broadcast(value: Any, shape: tuple) -> bool:
    """Whether `value` has the rank of `shape` but size 1 along an axis where `shape` is larger.

    A rank-0 array is not counted: a scalar argument of a nested ``jit``
    (``jnp.where``'s ``-1e9``) may be a mask constant that the half dtype
    cannot hold, and, not being a literal, it cannot be checked.
    """
    value_shape = np.shape(value)
    return len(value_shape) == len(shape) and value_shape != tuple(shape)


def follow_rule(context: Rewrite, equation, invals: Sequence[Any]) -> list:
    """Runs in the widest dtype among the floating inputs; literals and broadcast operands are weak.

    The algorithm::

        weak = the floating literals, and the inputs that are a literal
               broadcast to a shape (``jnp.zeros_like``, ``lax.full_like``)
        strong = current dtypes of the other floating inputs
        dtype = promote(strong)              # no strong input: keep as traced
        for each weak input whose literal dtype cannot hold:
            dtype = promote(dtype, its traced dtype)
        cast every floating input to dtype, run the primitive in dtype
        if the primitive is add, sub, mul, div, max or min:
            deciding = the strong inputs of the result's shape, if some
                       strong input is broadcast (size 1 where the result is
                       not); else every strong input
            of those, drop the ones wider than traced (a float32 param's
                original, a float32 rule's result), if any others remain
            if deciding is not every strong input:
                result_dtype = promote(dtypes of deciding), widened by weak inputs as above
                cast the floating results to result_dtype

    So a per-feature float32 value (a bias or scale, which are params, or
    a batch norm's mean and variance, which are float32 reductions) meeting
    a float16 activation computes in float32 and gives float16, as under
    `jaxamp.apply_policy` (which casts a layer's params to the compute
    dtype and a normalization layer's output back to it), and as a cuDNN
    batch norm returns half for half input under ``torch.autocast``. The
    statistics themselves are reductions (`float32_rule`) and stay float32;
    an op whose operands all have the result's shape (``x * x``, two
    activations) is promoted as before. A broadcast literal is as weak as
    the literal: ``lax.select(x > 0, g, lax.full_like(g, 0))``, the
    derivative of ``jax.nn.relu``, stays in ``g``'s dtype. The interpreter
    rounds a chain of broadcasting ops once and tells which inputs are
    broadcast literals (`follow`).
    """
    outvals, _ = follow(context, equation, invals)
    return outvals


def follow(
    context: Rewrite,
    equation,
    invals: Sequence[Any],
    unrounded: Sequence[Any | None] | None = None,
    fills: Sequence[Literal | None] | None = None,
) -> tuple[list, list | None]:
    """`follow_rule`, told which inputs are broadcast literals and which a previous op rounded.

    ``(h - mean) * inv + bias`` is three broadcasting ops; rounding each
    result to float16 would round the normalized activation three times.
    Instead each op takes its inputs' unrounded values where it has them
    (``unrounded[i]``, or None), while the dtype its result returns to is
    still decided by its inputs' rounded dtypes: the chain computes in
    float32 and is rounded once, where something other than such an op
    reads it. The interpreter keeps the unrounded values and the broadcast
    literals of each jaxpr (`jaxamp._autocast.interpreter.interpret`).

    Args:
        context: the rewrite.
        equation: the traced equation.
        invals: its inputs' current values.
        unrounded: per input, its value before a broadcasting op rounded it, or None.
        fills: per input, the literal it is a broadcast of, or None.

    Returns:
        The results, and their unrounded values (None where the results
        were not rounded).
    """
    count = len(invals)
    unrounded = [None] * count if unrounded is None else unrounded
    constants = [atom if isinstance(atom, Literal) else None for atom in equation.invars]
    if fills is not None:
        constants = [literal if literal is not None else fill for literal, fill in zip(constants, fills)]
    floating = [index for index, atom in enumerate(equation.invars) if is_floating(atom.aval.dtype)]
    strong = [index for index in floating if constants[index] is None]
    if not strong:
        return bind(equation, invals), None
    weak = [constants[index] for index in floating if constants[index] is not None]
    shape = equation.outvars[0].aval.shape
    # The inputs whose dtype the result takes: in the arithmetic ops, those of
    # the result's shape, and of those the ones as traced.
    arithmetic = equation.primitive.name in BROADCASTING
    full = [index for index in strong if not _is_broadcast(invals[index], shape)]
    deciding = full if arithmetic and 0 < len(full) < len(strong) else strong
    as_traced = [
        index for index in deciding if not _wider(invals[index].dtype, equation.invars[index].aval.dtype)
    ]
    if arithmetic and as_traced:
        deciding = as_traced
    rounds = len(deciding) < len(strong)
    operands = list(invals)
    if rounds:
        for index in strong:
            if unrounded[index] is not None:
                operands[index] = unrounded[index]
    dtype = _promote([operands[index].dtype for index in strong], weak)
    for index in floating:
        operands[index] = cast(operands[index], dtype)
    outvals = bind(equation, operands)
    if not rounds:
        return outvals, None
    result_dtype = _promote([invals[index].dtype for index in deciding], weak)
    if result_dtype == dtype:
        return outvals, None
    return [cast(value, result_dtype) for value in outvals], outvals


def convert_rule(context: Rewrite, equation, invals: Sequence[Any]) -> list:
    """The program's own ``astype``: honoured, whatever the input's current dtype."""
    return bind(equation, invals)


def unsupported(reason: str) -> Rule:
    """A rule that raises: the primitive cannot be rewritten, for `reason`."""

    def unsupported_rule(context: Rewrite, equation, invals: Sequence[Any]) -> list:
        raise NotImplementedError(
            f"jaxamp.autocast cannot run the primitive {equation.primitive.name!r}: {reason}"
        )

    unsupported_rule.reason = reason
    return unsupported_rule


def _table(groups: dict[Rule, Sequence[str]]) -> dict[str, Rule]:
    """primitive name -> rule, refusing a name listed under two rules."""
    table: dict[str, Rule] = {}
    for rule, names in groups.items():
        for name in names:
            if name in table:
                raise ValueError(f"{name!r} has two rules in the autocast table.")
            table[name] = rule
    return table


_COMPUTE = ("dot_general", "conv_general_dilated", "ragged_dot_general")

_FLOAT32 = (
    # exp / log family, roots, powers
    "exp", "exp2", "expm1", "log", "log1p", "logistic", "sqrt", "rsqrt", "cbrt", "pow", "integer_pow",
    "square", "log2", "polynomial",
    # special functions
    "erf", "erfc", "erf_inv", "lgamma", "digamma", "polygamma", "igamma", "igammac", "igamma_grad_a", "zeta",
    "bessel_i0e", "bessel_i1e", "regularized_incomplete_beta",
    # trigonometric and hyperbolic functions that torch keeps in float32
    "tan", "acos", "asin", "acosh", "asinh", "atanh", "cosh", "sinh",
    # lax.complex takes float32 or float64 parts, never half precision
    "complex",
    # reductions, windowed reductions, cumulative reductions
    "reduce_sum", "reduce_prod", "reduce_max", "reduce_min", "argmax", "argmin", "reduce_and", "reduce_or",
    "reduce_xor", "reduce_window_sum", "reduce_window_max", "reduce_window_min", "cumsum", "cumprod",
    "cummax", "cummin", "cumlogsumexp",
    # linear algebra and the FFT
    "cholesky", "eigh", "eig", "lu", "qr", "svd", "triangular_solve", "tridiagonal", "tridiagonal_solve",
    "householder_product", "schur", "hessenberg", "cholesky_update", "symmetric_product", "ormqr", "geqrf",
    "geqp3", "fft",
    # sums across devices (a gradient's psum): the one sum the rules would otherwise leave in half
    "psum", "psum_invariant", "reduce_scatter", "unreduced_psum", "unreduced_reduce_scatter",
)  # fmt: skip

_FOLLOW = (
    # arithmetic and comparisons
    "add", "add_any", "sub", "mul", "div", "rem", "max", "min", "neg", "sign", "abs", "floor", "ceil",
    "round", "nextafter", "is_finite", "eq", "ne", "lt", "le", "gt", "ge", "select_n", "clamp", "tanh",
    "sin", "cos", "atan", "atan2", "reduce_precision", "copy", "real", "imag", "conj", "one_minus_square",
    # integer and boolean arithmetic (nothing to cast; listed to be complete)
    "and", "or", "not", "xor", "shift_left", "shift_right_arithmetic", "shift_right_logical", "clz",
    "population_count", "mulhi", "eq_to", "le_to", "lt_to",
    # structure
    "broadcast_in_dim", "reshape", "squeeze", "transpose", "rev", "slice", "dynamic_slice",
    "dynamic_update_slice", "gather", "concatenate", "pad", "sort", "top_k", "approx_top_k", "split", "tile",
    "stack", "unstack", "select_and_gather_add", "select_and_scatter_add", "stop_gradient",
)  # fmt: skip

# Operand-wise primitives: each output is its own operand, so no promotion.
_PASS_THROUGH = (
    "optimization_barrier", "device_put", "sharding_constraint", "layout_constraint", "reshard", "relayout",
    "name", "tie", "pvary", "pbroadcast", "preduced", "reduced_vary_cast_p", "reduced_vary_cast",
    "vary_unreduced_cast_p", "vary_unreduced_cast", "stage", "dce_sink",
)  # fmt: skip

# Run as traced: the operation's meaning is tied to its traced dtypes.
_RESTORE = (
    # scatters: the update jaxpr combines values of the traced dtype
    "scatter", "scatter-add", "scatter-sub", "scatter-mul", "scatter-min", "scatter-max",
    # reductions with a jaxpr of their own (lax.reduce, lax.reduce_window)
    "reduce", "reduce_window", "select_and_scatter",
    # bits and integers: reinterpreting bits depends on the dtype
    "bitcast_convert_type", "iota", "empty", "empty2", "lu_pivots_to_permutation",
    # collectives that move or pick values keep the dtype the program gave them
    "pmax", "pmin", "all_gather", "all_to_all", "ppermute", "ragged_all_to_all", "axis_index",
    "all_gather_invariant", "all_gather_reduced", "unreduced_pmax", "unreduced_pmin", "psend", "precv",
    # their asynchronous halves
    "psum_start", "psum_done", "psum_invariant_start", "all_gather_start", "all_gather_done",
    "all_gather_reduced_start", "all_to_all_start", "all_to_all_done", "ppermute_start", "ppermute_done",
    "reduce_scatter_start", "reduce_scatter_done", "pbroadcast_start", "pbroadcast_done",
    "pbroadcast_dynamic", "unreduced_psum_start", "unreduced_reduce_scatter_start",
    # random numbers
    "random_bits", "random_seed", "random_split", "random_fold_in", "random_gamma", "random_wrap",
    "random_unwrap", "random_clone", "threefry2x32", "threefry4x32", "philox2x32", "philox4x32",
    "iota_2x32_shape", "rng_bit_generator", "rng_uniform",
    # callbacks, custom calls and kernels, written for their dtypes
    "pure_callback", "io_callback", "debug_callback", "debug_print", "ffi_call", "inspect_sharding",
    "call_exported", "scaled_matmul", "scaled_matmul_wrapper", "scaled_dot", "dot_product_attention_fwd",
    "dot_product_attention_bwd", "dot_product_attention_fwd_wrapper", "dot_product_attention_bwd_wrapper",
    "dot_product_attention_fp8_fwd", "dot_product_attention_fp8_bwd",
    "dot_product_attention_fp8_fwd_wrapper", "dot_product_attention_fp8_bwd_wrapper",
    # mutable references and boxes: a reference keeps the dtype it was created with
    "get", "swap", "addupdate", "new_ref", "empty_ref", "free_ref", "freeze", "accum_grad_in_ref",
    "create_linear", "pin", "broadcast_to", "unpin", "box_get", "box_set", "new_box", "log_extend",
    "log_read", "new_log",
    # extended dtypes, shape polymorphism, tokens, platform dispatch
    "to_edtype", "from_edtype", "dim_as_value", "dimension_size", "shape_assertion", "create_token",
    "after_all", "platform_index", "unreachable",
)  # fmt: skip

# The primitives that a JAX module registers only when imported (jax.experimental.sparse
# takes half a second to import, so jaxamp imports none of them to get the objects).
_OPTIONAL_MODULES = {
    # jax.experimental.checkify
    "check": restore_rule,
    # Pallas (jax.experimental.pallas and its backends): kernel-body primitives,
    # which autocast never meets outside a pallas_call (run as traced)
    "masked_load": restore_rule, "masked_swap": restore_rule, "multiple_of": restore_rule,
    "reciprocal": restore_rule, "get_global": restore_rule, "max_contiguous": restore_rule,
    "bitcast": restore_rule, "roll": restore_rule, "einshape_lo": restore_rule,
    "remove_memory_space": restore_rule, "tpu_custom_call": restore_rule,
    "mosaic_gpu_p": restore_rule, "with_memory_space_constraint": pass_through_rule,
    # jax.experimental.rnn (cuDNN kernels)
    "rnn_fwd": restore_rule, "rnn_bwd": restore_rule,
    # jax.experimental.multihost_utils: operand-wise transfers
    "global_array_to_host_local_array": pass_through_rule,
    "host_local_array_to_global_array": pass_through_rule,
    # jax.experimental.xla_metadata, jax.experimental.buffer_callback
    "xla_metadata_value": pass_through_rule, "buffer_callback": restore_rule,
    # Flax NNX variables (which jaxamp imports): a variable keeps its dtype
    "new_variable": restore_rule, "get_variable": restore_rule, "set_variable": restore_rule,
    # jax.experimental.sparse: sparse kernels, run as traced
    **{
        name: restore_rule
        for name in (
            "bcoo_dot_general", "bcoo_dot_general_sampled", "bcoo_extract", "bcoo_fromdense",
            "bcoo_sort_indices", "bcoo_spdot_general", "bcoo_sum_duplicates", "bcoo_todense",
            "bcoo_transpose", "bcsr_dot_general", "bcsr_extract", "bcsr_fromdense", "bcsr_todense",
            "coo_fromdense", "coo_matmat", "coo_matvec", "coo_spmm", "coo_spmv", "coo_todense",
            "csr_fromdense", "csr_matmat", "csr_matvec", "csr_spmm", "csr_spmv", "csr_todense", "spsolve",
            "todense",
        )
    },
}  # fmt: skip

FIRST_ORDER_RULES: dict[str, Rule] = {
    **_table(
        {
            compute_rule: _COMPUTE,
            float32_rule: _FLOAT32,
            follow_rule: _FOLLOW,
            pass_through_rule: _PASS_THROUGH,
            restore_rule: _RESTORE,
        }
    ),
    "convert_element_type": convert_rule,
    **_OPTIONAL_MODULES,
}
"""Primitive name -> rule, for the primitives without a jaxpr to rewrite.

Keyed by JAX's names, not by the primitive objects: nothing here reads
JAX's primitive set when jaxamp is imported, and a name the running JAX
does not register (one a release added or removed) is simply absent from
the table `jaxamp._autocast.table.rules_table` resolves. The tests check
every name against the primitives of each supported JAX release."""

RULES_BY_NAME: dict[str, Rule] = {
    "compute": compute_rule,
    "float32": float32_rule,
    "follow": follow_rule,
    "restore": restore_rule,
}
"""The rule names that ``autocast(..., overrides={primitive: name})`` accepts."""
