"""Values that feed only a float32 reduction are computed in float32.

Under `jaxamp.autocast` every reduction runs in float32, but the values it
reduces are whatever the ops before it gave: a ``mul`` follows its float16
inputs, so ``jnp.linalg.norm(h)`` (built as ``sqrt(sum(h * h))``), a
hand-written RMS norm ``mean(h * h)`` or a loss ``mean(d * d)`` overflows
float16 once ``|h|`` passes 256, before the float32 ``reduce_sum`` sees it.
This pass finds, per jaxpr, the elementwise equations whose results go to a
float32 reduction and nowhere else, and the interpreter runs them with
`float32_rule` instead of their own rule. Such a chain is fused by XLA into
the reduction that consumes it: its half-precision inputs are read once, as
before, converted in registers, and its results are never written out.

The chain (`_CHAIN`): the arithmetic ops whose rule is "follow" (``add``,
``sub``, ``mul``, ``div``, ``neg``, ``abs``, ``max``, ``min``, ``sign``,
``select_n``), the shape ops that a reduction fusion absorbs
(``broadcast_in_dim``, ``reshape``, ``squeeze``, ``transpose``, ``copy``), and a
``convert_element_type`` to float32 or wider (JAX's own upcast before a
float16 sum; a cast to a half dtype is the user's and stays as written).
Left out, each for a reason:

* ``add_any``, JAX's sum of cotangents in a backward pass: its operands are
  the backward matmuls' half-precision outputs, and a sum does not square
  its operands' range. Widened, it changed how XLA fuses a norm's backward
  on an H200 target (a float32 activation kept alive through the backward
  pass, or a float32 product written out; docs/guides/autocast-reductions.md
  has the measurement).
* gathers, slices, concatenation, padding, sorting: cast to float32 before
  them, their operands could be materialized in float32.
* ``conj`` and ``real``: they do not appear for real inputs, and autocast
  leaves complex values as they are.

The sinks (`_REDUCTIONS`) are the full reductions (sum, product, max, min,
argmax, argmin) whose rule is float32; windowed and cumulative reductions
are not sinks, since XLA does not fuse every producer into them.

The algorithm, once per jaxpr::

    readers[v] = the equations that read variable v
    widened = {}
    for equation in reversed(jaxpr.eqns):     # every reader before its producer
        if (equation's primitive is in the chain, its rule is follow/convert,
                and every output v is floating, is not an output of the
                jaxpr, and is read by exactly one equation, which is
                a float32 reduction or in widened):
            widened.add(equation)
    return widened

A jaxpr lists each equation after its inputs' producers, so one backward
sweep decides every equation after all of its readers. One reader, not
several: a value read by two equations (two reductions, say) may be written
to memory between them, and in float32 it would take twice the bytes. An
equation with any other reader keeps its rule: ``y = x * x`` that is
returned, fed to a matmul or to ``tanh`` follows its inputs, as before.
Rules come from ``Rewrite.scoped(...).rule_for``, so overrides, policy
scopes and `float32_scope` count: a reduction overridden to "follow" is no
sink, and code in the scope runs as traced.

Nested jaxprs (a ``jit``, ``scan``, ``cond`` or custom-derivative body) are
each swept on their own when the interpreter evaluates them. An output of a
body counts as a reader that is not a reduction: what reads it lies outside
the body, where the sweep does not look, so ``jax.jit(lambda h: h * h)``
followed by a sum keeps its ``mul`` as before. Likewise a value read by a
higher-order primitive (a ``jit`` whose body reduces it) keeps its rule.
Most reductions users write sit in one jaxpr with their chain
(``jnp.linalg.norm`` and ``jnp.var`` are each one ``jit`` body).

Under differentiation the sweep sees the jaxpr it is given:
``autocast(jax.grad(f))`` traces the backward pass too, where a product that
only feeds a sum (the gradient of a norm's scale, ``sum(ct * x_hat)``) runs in
float32 as well; ``jax.grad(autocast(f))`` differentiates the rewritten
forward pass, whose widened ``mul`` has a float32 backward that the
transpose of its input cast brings back to the activation's dtype.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

import jax.numpy as jnp
from jax.extend.core import Literal

from jaxamp._autocast.rules import convert_rule, float32_rule, follow_rule, is_floating

if TYPE_CHECKING:
    from jax.extend.core import Jaxpr

    from jaxamp._autocast.context import Rewrite

_REDUCTIONS = frozenset(
    (
        "reduce_sum",
        "reduce_prod",
        "reduce_max",
        "reduce_min",
        "argmax",
        "argmin",
    )
)

_CHAIN = frozenset(
    (
        # arithmetic
        "add",
        "sub",
        "mul",
        "div",
        "neg",
        "abs",
        "max",
        "min",
        "sign",
        "select_n",
        # shape ops a reduction fusion absorbs
        "broadcast_in_dim",
        "reshape",
        "squeeze",
        "transpose",
        "copy",
        # an upcast (checked below to be to float32 or wider)
        "convert_element_type",
    )
)

_enabled = True


@contextlib.contextmanager
def _disabled() -> Iterator[None]:
    """Turns the sweep off while autocast rewrites (for before/after measurements only).

    Rewrites are made when autocast traces (a first call, or ``lower``), and
    kept as made: use a new ``autocast`` wrapper inside the block.
    """
    global _enabled
    previous, _enabled = _enabled, False
    try:
        yield
    finally:
        _enabled = previous


def _is_float32_reduction(context: Rewrite, equation) -> bool:
    return (
        equation.primitive.name in _REDUCTIONS and context.scoped(equation).rule_for(equation) is float32_rule
    )


def _may_widen(context: Rewrite, equation) -> bool:
    """Whether `equation` is a chain op that runs by its follow (or cast) rule."""
    if equation.primitive.name not in _CHAIN:
        return False
    if not all(is_floating(variable.aval.dtype) for variable in equation.outvars):
        return False
    if equation.primitive.name == "convert_element_type":
        new_dtype = equation.params["new_dtype"]
        if jnp.promote_types(jnp.float32, new_dtype) != new_dtype:
            return False
    return context.scoped(equation).rule_for(equation) in (follow_rule, convert_rule)


def reduction_inputs(context: Rewrite, jaxpr: Jaxpr) -> frozenset[int]:
    """The equations of `jaxpr` that run in float32 because their results go only to a float32 reduction.

    Args:
        context: the rewrite (its ``rule_for`` gives each equation's rule).
        jaxpr: the jaxpr about to be interpreted (not its nested bodies).

    Returns:
        The ``id`` of each such equation (equations need not be hashable).
    """
    if not _enabled:
        return frozenset()
    readers: dict = {}
    for equation in jaxpr.eqns:
        for atom in equation.invars:
            if not isinstance(atom, Literal):
                readers.setdefault(atom, []).append(equation)
    escaping = {atom for atom in jaxpr.outvars if not isinstance(atom, Literal)}
    widened: set[int] = set()

    def feeds_one_reduction_chain(variable) -> bool:
        if variable in escaping or variable not in readers:
            return False
        (reader, *others) = {id(reader): reader for reader in readers[variable]}.values()
        return not others and (id(reader) in widened or _is_float32_reduction(context, reader))

    for equation in reversed(jaxpr.eqns):
        if _may_widen(context, equation) and all(
            feeds_one_reduction_chain(variable) for variable in equation.outvars
        ):
            widened.add(id(equation))
    return frozenset(widened)
