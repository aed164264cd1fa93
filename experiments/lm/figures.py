"""The performance figures of a compiled train step: FLOPs, memory, MFU.

FLOPs per step are XLA's own count for the compiled program
(``compiled.cost_analysis()``, attention included), the same source the
CIFAR benchmark uses; the analytic estimate ``6N + 12 L d T`` per token
(`experiments.lm.model.model_flops_per_token`) is recorded beside it as a
check. Model FLOPs utilization divides the achieved rate by the device's
published peak for the precision's heavy math (`jaxamp.diagnostics.GpuSpec`,
`experiments.benchmark.roofline.main_peak_key`); a CPU has no such figure
here, so its MFU is reported as not applicable rather than invented.
"""

from __future__ import annotations

import collections
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from experiments.benchmark import roofline
from experiments.benchmark.throughput import device_spec
from experiments.benchmark.workload import memory_of
from jaxamp.diagnostics import hlo_precision_report

_COLLECTIVE = re.compile(
    r"= (?P<dtype>[a-z][a-z0-9]*)\[(?P<dims>[0-9,]*)\][^ ]* "
    r"(?P<op>all-gather|reduce-scatter|all-reduce)(?:-start)?\("
)
MFU_NOT_APPLICABLE = "not applicable: no published peak FLOP/s for this device"


def step_cost(compiled: Any, device_count: int, lowered_program: str | None = None) -> dict[str, Any]:
    """FLOPs and bytes of one train step, its matmul FLOPs by dtype, its collectives.

    Under SPMD partitioning XLA compiles one program per device and counts
    that program's work; the step's total is the device count times it.

    Collectives are read twice. ``collectives_per_device``: what the
    compiled executable runs (on CPU, XLA widens every bfloat16 collective
    to float32, so there they all read float32). ``collectives_stated``:
    those the program itself writes before partitioning (`jaxamp.fsdp.fsdp_loss`
    writes its gathers and reduce-scatters with their dtypes; with plain
    ``jit`` and shardings there are none, the partitioner adds them).
    """
    cost = roofline.cost_of(compiled)
    report = hlo_precision_report(compiled.as_text())
    flops = cost.get("flops")
    return {
        "flops_per_step": None if flops is None else flops * device_count,
        "bytes_accessed_per_device": cost.get("bytes accessed"),
        "matmul_flops_by_dtype_per_device": report.flops_by_dtype(),
        "memory_per_device": memory_of(compiled),
        "collectives_per_device": collectives(compiled.as_text()),
        "collectives_stated": collectives(lowered_program) if lowered_program else {},
    }


def collectives(hlo_text: str) -> dict[str, dict[str, int]]:
    """The compiled program's all-gathers, reduce-scatters and all-reduces.

    Returns:
        ``{"all-gather float32": {"count": n, "result_bytes": b}, ...}``:
        per op and result dtype, how many there are and the bytes they
        produce on one device (arrays only; tuple-shaped results are left out).
    """
    found: dict[str, dict[str, int]] = collections.defaultdict(lambda: {"count": 0, "result_bytes": 0})
    for match in _COLLECTIVE.finditer(hlo_text):
        dims = [int(size) for size in match["dims"].split(",") if size]
        dtype = _HLO_DTYPES.get(match["dtype"], match["dtype"])
        entry = found[f"{match['op']} {dtype}"]
        entry["count"] += 1
        entry["result_bytes"] += int(np.prod(dims, dtype=np.int64)) * jnp.dtype(dtype).itemsize
    return dict(found)


_HLO_DTYPES = {
    "f32": "float32",
    "bf16": "bfloat16",
    "f16": "float16",
    "f64": "float64",
    "f8e4m3fn": "float8_e4m3fn",
    "f8e5m2": "float8_e5m2",
    "s8": "int8",
    "u8": "uint8",
    "s32": "int32",
    "u32": "uint32",
    "s64": "int64",
    "u64": "uint64",
    "pred": "bool",
}


def throughput(
    flops_per_step: float | None, tokens_per_step: int, step_s: float, precision: str, compute_dtype: Any
) -> dict[str, Any]:
    """Tokens/s, achieved FLOP/s and MFU against this device's peak (GPUs we know)."""
    result: dict[str, Any] = {"tokens_per_s": tokens_per_step / step_s, "step_s": step_s}
    spec = device_spec()
    if flops_per_step is None:
        result["mfu"] = None
        result["mfu_note"] = "XLA reported no FLOPs for this program"
        return result
    achieved = flops_per_step / step_s
    result["achieved_tflops"] = achieved / 1e12
    if spec is None:
        result["mfu"] = None
        result["mfu_note"] = MFU_NOT_APPLICABLE
        return result
    key = roofline.main_peak_key(precision, np.dtype(compute_dtype).name)
    result["peak_used"] = key
    result["mfu"] = achieved / (spec.peak_flops[key] * jax.device_count())
    return result


def peak_memory() -> int | None:
    """This process's first device's peak bytes in use (GPUs report it; CPUs do not).

    A local device: in a multi-process run the others' statistics are not
    readable here.
    """
    stats = jax.local_devices()[0].memory_stats()
    return int(stats["peak_bytes_in_use"]) if stats and "peak_bytes_in_use" in stats else None
