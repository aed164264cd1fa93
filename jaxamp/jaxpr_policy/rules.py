"""The dtype each first-order primitive runs in under `jaxamp.autocast`.

Like JAX's own ``ad.primitive_transposes``, the rules live in a table keyed
by the primitive objects themselves (`FIRST_ORDER_RULES`), taken from where
JAX exports them (``jax.lax.exp_p``, ``jax.extend.core.primitives``) or, for
the few it does not export, found by name in JAX's registry
(`jaxamp.jaxpr_policy.registry.registered`, which fails loudly on a name JAX
does not have). Adding a primitive is adding one entry, and a test checks
that every primitive JAX registers has one. Each rule takes the rewrite,
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
  float32 and keeps the operation in float32.
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
Primitives that carry jaxprs are in `jaxamp.jaxpr_policy.higher_order`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax.extend.core.primitives as core_primitives
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import Literal, Primitive
from jax.lax import linalg

from jaxamp.jaxpr_policy.context import Rewrite, Rule
from jaxamp.jaxpr_policy.registry import registered


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
    return bind(equation, casted, preferred_element_type=dtype)


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


def unsupported(reason: str) -> Rule:
    """A rule that raises: the primitive cannot be rewritten, for `reason`."""

    def unsupported_rule(context: Rewrite, equation, invals: Sequence[Any]) -> list:
        raise NotImplementedError(
            f"jaxamp.autocast cannot run the primitive {equation.primitive.name!r}: {reason}"
        )

    unsupported_rule.reason = reason
    return unsupported_rule


def _table(groups: dict[Rule, Sequence[Primitive | None]]) -> dict[Primitive, Rule]:
    """primitive -> rule, skipping the primitives of other JAX releases (None)."""
    table: dict[Primitive, Rule] = {}
    for rule, primitives in groups.items():
        for primitive in primitives:
            if primitive is None:
                continue
            if primitive in table:
                raise ValueError(f"{primitive.name!r} has two rules in the autocast table.")
            table[primitive] = rule
    return table


# The releases that added or removed primitives, down to the patch release:
# checked on jax 0.10.2, 0.11.0, 0.11.1, 0.11.2 and 0.12.0.1.
_V0111 = (0, 11, 1)
_V0112 = (0, 11, 2)
_V012 = (0, 12)

_COMPUTE = (lax.dot_general_p, lax.conv_general_dilated_p, registered("ragged_dot_general"))

_FLOAT32 = (
    # exp / log family, roots, powers
    lax.exp_p, lax.exp2_p, lax.expm1_p, lax.log_p, lax.log1p_p, lax.logistic_p, lax.sqrt_p,
    lax.rsqrt_p, lax.cbrt_p, lax.pow_p, lax.integer_pow_p, lax.square_p,
    registered("log2", added=_V0112), registered("polynomial", added=_V012),
    # special functions
    lax.erf_p, lax.erfc_p, lax.erf_inv_p, lax.lgamma_p, lax.digamma_p, lax.polygamma_p, lax.igamma_p,
    lax.igammac_p, lax.igamma_grad_a_p, lax.zeta_p, lax.bessel_i0e_p, lax.bessel_i1e_p,
    lax.regularized_incomplete_beta_p,
    # trigonometric and hyperbolic functions that torch keeps in float32
    lax.tan_p, lax.acos_p, lax.asin_p, lax.acosh_p, lax.asinh_p, lax.atanh_p, lax.cosh_p, lax.sinh_p,
    # lax.complex takes float32 or float64 parts, never half precision
    lax.complex_p,
    # reductions, windowed reductions, cumulative reductions
    lax.reduce_sum_p, lax.reduce_prod_p, lax.reduce_max_p, lax.reduce_min_p, lax.argmax_p,
    lax.argmin_p, lax.reduce_and_p, lax.reduce_or_p, lax.reduce_xor_p, lax.reduce_window_sum_p,
    lax.reduce_window_max_p, lax.reduce_window_min_p, lax.cumsum_p, lax.cumprod_p, lax.cummax_p,
    lax.cummin_p, lax.cumlogsumexp_p,
    # linear algebra and the FFT
    core_primitives.cholesky_p, core_primitives.eigh_p, core_primitives.eig_p, core_primitives.lu_p,
    core_primitives.qr_p, core_primitives.svd_p, core_primitives.triangular_solve_p,
    core_primitives.tridiagonal_p, core_primitives.tridiagonal_solve_p,
    core_primitives.householder_product_p, core_primitives.schur_p, core_primitives.hessenberg_p,
    linalg.cholesky_update_p, linalg.symmetric_product_p, linalg.ormqr_p, registered("geqrf"),
    registered("geqp3"), lax.fft_p,
)  # fmt: skip

_FOLLOW = (
    # arithmetic and comparisons
    lax.add_p, core_primitives.add_jaxvals_p, lax.sub_p, lax.mul_p, lax.div_p, lax.rem_p, lax.max_p,
    lax.min_p, lax.neg_p, lax.sign_p, lax.abs_p, lax.floor_p, lax.ceil_p, lax.round_p,
    lax.nextafter_p, lax.is_finite_p, lax.eq_p, lax.ne_p, lax.lt_p, lax.le_p, lax.gt_p, lax.ge_p,
    lax.select_n_p, lax.clamp_p, lax.tanh_p, lax.sin_p, lax.cos_p, lax.atan_p, lax.atan2_p,
    lax.reduce_precision_p, lax.copy_p, lax.real_p, lax.imag_p, lax.conj_p,
    registered("one_minus_square", added=_V0112),
    # integer and boolean arithmetic (nothing to cast; listed to be complete)
    lax.and_p, lax.or_p, lax.not_p, lax.xor_p, lax.shift_left_p, lax.shift_right_arithmetic_p,
    lax.shift_right_logical_p, lax.clz_p, lax.population_count_p, lax.mulhi_p, lax.eq_to_p,
    lax.le_to_p, lax.lt_to_p,
    # structure
    lax.broadcast_in_dim_p, lax.reshape_p, lax.squeeze_p, lax.transpose_p, lax.rev_p, lax.slice_p,
    lax.dynamic_slice_p, lax.dynamic_update_slice_p, lax.gather_p, lax.concatenate_p, lax.pad_p,
    lax.sort_p, lax.top_k_p, lax.approx_top_k_p, lax.split_p, lax.tile_p, lax.stack_p, lax.unstack_p,
    lax.select_and_gather_add_p, lax.select_and_scatter_add_p, lax.stop_gradient_p,
)  # fmt: skip

# Operand-wise primitives: each output is its own operand, so no promotion.
_PASS_THROUGH = (
    lax.optimization_barrier_p, lax.device_put_p, lax.sharding_constraint_p,
    registered("layout_constraint"), registered("reshard"), registered("relayout", added=_V0111),
    core_primitives.name_p, registered("tie"), registered("pvary"), registered("pbroadcast"),
    registered("preduced"), registered("reduced_vary_cast_p", removed=_V012),
    registered("reduced_vary_cast", added=_V012), registered("vary_unreduced_cast_p", removed=_V012),
    registered("vary_unreduced_cast", added=_V012), lax.stage_p, registered("dce_sink"),
)  # fmt: skip

# Run as traced: the operation's meaning is tied to its traced dtypes.
_RESTORE = (
    # scatters: the update jaxpr combines values of the traced dtype
    lax.scatter_p, lax.scatter_add_p, lax.scatter_sub_p, lax.scatter_mul_p, lax.scatter_min_p,
    lax.scatter_max_p,
    # reductions with a jaxpr of their own (lax.reduce, lax.reduce_window)
    lax.reduce_p, lax.reduce_window_p, lax.select_and_scatter_p,
    # bits and integers: reinterpreting bits depends on the dtype
    lax.bitcast_convert_type_p, lax.iota_p, registered("empty"), core_primitives.empty2_p,
    linalg.lu_pivots_to_permutation_p,
    # collectives keep the dtype the program gave them
    lax.psum_p, lax.pmax_p, lax.pmin_p, lax.all_gather_p, lax.all_to_all_p, lax.ppermute_p,
    lax.ragged_all_to_all_p, lax.axis_index_p, registered("reduce_scatter"),
    registered("psum_invariant"), registered("all_gather_invariant"),
    registered("all_gather_reduced"), registered("unreduced_psum"),
    registered("unreduced_reduce_scatter"), registered("unreduced_pmax", added=_V0111),
    registered("unreduced_pmin", added=_V0111), registered("psend"), registered("precv"),
    # their asynchronous halves
    registered("psum_start", removed=_V0111), registered("psum_done"),
    registered("psum_invariant_start"), registered("all_gather_start"),
    registered("all_gather_done"), registered("all_gather_reduced_start"),
    registered("all_to_all_start"), registered("all_to_all_done"), registered("ppermute_start"),
    registered("ppermute_done"), registered("reduce_scatter_start"),
    registered("reduce_scatter_done"), registered("pbroadcast_start", removed=_V0111),
    registered("pbroadcast_done", removed=_V0111), registered("pbroadcast_dynamic", added=_V012),
    registered("unreduced_psum_start", removed=_V0111),
    registered("unreduced_reduce_scatter_start", removed=_V0111),
    # random numbers
    core_primitives.random_bits_p, core_primitives.random_seed_p, core_primitives.random_split_p,
    core_primitives.random_fold_in_p, core_primitives.random_gamma_p, registered("random_wrap"),
    registered("random_unwrap"), registered("random_clone"), core_primitives.threefry2x32_p,
    registered("threefry4x32"), registered("philox2x32"), registered("philox4x32"),
    registered("iota_2x32_shape"), lax.rng_bit_generator_p, lax.rng_uniform_p,
    # callbacks, custom calls and kernels, written for their dtypes
    registered("pure_callback"), registered("io_callback"), registered("debug_callback"),
    registered("debug_print"), registered("ffi_call"), registered("inspect_sharding"),
    registered("call_exported"), registered("scaled_matmul"), registered("scaled_matmul_wrapper"),
    registered("scaled_dot"), registered("dot_product_attention_fwd"),
    registered("dot_product_attention_bwd"), registered("dot_product_attention_fwd_wrapper"),
    registered("dot_product_attention_bwd_wrapper"), registered("dot_product_attention_fp8_fwd"),
    registered("dot_product_attention_fp8_bwd"), registered("dot_product_attention_fp8_fwd_wrapper"),
    registered("dot_product_attention_fp8_bwd_wrapper"),
    # mutable references and boxes: a reference keeps the dtype it was created with
    core_primitives.get_p, core_primitives.swap_p, registered("addupdate"), registered("new_ref"),
    registered("empty_ref"), registered("free_ref"), registered("freeze"),
    registered("accum_grad_in_ref"), registered("create_linear"), registered("pin"),
    registered("broadcast_to"),
    registered("unpin"), registered("box_get", removed=_V0111), registered("box_set", removed=_V0111),
    registered("new_box", removed=_V0111), registered("log_extend", removed=_V0111),
    registered("log_read", removed=_V0111), registered("new_log", removed=_V0111),
    # extended dtypes, shape polymorphism, tokens, platform dispatch
    registered("to_edtype"), registered("from_edtype"), registered("dim_as_value"),
    registered("dimension_size"), registered("shape_assertion"), lax.create_token_p,
    lax.after_all_p, registered("platform_index"), registered("unreachable"),
)  # fmt: skip

FIRST_ORDER_RULES: dict[Primitive, Rule] = {
    **_table(
        {
            compute_rule: _COMPUTE,
            float32_rule: _FLOAT32,
            follow_rule: _FOLLOW,
            pass_through_rule: _PASS_THROUGH,
            restore_rule: _RESTORE,
        }
    ),
    lax.convert_element_type_p: convert_rule,
}
"""Primitive -> rule, for the primitives without a jaxpr to rewrite."""

OPTIONAL_RULES: dict[str, Rule] = {
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
            "csr_fromdense", "csr_matmat", "csr_matvec", "csr_spmm", "csr_spmv", "csr_todense",
            "spsolve", "todense",
        )
    },
}  # fmt: skip
"""Primitive name -> rule, for the first-order primitives that a JAX module
registers only when imported (``jax.experimental.sparse`` takes half a second
to import, so jaxamp does not import it to get the objects). Resolved through
the registry when a table is built (`jaxamp.jaxpr_policy.table`); the registry
test imports every such module and checks that each name resolves."""

RULES_BY_NAME: dict[str, Rule] = {
    "compute": compute_rule,
    "float32": float32_rule,
    "follow": follow_rule,
    "restore": restore_rule,
}
"""The rule names that ``autocast(..., overrides={primitive: name})`` accepts."""
