"""Diagnostics: proof of what ran, compiled for this machine or for a GPU you do not have.

Tools to run beside a train step, not inside it (except the two records of
a skipped step, which a jitted step keeps). Imported on use:
``jaxamp.diagnostics`` is loaded the first time it is named, and
``import jaxamp`` alone does not load it. One private module per job:

* `_compiled_report`: `hlo_precision_report`, the compiled half of
  `jaxamp.precision_report` (``compiled=True``);
* `_hlo_report`: the reader of optimized HLO text (heavy ops by dtype,
  `bytes_accessed`, `lowered_hlo_text`);
* `_fp8_check`: `check_fp8`, a warning where FP8 was asked for and a wider
  GEMM ran;
* `_fp8_stats`: `fp8_quantization_stats`, how FP8 operands quantized;
* `_gpu_targets`: `gpu_target_device`, `on_device`: deviceless compilation
  for the NVIDIA GPUs of `GPU_TARGETS`;
* `_roofline`: `kernel_roofline`, a compiled program's bound on a GPU summed
  kernel by kernel, beside the global one;
* `_collectives`: the collectives of a partitioned program and their bytes.

Re-exported here from the rest of jaxamp: why a step was skipped
(`NonFiniteGradients`, `nonfinite_grads_of`, `OverflowRecord`,
`record_overflow`), where FP8 pays (`fp8_matmul_cost`, `fp8_target`), the
GPUs jaxamp knows (`GpuSpec`, `GPU_TARGETS`), `FP8_FALLBACK_REASONS`, and the
warning where `autocast` cannot read a literal as written
(`LiteralNotRecoveredWarning`).

Examples:
    >>> device = jaxamp.diagnostics.gpu_target_device("h200")
    >>> args = jaxamp.diagnostics.on_device((params, x), device)
    >>> report = jaxamp.precision_report(step, *args, compiled=True)
    >>> jaxamp.diagnostics.check_fp8(report)
"""

from jaxamp._autocast.reference import LiteralNotRecoveredWarning
from jaxamp._gpu_specs import GPU_TARGETS, GpuSpec, gpu_spec, spec_for_device_kind
from jaxamp._scaling.loss_scaling import nonfinite_grads_of
from jaxamp._scaling.nonfinite import NonFiniteGradients
from jaxamp._scaling.overflow import FirstOverflow, OverflowRecord, OverflowSite, record_overflow
from jaxamp.diagnostics._collectives import (
    Collective,
    CollectiveTotal,
    collective_totals,
    collectives,
    compile_with_partitioned_hlo,
)
from jaxamp.diagnostics._compiled_report import hlo_precision_report
from jaxamp.diagnostics._fp8_check import Fp8NotUsedWarning, check_fp8
from jaxamp.diagnostics._fp8_stats import Fp8QuantizationStats, Fp8TensorStats, fp8_quantization_stats
from jaxamp.diagnostics._gpu_targets import (
    allow_compiling_without_gpu,
    cuda_plugin_available,
    gpu_target_device,
    on_device,
)
from jaxamp.diagnostics._hlo_report import bytes_accessed, heavy_ops, lowered_hlo_text
from jaxamp.diagnostics._roofline import KernelBound, KernelRoofline, kernel_roofline
from jaxamp.fp8._matmul import FP8_FALLBACK_REASONS
from jaxamp.fp8._payoff import Fp8MatmulCost, fp8_matmul_cost, fp8_target

__all__ = [
    "FP8_FALLBACK_REASONS",
    "GPU_TARGETS",
    "Collective",
    "CollectiveTotal",
    "FirstOverflow",
    "Fp8MatmulCost",
    "Fp8NotUsedWarning",
    "Fp8QuantizationStats",
    "Fp8TensorStats",
    "GpuSpec",
    "KernelBound",
    "KernelRoofline",
    "LiteralNotRecoveredWarning",
    "NonFiniteGradients",
    "OverflowRecord",
    "OverflowSite",
    "allow_compiling_without_gpu",
    "bytes_accessed",
    "check_fp8",
    "collective_totals",
    "collectives",
    "compile_with_partitioned_hlo",
    "cuda_plugin_available",
    "fp8_matmul_cost",
    "fp8_quantization_stats",
    "fp8_target",
    "gpu_spec",
    "gpu_target_device",
    "heavy_ops",
    "hlo_precision_report",
    "kernel_roofline",
    "lowered_hlo_text",
    "nonfinite_grads_of",
    "on_device",
    "record_overflow",
    "spec_for_device_kind",
]
