"""The compiled half of the precision report: what XLA runs, read from optimized HLO.

`jaxamp.precision_report(..., compiled=True)` comes here (imported on use):
the program is compiled for the device its arguments are placed on, and the
optimized HLO's ``dot`` and ``convolution`` instructions and cuDNN/cuBLAS
custom calls are counted (`jaxamp.diagnostics._hlo_report`). For a GPU, even
one compiled for without a GPU (`jaxamp.diagnostics.gpu_target_device`),
that shows the half-precision cuDNN calls and the FP8 ones
(`jaxamp.PrecisionReport.fp8_rows`, `jaxamp.diagnostics.check_fp8`).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import jax

from jaxamp._gpu_specs import GpuSpec, spec_for_device_kind
from jaxamp._report import OpRecord, PrecisionReport, fp8_scope
from jaxamp.diagnostics import _hlo_report as hlo_report
from jaxamp.diagnostics._roofline import kernel_roofline
from jaxamp.fp8 import _payoff as fp8_payoff


def gpu_spec_of(args: Any) -> GpuSpec | None:
    """The `GpuSpec` of the GPU the first placed leaf of `args` is on, if jaxamp knows it."""
    for leaf in jax.tree.leaves(args):
        sharding = getattr(leaf, "sharding", None)
        if sharding is None:
            continue
        device = next(iter(sharding.device_set))
        return spec_for_device_kind(device.device_kind) if device.platform == "gpu" else None
    return None


@contextlib.contextmanager
def deciding_fp8_for(spec: GpuSpec | None) -> Iterator[None]:
    """`fp8_payoff.fp8_target(spec)` inside the block, unless the caller set a target or `spec` has no FP8."""
    if spec is None or fp8_payoff.target_was_set() or "float8_e4m3fn" not in spec.peak_flops:
        yield
        return
    with fp8_payoff.fp8_target(spec):
        yield


def compiled_precision_report(lowered: Any, spec: GpuSpec | None = None) -> PrecisionReport:
    """The `PrecisionReport` of a lowered program, compiled (``jax.jit(f).lower(*args)``).

    With `spec`, the report's `roofline` is the program's on that GPU
    (`jaxamp.diagnostics.kernel_roofline`).
    """
    text = lowered.compile().as_text()
    report = hlo_precision_report(text, hlo_report.lowered_hlo_text(lowered))
    if spec is None:
        return report
    return dataclasses.replace(report, roofline=kernel_roofline(text, spec))


def hlo_precision_report(hlo_text: str, lowered_hlo_text: str | None = None) -> PrecisionReport:
    """A `PrecisionReport` of an optimized HLO module's text.

    Use it on a step that is already compiled, to avoid compiling it twice:

    ```python
    lowered = jax.jit(step).lower(*args)
    report = hlo_precision_report(
        lowered.compile().as_text(), jaxamp.diagnostics.lowered_hlo_text(lowered))
    ```

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
        in_scope = fp8_scope(op.op_name)[0]
        requested = in_scope or (op.op_name.rpartition("/")[0], op.source) in fed_scopes
        records.append(OpRecord(**dataclasses.asdict(op), fp8_requested=requested))
    return PrecisionReport(tuple(records), compiled=True)
