"""Every primitive JAX registers has an explicit autocast rule, keyed by the primitive.

The walk runs in a fresh interpreter that imports JAX and its public modules
(``JAX_MODULES``, which register the optional primitives: sparse, Pallas,
rnn, ...) and nothing else that defines primitives (Equinox, Flax NNX), then
compares JAX's registry with the rules table. Run it on each supported JAX:

    python -m pytest tests/test_autocast_registry.py            # jax 0.10
    /work/venv312/bin/python -m pytest tests/test_autocast_registry.py  # jax 0.12
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import pytest
from jax import lax

from jaxamp.jaxpr_policy import registry

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

JAX_MODULES = (
    "jax.numpy", "jax.scipy", "jax.scipy.sparse.linalg", "jax.nn", "jax.random", "jax.lax.linalg",
    "jax.experimental.shard_map", "jax.experimental.checkify", "jax.experimental.pallas",
    "jax.experimental.pallas.tpu", "jax.experimental.pallas.triton",
    "jax.experimental.pallas.mosaic_gpu", "jax.experimental.pallas.fuser", "jax.experimental.rnn",
    "jax.experimental.compute_on", "jax.experimental.multihost_utils",
    "jax.experimental.custom_partitioning", "jax.experimental.sparse", "jax.experimental.xla_metadata",
    "jax.experimental.fused", "jax.experimental.scheduling_groups", "jax.experimental.buffer_callback",
    "jax.experimental.overlap",
)  # fmt: skip

_WALK = """
import importlib, json, sys
import jax
for module in sys.argv[1:]:
    try:
        importlib.import_module(module)
    except ImportError:  # a module this JAX release does not have
        pass
