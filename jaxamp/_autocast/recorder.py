"""Recording overflows while `autocast` rewrites a program: what `record_overflow` adds to it.

Opt-in, through an *overflow session* (`overflow_session`), which
`jaxamp.scaled_value_and_grad(..., record_overflow=True)` and
`jaxamp.diagnostics.record_overflow` open around the function they run.
Every `autocast` (or `apply_policy`) call inside the session is rewritten
with a `Recorder`, which adds to each matmul and convolution it runs
(a *site*), in program order:

```python
lhs, rhs = tap(lhs, probe[i, 0]), tap(rhs, probe[i, 1])  # identity forward
out = tap(the op under its rule, probe[i, 2])
forward_amax[i] = max(abs(out))
# backward: tap's derivative passes the cotangent on unchanged and gives
# max(abs(cotangent)) as the derivative of its probe slot
```

so a site's backward amax covers the cotangent it receives (its output's)
and the two it gives (the outputs of its backward matmuls). The probe is a
zero-valued float32 input of shape ``(sites, 3)`` that the
session makes an argument of the differentiated function, so the backward
amaxes leave the step as the probe's gradient (no host callback, no
effect), and the forward amaxes as an extra output. Nothing changes when no
session is open.

The sites are the matmuls and convolutions of the traced program and of
the nested ``jit`` bodies in it, which a recording rewrite inlines. Those
inside loops, conditionals, ``jax.checkpoint`` blocks and custom derivative
rules are not watched (their values cannot leave those bodies without
changing them); the record counts them as ``unrecorded``.
"""

from __future__ import annotations

import contextlib
import contextvars
import re
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jaxamp._autocast.primitives import subjaxprs
from jaxamp._autocast.rules import is_floating
from jaxamp._autocast.scope import canonical_name_stack
from jaxamp._scaling.overflow import OverflowSite, amax

try:
    from jax._src import source_info_util as _source_info_util
except ImportError:  # pragma: no cover - a JAX release that moved it
    _source_info_util = None

try:  # the tracers of an enclosing jax.grad (JVP, or linearize from JAX 0.5 on)
    from jax._src.interpreters.ad import JVPTracer as _JVPTracer
    from jax._src.interpreters.ad import LinearizeTracer as _LinearizeTracer

    _DIFFERENTIATED_TRACERS: tuple = (_JVPTracer, _LinearizeTracer)
except ImportError:  # pragma: no cover - a JAX release that moved them: every input counts
    _DIFFERENTIATED_TRACERS = ()

SITE_PRIMITIVES = frozenset({"dot_general", "conv_general_dilated"})
"""The primitives a record watches."""

_POLICY_WRAPPER = re.compile(r"^PolicyModule/PolicyModule\.\w+/module(/|$)")

INLINED_CALLS = frozenset({"pjit", "jit", "closed_call", "core_call"})
"""Nested calls whose bodies a recording rewrite inlines, so their sites are watched."""


@jax.custom_vjp
def _tap(value: jax.Array, slot: jax.Array) -> jax.Array:
    """`value` unchanged; the derivative of `slot` is the largest magnitude of `value`'s cotangent."""
    del slot
    return value


def _tap_forward(value, slot):
    del slot
    return value, None


def _tap_backward(_, cotangent):
    return cotangent, amax(cotangent)


_tap.defvjp(_tap_forward, _tap_backward)


def differentiated_leaves(leaves: Sequence[Any]) -> tuple[bool, ...]:
    """Per leaf of an `autocast` call, whether an enclosing ``jax.grad`` differentiates it.

    A recording rewrite taps no operand that is an input nobody differentiates
    (the data): its cotangent would be computed for the tap alone (the first
    layer's input gradient, a whole matmul). Where JAX's tracer classes
    cannot be read, every leaf counts as differentiated (each operand is
    tapped).
    """
    if not _DIFFERENTIATED_TRACERS:
        return (True,) * len(leaves)
    return tuple(isinstance(leaf, _DIFFERENTIATED_TRACERS) for leaf in leaves)


