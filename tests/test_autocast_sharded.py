"""`jaxamp.autocast` with ``jax.shard_map`` and ``jax.pmap`` on 8 virtual CPU devices.

A device count is fixed when JAX starts, so the checks run in one fresh
process (tests/autocast_sharded_checks.py, started in the background as soon
as the tests are collected: tests/fresh_processes.py) and the tests below
read its findings: a data-parallel gradient step, summed over the devices with an
explicit ``psum`` (``check_vma=False``, as ``pmap`` stages it) or by JAX
itself (the default varying-axes types), under ``autocast(shard_map(f))``,
``shard_map(autocast(f))`` and ``autocast(pmap(f))``.

On main, ``autocast(shard_map(f))`` and ``autocast(pmap(f))`` raised
``NotImplementedError: ... no rule for the higher-order primitive
'shard_map'``, and ``shard_map(autocast(f))`` raised ``ValueError: Primitive
dot_general requires varying manual axes to match`` (the body was traced
without the varying-axes types of its inputs).
"""

from __future__ import annotations

import pytest
from fresh_processes import FreshProcess, xla_flags

RTOL = 2e-2  # float16 rounding, relative to the largest gradient

AUTOCAST_RUNS = [
    "autocast(shard_map) explicit psum",
    "autocast(shard_map) implicit psum",
    "shard_map(autocast) explicit psum",
    "shard_map(autocast) implicit psum",
    "jit(autocast(shard_map))",
    "autocast(shard_map) scan, cond, checkpoint",
    "autocast(pmap)",
]


FLOAT32_RUN_OF = {
    run: "float32 scan, cond, checkpoint" if "scan" in run
    else "float32 explicit psum" if "explicit" in run or "pmap" in run
    else "float32 implicit psum"
    for run in AUTOCAST_RUNS
}  # fmt: skip


CHECKS = FreshProcess(
    "findings", "-m", "tests.autocast_sharded_checks",
    env={"XLA_FLAGS": xla_flags("--xla_force_host_platform_device_count=8")}, timeout=600,
)  # fmt: skip


@pytest.fixture(scope="module")
def findings():
    return CHECKS.last_json_line()


def test_the_float32_sharded_steps_match_one_device(findings):
    for run in ("float32 explicit psum", "float32 implicit psum"):  # one device is the reference
        assert findings[run]["max_abs_error"] <= 1e-5 * findings[run]["reference_scale"], run


@pytest.mark.parametrize("run", AUTOCAST_RUNS)
def test_autocast_with_shard_map_or_pmap_matches_one_device_in_float32_with_half_matmuls(findings, run):
    finding = findings[run]
    assert finding["dtype"] == "float32"
    assert finding["max_abs_error"] <= RTOL * finding["reference_scale"], finding
    assert finding["half_matmul_share"] == 1.0, finding


@pytest.mark.parametrize("run", AUTOCAST_RUNS)
def test_the_gradient_psum_keeps_the_float32_the_program_gave_it(findings, run):
    """Under "follow", the psum would sum the float16 cotangents of the float16 matmuls."""
    traced = findings[FLOAT32_RUN_OF[run]]
    assert findings[run]["psum_operands"] == traced["psum_operands"]
    assert all(operand.endswith(":float32") for operand in findings[run]["psum_operands"])
    assert findings[run]["psum_operands"]


@pytest.mark.parametrize("kind", ["explicit", "implicit"])
def test_the_rewritten_shard_map_keeps_mesh_specs_and_the_other_params(findings, kind):
    params = findings["params"][kind]
    assert len(params["traced"]) == 1
    assert params["rewritten"] == params["traced"]
