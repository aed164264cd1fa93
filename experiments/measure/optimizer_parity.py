"""bfloat16 master weights and Adam state against float32: an MLP trained side by side on a CPU.

A student MLP (32 -> 256 -> 256 -> 1, GELU) learns a random teacher MLP's
regression on synthetic Gaussian inputs (one teacher and held-out set; each
seed draws its own initial weights and training batches), with Adam and a cosine learning-rate
decay to zero: late in the run the updates shrink below half a bfloat16 ulp
of the weights, where round-to-nearest loses them. Every recipe computes the
forward and backward pass in float32 from the same initial weights and the
same batches, so the rows differ only in how the params and Adam's state are
stored and updated:

* ``float32``: float32 params, ``optax.adam`` (12 bytes per param);
* ``bf16 optax``: bfloat16 params and ``optax.adam`` on them as optax does
  today: moments in bfloat16, every update rounded to nearest;
* ``bf16 nearest`` / ``bf16 stochastic`` / ``bf16 kahan``:
  ``jaxamp.low_precision_optimizer(optax.adam(...), rounding=...)``,
  bfloat16 params and moments, Adam's math in float32.

It prints the held-out mean squared error after the last step for each seed,
their mean, the gap of the mean to float32's, and the bytes per param of
params plus optimizer state (counted from the pytrees), and the time of one
compiled step of each recipe (interleaved rounds,
`experiments.benchmark.timing`). Writes table.md.
"""

from __future__ import annotations

import itertools
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxamp
from experiments.benchmark.timing import interleaved_medians
from experiments.flags import positive_float, positive_int
from experiments.measure.markdown import table

WIDTHS = (32, 256, 256, 1)


def init_mlp(key, scale=1.0):
    """Params of a GELU MLP of `WIDTHS`, float32, He-style initialisation times `scale`."""
    params = []
    for layer_key, (fan_in, fan_out) in zip(
        jax.random.split(key, len(WIDTHS) - 1), itertools.pairwise(WIDTHS)
    ):
        kernel = scale * jax.random.normal(layer_key, (fan_in, fan_out)) * np.sqrt(2.0 / fan_in)
        params.append({"kernel": kernel, "bias": jnp.zeros((fan_out,))})
    return params


def mlp(params, inputs):
    hidden = inputs
    for layer in params[:-1]:
        hidden = jax.nn.gelu(hidden @ layer["kernel"].astype(jnp.float32) + layer["bias"].astype(jnp.float32))
    return hidden @ params[-1]["kernel"].astype(jnp.float32) + params[-1]["bias"].astype(jnp.float32)


def make_data(seed, batch_size, steps, held_out=4096):
    """Training batches (drawn for `seed`) and a held-out set, labelled by one random teacher MLP."""
    teacher_key, test_key = jax.random.split(jax.random.key(1000), 2)
    data_key = jax.random.key(2000 + seed)
    teacher = init_mlp(teacher_key)
    inputs = jax.random.normal(data_key, (steps, batch_size, WIDTHS[0]))
    test_inputs = jax.random.normal(test_key, (held_out, WIDTHS[0]))
    return (inputs, mlp(teacher, inputs)), (test_inputs, mlp(teacher, test_inputs))


def recipes(learning_rate, steps, seed):
    """Each recipe: (param dtype, optimizer)."""

    def adam():
        return optax.adam(optax.cosine_decay_schedule(learning_rate, steps))

    def low_precision(rounding):
        return jaxamp.low_precision_optimizer(adam(), rounding=rounding, key=seed)

    return {
        "float32": (jnp.float32, adam()),
        "bf16 optax": (jnp.bfloat16, adam()),
        "bf16 nearest": (jnp.bfloat16, low_precision("nearest")),
        "bf16 stochastic": (jnp.bfloat16, low_precision("stochastic")),
        "bf16 kahan": (jnp.bfloat16, low_precision("kahan")),
    }


def new_state(name, params, tx) -> jaxamp.TrainState:
    """Recipe `name`'s `jaxamp.TrainState` of `params` and `tx`. ``bf16 optax``, measured for what it
    loses, is plain optax on bfloat16 params, which `TrainState.create` refuses: that state is made
    around the params in float32, then given the bfloat16 params and optax's state for them."""
    if name != "bf16 optax":
        return jaxamp.TrainState.create(apply_fn=mlp, params=params, tx=tx)
    float32_params = jax.tree.map(lambda param: param.astype(jnp.float32), params)
    state = jaxamp.TrainState.create(apply_fn=mlp, params=float32_params, tx=tx)
    return state.replace(params=params, opt_state=tx.init(params))


def tree_bytes(tree):
    return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(tree))


