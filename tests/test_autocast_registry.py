"""Every primitive JAX registers has an explicit autocast rule, and every name in the table is JAX's.

The rules tables are keyed by JAX's primitive names and resolved when
autocast is applied, so a misspelt name would silently give no rule. Two
guards: every name must be a primitive of a supported JAX release, as
recorded in ``tests/jax_primitives/<release>.txt`` (written by
``scripts/jax_primitive_manifest.py``; see its docstring to add a release;
``flax-<release>.txt`` for the primitives a Flax release defines); and the installed JAX's registry, walked in a
fresh interpreter that imports JAX and its public modules (which register
the optional primitives: sparse, Pallas, rnn, ...), must have a rule for
every primitive.
"""

from __future__ import annotations

import json
import os
import pathlib
import runpy
import subprocess
import sys

import jax
import pytest
from jax import lax

from jaxamp._autocast import primitives as registry

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MANIFESTS = pathlib.Path(REPO_ROOT, "tests", "jax_primitives")

_WALK = """
import importlib, json, sys
import jax
for module in sys.argv[1:]:
    try:
        importlib.import_module(module)
    except ImportError:  # a module this JAX release does not have
        pass
from jaxamp._autocast import primitives as registry
from jaxamp._autocast import table
rules = table.rules_table()
registered = registry.registered_primitives()
print(json.dumps({
    "jax": jax.__version__,
    "registered": sorted(primitive.name for primitive in registered),
    "with_rule": sorted(primitive.name for primitive in rules if primitive in registered),
}))
"""


