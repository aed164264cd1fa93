"""The float32 opt-out: code that `jaxamp.autocast` leaves in its traced dtypes."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator

import jax

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

    Example:
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
