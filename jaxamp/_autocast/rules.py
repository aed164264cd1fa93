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
* **follow** (`follow_rule`): elementwise and structural operations follow
  their inputs, by where each came from (`jaxamp._autocast.lineage`): an
  activation or a float32 island decides the dtype; a param's float32
  original, a float32 op's result and a constant are read in their width
  without deciding it, unless the result dtype cannot hold the constant.
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
from jax import lax
from jax.extend.core import Literal

from jaxamp._autocast.context import Rewrite, Rule, bind, cast, is_floating, traced_dtypes
from jaxamp._autocast.lineage import ACTIVATION, constant, follow


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
    """``precision=None`` where the traced matmul names a dot algorithm for other operand dtypes, or
    for half operands with float32 accumulation, which the rewrite's half result replaces."""
    precision = equation.params.get("precision")
    algorithms = (lax.DotAlgorithmPreset, lax.DotAlgorithm)
    if isinstance(precision, algorithms) and (
        equation.invars[0].aval.dtype != operand_dtype or precision in _HALF_WITH_FLOAT32_ACCUMULATION
    ):
        return {"precision": None}
    return {}


# Half operands, float32 accumulation: what a platform does for a half matmul anyway. Asked for by
# jax.nn.dot_product_attention, which falls back from it only when run eagerly; a compiled CPU
# program refuses F16_F16_F32.
_HALF_WITH_FLOAT32_ACCUMULATION = (lax.DotAlgorithmPreset.F16_F16_F32, lax.DotAlgorithmPreset.BF16_BF16_F32)


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



def follow_rule(context: Rewrite, equation, invals: Sequence[Any]) -> list:
    """Follows the inputs (`jaxamp._autocast.lineage.follow`); literals are constants.

    The interpreter calls `follow` itself with each input's lineage; this
    form, for a rule called on its own, takes every other input for an
    activation.
    """
    lineages = [
        constant(context.literal(equation, index)) if isinstance(atom, Literal) else ACTIVATION
        for index, atom in enumerate(equation.invars)
    ]
    return follow(context, equation, invals, lineages)[0]


def convert_rule(context: Rewrite, equation, invals: Sequence[Any]) -> list:
    """The program's own ``astype``: honoured, whatever the input's current dtype."""
    return bind(equation, invals)


# What each rule does to dtypes, read by `jaxamp._autocast.lineage` (which cannot import this module).
compute_rule.role, float32_rule.role, widened_rule.role = "compute", "float32", "widened"
follow_rule.role, convert_rule.role, restore_rule.role = "follow", "convert", "restore"
pass_through_rule.role = "pass_through"


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