class Recorder:
    """Taps and amaxes of the sites of one recording rewrite (see the module docstring).

    Args:
        probe: the rewrite's probe rows.
        constant_inputs: the rewrite's inputs that nobody differentiates;
            an operand that is one of them is not tapped.
    """

    def __init__(self, probe: jax.Array, constant_inputs: Sequence[Any] = ()):
        self.probe = probe
        self._constant_inputs = {id(value) for value in constant_inputs}
        self.sites: list[OverflowSite] = []
        self.forward: list[jax.Array] = []
        self._prefixes: list[str] = []
        self._seen: dict[str, int] = {}

    def tap_operands(self, invals: Sequence[Any]) -> list:
        """The operands of the next site, tapped for the backward pass."""
        index = len(self.sites)
        return [
            _tap(value, self.probe[index, slot])
            if slot < 2 and _is_traced_floating(value) and id(value) not in self._constant_inputs
            else value
            for slot, value in enumerate(invals)
        ]

    def record(self, equation, output: Any) -> Any:
        """Adds the site `equation` made, whose (first) output is `output`; returns it tapped."""
        name = self._name(equation)
        self._seen[name] = self._seen.get(name, 0) + 1
        if self._seen[name] > 1:  # a module or a line with several matmuls: numbered from the second
            name = f"{name} [{self._seen[name]}]"
        self.sites.append(
            OverflowSite(
                name=name,
                source=source_line(equation),
                primitive=equation.primitive.name,
                dtype=str(output.dtype),
                shape=tuple(output.shape),
            )
        )
        self.forward.append(amax(output))
        return _tap(output, self.probe[len(self.sites) - 1, 2]) if _is_traced_floating(output) else output

    def forward_amax(self) -> jax.Array:
        return jnp.stack(self.forward) if self.forward else jnp.zeros([0], jnp.float32)

    @contextlib.contextmanager
    def inlined(self, equation) -> Iterator[None]:
        """While a nested call's body is inlined: its sites are named under the call's scopes."""
        self._prefixes.append(str(equation.source_info.name_stack))
        try:
            yield
        finally:
            self._prefixes.pop()

    def _name(self, equation) -> str:
        stacks = [*self._prefixes, str(equation.source_info.name_stack)]
        path = "/".join(
            component
            for stack in stacks
            for component in canonical_name_stack(stack).split("/")
            if component and not component.startswith("jaxamp_")
        )
        # jaxamp.apply_policy's wrapper around a linen model: the path inside it is the params'.
        path = _POLICY_WRAPPER.sub("", path)
        return path or source_line(equation)


def _is_traced_floating(value: Any) -> bool:
    return isinstance(value, jax.Array) and is_floating(value.dtype)


_RECORDER: contextvars.ContextVar[Recorder | None] = contextvars.ContextVar("jaxamp_recorder", default=None)


def active_recorder() -> Recorder | None:
    """The recorder of the rewrite being traced at this level, or None."""
    return _RECORDER.get()


@contextlib.contextmanager
def recording(recorder: Recorder | None) -> Iterator[None]:
    """Runs the rewrite inside with `recorder` (None: a nested body's rewrite, which records nothing)."""
    token = _RECORDER.set(recorder)
    try:
        yield
    finally:
        _RECORDER.reset(token)


def count_sites(jaxpr) -> tuple[int, int]:
    """``(watched, unrecorded)``: the sites of `jaxpr` and its nested ``jit`` bodies, and the
    matmuls and convolutions inside other bodies (loops, conditionals, checkpoints, custom rules)."""
    watched = unrecorded = 0
    for equation in jaxpr.eqns:
        name = equation.primitive.name
        if name in SITE_PRIMITIVES:
            watched += 1
        for body in subjaxprs(equation.params):
            inner_watched, inner_unrecorded = count_sites(getattr(body, "jaxpr", body))
            if name in INLINED_CALLS:
                watched, unrecorded = watched + inner_watched, unrecorded + inner_unrecorded
            else:
                unrecorded += inner_watched + inner_unrecorded
    return watched, unrecorded


def source_line(equation) -> str:
    """The user's source line of `equation`: ``file.py:41 (function)``, outside JAX and libraries."""
    if _source_info_util is None:
        return "unknown source line"
    traceback = equation.source_info.traceback
    try:
        frames = list(_source_info_util.user_frames(traceback))
    except Exception:  # noqa: BLE001 (a JAX release with another signature: fall back to the summary)
        return _source_info_util.summarize(equation.source_info)
    own = [
        frame
        for frame in frames
        if "site-packages" not in frame.file_name and "/jaxamp/" not in frame.file_name
    ]
    frame = (own or frames or [None])[0]
    if frame is None:
        return _source_info_util.summarize(equation.source_info)
    file_name = frame.file_name.rsplit("/", 1)[-1]
    return f"{file_name}:{frame.start_line} ({frame.function_name})"