def train(name, param_dtype, tx, params, train_data, test_data):
    """Trains recipe `name` with `tx` through jaxamp.TrainState; returns the held-out MSE and bytes per param."""
    params = jax.tree.map(lambda p: p.astype(param_dtype), params)
    state = new_state(name, params, tx)
    bytes_per_param = (tree_bytes(state.params) + tree_bytes(state.opt_state)) / sum(
        leaf.size for leaf in jax.tree.leaves(params)
    )

    def train_step(state, batch):
        inputs, targets = batch
        grads = jax.grad(lambda params: jnp.mean((mlp(params, inputs) - targets) ** 2))(state.params)
        return state.apply_gradients(grads=grads), None

    state, _ = jax.jit(lambda state, data: jax.lax.scan(train_step, state, data))(state, train_data)
    test_inputs, test_targets = test_data
    return float(jnp.mean((mlp(state.params, test_inputs) - test_targets) ** 2)), bytes_per_param


def step_milliseconds(recipes_by_name, params, train_data, rounds=40):
    """Milliseconds of one compiled train step of each recipe, the median of `rounds` interleaved rounds."""
    batch = jax.tree.map(lambda data: data[0], train_data)

    def make_step():
        @jax.jit
        def train_step(state, batch):
            inputs, targets = batch
            grads = jax.grad(lambda params: jnp.mean((mlp(params, inputs) - targets) ** 2))(state.params)
            return state.apply_gradients(grads=grads)

        return train_step

    steps, states = {}, {}
    for name, (param_dtype, tx) in recipes_by_name.items():
        steps[name] = make_step()
        start = jax.tree.map(lambda p, dtype=param_dtype: p.astype(dtype), params)
        states[name] = new_state(name, start, tx)

    def one_step(name):
        def step():
            states[name] = steps[name](states[name], batch)
            return states[name]

        return step

    medians = interleaved_medians(
        {name: one_step(name) for name in recipes_by_name}, rounds, steps=1, warmup=1
    )
    return {name: 1000 * seconds for name, seconds in medians.items()}


def add_arguments(parser) -> None:
    parser.add_argument("--seeds", type=positive_int, default=2, help="seeds 0, 1, ...")
    parser.add_argument("--steps", type=positive_int, default=600, help="Adam steps per run")
    parser.add_argument("--batch-size", type=positive_int, default=128, help="examples per step")
    parser.add_argument(
        "--learning-rate", type=positive_float, default=1e-3, help="peak, cosine-decayed to 0"
    )
    parser.add_argument("--rounds", type=positive_int, default=40, help="interleaved rounds timing one step")


def run(args, out) -> None:
    started = time.perf_counter()
    losses, bytes_per_param, seconds = {}, {}, {}
    for seed in range(args.seeds):
        train_data, test_data = make_data(seed, args.batch_size, args.steps)
        initial = init_mlp(jax.random.key(seed), scale=0.5)
        for name, (param_dtype, tx) in recipes(args.learning_rate, args.steps, seed).items():
            run_started = time.perf_counter()
            loss, bytes_per_param[name] = train(name, param_dtype, tx, initial, train_data, test_data)
            seconds.setdefault(name, []).append(time.perf_counter() - run_started)
            losses.setdefault(name, []).append(loss)
            print(f"  seed {seed} {name}: held-out MSE {loss:.5f}", flush=True)

    train_data, _ = make_data(0, args.batch_size, 1)
    milliseconds = step_milliseconds(
        recipes(args.learning_rate, args.steps, 0),
        init_mlp(jax.random.key(0), scale=0.5),
        train_data,
        args.rounds,
    )
    float32_mean = np.mean(losses["float32"])
    rows = []
    for name, values in losses.items():
        mean = np.mean(values)
        rows.append(
            [
                name,
                f"{bytes_per_param[name]:.2f}",
                *(f"{value:.5f}" for value in values),
                f"{mean:.5f}",
                f"{100 * (mean / float32_mean - 1):+.1f}%",
                f"{100 * (max(values) - min(values)) / float32_mean:.1f}%",
                f"{np.mean(seconds[name]):.1f}",
                f"{milliseconds[name]:.2f}",
                f"{milliseconds[name] / milliseconds['bf16 nearest']:.2f}x",
            ]
        )
    header = [
        "recipe",
        "bytes/param",
        *(f"seed {seed}" for seed in range(args.seeds)),
        "mean",
        "gap vs float32",
        "seed spread",
        "s/run",
        "ms/step",
        "step vs nearest",
    ]
    text = "\n".join(
        [
            "# bfloat16 master weights and Adam state against float32, on a CPU",
            "",
            f"Command: `{out.command}`",
            f"(jax {jax.__version__}, {jax.devices()[0].platform}, {time.perf_counter() - started:.0f} s in all).",
            (
                f"MLP {' -> '.join(map(str, WIDTHS))} on a random teacher's regression, forward and backward in "
                f"float32; Adam, learning rate {args.learning_rate:g} cosine-decayed to 0, {args.steps} steps of "
                f"batch {args.batch_size}. Cells: held-out mean squared error after the last step; bytes/param: "
                "params plus optimizer state, counted from the pytrees; gap and seed spread "
                "(largest minus smallest seed): in percent of float32's mean; s/run: "
                "wall seconds of one run, compilation included, mean over seeds; ms/step: one compiled step "
                f"(forward, backward and update) after compilation, the median of {args.rounds} interleaved rounds."
            ),
            "",
            table(header, rows),
        ]
    )
    out.print(text)
    out.write("table.md", text)
