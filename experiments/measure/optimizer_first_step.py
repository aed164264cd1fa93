"""Time to first step with low_precision_optimizer: a train step lowered and compiled, plain against 16- and 8-bit state.

For each model, the train step through `jaxamp.TrainState` (linen) or
`jaxamp.NNXOptimizer` (NNX, ``nnx.split`` under ``jax.jit``) with AdamW:

* ``plain``: the model under ``mixed_bfloat16`` (float32 params), plain
  ``optax.adamw``: the optimizer as optax runs it;
* ``bfloat16``, ``int8``, ``e4m3``: the model under ``bfloat16`` (bfloat16
  params) and ``jaxamp.low_precision_optimizer(optax.adamw(...))`` with the
  state in bfloat16 (stochastic rounding), int8 or float8_e4m3fn.

The models: ``mlp``, a linen MLP (64 -> 512 -> 512 -> 512 -> 10, batch 32);
``lm``, the small language model of ``experiments.lm`` (``--model small``,
context 128, batch 8: 4 blocks, 52 param leaves); ``lm-scan``, the same
model with its blocks scanned over (``scan_layers=True``: each block param
stacked over the layers, 16 leaves, as models that scan their layers hold
them); ``nnx``, ``experiments.models.nnx_cnn.NNXSmallCNN`` (batch 32); and,
when named, ``gpt2`` and ``gpt2-scan``, GPT-2 small's 12 blocks (context 128,
a vocabulary of 256) in either form. Each round builds every variant's model, optimizer and step
anew (no cache of JAX's or jaxamp's reused; the state is abstract) and
times ``jax.jit(step).lower(...)`` (tracing and the StableHLO program) and
``.compile()`` (XLA) for this machine's CPU or, with ``--target h200``
(any of `jaxamp.diagnostics`' GPUs; needs the CUDA PJRT plugin), for that
GPU: XLA's GPU compiler then runs on this CPU, as a GPU machine's first
step runs it (without the GEMM autotuning a real GPU adds to every
variant alike), and nothing runs; the rounds interleave the
variants, so the machine's load falls on all alike. The table gives the
medians of the wall time and of this process's CPU time (lowering and
compiling together; less sensitive to other jobs on a shared machine) and
each variant's ratio to ``plain``. Beside the times, which move between
runs on a shared machine, the compiled program's size, which does not: its
kernels (XLA's fusions) and the lines of its optimized HLO text. Writes
first_step.md.
"""

from __future__ import annotations

import dataclasses
import os
import re
import statistics
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax import nnx

import jaxamp
from experiments.flags import GPU_TARGET_NAMES, comma_list, positive_int
from experiments.lm import model as lm_model
from experiments.lm import train as lm_train
from experiments.measure.gpu_target import target_device
from experiments.measure.markdown import table
from experiments.models.nnx_cnn import NNXSmallCNN

VARIANTS = ("plain", "bfloat16", "int8", "e4m3")
MODELS = ("mlp", "lm", "lm-scan", "nnx", "gpt2", "gpt2-scan")
DEFAULT_MODELS = MODELS[:4]
_STATE_DTYPES = {"bfloat16": jnp.bfloat16, "int8": "int8", "e4m3": jnp.float8_e4m3fn}


def add_arguments(parser) -> None:
    parser.add_argument("--rounds", type=positive_int, default=3, help="interleaved rounds")
    parser.add_argument(
        "--models",
        type=comma_list(list(MODELS), what="model"),
        default=list(DEFAULT_MODELS),
        help="comma-separated",
    )
    parser.add_argument(
        "--target",
        choices=("cpu", *GPU_TARGET_NAMES),
        default="cpu",
        help="compile for this machine's CPU (default) or for a GPU, on this machine (the CUDA PJRT plugin)",
    )


def optimizer(variant: str) -> tuple[str, optax.GradientTransformation]:
    """The variant's policy and its optimizer."""
    adamw = optax.adamw(1e-3)
    if variant == "plain":
        return "mixed_bfloat16", adamw
    return "bfloat16", jaxamp.low_precision_optimizer(adamw, state_dtype=_STATE_DTYPES[variant], key=0)


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        for _ in range(3):
            x = nn.relu(nn.Dense(512)(x))
        return nn.Dense(10)(x)


def mlp_step(variant: str):
    """The linen MLP's step and its abstract arguments."""
    policy, tx = optimizer(variant)
    model = jaxamp.apply_policy(MLP(), policy)
    x, y = jax.ShapeDtypeStruct((32, 64), jnp.float32), jax.ShapeDtypeStruct((32,), jnp.int32)
    params = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, 64)))["params"])
    state = jax.eval_shape(lambda: jaxamp.TrainState.create(apply_fn=model.apply, params=params, tx=tx))

    def step(state, x, y):
        def loss_fn(params):
            logits = state.apply_fn({"params": params}, x).astype(jnp.float32)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        loss, grads, grads_finite = jaxamp.scaled_value_and_grad(loss_fn, state.loss_scale)(state.params)
        return state.apply_gradients(grads=grads, grads_finite=grads_finite), loss

    return step, (state, x, y)


