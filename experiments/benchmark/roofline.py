"""The limit on paper: a roofline lower bound on a step's time on a known GPU.

A step cannot run faster than its arithmetic at the hardware's peak rate,
nor faster than its memory traffic at the peak bandwidth::

    compute_s = sum over dtypes d of  flops[d] / peak_flops[d]
    memory_s  = bytes_accessed / memory_bandwidth
    bound_s   = max(compute_s, memory_s)

``flops[d]`` splits the compiled step's FLOPs by the rate they run at:
matmuls and convolutions in float16 or bfloat16 at the tensor cores' half
rate, those with FP8 operands (``float8_e4m3fn``, ``float8_e5m2``) at the
FP8 rate, those in float32 at the float32 rate under ``fp32`` (matmul
precision "highest") and at the TF32 tensor-core rate otherwise (JAX's
default precision on Ampere and later); every other FLOP (element-wise
work, reductions) at the float32 rate. The peaks are the datasheets'
(`jaxamp.diagnostics.GpuSpec.peak_flops`). This is a bound, not a measurement: real
kernels reach a fraction of either peak, so a measured time sits above it.
"""

from __future__ import annotations

from typing import Any

from jaxamp.diagnostics import GpuSpec

CIFAR10_TRAIN_EXAMPLES = 50_000
_HALF_DTYPES = ("float16", "bfloat16")
_FP8_DTYPES = ("float8_e4m3fn", "float8_e5m2")  # FP8 tensor cores (GpuSpec.peak_flops, Hopper on)


def peak_key(precision: str, dtype: str) -> str:
    """Which peak rate a matmul or convolution in `dtype` runs at under `precision`."""
    if dtype in _HALF_DTYPES or dtype in _FP8_DTYPES:
        return dtype
    return "float32" if precision == "fp32" else "tf32"


def main_peak_key(precision: str, compute_dtype: str) -> str:
    """The peak a precision's heavy math aims at (the denominator of 'share of peak')."""
    return peak_key(precision, compute_dtype)


def flops_by_peak(
    precision: str, heavy_flops_by_dtype: dict[str, float], total_flops: float
) -> dict[str, float]:
    """A step's FLOPs by the peak rate they run at.

    Args:
        precision: ``fp32``, ``tf32``, ``mixed``, ``mixed_bf16``, ...
        heavy_flops_by_dtype: matmul and convolution FLOPs by compute dtype
            (`jaxamp.PrecisionReport.flops_by_dtype` of the compiled step).
        total_flops: all FLOPs of the step (XLA's cost analysis); what the
            matmuls and convolutions do not account for runs at float32.
    """
    by_peak: dict[str, float] = {}
    for dtype, flops in heavy_flops_by_dtype.items():
        key = peak_key(precision, dtype)
        by_peak[key] = by_peak.get(key, 0.0) + flops
    other = max(0.0, total_flops - sum(heavy_flops_by_dtype.values()))
    by_peak["float32"] = by_peak.get("float32", 0.0) + other
    return by_peak


def roofline(flops: dict[str, float], bytes_accessed: float, spec: GpuSpec) -> dict[str, float]:
    """The roofline bound of one step on `spec`'s GPU.

    Returns:
        ``compute_s``, ``memory_s`` and ``bound_s`` (their maximum), seconds.
    """
    compute_s = sum(count / spec.peak_flops[key] for key, count in flops.items())
    memory_s = bytes_accessed / spec.memory_bandwidth
    return {"compute_s": compute_s, "memory_s": memory_s, "bound_s": max(compute_s, memory_s)}


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
