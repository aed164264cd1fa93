"""What `jaxamp.autocast` costs, measured side by side in one run.

    python scripts/autocast_cost.py > results/cpu/autocast_cost.txt

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
"""

from __future__ import annotations

import collections
import os
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

import jaxamp


def _block(fun, *args):
    return jax.block_until_ready(fun(*args))


def _interleaved_medians(functions, *args, rounds):
    """Median seconds per call of each function, timed in alternating rounds.

    Alternating spreads a busy machine's noise over all of them alike, so
    their ratios hold even when the absolute times do not.
    """
    times = [[] for _ in functions]
    for _ in range(rounds):
        for fun, samples in zip(functions, times):
            start = time.perf_counter()
            _block(fun, *args)
            samples.append(time.perf_counter() - start)
    return [statistics.median(samples) for samples in times]


def _mlp(width):
    keys = jax.random.split(jax.random.key(0), 3)
    params = [jax.random.normal(key, (width, width)) / np.sqrt(width) for key in keys]
    inner = jax.jit(lambda h, w: jax.nn.relu(h @ w))

    def mlp(params, x):
        h = jax.nn.relu(x @ params[0])
        h = inner(h, params[1])
        return jax.nn.log_softmax(h @ params[2]).mean()

    return mlp, params


def eager_cost():
    mlp, params = _mlp(256)
    x = jax.random.normal(jax.random.key(1), (64, 256))
    _block(mlp, params, x)
    autocast_mlp = jaxamp.autocast(mlp)
    start = time.perf_counter()
    _block(autocast_mlp, params, x)
    first = time.perf_counter() - start
    naive_mlp = lambda params, x: jaxamp.autocast(mlp)(params, x)
    plain, cached, naive = _interleaved_medians((mlp, autocast_mlp, naive_mlp), params, x, rounds=7)
    print("1. eager calls, MLP 64x256, 3 matmuls (one in a nested jit), median ms (7 interleaved rounds)")
    print(f"   float32 function itself          {plain * 1e3:9.2f}")
    print(f"   autocast, first call             {first * 1e3:9.2f}")
    print(f"   autocast, later calls (cached)   {cached * 1e3:9.2f}   cached/float32 = {cached / plain:.2f}")
    print(f"   autocast rewritten every call    {naive * 1e3:9.2f}   naive/cached   = {naive / cached:.1f}")


def jit_cost():
    mlp, params = _mlp(1024)
    x = jax.random.normal(jax.random.key(1), (512, 1024))
    float32_step, half_step = jax.jit(jax.grad(mlp)), jax.jit(jax.grad(jaxamp.autocast(mlp)))
    _block(float32_step, params, x)
    _block(half_step, params, x)
    float32_time, half_time = _interleaved_medians((float32_step, half_step), params, x, rounds=10)
    print(
        f"2. jit(grad) of an MLP 512x1024, 3 matmuls, on {jax.default_backend()}, median ms (10 interleaved rounds)"
    )
    print(
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


def activation_bytes():
    images = jnp.ones((8, 16, 16, 3))
    model = SmallCNN()
    variables = model.init(jax.random.key(0), images)
    policy_model = jaxamp.apply_policy(model, "mixed_float16")
    print("3. activation bytes of one forward pass of a small linen CNN (batch 8, 16x16), by dtype")
    for name, fun in (
        ("autocast(model.apply)", jaxamp.autocast(model.apply)),
        ("apply_policy(model).apply", policy_model.apply),
    ):
        totals = _intermediate_bytes(jax.make_jaxpr(fun)(variables, images).jaxpr, collections.Counter())
        total = sum(totals.values())
        shares = ", ".join(f"{dtype} {count / total:.0%}" for dtype, count in sorted(totals.items()))
        print(f"   {name:<27} {total / 1024:8.0f} KiB   {shares}")


if __name__ == "__main__":
    print(
        f"jax {jax.__version__}, backend {jax.default_backend()}, {jax.devices()[0].device_kind}, "
        f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}"
    )
    eager_cost()
    jit_cost()
    activation_bytes()
