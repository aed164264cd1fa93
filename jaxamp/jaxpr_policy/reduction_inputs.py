"""Values that feed only a float32 reduction are computed in float32.

Under `jaxamp.autocast` every reduction runs in float32, but the values it
reduces were, until it casts them, whatever the ops before it gave: a
``mul`` follows its float16 inputs, so ``jnp.linalg.norm(h)`` (built as
``sqrt(sum(h * h))``), a hand-written RMS norm ``mean(h * h)`` or a loss
``mean(d * d)`` overflows float16 once ``|h|`` passes 256, before the float32
``reduce_sum`` ever sees it. This pass finds, per jaxpr, the elementwise
equations whose results are consumed by float32 reductions and by nothing
else, so that the interpreter runs them with `float32_rule` instead of their
own rule. XLA fuses such a chain into the reduction that consumes it (the
chain's results are never written to memory), so the float32 arithmetic
costs no extra bytes moved: the half-precision inputs are read once, as
before, and converted in registers.

The chain (`_CHAIN`): the arithmetic ops whose rule is "follow" (``add``,
``add_any``, ``sub``, ``mul``, ``div``, ``neg``, ``abs``, ``max``, ``min``,
``sign``, ``select_n``) and the shape ops that a reduction fusion absorbs
(``broadcast_in_dim``, ``reshape``, ``squeeze``, ``transpose``, ``copy``), plus
a ``convert_element_type`` to float32 or wider (JAX's own upcast before a
float16 sum; a cast to a half dtype is the user's and stays as written).
Gathers, slices, concatenation, sorting and the rest are left alone: cast to
float32 before them, their operands could be materialized in float32.
``conj`` and ``real`` do not appear for real inputs, and autocast leaves
complex values as they are. The sinks (`_REDUCTIONS`) are the full
reductions (sum, product, max, min, argmax, argmin); windowed and cumulative
reductions are not sinks, since XLA does not fuse every producer into them.

The algorithm, once per jaxpr::

    readers[v] = the equations that read variable v
    widened = {}
    for equation in reversed(jaxpr.eqns):      # every reader before its producer
        if (equation's primitive is in the chain and its rule is follow/convert
                and every output v is floating, is read by at least one equation,
                is not an output of the jaxpr, and each reader of v is either
                a float32 reduction (in the sinks, rule float32) or in widened):
            widened.add(equation)
    return widened

A jaxpr lists its equations in an order where each is after its inputs'
producers, so one backward sweep decides every equation after all of its
readers. An equation with any other reader keeps its rule: ``y = x * x``
that is returned, added to a residual or fed to a matmul follows its inputs,
as before. Rules see overrides and `float32_scope` through
``Rewrite.rule_for``: a reduction overridden to "follow" is no sink, code in
the scope runs as traced.

Nested jaxprs (a ``jit``, ``scan``, ``cond`` or custom-derivative body) are
each swept on their own when the interpreter evaluates them. An output of a
body counts as a reader that is not a reduction: what consumes it lies
outside the body, where the sweep does not look, so ``jax.jit(lambda h: h * h)``
followed by a sum keeps its ``mul`` as before. Likewise an equation whose
reader is a higher-order primitive (a reduction inside a ``jit`` body reading
a value computed outside) keeps its rule. Most reductions users write sit in
one jaxpr with their chain (``jnp.linalg.norm`` and ``jnp.var`` are each one
``jit`` body), which is what matters.

Under differentiation the sweep sees whatever jaxpr it is given:
``autocast(jax.grad(f))`` traces the backward pass too, where a product that
only feeds a sum (the gradient of a norm's scale, ``sum(ct * x_hat)``) runs in
float32 as well; ``jax.grad(autocast(f))`` differentiates the rewritten
forward pass, whose widened ``mul`` has a float32 backward that is cast back
to the activation's dtype by the transpose of the cast.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

import jax.numpy as jnp
from jax.extend.core import Literal
from jax.extend.core import primitives as lax_primitives

from jaxamp.jaxpr_policy.rules import convert_rule, float32_rule, follow_rule, is_floating

if TYPE_CHECKING:
    from jax.extend.core import Jaxpr

    from jaxamp.jaxpr_policy.interpreter import Rewrite

_REDUCTIONS = frozenset(
    (
        lax_primitives.reduce_sum_p,
        lax_primitives.reduce_prod_p,
        lax_primitives.reduce_max_p,
        lax_primitives.reduce_min_p,
        lax_primitives.argmax_p,
        lax_primitives.argmin_p,
    )
)

_CHAIN = frozenset(
    (
        # arithmetic
        lax_primitives.add_p,
        lax_primitives.add_jaxvals_p,  # "add_any", the sum of cotangents
        lax_primitives.sub_p,
        lax_primitives.mul_p,
        lax_primitives.div_p,
        lax_primitives.neg_p,
        lax_primitives.abs_p,
        lax_primitives.max_p,
        lax_primitives.min_p,
        lax_primitives.sign_p,
        lax_primitives.select_n_p,
        # shape ops a reduction fusion absorbs
        lax_primitives.broadcast_in_dim_p,
        lax_primitives.reshape_p,
        lax_primitives.squeeze_p,
        lax_primitives.transpose_p,
        lax_primitives.copy_p,
        # an upcast (checked below to be to float32 or wider)
        lax_primitives.convert_element_type_p,
    )
)

_enabled = True


@contextlib.contextmanager
def _disabled() -> Iterator[None]:
    """Turns the sweep off while autocast rewrites (for before/after measurements only)."""
    global _enabled
    previous, _enabled = _enabled, False
    try:
        yield
    finally:
        _enabled = previous


def _is_float32_reduction(context: Rewrite, equation) -> bool:
    return equation.primitive in _REDUCTIONS and context.rule_for(equation) is float32_rule


def _may_widen(context: Rewrite, equation) -> bool:
    """Whether `equation` is a chain op that runs by its follow (or cast) rule."""
    if equation.primitive not in _CHAIN:
        return False
    if not all(is_floating(variable.aval.dtype) for variable in equation.outvars):
        return False
    if equation.primitive is lax_primitives.convert_element_type_p:
        new_dtype = equation.params["new_dtype"]
        if jnp.promote_types(jnp.float32, new_dtype) != new_dtype:
            return False
    return context.rule_for(equation) in (follow_rule, convert_rule)


def reduction_inputs(context: Rewrite, jaxpr: Jaxpr) -> frozenset[int]:
    """The equations of `jaxpr` that run in float32 because they feed only float32 reductions.

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
