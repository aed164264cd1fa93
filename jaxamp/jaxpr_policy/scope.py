"""The float32 opt-out: code that `jaxamp.autocast` leaves in its traced dtypes."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator

import jax

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
    """Keeps the operations traced inside it in their own dtypes under `jaxamp.autocast`.

    For the layer that a user knows must stay in float32 (a loss with large
    intermediate values, a hand-written normalization). The scope is a
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
