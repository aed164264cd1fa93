"""Stop a run whose loss scale is stuck, instead of training on skipped steps.

A float16 run can fall into an overflow storm: every step overflows, every
step is skipped, the dynamic loss scale halves down to its floor and stays
there, and the run goes on for hours without learning anything (DeepSpeed
stops such a run with "Current loss scale already at minimum"). The counters
that tell are already in the state: ``TrainState.skipped_steps``, and on a
`DynamicLossScale` ``consecutive_skipped_steps``, ``loss_scale`` and
``min_loss_scale``.

`OverflowGuard.check` reads them on the host, at the points where a training
loop logs anyway (every few hundred steps, at a checkpoint, at an epoch's
end), so the jitted step gains no host sync. It raises `LossScaleStuckError`
when either limit is reached::

    consecutive = the steps skipped in a row up to now
    if max_consecutive_skips and consecutive >= max_consecutive_skips:
        raise LossScaleStuckError            # a storm, whatever the scale
    if (max_overflows_at_min_scale and loss_scale <= min_loss_scale
            and consecutive >= max_overflows_at_min_scale):
        raise LossScaleStuckError            # nothing left to back off to

Both limits are off (None) unless asked for.

Loss scales without a ``consecutive_skipped_steps`` counter (`NoOpLossScale`,
`StaticLossScale`) still skip steps through ``TrainState``; for them the
guard counts a run of skips from the two state counters it saw at its
previous check: if ``step`` (which counts applied steps only) has not moved,
every step since was skipped and the run grows by the change in
``skipped_steps``; if it has moved, the run restarts at 0. That count is a
lower bound of the true one, exact when checks are one step apart, so the
guard never fires early.

Examples:
    >>> guard = jaxamp.OverflowGuard(max_consecutive_skips=50)
    >>> for step, batch in enumerate(batches):
    ...     state = train_step(state, batch)
    ...     if step % 100 == 0:
    ...         guard.check(state)   # raises LossScaleStuckError in a storm
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np


class LossScaleStuckError(RuntimeError):
    """The loss scale is stuck: steps keep overflowing and being skipped.

    Attributes:
        steps: steps taken so far, applied and skipped.
        applied_steps: steps whose update was applied (``TrainState.step``).
        skipped_steps: steps skipped in all.
        consecutive_skipped_steps: steps skipped in a row up to now.
        loss_scale: the current loss scale.
        min_loss_scale: the loss scale's floor, or None if it has none.
        reason: which limit fired, in words.
    """

    def __init__(
        self,
        *,
        applied_steps: int,
        skipped_steps: int,
        consecutive_skipped_steps: int,
        loss_scale: float,
        min_loss_scale: float | None,
        reason: str,
    ):
        self.applied_steps = applied_steps
        self.skipped_steps = skipped_steps
        self.steps = applied_steps + skipped_steps
        self.consecutive_skipped_steps = consecutive_skipped_steps
        self.loss_scale = loss_scale
        self.min_loss_scale = min_loss_scale
        self.reason = reason
        floor = "" if min_loss_scale is None else f" (its minimum is {min_loss_scale:g})"
        super().__init__(
            f"Loss scale stuck: {reason}. At step {self.steps} ({applied_steps} applied, "
            f"{skipped_steps} skipped in all, the last {consecutive_skipped_steps} in a row) "
            f"the loss scale is {loss_scale:g}{floor}. The gradients overflow whatever the "
            "scale: try a bfloat16 policy, a lower learning rate, or a static loss scale, "
            "and look for inf or NaN in the inputs."
        )


@dataclasses.dataclass
class OverflowGuard:
    """Raises `LossScaleStuckError` when a run's loss scale is stuck.

    A host-side monitor, called outside ``jit`` (see the module docstring for
    the algorithm). It keeps the counters of its previous check, so use one
    guard per run; the train state itself stays an immutable pytree.

    Args:
        max_consecutive_skips: raise once this many steps in a row were
            skipped; None or 0 turns the limit off.
        max_overflows_at_min_scale: raise once the scale sits at its
            ``min_loss_scale`` and this many steps in a row were skipped;
            None or 0 turns the limit off. Loss scales with no floor
            (static, no-op) never reach it.
    """

    max_consecutive_skips: int | None = None
    max_overflows_at_min_scale: int | None = None
    _previous: tuple[int, int] | None = dataclasses.field(default=None, init=False, repr=False)
    _inferred_run: int = dataclasses.field(default=0, init=False, repr=False)

    def __post_init__(self):
        for name in ("max_consecutive_skips", "max_overflows_at_min_scale"):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
                raise ValueError(
                    f"OverflowGuard {name} must be None or an integer >= 0 (0 turns it off); got {value!r}."
                )

    def check(self, state: Any) -> None:
        """Reads the state's counters on the host; raises if the scale is stuck.

        Args:
            state: a `jaxamp.TrainState` (or anything with ``step``,
                ``skipped_steps`` and ``loss_scale``).

        Raises:
            LossScaleStuckError: a limit was reached.
            TypeError: `state` lacks the counters.
        """
        missing = [name for name in ("step", "skipped_steps", "loss_scale") if not hasattr(state, name)]
        if missing:
            raise TypeError(
                f"OverflowGuard.check needs a train state with step, skipped_steps and loss_scale; "
                f"{type(state).__name__} has no {', '.join(missing)}. Pass a jaxamp.TrainState."
            )
        loss_scale = state.loss_scale
        applied, skipped = int(_host_value(state.step)), int(_host_value(state.skipped_steps))
        consecutive = self._consecutive_skips(loss_scale, applied, skipped)
        scale = float(_host_value(loss_scale.loss_scale))
        floor = getattr(loss_scale, "min_loss_scale", None)
        floor = None if floor is None else float(floor)

        reason = None
        if self.max_consecutive_skips and consecutive >= self.max_consecutive_skips:
            reason = f"{consecutive} steps in a row overflowed (limit {self.max_consecutive_skips})"
        elif (
            self.max_overflows_at_min_scale
            and floor is not None
            and scale <= floor
            and consecutive >= self.max_overflows_at_min_scale
        ):
            reason = (
                f"{consecutive} steps in a row overflowed with the scale at its minimum "
                f"(limit {self.max_overflows_at_min_scale})"
            )
        if reason is not None:
            raise LossScaleStuckError(
                applied_steps=applied,
                skipped_steps=skipped,
                consecutive_skipped_steps=consecutive,
                loss_scale=scale,
                min_loss_scale=floor,
                reason=reason,
            )

    def _consecutive_skips(self, loss_scale: Any, applied: int, skipped: int) -> int:
        counter = getattr(loss_scale, "consecutive_skipped_steps", None)
        if counter is not None:
            consecutive = int(_host_value(counter))
        elif self._previous is None:
            # No earlier check: a run with no applied step yet is all skips.
            consecutive = skipped if applied == 0 else 0
        else:
            previous_applied, previous_skipped = self._previous
            if applied == previous_applied:
                consecutive = self._inferred_run + (skipped - previous_skipped)
            else:
                consecutive = 0
        self._previous, self._inferred_run = (applied, skipped), consecutive
        return consecutive


def _host_value(value: Any) -> np.ndarray:
    """A scalar's value on this host, also for an array replicated across processes."""
    if isinstance(value, jax.Array) and not value.is_fully_addressable:
        return np.asarray(value.addressable_data(0))
    return np.asarray(value)
