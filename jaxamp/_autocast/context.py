"""What every dtype rule receives: the rewrite in progress (`Rewrite`), and the helpers rules share.

Below `rules`, `lineage` and `interpreter`, so none of them imports another
for it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import Literal, Primitive

from jaxamp._autocast.primitives import subjaxprs, warn_once
from jaxamp._autocast.scope import ScopePolicy, in_float32_scope, scope_policies

Rule = Callable[["Rewrite", Any, Sequence[Any]], list]
"""A dtype rule: ``rule(rewrite, equation, invals) -> outvals``."""

RulesFor = Callable[[np.dtype, bool], Mapping[Primitive, Rule]]
"""``rules_for(compute_dtype, fp8_matmuls)``: the rules table of a policy scope (`fp8_matmuls`: the
matmul format, ``float8``, ``mxfp8`` or ``nvfp4``, or a false value)."""


def is_floating(dtype: Any) -> bool:
    """Whether `dtype` is a real floating dtype (float0 and complex are not)."""
    return jnp.issubdtype(dtype, jnp.floating)


def cast(value: Any, dtype: Any) -> Any:
    """`value` in `dtype`; NumPy values (literals, constants) stay NumPy values."""
    if value.dtype == dtype:
        return value
    if isinstance(value, (np.ndarray, np.generic)):
        with np.errstate(over="ignore", under="ignore"):
            return np.asarray(value).astype(dtype)
    return lax.convert_element_type(value, dtype)


def bind(equation, invals: Sequence[Any], **param_updates) -> list:
    """Applies `equation`'s primitive to `invals` with its params, some replaced.

    ``get_bind_params`` turns a jaxpr equation's params into bind's (a custom
    derivative's jaxprs into functions): JAX 0.10 returns the params with the
    functions among them, releases before it a ``(functions, params)`` pair.
    """
    bind_params = equation.primitive.get_bind_params({**equation.params, **param_updates})
    subfuns, bind_params = bind_params if isinstance(bind_params, tuple) else ((), bind_params)
    outvals = equation.primitive.bind(*subfuns, *invals, **bind_params)
    return list(outvals) if equation.primitive.multiple_results else [outvals]


def traced_dtypes(atoms: Sequence[Any]) -> list:
    """The dtypes `atoms` (jaxpr variables or literals) had when traced."""
    return [atom.aval.dtype for atom in atoms]


def carries_jaxpr(equation) -> bool:
    """Whether `equation` holds a jaxpr (a ``jit``, ``scan``, ``cond``, custom derivative...)."""
    return next(subjaxprs(equation.params), None) is not None


@dataclasses.dataclass(frozen=True, eq=False)
class Rewrite:
    """What one rewrite needs: the compute dtype and the rule of each primitive.

    Attributes:
        compute_dtype: the policy's compute dtype.
        rules: primitive -> rule.
        as_traced: the rule that runs an equation exactly as traced, for code
            under `jaxamp.float32_scope` where no scope can change the rules
            (a custom derivative's rewrite) and for first-order primitives the
            table does not know (a user's own primitive, or one a newer JAX
            added), which are named once per process
            (`jaxamp._autocast.primitives.warn_once`).
        memo: rewritten bodies of higher-order primitives, per (body, input
            avals, output dtypes), so that a body used many times (the same
            jitted layer called in a loop) is rewritten once.
        rules_for: builds the rules of a policy scope
            (`jaxamp._autocast.scope.policy_scope`); None where no scope
            can change the policy (the rewrites of a custom derivative).
        fp8_matmuls: the format `rules` run the eligible matmuls in
            (``float8``, ``mxfp8``, ``nvfp4``), or False.
        literals: ``(id(equation), position) -> value``: the literals the
            half trace rounded, as the program wrote them
            (`jaxamp._autocast.reference`).
        traced_dtype: the dtype the function's floating arguments were
            traced in (the policy's compute dtype; None: `compute_dtype`).
        written_casts: the ids of the half trace's casts the program wrote
            (`jaxamp._autocast.reference`); None where no argument was traced
            narrower than given, so every cast is the program's.
        island: whether this is a float32 island's rewrite (`scoped`).
    """

    compute_dtype: np.dtype
    rules: Mapping[Primitive, Rule]
    as_traced: Rule
    memo: dict = dataclasses.field(default_factory=dict)
    rules_for: RulesFor | None = None
    fp8_matmuls: str | bool | None = False
    literals: Mapping[tuple[int, int], np.ndarray] = dataclasses.field(default_factory=dict)
    traced_dtype: np.dtype | None = None
    written_casts: frozenset | None = None
    island: bool = False
    _scoped: dict = dataclasses.field(default_factory=dict)

    @property
    def in_float32_island(self) -> bool:
        """Whether this rewrite computes, in float32, code the function traced in half and hands its
        values on in float32 (a `float32_scope`, a layer overridden to float32), where the
        program's float32 meaning holds."""
        return self.island and self.traced_dtype is not None and np.dtype(self.traced_dtype) != np.float32

    def scoped(self, equation) -> Rewrite:
        """The rewrite that `equation` runs under: this one, or its innermost policy scope's.

        The rewrites of the scopes are made once per (compute dtype, FP8)
        and shared by every body rewritten beneath this one, each with its
        own memo (a body rewritten under two policies is two bodies).
        """
        if self.rules_for is None:
            return self
        if in_float32_scope(equation):
            return self.under(np.dtype(np.float32), fp8_matmuls=None, island=True)
        scopes = scope_policies(equation)
        if not scopes:
            return self
        scope: ScopePolicy = scopes[-1][1]
        island = scope.compute_dtype == np.float32 and scope.exit_dtype == np.float32
        return self.under(scope.compute_dtype, fp8_matmuls=scope.fp8_matmuls, island=island)

    def under(self, compute_dtype: np.dtype, *, fp8_matmuls: str | bool | None, island: bool = False) -> Rewrite:
        """This rewrite with another compute dtype and FP8 setting (this one where no scope can change
        it); `island`: a float32 island, whose values leave it in float32 (which matters only where
        the function was traced in half)."""
        traced = self.compute_dtype if self.traced_dtype is None else self.traced_dtype
        island = island and np.dtype(traced) != np.float32
        key = (np.dtype(compute_dtype), fp8_matmuls, island)
        if self.rules_for is None or key == (self.compute_dtype, self.fp8_matmuls, self.island):
            return self
        if key not in self._scoped:
            self._scoped[key] = Rewrite(
                key[0],
                self.rules_for(*key[:2]),
                self.as_traced,
                rules_for=self.rules_for,
                fp8_matmuls=key[1],
                literals=self.literals,
                traced_dtype=self.compute_dtype if self.traced_dtype is None else self.traced_dtype,
                island=island,
                written_casts=self.written_casts,
                _scoped=self._scoped,
            )
        return self._scoped[key]

    def rule_for(self, equation) -> Rule:
        """The rule of `equation` (`scoped` gives code under `float32_scope` the float32 rules).

        Policy scopes are resolved before (`scoped`): call this on the
        rewrite that `scoped` gives.

        Raises:
            NotImplementedError: the primitive carries a jaxpr and has no rule.
        """
        if in_float32_scope(equation) and self.rules_for is None:
            return self.as_traced
        rule = self.rules.get(equation.primitive)
        if rule is not None:
            return rule
        if carries_jaxpr(equation):
            name = equation.primitive.name
            raise NotImplementedError(
                f"jaxamp.autocast has no rule for the higher-order primitive {name!r} "
                f"(params: {', '.join(sorted(equation.params))}), so it cannot rewrite the jaxpr "
                f"it carries. Run it as traced with autocast(..., overrides={{{name!r}: 'restore'}}) "
                "(or the primitive object itself as the key), or wrap that code in jaxamp.float32_scope()."
            )
        warn_once(equation.primitive)
        return self.as_traced

    def literal(self, equation, position: int) -> np.ndarray:
        """The value of `equation`'s literal operand at `position`, as the program wrote it."""
        written = self.literals.get((id(equation), position))
        if written is not None:
            return written
        atom: Literal = equation.invars[position]
        return np.asarray(atom.val, dtype=atom.aval.dtype)
