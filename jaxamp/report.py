"""A precision report: proof of which dtype the heavy math ran in.

Mixed precision that silently falls back to float32 (a promoting layer, a
forgotten cast) looks exactly like mixed precision until the profiler says
otherwise. `precision_report` traces a function to a jaxpr and counts every
matrix multiplication (``dot_general``) and convolution
(``conv_general_dilated``) by the dtype of its operands, weighted by its
floating-point operations, including those inside nested jaxprs
(``jit``, ``remat``, ``scan``, ``cond``, custom derivatives). A ``scan``
body's FLOPs count once per iteration; a ``while_loop`` body's once, since
its trip count is not known at trace time. A ``cond`` (or ``switch``) runs
one branch per call, so it counts the branch with the most FLOPs only: the
report is an upper bound on what one call computes, never the sum of
branches that cannot all run.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np

from jaxamp import hlo_report

_HEAVY_PRIMITIVES = ("dot_general", "conv_general_dilated")


@dataclasses.dataclass(frozen=True)
class OpRecord:
    """One matmul or convolution found in the trace.

    Attributes:
        primitive: ``dot_general`` or ``conv_general_dilated``.
        operand_dtypes: dtypes of its two operands.
        output_dtype: dtype of its result.
        flops: multiply-adds times two (times the iterations of an
            enclosing ``scan``).
    """

    primitive: str
    operand_dtypes: tuple[str, str]
    output_dtype: str
    flops: int

    @property
    def compute_dtype(self) -> str:
        """The widest operand dtype: the precision the op runs in."""
        return max(self.operand_dtypes, key=lambda name: np.dtype(name).itemsize)


@dataclasses.dataclass(frozen=True)
class PrecisionReport:
    """Matmuls and convolutions of one traced function, by dtype.

    Attributes:
        ops: every matmul and convolution, in trace order.
    """

    ops: tuple[OpRecord, ...]

    def flops_by_dtype(self) -> dict[str, int]:
        """FLOPs of matmuls and convolutions per compute dtype."""
        totals: dict[str, int] = collections.Counter()
        for op in self.ops:
            totals[op.compute_dtype] += op.flops
        return dict(totals)

    def count_by_dtype(self) -> dict[str, int]:
        """Number of matmuls and convolutions per compute dtype."""
        return dict(collections.Counter(op.compute_dtype for op in self.ops))

    def fraction(self, dtype: Any) -> float:
        """Share of matmul and convolution FLOPs computed in `dtype` (0 to 1)."""
        total = sum(op.flops for op in self.ops)
        if total == 0:
            return 0.0
        return self.flops_by_dtype().get(np.dtype(dtype).name, 0) / total

    def __str__(self) -> str:
        total = sum(op.flops for op in self.ops) or 1
        lines = [f"{'dtype':<10} {'ops':>6} {'GFLOPs':>12} {'share':>7}"]
        counts = self.count_by_dtype()
        for dtype, flops in sorted(self.flops_by_dtype().items(), key=lambda item: -item[1]):
            lines.append(f"{dtype:<10} {counts[dtype]:>6} {flops / 1e9:>12.4f} {flops / total:>7.1%}")
        return "\n".join(lines)


def _subjaxprs(params: dict[str, Any]) -> Iterator[jax.extend.core.Jaxpr]:
    for value in params.values():
        candidates = value if isinstance(value, (tuple, list)) else (value,)
        for candidate in candidates:
            if isinstance(candidate, jax.extend.core.ClosedJaxpr):
                yield candidate.jaxpr
            elif isinstance(candidate, jax.extend.core.Jaxpr):
                yield candidate


def _flops(primitive: str, lhs, rhs, out, params: dict[str, Any]) -> int:
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

    Nested jaxprs are walked too::

        scan:   body records, FLOPs times `length` (times enclosing repeats)
        cond:   the records of the branch with the most FLOPs (ties: the first)
        other:  every nested jaxpr once (while_loop bodies, jit, remat, ...)
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
            for branch in _subjaxprs(equation.params):
                branch_records.append([])
                _walk(branch, branch_records[-1], repeats)
            records.extend(max(branch_records, key=lambda ops: sum(op.flops for op in ops)))
            continue
        # A scan body runs `length` times; a while loop's trip count is unknown
        # at trace time, so its body counts once.
        body_repeats = repeats * equation.params.get("length", 1) if name == "scan" else repeats
        for subjaxpr in _subjaxprs(equation.params):
            _walk(subjaxpr, records, body_repeats)


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
      `jaxamp.hlo_report`). On CPU, XLA runs half-precision convolutions in
      float32 and this mode says so; for a GPU, even one compiled for without
      a GPU (`jaxamp.gpu_targets`), it shows the half-precision cuDNN calls.

    Pass a training step (or ``jax.value_and_grad`` of a loss) to see the
    backward pass too.

    Example:
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
    if compiled:
        compiled_text = jax.jit(functools.partial(fun, **kwargs)).lower(*args).compile().as_text()
        return hlo_precision_report(compiled_text)
    # Keyword arguments are bound statically: flags such as ``train=False``
    # must stay Python values, not tracers.
    closed_jaxpr = jax.make_jaxpr(functools.partial(fun, **kwargs))(*args)
    records: list[OpRecord] = []
    _walk(closed_jaxpr.jaxpr, records)
    return PrecisionReport(tuple(records))


def hlo_precision_report(hlo_text: str) -> PrecisionReport:
    """A `PrecisionReport` of an optimized HLO module's text.

    Use it on a step that is already compiled, to avoid compiling it twice:
    ``hlo_precision_report(jax.jit(step).lower(*args).compile().as_text())``.
    A record's ``primitive`` is the HLO opcode (``dot``, ``convolution``) or
    the custom call target (``__cudnn$convForward``, ``__cublas$gemm``, ...).
    """
    return PrecisionReport(
        tuple(OpRecord(**dataclasses.asdict(op)) for op in hlo_report.heavy_ops(hlo_text))
    )
