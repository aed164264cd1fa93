"""8-bit optimizer state against the bfloat16-state wrapper and float32, with nearest codes beside stochastic ones.

Two parts (``PART``):

* ``mlp``: the MLP regression of ``optimizer-parity`` (Adam, b2 = 0.999),
  8-bit state beside float32 and bfloat16 state;
* ``decay``: a moving average decaying below its block's largest value,
  stored in 8 bits every step: nearest codes against stochastic ones.

Both add rows that the library does not offer: the same 8-bit state with
its codes rounded to nearest instead of stochastically (this measurement
patches the one call that quantizes), to show what stochastic rounding
buys. The language model's costs of the 8-bit recipes (``experiments.lm``
precisions ``bfloat16_int8``, ``bfloat16_fp8``,
``bfloat16_int8_per_tensor``) are ``optimizer-lm-cost``'s with these names
in ``--recipes``. Writes ``mlp.md`` or ``decay.md``.
"""

from __future__ import annotations

import contextlib
import time
import unittest.mock

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxamp
from experiments.flags import positive_int
from experiments.measure import optimizer_parity
from jaxamp._optimizer import low_precision
from jaxamp._optimizer.quantized import dequantize, quantize


# --- the MLP regression, and nearest codes against stochastic ones -----------------------


def nearest_codes():
    """A context in which the wrapper rounds its 8-bit codes to nearest (the library rounds them stochastically)."""
    def to_nearest(values, state_format, block_size, key, **options):
        return quantize(values, state_format, block_size, None, **options)

    return unittest.mock.patch.object(low_precision, "quantize", to_nearest)


def mlp_recipes(learning_rate, steps, seed):
    """(param dtype, optimizer, rounds its codes to nearest) of each recipe."""

    def adam():
        return optax.adam(optax.cosine_decay_schedule(learning_rate, steps))

    def wrapper(**settings):
        return jaxamp.low_precision_optimizer(adam(), key=seed, **settings)

    return {
        "float32": (jnp.float32, adam(), False),
        "bf16 state (stochastic)": (jnp.bfloat16, wrapper(), False),
        "int8, blocks of 256": (jnp.bfloat16, wrapper(state_dtype="int8"), False),
        "float8_e4m3fn, blocks of 256": (jnp.bfloat16, wrapper(state_dtype=jnp.float8_e4m3fn), False),
        "int8, one scale per leaf": (jnp.bfloat16, wrapper(state_dtype="int8", block_size=None), False),
        "int8, blocks of 256, nearest codes": (jnp.bfloat16, wrapper(state_dtype="int8"), True),
        "float8_e4m3fn, blocks of 256, nearest codes": (jnp.bfloat16, wrapper(state_dtype=jnp.float8_e4m3fn), True),
    }  # fmt: skip


def mlp_parity(args, command) -> str:
    losses, bytes_per_param = {}, {}
    started = time.perf_counter()
    for seed in range(args.seeds):
        train_data, test_data = optimizer_parity.make_data(seed, 128, args.steps)
        initial = optimizer_parity.init_mlp(jax.random.key(seed), scale=0.5)
        for name, (param_dtype, tx, nearest) in mlp_recipes(1e-3, args.steps, seed).items():
            with nearest_codes() if nearest else contextlib.nullcontext():
                loss, bytes_per_param[name] = optimizer_parity.train(
                    param_dtype, tx, initial, train_data, test_data
                )
            losses.setdefault(name, []).append(loss)
    base = np.mean(losses["float32"])
    lines = [
        "# 8-bit Adam state on the MLP regression of experiments.measure optimizer-parity",
        "",
        (
            f"Command: `{command}` (JAX {jax.__version__}, "
            f"{time.perf_counter() - started:.0f} s in all)."
        ),
        "",
        (
            f"MLP 32 -> 256 -> 256 -> 1 learning a random teacher's regression, forward and backward in float32; "
            f"Adam (b2 = 0.999), learning rate 1e-3 cosine-decayed to 0, {args.steps} steps of batch 128; each seed "
            "its own initial weights and batches. Cells: held-out mean squared error after the last step; gap and "
            "seed spread (largest minus smallest seed) in percent of float32's mean; bytes/param: params plus "
            "optimizer state, counted from the pytrees (the two kernels of 8,192 and 65,536 elements are stored in "
            "8 bits; the biases and the last kernel, 256 elements each, keep float32 state). The nearest-code rows "
            "patch the wrapper's one quantizing call to round to the nearest code: the library does not offer it."
        ),
        "",
        (
            f"| recipe | bytes/param | {' | '.join(f'seed {seed}' for seed in range(args.seeds))} | mean "
            "| gap vs float32 | seed spread |"
        ),
        "|---|---:|" + "---:|" * args.seeds + "---:|---:|---:|",
    ]
    for name, values in losses.items():
        cells = " | ".join(f"{value:.5f}" for value in values)
        lines.append(
            f"| {name} | {bytes_per_param[name]:.2f} | {cells} | {np.mean(values):.5f} "
            f"| {100 * (np.mean(values) / base - 1):+.1f}% | {100 * (max(values) - min(values)) / base:.1f}% |"
        )
    return "\n".join(lines) + "\n"


def decay(args, command) -> str:
    """An exponential moving average (b = 0.999) with no new input decays for 1000 steps below its block's
    largest value, which holds at 1; stored in 8 bits and read back each step."""
    steps, b = 1000, 0.999
    lines = [
        "# A moving average decaying in 8 bits: nearest codes against stochastic ones",
        "",
        f"Command: `{command}` (JAX {jax.__version__}).",
        "",
        (
            f"64 blocks of 256: the first element of each holds at 1, the others start at the value in the first "
            f"column and are multiplied by b = {b} each step (Adam's second moment once its gradients stop), the "
            f"result quantized and read back every step. Cells: the others' mean after {steps} steps over the "
            f"exact {b}**{steps} = {b**steps:.4f} times their start, and in brackets their standard deviation "
            "over it (the spread stochastic rounding leaves each element with)."
        ),
        "",
        "| start | int8, nearest | int8, stochastic | float8_e4m3fn, nearest | float8_e4m3fn, stochastic |",
        "|---:|---:|---:|---:|---:|",
    ]
    for start in (0.5, 0.05, 0.001):
        cells = []
        for state_format in ("int8", "float8_e4m3fn"):
            for stochastic in (False, True):
                held = jnp.zeros((64 * 256,), bool).at[::256].set(True)  # the first element of each block
                values = jnp.where(held, 1.0, start)

                def step(index, values, state_format=state_format, stochastic=stochastic, held=held):
                    key = jax.random.fold_in(jax.random.key(0), index) if stochastic else None
                    decayed = jnp.where(held, values, b * values)
                    return dequantize(quantize(decayed, state_format, 256, key))

                values = jax.jit(lambda values, step=step: jax.lax.fori_loop(0, steps, step, values))(values)
                ratios = values[~held] / (start * b**steps)
                cells.append(f"{float(ratios.mean()):.3f} ({float(ratios.std()):.3f})")
        lines.append(f"| {start:g} | {' | '.join(cells)} |")
    return "\n".join(lines) + "\n"


def add_arguments(parser) -> None:
    parser.add_argument("part", choices=["mlp", "decay"], help="which part to run")
    parser.add_argument("--seeds", type=positive_int, default=2, help="seeds (mlp)")
    parser.add_argument("--steps", type=positive_int, default=600, help="Adam steps per run (mlp)")


def run(args, out) -> None:
    text = {"mlp": mlp_parity, "decay": decay}[args.part](args, out.command)
    out.print(text)
    out.write(f"{args.part}.md", text)