def lm_step(variant: str, scan_layers: bool = False, size_name: str = "small"):
    """The language model's step (as `experiments.lm` builds it) and its abstract arguments: of size
    `size_name` (a key of `experiments.lm.config.SIZES`), context 128, its blocks scanned over when
    `scan_layers`."""
    policy_name, tx = optimizer(variant)
    policy = jaxamp.get_policy(policy_name)
    size = dataclasses.replace(lm_model.SIZES[size_name], context=128)
    gpt = lm_model.GPT(vocab_size=256, size=size, attention="xla", scan_layers=scan_layers)
    model = jaxamp.apply_policy(gpt, policy)
    sample = jnp.zeros((1, size.context), jnp.int32)
    params = jax.eval_shape(lambda: model.init(jax.random.key(0), sample)["params"])
    state = jax.eval_shape(lambda: jaxamp.TrainState.create(apply_fn=model.apply, params=params, tx=tx))
    windows = jax.ShapeDtypeStruct((8, size.context + 1), jnp.int32)
    return lm_train.make_train_step(lm_train.make_loss_fn(model.apply, "plain", policy)), (state, windows)


def nnx_step(variant: str):
    """The NNX CNN's step, ``nnx.split`` under ``jax.jit``, and its abstract arguments."""
    policy, tx = optimizer(variant)

    def make():
        model = jaxamp.apply_policy(NNXSmallCNN(nnx.Rngs(0)), policy)
        return model, jaxamp.NNXOptimizer(model, tx)

    graphdef, state = nnx.split(nnx.eval_shape(make))
    images, labels = jax.ShapeDtypeStruct((32, 32, 32, 3), jnp.float32), jax.ShapeDtypeStruct((32,), jnp.int32)

    def step(state, images, labels):
        model, optimizer = nnx.merge(graphdef, state)

        def loss_fn(model):
            logits = model(images).astype(jnp.float32)
            return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

        loss, grads, grads_finite = jaxamp.scaled_value_and_grad(loss_fn, optimizer.loss_scale)(model)
        optimizer.update(model, grads, grads_finite=grads_finite)
        return nnx.state((model, optimizer)), loss

    return step, (state, images, labels)


STEPS = {
    "mlp": mlp_step,
    "lm": lm_step,
    "lm-scan": lambda variant: lm_step(variant, scan_layers=True),
    "gpt2": lambda variant: lm_step(variant, size_name="gpt2"),
    "gpt2-scan": lambda variant: lm_step(variant, scan_layers=True, size_name="gpt2"),
    "nnx": nnx_step,
}


def program_size(compiled) -> tuple[int, int]:
    """The kernels (fusions) of a compiled program and the lines of its optimized HLO text."""
    text = compiled.as_text()
    return len(re.findall(r"= \S+ fusion\(", text)), text.count("\n")


def first_step(model: str, variant: str, device=None) -> tuple[float, float, float, tuple[int, int]]:
    """Seconds to build and lower, and to compile, one train step of `model` under `variant`, the CPU
    seconds of both (this process's: less sensitive to other jobs on the machine), and the compiled
    program's `program_size`; for `device` (a GPU target's compile-only device) when given, else for
    this machine's CPU."""
    start, start_cpu = time.perf_counter(), time.process_time()
    step, arguments = STEPS[model](variant)
    if device is not None:
        arguments = jaxamp.diagnostics.on_device(arguments, device)
    lowered = jax.jit(step).lower(*arguments)
    lowered_at = time.perf_counter()
    compiled = lowered.compile()
    seconds = (lowered_at - start, time.perf_counter() - lowered_at, time.process_time() - start_cpu)
    return (*seconds, program_size(compiled))


def run(args, out) -> None:
    device = None if args.target == "cpu" else target_device(args.target)
    compiled_for = (
        "this CPU" if device is None else f"{jaxamp.diagnostics.gpu_spec(args.target).description} (on this CPU)"
    )
    out.print(
        f"jax {jax.__version__}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; AdamW train "
        f"step lowered and compiled for {compiled_for}; medians of {args.rounds} interleaved rounds"
    )
    rows = []
    for model in args.models:
        first_step(model, "plain", device)  # JAX's own first-use costs, paid once before the rounds
        lower = {variant: [] for variant in VARIANTS}
        total = {variant: [] for variant in VARIANTS}
        cpu = {variant: [] for variant in VARIANTS}
        size = {}
        for _ in range(args.rounds):
            for variant in VARIANTS:
                lower_s, compile_s, cpu_s, size[variant] = first_step(model, variant, device)
                lower[variant].append(lower_s)
                total[variant].append(lower_s + compile_s)
                cpu[variant].append(cpu_s)
        plain_total, plain_cpu = statistics.median(total["plain"]), statistics.median(cpu["plain"])
        for variant in VARIANTS:
            median_total, median_lower = statistics.median(total[variant]), statistics.median(lower[variant])
            median_cpu = statistics.median(cpu[variant])
            rows.append([
                model, variant, f"{median_lower:.2f}", f"{median_total - median_lower:.2f}", f"{median_total:.2f}",
                f"{median_total / plain_total:.2f}x", f"{median_cpu:.2f}", f"{median_cpu / plain_cpu:.2f}x",
                f"{size[variant][0]:,}", f"{size[variant][1]:,}",
            ])  # fmt: skip
            out.print(f"{model} {variant}: lower {median_lower:.2f} s, total {median_total:.2f} s, CPU {median_cpu:.2f} s")
    header = [
        "model", "state", "lower s", "compile s", "total s", "total / plain", "CPU s", "CPU / plain", "kernels",
        "HLO lines",
    ]  # fmt: skip
    out.print(table(header, rows))
    out.save_printed("first_step.md")
