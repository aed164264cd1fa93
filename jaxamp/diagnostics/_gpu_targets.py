"""Compile for an NVIDIA GPU without one: deviceless ahead-of-time targets.

JAX can compile a program for a GPU on a CPU-only machine, given the CUDA
PJRT plugin of the installed JAX's version (``pip install
jax-mixed-precision[gpu-aot]``: the ``jax-cuda12-plugin`` and ``jax-cuda12-pjrt``
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
import functools
import importlib
import importlib.util
import os
from collections.abc import Iterator
from typing import Any

import jax

from jaxamp._gpu_specs import GpuSpec, gpu_spec


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


def gpu_target_device(target: str | GpuSpec, *, cudnn_version: tuple[int, int] | None = None) -> Any:
    """A compile-only device for a GPU, usable on a machine without one.

    Args:
        target: a name of `GPU_TARGETS` or a `GpuSpec`.
        cudnn_version: the cuDNN version the device states, (9, 8) by
            default; (9, 10) for a B200 program whose block-scaled matmuls
            (``mixed_mxfp8``, ``mixed_nvfp4``) compile to cuDNN's
            ``__cudnn$blockScaledDot``.

    Returns:
        A JAX device that programs can be lowered and compiled for (not run on).

    Raises:
        RuntimeError: the CUDA PJRT plugin is not installed.
    """
    spec = gpu_spec(target) if isinstance(target, str) else target
    if not cuda_plugin_available():
        raise RuntimeError(
            "Compiling for a GPU target needs the CUDA PJRT plugin of the installed JAX "
            f"({jax.__version__}): pip install 'jax-mixed-precision[gpu-aot]' (or jax-cuda12-plugin=="
            f"{jax.__version__} jax-cuda12-pjrt=={jax.__version__}). No GPU or CUDA libraries are needed; "
            "on a machine with a GPU but without its CUDA libraries, run with JAX_PLATFORMS=cpu."
        )
    with _cuda_check_skipped():
        try:
            return _topology_device(spec.target_config(cudnn_version))
        except NotImplementedError:  # "topology not implemented for cuda": the plugin did not register
            _register_cuda_plugin_again()
        try:
            return _topology_device(spec.target_config(cudnn_version))
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
