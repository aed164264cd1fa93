"""Gradients through a loss scale."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jaxamp._finite import all_finite
from jaxamp._probe import SLOTS
from jaxamp._scaling import nnx_training
from jaxamp._scaling.loss_scale import LossScale
from jaxamp._scaling.overflow import overflow_session, with_backward


def scaled_value_and_grad(
    fun: Callable[..., Any],
    loss_scale: LossScale,
    *,
    has_aux: bool = False,
    argnums: int | Sequence[int] = 0,
    record_overflow: bool = False,
) -> Callable[..., tuple]:
    """Like `jax.value_and_grad`, through a loss scale, with a finiteness flag.

    The returned function computes:

    ```python
    loss = fun(*args)                       # or (loss, aux) with has_aux
    scaled_grads = grad(loss_scale.scale(loss))
    grads = loss_scale.unscale(scaled_grads)
    grads_finite = all_finite(grads)
    ```

    The backward pass starts from a cotangent equal to the loss scale, in the
    loss's own dtype, and carries it through the model's float16 computation,
    which is where scaling keeps small gradients from flushing to zero. The
    scaled loss value itself is never used, so casting the loss to float32
    before scaling would change nothing; but a float16 *loss* overflows that
    first cotangent for any scale above 65504 (float16's largest value). Return
    the loss in float32, as a policy with a float32 output dtype does.

    An argument that is a Flax NNX module is differentiated as by
    ``nnx.value_and_grad``: its ``nnx.Param`` variables, whose gradients come
    as an ``nnx.State``. What `fun` changes in the module (batch statistics,
    RNG counts) is written back only where `grads_finite` is true, so with
    `jaxamp.NNXOptimizer` a skipped step leaves the model as it was.

    Args:
        fun: the loss function; returns a scalar loss, or ``(loss, aux)`` when
            `has_aux` is true.
        loss_scale: any loss scale (`NoOpLossScale`, `StaticLossScale`,
            `DynamicLossScale`, or a `jmp` loss scale).
        has_aux: whether `fun` returns ``(loss, aux)``.
        argnums: which positional argument(s) to differentiate.
        record_overflow: also return an `OverflowRecord` of the autocast
            calls in `fun`.

    Returns:
        A function with `fun`'s arguments that returns
        ``(value, grads, grads_finite)``: `value` is `fun`'s own, unscaled
        result (``loss`` or ``(loss, aux)``); `grads` are unscaled and in the
        dtype of the arguments they belong to; `grads_finite` is a scalar bool
        to pass to ``TrainState.apply_gradients`` and
        ``DynamicLossScale.adjust``. With `record_overflow`,
        ``(value, grads, grads_finite, record)``.

    Raises:
        TypeError: `loss_scale` is not a loss scale (it has no ``scale`` and
            ``unscale``), e.g. a plain number.
    """
    _require_loss_scale(loss_scale)

    def scaled_loss(*args, **kwargs):
        output = fun(*args, **kwargs)
        if has_aux:
            if not (isinstance(output, tuple) and len(output) == 2):
                raise TypeError(
                    "scaled_value_and_grad(has_aux=True) needs fun to return a "
                    f"(loss, aux) pair; it returned {type(output).__name__}."
                )
            loss = output[0]
        else:
            loss = output
        loss_array = jnp.asarray(loss)
        if loss_array.shape != ():
            raise TypeError(
                "scaled_value_and_grad needs fun to return a scalar loss; got shape "
                f"{loss_array.shape}. Reduce it (e.g. with .mean()) first."
            )
        return loss_scale.scale(loss_array), output

    if record_overflow:
        return _recording_overflow(fun, scaled_loss, loss_scale, argnums)

    value_and_scaled_grad = nnx_training.value_and_grad(scaled_loss, argnums=argnums, has_aux=True)

    @functools.wraps(fun)
    def value_and_grads(*args, **kwargs):
        before = nnx_training.variables_before(args)
        (_, value), scaled_grads = value_and_scaled_grad(*args, **kwargs)
        grads = loss_scale.unscale(scaled_grads)
        grads_finite = all_finite(grads)
        nnx_training.keep_if_skipped(args, before, grads_finite)
        return value, grads, grads_finite

    return value_and_grads


def _recording_overflow(fun, scaled_loss, loss_scale, argnums):
    """`scaled_value_and_grad` with ``record_overflow=True``: the probe is argument 0 of the
    differentiated function, and its gradient holds the backward amaxes."""
    single = isinstance(argnums, int)
    shifted = (0, *((argnums + 1,) if single else (index + 1 for index in argnums)))

    def differentiable(probe, *args, **kwargs):
        with overflow_session(probe) as session:
            scaled, output = scaled_loss(*args, **kwargs)
        return scaled, (output, session.records)

    value_and_probed_grad = nnx_training.value_and_grad(differentiable, argnums=shifted, has_aux=True)

    @functools.wraps(fun)
    def value_and_grads(*args, **kwargs):
        with overflow_session(None) as sizing:
            jax.eval_shape(lambda *leaves: scaled_loss(*leaves, **kwargs), *args)
        probe = jnp.zeros([sizing.size, SLOTS], jnp.float32)
        before = nnx_training.variables_before(args)
        (_, (value, records)), (probe_grad, *scaled_grads) = value_and_probed_grad(probe, *args, **kwargs)
        grads = loss_scale.unscale(scaled_grads[0] if single else tuple(scaled_grads))
        grads_finite = all_finite(grads)
        nnx_training.keep_if_skipped(args, before, grads_finite)
        return value, grads, grads_finite, with_backward(records, sizing.offsets, probe_grad)

    return value_and_grads


def _require_loss_scale(loss_scale: Any) -> None:
    """Raises TypeError, naming the type needed, unless `loss_scale` scales and unscales."""
    if all(callable(getattr(loss_scale, name, None)) for name in ("scale", "unscale")):
        return
    example = (
        f" For a fixed scale of {loss_scale!r} pass jaxamp.StaticLossScale({loss_scale!r})."
        if isinstance(loss_scale, (int, float)) and not isinstance(loss_scale, bool)
        else ""
    )
    raise TypeError(
        "scaled_value_and_grad needs a loss scale (jaxamp.NoOpLossScale, StaticLossScale or "
        f"DynamicLossScale, or a jmp loss scale) as loss_scale; got {loss_scale!r} of type "
        f"{type(loss_scale).__name__}.{example}"
    )
