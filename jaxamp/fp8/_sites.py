"""The carrier of FP8 delayed scaling: amaxes into each FP8 matmul, and out of the step by a probe.

One job: while a function runs under `delayed_scaling`, hand each FP8 site
(each `jaxamp.fp8_dot_general` or FP8 convolution, in the order they are
traced) its row of the history's amaxes (its scales) and its row of a
zero-valued *probe*. The site's custom VJP gives, as the derivative of its
probe row, the amaxes of the tensors it quantized:

```text
row i = sites.take(1)                    # (amax_in[i], probe[i]), in trace order
forward:  q_lhs, amax_lhs = quantize(lhs, scale from amax_in[i, 0])   # scale known first
          q_rhs, amax_rhs = quantize(rhs, scale from amax_in[i, 1])
backward: q_g,   amax_g   = quantize(g,   scale from amax_in[i, 2])
          d probe[i] = (amax_lhs, amax_rhs, amax_g)
```

So every amax, forward and backward, leaves the step as the probe's
gradient, as the overflow recorder's backward amaxes do
(`jaxamp._autocast.recorder`): no host callback, no effect. With no
amaxes in (``amax=None``: the history is empty) the sites use current
scaling and still send their amaxes out. Inside `jaxamp.autocast` the
rewrite takes a block of rows per call (one per matmul and convolution it
could run in FP8) and passes them in as inputs of the rewritten program,
so the rewrite stays cached; matmuls inside loops, conditionals, checkpoints
and custom derivative rules keep current scaling (their amaxes cannot leave
those bodies).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import jax
import jax.numpy as jnp

SLOTS = 3
"""Columns of a row: the lhs, the rhs and the cotangent of one FP8 site."""


class Fp8Sites:
    """The amax and probe rows of the FP8 sites of one traced call (see the module docstring).

    Args:
        amax: float32 ``(rows, 3)``, the amaxes the sites scale by, or None
            for current scaling.
        probe: the zero-valued float32 ``(rows, 3)`` whose gradient receives
            the amaxes, or None to count the sites (every take gets zeros).
    """

    def __init__(self, amax: jax.Array | None, probe: jax.Array | None):
        if probe is not None and amax is not None and amax.shape != probe.shape:
            raise ValueError(
                f"FP8 sites need amax and probe of one shape; got {amax.shape} and {probe.shape}."
            )
        self.amax = amax
        self.probe = probe
        self.size = 0

    @property
    def current_scaling(self) -> bool:
        """Whether the sites scale by the amax of the tensor now (no history yet)."""
        return self.amax is None

    def take(self, rows: int) -> tuple[jax.Array | None, jax.Array]:
        """The amax rows (None under current scaling) and probe rows of the next `rows` sites."""
        start, self.size = self.size, self.size + rows
        if self.probe is None:
            zeros = jnp.zeros([rows, SLOTS], jnp.float32)
            return (None if self.amax is None else zeros), zeros
        if self.size > self.probe.shape[0]:
            raise RuntimeError(
                f"FP8 delayed scaling: the function ran more FP8 sites ({self.size} so far) than its history "
                f"has rows ({self.probe.shape[0]}). Size the history with jaxamp.fp8.init_fp8_history on the "
                "same function and arguments; it must trace the same matmuls every time."
            )
        amax = None if self.amax is None else self.amax[start : self.size]
        return amax, self.probe[start : self.size]


_SITES: contextvars.ContextVar[Fp8Sites | None] = contextvars.ContextVar("jaxamp_fp8_sites", default=None)


def current_fp8_sites() -> Fp8Sites | None:
    """The FP8 sites open here, or None (current scaling, no amaxes out)."""
    return _SITES.get()


@contextlib.contextmanager
def fp8_sites(sites: Fp8Sites | None) -> Iterator[Fp8Sites | None]:
    """Runs the code inside with `sites` (None: no delayed scaling inside)."""
    token = _SITES.set(sites)
    try:
        yield sites
    finally:
        _SITES.reset(token)
