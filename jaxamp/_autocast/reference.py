"""The program as written: the literals the half trace rounded, and the casts the program wrote.

Traced in float16, a Python ``1e-12`` is already ``0`` and ``-1e9`` already
``-inf``. `autocast` traces the function once more with its arguments as
given (the *reference*) and pairs the two programs structurally: both ran
the same Python code, so their equations come in the same order, except
where the half trace added some (JAX's upcasts around a half ``mean``) or
left some out (a cast to a dtype the value already had).

```text
align(half jaxpr, reference jaxpr):
    key(equation) = (primitive, operand count, floating-literal positions, output count,
                     name stack, the traceback's frames inside the traced function)
    pair the two sequences of keys by their longest common subsequence (difflib)
    for each pair: recover its literals; note a cast both make to one dtype;
                   align the nested jaxprs of the two, in order
a literal is recovered where the reference's rounds to it and holds a value it lost
a cast to half is written where its twin casts to the same dtype
```

Each nested jaxpr is aligned with its own twin, so the k-th ``where`` of
one call of a library function meets the k-th of the same call, however
often the function is called. A body the half trace shares between calls
(JAX caches a traced ``jit``) is aligned once per call; where two calls'
twins wrote different values, the literal keeps the half trace's value and
a `LiteralNotRecoveredWarning` says so, once per process: a failed pairing
never gives a value from another equation. A literal is replaced only where
the written value rounds to the traced one, so a pairing cannot change a
value the program did not write. A constant needs no pairing to keep its
width through the half trace's casts (`jaxamp._autocast.lineage`); the
written casts tell a float32 island which casts to half are the program's
(``x.astype(jnp.float16)``) and which the half trace made (``x.astype(x.dtype)``
of an argument traced in half, a half ``mean`` rounding back).
"""

from __future__ import annotations

import difflib
import functools
import warnings
from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np
from jax.extend.core import Jaxpr, Literal

from jaxamp._autocast.primitives import subjaxprs


class LiteralNotRecoveredWarning(UserWarning):
    """A literal the half trace rounded could not be read as written: autocast keeps the rounded one."""


def _is_floating_literal(atom: Any) -> bool:
    return isinstance(atom, Literal) and jnp.issubdtype(atom.aval.dtype, jnp.floating)


def _key(equation, entry: Any) -> tuple:
    """The equation's key; its frames are those inside `entry`, the code the trace started at
    (innermost first, where JAX's own frames are the same in both traces)."""
    positions = tuple(index for index, atom in enumerate(equation.invars) if _is_floating_literal(atom))
    info = equation.source_info
    codes, offsets = info.traceback.raw_frames() if info.traceback is not None else ((), ())
    inside = next((depth for depth, code in enumerate(codes) if code is entry), len(codes))
    frames = (tuple(codes[:inside]), tuple(offsets[:inside]))
    name = equation.primitive.name
    return (name, len(equation.invars), positions, len(equation.outvars), str(info.name_stack), frames)


class Recovered(NamedTuple):
    """What the reference tells the rewrite of the half trace.

    Attributes:
        literals: ``(id(equation), position) -> value`` for each literal of
            the half trace that rounded one of the reference.
        written_casts: the ids of the half trace's casts whose twin casts to
            the same dtype: the casts the program wrote.
    """

    literals: dict
    written_casts: frozenset


def recovered(traced: Jaxpr, reference: Jaxpr, entry: Any) -> Recovered:
    """The literals and casts of the half trace `traced` as `reference` wrote them (see the module
    docstring); `entry` is the code object both traces started at (their frames above it differ)."""
    found: dict[tuple[int, int], np.ndarray] = {}
    conflicting: set[tuple[int, int]] = set()
    casts: set[int] = set()
    _align(traced, reference, entry, found, conflicting, casts, set())
    for slot in conflicting:
        found.pop(slot, None)
    if conflicting:
        _warn_once()
    return Recovered(found, frozenset(casts))


def _align(
    traced: Jaxpr, reference: Jaxpr, entry: Any, found: dict, conflicting: set, casts: set, seen: set
) -> None:
    if (id(traced), id(reference)) in seen:
        return
    seen.add((id(traced), id(reference)))
    keys = [_key(equation, entry) for equation in traced.eqns]
    twin_keys = [_key(equation, entry) for equation in reference.eqns]
    matcher = difflib.SequenceMatcher(None, keys, twin_keys, autojunk=False)
    for start, twin_start, size in matcher.get_matching_blocks():
        for offset in range(size):
            equation, twin = traced.eqns[start + offset], reference.eqns[twin_start + offset]
            _recover_literals(equation, twin, keys[start + offset][2], found, conflicting)
            if equation.primitive.name == "convert_element_type" and (
                equation.params["new_dtype"] == twin.params["new_dtype"]
            ):
                casts.add(id(equation))
            bodies, twin_bodies = list(subjaxprs(equation.params)), list(subjaxprs(twin.params))
            if len(bodies) == len(twin_bodies):
                for body, twin_body in zip(bodies, twin_bodies):
                    _align(body, twin_body, entry, found, conflicting, casts, seen)


def _recover_literals(equation, twin, positions: tuple, found: dict, conflicting: set) -> None:
    for position in positions:
        written = np.asarray(twin.invars[position].val, twin.invars[position].aval.dtype)
        rounded = np.asarray(equation.invars[position].val, equation.invars[position].aval.dtype)
        if written.dtype == rounded.dtype or written.shape != rounded.shape:
            continue
        if not _rounds_to(written, rounded) or np.array_equal(rounded.astype(written.dtype), written, equal_nan=True):
            continue
        slot = (id(equation), position)
        if slot in found and not np.array_equal(found[slot], written, equal_nan=True):
            conflicting.add(slot)
        found.setdefault(slot, written)


@functools.cache
def _warn_once() -> None:
    warnings.warn(
        "jaxamp.autocast could not read some literals of this function as written: one body JAX traced "
        "once is called where the program wrote different values, so those literals keep the value the "
        "half trace rounded them to. Write such a constant where it is used, or pass it as an argument.",
        LiteralNotRecoveredWarning,
        stacklevel=2,
    )


def _rounds_to(written: np.ndarray, rounded: np.ndarray) -> bool:
    """Whether `written`, rounded to `rounded`'s dtype, is `rounded` to within one unit in the last
    place (JAX rounds a Python float straight to the half dtype, here it comes through float32)."""
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        if np.array_equal(written.astype(rounded.dtype), rounded, equal_nan=True):
            return True
        info = jnp.finfo(rounded.dtype)
        exact, near = written.astype(np.float64), rounded.astype(np.float64)
        unit = np.abs(near) * float(info.eps) + float(info.smallest_subnormal)
        return bool(np.all(np.isfinite(near) & (np.abs(exact - near) <= unit)))
