"""The limit on paper: a step's roofline bound on a known GPU, per step and per CIFAR-10 epoch.

The bound is the library's, `jaxamp.diagnostics.kernel_roofline` of the
compiled step's optimized program: each kernel's matmul and convolution FLOPs
at the peak of their operands' dtype and its bytes at the memory bandwidth,
summed kernel by kernel (``per_kernel_s``) or over the whole step
(``global_s``, the larger of all FLOPs at peak and all bytes at bandwidth).
This module adds what the benchmark needs around it:

* which peak float32 matmuls run at under a precision (`float32_peak`):
  the float32 rate under ``fp32`` (matmul precision "highest"), the TF32
  tensor-core rate otherwise (JAX's default precision on Ampere and later);
* which peak a precision's heavy math aims at (`main_peak_key`), the
  denominator of "share of peak" and MFU;
* the bound of one CIFAR-10 epoch (`epoch_bound`), and XLA's own cost
  analysis of an executable (`cost_of`).

A bound, not a measurement: real kernels reach a fraction of either peak,
so a measured time sits above it.
"""

from __future__ import annotations

from typing import Any

import jaxamp

CIFAR10_TRAIN_EXAMPLES = 50_000
_HALF_DTYPES = ("float16", "bfloat16")
_FP8_DTYPES = ("float8_e4m3fn", "float8_e5m2")  # FP8 tensor cores (GpuSpec.peak_flops, Hopper on)


def float32_peak(precision: str) -> str:
    """The peak of float32 matmuls under `precision`: ``float32`` for ``fp32``, else ``tf32``."""
    return "float32" if precision == "fp32" else "tf32"


def main_peak_key(precision: str, compute_dtype: str) -> str:
    """The peak a precision's heavy math aims at (the denominator of 'share of peak').

    Matmuls in a half or FP8 dtype run at that dtype's peak, float32 ones at
    `float32_peak`; the result is a key of `jaxamp.diagnostics.GpuSpec.peak_flops`.
    """
    if compute_dtype in _HALF_DTYPES or compute_dtype in _FP8_DTYPES:
        return compute_dtype
    return float32_peak(precision)


def step_bound(hlo_text: str, spec: jaxamp.diagnostics.GpuSpec, precision: str):
    """The roofline of one compiled step on `spec`'s GPU (`jaxamp.diagnostics.KernelRoofline`).

    Args:
        hlo_text: the step's optimized program (``Compiled.as_text()``).
        spec: the GPU.
        precision: ``fp32``, ``tf32`` or a policy name: the peak of float32 matmuls.

    Raises:
        ValueError: the program has FP8 matmuls and the GPU no FP8 peak.
    """
    return jaxamp.diagnostics.kernel_roofline(hlo_text, spec, float32_peak=float32_peak(precision))


def epoch_bound(step_bound_s: float, batch_size: int) -> float:
    """The bound on one CIFAR-10 training epoch (the remainder batch dropped, as in training)."""
    return step_bound_s * (CIFAR10_TRAIN_EXAMPLES // batch_size)


def cost_of(compiled: Any) -> dict[str, float]:
    """``flops`` and ``bytes accessed`` of a compiled executable; empty if XLA gives none."""
    analysis = compiled.cost_analysis()
    if isinstance(analysis, (list, tuple)):  # older jaxlibs: one dict per program
        analysis = analysis[0] if analysis else None
    if not analysis:
        return {}
    return {key: float(analysis[key]) for key in ("flops", "bytes accessed") if key in analysis}
