"""GPT-2 (124M) compiled for an H200 on a machine without one: memory, bytes, roofline.

    PYTHONPATH=/path/to/cuda_plugin JAX_PLATFORMS=cpu python -m experiments.lm.on_paper --target h200

For each precision and route, the language model's train step (the recipe's
own `experiments.lm.train.make_train_step`) is lowered with its arguments as
``ShapeDtypeStruct``s on the target's compile-only device
(`jaxamp.diagnostics.gpu_target_device`) and compiled, as the CIFAR benchmark's
``targets`` section does. Recorded per step: temp memory
(``memory_analysis()``), bytes moved (`jaxamp.diagnostics.bytes_accessed` of
the optimized program), FLOPs (the lowered module's cost analysis; where it
gives none, the optimized program's matmul FLOPs, as the CIFAR benchmark's
targets section does) and the
dtype of every matmul in the optimized program (cuBLAS and cuDNN calls
included, with the share of them in FP8 and each FP8 outcome,
`jaxamp.PrecisionReport.fp8_rows`), and the roofline bound of the optimized program
(`jaxamp.diagnostics.kernel_roofline`, over the whole step and kernel by kernel) with the
tokens/s it allows. Nothing is autotuned; it is a bound on paper, not a
measurement.

cuDNN's fused attention compiles here once ``libcudnn`` is importable (the
``nvidia-cudnn-cu12`` wheel, which the ``cuda`` extra installs, unpacked onto
``PYTHONPATH``): JAX asks the cuDNN library for its version while lowering
it. Where it is not, the step is compiled with the ``einsum`` attention
instead and the entry says so (``attention_note``); the bound then counts
the attention's score matrices in memory traffic, which flash attention
avoids: an upper estimate of bytes moved.

Beside the two routes, ``hand_cast`` is the recipe JAX language-model code
bases use, the anchor to measure against: the params cast to bfloat16 at
the step's entry and the plain model applied to them (no jaxamp in the
model), with the same attention choice.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any

# Nothing heavy here: the flags are parsed before JAX or Flax load (in `main`, and in `compile_for`,
# which imports them on use), so a mistyped flag is answered at once.
from experiments import interrupts, outputs
from experiments.flags import GPU_TARGET_NAMES, ArgumentParser, HelpFormatter, output_directory
from experiments.lm.config import SIZES, GPTSize, LMConfig

PRECISIONS = ("fp32", "tf32", "mixed_bf16", "mixed", "mixed_float8")
ROUTES = ("apply_policy", "autocast", "hand_cast")
HAND_CAST = "hand_cast"  # the anchor: params cast to bfloat16 at the step's entry
FP8_WHERE = ("pays", "everywhere")  # experiments.benchmark.targets.FP8_WHERE, without its imports
GPT2_VOCAB = 50304  # GPT-2's 50257 tokens padded to a multiple of 64, as nanoGPT does


def cudnn_version(text: str) -> tuple[int, int]:
    """``--cudnn 9.10`` as (9, 10)."""
    major, dot, minor = text.partition(".")
    if not (dot and major.isdigit() and minor.isdigit()):
        raise argparse.ArgumentTypeError(f"--cudnn {text!r}: expected MAJOR.MINOR, e.g. 9.10")
    return int(major), int(minor)


def gpt_size(name: str, d_model: int | None = None, layers: int | None = None) -> GPTSize:
    """A named size of `SIZES`, its width and depth changed where given.

    The heads keep GPT-2's 64 dims each (``d_model / 64`` heads).
    """
    size = SIZES[name]
    if d_model is not None:
        if d_model < 64 or d_model % 64:
            raise ValueError(f"--d-model {d_model} is not a positive multiple of 64 (heads of 64 dims).")
        size = dataclasses.replace(size, d_model=d_model, num_heads=d_model // 64)
    if layers is not None:
        if layers < 1:
            raise ValueError(f"--layers {layers} is below 1.")
        size = dataclasses.replace(size, num_layers=layers)
    return size


def size_label(name: str, size: GPTSize) -> str:
    """``gpt2`` for a named size as it is, else ``gpt2 d2048 l4``."""
    if size == SIZES[name]:
        return name
    return f"{name} d{size.d_model} l{size.num_layers}"


def compile_for(
    target: str,
    config: LMConfig,
    vocab_size: int,
    size: GPTSize | None = None,
    fp8_where: str = "pays",
    cudnn_version: tuple[int, int] | None = None,
) -> dict[str, Any]:
    """Compiles one train step for `target` and describes what it would run.

    Args:
        target: a name of `jaxamp.diagnostics.GPU_TARGETS`.
        config: the run's settings (its model names the size).
        vocab_size: the vocabulary.
        size: the model's shape, if not ``config.model``'s own (`gpt_size`).
        fp8_where: under ``mixed_float8`` (and the block-scaled ``mixed_mxfp8``
            and ``mixed_nvfp4``), ``pays`` (FP8 where it pays on the target,
            the default) or ``everywhere``.
        cudnn_version: the cuDNN version the target states (`jaxamp.diagnostics.gpu_target_device`).
    """
    import jax  # pylint: disable=import-outside-toplevel  # on use: see the imports above
    import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

    import jaxamp  # pylint: disable=import-outside-toplevel
    from experiments.benchmark import targets  # pylint: disable=import-outside-toplevel
    from experiments.benchmark.workload import memory_of  # pylint: disable=import-outside-toplevel
    from experiments.lm import model as model_lib  # pylint: disable=import-outside-toplevel
    from experiments.lm import train  # pylint: disable=import-outside-toplevel
    from experiments.train import resolve_precision  # pylint: disable=import-outside-toplevel

    spec = jaxamp.diagnostics.gpu_spec(target)
    device = jaxamp.diagnostics.gpu_target_device(spec, cudnn_version=cudnn_version)
    precision = resolve_precision(config.precision)
    size = size or model_lib.SIZES[config.model]
    context = config.context or size.context
    hand_cast = config.route == HAND_CAST
    if hand_cast:  # the plain model, as the autocast route builds it
        config = dataclasses.replace(config, route="autocast")
    model, attention = train.create_model(config, precision, vocab_size, "gpu")
    if size != model_lib.SIZES[config.model]:
        plain = model_lib.GPT(vocab_size=vocab_size, size=size, attention=attention)
        overrides = train.high_precision_layers(precision.policy)
        model = jaxamp.apply_policy(plain, precision.policy, overrides=overrides) if config.route == "apply_policy" else plain
    tx = train.create_optimizer(config)
    state = jax.eval_shape(lambda: train.create_train_state(config, precision, model, context, tx))
    windows = jax.ShapeDtypeStruct((config.batch_size, context + 1), jnp.int32)
    arguments = jaxamp.diagnostics.on_device((state, windows), device)
    if hand_cast:
        loss_fn = hand_cast_loss(model.apply, precision.policy.compute_dtype)
    else:
        loss_fn = train.make_loss_fn(model.apply, config.route, precision.policy)
    step = train.make_train_step(loss_fn)
    compiled_step = targets.compile_step(
        step, arguments, config.precision, precision.context(), spec, fp8_where=fp8_where
    )
    compiled, text, compile_s = compiled_step.compiled, compiled_step.text, compiled_step.compile_s
    heavy_flops = compiled_step.report.flops_by_dtype()
    total_flops, bytes_accessed, bound = (
        compiled_step.total_flops,
        compiled_step.bytes_accessed,
        compiled_step.bound,
    )
    tokens = config.batch_size * context
    report = compiled_step.report
    return {
        "target": target,
        "device_kind": device.device_kind,
        "cudnn_version": ".".join(str(part) for part in cudnn_version) if cudnn_version else None,
        "model": size_label(config.model, size),
        "d_model": size.d_model,
        "num_layers": size.num_layers,
        "precision": config.precision,
        "fp8_where": fp8_where if precision.policy.fp8_matmuls else None,
        "route": HAND_CAST if hand_cast else config.route,
        "attention": attention,
        "batch_size": config.batch_size,
        "context": context,
        "vocab_size": vocab_size,
        "num_params": model_lib.num_params(size, vocab_size),
        "compile_s": compile_s,
        "memory": memory_of(compiled),
        "matmul_flops_by_dtype": heavy_flops,
        # Share of matmul FLOPs with FP8 operands in the compiled program (cuBLASLt's
        # FP8 GEMMs on a GPU target), all of them and per pass, and each FP8 outcome.
        "fp8_share": report.fp8_fraction(),
        "fp8_share_forward": report.fp8_fraction("forward"),
        "fp8_share_backward": report.fp8_fraction("backward"),
        "fp8_rows": [dataclasses.asdict(row) for row in report.fp8_rows()],
        "cudnn_attention_calls": text.count("__cudnn$fmha"),
        "block_scaled_dot_calls": text.count('custom_call_target="__cudnn$blockScaledDot"'),
        "flops_per_step": total_flops,
        "analytic_flops_per_step": tokens * model_lib.model_flops_per_token(size, vocab_size, context),
        "bytes_accessed_per_step": bytes_accessed,
        "roofline_step_s": bound.global_s,
        "roofline_compute_s": bound.compute_s,
        "roofline_memory_s": bound.memory_s,
        "roofline_tokens_per_s": tokens / bound.global_s,
        # The sum of each kernel's own bound, by kind of kernel.
        "roofline_per_kernel_s": bound.per_kernel_s,
        "roofline_per_kernel_by_class_s": kernel_classes(bound),
        "bytes_per_step_by_class": kernel_classes(bound, "bytes"),
        "gemm_flops_fp8_share": report.fp8_fraction(),
    }


def compile_with_attention_fallback(
    target: str,
    config: LMConfig,
    vocab_size: int,
    size: GPTSize | None = None,
    fp8_where: str = "pays",
    cudnn_version: tuple[int, int] | None = None,
) -> dict[str, Any]:
    """`compile_for`, with the einsum attention where cuDNN's cannot compile here (libcudnn not
    importable); the entry then says so (``attention_note``)."""
    try:
        return compile_for(target, config, vocab_size, size, fp8_where, cudnn_version)
    except RuntimeError as error:
        if "cuDNN" not in str(error):
            raise
        entry = compile_for(
            target, dataclasses.replace(config, attention="einsum"), vocab_size, size, fp8_where, cudnn_version
        )
        return {**entry, "attention_note": f"cudnn attention not compilable without cuDNN ({error})"}


def kernel_class(kernel) -> str:
    """``FP8 GEMMs``, ``other GEMMs``, ``FP8 quantization`` (kernels traced under
    jaxamp's ``jaxamp_fp8`` scope outside a fallback: amaxes, scales, casts to
    FP8, transposes of FP8 values) or ``other``."""
    if kernel.flops:
        low_precision = any(key.startswith(("float8_", "float4_")) for key in kernel.flops)
        return "FP8 GEMMs" if low_precision else "other GEMMs"
    if "jaxamp_fp8" in kernel.op_name and "jaxamp_fp8_fallback" not in kernel.op_name:
        return "FP8 quantization"
    return "other"


def kernel_classes(kernels, figure: str = "bound_s") -> dict[str, float]:
    """A figure of each kernel summed by `kernel_class`: ``bound_s`` (seconds of the per-kernel
    bound, the default) or ``bytes`` (bytes moved per step)."""
    totals: dict[str, float] = {}
    for kernel in kernels.kernels:
        key = kernel_class(kernel)
        totals[key] = totals.get(key, 0) + getattr(kernel, figure)
    return totals


def hand_cast_loss(apply_fn, compute_dtype):
    """The anchor's loss: float32 params cast to `compute_dtype` at entry, the plain model on them."""
    import jax  # pylint: disable=import-outside-toplevel  # on use: see the imports above

    from experiments.lm import train  # pylint: disable=import-outside-toplevel

    def loss_fn(params, windows):
        half = jax.tree.map(lambda param: param.astype(compute_dtype), params)
        logits = apply_fn({"params": half}, windows[:, :-1])
        return train.token_losses(logits, windows[:, 1:]).mean()

    return loss_fn


