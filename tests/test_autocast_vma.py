"""`jaxamp.autocast` with ``jax.shard_map(..., check_vma=True)`` (JAX's default) on 8 virtual CPU devices.

With varying-axes types on, every value inside a ``shard_map`` body says over
which mesh axes it differs from device to device, and each primitive checks
that its operands agree (``mul requires varying manual axes to match``). The
rewritten body creates new values (casts of literals and constants, float16
and float32 intermediates); they must carry the varying-axes types of the
values they meet, or the rewritten body does not type-check. One fresh
process (tests/autocast_vma_checks.py) runs five data-parallel programs (a
matmul, a literal times a varying value, a program that sums its own
per-device gradients with ``psum``, ``jax.grad`` inside, a ``scan`` inside)
as ``autocast(shard_map(f))`` and ``shard_map(autocast(f))``, and the tests
below read its findings.

Negative controls, seen failing (jax 0.10.2): with the varying-axes type
dropped from the avals the interpreter re-traces bodies with
(``interpreter.abstract`` returning a plain ``ShapeDtypeStruct``, as on the
code before commit 1bb247f), every ``shard_map(autocast(f))`` run fails
(``Primitive dot_general requires varying manual axes to match``; for the
psum of the gradients ``pvary is a invariant->variant collective``; for the
scan ``Scan carry input and output got mismatched varying manual axes``),
and so does ``autocast(shard_map(f))`` of the scan (``psum is a
variant->invariant collective``).
"""

from __future__ import annotations

import pytest
from fresh_processes import FreshProcess, xla_flags

RTOL = 2e-2  # float16 rounding, relative to the largest result
PROGRAMS = [
    "matmul",
    "literal times a varying value",
    "psum of the gradients",
    "grad inside",
    "scan inside",
]
ORDERS = ["autocast(shard_map(f))", "shard_map(autocast(f))"]


CHECKS = FreshProcess(
    "findings", "-m", "tests.autocast_vma_checks",
    env={"XLA_FLAGS": xla_flags("--xla_force_host_platform_device_count=8")}, timeout=600,
)  # fmt: skip


@pytest.fixture(scope="module")
def findings():
    return CHECKS.last_json_line()


@pytest.mark.parametrize("program", PROGRAMS)
def test_the_float32_sharded_program_matches_one_device(findings, program):
    """The reference itself: the sharded float32 program equals its unsharded twin."""
    run = findings[program]["float32"]
    assert "error" not in run, run
    assert run["relative_error"] <= 1e-5, run
    assert run["check_vma"] == [True]


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("program", PROGRAMS)
def test_autocast_type_checks_with_varying_axes_and_matches_one_device_with_half_matmuls(
    findings, program, order
):
    run = findings[program][order]
    assert "error" not in run, run  # a varying-axes mismatch raises while tracing
    assert run["check_vma"] == [True]  # the rewritten shard_map still checks them
    assert run["dtype"] == "float32"
    assert run["relative_error"] <= RTOL, run
    assert run["half_matmul_share"] == 1.0, run


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("program", PROGRAMS)
def test_every_psum_sums_the_float32_values_the_program_gave_it(findings, program, order):
    """A collective keeps the dtype the program gave it: under "follow" the
    gradient sums would take the float16 cotangents of the float16 matmuls."""
    traced = findings[program]["float32"]["psum_operands"]
    run = findings[program][order]
    assert "error" not in run, run
    assert run["psum_operands"] == traced
    assert traced and all(operand.endswith(":float32") for operand in traced)
