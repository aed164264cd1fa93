"""Scopes that `jaxamp.autocast` reads from the name stack of each equation.

* `float32_scope`, the public opt-out: code traced inside it runs in
  float32.
* Policy scopes (`policy_scope`), entered by `jaxamp.apply_policy` around
  the calls of a Flax layer whose class runs under a policy of its own (a
  class in ``overrides``, a normalization layer): the equations inside run
  under that scope's compute dtype (float32: every op that would follow its
  inputs runs in float32) and FP8 setting, and a floating value made inside
  that an equation outside reads is cast to the scope's exit dtype on the
  way out.

Both are ``jax.named_scope``s, so they are carried into the jaxpr and
survive ``jax.jit``, ``jax.grad`` and the other transformations; outside
`autocast` they only name the operations.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import re
from collections.abc import Iterator

import jax
import numpy as np

try:  # JAX's own eval_jaxpr re-enters each equation's source info this way.
    from jax._src.source_info_util import user_context as _user_context
except ImportError:  # pragma: no cover - a JAX release that moved it
    _user_context = None

FLOAT32_SCOPE_NAME = "jaxamp_float32"

# The scope name as one component of a name stack such as
# "block/jaxamp_float32/dense" or, after differentiation,
# "transpose(jvp(jaxamp_float32))".
_SCOPE_COMPONENT = re.compile(rf"(^|[/(]){FLOAT32_SCOPE_NAME}($|[/)])")


@contextlib.contextmanager
def float32_scope() -> Iterator[None]:
    """Runs the operations traced inside it in float32 under `jaxamp.autocast`.

    For the layer that a user knows must stay in float32 (a loss with large
    intermediate values, a hand-written normalization): its matmuls, and the
    operations that would follow their inputs, run in float32, though the
    function was traced in the compute dtype, and what it makes stays float32
    through the ops outside that follow it, until a matmul or convolution
    consumes it (a float32 island). Kernels, scatters and other
    operations that run as traced keep the traced dtype. The scope is a
    ``jax.named_scope``, so it is carried into the jaxpr and survives
    ``jax.jit``, ``jax.grad`` and the other transformations; outside
    `autocast` it only names the operations.

    Examples:
        >>> def model(params, x):
        ...     h = x @ params["w1"]                 # float16 under autocast
        ...     with jaxamp.float32_scope():
        ...         h = h @ params["w2"]             # stays float32
        ...     return h
    """
    with jax.named_scope(FLOAT32_SCOPE_NAME):
        yield


def in_float32_scope(equation) -> bool:
    """Whether `equation` was traced inside `float32_scope`.

    Reads the equation's name stack, the one place where autocast relies on
    an attribute JAX does not document (``source_info.name_stack``).
    """
    return bool(_SCOPE_COMPONENT.search(str(equation.source_info.name_stack)))


POLICY_SCOPE_PREFIX = "jaxamp_policy"

# "jaxamp_policy.c-float16.m-fp8.o-float32" as one component of a name stack; the matmul part is
# .m-fp8 (per-tensor FP8), .m-mxfp8 or .m-nvfp4.
_POLICY_COMPONENT = re.compile(
    rf"(?:^|(?<=[/(])){POLICY_SCOPE_PREFIX}\.c-([a-z0-9]+)(?:\.m-([a-z0-9]+))?\.o-([a-z0-9]+)(?=$|[/)])"
)


@dataclasses.dataclass(frozen=True)
class ScopePolicy:
    """What a policy scope asks of the equations traced inside it.

    Attributes:
        compute_dtype: the compute dtype inside; under float32, the ops that
            follow their inputs run in float32 too.
        fp8_matmuls: the format the eligible matmuls inside run in
            (``float8``, ``mxfp8``, ``nvfp4``: `jaxamp.Policy.matmul_format`),
            or None (or False) for the compute dtype.
        exit_dtype: the dtype of the scope's floating values where an
            equation outside the scope reads them.
    """

    compute_dtype: np.dtype
    fp8_matmuls: str | None
    exit_dtype: np.dtype

    @property
    def name(self) -> str:
        """The scope's name in the name stack, which `scope_policies` parses back."""
        fp8 = f".m-{'fp8' if self.fp8_matmuls in (True, 'float8') else self.fp8_matmuls}" if self.fp8_matmuls else ""
        return f"{POLICY_SCOPE_PREFIX}.c-{self.compute_dtype.name}{fp8}.o-{self.exit_dtype.name}"


@contextlib.contextmanager
def policy_scope(scope: ScopePolicy) -> Iterator[None]:
    """Runs the operations traced inside under `scope` when `jaxamp.autocast` rewrites them."""
    with jax.named_scope(scope.name):
        yield


# A transformation's wrapper in a name stack: "jvp(", "transpose(", and ")".
_TRANSFORM_WRAPPER = re.compile(r"[A-Za-z_]\w*\(|\)")


@functools.lru_cache(maxsize=4096)
def canonical_name_stack(name_stack: str) -> str:
    """`name_stack` without transformation wrappers: the scopes alone, "/"-separated.

    Differentiation wraps a name stack's first component
    (``transpose(jvp(block))/jaxamp_policy...``), so the forward and
    backward equations of one scope differ as strings; without the wrappers
    they share the scope's extent.
    """
    return _TRANSFORM_WRAPPER.sub("", name_stack)


@functools.lru_cache(maxsize=4096)
def _parse_policy_scopes(name_stack: str) -> tuple[tuple[str, ScopePolicy], ...]:
    scopes = []
    for match in _POLICY_COMPONENT.finditer(name_stack):
        compute, fp8, exit_dtype = match.groups()
        matmul_format = None if fp8 is None else "float8" if fp8 == "fp8" else fp8
        scope = ScopePolicy(np.dtype(compute), matmul_format, np.dtype(exit_dtype))
        scopes.append((canonical_name_stack(name_stack[: match.end()]), scope))
    return tuple(scopes)


def scope_policies(equation) -> tuple[tuple[str, ScopePolicy], ...]:
    """The policy scopes `equation` was traced in, outermost first.

    Each comes with its *extent*: the canonical name stack
    (`canonical_name_stack`) up to and including the scope, which the
    canonical name stack of every equation inside it starts with.
    """
    return _parse_policy_scopes(str(equation.source_info.name_stack))


def inside_extent(name_stack: str, extent: str) -> bool:
    """Whether an equation of `name_stack` lies within a policy scope's `extent`."""
    canonical = canonical_name_stack(name_stack)
    return canonical.startswith(extent) and canonical[len(extent) : len(extent) + 1] in ("", "/")


def equation_context(equation) -> contextlib.AbstractContextManager:
    """Re-enters `equation`'s name scopes and source location while its rule runs.

    So the rewritten jaxpr keeps the names the traced one had: profiles and
    compiled programs keep the model's layer names, errors point at the
    user's line, and a `float32_scope` survives a second rewrite. JAX has no
    public API for this, so it is the one place autocast imports from
    ``jax._src``; without it the names are dropped and nothing else changes.
    """
    if _user_context is None:
        return contextlib.nullcontext()
    return _user_context(equation.source_info.traceback, name_stack=equation.source_info.name_stack)
