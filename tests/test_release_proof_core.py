"""The core survives a JAX that changed its primitives, names what it has no rule for, and leaves the process alone.

Each scenario needs an interpreter in which jaxamp was not imported yet;
one fresh process runs them all (tests/core_release_checks.py) and prints
what it saw.
"""

from __future__ import annotations

import pytest
from fresh_processes import FreshProcess, xla_flags

CHECKS = FreshProcess("core_checks", "tests/core_release_checks.py", env={"XLA_FLAGS": xla_flags()})


@pytest.fixture(scope="module")
def core_checks():
    return CHECKS.last_json_line()


def test_a_jax_without_primitives_the_table_names_imports_jaxamp_and_trains_a_float16_mlp(core_checks):
    """jax 0.11.1 dropped psum_start and pbroadcast_start; main before this change then stopped at import
    (LookupError naming the primitive). Absent names are absent rules, nothing more."""
    assert core_checks["dropped_with_rule"] == []
    losses = core_checks["losses"]
    assert len(losses) == 30 and losses[-1] < 0.1 * losses[0], losses
    assert core_checks["matmul_dtypes"] == ["float16"]
    assert core_checks["loss_scale"] >= 2.0**15  # no step overflowed: the scale stayed at its start


def test_a_primitive_without_a_rule_runs_as_traced_and_is_named_in_exactly_one_warning(core_checks):
    """Four traces (three signatures eagerly, one under jit) of a user's primitive: one warning."""
    (warning,) = core_checks["no_rule_warnings"]
    assert "no rule for the primitive 'user_double'" in warning
    assert "overrides={'user_double': 'follow'}" in warning
    assert core_checks["user_primitive_values"] == [8.0, 8.0, 8.0]  # (ones @ ones) * 2 over 4 columns
    assert core_checks["user_primitive_dtype"] == "float32"


def test_the_traced_and_compiled_reports_list_the_primitive_without_a_rule(core_checks):
    assert core_checks["without_rule"] == [["user_double"], ["user_double"]]
    assert core_checks["traced_report"].endswith("\n\nno autocast rule (run as traced): user_double")


def test_importing_jaxamp_and_calling_autocast_or_a_gpu_target_leave_the_environment_as_it_was(core_checks):
    """With the CUDA plugin installed, main before this change set JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 on
    import; without the plugin, the GPU target says how to install it and the environment is checked all
    the same."""
    assert core_checks["environment_unchanged_by_import"]
    assert core_checks["environment_unchanged_after_autocast"]
    assert core_checks["gpu_target"] == "compiled-for" or "jax-mixed-precision[gpu-aot]" in core_checks["gpu_target"]
    assert core_checks["environment_unchanged_after_gpu_target"]
