"""What bfloat16 master weights and AdamW state cost and save in the language model, by part.

    optimizer-lm-cost memory        # GPT-2 (124M) compiled for an H200 without one: bytes per param, step memory
    optimizer-lm-cost cpu-time      # the small model's train step on this CPU: each rounding's time against nearest's
    optimizer-lm-cost update-bytes  # the optimizer's update alone, for the params and the largest leaf: bytes per param
    optimizer-lm-cost count         # bytes per param from the abstract train state alone (no compile)

Each recipe is a ``--precisions`` name of ``experiments.lm``, built by the
recipe's own code (`experiments.lm.train.create_optimizer`: AdamW, clipped,
wrapped by the optimizer a policy's update rounding asks for, `jaxamp.low_precision_optimizer`,
where the policy names one). ``memory`` counts the bytes of params,
optimizer state and gradients from the abstract train state, then compiles
(a) the whole train step and (b) the optimizer update alone (``tx.update``
and ``optax.apply_updates``) for the target, and reads their memory analysis
and bytes moved (`jaxamp.diagnostics.bytes_accessed`), and writes each
recipe's figures as a line of memory_rows.jsonl as soon as it has them
(``--rows FILE`` makes the table again from such a file, compiling nothing).
``cpu-time`` compiles the small model's step per recipe and times one step
of every recipe in turn, round after round, so that every recipe sees the
same load (`experiments.benchmark.timing`); it reports the median and the
quartiles. Each part writes PART.md (cpu-time: cpu_time.md, update-bytes:
update_bytes.md); the compiled parts need the CUDA PJRT plugin.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxamp
from experiments.benchmark.timing import interleaved_samples
from experiments.benchmark.workload import memory_of
from experiments.flags import GPU_TARGET_NAMES, comma_list, positive_int
from experiments.lm import on_paper, train
from experiments.lm.config import SIZES, LMConfig
from experiments.lm.sharding import Sharding
from experiments.measure.gpu_target import compile_for, target_device
from experiments.train import resolve_precision

RECIPES = {
    "mixed_bf16": "float32 master (mixed_bf16)",
    "bfloat16": "bfloat16, optax as is",
    "bfloat16_nearest": "bfloat16 nearest",
    "bfloat16_stochastic": "bfloat16 stochastic",
    "bfloat16_kahan": "bfloat16 Kahan",
    "bfloat16_int8": "8-bit state, int8 code",
    "bfloat16_fp8": "8-bit state, float8_e4m3fn",
    "bfloat16_int8_per_tensor": "8-bit state, int8, one scale per leaf",
}
GIB = 2**30


def tree_bytes(tree) -> int:
    return sum(leaf.size * np.dtype(leaf.dtype).itemsize for leaf in jax.tree.leaves(tree))


def abstract_state_and_grads(config: LMConfig, vocab_size: int):
    """The train state the recipe builds, and the gradients its step computes, as shapes and dtypes."""
    precision = resolve_precision(config.precision)
    model, _ = train.create_model(config, precision, vocab_size, "gpu")
    tx = train.create_optimizer(config)
    context = config.sequence_length
    state = jax.eval_shape(lambda: train.create_train_state(config, precision, model, context, tx))
    loss_fn = train.make_loss_fn(model.apply, config.route, precision.policy)
    windows = jax.ShapeDtypeStruct((config.batch_size, context + 1), jnp.int32)
    _, grads, _ = jax.eval_shape(
        lambda state, windows: jaxamp.scaled_value_and_grad(loss_fn, state.loss_scale)(state.params, windows),
        state,
        windows,
    )
    return state, grads, tx


def compile_update(params, opt_state, grads, tx, device):
    """The optimizer's update and its application, compiled for `device` (params and state donated)."""

    def update(params, opt_state, grads):
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return compile_for(update, (params, opt_state, grads), device, donate_argnums=(0, 1)).compiled


def compile_optimizer_alone(state, grads, tx, device):
    """The optimizer's update and its application, compiled for `device`; (memory, bytes moved)."""
    compiled = compile_update(state.params, state.opt_state, grads, tx, device)
    return memory_of(compiled), jaxamp.diagnostics.bytes_accessed(compiled.as_text())


