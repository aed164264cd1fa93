"""What loss scaling costs, against the anchors' own recipes.

One ``mixed_float16`` train step on a fixed batch, built six ways and timed
interleaved (ratios to ``plain``):

* ``plain``: ``jax.value_and_grad`` and the optax update, nothing else;
* ``jaxamp_dynamic``: `jaxamp.scaled_value_and_grad` with
  `jaxamp.DynamicLossScale` and `jaxamp.TrainState.apply_gradients`
  (scale, unscale, finiteness check, one select, scale adjustment);
* ``jaxamp_noop``: the same step with `jaxamp.NoOpLossScale` (the check and
  select remain; only the scaling goes);
* ``flax_dynamic_scale``: flax's ``DynamicScale.value_and_grad`` and a
  ``jnp.where`` over params and optimizer state, as flax's ImageNet example
  does (batch statistics update even on a skipped step, as there);
* ``jmp_dynamic``: jmp's ``DynamicLossScale`` (scale, unscale,
  ``all_finite``, ``adjust``) and ``select_tree`` over params and optimizer
  state;
* ``optax_apply_if_finite``: ``optax.apply_if_finite`` around the optimizer
  (no loss scale: it only skips non-finite updates).

Two more, which the ``attribution`` section times against ``jaxamp_dynamic``
(`experiments.benchmark.attribution`):

* ``jaxamp_no_attribution``: ``jaxamp_dynamic`` without the gradient
  attribution the train state keeps by default (``nonfinite_grads=None``);
* ``jaxamp_record_overflow``: ``jaxamp_dynamic`` with
  ``record_overflow=True``, the record kept in the state.

Each recipe skips an overflowed step the way its library does
(``tests/test_benchmark.py`` injects one), so the comparison is fair.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import jmp
import optax
from flax.training import dynamic_scale as flax_dynamic_scale

import jaxamp
from experiments import train
from experiments.benchmark import timing
from experiments.models import create_model

VARIANTS = (
    "plain",
    "jaxamp_dynamic",
    "jaxamp_noop",
    "flax_dynamic_scale",
    "jmp_dynamic",
    "optax_apply_if_finite",
)
ATTRIBUTION_VARIANTS = ("jaxamp_no_attribution", "jaxamp_dynamic", "jaxamp_record_overflow")
_MAX_CONSECUTIVE_ERRORS = 5


class MLP(nn.Module):
    """784-512-512-10 with ReLU: small enough that per-step overhead shows."""

    @nn.compact
    def __call__(self, x, train: bool = True):
        del train
        x = x.reshape((x.shape[0], -1))
        x = nn.relu(nn.Dense(512)(x))
        x = nn.relu(nn.Dense(512)(x))
        return nn.Dense(10)(x)


def make_problem(model_name: str, batch_size: int) -> tuple[nn.Module, jax.Array, jax.Array]:
    """The mixed_float16 model and a fixed batch (``mlp``: 28x28x1; else CIFAR shapes)."""
    if model_name == "mlp":
        model, shape = MLP(), (batch_size, 28, 28, 1)
    else:
        model, shape = create_model(model_name), (batch_size, 32, 32, 3)
    images = jax.random.normal(jax.random.key(1), shape)
    labels = jax.random.randint(jax.random.key(2), (batch_size,), 0, 10)
    return jaxamp.apply_policy(model, "mixed_float16"), images, labels


def _loss_fn(model: nn.Module) -> Callable:
    """``loss_fn(params, batch_stats, images, labels) -> (loss, new_batch_stats)``."""

    def loss_fn(params, batch_stats, images, labels):
        variables = {"params": params}
        if batch_stats is not None:
            variables["batch_stats"] = batch_stats
        logits, updates = model.apply(variables, images, train=True, mutable=["batch_stats"])
        new_batch_stats = updates["batch_stats"] if batch_stats is not None else None
        return train.cross_entropy(logits, labels, 10, 0.0), new_batch_stats

    return loss_fn


def _select(grads_finite, new_tree, old_tree):
    return jax.tree.map(functools.partial(jnp.where, grads_finite), new_tree, old_tree)


def build_variants(model: nn.Module, images, variants=VARIANTS) -> dict[str, tuple[Callable, Any]]:
    """Each variant's step (not yet jitted) and initial state.

    A step is ``step(state, images, labels) -> (state, loss)``.

    `images` are a sample batch, to initialize the model with.

    Every state is a pytree that holds params, optimizer state and batch
    statistics (and the variant's loss scale), each with its own buffers.
    """
    variables = model.init(jax.random.key(0), images, train=False)
    params, batch_stats = variables["params"], variables.get("batch_stats")
    tx = optax.sgd(0.01, momentum=0.9)
    loss_fn = _loss_fn(model)

    def own(tree):
        return jax.tree.map(jnp.copy, tree)

    def update(params, opt_state, grads, transform=tx):
        updates, opt_state = transform.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    def plain(state, images, labels):
        params, opt_state, batch_stats = state
        (loss, new_stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            params, batch_stats, images, labels
        )
        return (*update(params, opt_state, grads), new_stats), loss

    def jaxamp_step(state, images, labels, record_overflow=False):
        (loss, new_stats), grads, grads_finite, *record = jaxamp.scaled_value_and_grad(
            lambda p: loss_fn(p, state.batch_stats, images, labels),
            state.loss_scale,
            has_aux=True,
            record_overflow=record_overflow,
        )(state.params)
        state = state.apply_gradients(
            grads=grads,
            grads_finite=grads_finite,
            batch_stats=new_stats,
            overflow_record=record[0] if record else None,
        )
        return state, loss

    recording_step = functools.partial(jaxamp_step, record_overflow=True)

    def flax_step(state, images, labels):
        params, opt_state, batch_stats, scale = state
        scale, grads_finite, (loss, new_stats), grads = scale.value_and_grad(
            lambda p: loss_fn(p, batch_stats, images, labels), has_aux=True
        )(params)
        new_params, new_opt_state = update(params, opt_state, grads)
        new_params, new_opt_state = _select(grads_finite, (new_params, new_opt_state), (params, opt_state))
        return (new_params, new_opt_state, new_stats, scale), loss

    def jmp_step(state, images, labels):
        params, opt_state, batch_stats, loss_scale = state

        def scaled_loss(params):
            loss, new_stats = loss_fn(params, batch_stats, images, labels)
            return loss_scale.scale(loss), (loss, new_stats)

        grads, (loss, new_stats) = jax.grad(scaled_loss, has_aux=True)(params)
        grads = loss_scale.unscale(grads)
        grads_finite = jmp.all_finite(grads)
        new_params, new_opt_state = update(params, opt_state, grads)
        new_params, new_opt_state = jmp.select_tree(
            grads_finite, (new_params, new_opt_state), (params, opt_state)
        )
        return (new_params, new_opt_state, new_stats, loss_scale.adjust(grads_finite)), loss

    guarded_tx = optax.apply_if_finite(tx, _MAX_CONSECUTIVE_ERRORS)

    def optax_step(state, images, labels):
        params, opt_state, batch_stats = state
        (loss, new_stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            params, batch_stats, images, labels
        )
        return (*update(params, opt_state, grads, guarded_tx), new_stats), loss

    def jaxamp_state(loss_scale):
        return jaxamp.TrainState.create(
            apply_fn=model.apply,
            params=own(params),
            tx=tx,
            loss_scale=loss_scale,
            batch_stats=own(batch_stats),
        )

    def recording_state():
        state = jaxamp_state(jaxamp.DynamicLossScale())
        return state.with_overflow_record_of(recording_step, images, jnp.zeros(len(images), jnp.int32))

    builders = {
        "plain": lambda: (plain, (own(params), tx.init(params), own(batch_stats))),
        "jaxamp_dynamic": lambda: (jaxamp_step, jaxamp_state(jaxamp.DynamicLossScale())),
        "jaxamp_noop": lambda: (jaxamp_step, jaxamp_state(jaxamp.NoOpLossScale())),
        "jaxamp_no_attribution": lambda: (
            jaxamp_step,
            jaxamp_state(jaxamp.DynamicLossScale()).replace(nonfinite_grads=None),
        ),
        "jaxamp_record_overflow": lambda: (recording_step, recording_state()),
        "flax_dynamic_scale": lambda: (
            flax_step,
            (own(params), tx.init(params), own(batch_stats), flax_dynamic_scale.DynamicScale()),
        ),
        "jmp_dynamic": lambda: (
            jmp_step,
            (own(params), tx.init(params), own(batch_stats), jmp.DynamicLossScale(jnp.float32(2**15))),
        ),
        "optax_apply_if_finite": lambda: (
            optax_step,
            (own(params), guarded_tx.init(params), own(batch_stats)),
        ),
    }
    unknown = set(variants) - set(builders)
    if unknown:
        raise ValueError(f"Unknown loss-scale variants {sorted(unknown)}; choose from {', '.join(builders)}.")
    return {name: builders[name]() for name in variants}


def measure(
    model_name: str,
    batch_size: int,
    rounds: int,
    steps: int,
    variants: tuple[str, ...] = VARIANTS,
    baseline: str = "plain",
) -> dict[str, dict[str, float]]:
    """Median ms per step of each of `variants`, timed interleaved, and its ratio to `baseline`'s.

    The ratio's key is ``ratio_to_<baseline>`` (``ratio_to_plain`` by default).
    """
    if baseline not in variants:
        raise ValueError(
            f"The baseline {baseline!r} must be among the variants timed: {', '.join(variants)}."
        )
    model, images, labels = make_problem(model_name, batch_size)
    steps_by_variant = {}
    for name, (step, state) in build_variants(model, images, variants).items():
        steps_by_variant[name] = timing.StatefulStep(
            jax.jit(step, donate_argnums=0), state, [(images, labels)]
        )
    medians = timing.interleaved_medians(steps_by_variant, rounds, steps)
    return {
        name: {"ms_per_step": 1e3 * seconds, f"ratio_to_{baseline}": seconds / medians[baseline]}
        for name, seconds in medians.items()
    }
