"""What `jaxamp.autocast` costs: eager calls, a jitted gradient, and the traced program's activation bytes.

1. Eager calls of an MLP whose middle layer is a nested ``jax.jit``: the
   float32 function itself, autocast's first call (trace, rewrite, compile),
   its later calls (cached rewrite), and a naive autocast that rewrites on
   every call (a new wrapper each call, so the nested jit recompiles too).
2. ``jax.jit(autocast(f))`` against ``jax.jit(f)`` on this machine's backend.
3. Activation bytes in the traced program: bytes of the intermediate
   values of one forward pass of a small linen CNN by dtype, under
   ``autocast`` and under ``apply_policy`` (counted from the jaxpr, nested
   jaxprs included). This is what the program asks for, not what XLA
   allocates: fusion keeps most float32 values between ops out of memory.
   The memory and traffic of the compiled train step, by route, come from
   ``python -m experiments.benchmark --target h200``.

Times are medians of interleaved rounds (`experiments.benchmark.timing`).
Writes autocast_cost.txt.
"""

from __future__ import annotations

import collections
import os
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

import jaxamp
from experiments.benchmark.timing import interleaved_medians
from experiments.flags import positive_int


def add_arguments(parser) -> None:
    parser.add_argument(
        "--rounds", type=positive_int, default=7, help="interleaved rounds of the eager calls"
    )
    parser.add_argument(
        "--jit-rounds", type=positive_int, default=10, help="interleaved rounds of the jitted step"
    )


def _mlp(width):
    keys = jax.random.split(jax.random.key(0), 3)
    params = [jax.random.normal(key, (width, width)) / np.sqrt(width) for key in keys]
    inner = jax.jit(lambda h, w: jax.nn.relu(h @ w))

    def mlp(params, x):
        h = jax.nn.relu(x @ params[0])
        h = inner(h, params[1])
        return jax.nn.log_softmax(h @ params[2]).mean()

    return mlp, params


def eager_cost(out, rounds: int) -> None:
    mlp, params = _mlp(256)
    x = jax.random.normal(jax.random.key(1), (64, 256))
    jax.block_until_ready(mlp(params, x))
    autocast_mlp = jaxamp.autocast(mlp)
    start = time.perf_counter()
    jax.block_until_ready(autocast_mlp(params, x))
    first = time.perf_counter() - start
    medians = interleaved_medians(
        {
            "plain": lambda: mlp(params, x),
            "cached": lambda: autocast_mlp(params, x),
            "naive": lambda: jaxamp.autocast(mlp)(params, x),
        },
        rounds=rounds,
        steps=1,
        warmup=1,
    )
    plain, cached, naive = medians["plain"], medians["cached"], medians["naive"]
    out.print(
        f"1. eager calls, MLP 64x256, 3 matmuls (one in a nested jit), median ms ({rounds} interleaved rounds)"
    )
    out.print(f"   float32 function itself          {plain * 1e3:9.2f}")
    out.print(f"   autocast, first call             {first * 1e3:9.2f}")
    out.print(
        f"   autocast, later calls (cached)   {cached * 1e3:9.2f}   cached/float32 = {cached / plain:.2f}"
    )
    out.print(
        f"   autocast rewritten every call    {naive * 1e3:9.2f}   naive/cached   = {naive / cached:.1f}"
    )


def jit_cost(out, rounds: int) -> None:
    mlp, params = _mlp(1024)
    x = jax.random.normal(jax.random.key(1), (512, 1024))
    float32_step, half_step = jax.jit(jax.grad(mlp)), jax.jit(jax.grad(jaxamp.autocast(mlp)))
    medians = interleaved_medians(
        {"float32": lambda: float32_step(params, x), "half": lambda: half_step(params, x)},
        rounds=rounds,
        steps=1,
        warmup=1,
    )
    float32_time, half_time = medians["float32"], medians["half"]
    out.print(
        f"2. jit(grad) of an MLP 512x1024, 3 matmuls, on {jax.default_backend()}, "
        f"median ms ({rounds} interleaved rounds)"
    )
    out.print(
        f"   float32 {float32_time * 1e3:.1f}   autocast float16 {half_time * 1e3:.1f}   "
        f"autocast/float32 = {half_time / float32_time:.2f}"
    )


class SmallCNN(nn.Module):
    @nn.compact
    def __call__(self, x):
        for features in (16, 32):
            x = nn.Conv(features, (3, 3))(x)
            x = nn.relu(nn.BatchNorm(use_running_average=True)(x))
        return nn.Dense(10)(x.mean(axis=(1, 2)))


def _intermediate_bytes(jaxpr, totals):
    for equation in jaxpr.eqns:
        for variable in equation.outvars:
            aval = variable.aval
            if getattr(aval, "shape", ()) and jnp.issubdtype(aval.dtype, jnp.floating):
                totals[aval.dtype.name] += int(np.prod(aval.shape)) * aval.dtype.itemsize
        for value in equation.params.values():
            for candidate in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(candidate, "jaxpr", candidate)
                if hasattr(inner, "eqns"):
                    _intermediate_bytes(inner, totals)
    return totals


def activation_bytes(out) -> None:
    images = jnp.ones((8, 16, 16, 3))
    model = SmallCNN()
    variables = model.init(jax.random.key(0), images)
    policy_model = jaxamp.apply_policy(model, "mixed_float16")
    out.print("3. activation bytes of one forward pass of a small linen CNN (batch 8, 16x16), by dtype")
    for name, fun in (
        ("autocast(model.apply)", jaxamp.autocast(model.apply)),
        ("apply_policy(model).apply", policy_model.apply),
    ):
        totals = _intermediate_bytes(jax.make_jaxpr(fun)(variables, images).jaxpr, collections.Counter())
        total = sum(totals.values())
        shares = ", ".join(f"{dtype} {count / total:.0%}" for dtype, count in sorted(totals.items()))
        out.print(f"   {name:<27} {total / 1024:8.0f} KiB   {shares}")


def run(args, out) -> None:
    out.print(
        f"jax {jax.__version__}, backend {jax.default_backend()}, {jax.devices()[0].device_kind}, "
        f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}"
    )
    eager_cost(out, args.rounds)
    jit_cost(out, args.jit_rounds)
    activation_bytes(out)
    out.save_printed("autocast_cost.txt")
