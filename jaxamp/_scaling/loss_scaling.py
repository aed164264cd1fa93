"""Loss scaling around any optax optimizer: the whole-step skip for every framework.

`loss_scaling(inner, loss_scale)` wraps an optax `GradientTransformation`, as
Keras' ``LossScaleOptimizer`` wraps an optimizer: the loss scale (and with it
the skip counters, see `jaxamp._scaling.loss_scale.CountsSkippedSteps`) lives in the
optimizer state, and a step whose gradients are not finite changes neither
the params nor the inner optimizer's state. It needs no Flax: Equinox, Haiku
and plain JAX train steps get the same skip as `jaxamp.TrainState`, which is
a thin layer over it.

Examples:
    >>> tx = jaxamp.loss_scaling(optax.adam(1e-3), jaxamp.DynamicLossScale())
    >>> opt_state = tx.init(params)
    >>> loss, grads, grads_finite = jaxamp.scaled_value_and_grad(
    ...     loss_fn, jaxamp.loss_scale_of(opt_state))(params, batch)
    >>> updates, opt_state = tx.update(grads, opt_state, params, grads_finite=grads_finite)
    >>> params = optax.apply_updates(params, updates)
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxamp._finite import every, leaf_finite_flags, select_tree
from jaxamp._scaling.loss_scale import LossScale
from jaxamp._scaling.nonfinite import NonFiniteGradients


class LossScalingState(NamedTuple):
    """The optimizer state of `loss_scaling`.

    Attributes:
        loss_scale: the loss scale for the next step. It holds the skip
            counters (``loss_scale.skipped_steps``,
            ``loss_scale.consecutive_skipped_steps``), the only ones there are.
        inner_state: the wrapped optimizer's state, as it was after the last
            step whose gradients were finite.
        nonfinite_grads: which gradient leaves were not finite in the last
            skipped step, and its index (`jaxamp.diagnostics.NonFiniteGradients`;
            ``.summary()`` names them); None in a state built by hand.
    """

    loss_scale: LossScale
    inner_state: optax.OptState
    nonfinite_grads: NonFiniteGradients | None = None


def require_skip_counting(loss_scale: Any, caller: str) -> None:
    """Raises TypeError unless `loss_scale` is a loss scale that counts skipped steps."""
    missing = [
        name
        for name in ("loss_scale", "scale", "unscale", "adjust", "skipped_steps", "consecutive_skipped_steps")
        if not hasattr(loss_scale, name)
    ]
    if missing:
        raise TypeError(
            f"{caller} needs a jaxamp loss scale (NoOpLossScale, StaticLossScale or "
            f"DynamicLossScale), which counts skipped steps; got {loss_scale!r}, which has no "
            f"{', '.join(missing)}. For a jmp loss scale pass the jaxamp one of the same "
            "settings, e.g. jaxamp.DynamicLossScale(scale.loss_scale, period=scale.period)."
        )


def loss_scaling(
    inner: optax.GradientTransformation, loss_scale: LossScale
) -> optax.GradientTransformationExtraArgs:
    """Wraps an optax optimizer so that a step with non-finite gradients is skipped.

    ``update(grads, state, params, grads_finite=None)`` takes the *unscaled*
    gradients (from `jaxamp.scaled_value_and_grad`, with the scale
    `loss_scale_of` reads from the state) and computes:

    ```python
    leaf_finite = [all(isfinite(g)) for g in leaves(grads)]
    if grads_finite is None:
        grads_finite = all(leaf_finite)
    inner_updates, new_inner_state = inner.update(grads, inner_state, params)
    if grads_finite:
        updates, inner_state = inner_updates, new_inner_state
    else:                                    # the step is skipped
        updates = -0.0 for every leaf        # params + -0.0 is params, bit for bit
        inner_state = inner_state            # moments, step count, schedules
    loss_scale = loss_scale.adjust(grads_finite)   # backs off or grows; counts the skip
    nonfinite_grads = nonfinite_grads.after_step(leaf_finite, grads_finite)
    ```

    The last line keeps which leaves were not finite in the last skipped
    step (`jaxamp.diagnostics.NonFiniteGradients`): the per-leaf flags are
    those ``all_finite`` reduces, so XLA computes them once.

    Both outcomes are computed and one is selected with ``jnp.where``: no
    branch, no host sync, no retrace under ``jax.jit``. The state is a
    `LossScalingState` (a named tuple of pytrees), so it passes through
    ``jit``, ``jax.tree`` functions, ``lower()`` and checkpointing like any
    optax state.

    The updates of a skipped step are negative zeros rather than zeros:
    ``p + (-0.0)`` equals ``p`` bit for bit for every ``p``, while
    ``-0.0 + 0.0`` would turn a negative-zero param into ``+0.0``.

    Put `loss_scaling` outermost: around ``optax.MultiSteps`` it keeps an
    overflowed micro-batch out of the accumulator, while inside it the
    accumulator would take the ``inf``. Any other wrapper or ``chain`` may go
    inside.

    Args:
        inner: the optimizer to wrap (an optax `GradientTransformation`,
            ``optax.MultiSteps`` or anything with ``init`` and ``update``).
        loss_scale: the initial loss scale, a jaxamp loss scale
            (`NoOpLossScale`, `StaticLossScale`, `DynamicLossScale`).

    Returns:
        An optax `GradientTransformationExtraArgs`; its ``update`` accepts
        ``grads_finite=`` (a scalar bool) and passes other extra arguments on
        to `inner`.

    Raises:
        TypeError: `inner` is no optimizer, or `loss_scale` does not count
            skipped steps (a jmp loss scale, say).
    """
    if not (callable(getattr(inner, "init", None)) and callable(getattr(inner, "update", None))):
        raise TypeError(
            f"loss_scaling needs inner to be an optax optimizer (with init and update); got {inner!r}."
        )
    require_skip_counting(loss_scale, "loss_scaling")
    inner = optax.with_extra_args_support(inner)

    def init(params) -> LossScalingState:
        return LossScalingState(
            loss_scale=loss_scale,
            inner_state=inner.init(params),
            nonfinite_grads=NonFiniteGradients.for_params(params),
        )

    def update(grads, state: LossScalingState, params=None, *, grads_finite=None, **extra_args):
        leaf_finite = leaf_finite_flags(grads)
        if grads_finite is None:
            grads_finite = every(leaf_finite)
        inner_updates, new_inner_state = inner.update(grads, state.inner_state, params, **extra_args)
        skipped_updates = jax.tree.map(lambda update: jnp.full_like(update, -0.0), inner_updates)
        nonfinite_grads = state.nonfinite_grads
        if nonfinite_grads is not None:
            nonfinite_grads = nonfinite_grads.after_step(leaf_finite, grads_finite)
        return select_tree(grads_finite, inner_updates, skipped_updates), LossScalingState(
            loss_scale=state.loss_scale.adjust(grads_finite),
            inner_state=select_tree(grads_finite, new_inner_state, state.inner_state),
            nonfinite_grads=nonfinite_grads,
        )

    return optax.GradientTransformationExtraArgs(init, update)


def loss_scale_of(opt_state: Any) -> LossScale:
    """The loss scale in an optimizer state built by `loss_scaling`.

    The `LossScalingState` may sit anywhere in `opt_state`: at its root, or
    inside ``optax.chain``'s tuple or another wrapper's state.

    Examples:
        >>> loss, grads, grads_finite = jaxamp.scaled_value_and_grad(
        ...     loss_fn, jaxamp.loss_scale_of(opt_state))(params)
        >>> jaxamp.loss_scale_of(opt_state).skipped_steps   # steps skipped so far

    Args:
        opt_state: the optimizer state (``tx.init(params)`` or a later one).

    Returns:
        The loss scale for the next step, with its skip counters.

    Raises:
        ValueError: `opt_state` holds no `LossScalingState`, or more than one.
    """
    return scaling_state_of(opt_state, "loss_scale_of").loss_scale


def scaling_state_of(opt_state: Any, caller: str) -> LossScalingState:
    """The one `LossScalingState` anywhere in `opt_state` (at its root, in a chain's tuple, ...).

    Raises:
        ValueError: `opt_state` holds no `LossScalingState`, or more than one.
    """
    found = [
        node
        for node in jax.tree.leaves(opt_state, is_leaf=lambda node: isinstance(node, LossScalingState))
        if isinstance(node, LossScalingState)
    ]
    if len(found) != 1:
        raise ValueError(
            f"{caller} needs an optimizer state holding one jaxamp.loss_scaling state; this one "
            f"holds {len(found)}. Build the optimizer as jaxamp.loss_scaling(inner, loss_scale), once, "
            "and pass the state its init or update returned."
        )
    return found[0]


def nonfinite_grads_of(state: Any) -> NonFiniteGradients:
    """The record of non-finite gradient leaves a train state or optimizer state keeps.

    Examples:
        >>> print(jaxamp.diagnostics.nonfinite_grads_of(state).summary())
        step 12 skipped: non-finite grads in 3 of 8 leaves: Dense_0/bias, Dense_0/kernel, Dense_1/bias

    Args:
        state: a `jaxamp.TrainState`, a `jaxamp.NNXOptimizer`, or an
            optimizer state built by `jaxamp.loss_scaling` (anywhere inside it).

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
            f"nonfinite_grads_of needs a jaxamp.TrainState made by TrainState.create, a "
            f"jaxamp.NNXOptimizer, or a jaxamp.loss_scaling optimizer state made by its init; this "
            f"{type(state).__name__} keeps no record of non-finite gradients."
        )
    return record
