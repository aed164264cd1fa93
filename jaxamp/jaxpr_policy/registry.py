"""JAX's registry of primitives: the one place autocast reads it.

JAX keeps no public list of its primitives, but every primitive that a
compiled program can contain has a lowering rule (``mlir._lowerings``, or a
platform's own table in ``mlir._platform_specific_lowerings``: the cuDNN
kernels, the eigendecompositions), and every one that can be differentiated
has a JVP or a transpose rule (``ad.primitive_jvps``,
``ad.primitive_transposes``: the mutable-reference primitives, which never
reach a compiler). The union of those four tables, keyed by the primitive
objects themselves, is the registry. It holds the primitives of the modules
imported so far: ``jax.experimental.sparse`` registers its own on import.

`registered_primitives` reads the tables (jax 0.10 and 0.12 keep them in
the same place); `registered` finds one primitive by name, for the
primitives JAX does not export as an object, and fails loudly when JAX has
no such primitive, so a misspelt name cannot slip into the rules table.
"""

from __future__ import annotations

import functools

import jax
from jax.extend.core import Primitive

from jaxamp.supported_jax import SUPPORTED, release

_VERSION = release(jax.__version__)  # (0, 11, 2): patch releases add and remove primitives too


def registered_primitives() -> frozenset[Primitive]:
    """Every primitive the running JAX can lower or differentiate.

    Raises:
        RuntimeError: this JAX keeps its rule tables elsewhere (a release
            jaxamp does not support yet); the message names what is missing.
    """
    try:
        from jax._src.interpreters import ad, mlir

        tables = [
            mlir._lowerings,
            *mlir._platform_specific_lowerings.values(),
            ad.primitive_jvps,
            ad.primitive_transposes,
        ]
    except (ImportError, AttributeError) as error:
        raise RuntimeError(
            f"jaxamp cannot read JAX {jax.__version__}'s primitive registry (the lowering, JVP and "
            f"transpose tables in jax._src.interpreters): {error}. jaxamp supports "
            f"jax{SUPPORTED}; install one of those releases."
        ) from error
    primitives = frozenset(primitive for table in tables for primitive in table)
    if not primitives or not all(isinstance(primitive, Primitive) for primitive in primitives):
        raise RuntimeError(
            f"JAX {jax.__version__}'s rule tables are no longer keyed by primitives; jaxamp supports "
            f"jax{SUPPORTED}."
        )
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


def registered(
    name: str, *, added: tuple[int, int] | None = None, removed: tuple[int, int] | None = None
) -> Primitive | None:
    """The primitive JAX registers as `name`, for one that JAX does not export.

    Args:
        name: the primitive's ``name``.
        added: the JAX release that introduced it, if after 0.10.2, as
            (major, minor) or (major, minor, patch).
        removed: the first JAX release without it, in the same form.

    Returns:
        The primitive; None when the installed JAX is outside [added, removed).

    Raises:
        LookupError: the installed JAX should have it and has none (or two).
    """
    if (added is not None and _VERSION < added) or (removed is not None and _VERSION >= removed):
        return None
    matches = find(name)
    if len(matches) != 1:
        raise LookupError(
            f"JAX {jax.__version__} registers {len(matches)} primitives named {name!r}, not one: "
            "the rules table of jaxamp.autocast names a primitive this JAX does not have. Fix the "
            "name (or its added/removed releases) in jaxamp/jaxpr_policy/rules.py."
        )
    return matches[0]
