"""The amax history of FP8 delayed scaling: an immutable pytree the train step carries.

One job: remember the recent amaxes (largest magnitudes) of the tensors that
FP8 matmuls quantize, and reduce them to the amax the next step scales by,
as NVIDIA TransformerEngine's ``DelayedScaling`` recipe does:

```text
history:  float32 (rows, 3, length); row = one FP8 site (a matmul), column =
          lhs, rhs, cotangent; history[..., 0] the newest amax
amax():   reduce(history, "max" over the window | "most_recent")  * 2**margin
record(amaxes, keep):                     # once per step, after the step
    if keep and all(isfinite(amaxes)):
        history = concat(amaxes[..., None], history[..., :-1])   # newest in, oldest out
    else:
        history unchanged                 # a non-finite amax never enters
    recorded = True
```

Until the first step is recorded (``recorded`` is False, a static field) the
FP8 sites use current scaling (the amax of the tensor now), so no step runs
with a made-up scale. ``recorded`` is static, so the first step and the
later ones are two programs under ``jax.jit`` (it retraces once); a history
carried through ``lax.scan`` must be recorded once before the loop.
A row whose history holds only zeros (its tensor was all zeros, or the
first step was skipped) scales by 1, TransformerEngine's rule.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp
from flax import struct

from jaxamp.fp8_sites import SLOTS

REDUCTIONS = ("max", "most_recent")
"""How `Fp8History.amax` reduces a row's window (TransformerEngine's ``amax_compute_algo``)."""

DEFAULT_LENGTH = 1024
"""TransformerEngine's default ``amax_history_len``."""


class Fp8History(struct.PyTreeNode):
    """Amax histories of the FP8 sites of a step, for delayed scaling (see the module docstring).

    Attributes:
        amax_history: float32 ``(rows, 3, length)``, newest amax first.
        recorded: whether a step has been recorded; before it, current scaling.
        reduction: ``"max"`` (the largest amax in the window, the default) or
            ``"most_recent"``.
        margin: the scale is divided by ``2**margin`` (headroom above the amax).

    Examples:
        >>> history = jaxamp.fp8.Fp8History.create(rows=2, length=4)
        >>> history.amax_history.shape
        (2, 3, 4)
    """

    amax_history: jax.Array
    recorded: bool = struct.field(pytree_node=False, default=False)
    reduction: str = struct.field(pytree_node=False, default="max")
    margin: int = struct.field(pytree_node=False, default=0)

    @classmethod
    def create(
        cls,
        rows: int,
        length: int = DEFAULT_LENGTH,
        reduction: Literal["max", "most_recent"] = "max",
        margin: int = 0,
    ) -> Fp8History:
        """An empty history of `rows` FP8 sites (TransformerEngine's defaults: 1024, "max", 0).

        Raises:
            ValueError: `rows` is negative, `length` below 1, or `reduction` unknown.
        """
        if reduction not in REDUCTIONS:
            raise ValueError(f"Unknown amax reduction {reduction!r}; valid: {', '.join(REDUCTIONS)}.")
        if int(length) < 1 or int(rows) < 0:
            raise ValueError(
                f"An FP8 history needs length >= 1 and rows >= 0; got length {length}, rows {rows}."
            )
        return cls(jnp.zeros((int(rows), SLOTS, int(length)), jnp.float32), False, reduction, int(margin))

    @property
    def rows(self) -> int:
        """How many FP8 sites the history has rows for."""
        return self.amax_history.shape[0]

    def amax(self) -> jax.Array:
        """Per row and column, the amax the next step scales by: float32 ``(rows, 3)``."""
        if self.reduction == "max":
            reduced = jnp.max(self.amax_history, axis=-1)
        else:
            reduced = self.amax_history[..., 0]
        return reduced * jnp.float32(2.0**self.margin)

    def record(self, amaxes: jax.Array, keep: jax.Array | bool = True) -> Fp8History:
        """The history with `amaxes` (``(rows, 3)``) as its newest entry, unless the step is not kept.

        Args:
            amaxes: the step's amaxes, one per row and column.
            keep: whether the step counts (its gradients were finite); a step
                not kept, or with a non-finite amax, leaves the window as it was.

        Raises:
            ValueError: `amaxes` is not ``(rows, 3)``.
        """
        if amaxes.shape != self.amax_history.shape[:-1]:
            raise ValueError(
                f"Fp8History.record needs amaxes of shape {self.amax_history.shape[:-1]} (rows, "
                f"lhs/rhs/cotangent); got {amaxes.shape}."
            )
        amaxes = amaxes.astype(jnp.float32)
        rolled = jnp.concatenate([amaxes[..., None], self.amax_history[..., :-1]], axis=-1)
        enters = jnp.logical_and(keep, jnp.all(jnp.isfinite(amaxes)))
        return self.replace(amax_history=jnp.where(enters, rolled, self.amax_history), recorded=True)
