"""The program as written: each literal's value, and each constant's cast, before the half trace rounded it.

`autocast` traces a function in its compute dtype, so that what the
function decides while traced (a fused attention kernel, a Pallas call, a
dtype check) sees half precision. JAX rounds every Python scalar the
function uses to the dtype it meets: in a float16 trace ``1e-12`` is
already ``0`` and ``-1e9`` already ``-inf``. So `autocast` traces the
function a second time with its arguments as given (the *reference*
trace) and pairs the two programs' literals:

```text
key(equation) = (primitive, operand count, literal positions, name stack,
                 the traceback's frames inside the traced function)
for each jaxpr, nested ones included, in the same order in both traces:
    the k-th equation of a key in the half trace pairs with the k-th of that key in the reference
for each floating literal of a paired equation:
    if the reference's literal, rounded to the half literal's dtype, is the half literal
    and holds a value the half literal lost:
        recovered[equation, position] = the reference's literal
```

Equations the half trace adds or changes (JAX's upcasts around a half
``mean``, a normalization's other path for half inputs) have keys of their
own and pair with nothing; a literal is replaced only where the value the
program wrote rounds to the one the half trace holds, so a wrong pairing
cannot change a value the program did not write.

A Python scalar that JAX passes on as a weak float32 value (``jnp.where``'s
fill, inside its ``jit``) is cast to the half dtype where it meets a half
operand. The casts pair the same way: where the reference casts to a wider
dtype, `recovered_casts` keeps it, and the interpreter casts a constant
there instead (`jaxamp._autocast.lineage` decides whether the half dtype
can hold it).
"""

from __future__ import annotations

import collections
from collections.abc import Iterator
from typing import Any

import numpy as np
from jax.extend.core import Jaxpr, Literal

from jaxamp._autocast.primitives import subjaxprs


def _is_floating_literal(atom: Any) -> bool:
    return isinstance(atom, Literal) and np.issubdtype(atom.aval.dtype, np.floating)


def _pairable(jaxpr: Jaxpr, seen: set[int]) -> Iterator[Any]:
    """The equations of `jaxpr` and of its nested jaxprs (each once) with a floating literal
    operand, and the casts between floating dtypes."""
    if id(jaxpr) in seen:
        return
    seen.add(id(jaxpr))
    for equation in jaxpr.eqns:
        cast = equation.primitive.name == "convert_element_type" and np.issubdtype(
            equation.invars[0].aval.dtype, np.floating
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
    """What the half trace rounded, from the program as written.

    Args:
        traced: the half trace.
        reference: the trace of the same function with its arguments as given.
        entry: the code object both traces started at (their frames above it differ).

    Returns:
        ``(id(equation), position) -> value`` for each literal of `traced` that
        rounded one of `reference`, and ``id(equation) -> dtype`` for each cast
        to a narrower dtype than the reference's.
    """
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
            with np.errstate(over="ignore", under="ignore"):
                rounds_to = np.array_equal(written.astype(rounded.dtype), rounded, equal_nan=True)
                lost = not np.array_equal(rounded.astype(written.dtype), written, equal_nan=True)
            if rounds_to and lost:
                literals[(id(equation), position)] = written
    return literals, casts
