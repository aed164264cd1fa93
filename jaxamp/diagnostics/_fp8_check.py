"""Did FP8 run? A check on a compiled precision report.

A program can ask for FP8 and not get it. The classic case is the
quantize-dequantize pattern ``convert(convert(x, float8), bfloat16) @ w``:
compiled for an H200 with XLA's default flags, XLA folds the round trip and
runs a plain bfloat16 GEMM, so the step is exactly as fast as bfloat16 and
only the numerics of FP8 are left. `check_fp8` reads a compiled
`PrecisionReport` and warns (`Fp8NotUsedWarning`) or raises when an op that
asked for FP8 ran in a wider dtype.

Examples:
    >>> report = jaxamp.precision_report(step, *args_on_h200, compiled=True)
    >>> jaxamp.diagnostics.check_fp8(report)   # warns if FP8 was requested and not run
"""

from __future__ import annotations

import collections
import warnings

from jaxamp._report import FP8_MISSED, OpRecord, PrecisionReport

_LISTED = 5


class Fp8NotUsedWarning(UserWarning):
    """FP8 was requested for a matmul or convolution and XLA ran a wider GEMM."""


def check_fp8(report: PrecisionReport, *, raise_error: bool = False) -> tuple[OpRecord, ...]:
    """Warns when the compiled program ran a requested FP8 op in a wider dtype.

    An op counts as requested when it was traced under the ``jaxamp_fp8``
    named scope, or when the program before optimization fed it FP8
    values through a dequantize (see `jaxamp.diagnostics.hlo_precision_report`). Ops
    that jaxamp sent to bfloat16 on purpose (``jaxamp_fp8_fallback_*``
    scopes) are not missed FP8: they show as ``fallback`` rows of
    `PrecisionReport.fp8_rows`, with their reason.

    Args:
        report: a compiled report: ``precision_report(fun, *args,
            compiled=True)`` or `jaxamp.diagnostics.hlo_precision_report`.
        raise_error: raise `Fp8NotUsedWarning` as an exception instead of
            warning.

    Returns:
        The requested ops that did not run in FP8 (empty when all did, or
        when none was requested).

    Raises:
        ValueError: `report` is a traced report, which cannot know what XLA ran.
        Fp8NotUsedWarning: with ``raise_error=True``, when an op missed FP8.
    """
    if not report.compiled:
        raise ValueError(
            "check_fp8 needs a compiled report (what XLA runs), got a traced one (what the program asks "
            "for); make it with jaxamp.precision_report(fun, *args, compiled=True), the arguments placed on "
            "the GPU or on jaxamp.diagnostics.gpu_target_device('h200')."
        )
    missed = tuple(op for op in report.ops if op.fp8_status == FP8_MISSED)
    if missed:
        message = _message(missed, report)
        if raise_error:
            raise Fp8NotUsedWarning(message)
        warnings.warn(message, Fp8NotUsedWarning, stacklevel=2)
    return missed


def _message(missed: tuple[OpRecord, ...], report: PrecisionReport) -> str:
    total = sum(op.flops for op in report.ops) or 1
    groups: dict[tuple, list[OpRecord]] = collections.defaultdict(list)
    for op in missed:
        groups[(op.op_name, op.source, op.primitive, op.operand_dtypes)].append(op)
    share = sum(op.flops for op in missed) / total
    summary = (
        f"FP8 was requested for {len(missed)} matmul(s)/convolution(s) ({share:.1%} of the program's FLOPs) "
        "that XLA ran in a wider dtype:"
    )
    lines = [summary]
    for (op_name, source, primitive, dtypes), ops in list(groups.items())[:_LISTED]:
        where = f" at {source}" if source else ""
        lines.append(
            f"  {op_name or '(no op_name)'}{where}: {primitive} on {' x '.join(dtypes)}, {len(ops)} op(s)"
        )
    if len(groups) > _LISTED:
        lines.append(f"  ... and {len(groups) - _LISTED} more")
    lines.append(
        "Causes: compiled for a CPU or a GPU without FP8 tensor cores (before Hopper), XLA runs FP8 matmuls "
        "in a wider dtype; a convert to FP8 and back before a matmul (quantize-dequantize) is folded by "
        "XLA's default flags into a plain GEMM: give lax.dot_general the FP8 operands themselves with "
        "precision=lax.DotAlgorithmPreset.ANY_F8_ANY_F8_F32 and multiply the scales into its result. "
        "If the wider dtype is intended, trace the op under a jaxamp_fp8_fallback_<reason> named scope."
    )
    return "\n".join(lines)
