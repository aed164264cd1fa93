"""`precision_report`: the dtypes of a function's matmuls and convolutions, traced or compiled.

Traced (the default), the function is traced to a jaxpr and its
``dot_general``, ``conv_general_dilated`` and block-scaled
(``scaled_matmul_wrapper``, `jax.nn.scaled_matmul`) equations are counted,
nested jaxprs included (`_walk` says how loops and branches count). Compiled, the
program is compiled and its optimized HLO read by
`jaxamp.diagnostics._compiled_report`, imported on use. Both give a
`jaxamp._report.PrecisionReport`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jaxamp._autocast.primitives import primitives_without_rule, subjaxprs
from jaxamp._autocast.table import rules_table
from jaxamp._report import OpRecord, PrecisionReport

# jax.nn.scaled_matmul's primitive: (values [B, M, K], values [B, N, K], scales, scales) -> [B, M, N].
_BLOCK_SCALED = "scaled_matmul_wrapper"
_HEAVY_PRIMITIVES = ("dot_general", "conv_general_dilated", _BLOCK_SCALED)


def _flops(primitive: str, lhs, rhs, out, params: dict[str, Any]) -> int:
    if primitive == _BLOCK_SCALED:
        return 2 * math.prod(out.shape) * lhs.shape[-1]
    if primitive == "dot_general":
        (lhs_contracting, _), _ = params["dimension_numbers"]
        contracted = math.prod(lhs.shape[axis] for axis in lhs_contracting)
        return 2 * math.prod(out.shape) * contracted
    # Convolution: every output element sums over the kernel's spatial window
    # and its input features (rhs holds in_features // groups per group).
    rhs_spec = params["dimension_numbers"].rhs_spec
    _, in_feature_axis, *spatial_axes = rhs_spec
    window = math.prod(rhs.shape[axis] for axis in spatial_axes) * rhs.shape[in_feature_axis]
    return 2 * math.prod(out.shape) * window


def _walk(jaxpr, records: list[OpRecord], repeats: int = 1) -> None:
    """Appends a record for every matmul and convolution of `jaxpr` to `records`.

    Nested jaxprs are walked too:

    ```text
    scan:   body records, FLOPs times `length` (times enclosing repeats)
    cond:   the records of the branch with the most FLOPs (ties: the one
            with the narrowest operands, as a block-scaled GEMM's CUDA
            branch beside its float32 emulation; then the first)
    other:  every nested jaxpr once (while_loop bodies, jit, remat, ...)
    ```
    """
    for equation in jaxpr.eqns:
        name = equation.primitive.name
        if name in _HEAVY_PRIMITIVES:
            lhs, rhs = (variable.aval for variable in equation.invars[:2])
            out = equation.outvars[0].aval
            records.append(
                OpRecord(
                    primitive=name,
                    operand_dtypes=(lhs.dtype.name, rhs.dtype.name),
                    output_dtype=out.dtype.name,
                    flops=repeats * _flops(name, lhs, rhs, out, equation.params),
                )
            )
        if name == "cond":
            branch_records = []
            for branch in subjaxprs(equation.params):
                branch_records.append([])
                _walk(branch, branch_records[-1], repeats)
            records.extend(max(branch_records, key=_branch_weight))
            continue
        # A scan body runs `length` times; a while loop's trip count is unknown
        # at trace time, so its body counts once.
        body_repeats = repeats * equation.params.get("length", 1) if name == "scan" else repeats
        for subjaxpr in subjaxprs(equation.params):
            _walk(subjaxpr, records, body_repeats)


def _bits(dtype: str) -> int:
    return jax.numpy.finfo(dtype).bits if jax.numpy.issubdtype(dtype, jax.numpy.floating) else 8 * np.dtype(dtype).itemsize


def _branch_weight(ops: list[OpRecord]) -> tuple[int, float]:
    """A branch's FLOPs, then how narrow its operands are (fewer bits per FLOP weighs more)."""
    flops = sum(op.flops for op in ops)
    bits = sum(op.flops * _bits(op.compute_dtype) for op in ops if op.flops)
    return flops, -(bits / flops if flops else 0.0)


def precision_report(
    fun: Callable[..., Any], *args, compiled: bool = False, **kwargs
) -> PrecisionReport:
    """Reports the dtypes of the heavy math of ``fun(*args, **kwargs)``.

    Two modes answer two questions:

    * traced (``compiled=False``, the default): what the program asks for.
      Nothing is compiled or run: the function is traced to a jaxpr and its
      ``dot_general`` and ``conv_general_dilated`` equations are counted.
    * compiled (``compiled=True``): what XLA runs. The function is compiled
      for the device its arguments are placed on (``jax.jit(fun).lower(*args)
      .compile()``) and the optimized HLO's ``dot`` and ``convolution``
      instructions and cuDNN/cuBLAS custom calls are counted (see
      `jaxamp.diagnostics.hlo_precision_report`). On CPU, XLA runs half-precision convolutions in
      float32 and this mode says so; for a GPU, even one compiled for without
      a GPU (`jaxamp.diagnostics.gpu_target_device`), it shows the half-precision cuDNN calls,
      and the FP8 ones (`PrecisionReport.fp8_rows`, `jaxamp.diagnostics.check_fp8`).
      Compiled for a GPU that jaxamp knows (`jaxamp.diagnostics.GPU_TARGETS`),
      that GPU decides where ``mixed_float8`` runs FP8 (unless
      `jaxamp.diagnostics.fp8_target` says otherwise around the call), and
      the report carries the program's roofline kernel by kernel
      (`PrecisionReport.roofline`).

    Pass a training step (or ``jax.value_and_grad`` of a loss) to see the
    backward pass too.

    Examples:
        >>> report = jaxamp.precision_report(model.apply, variables, images)
        >>> print(report)
        dtype         ops       GFLOPs   share
        float16        21       0.5571  100.0%
        >>> report.fraction(jnp.float16)
        1.0

    Args:
        fun: any traceable function.
        *args: its positional arguments (arrays or ShapeDtypeStructs; in
            compiled mode, their shardings choose the device compiled for).
        compiled: report the compiled, optimized program rather than the
            traced one.
        **kwargs: its keyword arguments, passed as static Python values.

    Returns:
        A `PrecisionReport`.
    """
    # Keyword arguments are bound statically: flags such as ``train=False``
    # must stay Python values, not tracers.
    if compiled:
        from jaxamp.diagnostics import _compiled_report as compiled_report

        spec = compiled_report.gpu_spec_of(args)
        with compiled_report.deciding_fp8_for(spec):
            traced = jax.jit(functools.partial(fun, **kwargs)).trace(*args)
        without_rule = primitives_without_rule(traced.jaxpr.jaxpr, rules_table())
        report = compiled_report.compiled_precision_report(traced.lower(), spec)
        return dataclasses.replace(report, without_rule=without_rule)
    traced = jax.jit(functools.partial(fun, **kwargs)).trace(*args)
    without_rule = primitives_without_rule(traced.jaxpr.jaxpr, rules_table())
    records: list[OpRecord] = []
    _walk(traced.jaxpr.jaxpr, records)
    return PrecisionReport(tuple(records), without_rule=without_rule)
