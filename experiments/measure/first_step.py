"""Time to first step: the GPT train step traced, lowered and compiled, plain, hand-cast and through jaxamp.

The step is the language model's (`experiments.lm`): GPT-2's width (768,
12 heads), context 256, batch 8, AdamW through `jaxamp.TrainState`, at 12
layers by default. The routes:

* ``plain``: the float32 model, no jaxamp;
* ``hand_cast``: the recipe JAX language-model code bases use, the anchor:
  the params cast to bfloat16 at the step's entry, the plain model on them;
* ``autocast``: the plain model's loss under ``jaxamp.autocast(...,
  "mixed_bfloat16")`` (traced in bfloat16, and once more as given for its
  constants);
* ``apply_policy``: the model under ``jaxamp.apply_policy(...,
  "mixed_bfloat16")``.

Per target (this machine's CPU, and an H200 compiled for without a GPU
where the CUDA plugin is installed), each round builds every route's step,
model wrapper and autocast anew (no cache of JAX's or jaxamp's reused) and
times ``jax.jit(step).lower(...)`` (tracing, jaxamp's rewrite and the
StableHLO program) and ``.compile()`` (XLA) apart; rounds interleave the
routes, so the machine's load falls on all alike. The table gives the
medians and each route's ratio to ``hand_cast``. Writes first_step.md.
"""

from __future__ import annotations

import os
import statistics
import time

import jax
import jax.numpy as jnp
import optax

import jaxamp
from experiments.flags import positive_int
from experiments.lm import model as model_lib
from experiments.lm import train
from experiments.lm.on_paper import hand_cast_loss
from experiments.measure.markdown import table

ROUTES = ("plain", "hand_cast", "autocast", "apply_policy")


def add_arguments(parser) -> None:
    parser.add_argument("--layers", type=positive_int, default=12, help="the GPT's depth")
    parser.add_argument("--context", type=positive_int, default=256, help="tokens per sequence")
    parser.add_argument("--batch", type=positive_int, default=8, help="sequences per step")
    parser.add_argument("--rounds", type=positive_int, default=2, help="interleaved rounds")
    parser.add_argument(
        "--targets", default="cpu,h200", help="comma-separated: cpu and/or a GPU target such as h200"
    )


def first_step(route: str, args, device) -> tuple[float, float]:
    """Seconds to lower and to compile one train step of `route` for `device` (None: this CPU)."""
    size = model_lib.GPTSize(num_layers=args.layers, d_model=768, num_heads=12, context=args.context)
    model = model_lib.GPT(vocab_size=50304, size=size, attention="xla")
    policy = jaxamp.get_policy("mixed_bfloat16")
    params = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, args.context), jnp.int32))["params"]
    windows = jax.ShapeDtypeStruct((args.batch, args.context + 1), jnp.int32)
    start = time.perf_counter()
    applied = jaxamp.apply_policy(model, policy) if route == "apply_policy" else model
    if route == "hand_cast":
        loss_fn = hand_cast_loss(model.apply, policy.compute_dtype)
    else:
        loss_fn = train.make_loss_fn(applied.apply, "autocast" if route == "autocast" else "plain", policy)
    state = jax.eval_shape(
        lambda: jaxamp.TrainState.create(
            apply_fn=applied.apply, params=params, tx=optax.adamw(1e-3), loss_scale=jaxamp.NoOpLossScale()
        )
    )
    arguments = (state, windows) if device is None else jaxamp.diagnostics.on_device((state, windows), device)
    lowered = jax.jit(train.make_train_step(loss_fn)).lower(*arguments)
    lowered_at = time.perf_counter()
    lowered.compile()
    return lowered_at - start, time.perf_counter() - lowered_at


def run(args, out) -> None:
    targets = [name.strip() for name in args.targets.split(",") if name.strip()]
    out.print(
        f"jax {jax.__version__}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; GPT train step, "
        f"{args.layers} layers, width 768, context {args.context}, batch {args.batch}, mixed_bfloat16; "
        f"medians of {args.rounds} interleaved rounds"
    )
    rows = []
    for target in targets:
        if target == "cpu":
            device = None
        elif not jaxamp.diagnostics.cuda_plugin_available():
            out.print(f"{target}: left out (needs pip install 'jax-mixed-precision[gpu-aot]')")
            continue
        else:
            device = jaxamp.diagnostics.gpu_target_device(target)
        first_step("plain", args, device)  # JAX's own first-use costs, paid once before the rounds
        lower = {route: [] for route in ROUTES}
        total = {route: [] for route in ROUTES}
        for _ in range(args.rounds):
            for route in ROUTES:
                lower_s, compile_s = first_step(route, args, device)
                lower[route].append(lower_s)
                total[route].append(lower_s + compile_s)
        anchor_total, anchor_lower = statistics.median(total["hand_cast"]), statistics.median(lower["hand_cast"])
        for route in ROUTES:
            median_total, median_lower = statistics.median(total[route]), statistics.median(lower[route])
            rows.append(
                [
                    target,
                    route,
                    f"{median_lower:.2f}",
                    f"{median_total - median_lower:.2f}",
                    f"{median_total:.2f}",
                    f"{median_total / anchor_total:.2f}x",
                    f"{median_lower / anchor_lower:.2f}x",
                ]
            )
    header = ["target", "route", "lower s", "compile s", "total s", "total / hand_cast", "lower / hand_cast"]
    out.print(table(header, rows))
    out.save_printed("first_step.md")