def title(entries: list[dict[str, Any]]) -> str:
    """The table page's heading, naming the GPUs compiled for."""
    devices = sorted({entry["device_kind"] for entry in entries if "device_kind" in entry})
    return (
        f"# Language model compiled for {', '.join(devices) or 'a GPU'}, on paper: memory and roofline bound"
    )


def markdown(entries: list[dict[str, Any]], command: str) -> str:
    lines = [
        title(entries),
        "",
        f"Command: `{command}`",
        "",
        (
            "| model | precision | route | attention | temp GiB | GB moved/step | GFLOP/step "
            "| half share of matmul FLOPs | FP8 share (fwd, bwd) | roofline ms/step (compute, memory) "
            "| tokens/s bound | per-kernel ms/step | per kernel vs mixed_bf16 |"
        ),
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    baselines = {
        (entry.get("model"), entry["route"]): entry["roofline_per_kernel_s"]
        for entry in entries
        if entry.get("precision") == "mixed_bf16" and "roofline_per_kernel_s" in entry
    }
    for entry in entries:
        if "error" in entry:
            lines.append(
                f"| {entry.get('model', '')} | {entry['precision']} | {entry['route']} | "
                f"| compile failed: {entry['error']} | | | | | | | | |"
            )
            continue
        matmul = entry["matmul_flops_by_dtype"]
        half = sum(flops for dtype, flops in matmul.items() if dtype in ("float16", "bfloat16"))
        attention = entry["attention"] + (" (cudnn not compilable here)" if "attention_note" in entry else "")
        per_kernel = entry.get("roofline_per_kernel_s")
        baseline = baselines.get((entry.get("model"), entry["route"]))
        lines.append(
            f"| {entry.get('model', '')} | {precision_label(entry)} | {entry['route']} | {attention} "
            f"| {entry['memory']['temp_bytes'] / 2**30:.2f} | {entry['bytes_accessed_per_step'] / 1e9:.1f} "
            f"| {entry['flops_per_step'] / 1e9:,.0f} | {half / max(1, sum(matmul.values())):.0%} "
            f"| {fp8_share(entry)} "
            f"| {entry['roofline_step_s'] * 1e3:.1f} ({entry['roofline_compute_s'] * 1e3:.1f}, "
            f"{entry['roofline_memory_s'] * 1e3:.1f}) | {entry['roofline_tokens_per_s']:,.0f} "
            f"| {'' if per_kernel is None else f'{per_kernel * 1e3:.2f}'} "
            f"| {'' if per_kernel is None or baseline is None else f'{baseline / per_kernel:.2f}x'} |"
        )
    lines += [
        "",
        (
            "Roofline: the global bound, max(FLOPs at peak, bytes at bandwidth) over the whole step. Per kernel: "
            "the sum over the optimized program's kernels of each one's max (`jaxamp.diagnostics.kernel_roofline`; "
            "matmul FLOPs only, element-wise arithmetic counted by its bytes). Per kernel vs mixed_bf16: the "
            "speed-up on paper over the same model and route in mixed_bf16, above 1 where faster."
        ),
    ]
    return "\n".join(lines) + "\n" + fp8_lines(entries)


def precision_label(entry: dict[str, Any]) -> str:
    """The precision, with ``(FP8 everywhere)`` where FP8 was forced at every eligible matmul."""
    return entry["precision"] + (" (FP8 everywhere)" if entry.get("fp8_where") == "everywhere" else "")


def fp8_share(entry: dict[str, Any]) -> str:
    """The table's FP8 cell: share of matmul FLOPs in FP8, then forward's and backward's."""
    if "fp8_share" not in entry:  # results written before FP8 joined the table
        return "n/a"
    if not entry["fp8_share"]:
        return "0%"
    return f"{entry['fp8_share']:.0%} ({entry['fp8_share_forward']:.0%}, {entry['fp8_share_backward']:.0%})"


def fp8_lines(entries: list[dict[str, Any]]) -> str:
    """The compiled programs' FP8 outcomes (`jaxamp.PrecisionReport.fp8_rows`), one line per row."""
    lines = []
    for entry in entries:
        for row in entry.get("fp8_rows", []):
            operands = " x ".join(dtype.removeprefix("float8_") for dtype in row["operand_dtypes"])
            reason = f" ({row['reason'].replace('_', ' ')})" if row["reason"] else ""
            lines.append(
                f"| {entry.get('model', '')} | {precision_label(entry)} | {entry['route']} "
                f"| {row['status']}{reason} | {row['direction']} "
                f"| {operands} | `{row['primitive']}` | {row['ops']} | {row['flops'] / 1e9:,.1f} |"
            )
    if not lines:
        return ""
    header = [
        "",
        (
            "FP8 outcome of each matmul where FP8 was in question (`PrecisionReport.fp8_rows` of the "
            "compiled program):"
        ),
        "",
        "| model | precision | route | outcome | pass | operands | as | ops | GFLOP/step |",
        "|---|---|---|---|---|---|---|---:|---:|",
    ]
    return "\n".join(header + lines) + "\n"


def main(argv: list[str] | None = None, *, entry_point: bool = False) -> int:
    """Runs the command with `argv` (default: the command line); returns the exit status.

    Args:
        argv: the flags.
        entry_point: run as ``python -m experiments.lm.on_paper``: once the
            flags are parsed, and before JAX starts, let the CUDA plugin
            register quietly where no GPU is visible
            (`jaxamp.diagnostics.allow_compiling_without_gpu`).
    """
    parser = ArgumentParser(
        prog="python -m experiments.lm.on_paper",
        description="Compile the language model's train step for a GPU without one; write memory, "
        "bytes moved and the roofline bound per precision and route.",
        formatter_class=HelpFormatter,
    )
    parser.add_argument(
        "--target",
        default="h200",
        choices=list(GPU_TARGET_NAMES),
        help="the GPU to compile for",
    )
    parser.add_argument("--model", default="gpt2", choices=list(SIZES), help="model size")
    parser.add_argument(
        "--d-model", type=int, default=None, help="width, heads of 64 dims (default: the model size's own)"
    )
    parser.add_argument("--layers", type=int, default=None, help="depth (default: the model size's own)")
    parser.add_argument(
        "--fp8-where",
        default="pays",
        help="comma-separated, for mixed_float8: pays (FP8 only where it pays on the target) and/or everywhere",
    )
    parser.add_argument(
        "--cudnn",
        type=cudnn_version,
        default=None,
        help="the cuDNN version the target states, e.g. 9.10 (from which XLA compiles mixed_mxfp8's and "
        "mixed_nvfp4's block-scaled dots to cuDNN's on a B200); default: jaxamp's, 9.8",
    )
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per step")
    parser.add_argument("--vocab-size", type=int, default=GPT2_VOCAB, help="vocabulary size (GPT-2's)")
    parser.add_argument("--precisions", default=",".join(PRECISIONS), help="comma-separated precisions")
    parser.add_argument("--routes", default=",".join(ROUTES), help="comma-separated routes")
    parser.add_argument(
        "--out-dir",
        type=output_directory,
        default=None,
        help="where results.json and table.md go (default: runs/)",
    )
    args = parser.parse_args(argv)
    import jaxamp  # pylint: disable=import-outside-toplevel  # after the flags: see the imports above
    from experiments.lm.__main__ import new_out_dir  # pylint: disable=import-outside-toplevel

    if entry_point:
        jaxamp.diagnostics.allow_compiling_without_gpu()  # before JAX starts: no CUDA traceback without a GPU
    if not jaxamp.diagnostics.cuda_plugin_available():
        print(
            "error: compiling for a GPU target needs the CUDA PJRT plugin of the installed JAX: "
            "pip install 'jax-mixed-precision[gpu-aot]', then run with JAX_PLATFORMS=cpu.",
            file=sys.stderr,
        )
        return 1
    if any(where not in FP8_WHERE for where in args.fp8_where.split(",")):
        parser.error(f"--fp8-where {args.fp8_where!r}: choose from {', '.join(FP8_WHERE)}")
    try:
        size = gpt_size(args.model, args.d_model, args.layers)
    except ValueError as error:
        parser.error(str(error))
    command = "python -m experiments.lm.on_paper " + " ".join(sys.argv[1:] if argv is None else argv)
    entries: list[dict[str, Any]] = []
    out_dir = args.out_dir
    try:
        # The run folder (and the runs/ above it) is removed again if the command fails leaving it empty.
        with interrupts.watched(), outputs.removed_if_left_empty(args.out_dir or outputs.RUNS_ROOT) as made:
            if not out_dir:
                out_dir = new_out_dir()
                made.append(out_dir)
            table = compile_each(args, size, command, out_dir, entries)
    except KeyboardInterrupt:
        kept = (
            f"the {len(entries)} entries compiled so far are in {out_dir}"
            if entries
            else "no compile had finished, so nothing was written"
        )
        print(f"interrupted; {kept}.", file=sys.stderr)
        return interrupts.exit_status(entry_point)
    print(table)
    print(f"results written to {out_dir}")
    return 0


def compile_each(
    args: argparse.Namespace, size: GPTSize, command: str, out_dir: str, entries: list[dict[str, Any]]
) -> str:
    """Compiles every precision x route (x FP8 setting) in turn, appending each entry to `entries`
    and writing results.json and table.md after each; returns the table."""
    import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

    from experiments.lm import output  # pylint: disable=import-outside-toplevel
    from experiments.results import write_text_atomically  # pylint: disable=import-outside-toplevel
    from experiments.train import resolve_precision  # pylint: disable=import-outside-toplevel

    shown = ("precision", "route", "attention", "roofline_step_s", "roofline_per_kernel_s", "error")
    table = ""
    for precision in args.precisions.split(","):
        policy = resolve_precision(precision).policy
        for route in args.routes.split(","):
            if route == HAND_CAST and policy.compute_dtype == jnp.float32:
                continue  # nothing to cast: the plain float32 step
            config = LMConfig(model=args.model, precision=precision, route=route, batch_size=args.batch_size)
            for where in args.fp8_where.split(",") if policy.fp8_matmuls else ["pays"]:
                try:
                    entry = compile_with_attention_fallback(
                        args.target, config, args.vocab_size, size, where, args.cudnn
                    )
                except Exception as error:  # noqa: BLE001 (a compile failure is a finding to record, not a crash)
                    entry = {
                        "model": size_label(args.model, size),
                        "precision": precision,
                        "route": route,
                        "error": str(error).splitlines()[0][:200],
                    }
                interrupts.stop_if_interrupted()
                entries.append(entry)
                print({key: entry.get(key) for key in shown}, flush=True)
                output.write_json(out_dir, {"command": command, "entries": entries})
                table = markdown(entries, command)
                write_text_atomically(f"{out_dir}/table.md", table)
    return table


if __name__ == "__main__":
    sys.exit(main(entry_point=True))
