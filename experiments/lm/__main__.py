"""Train a GPT-style language model under jaxamp precisions; write JSON, a table and plots.

python -m experiments.lm --quick
python -m experiments.lm --model small --precisions fp32,mixed_bf16,mixed --seeds 0,1 --steps 300
python -m experiments.lm --route autocast --precisions mixed_bf16
python -m experiments.lm --data tfds:tiny_shakespeare --data-dir ~/tensorflow_datasets   # prepared there
python -m experiments.lm --precisions mixed_bf16,mixed_float8   # FP8 matmuls
python -m experiments.lm --data synthetic --model gpt2 --vocab-size 50304 --batch-size 8 --steps 20
python -m experiments.lm --target h200        # on paper: compiled for an H200, no GPU needed

Exit status: 0 on success, 2 for a bad flag, 1 for anything found later (the
corpus missing or too small, a batch that does not split over the devices),
each with one message and no traceback; 130 when interrupted (Ctrl-C), with
where the finished evaluations were written.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import sys
from typing import Any

# Nothing heavy here: the flags are parsed before JAX, Flax or TensorFlow load (in `main`), so a
# mistyped flag is answered at once.
from experiments import interrupts, outputs
from experiments.cifar import loss_scale_arg, precision_arg
from experiments.flags import (
    ArgumentParser,
    HelpFormatter,
    add_process_flags,
    comma_list,
    integer_at_least,
    one_of,
    output_directory,
    positive_float,
    positive_int,
)
from experiments.lm import config as config_lib
from experiments.lm import data as data_lib

QUICK = {"model": "tiny", "precisions": ["fp32", "mixed_bf16"], "steps": 100, "eval_every": 25}
_DEFAULTS = config_lib.LMConfig()


def seeds_arg(text: str) -> list[int]:
    """An argparse type: comma-separated integer seeds."""
    try:
        seeds = [int(item) for item in text.split(",") if item.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not seeds:
        raise argparse.ArgumentTypeError("expected at least one seed")
    return seeds


def data_arg(text: str) -> str:
    """An argparse type: ``stdlib``, ``synthetic`` or ``tfds:NAME[:FEATURE]``."""
    try:
        data_lib.parse_source(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="python -m experiments.lm",
        description="Train a GPT-style decoder on the bytes of Python's standard library (or of a "
        "prepared TFDS text data set) under jaxamp precisions; write results.json, table.md and plots of the held-out loss.",
        formatter_class=HelpFormatter,
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a first run of a few minutes on a CPU: --model tiny --precisions fp32,mixed_bf16 --steps 100 "
        "--eval-every 25, each unless given beside it (given flags win: --quick --steps 30 runs 30 steps)",
    )
    parser.add_argument(
        "--model",
        default=_DEFAULTS.model,
        type=one_of(list(config_lib.SIZES), "model size"),
        metavar="SIZE",
        help=f"model size: {', '.join(config_lib.SIZES)}",
    )
    parser.add_argument(
        "--precisions",
        type=comma_list(None, precision_arg),
        default="fp32,mixed_bf16,mixed",
        help="comma-separated: fp32 (float32, matmuls at highest precision), tf32 (float32 at the default "
        "precision), mixed_bf16 (bfloat16 compute, no loss scale), mixed (float16 compute, dynamic loss "
        "scale), mixed_float8 (mixed_bf16 with FP8 matmuls), bfloat16_nearest/_stochastic/_kahan (bfloat16 "
        "params and AdamW state, each update rounded that way), bfloat16_int8/_fp8/_int8_per_tensor "
        "(bfloat16_stochastic with AdamW's moments in 8 bits, a scale per 256 elements or per leaf), or any "
        "jaxamp policy",
    )
    parser.add_argument(
        "--route",
        type=comma_list(list(config_lib.ROUTES), what="route"),
        default=None,
        help="how the policy is applied: apply_policy (on the model), autocast (on the loss of the plain "
        "model), or both (default: apply_policy)",
    )
    parser.add_argument("--seeds", type=seeds_arg, default="0", help="comma-separated seeds; one run each")
    parser.add_argument("--steps", type=positive_int, default=_DEFAULTS.steps, help="training steps per run")
    parser.add_argument(
        "--batch-size", type=positive_int, default=_DEFAULTS.batch_size, help="global batch, in sequences"
    )
    parser.add_argument(
        "--context",
        type=positive_int,
        default=None,
        help="sequence length (default: the model size's context)",
    )
    parser.add_argument("--lr", type=positive_float, default=_DEFAULTS.lr, help="peak learning rate")
    parser.add_argument(
        "--warmup-steps",
        type=integer_at_least(0, "an integer >= 0"),
        default=_DEFAULTS.warmup_steps,
        help="steps of linear learning-rate warm-up before the cosine decay",
    )
    parser.add_argument(
        "--weight-decay", type=float, default=_DEFAULTS.weight_decay, help="AdamW weight decay"
    )
    parser.add_argument(
        "--clip-norm",
        type=positive_float,
        default=_DEFAULTS.clip_norm,
        help="gradient clipping by global norm",
    )
    parser.add_argument(
        "--eval-every",
        type=positive_int,
        default=_DEFAULTS.eval_every,
        help="held-out evaluation every N steps",
    )
    parser.add_argument(
        "--eval-batches",
        type=positive_int,
        default=_DEFAULTS.eval_batches,
        help="held-out batches per evaluation (fixed windows, evenly spaced over the held-out files)",
    )
    parser.add_argument(
        "--attention",
        default=_DEFAULTS.attention,
        choices=list(config_lib.ATTENTION_CHOICES),
        help="auto: cudnn on a GPU where it fits, else xla for float32 and einsum for half compute",
    )
    parser.add_argument(
        "--loss-scale",
        type=loss_scale_arg,
        default=_DEFAULTS.loss_scale,
        help="default (dynamic for float16, none otherwise), dynamic, none or static:N",
    )
    parser.add_argument(
        "--data",
        type=data_arg,
        default=_DEFAULTS.data,
        help="stdlib: bytes of the *.py files of Python's standard library; synthetic: random tokens, for "
        "timing; tfds:NAME[:FEATURE]: the bytes of text feature FEATURE (optional if there is only one) "
        "of a TFDS data set prepared beforehand in --data-dir (never downloaded), e.g. "
        "tfds:tiny_shakespeare",
    )
    parser.add_argument(
        "--data-dir",
        default=None,
        help="with stdlib: read the *.py files of this folder instead; with tfds:...: the TFDS data dir "
        "(default: TFDS's, ~/tensorflow_datasets)",
    )
    parser.add_argument(
        "--vocab-size",
        type=integer_at_least(2, "an integer >= 2"),
        default=None,
        help="token ids (default 256: bytes); other values need --data synthetic",
    )
    parser.add_argument(
        "--sharding",
        default=_DEFAULTS.sharding,
        choices=list(config_lib.SHARDING),
        help="fsdp: params and optimizer state split over all devices; replicated: a copy on each",
    )
    parser.add_argument(
        "--gather-dtype",
        default=None,
        help="with fsdp: gather params in this dtype (e.g. bfloat16: half float32's bytes) through "
        "jaxamp.fsdp.fsdp_loss; float8_e4m3fn: the matmul weights in FP8, one global scale each, the rest in "
        "the compute dtype; 'param' for their own dtype. Neither flag (the default): XLA's partitioner chooses "
        "(gathers in the params' dtype)",
    )
    parser.add_argument(
        "--reduce-dtype",
        default=None,
        help="with fsdp: sum gradients over devices in this dtype (never narrower than the params'); "
        "'param' for their own dtype (default: none, XLA's partitioner chooses)",
    )
    parser.add_argument(
        "--out-dir",
        type=output_directory,
        default=None,
        help="where results.json, table.md and the plots go (default: a new directory under runs/)",
    )
    parser.add_argument(
        "--record-overflow",
        action="store_true",
        help="record each matmul's largest magnitude, forward and backward, so that a skipped step's "
        "report names the layer and pass that overflowed first (it reads the attention scores and logits "
        "once more: see docs/guides/why-was-my-step-skipped.md)",
    )
    parser.add_argument(
        "--scan-layers",
        action="store_true",
        help="run the blocks as one block scanned over the layers, each block param stacked over them: "
        "one block compiled for all, and fewer, larger leaves for the optimizer",
    )
    parser.add_argument(
        "--block-recipe",
        default=_DEFAULTS.block_recipe,
        choices=list(config_lib.BLOCK_RECIPES),
        help="mixed_nvfp4's recipe: full, or without one of its tools (the Hadamard transform, stochastic "
        "rounding of gradients, 16x16 weight blocks), for ablations (jaxamp.fp8.block_recipe)",
    )
    parser.add_argument(
        "--no-progress", action="store_true", help="no progress bar (never drawn off a terminal)"
    )
    add_process_flags(parser)
    return parser


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """The flags, with --quick's settings (`QUICK`) as the defaults of the flags not given.

    A flag given beside --quick wins over it, so what runs is what the command
    line says and the command recorded in table.md is the whole story.
    """
    args = parser.parse_args(argv)
    if args.quick:
        parser.set_defaults(**QUICK)
        args = parser.parse_args(argv)
    return args


def configs_from_args(args: argparse.Namespace) -> list[config_lib.LMConfig]:
    """One `LMConfig` per precision x route x seed, in that order (`parse_args` has applied --quick)."""
    base = config_lib.LMConfig(
        model=args.model,
        attention=args.attention,
        loss_scale=args.loss_scale,
        data=args.data,
        data_dir=args.data_dir,
        vocab_size=args.vocab_size,
        context=args.context,
        batch_size=args.batch_size,
        steps=args.steps,
        lr=args.lr,
        warmup_steps=args.warmup_steps,
        weight_decay=args.weight_decay,
        clip_norm=args.clip_norm,
        eval_every=args.eval_every,
        eval_batches=args.eval_batches,
        sharding=args.sharding,
        gather_dtype=args.gather_dtype,
        reduce_dtype=args.reduce_dtype,
        progress=not args.no_progress,
        record_overflow=args.record_overflow,
        scan_layers=args.scan_layers,
        block_recipe=args.block_recipe,
    )
    return [
        dataclasses.replace(base, precision=precision, route=route, seed=seed)
        for precision in args.precisions
        for route in (args.route or [config_lib.default_route(precision)])
        for seed in args.seeds
    ]


def environment() -> dict[str, Any]:
    """What ran where, and how loaded the machine was at the start."""
    from experiments import results  # pylint: disable=import-outside-toplevel

    return {
        **results.machine(),
        "load_average_at_start": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "cpu_count": os.cpu_count(),
    }


def new_out_dir() -> str:
    """A fresh directory under ``runs/`` (git-ignored), as every experiment command makes."""
    from experiments import results  # pylint: disable=import-outside-toplevel

    return results.run_directory("lm")


def main(argv: list[str] | None = None, *, entry_point: bool = False) -> int:
    """Runs the command with `argv` (default: the command line); returns the exit status.

    Args:
        argv: the flags.
        entry_point: run as ``python -m experiments.lm``: once the flags are
            parsed, and before JAX starts, let the CUDA plugin register
            quietly where no GPU is visible
            (`jaxamp.diagnostics.allow_compiling_without_gpu`).
    """
    parser = build_parser()
    args = parse_args(parser, argv)
    try:
        configs = configs_from_args(args)
        for config in configs:
            config_lib.validate(config)
    except config_lib.ConfigError as error:
        parser.error(str(error))
    import jax  # pylint: disable=import-outside-toplevel  # after the flags: see the imports above

    import jaxamp  # pylint: disable=import-outside-toplevel
    from experiments import distributed  # pylint: disable=import-outside-toplevel
    from experiments.lm import output, train  # pylint: disable=import-outside-toplevel

    if entry_point:
        jaxamp.diagnostics.allow_compiling_without_gpu()  # before JAX starts: no CUDA traceback without a GPU
    command = "python -m experiments.lm " + shlex.join(sys.argv[1:] if argv is None else argv)
    out_dir = None
    results_before = outputs.file_version(args.out_dir and os.path.join(args.out_dir, "results.json"))
    try:
        # The run folder (and the runs/ above it) is removed again if the command fails leaving it empty.
        with interrupts.watched(), outputs.removed_if_left_empty(args.out_dir or outputs.RUNS_ROOT) as made:
            distributed.initialize(args.coordinator_address, args.num_processes, args.process_id)
            main_process = jax.process_index() == 0
            corpus = data_lib.load_corpus(
                configs[0].data,
                configs[0].data_dir,
                configs[0].vocab_size or 256,
                0,
                jax.process_index(),
                jax.process_count(),
            )
            print(f"corpus: {corpus.description}", flush=True)
            out_dir = args.out_dir or (new_out_dir() if main_process else None)
            if out_dir and main_process:
                os.makedirs(out_dir, exist_ok=True)
                made.append(out_dir)
            payload: dict[str, Any] = {"command": command, "environment": environment(), "runs": []}

            for config in configs:

                def save(run, payload=payload):
                    if main_process:
                        output.write_json(out_dir, {**payload, "runs": [*payload["runs"], run]})

                run = train.train_and_evaluate(
                    config, corpus, log=lambda line: print(line, flush=True), on_record=save
                )
                payload["runs"].append(run)
                interrupts.stop_if_interrupted()
                if main_process:
                    output.write_json(out_dir, payload)
                    output.write_table(out_dir, payload["runs"], command, payload["environment"])
    except KeyboardInterrupt:
        results = out_dir and os.path.join(out_dir, "results.json")
        kept = (
            f" The evaluations finished so far are in {results}."
            if outputs.file_version(results) not in (None, results_before)
            else " No evaluation had finished, so nothing was written."
        )
        print(
            f"interrupted.{kept} Language-model runs keep no checkpoints: run the command again to start "
            "afresh, with fewer --steps or --precisions for a shorter run.",
            file=sys.stderr,
        )
        return interrupts.exit_status(entry_point)
    except (
        data_lib.DataUnavailableError,
        distributed.DistributedSetupError,
        config_lib.ConfigError,
    ) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    if main_process:
        output.write_plots(out_dir, payload["runs"])
        print(output.markdown_table(payload["runs"]))
        print(f"results written to {out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main(entry_point=True))
