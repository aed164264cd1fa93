"""Where float32 extends: each value's lineage, which decides the dtype of an op on no list.

The rules of `rules` put matmuls and convolutions in the compute dtype and
the sensitive ops (exp, log, reductions) in float32. Every other op follows
its inputs, and which inputs it follows depends on where each came from:

```text
lineage      what it is                                            decides an op's dtype?
ACTIVATION   a value in the dtype the program computes it in       yes
ISLAND       made in a float32 island: float32_scope, a float32    yes, and it is never narrowed
             layer, an argument kept in float32                    to the dtype it was traced in
WIDE         wider than traced: a param's float32 original, the    no: read in its width, the result
             result of a float32 op                                takes its deciders' dtype
STATISTIC    a reduction, and what follows from statistics alone   no; kept float32 through the
                                                                   half trace's cast back to half
CONSTANT     a literal (as the program wrote it, `reference`) or   no, unless the result dtype
             a closed-over array, and what follows from them alone cannot hold it
```

An op that follows its inputs computes in the widest dtype among its
deciders, its WIDE and STATISTIC inputs and the constants its deciders'
dtype cannot hold (past its largest value, or nonzero and below its
smallest), and its result takes the widest deciders' dtype, rounded once
per chain of such ops: the next op reads the unrounded value. A constant
that widens the result makes it WIDE (a mask filled with ``-1e9`` stays
float32 through the softmax and is rounded where an activation meets it).
Without deciders the result is as wide as computed. So a bias, a
normalization's scale or a mean meeting a float16 activation computes in
float32 and gives float16, and a value between two float32 layers stays
float32 until a matmul consumes it, as ``torch.autocast`` keeps it. A
difference of two values each rounded by the op that made it reads their
unrounded values too (`_difference_of_rounded`).

A constant is read as written: a literal the half trace rounded comes from
the reference trace (`jaxamp._autocast.reference`), and a Python number
that JAX casts to the half dtype it meets keeps its value
(`cast_constant`), however it entered (a ``jit``'s or a ``custom_jvp``'s
argument, ``jnp.where``'s fill).

Float32 also extends backwards, into the elementwise chains that feed only
a float32 reduction (`reduction_inputs`): ``mean(h * h)`` squares in
float32, fused into the reduction.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import math
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Literal

from jaxamp._autocast.context import bind, cast, is_floating

if TYPE_CHECKING:
    from jax.extend.core import Jaxpr

    from jaxamp._autocast.context import Rewrite


class Kind(enum.Enum):
    """Where a floating value came from (see the module docstring), in the order `join` ranks them."""

    ISLAND = 0
    ACTIVATION = 1
    WIDE = 2
    STATISTIC = 3
    CONSTANT = 4


@dataclasses.dataclass(frozen=True)
class Lineage:
    """A value's `Kind`; a constant's also the range of its finite nonzero magnitudes (None: unknown)."""

    kind: Kind
    largest: float | None = None
    smallest: float | None = None

    @property
    def decides(self) -> bool:
        return self.kind in (Kind.ISLAND, Kind.ACTIVATION)

    def fits(self, dtype: Any) -> bool:
        """Whether `dtype` holds this constant: no finite value overflows and none flushes to zero."""
        info = jnp.finfo(dtype)
        return (self.largest is None or self.largest <= float(info.max)) and (
            self.smallest is None or self.smallest >= float(info.smallest_subnormal)
        )


ISLAND = Lineage(Kind.ISLAND)
ACTIVATION = Lineage(Kind.ACTIVATION)
WIDE = Lineage(Kind.WIDE)
STATISTIC = Lineage(Kind.STATISTIC)


def constant(value: Any) -> Lineage:
    """The lineage of a concrete value (a literal, a closed-over array); ACTIVATION for a tracer.

    A number's magnitudes are measured, an integer's and a boolean's too (a
    bound or a count made floating later). A closed-over ``jax.Array`` is
    measured where it lives (a large table is not copied to the host to be
    measured)."""
    if isinstance(value, jax.core.Tracer):
        return ACTIVATION
    dtype = np.dtype(value.dtype) if hasattr(value, "dtype") else np.result_type(value)
    if not (is_floating(dtype) or jnp.issubdtype(dtype, jnp.integer) or dtype == np.bool_):
        return ACTIVATION
    xp = jnp if isinstance(value, jax.Array) else np
    with jax.ensure_compile_time_eval():  # measured now, though a rewrite is being traced
        magnitudes = xp.abs(xp.asarray(value).astype(xp.float32 if xp is jnp else np.float64))
        counted = xp.isfinite(magnitudes) & (magnitudes > 0)
        if not bool(xp.any(counted)):
            return Lineage(Kind.CONSTANT, 0.0, None)
        largest = float(xp.max(xp.where(counted, magnitudes, 0)))
        return Lineage(Kind.CONSTANT, largest, float(xp.min(xp.where(counted, magnitudes, xp.inf))))


def cast_constant(value: Any, dtype: Any, lineage: Lineage) -> Any:
    """A weakly typed constant (a Python number the program wrote) under JAX's cast of it to `dtype`.

    JAX casts a Python number to the dtype it meets: in a half trace, the
    half dtype (``jnp.where``'s fill, ``-1e9`` meeting a half activation, a
    bound entering ``jnp.clip``'s ``jit`` as an argument). A floating
    constant keeps its width there, and the op that reads it rounds it or
    widens, by the rule of `follow`. An integer constant made floating goes
    to `dtype` where `dtype` holds every integer up to its magnitude exactly
    (2048 in float16, 256 in bfloat16), else to float32:
    ``jnp.clip(x, 0, 4095)`` bounds by 4095, not 4096. The program's own
    cast of a constant it made (``jnp.full(..., -1e9, jnp.float32).astype(h.dtype)``)
    is honoured, as in a half program.
    """
    if not is_floating(dtype):
        return cast(value, dtype)
    if is_floating(value.dtype):
        return value if wider(value.dtype, dtype) else cast(value, dtype)
    exact_below = 2.0 ** (jnp.finfo(dtype).nmant + 1)
    if value.dtype == np.bool_ or (lineage.largest is not None and lineage.largest <= exact_below):
        return cast(value, dtype)
    return cast(value, jnp.promote_types(dtype, jnp.float32))


def wider(dtype: Any, traced: Any) -> bool:
    """Whether a value of `dtype` is wider than the program traced it."""
    return dtype != traced and jnp.promote_types(dtype, traced) == dtype


def of_input(value: Any, traced: Any, compute_dtype: Any) -> Lineage:
    """A jaxpr input's lineage: WIDE if wider than traced (a param's original), ISLAND if traced
    and given wider than the compute dtype (an argument kept in float32), else ACTIVATION."""
    if not is_floating(value.dtype):
        return ACTIVATION
    if wider(value.dtype, traced):
        return WIDE
    return ISLAND if wider(value.dtype, compute_dtype) else ACTIVATION


def join(lineages: Sequence[Lineage]) -> Lineage:
    """The lineage of a value that may be any of `lineages` (a ``cond``'s branches)."""
    return min(lineages, key=lambda lineage: lineage.kind.value, default=ACTIVATION)


_STRUCTURAL = frozenset((
    "broadcast_in_dim", "reshape", "squeeze", "transpose", "rev", "copy", "slice", "dynamic_slice", "gather",
    "concatenate", "pad", "select_n", "max", "min", "neg", "abs", "convert_element_type", "sort", "clamp",
))  # fmt: skip


def _constant_result(name: str, lineages: Sequence[Lineage]) -> Lineage:
    """A constant op's result, with its magnitudes where the op moves, picks, adds or multiplies."""
    known = [lineage for lineage in lineages if lineage.kind is Kind.CONSTANT]
    if name in _STRUCTURAL:
        largest = [lineage.largest for lineage in known]
        smallest = [lineage.smallest for lineage in known if lineage.smallest is not None]
        if None in largest:
            return Lineage(Kind.CONSTANT)
        return Lineage(Kind.CONSTANT, max(largest, default=0.0), min(smallest, default=None))
    if name in ("mul", "add", "sub") and all(lineage.largest is not None for lineage in known):
        combine = math.prod if name == "mul" else sum
        return Lineage(Kind.CONSTANT, float(combine(lineage.largest for lineage in known)), None)
    return Lineage(Kind.CONSTANT)


def follow(
    context: Rewrite,
    equation,
    invals: Sequence[Any],
    lineages: Sequence[Lineage],
    unrounded: Sequence[Any | None] | None = None,
) -> tuple[list, list | None, Lineage]:
    """An op on no list, by its inputs' `lineages` (the module docstring has the rule); `unrounded`
    holds, per input, its value before the op that made it rounded it, or None. Returns the
    results, their unrounded values (None where not rounded) and their lineage."""
    floating = [index for index, atom in enumerate(equation.invars) if is_floating(atom.aval.dtype)]
    deciders = [index for index in floating if lineages[index].decides]
    weak = [index for index in floating if lineages[index].kind in (Kind.WIDE, Kind.STATISTIC)]
    constants = [index for index in floating if lineages[index].kind is Kind.CONSTANT]
    operands = list(invals)
    if not deciders and not weak:
        dtype = jnp.result_type(*(invals[index].dtype for index in floating)) if floating else None
        outvals = bind(equation, [cast(value, dtype) if index in floating else value
                                  for index, value in enumerate(invals)])  # fmt: skip
        if not floating and any(lineage.kind is not Kind.CONSTANT for lineage in lineages):
            return outvals, None, ACTIVATION  # integer or boolean arithmetic on data
        return outvals, None, _constant_result(equation.primitive.name, lineages)
    result = jnp.result_type(*(invals[index].dtype for index in deciders or weak))
    widening = [index for index in constants if not lineages[index].fits(result)]
    result = jnp.result_type(result, *(invals[index].dtype for index in widening))
    if unrounded is not None and deciders and (weak or _difference_of_rounded(equation, deciders, unrounded)):
        operands = [value if wide is None else wide for value, wide in zip(invals, unrounded)]
    computed = jnp.result_type(result, *(operands[index].dtype for index in deciders + weak))
    for index in floating:
        operands[index] = cast(operands[index], computed)
    outvals = bind(equation, operands)
    if not deciders:
        lineage = STATISTIC if all(lineages[index] == STATISTIC for index in weak) else WIDE
    elif any(lineages[index].kind is Kind.ISLAND for index in deciders):
        lineage = ISLAND
    else:
        lineage = WIDE if widening else ACTIVATION
    if computed == result:
        return outvals, None, lineage
    return [cast(value, result) for value in outvals], outvals, lineage


def _difference_of_rounded(equation, deciders: Sequence[int], unrounded: Sequence[Any | None]) -> bool:
    """Whether `equation` subtracts a value rounded by the op that made it (``a * c - b * s`` or
    ``a * c - b`` of a float32 ``c``): the difference of the unrounded values, rounded once, has no
    cancellation error; a sum does not cancel, and a residual stream of sums stays in the compute
    dtype."""
    return equation.primitive.name == "sub" and any(unrounded[index] is not None for index in deciders)


_REDUCTIONS = frozenset(("reduce_sum", "reduce_prod", "reduce_max", "reduce_min", "argmax", "argmin"))


def after_float32(equation, lineages: Sequence[Lineage]) -> Lineage:
    """A float32 op's result: a STATISTIC if a reduction or of statistics alone, else WIDE."""
    operands = [
        lineage
        for atom, lineage in zip(equation.invars, lineages)
        if is_floating(atom.aval.dtype) and lineage.kind is not Kind.CONSTANT
    ]
    if equation.primitive.name in _REDUCTIONS - {"argmax", "argmin"}:
        return STATISTIC
    if not operands:
        return Lineage(Kind.CONSTANT)
    return STATISTIC if all(lineage == STATISTIC for lineage in operands) else WIDE


def keeps_a_statistic(context: Rewrite, equation, value: Any, lineage: Lineage) -> bool:
    """Whether `equation` is the half trace's cast of a statistic back to the compute dtype (a half
    ``jnp.mean`` upcasts and rounds back): skipped, a mean of squares past 65504 stays finite."""
    new_dtype = equation.params.get("new_dtype")
    return (
        lineage == STATISTIC
        and new_dtype == context.compute_dtype
        and jnp.finfo(new_dtype).bits < 32
        and wider(value.dtype, new_dtype)
    )


def after_convert(lineage: Lineage, dtype: Any, from_dtype: Any, compute_dtype: Any) -> Lineage:
    """The program's own cast: to a dtype wider than the compute dtype it keeps a value's lineage (a
    param cast to float32 stays weak, an island an island); to the compute dtype or narrower the
    value is an activation (a constant stays one). An integer made floating (a count, ``ddof``)
    joins what it meets as a constant does."""
    if not is_floating(from_dtype) or lineage.kind is Kind.CONSTANT:
        return Lineage(Kind.CONSTANT) if not is_floating(from_dtype) else lineage
    return lineage if wider(dtype, compute_dtype) else ACTIVATION


_CHAIN = frozenset(("add", "sub", "mul", "div", "neg", "abs", "max", "min", "sign", "select_n",
                    "broadcast_in_dim", "reshape", "squeeze", "transpose", "copy", "convert_element_type"))  # fmt: skip

_enabled = True


@contextlib.contextmanager
def _reduction_inputs_disabled() -> Iterator[None]:
    """Turns `reduction_inputs` off while autocast rewrites (before/after measurements only; use a
    new ``autocast`` wrapper inside the block)."""
    global _enabled
    previous, _enabled = _enabled, False
    try:
        yield
    finally:
        _enabled = previous


def _role(context: Rewrite, equation) -> str | None:
    return getattr(context.scoped(equation).rule_for(equation), "role", None)


def reduction_inputs(context: Rewrite, jaxpr: Jaxpr) -> frozenset[int]:
    """The ``id`` of each equation of `jaxpr` whose results go only to a float32 reduction.

    Such an equation runs in float32 whatever its rule: ``sqrt(sum(h * h))``
    or a hand-written RMS norm would otherwise overflow float16 once ``|h|``
    passes 256. XLA fuses the chain into the reduction, so nothing more is
    written out. The chain is `_CHAIN` (arithmetic that follows its inputs,
    the shape ops a reduction fusion absorbs, an upcast; not ``add_any``,
    whose widening changes how XLA fuses a norm's backward, nor gathers or
    slices, whose operands could be materialized); the sinks are the full
    reductions whose rule is float32. One backward sweep:

    ```text
    for equation in reversed(jaxpr.eqns):      # every reader before its producer
        if it is a chain op run by its follow or cast rule, and each floating output is
                read by exactly one equation (not a jaxpr output): a sink or already widened
            widened.add(equation)
    ```

    One reader: a value read twice may be written out between the reads.
    """
    if not _enabled:
        return frozenset()
    readers: dict = {}
    for equation in jaxpr.eqns:
        for atom in equation.invars:
            if not isinstance(atom, Literal):
                readers.setdefault(atom, {})[id(equation)] = equation
    escaping = {atom for atom in jaxpr.outvars if not isinstance(atom, Literal)}
    widened: set[int] = set()

    def feeds_one_reduction(variable) -> bool:
        if variable in escaping or len(readers.get(variable, ())) != 1:
            return False
        (reader,) = readers[variable].values()
        if id(reader) in widened:
            return True
        return reader.primitive.name in _REDUCTIONS and _role(context, reader) == "float32"

    for equation in reversed(jaxpr.eqns):
        name = equation.primitive.name
        if name not in _CHAIN or not all(is_floating(variable.aval.dtype) for variable in equation.outvars):
            continue
        if name == "convert_element_type" and wider(jnp.float32, equation.params["new_dtype"]):
            continue
        if _role(context, equation) in ("follow", "convert") and all(
            feeds_one_reduction(variable) for variable in equation.outvars
        ):
            widened.add(id(equation))
    return frozenset(widened)
