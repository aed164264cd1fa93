"""A precision report: proof of which dtype the heavy math ran in.

Mixed precision that silently falls back to float32 (a promoting layer, a
forgotten cast) looks exactly like mixed precision until the profiler says
otherwise. A `PrecisionReport` lists every matrix multiplication and
convolution of one program with the dtype of its operands and its
floating-point operations; `jaxamp.precision_report`
(`jaxamp._precision_report`) makes one from a traced function, and
`jaxamp.diagnostics.hlo_precision_report` from a compiled program.

Compiled for a GPU, the report also proves FP8: which matmuls and
convolutions ran in cuBLASLt's and cuDNN's FP8 calls, forward and backward,
which ones asked for FP8 and got a wider GEMM from XLA, and which ones fell
back to bfloat16 on purpose, with the reason (`PrecisionReport.fp8_rows`,
`jaxamp.diagnostics.check_fp8`).
"""

from __future__ import annotations

import collections
import dataclasses
import re
from typing import Any

import numpy as np

_FP8_SCOPES = re.compile(r"(?<![\w])jaxamp_fp8(?:_fallback_(\w+))?(?![\w])")
# jaxamp.fp8.FP8_PAYS_SCOPE_NAME: an FP8 matmul that a target GPU judged faster in FP8.
_FP8_PAYS_SCOPE = re.compile(r"(?<![\w])jaxamp_fp8_pays(?![\w])")


def fp8_scope(op_name: str) -> tuple[bool, str | None]:
    """What jaxamp's named scopes in `op_name` say about FP8.

    Returns:
        ``(requested, fallback_reason)``: ``(True, None)`` under the
        ``jaxamp_fp8`` scope, ``(False, reason)`` under
        ``jaxamp_fp8_fallback_<reason>``, ``(False, None)`` under neither.
        The innermost of several such scopes decides.
    """
    scopes = list(_FP8_SCOPES.finditer(op_name))
    if not scopes:
        return False, None
    reason = scopes[-1].group(1)
    return reason is None, reason


def is_backward(op_name: str) -> bool:
    """Whether JAX traced the operation in a backward pass.

    JAX's name stack wraps what the transpose of a linearized function
    computes in ``transpose(jvp(...))``: the cotangent matmuls of
    ``jax.grad``, and a ``custom_vjp``'s backward function.
    """
    return "transpose(" in op_name


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
        """Whether both operands are FP8 (or FP4, NVFP4's values): the op runs on low-precision tensor cores."""
        return all(dtype.startswith(("float8_", "float4_")) for dtype in self.operand_dtypes)

    @property
    def direction(self) -> str:
        """``backward`` for an op of a transposed (gradient) computation, else ``forward``."""
        return "backward" if is_backward(self.op_name) else "forward"

    @property
    def fallback_reason(self) -> str | None:
        """The reason slug of a ``jaxamp_fp8_fallback_<reason>`` scope around the op."""
        return fp8_scope(self.op_name)[1]

    @property
    def fp8_reason(self) -> str:
        """Why FP8 ran or not: a fallback's reason slug; ``pays`` for an FP8 op that a
        target GPU judged faster in FP8 (`jaxamp.diagnostics.fp8_target`); else ``""``."""
        if self.fallback_reason is not None:
            return self.fallback_reason
        return FP8_PAYS if self.is_fp8 and _FP8_PAYS_SCOPE.search(self.op_name) else ""

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
FP8_PAYS = "pays"


@dataclasses.dataclass(frozen=True)
class Fp8Row:
    """Matmuls and convolutions that share one FP8 outcome, summed.

    Attributes:
        status: ``fp8``, ``requested, not fp8`` or ``fallback`` (`OpRecord.fp8_status`).
        direction: ``forward`` or ``backward``.
        operand_dtypes: dtypes of the two operands.
        primitive: the HLO opcode or library call
            (``__cublas$lt$matmul$f8``, ``__cudnn$convForwardGraph``, ``dot``).
        reason: a fallback's reason slug (``shape_not_multiple_of_16``,
            ``too_small_to_pay``); ``pays`` for FP8 that a target GPU judged
            faster on paper (`OpRecord.fp8_reason`); else "".
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

    @property
    def why(self) -> str:
        """The reason in words: ``kept in bfloat16: too small to pay``, ``pays on paper``, or ""."""
        if self.status == FP8_FALLBACK:
            dtype = max(self.operand_dtypes, key=lambda name: np.dtype(name).itemsize)
            return f"kept in {dtype}: {self.reason.replace('_', ' ')}"
        return "pays on paper" if self.reason == FP8_PAYS else ""


@dataclasses.dataclass(frozen=True)
class PrecisionReport:
    """Matmuls and convolutions of one traced function, by dtype.

    Attributes:
        ops: every matmul and convolution, in trace order.
        compiled: whether the ops are those of an optimized, compiled
            program (`hlo_precision_report`) rather than a traced one.
        without_rule: the names of the program's primitives that
            `jaxamp.autocast` has no rule for, and so runs in the dtypes
            they were traced with (empty for a report made from HLO text
            alone).
        roofline: compiled for a GPU that jaxamp knows, the program's
            bound on it kernel by kernel and as a whole
            (`jaxamp.diagnostics.KernelRoofline`); else None.
    """

    ops: tuple[OpRecord, ...]
    compiled: bool = False
    without_rule: tuple[str, ...] = ()
    roofline: Any = None

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
                key = (op.fp8_status, op.direction, op.operand_dtypes, op.primitive, op.fp8_reason)
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
                    f"{row.flops / 1e9:>9.4f} {row.flops / total:>7.1%}  {row.why}".rstrip()
                )
        if self.roofline is not None:
            lines += [
                "",
                (
                    f"on paper on {self.roofline.target}: {self.roofline.per_kernel_s * 1e3:.4g} ms summed "
                    f"kernel by kernel, {self.roofline.global_s * 1e3:.4g} ms as one kernel (global roofline)"
                ),
            ]
        if self.without_rule:
            lines += ["", f"no autocast rule (run as traced): {', '.join(self.without_rule)}"]
        return "\n".join(lines)
