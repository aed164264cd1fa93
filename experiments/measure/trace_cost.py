"""What tracing through jaxamp costs: the GPT train step lowered plain, through autocast and apply_policy.

Lowering is tracing the step to a jaxpr and emitting the StableHLO program,
with no XLA compile: exactly the part of a first call that jaxamp adds to
(its own trace of the model and the rewrite). The step is the language
model's (`experiments.lm`): GPT-2's width (768, 12 heads), context 256,
batch 8, AdamW through `jaxamp.TrainState`, at two depths. The routes:

* ``plain``: the float32 model, no jaxamp;
* ``autocast``: the plain model's loss under ``jaxamp.autocast(...,
  "mixed_bfloat16")``;
* ``apply_policy``: the model under ``jaxamp.apply_policy(...,
  "mixed_bfloat16")``.

Each lowering builds its step, model wrapper and autocast anew, so no cache
of JAX's or jaxamp's is reused; rounds alternate the routes so the
machine's load falls on all alike, and the median of the rounds is printed
with its ratio to plain. Writes trace_cost.txt.
"""

from __future__ import annotations

import os
import statistics
import time

import jax
import jax.numpy as jnp
import optax

import jaxamp
from experiments.flags import comma_list, positive_int
from experiments.lm import model as model_lib
from experiments.lm import train

ROUTES = ("plain", "autocast", "apply_policy")


def add_arguments(parser) -> None:
    parser.add_argument("--depths", default="2,12", type=comma_list(None), help="numbers of layers")
    parser.add_argument("--context", type=positive_int, default=256, help="tokens per sequence")
    parser.add_argument("--batch", type=positive_int, default=8, help="sequences per step")
    parser.add_argument("--rounds", type=positive_int, default=3, help="interleaved rounds")


def lower_step(route: str, num_layers: int, context: int, batch: int) -> float:
    """Seconds to lower one train step of `route` (tracing and rewriting included)."""
    size = model_lib.GPTSize(num_layers=num_layers, d_model=768, num_heads=12, context=context)
    model = model_lib.GPT(vocab_size=50304, size=size, attention="xla")
    policy = jaxamp.get_policy("mixed_bfloat16")
    windows = jax.ShapeDtypeStruct((batch, context + 1), jnp.int32)
    params = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, context), jnp.int32))["params"]
    start = time.perf_counter()
    applied = jaxamp.apply_policy(model, policy) if route == "apply_policy" else model
    loss_fn = train.make_loss_fn(applied.apply, "autocast" if route == "autocast" else "apply_policy", policy)
    state = jax.eval_shape(
        lambda: jaxamp.TrainState.create(
            apply_fn=applied.apply, params=params, tx=optax.adamw(1e-3), loss_scale=jaxamp.NoOpLossScale()
        )
    )
    jax.jit(train.make_train_step(loss_fn)).lower(state, windows)
    return time.perf_counter() - start


def run(args, out) -> None:
    depths = [int(depth) for depth in args.depths]
    out.print(
        f"jax {jax.__version__}, flax, backend {jax.default_backend()}, {os.cpu_count()} CPUs, "
        f"load average {os.getloadavg()[0]:.1f}"
    )
    out.print(
        f"GPT train step lowered (trace + rewrite, no XLA compile): width 768, 12 heads, context "
        f"{args.context}, batch {args.batch}, median of {args.rounds} interleaved rounds"
    )
    for depth in depths:
        lower_step("plain", depth, args.context, args.batch)  # warm JAX's own caches once
        seconds = {route: [] for route in ROUTES}
        for _ in range(args.rounds):
            for route in ROUTES:
                seconds[route].append(lower_step(route, depth, args.context, args.batch))
        plain = statistics.median(seconds["plain"])
        cells = "   ".join(
            f"{route} {statistics.median(times):6.2f} s ({statistics.median(times) / plain:.2f}x)"
            for route, times in seconds.items()
        )
        out.print(f"{depth:3d} layers   {cells}")
    out.save_printed("trace_cost.txt")
