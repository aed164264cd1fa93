"""One transformer layer at TransformerEngine's shape, compiled for a GPU without one: FP8 against bfloat16.

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

Needs the CUDA PJRT plugin; ``--attention cudnn`` also libcudnn importable.
Writes table.md and results.json.
"""

from __future__ import annotations

import datetime

import jax
import jax.numpy as jnp
import optax

import jaxamp
from experiments.flags import GPU_TARGET_NAMES, comma_list, positive_int
from experiments.lm import model as model_lib
from experiments.lm import on_paper
from experiments.measure.gpu_target import compile_for, target_device
from experiments.measure.markdown import table

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
    device = target_device(spec)
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
        args = (params, opt_state, history, x)
        step = delayed_step
    else:
        args = (params, opt_state, x)
    program = compile_for(step, args, device, donate_argnums=(0, 1), context=deciding())
    text, compile_s = program.text, program.seconds
    report = jaxamp.diagnostics.hlo_precision_report(
        text, jaxamp.diagnostics.lowered_hlo_text(program.lowered)
    )
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
    ]
    rows = []
    for entry in entries:
        classes = entry["per_kernel_by_class_s"]
        gemms = classes.get("FP8 GEMMs", 0.0) + classes.get("other GEMMs", 0.0)
        rows.append(
            [
                entry["precision"],
                entry["fp8_where"] or "",
                entry.get("scaling") or "",
                f"{entry['bytes_accessed'] / 1e9:.1f}",
                f"{entry['gemm_flops_fp8_share']:.1%}",
                f"{entry['global_s'] * 1e3:.2f}",
                f"{entry['per_kernel_s'] * 1e3:.2f}",
                f"{bf16['per_kernel_s'] / entry['per_kernel_s']:.2f}x",
                f"{gemms * 1e3:.2f}",
                f"{classes.get('FP8 quantization', 0.0) * 1e3:.2f}",
                f"{classes.get('other', 0.0) * 1e3:.2f}",
                f"{entry['compile_s']:.0f}",
            ]
        )
    header = [
        "precision", "FP8", "scaling", "GB moved", "GEMM FLOPs in FP8", "global ms", "per-kernel ms",
        "per kernel vs bf16", "GEMMs ms", "FP8 quantization ms", "other ms", "compile s",
    ]  # fmt: skip
    outcomes = [
        [
            entry["precision"],
            entry["fp8_where"] or "",
            entry.get("scaling") or "",
            row["status"],
            row["direction"],
            row["why"],
            row["ops"],
            f"{row['flops'] / 1e9:,.1f}",
        ]
        for entry in entries
        for row in entry["fp8_rows"]
    ]
    outcome_header = ["precision", "FP8", "scaling", "outcome", "pass", "why", "ops", "GFLOP"]
    lines += [
        table(header, rows, "lll" + "r" * 9).rstrip(),
        "",
        "FP8 outcomes (`PrecisionReport.fp8_rows`):",
        "",
        table(outcome_header, outcomes, "llllllrr").rstrip(),
    ]
    return "\n".join(lines) + "\n"


def add_arguments(parser) -> None:
    parser.add_argument("--target", choices=GPU_TARGET_NAMES, default="h200", help="the GPU to compile for")
    parser.add_argument("--d-model", type=positive_int, default=4096, help="width")
    parser.add_argument("--heads", type=positive_int, default=32, help="attention heads")
    parser.add_argument("--batch", type=positive_int, default=8, help="sequences per step")
    parser.add_argument("--sequence", type=positive_int, default=2048, help="tokens per sequence")
    parser.add_argument(
        "--attention",
        default="einsum",
        choices=["einsum", "cudnn"],
        help="einsum, or cudnn's fused attention (needs libcudnn importable)",
    )
    parser.add_argument(
        "--scalings",
        default=["current", "delayed"],
        type=comma_list(["current", "delayed"]),
        help="FP8 scalings to compile: current (per-tensor, the default rows) and delayed (jaxamp.fp8)",
    )


def run(args, out) -> None:
    shape = (
        f"d_model {args.d_model}, {args.heads} heads, FFN {4 * args.d_model}, sequence {args.sequence}, "
        f"batch {args.batch}, one layer, {args.attention} attention, AdamW, through autocast"
    )
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
    text = markdown(entries, out.command, args.target, shape)
    out.write("table.md", text)
    out.write_json("results.json", {"command": out.command, "entries": entries})
    out.print(text.rstrip())
