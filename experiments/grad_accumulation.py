"""Gradient accumulation inside one jitted step, with loss scaling.

``--grad-accum K`` splits the global batch into K micro-batches and sums
their unscaled gradients before one optimizer update, so the update equals
that of one batch K times the micro-batch (for a model without batch
statistics; with BatchNorm each micro-batch normalizes over itself, as in
PyTorch).

Why not ``optax.MultiSteps(optax.apply_if_finite(opt))``: MultiSteps adds
every micro-batch's gradients to its accumulator *before* the inner
``apply_if_finite`` sees them, so one overflowed micro-batch leaves inf or
NaN in the accumulator and the inner check only skips the poisoned update
(optax issue 828). Here each micro-batch's finite flag is checked first and
an overflowed micro-batch adds none of its finite values; its inf and NaN
values are added, so the step's gradients are non-finite in exactly the
leaves where some micro-batch's were, and the train state names those
leaves (`jaxamp.diagnostics.NonFiniteGradients`) when it skips the step::

    grads_sum, finite = zeros (float32), True
    for micro_batch in micro_batches:            # lax.scan
        grads, micro_finite = scaled grads of micro_batch, unscaled
        grads_sum += grads where micro_finite or not isfinite(grads), else 0
        finite &= micro_finite
    return grads_sum / K, finite                 # the step is skipped unless finite

A step with any overflowed micro-batch is skipped as a whole (and the loss
scale backs off), as ``torch.amp.GradScaler`` does with accumulation; the
accumulator lives only inside the step, so nothing non-finite outlives it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jaxamp.diagnostics import OverflowRecord


def accumulate_gradients(
    grad_fn: Callable[[Any, Any, Any], tuple[tuple[Any, Any], Any, jax.Array]],
    params: Any,
    carry: Any,
    micro_batches: Any,
) -> tuple[Any, Any, jax.Array, Any]:
    """Runs `grad_fn` over micro-batches and averages the finite gradients.

    Args:
        grad_fn: ``grad_fn(params, carry, micro_batch)`` returning
            ``((metrics, carry), grads, grads_finite)``, as
            `jaxamp.scaled_value_and_grad` does: unscaled `grads` and a scalar
            bool. `carry` threads state from one micro-batch to the next
            (BatchNorm statistics, say); `metrics` is a tree of scalars, and
            of `jaxamp.diagnostics.OverflowRecord`s.
        params: the parameters the gradients are taken with respect to.
        carry: the initial carry.
        micro_batches: a tree whose leaves have a leading axis of length K.

    Returns:
        ``(carry, grads, grads_finite, metrics)``: the last carry, the mean
        gradients over the K micro-batches in the params' dtypes (of a
        micro-batch that was not all finite, only the inf and NaN values
        added), whether all K were finite, and the metrics
        summed over the micro-batches (each overflow record the worst of the
        K: `OverflowRecord.worst`).
    """
    num_micro_batches = jax.tree.leaves(micro_batches)[0].shape[0]
    if num_micro_batches == 1:
        (metrics, carry), grads, grads_finite = grad_fn(
            params, carry, jax.tree.map(lambda leaf: leaf[0], micro_batches)
        )
        return carry, grads, grads_finite, metrics

    def accumulate(accumulator, micro_batch):
        grads_sum, all_finite, carry, metrics_sum = accumulator
        (metrics, carry), grads, grads_finite = grad_fn(params, carry, micro_batch)
        grads_sum = jax.tree.map(
            lambda total, grad: (
                total + jnp.where(grads_finite | ~jnp.isfinite(grad), grad, 0).astype(total.dtype)
            ),
            grads_sum,
            grads,
        )
        metrics_sum = jax.tree.map(_combine_metric, metrics_sum, metrics, is_leaf=_is_record)
        return (grads_sum, all_finite & grads_finite, carry, metrics_sum), None

    zeros = jax.tree.map(lambda leaf: jnp.zeros(leaf.shape, jnp.float32), params)
    first = jax.tree.map(lambda leaf: leaf[0], micro_batches)
    metrics_shape = jax.eval_shape(lambda: grad_fn(params, carry, first)[0][0])
    metrics_zeros = jax.tree.map(lambda leaf: jnp.zeros(leaf.shape, leaf.dtype), metrics_shape)
    (grads_sum, grads_finite, carry, metrics), _ = jax.lax.scan(
        accumulate, (zeros, jnp.array(True), carry, metrics_zeros), micro_batches
    )
    grads = jax.tree.map(
        lambda total, leaf: (total / num_micro_batches).astype(leaf.dtype), grads_sum, params
    )
    return carry, grads, grads_finite, metrics


def _is_record(node: Any) -> bool:
    return isinstance(node, OverflowRecord)


def _combine_metric(total: Any, value: Any) -> Any:
    """A metric over micro-batches: summed, or for an overflow record the worst of them."""
    return total.worst(value) if _is_record(total) else total + value
