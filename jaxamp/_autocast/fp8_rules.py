"""The FP8 rules of `jaxamp.autocast`: which matmuls run in FP8, and why the others do not.

Under a policy with FP8 matmuls (``"mixed_float8"``) these rules replace
the compute rule of ``dot_general``, ``conv_general_dilated`` and
``ragged_dot_general`` (`fp8_rules`); every other primitive keeps its rule
from `jaxamp._autocast.rules`, exactly as under ``"mixed_bfloat16"``.

An eligible ``dot_general`` becomes `jaxamp.fp8_dot_general` and an
eligible convolution `jaxamp.fp8.fp8_convolution` (forward FP8, backward
bfloat16 under the ``conv_backward`` fallback scope), both traced under
``jax.named_scope("jaxamp_fp8")``. Every other floating matmul or
convolution runs in the compute dtype (the compute rule) under
``jax.named_scope("jaxamp_fp8_fallback_<reason>")``, with the reason one of
`FP8_FALLBACK_REASONS`; so the compiled program names each op that was not
FP8 and why. Integer dots run as traced (their scope says so too).

FP8 only where it pays: where a target GPU decides (`jaxamp.diagnostics.fp8_target`
around the trace, else the GPU the program runs on), an eligible
``dot_general`` runs in FP8 only if `jaxamp.diagnostics.fp8_matmul_cost` says
that its FP8 training pass, quantization included, is faster on paper than
the compute dtype's; it is then traced under ``jaxamp_fp8_pays`` too, and
otherwise falls back with the reason ``too_small_to_pay``. Without a target
(a CPU, or ``fp8_target("everywhere")``) every eligible matmul runs in FP8.

The block-scaled formats (``"mixed_mxfp8"``, ``"mixed_nvfp4"``) are the
same rules with another kernel: an eligible ``dot_general`` becomes
`jaxamp.fp8.block_scaled_dot_general` in the policy's format, eligible
where its M, N and K are multiples of the format's block size (32 for
MXFP8: ``shape_not_multiple_of_32``; 16 for NVFP4), and FP8 pays by
`jaxamp.diagnostics.fp8_matmul_cost` of that format. Batched matmuls
(attention) stay in the compute dtype as under FP8, as do convolutions
(``block_scaled_conv``: XLA has no block-scaled convolution). A target GPU
without block-scaled tensor cores (before Blackwell) keeps every matmul of
such a policy in the compute dtype (``needs_blackwell``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from jaxamp._autocast.context import Rewrite, Rule
from jaxamp._autocast.rules import bind, compute_rule, is_floating, traced_dtypes
from jaxamp.fp8._block_scaled import block_scaled_dot_general
from jaxamp.fp8._matmul import (
    FP8_FALLBACK_REASONS,
    FP8_FALLBACK_SCOPE_PREFIX,
    FP8_PAYS_SCOPE_NAME,
    fp8_convolution,
    fp8_dot_general,
)
from jaxamp.fp8._payoff import current_fp8_target, fp8_matmul_cost, runs_block_scaled
from jaxamp.fp8._recipe import current_block_recipe

# The size M, N and K must be a multiple of, by matmul format: cuBLASLt's FP8 granularity, the block sizes.
_MULTIPLE = {"float8": 16, "mxfp8": 32, "nvfp4": 16}


def _product(shape: Sequence[int], dims: Sequence[int]) -> int:
    return int(np.prod([shape[dim] for dim in dims], dtype=np.int64))


def _matmul_sizes(equation) -> tuple[int, int, int]:
    """``(M, N, K)`` of a ``dot_general`` without batch dims: lhs free, rhs free, contracted."""
    (lhs_contract, rhs_contract), _ = equation.params["dimension_numbers"]
    lhs_shape, rhs_shape = (atom.aval.shape for atom in equation.invars)
    lhs_free = [dim for dim in range(len(lhs_shape)) if dim not in lhs_contract]
    rhs_free = [dim for dim in range(len(rhs_shape)) if dim not in rhs_contract]
    return _product(lhs_shape, lhs_free), _product(rhs_shape, rhs_free), _product(lhs_shape, lhs_contract)


def dot_fallback_reason(equation, matmul_format: str = "float8") -> str | None:
    """Why `equation` (a ``dot_general``) cannot run as a dot of `matmul_format`, or None if it can."""
    if not all(is_floating(dtype) for dtype in traced_dtypes(equation.invars)):
        return "integer_operands"
    (_, (lhs_batch, _)) = equation.params["dimension_numbers"]
    if lhs_batch:
        return "batch_dims"
    multiple = _MULTIPLE[matmul_format]
    if any(size % multiple for size in _matmul_sizes(equation)):
        return f"shape_not_multiple_of_{multiple}"
    target = current_fp8_target()
    if matmul_format != "float8" and target is not None and not runs_block_scaled(target):
        return "needs_blackwell"
    return None


def fp8_payoff(equation, invals: Sequence[Any], compute_dtype, matmul_format: str = "float8") -> bool | None:
    """Whether FP8 pays for an eligible `equation` on the current target; None without a target.

    The target is `jaxamp.diagnostics.fp8_target`'s or the device's
    (`current_fp8_target`); the cost,
    `jaxamp.diagnostics.fp8_matmul_cost` of the matmul's sizes and its
    operands' bytes per element as they reach it.
    """
    target = current_fp8_target()
    if target is None:
        return None
    m, n, k = _matmul_sizes(equation)
    operand_bytes = [np.dtype(value.dtype).itemsize for value in invals]
    cost = fp8_matmul_cost(
        m,
        k,
        n,
        target,
        operand_bytes=operand_bytes,
        compute_dtype=np.dtype(compute_dtype).name,
        matmul_format=matmul_format,
    )
    return cost.pays


def fp8_decision_key() -> tuple:
    """What decides the FP8 rules now (the target's name, or "everywhere"; the NVFP4 recipe):
    part of the rewrite cache's key of an FP8 policy, so that a function traced under one
    target or recipe is not reused under another."""
    target = current_fp8_target()
    return ("everywhere" if target is None else target.description, current_block_recipe())


def conv_fallback_reason(equation) -> str | None:
    """Why `equation` (a ``conv_general_dilated``) cannot run as an FP8 forward convolution, or None."""
    if not all(is_floating(dtype) for dtype in traced_dtypes(equation.invars)):
        return "integer_operands"
    params = equation.params
    if params["feature_group_count"] != 1 or params["batch_group_count"] != 1:
        return "grouped_conv"
    if any(dilation != 1 for dilation in params["lhs_dilation"]):
        return "transposed_conv"
    numbers = params["dimension_numbers"]
    lhs_shape, rhs_shape = (atom.aval.shape for atom in equation.invars)
    features = (lhs_shape[numbers.lhs_spec[1]], rhs_shape[numbers.rhs_spec[0]])
    if any(size % _MULTIPLE["float8"] for size in features):
        return "shape_not_multiple_of_16"
    return None


def fp8_conv_rule(observer: Callable | None = None, matmul_format: str = "float8") -> Rule:
    """The ``conv_general_dilated`` rule: forward FP8 when eligible (backward bfloat16), else
    the compute dtype under a fallback scope (always, under a block-scaled format)."""
    if matmul_format != "float8":
        return _in_fallback_scope("block_scaled_conv", compute_rule)

    def rule(context: Rewrite, equation, invals: Sequence[Any]) -> list:
        reason = conv_fallback_reason(equation)
        if reason is not None:
            return _in_fallback_scope(reason, compute_rule)(context, equation, invals)
        dtype = context.compute_dtype

        def convolution(lhs, rhs):
            (out,) = bind(equation, [lhs, rhs], preferred_element_type=dtype)
            return out

        # fp8_convolution traces itself under the jaxamp_fp8 scope.
        return [fp8_convolution(*invals, convolution, dtype, _observer=observer)]

    return rule


def _in_fallback_scope(reason: str, rule: Rule) -> Rule:
    """`rule`, traced under the fallback scope of `reason`."""
    if reason not in FP8_FALLBACK_REASONS:
        raise ValueError(f"Unknown FP8 fallback reason {reason!r}; valid: {', '.join(FP8_FALLBACK_REASONS)}.")

    def fallback_rule(context: Rewrite, equation, invals: Sequence[Any]) -> list:
        with jax.named_scope(FP8_FALLBACK_SCOPE_PREFIX + reason):
            return rule(context, equation, invals)

    return fallback_rule


def fp8_dot_rule(observer: Callable | None = None, matmul_format: str = "float8") -> Rule:
    """The ``dot_general`` rule: FP8 when eligible, else the compute dtype under a fallback scope.

    Args:
        observer: passed to `jaxamp.fp8_dot_general` (a
            `jaxamp.diagnostics.fp8_quantization_stats` run only).
        matmul_format: ``float8`` (`jaxamp.fp8_dot_general`), ``mxfp8`` or
            ``nvfp4`` (`jaxamp.fp8.block_scaled_dot_general`).
    """

    def rule(context: Rewrite, equation, invals: Sequence[Any]) -> list:
        reason = dot_fallback_reason(equation, matmul_format)
        pays = None if reason is not None else fp8_payoff(equation, invals, context.compute_dtype, matmul_format)
        if pays is False:
            reason = "too_small_to_pay"
        if reason is not None:
            return _in_fallback_scope(reason, compute_rule)(context, equation, invals)
        lhs, rhs = invals
        # fp8_dot_general and block_scaled_dot_general trace themselves under the jaxamp_fp8 scope.
        with jax.named_scope(FP8_PAYS_SCOPE_NAME) if pays else contextlib.nullcontext():
            if matmul_format != "float8":
                dims = equation.params["dimension_numbers"]
                return [block_scaled_dot_general(lhs, rhs, dims, matmul_format, context.compute_dtype)]
            out = fp8_dot_general(
                lhs,
                rhs,
                equation.params["dimension_numbers"],
                preferred_element_type=context.compute_dtype,
                _observer=observer,
            )
        return [out]

    return rule


def fp8_rules(observer: Callable | None = None, matmul_format: str = "float8") -> dict[str, Rule]:
    """primitive name -> rule, the entries that a policy with FP8 matmuls of `matmul_format` changes."""
    return {
        "dot_general": fp8_dot_rule(observer, matmul_format),
        "conv_general_dilated": fp8_conv_rule(observer, matmul_format),
        "ragged_dot_general": _in_fallback_scope("ragged_dot", compute_rule),
    }
