"""Compile for an NVIDIA GPU without one: deviceless ahead-of-time targets.

JAX can compile a program for a GPU on a CPU-only machine, given the CUDA
PJRT plugin of the installed JAX's version (``pip install
jaxamp[gpu-aot]``: the ``jax-cuda12-plugin`` and ``jax-cuda12-pjrt``
wheels, no NVIDIA libraries needed) and a description of the GPU:

```python
device = jaxamp.diagnostics.gpu_target_device("h200")
args = jaxamp.diagnostics.on_device((variables, images), device)   # ShapeDtypeStructs
compiled = jax.jit(step).lower(*args).compile()
compiled.memory_analysis()                              # H200 bytes
jaxamp.precision_report(step, *args, compiled=True)     # cuDNN in float16
```

The description is a ``GpuTargetConfigProto`` in text form, written here from
the GPUs' published specifications (`GPU_TARGETS`). What such a compilation
cannot know: no autotuning happens (cuDNN and cuBLAS algorithms are
defaults, and their workspace is what the default needs), the cuDNN and CUDA
versions are those the config states, and the executable's
``cost_analysis()`` is empty (use the lowered module's, or
`jaxamp.diagnostics.bytes_accessed`).

On a machine without an NVIDIA GPU the plugin's start-up check of the CUDA
libraries can only fail (there is nothing to run on), leaving the plugin
unregistered. Importing jaxamp changes nothing about that: only
`gpu_target_device`, when called on such a machine, sets the plugin's own
switch ``JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1`` for the duration of the call
(restoring the environment after it), so the plugin registers for
compiling. What stays changed after the call is what the call is for: the
plugin is registered with JAX (and JAX's backends are started, if they were
not); JAX still runs computations on the CPU, since it uses the CUDA backend
only where a GPU is visible. A program whose JAX starts before that call
sees JAX log the plugin's failed check; a command that wants no such
traceback calls `allow_compiling_without_gpu` first thing, as the
experiments' commands do.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import importlib.util
import os
import types
from collections.abc import Iterator, Mapping
from typing import Any

import jax

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
            where the GPU has FP8 tensor cores).
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

    def target_config(self) -> str:
        """This GPU as a ``GpuTargetConfigProto`` in protobuf text format."""
        major, minor = self.compute_capability
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
            f"dnn_version_info {{ major: {_CUDNN_VERSION[0]} minor: {_CUDNN_VERSION[1]} }}\n"
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
    # table) gives the 8-GPU board's tensor-core rates with sparsity: FP8 72 PFLOP/s,
    # FP16/BF16 36 PFLOP/s, TF32 18 PFLOP/s, and FP32 600 TFLOP/s, 1.4 TB of HBM3e at
    # 64 TB/s. Per GPU and dense (half the sparse rate): FP8 4.5, BF16 2.25, TF32 1.125
    # PFLOP/s; FP32 75 TFLOP/s; 180 GB at 8 TB/s. Compute capability 10.0 and the
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


def cuda_plugin_available() -> bool:
    """Whether JAX's CUDA PJRT plugin (``jax_cuda12_plugin``) can be imported."""
    return importlib.util.find_spec("jax_cuda12_plugin") is not None


# The device files by which JAX decides whether an NVIDIA GPU is visible
# (jax._src.hardware_utils.has_visible_nvidia_gpu; the same list in jax 0.10 and 0.12).
_NVIDIA_DEVICE_FILES = ("/dev/nvidia0", "/dev/nvidiactl", "/dev/dxg")
_CUDA_PLUGIN_MODULE = "jax_plugins.xla_cuda12"
_SKIP_CHECK = "JAX_SKIP_CUDA_CONSTRAINTS_CHECK"


def nvidia_gpu_visible() -> bool:
    """Whether this machine shows an NVIDIA GPU, as JAX itself decides it."""
    return any(os.path.exists(path) for path in _NVIDIA_DEVICE_FILES)


