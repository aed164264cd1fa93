"""Why was a step skipped: which gradient leaves, and which op overflowed first.

Two records, both small pytrees that a jitted step keeps or returns, read
on the host:

* `NonFiniteGradients`, always kept by `jaxamp.TrainState` and
  `jaxamp.loss_scaling` (`nonfinite_grads_of` finds it in either): the
  gradient leaves that were not finite in the last skipped step;
* `OverflowRecord`, opt-in (`jaxamp.scaled_value_and_grad(...,
  record_overflow=True)`, or `record_overflow` for a forward pass): the
  largest magnitude of each matmul and convolution that `jaxamp.autocast`
  ran, forward and backward, and the first of them that overflowed.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from jaxamp.jaxpr_policy.recorder import overflow_session
from jaxamp.loss_scaling import scaling_state_of
from jaxamp.nonfinite_grads import NonFiniteGradients
from jaxamp.overflow_record import FirstOverflow, OverflowRecord, OverflowSite

__all__ = [
    "FirstOverflow",
    "NonFiniteGradients",
    "OverflowRecord",
    "OverflowSite",
    "nonfinite_grads_of",
    "record_overflow",
]


def nonfinite_grads_of(state: Any) -> NonFiniteGradients:
    """The record of non-finite gradient leaves a train state or optimizer state keeps.

    Examples:
        >>> print(jaxamp.diagnostics.nonfinite_grads_of(state).summary())
        step 12 skipped: non-finite grads in 3 of 8 leaves: Dense_0/bias, Dense_0/kernel, Dense_1/bias

    Args:
        state: a `jaxamp.TrainState`, or an optimizer state built by
            `jaxamp.loss_scaling` (anywhere inside it).

    Raises:
        TypeError: `state` keeps no such record (a state built by hand, or by
            an older jaxamp).
    """
    record = getattr(state, "nonfinite_grads", None)
    if record is None and not hasattr(state, "loss_scale"):
        try:
            record = scaling_state_of(state, "nonfinite_grads_of").nonfinite_grads
        except ValueError as error:
            raise TypeError(str(error)) from None
    if not isinstance(record, NonFiniteGradients):
        raise TypeError(
            f"nonfinite_grads_of needs a jaxamp.TrainState made by TrainState.create, or a "
            f"jaxamp.loss_scaling optimizer state made by its init; this {type(state).__name__} keeps no "
            "record of non-finite gradients."
        )
    return record


def record_overflow(fun: Callable[..., Any]) -> Callable[..., tuple[Any, OverflowRecord]]:
    """`fun`, whose autocast calls record each matmul's and convolution's forward amax.

    For a forward pass (an evaluation, a notebook): ``record_overflow(fun)(*args)``
    returns ``(fun(*args), record)``. For the backward pass too, use
    ``jaxamp.scaled_value_and_grad(loss_fn, loss_scale, record_overflow=True)``.

    Examples:
        >>> model = jaxamp.autocast(mlp, "mixed_float16")
        >>> logits, record = jaxamp.diagnostics.record_overflow(model)(params, x)
        >>> record.summary()
        'no overflow (4 matmuls and convolutions watched, forward only)'

    Args:
        fun: a function that calls `jaxamp.autocast` or `jaxamp.apply_policy`
            functions (or is one).
    """
    if not callable(fun):
        raise TypeError(f"record_overflow needs a function; got {type(fun).__name__}: {fun!r}.")

    @functools.wraps(fun)
    def recorded(*args, **kwargs):
        with overflow_session(None) as session:
            outputs = fun(*args, **kwargs)
        return outputs, OverflowRecord.concatenate(session.records)

    return recorded
