"""One transformer layer at TransformerEngine's shape, compiled for a GPU without one: FP8 against bfloat16.

    PYTHONPATH=/path/to/cuda_plugin JAX_PLATFORMS=cpu \\
        python scripts/fp8_layer_on_paper.py --out results/cpu/fp8_pays/te_layer.md

TransformerEngine's JAX layer benchmark shape: d_model 4096, 32 heads, FFN
16384, sequence 2048, batch 8, one layer. The layer is the language
model's own `experiments.lm.model.Block` (pre-LayerNorm attention with the
einsum attention, GELU MLP), its train step AdamW on float32 params, the
loss (mean square of the layer's output) through `jaxamp.autocast`, the
input a bfloat16 activation as a layer inside a bfloat16 model gets it.
The step is compiled for the target (`jaxamp.diagnostics.gpu_target_device`)
under ``mixed_bf16``, under ``mixed_float8`` with FP8 where it pays on the
target (the default) and with FP8 at every eligible matmul, and each
program bounded on paper: globally, and kernel by kernel
(`jaxamp.diagnostics.kernel_roofline`), by kind of kernel
(`experiments.lm.on_paper.kernel_class`). A bound, not a measurement.

The ``delayed`` row is ``mixed_float8`` (FP8 where it pays) with delayed
scaling (`jaxamp.fp8.delayed_scaling`, the amaxes out through the probe's
gradient): the program of a step after the first (its
`jaxamp.fp8.Fp8History` recorded), each operand cast to FP8 with the scale
from the history's amax, the history (1024 steps, "max") rolled in the
step. Like the other rows it applies its updates unconditionally, without
`jaxamp.fp8.delayed_value_and_grad`'s gradient finiteness check (which
every row would pay alike), so that only the scaling differs.
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import jax
import jax.numpy as jnp
import optax

import jaxamp
from experiments.lm import model as model_lib
from experiments.lm import on_paper

VARIANTS = (
    ("mixed_bf16", "pays", "current"),
    ("mixed_float8", "pays", "current"),
    ("mixed_float8", "everywhere", "current"),
    ("mixed_float8", "pays", "delayed"),
)


def compile_layer(
    target: str,
    precision: str,
    fp8_where: str,
    d_model,
    heads,
    batch,
    sequence,
    attention="einsum",
    scaling: str = "current",
) -> dict:
    """The layer's train step compiled for `target`, with its bounds on paper."""
    spec = jaxamp.diagnostics.gpu_spec(target)
    device = jaxamp.diagnostics.gpu_target_device(spec)
    layer = model_lib.Block(heads, attention, 1.0)
    # The params are the same for every attention; cuDNN's takes half operands only: init with einsum.
    init_layer = model_lib.Block(heads, "einsum", 1.0)
    x = jax.ShapeDtypeStruct((batch, sequence, d_model), jnp.bfloat16)
    params = jax.eval_shape(
        lambda: init_layer.init(jax.random.key(0), jnp.zeros((1, sequence, d_model)))["params"]
    )
    tx = optax.adamw(1e-4, b1=0.9, b2=0.95, weight_decay=0.1)
    opt_state = jax.eval_shape(tx.init, params)

    def loss_fn(params, x):
        y = layer.apply({"params": params}, x)
        return jnp.mean(jnp.square(y.astype(jnp.float32)))

    loss = jaxamp.autocast(loss_fn, precision)

    def step(params, opt_state, x):
        value, grads = jax.value_and_grad(loss)(params, x)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    def delayed_step(params, opt_state, history, x):
        def probed(params, probe, x):
            with jaxamp.fp8.delayed_scaling(history, probe):
                return loss(params, x)

        probe = jnp.zeros((history.rows, 3), jnp.float32)
        value, (grads, amaxes) = jax.value_and_grad(probed, argnums=(0, 1))(params, probe, x)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, history.record(amaxes), value

    def deciding():
        return jaxamp.diagnostics.fp8_target(spec if fp8_where == "pays" else "everywhere")

    if scaling == "delayed":
        with deciding():
            history = jaxamp.fp8.init_fp8_history(loss, params, x)
        # The program of every step after the first: the history holds amaxes.
        history = jax.eval_shape(lambda: history.replace(recorded=True))
        args = jaxamp.diagnostics.on_device((params, opt_state, history, x), device)
        step = delayed_step
    else:
        args = jaxamp.diagnostics.on_device((params, opt_state, x), device)
    start = time.perf_counter()
    with deciding():
        lowered = jax.jit(step, donate_argnums=(0, 1)).lower(*args)
        compiled = lowered.compile()
    compile_s = time.perf_counter() - start
    text = compiled.as_text()
    report = jaxamp.diagnostics.hlo_precision_report(text, jaxamp.diagnostics.lowered_hlo_text(lowered))
    kernels = jaxamp.diagnostics.kernel_roofline(text, spec)
    return {
        "precision": precision,
        "fp8_where": fp8_where if precision == "mixed_float8" else None,
        "scaling": scaling if precision == "mixed_float8" else None,
        "compile_s": compile_s,
        "bytes_accessed": jaxamp.diagnostics.bytes_accessed(text),
        "matmul_flops_by_dtype": report.flops_by_dtype(),
        "gemm_flops_fp8_share": report.fp8_fraction(),
        "fp8_rows": [dict(vars(row), why=row.why) for row in report.fp8_rows()],
        "global_s": kernels.global_s,
        "per_kernel_s": kernels.per_kernel_s,
        "per_kernel_by_class_s": on_paper.kernel_classes(kernels),
        "cudnn_attention_calls": text.count("__cudnn$fmha"),
    }