def allow_compiling_without_gpu() -> bool:
    """For a program's entry point: lets the CUDA plugin register quietly where no GPU is visible.

    A library import must not change the process, so jaxamp never calls
    this itself; a command that may compile for a GPU target calls it first
    thing, before JAX starts its backends. With JAX_PLATFORMS unset, JAX
    initializes every installed plugin when it starts; the CUDA plugin first
    checks the CUDA libraries, which on a machine without a GPU fails with a
    logged traceback. Where the plugin is installed and no NVIDIA GPU is
    visible, this sets the plugin's documented switch
    ``JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1`` for the process and the processes
    it starts (unless set already): the plugin registers without the
    traceback, and JAX still runs on the CPU. Elsewhere it does nothing.

    Returns:
        Whether the switch was set by this call.
    """
    if _SKIP_CHECK in os.environ or nvidia_gpu_visible() or not cuda_plugin_available():
        return False
    os.environ[_SKIP_CHECK] = "1"
    return True


@contextlib.contextmanager
def _cuda_check_skipped() -> Iterator[None]:
    """Sets the plugin's ``JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1`` inside the block, where no GPU is visible.

    The plugin reads the switch when it initializes: when JAX starts its
    backends (if they start inside the block) or when it is registered again
    (`_register_cuda_plugin_again`). With a GPU visible, the switch already
    set, or no plugin installed, nothing changes. The environment is
    restored when the block ends, whatever happened in it.
    """
    if _SKIP_CHECK in os.environ or nvidia_gpu_visible() or not cuda_plugin_available():
        yield
        return
    os.environ[_SKIP_CHECK] = "1"
    try:
        yield
    finally:
        os.environ.pop(_SKIP_CHECK, None)


def _register_cuda_plugin_again() -> None:
    """Runs the CUDA plugin's registration again (inside `_cuda_check_skipped`).

    For a process where JAX started its backends before a GPU target was
    asked for (so the plugin's check ran, failed and left it unregistered);
    only on a machine without a visible NVIDIA GPU.
    """
    if nvidia_gpu_visible() or not cuda_plugin_available():
        return
    try:
        importlib.import_module(_CUDA_PLUGIN_MODULE).initialize()
    except Exception:  # noqa: BLE001, S110  # pylint: disable=broad-except
        pass  # the caller's error says what to set


@functools.cache
def _topology_device(config_text: str):
    # get_topology_desc lives in jax.experimental: its one use is here.
    from jax.experimental import topologies  # pylint: disable=g-import-not-at-top

    topology = topologies.get_topology_desc(platform="cuda", target_config=config_text, topology="1x1x1")
    return topology.devices[0]


def gpu_target_device(target: str | GpuSpec) -> Any:
    """A compile-only device for a GPU, usable on a machine without one.

    Args:
        target: a name of `GPU_TARGETS` or a `GpuSpec`.

    Returns:
        A JAX device that programs can be lowered and compiled for (not run on).

    Raises:
        RuntimeError: the CUDA PJRT plugin is not installed.
    """
    spec = gpu_spec(target) if isinstance(target, str) else target
    if not cuda_plugin_available():
        raise RuntimeError(
            "Compiling for a GPU target needs the CUDA PJRT plugin of the installed JAX "
            f"({jax.__version__}): pip install 'jaxamp[gpu-aot]' (or jax-cuda12-plugin=="
            f"{jax.__version__} jax-cuda12-pjrt=={jax.__version__}). No GPU or CUDA libraries are needed; "
            "on a machine with a GPU but without its CUDA libraries, run with JAX_PLATFORMS=cpu."
        )
    with _cuda_check_skipped():
        try:
            return _topology_device(spec.target_config())
        except NotImplementedError:  # "topology not implemented for cuda": the plugin did not register
            _register_cuda_plugin_again()
        try:
            return _topology_device(spec.target_config())
        except NotImplementedError:
            pass
    raise RuntimeError(
        "The CUDA PJRT plugin is installed but did not register with JAX (its start-up check of the "
        "CUDA libraries failed; JAX's log above says why). To compile for a GPU target here, set "
        "JAX_PLATFORMS=cpu before starting Python."
    )


def on_device(tree: Any, device: Any) -> Any:
    """Abstract copies of a pytree of arrays, placed on `device`.

    Every leaf with a shape and dtype (an array or a ``ShapeDtypeStruct``)
    becomes a ``jax.ShapeDtypeStruct`` with a single-device sharding on
    `device`; other leaves (e.g. Python numbers) stay as they are. Lower a
    function on the result to compile it for that device.
    """
    sharding = jax.sharding.SingleDeviceSharding(device)

    def abstract(leaf):
        if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
            return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)
        return leaf

    return jax.tree.map(abstract, tree)
