"""Fault injection: turn a seeded random share of steps' gradients into inf or NaN.

A test and demonstration hook (``--inject-nonfinite RATE``), not a training
feature: it shows, on a real run, that a step whose gradients are not finite
is skipped and that no inf or NaN ever reaches params, optimizer state or
batch statistics. It runs inside the jitted step, after the gradients are
computed and before the train state decides whether to apply them::

    injected = bernoulli(rng, rate)           # one draw per step
    bad      = NaN or +inf                    # a fair coin from the same key
    grads    = bad everywhere if injected else grads

The key is the step's own (derived from the run's seed, the epoch and the
step), so the same flags inject on the same steps, resumed or not.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


def inject_nonfinite(grads: Any, rng: jax.Array, rate: float) -> tuple[Any, jax.Array]:
    """Replaces every floating gradient by NaN or inf on a random `rate` of steps.

    Args:
        grads: the step's gradients.
        rng: a key of this step.
        rate: the probability of injecting, a Python float in [0, 1); 0 adds
            no operation to the step.

    Returns:
        ``(grads, injected)``: the gradients, poisoned or not, and a scalar
        bool telling whether this step was injected.
    """
    if rate == 0:
        return grads, jnp.zeros([], jnp.bool_)
    inject_rng, kind_rng = jax.random.split(jax.random.fold_in(rng, 0x1A7))
    injected = jax.random.bernoulli(inject_rng, rate)
    bad_value = jnp.where(jax.random.bernoulli(kind_rng), jnp.nan, jnp.inf)

    def poison(leaf):
        if not jnp.issubdtype(leaf.dtype, jnp.floating):
            return leaf
        return jnp.where(injected, bad_value.astype(leaf.dtype), leaf)

    return jax.tree.map(poison, grads), injected