def markdown(entries: list[dict], command: str, target: str, shape: str) -> str:
    bf16 = next(entry for entry in entries if entry["precision"] == "mixed_bf16")
    lines = [
        f"# One transformer layer compiled for {jaxamp.diagnostics.gpu_spec(target).description}, on paper",
        "",
        f"Command: `{command}`",
        "",
        f"Shape: {shape}; jax {jax.__version__}; {datetime.date.today().isoformat()}.",
        "",
        (
            "| precision | FP8 | scaling | GB moved | GEMM FLOPs in FP8 | global ms | per-kernel ms "
            "| per kernel vs bf16 | GEMMs ms | FP8 quantization ms | other ms | compile s |"
        ),
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for entry in entries:
        classes = entry["per_kernel_by_class_s"]
        gemms = classes.get("FP8 GEMMs", 0.0) + classes.get("other GEMMs", 0.0)
        lines.append(
            f"| {entry['precision']} | {entry['fp8_where'] or ''} | {entry.get('scaling') or ''} "
            f"| {entry['bytes_accessed'] / 1e9:.1f} "
            f"| {entry['gemm_flops_fp8_share']:.1%} | {entry['global_s'] * 1e3:.2f} | {entry['per_kernel_s'] * 1e3:.2f} "
            f"| {bf16['per_kernel_s'] / entry['per_kernel_s']:.2f}x | {gemms * 1e3:.2f} "
            f"| {classes.get('FP8 quantization', 0.0) * 1e3:.2f} | {classes.get('other', 0.0) * 1e3:.2f} "
            f"| {entry['compile_s']:.0f} |"
        )
    lines += ["", "FP8 outcomes (`PrecisionReport.fp8_rows`):", ""]
    lines += [
        "| precision | FP8 | scaling | outcome | pass | why | ops | GFLOP |",
        "|---|---|---|---|---|---|---:|---:|",
    ]
    for entry in entries:
        for row in entry["fp8_rows"]:
            lines.append(
                f"| {entry['precision']} | {entry['fp8_where'] or ''} | {entry.get('scaling') or ''} "
                f"| {row['status']} | {row['direction']} "
                f"| {row['why']} | {row['ops']} | {row['flops'] / 1e9:,.1f} |"
            )
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="the Markdown table to write (JSON beside it)")
    parser.add_argument("--target", default="h200", help="the GPU to compile for (default h200)")
    parser.add_argument("--d-model", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--sequence", type=int, default=2048)
    parser.add_argument(
        "--attention",
        default="einsum",
        choices=["einsum", "cudnn"],
        help="einsum (default), or cudnn's fused attention (needs libcudnn importable)",
    )
    parser.add_argument(
        "--scalings",
        default="current,delayed",
        type=lambda text: text.split(","),
        help="FP8 scalings to compile: current (per-tensor, the default rows) and delayed (jaxamp.fp8)",
    )
    args = parser.parse_args()
    shape = (
        f"d_model {args.d_model}, {args.heads} heads, FFN {4 * args.d_model}, sequence {args.sequence}, "
        f"batch {args.batch}, one layer, {args.attention} attention, AdamW, through autocast"
    )
    command = "python " + " ".join(sys.argv)
    entries = []
    for precision, where, scaling in VARIANTS:
        if scaling not in args.scalings:
            continue
        entry = compile_layer(
            args.target,
            precision,
            where,
            args.d_model,
            args.heads,
            args.batch,
            args.sequence,
            args.attention,
            scaling,
        )
        entries.append(entry)
        print(
            {key: entry[key] for key in ("precision", "fp8_where", "scaling", "global_s", "per_kernel_s")},
            flush=True,
        )
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(markdown(entries, command, args.target, shape), encoding="utf-8")
    out.with_suffix(".json").write_text(json.dumps({"command": command, "entries": entries}, indent=1) + "\n")
    print(out.read_text())
    return 0


if __name__ == "__main__":
    jaxamp.diagnostics.allow_compiling_without_gpu()
    sys.exit(main())
