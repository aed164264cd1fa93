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

Compiled for a GPU, the report also proves FP8: which matmuls and
convolutions ran in cuBLASLt's and cuDNN's FP8 calls, forward and backward,
which ones asked for FP8 and got a wider GEMM from XLA, and which ones fell
back to bfloat16 on purpose, with the reason (`PrecisionReport.fp8_rows`,
`jaxamp.check_fp8`).
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
        op_name: compiled reports: the JAX name stack the op was traced
            under (its HLO metadata), e.g.
            ``jit(step)/transpose(jvp(jaxamp_fp8))/dot_general``.
        source: compiled reports: the Python location it was traced at.
        fp8_requested: compiled reports: the program asked for this op in
            FP8, by the ``jaxamp_fp8`` named scope or by feeding it FP8
            values through a dequantize (see `hlo_precision_report`).
    """

    primitive: str
    operand_dtypes: tuple[str, str]
    output_dtype: str
    flops: int
    op_name: str = ""
    source: str = ""
    fp8_requested: bool = False

    @property
    def compute_dtype(self) -> str:
        """The widest operand dtype: the precision the op runs in."""
        return max(self.operand_dtypes, key=lambda name: np.dtype(name).itemsize)

    @property
    def is_fp8(self) -> bool:
        """Whether both operands are FP8: the op runs on FP8 tensor cores."""
        return all(dtype.startswith("float8_") for dtype in self.operand_dtypes)

    @property
    def direction(self) -> str:
        """``backward`` for an op of a transposed (gradient) computation, else ``forward``."""
        return "backward" if hlo_report.is_backward(self.op_name) else "forward"

    @property
    def fallback_reason(self) -> str | None:
        """The reason slug of a ``jaxamp_fp8_fallback_<reason>`` scope around the op."""
        return hlo_report.fp8_scope(self.op_name)[1]

    @property
    def fp8_status(self) -> str | None:
        """What happened to FP8 here, or None where FP8 was never in question.

        ``fp8``: the op ran with FP8 operands. ``fallback``: jaxamp chose
        bfloat16 for it (`fallback_reason` says why). ``requested, not
        fp8``: the program asked for FP8 and XLA ran a wider GEMM.
        """
        if self.is_fp8:
            return FP8_RAN
        if self.fallback_reason is not None:
            return FP8_FALLBACK
        if self.fp8_requested:
            return FP8_MISSED
        return None


FP8_RAN = "fp8"
FP8_FALLBACK = "fallback"
FP8_MISSED = "requested, not fp8"


@dataclasses.dataclass(frozen=True)
class Fp8Row:
    """Matmuls and convolutions that share one FP8 outcome, summed.

    Attributes:
        status: ``fp8``, ``requested, not fp8`` or ``fallback`` (`OpRecord.fp8_status`).
        direction: ``forward`` or ``backward``.
        operand_dtypes: dtypes of the two operands.
        primitive: the HLO opcode or library call
            (``__cublas$lt$matmul$f8``, ``__cudnn$convForwardGraph``, ``dot``).
        reason: a fallback's reason slug (``shape_not_multiple_of_16``), else "".
        ops: how many ops.
        flops: their FLOPs.
    """

    status: str
    direction: str
    operand_dtypes: tuple[str, str]
    primitive: str
    reason: str
    ops: int
    flops: int


@dataclasses.dataclass(frozen=True)
class PrecisionReport:
    """Matmuls and convolutions of one traced function, by dtype.

    Attributes:
        ops: every matmul and convolution, in trace order.
        compiled: whether the ops are those of an optimized, compiled
            program (`hlo_precision_report`) rather than a traced one.
    """

    ops: tuple[OpRecord, ...]
    compiled: bool = False

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

    def fp8_rows(self) -> tuple[Fp8Row, ...]:
        """The FP8 outcome of every op where FP8 was in question, grouped.

        One row per (status, direction, operand dtypes, primitive, reason),
        in that order; ops with no FP8 in question (`OpRecord.fp8_status`
        None) are left out. Meaningful for compiled reports: a traced
        program only says what it asks for.
        """
        groups: dict[tuple, list[OpRecord]] = collections.defaultdict(list)
        for op in self.ops:
            if op.fp8_status is not None:
                key = (op.fp8_status, op.direction, op.operand_dtypes, op.primitive, op.fallback_reason or "")
                groups[key].append(op)
        order = {FP8_RAN: 0, FP8_MISSED: 1, FP8_FALLBACK: 2}
        return tuple(
            Fp8Row(*key, ops=len(ops), flops=sum(op.flops for op in ops))
            for key, ops in sorted(groups.items(), key=lambda item: (order[item[0][0]], item[0][1:]))
        )

    def fp8_fraction(self, direction: str | None = None) -> float:
        """Share of matmul and convolution FLOPs that ran with FP8 operands (0 to 1).

        Args:
            direction: ``forward`` or ``backward`` to count only those ops;
                None for all.
        """
        if direction not in (None, "forward", "backward"):
            raise ValueError(f"direction={direction!r}; choose 'forward', 'backward' or None (both).")
        ops = [op for op in self.ops if direction is None or op.direction == direction]
        total = sum(op.flops for op in ops)
        return sum(op.flops for op in ops if op.is_fp8) / total if total else 0.0

    def __str__(self) -> str:
        total = sum(op.flops for op in self.ops) or 1
        counts = self.count_by_dtype()
        width = max([10, *(len(dtype) for dtype in counts)])  # float8_e4m3fn is 13
        lines = [f"{'dtype':<{width}} {'ops':>6} {'GFLOPs':>12} {'share':>7}"]
        for dtype, flops in sorted(self.flops_by_dtype().items(), key=lambda item: -item[1]):
            lines.append(f"{dtype:<{width}} {counts[dtype]:>6} {flops / 1e9:>12.4f} {flops / total:>7.1%}")
        # FP8 outcomes are the compiled program's: a traced one only says what it asks for.
        rows = self.fp8_rows() if self.compiled else ()
        if rows:
            lines += [
                "",
                f"{'FP8':<18} {'pass':<8} {'operands':<19} {'as':<24} {'ops':>4} {'GFLOPs':>9} {'share':>7}  reason",
            ]
            for row in rows:
                operands = " x ".join(dtype.removeprefix("float8_") for dtype in row.operand_dtypes)
                lines.append(
                    f"{row.status:<18} {row.direction:<8} {operands:<19} {row.primitive:<24} {row.ops:>4} "
                    f"{row.flops / 1e9:>9.4f} {row.flops / total:>7.1%}  {row.reason}".rstrip()
                )
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
      a GPU (`jaxamp.gpu_targets`), it shows the half-precision cuDNN calls,
      and the FP8 ones (`PrecisionReport.fp8_rows`, `jaxamp.check_fp8`).

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
    if compiled:
        lowered = jax.jit(functools.partial(fun, **kwargs)).lower(*args)
        return hlo_precision_report(lowered.compile().as_text(), hlo_report.lowered_hlo_text(lowered))
    # Keyword arguments are bound statically: flags such as ``train=False``
    # must stay Python values, not tracers.
    closed_jaxpr = jax.make_jaxpr(functools.partial(fun, **kwargs))(*args)
    records: list[OpRecord] = []
    _walk(closed_jaxpr.jaxpr, records)
    return PrecisionReport(tuple(records))


def hlo_precision_report(hlo_text: str, lowered_hlo_text: str | None = None) -> PrecisionReport:
    """A `PrecisionReport` of an optimized HLO module's text.

    Use it on a step that is already compiled, to avoid compiling it twice::

        lowered = jax.jit(step).lower(*args)
        report = hlo_precision_report(
            lowered.compile().as_text(), jaxamp.hlo_report.lowered_hlo_text(lowered))

    A record's ``primitive`` is the HLO opcode (``dot``, ``convolution``) or
    the custom call target (``__cudnn$convForward``, ``__cublas$gemm``,
    ``__cublas$lt$matmul$f8``, ...).

    An op counts as FP8-requested (`OpRecord.fp8_requested`) when its
    op_name lies under the ``jaxamp_fp8`` named scope, or, given the
    program before optimization, when that program fed it FP8 values,
    directly or through a dequantize (`hlo_report.fp8_fed_matmuls`; ops
    are matched by name stack and source location, which XLA keeps
    through its rewrites: the op_name without its last part, the
    primitive, which XLA may replace with that of a transpose it merged).

    Args:
        hlo_text: the optimized module's text.
        lowered_hlo_text: the same program's HLO before optimization, with
            metadata (`hlo_report.lowered_hlo_text`); without it, only the
            named scope marks FP8 requests.
    """
    fed = hlo_report.fp8_fed_matmuls(lowered_hlo_text) if lowered_hlo_text else set()
    # Matched without the op_name's last part: XLA gives a dot that it merges with
    # the transpose after it (as a backward pass's dot often is) the transpose's name.
    fed_scopes = {(op_name.rpartition("/")[0], source) for op_name, source in fed}
    records = []
    for op in hlo_report.heavy_ops(hlo_text):
        in_scope = hlo_report.fp8_scope(op.op_name)[0]
        requested = in_scope or (op.op_name.rpartition("/")[0], op.source) in fed_scopes
        records.append(OpRecord(**dataclasses.asdict(op), fp8_requested=requested))
    return PrecisionReport(tuple(records), compiled=True)
