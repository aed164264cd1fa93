"""JAX's primitives: the registry, read in one place, and the primitives autocast has no rule for.

The registry (`find`, `registered_primitives`):

JAX keeps no public list of its primitives, but every primitive that a
compiled program can contain has a lowering rule (``mlir._lowerings``, or a
platform's own table in ``mlir._platform_specific_lowerings``: the cuDNN
kernels, the eigendecompositions), and every one that can be differentiated
has a JVP or a transpose rule (``ad.primitive_jvps``,
``ad.primitive_transposes``: the mutable-reference primitives, which never
reach a compiler). The union of those four tables, keyed by the primitive
objects themselves, is the registry. It holds the primitives of the modules
imported so far: ``jax.experimental.sparse`` registers its own on import.

Nothing here runs when jaxamp is imported: the rules tables are keyed by
name and resolved through `find` when `jaxamp.autocast` is applied, so a
JAX release that adds, renames or removes primitives changes which rules
apply, never whether jaxamp imports. A JAX that keeps these tables
elsewhere degrades to the primitives it exports publicly (``jax.lax``,
``jax.lax.linalg``, ``jax.extend.core.primitives``), with one warning.

Primitives without a rule (`warn_once`, `primitives_without_rule`):

A primitive the rules table does not know (a user's own, or one a new JAX
release added) runs in the dtypes it was traced with, which is always
correct and may be slower than it could be. `warn_once` names each such
primitive in one `NoAutocastRuleWarning` per process, however often it is
traced; `jaxamp.precision_report` lists them in every program it reports
(`primitives_without_rule`).
"""

from __future__ import annotations

import functools
import threading
import warnings
from collections.abc import Iterator
from typing import Any

import jax
from jax.extend.core import ClosedJaxpr, Jaxpr, Primitive

_PUBLIC_MODULES = ("jax.lax", "jax.lax.linalg", "jax.extend.core.primitives")


def _rule_tables() -> list:
    from jax._src.interpreters import ad, mlir

    return [
        mlir._lowerings,
        *mlir._platform_specific_lowerings.values(),
        ad.primitive_jvps,
        ad.primitive_transposes,
    ]


@functools.cache
def _exported_primitives() -> frozenset[Primitive]:
    import importlib

    return frozenset(
        value
        for module in _PUBLIC_MODULES
        for value in vars(importlib.import_module(module)).values()
        if isinstance(value, Primitive)
    )


@functools.cache
def _warn_unreadable(reason: str) -> None:
    warnings.warn(
        f"jaxamp cannot read JAX {jax.__version__}'s primitive registry ({reason}); autocast's rules "
        "apply to the primitives JAX exports (jax.lax, jax.lax.linalg, jax.extend.core.primitives), "
        "and the others run in the dtypes they were traced with. Please report this JAX release "
        "to jaxamp.",
        RuntimeWarning,
        stacklevel=3,
    )


def registered_primitives() -> frozenset[Primitive]:
    """Every primitive the running JAX can lower or differentiate.

    Where JAX keeps its rule tables elsewhere than jaxamp knows, the
    primitives it exports publicly, after one `RuntimeWarning`.
    """
    try:
        primitives = frozenset(primitive for table in _rule_tables() for primitive in table)
    except (ImportError, AttributeError) as error:
        _warn_unreadable(f"{type(error).__name__}: {error}")
        return _exported_primitives()
    if not primitives or not all(isinstance(primitive, Primitive) for primitive in primitives):
        _warn_unreadable("its rule tables are no longer keyed by primitives")
        return _exported_primitives()
    return primitives


@functools.lru_cache(maxsize=4)
def _by_name(primitives: frozenset[Primitive]) -> dict[str, list[Primitive]]:
    # Keyed by the registry's contents, not its size: a module imported late
    # adds primitives, and a registry that lost one and gained another has the
    # same size but other names.
    named: dict[str, list[Primitive]] = {}
    for primitive in primitives:
        named.setdefault(primitive.name, []).append(primitive)
    return named


def find(name: str) -> list[Primitive]:
    """The registered primitives called `name` (one, or none; JAX reuses no name)."""
    return _by_name(registered_primitives()).get(name, [])


class NoAutocastRuleWarning(UserWarning):
    """`jaxamp.autocast` met a primitive it has no rule for and ran it as traced."""


_warned: set[Primitive] = set()
_lock = threading.Lock()


def warn_once(primitive: Primitive) -> None:
    """Warns that `primitive` runs as traced, the first time this process meets it."""
    with _lock:
        if primitive in _warned:
            return
        _warned.add(primitive)
    warnings.warn(
        f"jaxamp.autocast has no rule for the primitive {primitive.name!r}, so it runs in the dtypes "
        "it was traced with (correct, but not in half precision where it could be). To choose its "
        f"rule, pass autocast(..., overrides={{{primitive.name!r}: 'follow'}}) (or 'compute', "
        "'float32', 'restore'; the primitive object works as the key too). Shown once per primitive "
        "and process.",
        NoAutocastRuleWarning,
        stacklevel=2,
    )


def subjaxprs(params: dict[str, Any]) -> Iterator[Jaxpr]:
    """The jaxprs an equation's params carry (a closed jaxpr's inner jaxpr), in params order."""
    for value in params.values():
        for candidate in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(candidate, ClosedJaxpr):
                yield candidate.jaxpr
            elif isinstance(candidate, Jaxpr):
                yield candidate


def primitives_without_rule(jaxpr: Jaxpr, rules: Any) -> tuple[str, ...]:
    """The names of the primitives in `jaxpr` (nested jaxprs too) that `rules` lacks, sorted."""
    missing: set[str] = set()
    seen: set[int] = set()

    def walk(inner: Jaxpr) -> None:
        if id(inner) in seen:
            return
        seen.add(id(inner))
        for equation in inner.eqns:
            if equation.primitive not in rules:
                missing.add(equation.primitive.name)
            for body in subjaxprs(equation.params):
                walk(body)

    walk(jaxpr)
    return tuple(sorted(missing))