@pytest.fixture(scope="module")
def walk():
    """JAX's registry and the rules table, in a fresh interpreter with every JAX module imported."""
    completed = subprocess.run(
        [sys.executable, "-c", _WALK, *_MANIFEST_SCRIPT["JAX_MODULES"]],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert completed.returncode == 0, completed.stderr
    return json.loads(completed.stdout.splitlines()[-1])


def primitives_without_rule(registered: list[str], with_rule: list[str]) -> list[str]:
    """The registered primitives' names that have no entry in the rules table."""
    return sorted(set(registered) - set(with_rule))


def read_manifests(folder: pathlib.Path = MANIFESTS) -> dict[str, set[str]]:
    """release -> the primitive names it registers, from the committed manifests."""
    return {
        path.stem: {line.strip() for line in path.read_text().splitlines() if line.strip() and line[0] != "#"}
        for path in sorted(folder.glob("*.txt"))
    }


_MANIFEST_SCRIPT = runpy.run_path(os.path.join(REPO_ROOT, "scripts", "jax_primitive_manifest.py"))


def flax_primitive_names() -> set[str]:
    """The primitives the installed Flax defines itself (flax 0.12.8: its NNX variables)."""
    return set(_MANIFEST_SCRIPT["flax_primitive_names"]())


def names_no_release_registers(names, manifests: dict[str, set[str]], others: set[str] = frozenset()):
    """The manifest check: the names in `names` that no release's manifest (nor `others`) holds."""
    known = set(others).union(*manifests.values())
    return sorted(set(names) - known)


def table_names() -> set[str]:
    from jaxamp._autocast.fp8_rules import fp8_rules
    from jaxamp._autocast.higher_order import HIGHER_ORDER_RULES
    from jaxamp._autocast.rules import FIRST_ORDER_RULES

    return {*FIRST_ORDER_RULES, *HIGHER_ORDER_RULES, *fp8_rules()}


def test_every_primitive_jax_registers_has_an_explicit_rule(walk):
    assert walk["jax"] == jax.__version__
    assert len(walk["registered"]) > 250  # the registry was found, not an empty table
    assert primitives_without_rule(walk["registered"], walk["with_rule"]) == []


def test_every_name_in_the_rules_tables_is_a_primitive_of_a_supported_jax_release_or_of_flax():
    manifests = read_manifests()
    assert {"0.10.2", "0.11.0", "0.11.1", "0.11.2", "0.12.0.1", "flax-0.12.8"} <= set(manifests)
    assert all(len(names) > 250 for release, names in manifests.items() if not release.startswith("flax"))
    assert names_no_release_registers(table_names(), manifests, flax_primitive_names()) == []


def test_the_manifest_check_names_a_misspelt_primitive():
    """The negative control: main's old spelling ``scatter_add`` (JAX says ``scatter-add``) is caught."""
    manifests = read_manifests()
    misspelt = {*table_names(), "scatter_add", "linear_solve"}
    assert names_no_release_registers(misspelt, manifests, flax_primitive_names()) == [
        "linear_solve", "scatter_add"
    ]  # fmt: skip


def test_every_primitive_of_every_recorded_release_has_a_rule():
    """A release's new primitives get a rule (or an explicit 'restore') before its manifest lands."""
    names = table_names()
    assert {release: sorted(primitives - names) for release, primitives in read_manifests().items()} == {
        release: [] for release in read_manifests()
    }


def test_the_installed_jax_registers_what_its_manifest_records(walk):
    """The manifest of the installed release is the script's output, so the script is checked too."""
    manifests = read_manifests()
    if walk["jax"] not in manifests:
        pytest.skip(f"no manifest for jax {walk['jax']}: add one with scripts/jax_primitive_manifest.py")
    assert set(walk["registered"]) - flax_primitive_names() == manifests[walk["jax"]]


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
    assert [primitive.name for primitive in registry.find("shard_map")] == ["shard_map"]
    assert registry.find("scatter-add") == [lax.scatter_add_p]
    assert registry.find("scatter_add") == []  # a name JAX does not have resolves to nothing


def test_a_jax_that_moved_its_rule_tables_degrades_to_its_exported_primitives_with_one_warning(monkeypatch):
    from jax._src.interpreters import mlir

    monkeypatch.delattr(mlir, "_lowerings")
    registry._warn_unreadable.cache_clear()
    with pytest.warns(RuntimeWarning, match=r"cannot read JAX .*'s primitive registry.*jax\.lax"):
        primitives = registry.registered_primitives()
    assert {lax.add_p, lax.scatter_add_p, lax.dot_general_p} <= primitives
    registry._warn_unreadable.cache_clear()


@pytest.mark.parametrize("version", ["0.10.0", "0.10.1", "0.9.2", "0.10.1.dev20260101"])
def test_a_jax_older_than_supported_is_refused_at_import_with_the_upgrade_command(version):
    """Fails if an older release passes the check or the message loses the installed release or the
    command."""
    from jaxamp import _supported_jax as supported_jax

    with pytest.raises(ImportError) as refused:
        supported_jax.check(version)
    message = str(refused.value)
    assert f"jax {version}, an older release" in message
    assert message.endswith("pip install -U 'jax>=0.10.2'")


@pytest.mark.parametrize(
    "version, release",
    [("0.10.2", (0, 10, 2)), ("0.12.0.1", (0, 12, 0, 1)), ("0.10.2.dev20260101", (0, 10, 2)),
     ("0.11.0rc1", (0, 11, 0)), ("0.10.2+cuda12", (0, 10, 2)), ("1.0", (1, 0))],
)  # fmt: skip
def test_supported_and_newer_jax_releases_pass_the_import_check(version, release):
    """A JAX newer than the newest tested release is not refused. Fails if a development or local
    suffix is read as part of the release, or a supported release is refused."""
    from jaxamp import _supported_jax as supported_jax

    assert supported_jax.release(version) == release
    supported_jax.check(version)  # no error


def test_the_one_primitive_autocast_refuses_is_custom_lin_and_the_error_says_why():
    """The list docs/incoming/rules.md gives; a new refusal must be documented with its reason."""
    from types import SimpleNamespace

    from jaxamp._autocast.table import rules_table

    refused = {primitive: rule for primitive, rule in rules_table().items() if hasattr(rule, "reason")}
    assert [primitive.name for primitive in refused] == ["custom_lin"]
    (rule,) = refused.values()
    equation = SimpleNamespace(primitive=next(iter(refused)))
    with pytest.raises(NotImplementedError, match="'custom_lin': JAX uses it only while it linearizes"):
        rule(None, equation, [])
