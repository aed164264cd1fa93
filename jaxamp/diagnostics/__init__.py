"""Diagnostics: proof of what ran, compiled for this machine or for a GPU you do not have.

Not part of a train step; imported on use (``jaxamp.diagnostics`` is
loaded the first time it is named, and ``import jaxamp`` alone does not
load it). One module per job:

* `compiled_report`: `hlo_precision_report`, the compiled half of
  `jaxamp.precision_report` (``compiled=True``);
* `hlo_report`: the reader of optimized HLO text (heavy ops by dtype,
  `bytes_accessed`, `lowered_hlo_text`);
* `fp8_check`: `check_fp8`, a warning where FP8 was asked for and a wider
  GEMM ran;
* `fp8_stats`: `fp8_quantization_stats`, how FP8 operands quantized;
* `gpu_targets`: `GPU_TARGETS`, `GpuSpec`, `gpu_target_device`,
  `on_device`: deviceless compilation for NVIDIA GPUs;
* `overflow`: why a step was skipped: `NonFiniteGradients` (the gradient
  leaves), `OverflowRecord` (the first matmul or convolution that
  overflowed, forward or backward), `record_overflow`;
* `roofline`: `kernel_roofline`, a compiled program's bound on a
  GPU summed kernel by kernel, beside the global one;
* `fp8_payoff`: `fp8_matmul_cost`, whether FP8 pays for one matmul's shape
  on a GPU, and `fp8_target`, the GPU that decides where ``mixed_float8``
  runs FP8;
* `collectives`: the collectives of a partitioned program and their bytes.

Examples:
    >>> device = jaxamp.diagnostics.gpu_target_device("h200")
    >>> args = jaxamp.diagnostics.on_device((params, x), device)
    >>> report = jaxamp.precision_report(step, *args, compiled=True)
    >>> jaxamp.diagnostics.check_fp8(report)
"""

from jaxamp.diagnostics.collectives import (
    Collective,
    CollectiveTotal,
    collective_totals,
    collectives,
    compile_with_partitioned_hlo,
)
from jaxamp.diagnostics.compiled_report import hlo_precision_report
from jaxamp.diagnostics.fp8_check import Fp8NotUsedWarning, check_fp8
from jaxamp.diagnostics.fp8_payoff import Fp8MatmulCost, fp8_matmul_cost, fp8_target
from jaxamp.diagnostics.fp8_stats import Fp8QuantizationStats, Fp8TensorStats, fp8_quantization_stats
from jaxamp.diagnostics.gpu_targets import (
    GPU_TARGETS,
    GpuSpec,
    allow_compiling_without_gpu,
    cuda_plugin_available,
    gpu_spec,
    gpu_target_device,
    on_device,
    spec_for_device_kind,
)
from jaxamp.diagnostics.hlo_report import bytes_accessed, heavy_ops, lowered_hlo_text
from jaxamp.diagnostics.overflow import (
    FirstOverflow,
    NonFiniteGradients,
    OverflowRecord,
    OverflowSite,
    nonfinite_grads_of,
    record_overflow,
)
from jaxamp.diagnostics.roofline import KernelBound, KernelRoofline, kernel_roofline
from jaxamp.fp8 import FP8_FALLBACK_REASONS

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
