"""The FP8 rules of `jaxamp.autocast`: which matmuls run in FP8, and why the others do not.

Under a policy with FP8 matmuls (``"mixed_float8"``) these rules replace
the compute rule of ``dot_general``, ``conv_general_dilated`` and
``ragged_dot_general`` (`fp8_rules`); every other primitive keeps its rule
from `jaxamp.jaxpr_policy.rules`, exactly as under ``"mixed_bfloat16"``.

An eligible ``dot_general`` becomes `jaxamp.fp8_dot_general` and an
eligible convolution `jaxamp.fp8.fp8_convolution` (forward FP8, backward
bfloat16 under the ``conv_backward`` fallback scope), both traced under
``jax.named_scope("jaxamp_fp8")``. Every other floating matmul or
convolution runs in the compute dtype (the compute rule) under
``jax.named_scope("jaxamp_fp8_fallback_<reason>")``, with the reason one of
`FP8_FALLBACK_REASONS`; so the compiled program names each op that was not
FP8 and why. Integer dots run as traced (their scope says so too).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from jaxamp.fp8 import (
    FP8_FALLBACK_REASONS,
    FP8_FALLBACK_SCOPE_PREFIX,
    fp8_convolution,
    fp8_dot_general,
)
from jaxamp.jaxpr_policy.context import Rewrite, Rule
from jaxamp.jaxpr_policy.rules import bind, compute_rule, is_floating, traced_dtypes

_MULTIPLE = 16


def _product(shape: Sequence[int], dims: Sequence[int]) -> int:
    return int(np.prod([shape[dim] for dim in dims], dtype=np.int64))


def dot_fallback_reason(equation) -> str | None:
    """Why `equation` (a ``dot_general``) cannot run as an FP8 dot, or None if it can."""
    if not all(is_floating(dtype) for dtype in traced_dtypes(equation.invars)):
        return "integer_operands"
    (lhs_contract, rhs_contract), (lhs_batch, _) = equation.params["dimension_numbers"]
    if lhs_batch:
        return "batch_dims"
    lhs_shape, rhs_shape = (atom.aval.shape for atom in equation.invars)
    lhs_free = [dim for dim in range(len(lhs_shape)) if dim not in lhs_contract]
    rhs_free = [dim for dim in range(len(rhs_shape)) if dim not in rhs_contract]
    sizes = (_product(lhs_shape, lhs_free), _product(rhs_shape, rhs_free), _product(lhs_shape, lhs_contract))
    if any(size % _MULTIPLE for size in sizes):
        return "shape_not_multiple_of_16"
    return None


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
    if any(size % _MULTIPLE for size in features):
        return "shape_not_multiple_of_16"
    return None


def fp8_conv_rule(observer: Callable | None = None) -> Rule:
    """The ``conv_general_dilated`` rule: forward FP8 when eligible (backward bfloat16), else
    the compute dtype under a fallback scope."""

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


def fp8_dot_rule(observer: Callable | None = None) -> Rule:
    """The ``dot_general`` rule: FP8 when eligible, else the compute dtype under a fallback scope.

    Args:
        observer: passed to `jaxamp.fp8_dot_general` (a
            `jaxamp.diagnostics.fp8_quantization_stats` run only).
    """

    def rule(context: Rewrite, equation, invals: Sequence[Any]) -> list:
        reason = dot_fallback_reason(equation)
        if reason is not None:
            return _in_fallback_scope(reason, compute_rule)(context, equation, invals)
        lhs, rhs = invals
        # fp8_dot_general traces itself under the jaxamp_fp8 scope.
        out = fp8_dot_general(
            lhs,
            rhs,
            equation.params["dimension_numbers"],
            preferred_element_type=context.compute_dtype,
            _observer=observer,
        )
        return [out]

    return rule


def fp8_rules(observer: Callable | None = None) -> dict[str, Rule]:
    """primitive name -> rule, the entries that a policy with FP8 matmuls changes."""
    return {
        "dot_general": fp8_dot_rule(observer),
        "conv_general_dilated": fp8_conv_rule(observer),
        "ragged_dot_general": _in_fallback_scope("ragged_dot", compute_rule),
    }
