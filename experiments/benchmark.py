"""What loss scaling costs: the same train step with and without it.

    python -m experiments.benchmark
    python -m experiments.benchmark --rounds 30 --steps 20 --models mlp

For a small MLP (where per-step overhead shows most) and a small CNN, one
jitted ``mixed_float16`` train step is built three ways and timed interleaved,
in one process, round after round:

* ``dynamic``: `jaxamp.DynamicLossScale` (scale, unscale, finiteness check,
  skip-or-apply select, scale adjustment);
* ``noop``: `jaxamp.NoOpLossScale` in the same `jaxamp.TrainState` step (the
  finiteness check and select remain; only the scaling goes);
* ``plain``: ``jax.value_and_grad`` and the optax update, nothing else.

It prints the median time per step of each and the ratios ``dynamic/noop``
(the loss scale's cost) and ``dynamic/plain`` (the whole mechanism's cost).
Timing on a shared machine is noisy: each round times every variant
back to back, in alternating order, and medians are taken over rounds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

import jaxamp

_BUDGETS = {"mlp": 1.10, "cnn": 1.03}


class MLP(nn.Module):
    """784-512-512-10 with ReLU."""

    @nn.compact
    def __call__(self, x):
        x = x.reshape((x.shape[0], -1))
        x = nn.relu(nn.Dense(512)(x))
        x = nn.relu(nn.Dense(512)(x))
        return nn.Dense(10)(x)


class SmallCNN(nn.Module):
    """Two 3x3 conv layers with pooling, then a dense head."""

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(32, (3, 3))(x))
        x = nn.max_pool(x, (2, 2), (2, 2))
        x = nn.relu(nn.Conv(64, (3, 3))(x))
        x = nn.max_pool(x, (2, 2), (2, 2))
        x = x.reshape((x.shape[0], -1))
        return nn.Dense(10)(x)


def make_problem(name: str, batch_size: int):
    """The model and a fixed batch for `name` (``mlp`` or ``cnn``)."""
    if name == "mlp":
        model, shape = MLP(), (batch_size, 28, 28, 1)
    else:
        model, shape = SmallCNN(), (batch_size, 32, 32, 3)
    images = jax.random.normal(jax.random.key(1), shape)
    labels = jax.random.randint(jax.random.key(2), (batch_size,), 0, 10)
    return jaxamp.apply_policy(model, "mixed_float16"), images, labels


def build_steps(model, images, labels):
    """The three jitted steps and their initial states."""
    params = model.init(jax.random.key(0), images)["params"]
    tx = optax.sgd(0.01, momentum=0.9)

    def loss_fn(params):
        logits = model.apply({"params": params}, images)
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    def jaxamp_step(state):
        loss, grads, grads_finite = jaxamp.scaled_value_and_grad(loss_fn, state.loss_scale)(state.params)
        return state.apply_gradients(grads=grads, grads_finite=grads_finite), loss

    def plain_step(carry):
        params, opt_state = carry
        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    def own_copy(tree):
        # Each variant donates its state, so none may share buffers with another.
        return jax.tree.map(jnp.copy, tree)

    def state_with(loss_scale):
        return jaxamp.TrainState.create(
            apply_fn=model.apply, params=own_copy(params), tx=tx, loss_scale=loss_scale
        )

    jaxamp_step = jax.jit(jaxamp_step, donate_argnums=0)
    return {
        "dynamic": (jaxamp_step, state_with(jaxamp.DynamicLossScale())),
        "noop": (jaxamp_step, state_with(jaxamp.NoOpLossScale())),
        "plain": (jax.jit(plain_step, donate_argnums=0), (own_copy(params), tx.init(params))),
    }


def time_steps(step, state, count: int):
    """Runs `count` steps; returns the new state and seconds per step."""
    start = time.perf_counter()
    for _ in range(count):
        state, loss = step(state)
    jax.block_until_ready((state, loss))
    return state, (time.perf_counter() - start) / count


def benchmark(name: str, batch_size: int, rounds: int, steps: int) -> dict[str, float]:
    """Median seconds per step of each variant, timed interleaved."""
    steps_by_variant = build_steps(*make_problem(name, batch_size))
    states = {}
    for variant, (step, state) in steps_by_variant.items():
        states[variant], _ = time_steps(step, state, 3)  # compile and warm up
    samples: dict[str, list[float]] = {variant: [] for variant in steps_by_variant}
    order = list(steps_by_variant)
    for round_index in range(rounds):
        for variant in order if round_index % 2 == 0 else reversed(order):
            step = steps_by_variant[variant][0]
            states[variant], seconds = time_steps(step, states[variant], steps)
            samples[variant].append(seconds)
    return {variant: statistics.median(times) for variant, times in samples.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m experiments.benchmark", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--models", default="mlp,cnn", help="comma-separated: mlp, cnn (default: %(default)s)"
    )
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=20, help="steps per timed round")
    args = parser.parse_args(argv)
    models = [name.strip() for name in args.models.split(",") if name.strip()]
    for name in models:
        if name not in _BUDGETS:
            parser.error(f"invalid model {name!r} (choose from {', '.join(_BUDGETS)})")

    print(
        f"device: {jax.devices()[0].device_kind}; batch {args.batch_size}; "
        f"{args.rounds} interleaved rounds of {args.steps} steps; policy mixed_float16"
    )
    print(
        f"{'model':<6} {'dynamic ms':>11} {'noop ms':>9} {'plain ms':>9} {'dynamic/noop':>13} "
        f"{'budget':>7} {'dynamic/plain':>14}"
    )
    within_budget = True
    for name in models:
        medians = benchmark(name, args.batch_size, args.rounds, args.steps)
        ratio = medians["dynamic"] / medians["noop"]
        within_budget &= ratio <= _BUDGETS[name]
        print(
            f"{name:<6} {1e3 * medians['dynamic']:>11.3f} {1e3 * medians['noop']:>9.3f} "
            f"{1e3 * medians['plain']:>9.3f} {ratio:>13.3f} {_BUDGETS[name]:>7.2f} "
            f"{medians['dynamic'] / medians['plain']:>14.3f}"
        )
    print(
        "all within budget" if within_budget else "over budget (timings are noisy: rerun on an idle machine)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