from jaxamp.jaxpr_policy import registry, table
from jaxamp.jaxpr_policy.higher_order import OPTIONAL_HIGHER_ORDER_RULES
from jaxamp.jaxpr_policy.rules import OPTIONAL_RULES
rules = table.rules_table()
registered = registry.registered_primitives()
print(json.dumps({
    "jax": jax.__version__,
    "registered": sorted(primitive.name for primitive in registered),
    "with_rule": sorted(primitive.name for primitive in rules if primitive in registered),
    "unresolved": sorted(
        name for name in [*OPTIONAL_RULES, *OPTIONAL_HIGHER_ORDER_RULES] if not registry.find(name)
    ),
}))
"""


@pytest.fixture(scope="module")
def walk():
    """JAX's registry and the rules table, in a fresh interpreter with every JAX module imported."""
    completed = subprocess.run(
        [sys.executable, "-c", _WALK, *JAX_MODULES],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert completed.returncode == 0, completed.stderr
    return json.loads(completed.stdout.splitlines()[-1])


def primitives_without_rule(registered: list[str], with_rule: list[str]) -> list[str]:
    """The registered primitives' names that have no entry in the rules table."""
    return sorted(set(registered) - set(with_rule))


def test_every_primitive_jax_registers_has_an_explicit_rule(walk):
    assert walk["jax"] == jax.__version__
    assert len(walk["registered"]) > 250  # the registry was found, not an empty table
    assert primitives_without_rule(walk["registered"], walk["with_rule"]) == []


def test_every_optional_primitive_named_in_the_table_is_registered_once_its_module_is(walk):
    """A misspelt name among the primitives of optional modules (listed by name) fails here."""
    # Checked on jax 0.10.2, 0.11.0, 0.11.1, 0.11.2 and 0.12.0.1 (the NNX variable primitives: the
    # flax 0.12.8 and 0.12.12 beside them register none).
    from jaxamp.supported_jax import release

    nnx_and_pallas = {"core_map", "fusible", "new_variable", "get_variable", "set_variable"}
    installed = release(jax.__version__)
    if installed < (0, 11, 1):
        release_specific = {"get_global", "program_order"}
    elif installed < (0, 11, 2):
        release_specific = {"get_global", "program_order", *nnx_and_pallas}
    elif installed < (0, 12):
        release_specific = {"get_global", *nnx_and_pallas}
    else:
        release_specific = nnx_and_pallas
    assert set(walk["unresolved"]) <= release_specific, walk["unresolved"]


# The string-keyed table that main had before the table was keyed by primitives.
MAIN_RESTORE_NAMES = (
    "scatter", "scatter_add", "scatter_sub", "scatter_mul", "scatter_min", "scatter_max",
    "reduce", "reduce_window", "select_and_scatter", "pallas_call", "linear_solve",
)  # fmt: skip


def test_the_walk_lists_the_misspelt_names_of_a_string_keyed_table(walk):
    """The negative control: main's names ("scatter_add", "linear_solve") leave JAX's primitives bare."""
    missing = primitives_without_rule(walk["registered"], MAIN_RESTORE_NAMES)
    for name in ("scatter-add", "scatter-sub", "scatter-mul", "scatter-min", "scatter-max"):
        assert name in missing
    assert "custom_linear_solve" in missing
    assert "scatter" not in missing


def test_the_registry_holds_the_primitives_jax_exports_and_finds_the_others_by_name():
    primitives = registry.registered_primitives()
    assert {lax.add_p, lax.scatter_add_p, lax.linear_solve_p, lax.dot_general_p} <= primitives
    assert registry.registered("shard_map").name == "shard_map"
    assert registry.registered("scatter-add") is lax.scatter_add_p


def test_a_name_jax_does_not_have_fails_loudly():
    with pytest.raises(LookupError, match="registers 0 primitives named 'scatter_add'.*rules.py"):
        registry.registered("scatter_add")
    assert registry.registered("scatter_add", added=(99, 0)) is None  # a future release's primitive


def test_a_jax_that_moved_its_rule_tables_fails_loudly(monkeypatch):
    from jax._src.interpreters import mlir

    monkeypatch.delattr(mlir, "_lowerings")
    with pytest.raises(RuntimeError, match=r"cannot read JAX .*'s primitive registry.*jax>=0\.10\.2,<0\.13"):
        registry.registered_primitives()


@pytest.mark.parametrize("version", ["0.10.0", "0.10.1", "0.9.2", "0.10.1.dev20260101"])
def test_a_jax_older_than_supported_is_refused_at_import_with_the_upgrade_command(version):
    """jax 0.10.0 exports no ``lax.mulhi_p``, ``stack_p``, ``unstack_p`` or ``stage_p``, and 0.10.1 no
    ``mulhi_p``, which the rules table names: without the check, ``import jaxamp`` fails there with an
    ``AttributeError``. Fails if an older release passes the check or the message loses the installed
    release or the command."""
    from jaxamp import supported_jax

    with pytest.raises(ImportError) as refused:
        supported_jax.check(version)
    message = str(refused.value)
    assert f"jax {version}:" in message
    assert message.endswith("pip install -U 'jax>=0.10.2,<0.13'")


@pytest.mark.parametrize(
    "version, release",
    [("0.10.2", (0, 10, 2)), ("0.12.0.1", (0, 12, 0, 1)), ("0.10.2.dev20260101", (0, 10, 2)),
     ("0.11.0rc1", (0, 11, 0)), ("0.10.2+cuda12", (0, 10, 2)), ("1.0", (1, 0))],
)  # fmt: skip
def test_supported_and_newer_jax_releases_pass_the_import_check(version, release):
    """A newer JAX than the range is left to the registry to judge. Fails if a development or local
    suffix is read as part of the release, or a supported release is refused."""
    from jaxamp import supported_jax

    assert supported_jax.release(version) == release
    supported_jax.check(version)  # no error


def test_no_module_of_the_jaxpr_policy_imports_one_that_imports_it_back():
    """The rules take a `Rewrite` from context.py, below both rules.py and interpreter.py."""
    import ast
    import pathlib

    package = pathlib.Path(REPO_ROOT, "jaxamp", "jaxpr_policy")
    imports = {}
    for path in package.glob("*.py"):
        tree = ast.parse(path.read_text())
        imports[path.stem] = {
            node.module.rsplit(".", 1)[-1]
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jaxamp.jaxpr_policy.")
        }

    def reaches(start, target, seen=()):
        return any(
            module == target or (module not in seen and reaches(module, target, (*seen, module)))
            for module in imports.get(start, ())
        )

    assert "interpreter" not in imports["rules"]
    assert [module for module in imports if reaches(module, module)] == []


def test_the_one_primitive_autocast_refuses_is_custom_lin_and_the_error_says_why():
    """The list docs/incoming/rules.md gives; a new refusal must be documented with its reason."""
    from types import SimpleNamespace

    from jaxamp.jaxpr_policy.table import rules_table

    refused = {primitive: rule for primitive, rule in rules_table().items() if hasattr(rule, "reason")}
    assert [primitive.name for primitive in refused] == ["custom_lin"]
    (rule,) = refused.values()
    equation = SimpleNamespace(primitive=next(iter(refused)))
    with pytest.raises(NotImplementedError, match="'custom_lin': JAX uses it only while it linearizes"):
        rule(None, equation, [])
