"""Primitives autocast has no rule for: run as traced, and named once.

A primitive the rules table does not know (a user's own, or one a new JAX
release added) runs in the dtypes it was traced with, which is always
correct and may be slower than it could be. `warn_once` names each such
primitive in one `NoAutocastRuleWarning` per process, however often it is
traced; `jaxamp.precision_report` lists them in every program it reports
(`primitives_without_rule`).
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Iterator
from typing import Any

from jax.extend.core import ClosedJaxpr, Jaxpr, Primitive


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
