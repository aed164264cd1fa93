"""Stop a run whose loss scale is stuck, instead of training on skipped steps.

A float16 run can fall into an overflow storm: every step overflows, every
step is skipped, the dynamic loss scale halves down to its floor and stays
there, and the run goes on for hours without learning anything (DeepSpeed
stops such a run with "Current loss scale already at minimum"). The counters
that tell are already in the state, in its loss scale: every jaxamp loss
scale counts ``skipped_steps`` and ``consecutive_skipped_steps``
(`jaxamp._scaling.loss_scale.CountsSkippedSteps`, the one definition of a skipped
step that `jaxamp.TrainState` and `jaxamp.loss_scaling` read too), and a
`DynamicLossScale` has ``loss_scale`` and ``min_loss_scale``.

`OverflowGuard.check` reads them on the host, at the points where a training
loop logs anyway (every few hundred steps, at a checkpoint, at an epoch's
end), so the jitted step gains no host sync. It raises `LossScaleStuckError`
when either limit is reached:

```python
consecutive = loss_scale.consecutive_skipped_steps
if max_consecutive_skips and consecutive >= max_consecutive_skips:
    raise LossScaleStuckError            # a storm, whatever the scale
if (max_overflows_at_min_scale and loss_scale <= min_loss_scale
        and consecutive >= max_overflows_at_min_scale):
    raise LossScaleStuckError            # nothing left to back off to
```

Both limits are off (None) unless asked for. The count is exact for every
loss scale, however far apart the checks are, and the guard keeps no state
of its own: a run resumed from a checkpoint (which holds the loss scale)
carries on with the counts it had.

Examples:
    >>> guard = jaxamp.OverflowGuard(max_consecutive_skips=50)
    >>> for step, batch in enumerate(batches):
    ...     state = train_step(state, batch)
    ...     if step % 100 == 0:
    ...         guard.check(state)   # a TrainState, or a jaxamp.loss_scaling optimizer state
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
from flax import nnx

from jaxamp._policy import is_floating_array
from jaxamp._scaling.loss_scaling import scaling_state_of
from jaxamp._scaling.nonfinite import (
    NonFiniteGradients,
    deepest_layers,
    host_value,
    layer_of,
    layer_order_key,
    leaf_path,
)


class LossScaleStuckError(RuntimeError):
    """The loss scale is stuck: steps keep overflowing and being skipped.

    The message names, from the state's records of the last skipped step,
    the layer where its non-finite gradients start (the deepest one whose
    gradients are not finite, by the order of the names:
    `jaxamp.diagnostics.NonFiniteGradients.deepest_layers`) and its leaves
    from there back; or says that the names do not tell which layer is
    deepest. A state that keeps an `jaxamp.diagnostics.OverflowRecord`
    (``apply_gradients(overflow_record=...)``) adds the first op that
    overflowed; without one, the message says that ``record_overflow=True``
    names it.

    Attributes:
        steps: steps taken so far, applied and skipped; None when the checked
            state does not count applied steps (an optimizer state).
        applied_steps: steps whose update was applied (``TrainState.step``),
            or None.
        skipped_steps: steps skipped in all.
        consecutive_skipped_steps: steps skipped in a row up to now.
        loss_scale: the current loss scale.
        min_loss_scale: the loss scale's floor, or None if it has none.
        reason: which limit fired, in words.
        nonfinite_paths: the gradient leaves that were not finite in the
            last skipped step (`jaxamp.diagnostics.NonFiniteGradients`), or
            None when the state keeps no such record.
        deepest_layers: where those non-finite gradients start: one layer, or
            several when the names do not tell which is deepest; None when
            the state keeps no such record.
        first_overflow: the first op that overflowed in the last skipped
            step, as `jaxamp.diagnostics.FirstOverflow` writes it, or None
            when the state keeps no overflow record or it names none.
        nonfinite_params: the param leaves that hold an inf or a NaN when
            the guard checks, or None when it had no params to read. Any
            there means an applied step wrote them (the optimizer's update):
            every gradient since is NaN whatever the scale, and the message
            says so instead of blaming an overflow.
    """

    def __init__(
        self,
        *,
        applied_steps: int | None,
        skipped_steps: int,
        consecutive_skipped_steps: int,
        loss_scale: float,
        min_loss_scale: float | None,
        reason: str,
        nonfinite_paths: list[str] | None = None,
        first_overflow: str | None = None,
        nonfinite_params: list[str] | None = None,
    ):
        self.applied_steps = applied_steps
        self.skipped_steps = skipped_steps
        self.steps = None if applied_steps is None else applied_steps + skipped_steps
        self.consecutive_skipped_steps = consecutive_skipped_steps
        self.loss_scale = loss_scale
        self.min_loss_scale = min_loss_scale
        self.reason = reason
        self.nonfinite_paths = nonfinite_paths
        self.deepest_layers = None if nonfinite_paths is None else deepest_layers(nonfinite_paths)
        self.first_overflow = first_overflow
        self.nonfinite_params = nonfinite_params
        floor = "" if min_loss_scale is None else f" (its minimum is {min_loss_scale:g})"
        counts = f"{skipped_steps} skipped in all, the last {consecutive_skipped_steps} in a row"
        where = (
            f"With {counts},"
            if applied_steps is None
            else f"At step {self.steps} ({applied_steps} applied, {counts})"
        )
        layer = "the layer that overflows"
        if self.deepest_layers and len(self.deepest_layers) == 1:
            layer = f"{self.deepest_layers[0]} or the layer after it"
        record = (
            f" The last skipped step's first overflow: {first_overflow}."
            if first_overflow
            else " record_overflow=True in jaxamp.scaled_value_and_grad names the op that overflowed first "
            "and its pass (forward or backward)."
        )
        if nonfinite_params:
            super().__init__(
                f"Loss scale stuck: {reason}. {where} the loss scale is {loss_scale:g}{floor}. The params "
                f"are not finite ({_first_leaves(nonfinite_params)}): an applied step wrote them, so every "
                "gradient since is NaN whatever the scale, and no forward or backward pass overflowed. Look "
                "at the optimizer's update: float16 or bfloat16 params need it computed in float32 "
                "(jaxamp.low_precision_optimizer), and too large a learning rate diverges. The guide 'Why "
                "was my step skipped?' says what each finding means."
            )
            return
        super().__init__(
            f"Loss scale stuck: {reason}. {where} the loss scale is {loss_scale:g}{floor}."
            f"{_where_nonfinite(nonfinite_paths or [], self.deepest_layers or [])} The gradients overflow "
            f"whatever the scale: try a float32 override for {layer}, a bfloat16 policy, a lower learning "
            f"rate or a static loss scale, and look for inf or NaN in the inputs.{record} The guide "
            "'Why was my step skipped?' says what each finding means."
        )


def _first_leaves(paths: list[str], shown: int = 4) -> str:
    more = len(paths) - shown
    return f"{len(paths)} leaves: " + ", ".join(paths[:shown]) + (f" and {more} more" if more > 0 else "")


def _where_nonfinite(nonfinite_paths: list[str], deepest: list[str], shown: int = 4) -> str:
    """Where the non-finite gradients start, and their first `shown` leaves from there back."""
    if not nonfinite_paths:
        return ""
    from_deepest = sorted(nonfinite_paths, key=lambda path: layer_order_key(layer_of(path)), reverse=True)
    from_deepest.sort(key=lambda path: layer_of(path) not in deepest)
    more = len(from_deepest) - shown
    leaves = ", ".join(from_deepest[:shown]) + (f" and {more} more" if more > 0 else "")
    count = f"{len(nonfinite_paths)} leaves"
    if len(deepest) == 1:
        return (
            f" The last skipped step's non-finite gradients start at {deepest[0]}: the deepest layer whose "
            "gradients are not finite (by the order of the names, no layer after it has one), so the "
            f"overflow is in its backward pass or in the op after it. {count}, from there back: {leaves}."
        )
    return (
        f" The last skipped step's non-finite gradients: {count}; the names do not tell which of "
        f"{', '.join(deepest)} runs last, so where they start: {leaves}."
    )


@dataclasses.dataclass(frozen=True)
class OverflowGuard:
    """Raises `LossScaleStuckError` when a run's loss scale is stuck.

    A host-side monitor, called outside ``jit`` (see the module docstring for
    the algorithm). It reads the loss scale's skip counters and keeps nothing
    between checks, so one guard may check any number of states.

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

    def __post_init__(self):
        for name in ("max_consecutive_skips", "max_overflows_at_min_scale"):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
                raise ValueError(
                    f"OverflowGuard {name} must be None or an integer >= 0 (0 turns it off); got {value!r}."
                )

    def check(self, state: Any, *, params: Any = None) -> None:
        """Reads the state's counters on the host; raises if the scale is stuck.

        When it raises, it reads the params too (``state.params``, or
        `params`): non-finite params, written by an applied step, are
        reported as that, not as an overflow.

        Args:
            state: a `jaxamp.TrainState` (or anything with ``step`` and a
                jaxamp ``loss_scale``), a `jaxamp.NNXOptimizer`, or an
                optimizer state built by `jaxamp.loss_scaling`.
            params: the params, where `state` holds none (an NNX model's:
                ``nnx.state(model, nnx.Param)``).

        Raises:
            LossScaleStuckError: a limit was reached.
            TypeError: `state` holds no loss scale with skip counters.
        """
        loss_scale, applied, nonfinite_grads, overflow_record = _counters_of(state)
        skipped = int(host_value(loss_scale.skipped_steps))
        consecutive = int(host_value(loss_scale.consecutive_skipped_steps))
        scale = float(host_value(loss_scale.loss_scale))
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
            nonfinite_params = _nonfinite_leaves(getattr(state, "params", None) if params is None else params)
            if nonfinite_params:
                reason = reason.replace("overflowed", "were skipped")
            raise LossScaleStuckError(
                applied_steps=applied,
                skipped_steps=skipped,
                consecutive_skipped_steps=consecutive,
                loss_scale=scale,
                min_loss_scale=floor,
                reason=reason,
                nonfinite_paths=None if nonfinite_grads is None else nonfinite_grads.nonfinite_paths(),
                first_overflow=_first_overflow(overflow_record),
                nonfinite_params=nonfinite_params,
            )


def _nonfinite_leaves(params: Any) -> list[str] | None:
    """The paths of the floating leaves of `params` holding an inf or a NaN (host); None without params."""
    if params is None:
        return None
    is_variable = lambda node: isinstance(node, nnx.Variable)  # noqa: E731
    leaves = jax.tree_util.tree_leaves_with_path(params, is_leaf=is_variable)
    values = [(path, leaf.get_value() if is_variable(leaf) else leaf) for path, leaf in leaves]
    return [
        leaf_path(path)
        for path, value in values
        if is_floating_array(value) and not np.isfinite(host_value(value).astype(np.float32)).all()
    ]


def _first_overflow(record: Any) -> str | None:
    """The first overflow a kept `jaxamp.diagnostics.OverflowRecord` names, as text; None if none."""
    first = None if record is None else record.first_overflow()
    return None if first is None else str(first)


def _counters_of(state: Any) -> tuple[Any, int | None, NonFiniteGradients | None, Any]:
    """The loss scale a state holds, its applied steps (None if it counts none), its record of
    non-finite gradient leaves and its overflow record (each None if it keeps none)."""
    overflow_record = None
    if hasattr(state, "step") and hasattr(state, "loss_scale"):
        loss_scale, applied = state.loss_scale, int(host_value(state.step))
        nonfinite_grads = getattr(state, "nonfinite_grads", None)
        overflow_record = getattr(state, "overflow_record", None)
    else:
        try:
            scaling_state = scaling_state_of(state, "OverflowGuard.check")
        except ValueError:
            raise TypeError(
                "OverflowGuard.check needs a train state with step, skipped_steps and loss_scale "
                f"(a jaxamp.TrainState) or a jaxamp.loss_scaling optimizer state; got "
                f"{type(state).__name__}."
            ) from None
        loss_scale, applied = scaling_state.loss_scale, None
        nonfinite_grads = scaling_state.nonfinite_grads
    if not hasattr(loss_scale, "consecutive_skipped_steps"):
        raise TypeError(
            f"OverflowGuard.check needs a jaxamp loss scale, which counts skipped steps; the state "
            f"holds {type(loss_scale).__name__}."
        )
    return loss_scale, applied, nonfinite_grads, overflow_record