def memory(args, out) -> str:
    spec = jaxamp.diagnostics.gpu_spec(args.target)
    device = target_device(spec)
    rows = []
    for name in args.recipes:
        config = LMConfig(model=args.model, precision=name, batch_size=args.batch_size)
        try:
            state, grads, tx = abstract_state_and_grads(config, on_paper.GPT2_VOCAB)
        except RuntimeError as error:  # libcudnn not importable: the einsum attention, as on_paper does
            if "cuDNN" not in str(error):
                raise
            config = dataclasses.replace(config, attention="einsum")
            state, grads, tx = abstract_state_and_grads(config, on_paper.GPT2_VOCAB)
        num_params = sum(leaf.size for leaf in jax.tree.leaves(state.params))
        optimizer_memory, optimizer_bytes = compile_optimizer_alone(state, grads, tx, device)
        start = time.perf_counter()
        step = on_paper.compile_with_attention_fallback(args.target, config, on_paper.GPT2_VOCAB)
        rows.append(
            {
                "name": name,
                "num_params": num_params,
                "params": tree_bytes(state.params),
                "opt_state": tree_bytes(state.opt_state),
                "grads": tree_bytes(grads),
                "step": step["memory"],
                "step_bytes_moved": step["bytes_accessed_per_step"],
                "optimizer": optimizer_memory,
                "optimizer_bytes_moved": optimizer_bytes,
                "compile_s": time.perf_counter() - start,
                "attention": step["attention"],
            }
        )
        out.write(
            "memory_rows.jsonl", "".join(json.dumps(row) + "\n" for row in rows)
        )  # each row as it comes
        print(f"  {name}: compiled in {rows[-1]['compile_s']:.0f} s", flush=True)
    return memory_table(rows, args, device.device_kind, out.command)


