"""The sites of a rewrite: the matmuls and convolutions that a probe's client watches, counted and named.

While a client of the probe is open around an `autocast` call (the overflow
record, FP8 delayed scaling: `jaxamp._probe`), the rewrite gives the client
a block of probe rows, one per site, and calls its hooks at each site. The
sites are the matmuls and convolutions of the traced program and of the
nested ``jit`` bodies in it, which such a rewrite inlines; those inside
loops, conditionals, ``jax.checkpoint`` blocks and custom derivative rules
are not watched (their values cannot leave those bodies without changing
them), and `count_sites` counts them as unrecorded.

A site is named by its path in the name stack: the Flax module path
(linen's ``MLP/Dense_2``; an NNX layer's attribute path ``blocks/0/attn``,
which `jaxamp.apply_policy` puts there), the ``jax.named_scope``s around it;
where the name stack holds none (plain JAX, an NNX model through `autocast`
alone), its source line. A second site of one name is numbered
(``Attention [2]``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections.abc import Iterator

from jaxamp._autocast.primitives import subjaxprs
from jaxamp._autocast.scope import canonical_name_stack

try:
    from jax._src import source_info_util as _source_info_util
except ImportError:  # pragma: no cover - a JAX release that moved it
    _source_info_util = None

SITE_PRIMITIVES = frozenset({"dot_general", "conv_general_dilated"})
"""The primitives a client watches."""

INLINED_CALLS = frozenset({"pjit", "jit", "closed_call", "core_call"})
"""Nested calls whose bodies a rewrite with a client inlines, so their sites are watched."""

# jaxamp.apply_policy's wrapper around a linen model: the path inside it is the params'.
_POLICY_WRAPPER = re.compile(r"^PolicyModule/PolicyModule\.\w+/module(/|$)")


@dataclasses.dataclass(frozen=True)
class Site:
    """One matmul or convolution a client watches: its name, its user's source line, its primitive."""

    name: str
    source: str
    primitive: str


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


class Naming:
    """Names the sites of one rewrite in order (see the module docstring)."""

    def __init__(self):
        self._prefixes: list[str] = []
        self._seen: dict[str, int] = {}

    def site(self, equation) -> Site:
        """The next site, `equation`."""
        stacks = [*self._prefixes, str(equation.source_info.name_stack)]
        path = "/".join(
            component
            for stack in stacks
            for component in canonical_name_stack(stack).split("/")
            if component and not component.startswith("jaxamp_")
        )
        name = _POLICY_WRAPPER.sub("", path) or source_line(equation)
        self._seen[name] = self._seen.get(name, 0) + 1
        if self._seen[name] > 1:
            name = f"{name} [{self._seen[name]}]"
        return Site(name, source_line(equation), equation.primitive.name)

    @contextlib.contextmanager
    def inlined(self, equation) -> Iterator[None]:
        """While a nested call's body is inlined: its sites are named under the call's scopes."""
        self._prefixes.append(str(equation.source_info.name_stack))
        try:
            yield
        finally:
            self._prefixes.pop()


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
