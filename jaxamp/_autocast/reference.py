"""The program as written: the literals and constant casts the half trace rounded.

Traced in float16, a Python ``1e-12`` is already ``0`` and ``-1e9`` already
``-inf``, and a weak scalar JAX passes on (``jnp.where``'s fill, inside its
``jit``) is cast to half. `autocast` traces the function once more with its
arguments as given (the *reference*) and pairs the two programs:

```text
key(equation) = (primitive, operand count, literal positions, name stack,
                 the traceback's frames inside the traced function)
the k-th equation of a key in the half trace pairs with the k-th of that key in the reference
a literal is recovered where the reference's rounds to it and holds a value it lost;
a cast of a constant, where the reference casts to a wider dtype
```

Equations the half trace adds or changes (JAX's upcasts around a half
``mean``) have keys of their own and pair with nothing, and a literal is
replaced only where the written value rounds to the traced one, so a wrong
pairing cannot change a value the program did not write.
"""
from __future__ import annotations

import collections
from collections.abc import Iterator
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax.extend.core import Jaxpr, Literal

from jaxamp._autocast.primitives import subjaxprs


def _is_floating_literal(atom: Any) -> bool:
    return isinstance(atom, Literal) and jnp.issubdtype(atom.aval.dtype, jnp.floating)


def _pairable(jaxpr: Jaxpr, seen: set[int]) -> Iterator[Any]:
    """The equations of `jaxpr` and its nested jaxprs (each once) with a floating literal, and the
    casts between floating dtypes."""
    if id(jaxpr) in seen:
        return
    seen.add(id(jaxpr))
    for equation in jaxpr.eqns:
        cast = equation.primitive.name == "convert_element_type" and jnp.issubdtype(
            equation.invars[0].aval.dtype, jnp.floating
        )
        if cast or any(_is_floating_literal(atom) for atom in equation.invars):
            yield equation
        for body in subjaxprs(equation.params):
            yield from _pairable(body, seen)


def _key(equation, entry: Any) -> tuple:
    """The equation's key; its frames are those inside `entry`, the code the trace started at
    (innermost first, where JAX's own frames are the same in both traces)."""
    positions = tuple(index for index, atom in enumerate(equation.invars) if _is_floating_literal(atom))
    info = equation.source_info
    codes, offsets = info.traceback.raw_frames() if info.traceback is not None else ((), ())
    inside = next((depth for depth, code in enumerate(codes) if code is entry), len(codes))
    frames = (tuple(codes[:inside]), tuple(offsets[:inside]))
    return (equation.primitive.name, len(equation.invars), positions, str(info.name_stack), frames)


def recovered(traced: Jaxpr, reference: Jaxpr, entry: Any) -> tuple[dict, dict]:
    """``(id(equation), position) -> value`` for each literal of the half trace `traced` that rounded
    one of `reference`, and ``id(equation) -> dtype`` for each cast narrower than the reference's;
    `entry` is the code object both traces started at (their frames above it differ)."""
    twins: dict[tuple, list] = collections.defaultdict(list)
    for equation in _pairable(reference, set()):
        twins[_key(equation, entry)].append(equation)
    taken: collections.Counter = collections.Counter()
    literals, casts = {}, {}
    for equation in _pairable(traced, set()):
        key = _key(equation, entry)
        index, taken[key] = taken[key], taken[key] + 1
        if index >= len(twins.get(key, ())):
            continue
        twin = twins[key][index]
        if equation.primitive.name == "convert_element_type":
            written = np.dtype(twin.params["new_dtype"])
            if np.promote_types(written, equation.params["new_dtype"]) == written != equation.params["new_dtype"]:
                casts[id(equation)] = written
        for position in key[2]:
            written = np.asarray(twin.invars[position].val, twin.invars[position].aval.dtype)
            rounded = np.asarray(equation.invars[position].val, equation.invars[position].aval.dtype)
            if written.dtype == rounded.dtype or written.shape != rounded.shape:
                continue
            if _rounds_to(written, rounded) and not np.array_equal(
                rounded.astype(written.dtype), written, equal_nan=True
            ):
                literals[(id(equation), position)] = written
    return literals, casts


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
