"""The GPUs jaxamp knows, from their published specifications: `GpuSpec` and `GPU_TARGETS`.

One job: describe each NVIDIA GPU by what its datasheet says (multiprocessors,
clock, memory, bandwidth, peak FLOP/s per dtype), for the three things that
read it: compiling for a GPU without one (`jaxamp.diagnostics.gpu_target_device`
turns a spec into XLA's target config), the roofline bound of a compiled
program (`jaxamp.diagnostics.kernel_roofline`), and whether FP8 pays for a
matmul's shape (`jaxamp.diagnostics.fp8_matmul_cost`).
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Mapping

# The cuDNN version the target config states: deviceless cuDNN fusions need
# at least 9.8, which is also what the CUDA 12 wheels of jax 0.10 ship.
_CUDNN_VERSION = (9, 8)
_CUDA_VERSION = (12, 8)


@dataclasses.dataclass(frozen=True)
class GpuSpec:
    """Published facts about one NVIDIA GPU.

    Sources: NVIDIA's V100 (SXM2 32 GB), A100 (SXM4 40 GB), H100 (SXM5 80 GB),
    H200 (SXM 141 GB) and B200 (HGX B200) datasheets and the CUDA C
    Programming Guide's table of compute capabilities. Peak rates are dense (no structured sparsity),
    at boost clock; ``float32`` means the CUDA cores, ``tf32`` the tensor
    cores on float32 inputs.

    Attributes:
        description: the device kind JAX reports (``jax.devices()[0].device_kind``).
        compute_capability: (major, minor).
        sm_count: streaming multiprocessors.
        fp32_cores_per_sm: float32 lanes per multiprocessor.
        boost_clock_ghz: boost clock.
        memory_bytes: device memory.
        memory_bandwidth: bytes per second.
        l2_cache_bytes: L2 cache.
        shared_memory_per_sm: shared memory per multiprocessor, bytes.
        shared_memory_per_block_optin: the most one block may opt in to.
        peak_flops: FLOP/s per compute dtype name (``float32``, ``tf32``,
            ``float16``, ``bfloat16``; ``float8_e4m3fn`` and ``float8_e5m2``
            where the GPU has FP8 tensor cores, ``float4_e2m1fn`` where it
            has FP4 ones).
    """

    description: str
    compute_capability: tuple[int, int]
    sm_count: int
    fp32_cores_per_sm: int
    boost_clock_ghz: float
    memory_bytes: int
    memory_bandwidth: float
    l2_cache_bytes: int
    shared_memory_per_sm: int
    shared_memory_per_block_optin: int
    peak_flops: Mapping[str, float]

    def __post_init__(self):
        # Frozen all the way down: a spec is shared (GPU_TARGETS), so its rates must not change.
        object.__setattr__(self, "peak_flops", types.MappingProxyType(dict(self.peak_flops)))

    def target_config(self, cudnn_version: tuple[int, int] | None = None) -> str:
        """This GPU as a ``GpuTargetConfigProto`` in protobuf text format.

        Args:
            cudnn_version: the cuDNN version the config states, (9, 8) by
                default; XLA rewrites a block-scaled dot into cuDNN's
                (``__cudnn$blockScaledDot``) from (9, 10).
        """
        major, minor = self.compute_capability
        cudnn_major, cudnn_minor = cudnn_version or _CUDNN_VERSION
        device_info = {
            "threads_per_block_limit": 1024,
            "threads_per_warp": 32,
            "shared_memory_per_block": 48 * 1024,
            "shared_memory_per_core": self.shared_memory_per_sm,
            "threads_per_core_limit": 2048,
            "core_count": self.sm_count,
            "fpus_per_core": self.fp32_cores_per_sm,
            "block_dim_limit_x": 2**31 - 1,
            "block_dim_limit_y": 65535,
            "block_dim_limit_z": 65535,
            "memory_bandwidth": int(self.memory_bandwidth),
            "l2_cache_size": self.l2_cache_bytes,
            "clock_rate_ghz": self.boost_clock_ghz,
            "device_memory_size": self.memory_bytes,
            "shared_memory_per_block_optin": self.shared_memory_per_block_optin,
            "registers_per_core_limit": 65536,
            "registers_per_block_limit": 65536,
        }
        fields = "\n".join(f"  {key}: {value}" for key, value in device_info.items())
        return (
            f"gpu_device_info {{\n{fields}\n"
            f"  cuda_compute_capability {{ major: {major} minor: {minor} }}\n}}\n"
            'platform_name: "CUDA"\n'
            f"dnn_version_info {{ major: {cudnn_major} minor: {cudnn_minor} }}\n"
            f"runtime_version {{ major: {_CUDA_VERSION[0]} minor: {_CUDA_VERSION[1]} }}\n"
            f'device_description_str: "{self.description}"\n'
        )


_TERA = 1e12
_GIB = 2**30
_MIB = 2**20

_H100 = GpuSpec(
    description="NVIDIA H100 80GB HBM3",
    compute_capability=(9, 0),
    sm_count=132,
    fp32_cores_per_sm=128,
    boost_clock_ghz=1.98,
    memory_bytes=80 * _GIB,
    memory_bandwidth=3.35e12,
    l2_cache_bytes=50 * _MIB,
    shared_memory_per_sm=228 * 1024,
    shared_memory_per_block_optin=227 * 1024,
    # FP8 tensor cores (Hopper and later): 1978.9 dense TFLOP/s for either format.
    peak_flops={"float32": 67 * _TERA, "tf32": 494.7 * _TERA,
                "float16": 989.4 * _TERA, "bfloat16": 989.4 * _TERA,
                "float8_e4m3fn": 1978.9 * _TERA, "float8_e5m2": 1978.9 * _TERA},
)  # fmt: skip

GPU_TARGETS: Mapping[str, GpuSpec] = types.MappingProxyType({
    "v100": GpuSpec(
        description="Tesla V100-SXM2-32GB",
        compute_capability=(7, 0),
        sm_count=80,
        fp32_cores_per_sm=64,
        boost_clock_ghz=1.53,
        memory_bytes=32 * _GIB,
        memory_bandwidth=900e9,
        l2_cache_bytes=6 * _MIB,
        shared_memory_per_sm=96 * 1024,
        shared_memory_per_block_optin=96 * 1024,
        # No TF32 or bfloat16 tensor cores: those run at the float32 rate.
        peak_flops={
            "float32": 15.7 * _TERA,
            "tf32": 15.7 * _TERA,
            "float16": 125 * _TERA,
            "bfloat16": 15.7 * _TERA,
        },
    ),  # fmt: skip
    "a100": GpuSpec(
        description="NVIDIA A100-SXM4-40GB",
        compute_capability=(8, 0),
        sm_count=108,
        fp32_cores_per_sm=64,
        boost_clock_ghz=1.41,
        memory_bytes=40 * _GIB,
        memory_bandwidth=1555e9,
        l2_cache_bytes=40 * _MIB,
        shared_memory_per_sm=164 * 1024,
        shared_memory_per_block_optin=163 * 1024,
        peak_flops={
            "float32": 19.5 * _TERA,
            "tf32": 156 * _TERA,
            "float16": 312 * _TERA,
            "bfloat16": 312 * _TERA,
        },
    ),  # fmt: skip
    "h100": _H100,
    # The H200 is an H100 with more and faster memory (141 GB of HBM3e at 4.8 TB/s).
    "h200": dataclasses.replace(
        _H100, description="NVIDIA H200", memory_bytes=141 * 10**9, memory_bandwidth=4.8e12
    ),
    # Blackwell, one GPU of an HGX B200 board. NVIDIA's B200 datasheet (the HGX B200
    # table) gives the 8-GPU board's tensor-core rates with sparsity: FP4 144 PFLOP/s,
    # FP8/FP6 72 PFLOP/s, FP16/BF16 36 PFLOP/s, TF32 18 PFLOP/s, and FP32 600 TFLOP/s,
    # 1.4 TB of HBM3e at 64 TB/s. Per GPU and dense (half the sparse rate): FP4 9, FP8
    # 4.5, BF16 2.25, TF32 1.125 PFLOP/s; FP32 75 TFLOP/s; 180 GB at 8 TB/s. MXFP8
    # runs at the FP8 rate, NVFP4 at the FP4 rate. Compute capability 10.0 and the
    # per-SM figures from the CUDA C Programming Guide; 148 SMs, the boost clock and
    # the L2 as CUDA's device query reports them for a B200.
    "b200": GpuSpec(
        description="NVIDIA B200",
        compute_capability=(10, 0),
        sm_count=148,
        fp32_cores_per_sm=128,
        boost_clock_ghz=1.965,
        memory_bytes=180 * 10**9,
        memory_bandwidth=8e12,
        l2_cache_bytes=126 * _MIB,
        shared_memory_per_sm=228 * 1024,
        shared_memory_per_block_optin=227 * 1024,
        peak_flops={
            "float32": 75 * _TERA,
            "tf32": 1125 * _TERA,
            "float16": 2250 * _TERA,
            "bfloat16": 2250 * _TERA,
            "float8_e4m3fn": 4500 * _TERA,
            "float8_e5m2": 4500 * _TERA,
            "float4_e2m1fn": 9000 * _TERA,
        },
    ),
})
"""The GPUs jaxamp describes, by target name (read-only)."""


def gpu_spec(name: str) -> GpuSpec:
    """The `GpuSpec` of a target name (``v100``, ``a100``, ``h100``, ``h200``, ``b200``)."""
    key = name.strip().lower()
    if key not in GPU_TARGETS:
        raise ValueError(
            f"Unknown GPU target {name!r}; choose one of {', '.join(GPU_TARGETS)} "
            "(or describe another GPU with jaxamp.diagnostics.GpuSpec)."
        )
    return GPU_TARGETS[key]


def spec_for_device_kind(device_kind: str) -> GpuSpec | None:
    """The `GpuSpec` whose GPU a real device's ``device_kind`` names, if known.

    Matches on the model (``V100``, ``A100``, ``H100``, ``H200``, ``B200``) in the name,
    so ``NVIDIA H100 80GB HBM3`` and ``NVIDIA H100 PCIe`` both find the H100
    (whose SXM figures then bound the PCIe card from above).
    """
    kind = device_kind.upper()
    for name, spec in GPU_TARGETS.items():
        if name.upper() in kind:
            return spec
    return None