def memory_table(rows: list[dict], args, device_kind: str, command: str) -> str:
    """The memory part's Markdown, from its rows (as `memory` measures them, or read back from their JSON)."""
    base = rows[0]
    lines = [
        (
            f"# bfloat16 master weights and AdamW state: the `{args.model}` LM ({base['num_params'] / 1e6:.1f}M "
            "params) compiled "
            f"for {device_kind}, on paper"
        ),
        "",
        f"Command: `{command}`",
        (
            f"(JAX {jax.__version__}, no GPU: each program is compiled for the target's compile-only device; "
            f"batch {args.batch_size} x {LMConfig(model=args.model).sequence_length} tokens, vocabulary "
            f"{on_paper.GPT2_VOCAB}, the `experiments.lm` recipe's AdamW, attention "
            f"`{base['attention']}`)."
        ),
        "",
        (
            "Bytes per parameter: params, optimizer state and gradients, counted from the abstract train state "
            "and the step's gradients. Step: `memory_analysis()` of the whole train step compiled for the "
            "target (arguments, temp, outputs; arguments and outputs alias through donation, so what the step "
            "holds at once is about arguments + temp). Bytes moved: `jaxamp.diagnostics.bytes_accessed` of the "
            "optimized program, for the whole step and for the optimizer's update alone (`tx.update` and "
            "`optax.apply_updates`, compiled by itself)."
        ),
        "",
        (
            f"| recipe | params B/param | state B/param | params + state B/param | vs `{base['name']}` "
            "| + grads B/param | step arguments GiB | step temp GiB | step outputs GiB | step total GiB "
            f"| step GB moved | optimizer GB moved | optimizer bytes vs `{base['name']}` |"
        ),
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        n = row["num_params"]
        kept = (row["params"] + row["opt_state"]) / n
        relative = row["optimizer_bytes_moved"] / base["optimizer_bytes_moved"]
        lines.append(
            f"| {RECIPES.get(row['name'], row['name'])} (`{row['name']}`) | {row['params'] / n:.2f} "
            f"| {row['opt_state'] / n:.2f} | {kept:.2f} "
            f"| {kept / ((base['params'] + base['opt_state']) / base['num_params']):.3f} "
            f"| {(row['params'] + row['opt_state'] + row['grads']) / n:.2f} "
            f"| {row['step']['argument_bytes'] / GIB:.2f} | {row['step']['temp_bytes'] / GIB:.2f} "
            f"| {row['step']['output_bytes'] / GIB:.2f} | {row['step']['total_bytes'] / GIB:.2f} "
            f"| {row['step_bytes_moved'] / 1e9:.1f} | {row['optimizer_bytes_moved'] / 1e9:.2f} | {relative:.2f}x |"
        )
    lines += [
        "",
        "Compile seconds: " + ", ".join(f"{row['name']} {row['compile_s']:.0f}" for row in rows) + ".",
    ]
    return "\n".join(lines) + "\n"


def cpu_time(args, out) -> str:
    sharding = Sharding.over_all_devices("fsdp")
    compiled, states = {}, {}
    windows = None
    for name in args.recipes:
        config = LMConfig(model="small", precision=name, batch_size=8, steps=150)
        precision = resolve_precision(name)
        model, _ = train.create_model(config, precision, 256, "cpu")
        context = config.sequence_length
        compiled[name] = train.compile_steps(config, precision, model, sharding, context)
        states[name] = compiled[name].init()
        if windows is None:
            windows = jax.random.randint(
                jax.random.key(0), (config.batch_size, context + 1), 0, 256, jnp.int32
            )

    def one_step(name):
        def step():
            states[name], metrics = compiled[name].train_step(states[name], windows)
            return states[name], metrics

        return step

    print(f"  timing {len(args.recipes)} recipes: {args.rounds} rounds", flush=True)
    start_all = time.perf_counter()
    times = interleaved_samples(
        {name: one_step(name) for name in args.recipes}, args.rounds, steps=1, warmup=1
    )
    wall = time.perf_counter() - start_all
    median = {name: statistics.median(values) for name, values in times.items()}
    nearest = median.get("bfloat16_nearest")

    lines = [
        "# bfloat16 master weights and AdamW state: step time of the small language model on this CPU",
        "",
        f"Command: `{out.command}`",
        (
            f"(JAX {jax.__version__}, {jax.devices()[0].platform} x{jax.device_count()}, {os.cpu_count()} CPUs; "
            f"load average {os.getloadavg()[0]:.1f} at the end; {wall:.0f} s of timing)."
        ),
        "",
        (
            "The `experiments.lm` small model (0.84M params, batch 8 x 128 tokens), its train step compiled per "
            "recipe by the recipe's own code (forward, backward, AdamW update). Each round times one step of "
            "every recipe in turn; cells are the median over the rounds, and the quartiles."
        ),
        "",
        "| recipe | ms/step (median) | quartiles | step vs nearest |",
        "|---|---:|---:|---:|",
    ]
    for name in args.recipes:
        quartiles = np.percentile(times[name], [25, 75]) * 1e3
        relative = f"{median[name] / nearest:.2f}x" if nearest else "n/a"
        lines.append(
            f"| {RECIPES.get(name, name)} (`{name}`) | {median[name] * 1e3:.1f} "
            f"| {quartiles[0]:.1f} to {quartiles[1]:.1f} | {relative} |"
        )
    return "\n".join(lines) + "\n"


def count(args, out) -> str:
    """Bytes per parameter of params and optimizer state, from the abstract train state alone (no compile)."""
    lines = [
        f"Counted, not compiled: `{out.command}` (`jax.eval_shape` of the recipe's train state).",
        "",
        f"| recipe | params B/param | state B/param | params + state B/param | vs `{args.recipes[0]}` |",
        "|---|---:|---:|---:|---:|",
    ]
    base = None
    for name in args.recipes:
        config = LMConfig(model=args.model, precision=name, batch_size=args.batch_size)
        precision = resolve_precision(name)
        model, _ = train.create_model(config, precision, on_paper.GPT2_VOCAB, "cpu")
        tx = train.create_optimizer(config)
        state = jax.eval_shape(
            lambda: train.create_train_state(config, precision, model, config.sequence_length, tx)  # noqa: B023
        )
        n = sum(leaf.size for leaf in jax.tree.leaves(state.params))
        kept = (tree_bytes(state.params) + tree_bytes(state.opt_state)) / n
        base = base or kept
        lines.append(
            f"| `{name}` | {tree_bytes(state.params) / n:.2f} | {tree_bytes(state.opt_state) / n:.2f} "
            f"| {kept:.2f} | {kept / base:.3f} |"
        )
    return "\n".join(lines) + "\n"


def update_bytes(args, out) -> str:
    """Bytes moved per parameter by the optimizer's update alone, for the model's params and for
    one leaf of the embedding's shape, with each update's heaviest kernels (compiled for the target)."""
    spec = jaxamp.diagnostics.gpu_spec(args.target)
    device = target_device(spec)
    lines = [
        (
            f"Command: `{out.command}` (JAX {jax.__version__}). The optimizer's "
            "update and its application (`tx.update`, `optax.apply_updates`) compiled alone for the target, "
            "for the model's params and the step's gradients, and for one leaf of the embedding's shape "
            "alone; bytes moved (`jaxamp.diagnostics.bytes_accessed`) per parameter, and the three "
            "heaviest kernels (`jaxamp.diagnostics.kernel_roofline`)."
        ),
        "",
        "| recipe | params | B/param moved | heaviest kernels, B/param |",
        "|---|---|---:|---|",
    ]
    for name in args.recipes:
        config = LMConfig(model=args.model, precision=name, batch_size=args.batch_size, attention="einsum")
        state, grads, tx = abstract_state_and_grads(config, on_paper.GPT2_VOCAB)
        embedding = max(jax.tree.leaves(state.params), key=lambda leaf: leaf.size)
        one_leaf = {"embedding": jax.ShapeDtypeStruct(embedding.shape, embedding.dtype)}
        one_grad = {"embedding": jax.ShapeDtypeStruct(embedding.shape, jax.tree.leaves(grads)[0].dtype)}
        for label, params, leaf_grads in (
            (f"the model's ({len(jax.tree.leaves(state.params))} leaves)", state.params, grads),
            (f"one leaf {embedding.shape}", one_leaf, one_grad),
        ):
            opt_state = jax.eval_shape(tx.init, params)
            text = compile_update(params, opt_state, leaf_grads, tx, device).as_text()
            n = sum(leaf.size for leaf in jax.tree.leaves(params))
            kernels = sorted(jaxamp.diagnostics.kernel_roofline(text, spec).kernels, key=lambda k: -k.bytes)
            heaviest = ", ".join(f"{kernel.name} {kernel.bytes / n:.2f}" for kernel in kernels[:3])
            lines.append(
                f"| `{name}` | {label} | {jaxamp.diagnostics.bytes_accessed(text) / n:.2f} | {heaviest} |"
            )
            print(lines[-1], flush=True)
    return "\n".join(lines) + "\n"


PARTS = {"memory": memory, "cpu-time": cpu_time, "count": count, "update-bytes": update_bytes}


def add_arguments(parser) -> None:
    parser.add_argument("part", choices=list(PARTS), help="what to measure (see above)")
    parser.add_argument(
        "--recipes", type=comma_list(None), default=list(RECIPES), help="experiments.lm precisions"
    )
    parser.add_argument("--target", choices=GPU_TARGET_NAMES, default="h200", help="the GPU to compile for")
    parser.add_argument(
        "--model", choices=sorted(SIZES), default="gpt2", help="the experiments.lm model size"
    )
    parser.add_argument("--batch-size", type=positive_int, default=8, help="sequences per step")
    parser.add_argument("--rounds", type=positive_int, default=40, help="cpu-time: interleaved timing rounds")
    parser.add_argument(
        "--rows", help="memory: make the table of these JSON rows (memory_rows.jsonl), compile nothing"
    )


def run(args, out) -> None:
    if args.rows:  # the table of rows measured by an earlier `memory` run
        with open(args.rows, encoding="utf-8") as file:
            rows = [json.loads(line) for line in file if line.startswith("{")]
        args.recipes = [row["name"] for row in rows]
        device_kind = jaxamp.diagnostics.gpu_spec(args.target).description
        text = memory_table(rows, args, device_kind, out.command)
    else:
        text = PARTS[args.part](args, out)
    out.print(text.rstrip())
    out.write(f"{args.part.replace('-', '_')}.md", text)
