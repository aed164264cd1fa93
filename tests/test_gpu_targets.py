"""Tests for `jaxamp.diagnostics._gpu_targets`: GPU descriptions and deviceless compilation."""

import contextlib
import importlib.util
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

import jaxamp
from jaxamp.diagnostics import _gpu_targets as gpu_targets


@pytest.mark.parametrize("name", sorted(jaxamp.diagnostics.GPU_TARGETS))
def test_every_target_config_names_its_gpu_and_compute_capability(name):
    spec = jaxamp.diagnostics.GPU_TARGETS[name]
    config = spec.target_config()
    major, minor = spec.compute_capability
    assert f"cuda_compute_capability {{ major: {major} minor: {minor} }}" in config
    assert f'device_description_str: "{spec.description}"' in config
    assert f"core_count: {spec.sm_count}" in config
    # jaxlib 0.10 rejects configs that carry this newer field.
    assert "collective_memory_granularity" not in config
    assert spec.peak_flops["float16"] > spec.peak_flops["float32"]


def test_an_unknown_target_is_refused_with_the_valid_choices():
    with pytest.raises(ValueError, match=r"'B300'.*v100, a100, h100, h200"):
        jaxamp.diagnostics.gpu_spec("B300")


@pytest.mark.parametrize(
    "device_kind, target",
    [
        ("NVIDIA H100 80GB HBM3", "h100"),
        ("NVIDIA H200", "h200"),
        ("NVIDIA B200", "b200"),
        ("Tesla V100-SXM2-16GB", "v100"),
        ("NVIDIA A100-SXM4-80GB", "a100"),
        ("cpu", None),
    ],
)
def test_a_real_devices_kind_finds_its_spec(device_kind, target):
    expected = jaxamp.diagnostics.GPU_TARGETS[target] if target else None
    assert jaxamp.diagnostics.spec_for_device_kind(device_kind) is expected


def test_on_device_turns_arrays_into_placed_shape_dtype_structs_and_keeps_other_leaves():
    device = jax.devices()[0]
    tree = {"array": jnp.zeros((2, 3), jnp.float16), "spec": jax.ShapeDtypeStruct((4,), jnp.int32), "n": 3}
    placed = jaxamp.diagnostics.on_device(tree, device)
    assert placed["n"] == 3
    for key, shape, dtype in [("array", (2, 3), jnp.float16), ("spec", (4,), jnp.int32)]:
        assert isinstance(placed[key], jax.ShapeDtypeStruct)
        assert (placed[key].shape, placed[key].dtype) == (shape, dtype)
        assert placed[key].sharding.device_set == {device}


def test_without_the_plugin_a_target_device_explains_how_to_install_it(monkeypatch):
    monkeypatch.setattr(gpu_targets, "cuda_plugin_available", lambda: False)
    with pytest.raises(RuntimeError, match=r"jax-mixed-precision\[gpu-aot\].*JAX_PLATFORMS=cpu"):
        jaxamp.diagnostics.gpu_target_device("h200")


def test_a_step_compiled_for_an_h200_halves_its_temporary_memory_under_mixed():
    if not jaxamp.diagnostics.cuda_plugin_available():
        pytest.skip("needs the CUDA PJRT plugin (pip install 'jax-mixed-precision[gpu-aot]')")
    device = jaxamp.diagnostics.gpu_target_device("h200")
    assert device.device_kind == "NVIDIA H200"

    def temp_bytes(dtype):
        def forward_and_back(weights, x):
            return jax.grad(lambda w: jnp.tanh(x @ w).astype(jnp.float32).sum())(weights)

        args = jaxamp.diagnostics.on_device(
            (jax.ShapeDtypeStruct((512, 512), dtype), jax.ShapeDtypeStruct((256, 512), dtype)), device
        )
        return jax.jit(forward_and_back).lower(*args).compile().memory_analysis().temp_size_in_bytes

    assert temp_bytes(jnp.float16) < temp_bytes(jnp.float32)


REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_COMPILE_FOR_AN_H200 = """
import jax, jax.numpy as jnp
import jaxamp
device = jaxamp.diagnostics.gpu_target_device("h200")
x = jaxamp.diagnostics.on_device(jnp.zeros((64, 64), jnp.float16), device)
compiled = jax.jit(lambda x: x @ x).lower(x).compile()
print(jax.devices()[0].platform, device.device_kind, compiled.memory_analysis().output_size_in_bytes)
"""


@pytest.mark.parametrize("jax_first", [False, True], ids=["jaxamp-imported-first", "jax-started-first"])
def test_with_the_plugin_installed_and_jax_platforms_unset_gpu_targets_compile_and_jax_runs_on_cpu(jax_first):
    """The gpu-aot extra on a machine without a GPU, JAX_PLATFORMS unset.

    Fails where the CUDA plugin's start-up check of the CUDA libraries runs
    (it did: JAX logged its traceback, the plugin never registered, and
    gpu_target_device raised "topology not implemented for cuda"). Where JAX
    started before jaxamp was imported, JAX has already logged the failed
    check, but the target still compiles.
    """
    spec = importlib.util.find_spec("jax_cuda12_plugin")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("needs the CUDA PJRT plugin (pip install 'jax-mixed-precision[gpu-aot]')")
    if gpu_targets.nvidia_gpu_visible():
        pytest.skip("a machine with an NVIDIA GPU: the plugin's check is JAX's to run")
    plugin_parent = os.path.dirname(next(iter(spec.submodule_search_locations)))
    environment = {
        key: value
        for key, value in os.environ.items()
        if key not in ("JAX_PLATFORMS", "JAX_SKIP_CUDA_CONSTRAINTS_CHECK")
    }
    environment["PYTHONPATH"] = os.pathsep.join(
        [REPO_ROOT, plugin_parent, *filter(None, [os.environ.get("PYTHONPATH")])]
    )
    script = ("import jax; jax.devices()\n" if jax_first else "") + _COMPILE_FOR_AN_H200
    completed = subprocess.run(
        [sys.executable, "-c", script],
        check=False,
        cwd=REPO_ROOT,
        env=environment,
        capture_output=True,
        text=True,
    )

    assert completed.returncode == 0, completed.stderr
    assert completed.stdout.split() == ["cpu", "NVIDIA", "H200", str(64 * 64 * 2)]
    if not jax_first:
        assert "Traceback" not in completed.stderr


@pytest.mark.parametrize("fails", [False, True], ids=["block ends", "block raises"])
def test_the_cuda_check_switch_is_set_only_inside_the_block_and_removed_after(monkeypatch, fails):
    """The import-side-effect contract, also where the plugin is absent (it is faked here as installed,
    with no GPU visible): JAX_SKIP_CUDA_CONSTRAINTS_CHECK is 1 inside `_cuda_check_skipped` only, and
    the environment is as before once the block ends, normally or by an exception."""
    monkeypatch.setattr(gpu_targets, "cuda_plugin_available", lambda: True)
    monkeypatch.setattr(gpu_targets, "nvidia_gpu_visible", lambda: False)
    monkeypatch.delenv("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", raising=False)
    before = dict(os.environ)
    with pytest.raises(RuntimeError) if fails else contextlib.nullcontext():
        with gpu_targets._cuda_check_skipped():
            assert os.environ["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"] == "1"
            if fails:
                raise RuntimeError("compiling failed")
    assert dict(os.environ) == before


def test_a_cuda_check_switch_the_user_set_is_left_as_it_was(monkeypatch):
    monkeypatch.setattr(gpu_targets, "cuda_plugin_available", lambda: True)
    monkeypatch.setattr(gpu_targets, "nvidia_gpu_visible", lambda: False)
    monkeypatch.setenv("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "0")
    with gpu_targets._cuda_check_skipped():
        assert os.environ["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"] == "0"
    assert os.environ["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"] == "0"
