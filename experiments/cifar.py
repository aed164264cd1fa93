"""Train a CIFAR-10 model under a precision policy and time every epoch.

python -m experiments.cifar --precision mixed
python -m experiments.cifar --precision fp32 --model mobilenetv2 --out fp32.json
python -m experiments.cifar --precision mixed --data synthetic --steps-per-epoch 5
python -m experiments.cifar --precision mixed_float8   # FP8 matmuls and forward convs
python -m experiments.cifar --checkpoint-dir ckpt --checkpoint-every 100 --resume
python -m experiments.cifar --coordinator-address 10.0.0.1:1234 --num-processes 2 --process-id 0

Exit status: 0 on success, 2 for a bad flag, 1 for anything found later (data
missing or damaged, an unusable checkpoint, a batch that does not split over
the devices, an overflow storm), each with one message and no traceback; 130
when interrupted (Ctrl-C), with the last checkpoint kept and the command that
resumes from it.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from typing import TYPE_CHECKING

# Nothing heavy here: the flags are parsed before JAX, Flax or TensorFlow load (in `main`), so a
# mistyped flag is answered at once.
from experiments import config as config_lib
from experiments import interrupts, outputs
from experiments.flags import (
    ArgumentParser,
    HelpFormatter,
    add_process_flags,
    fraction_below_one,
    non_negative_int,
    one_of,
    output_file,
    positive_float,
    positive_int,
)

if TYPE_CHECKING:
    import jaxamp

_DATASETS = ("cifar10", "fashion_mnist")
_DATA_SOURCES = ("tfds", "synthetic")


def injection_rate(text: str) -> float:
    """An argparse type: a share of steps in [0, 1)."""
    try:
        rate = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1), got {text!r}") from None
    try:
        return config_lib.validate_rate(rate)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def precision_arg(text: str) -> str:
    """An argparse type: a name of `experiments.config.KNOWN_PRECISIONS` or a jaxamp policy spec."""
    try:
        config_lib.check_precision(text)
    except (ValueError, TypeError) as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


def loss_scale_arg(text: str) -> str:
    """An argparse type: default, dynamic, none or static:N."""
    try:
        config_lib.parse_loss_scale(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


def add_data_arguments(parser: argparse.ArgumentParser) -> None:
    """The data flags, shared with experiments.compare."""
    parser.add_argument(
        "--dataset", default="cifar10", choices=_DATASETS, help="data set (default: %(default)s)"
    )
    parser.add_argument(
        "--data",
        default="tfds",
        choices=_DATA_SOURCES,
        help="tfds: the real data set; synthetic: random data of the same size, for timing and offline runs",
    )
    parser.add_argument(
        "--data-dir",
        default=None,
        help="where the data lives: the TFDS data dir for cifar10 (default ~/tensorflow_datasets), the IDX "
        "files for fashion_mnist (default /usr/share/datasets/fashion-mnist)",
    )


def add_training_arguments(parser: argparse.ArgumentParser) -> None:
    """The training flags, shared with experiments.compare."""
    parser.add_argument(
        "--epochs",
        type=positive_int,
        default=config_lib.TrainConfig.epochs,
        help="passes over the training data (default: %(default)s; 30 for accuracy)",
    )
    parser.add_argument(
        "--batch-size",
        type=positive_int,
        default=config_lib.TrainConfig.batch_size,
        help="train batch size, over all devices and processes",
    )
    parser.add_argument(
        "--eval-batch-size",
        type=positive_int,
        default=config_lib.TrainConfig.eval_batch_size,
        help="test batch size (default: %(default)s)",
    )
    parser.add_argument(
        "--lr", type=positive_float, default=config_lib.TrainConfig.lr, help="peak learning rate"
    )
    parser.add_argument(
        "--seed",
        type=non_negative_int,
        default=0,
        help="seed of the initialization, shuffling and augmentation",
    )
    parser.add_argument(
        "--steps-per-epoch",
        type=positive_int,
        default=None,
        help="cap on the train steps and on the test batches of each epoch, for quick runs "
        "(default: no cap, the whole data set)",
    )
    parser.add_argument(
        "--eval-every", type=positive_int, default=1, help="test every N epochs (and after the last)"
    )
    parser.add_argument(
        "--loss-scale",
        type=loss_scale_arg,
        default="default",
        help="default (dynamic for float16, none otherwise), dynamic, none or static:N",
    )
    parser.add_argument(
        "--label-smoothing",
        type=fraction_below_one,
        default=0.0,
        help="share of each label's mass spread evenly over the classes",
    )
    parser.add_argument(
        "--grad-accum",
        type=positive_int,
        default=1,
        help="accumulate gradients over K micro-batches per step; --batch-size is the global batch",
    )
    parser.add_argument(
        "--max-consecutive-skips",
        type=non_negative_int,
        default=config_lib.TrainConfig.max_consecutive_skips,
        help="stop (exit 1) after this many overflowed steps in a row; 0 turns it off (default: %(default)s)",
    )
    parser.add_argument(
        "--max-overflows-at-min-scale",
        type=non_negative_int,
        default=0,
        help="stop after this many overflows in a row with the loss scale at its minimum; 0 turns it off",
    )
    parser.add_argument(
        "--inject-nonfinite",
        type=injection_rate,
        default=0.0,
        metavar="RATE",
        help="test hook: make the gradients of a seeded random RATE share of steps inf or NaN",
    )
    parser.add_argument(
        "--record-overflow",
        action="store_true",
        help="record each matmul's and convolution's largest magnitude, forward and backward, so that a "
        "skipped step's report names the layer and pass that overflowed first (its measured cost: "
        "docs/guides/why-was-my-step-skipped.md)",
    )
    parser.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress bar inside epochs (never drawn off a terminal anyway)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="python -m experiments.cifar",
        description="Train a CIFAR-10 model under a jaxamp precision policy, timing every epoch.",
        epilog="The defaults (ResNet18, 2 epochs, mixed) train about an hour on a CPU: 1,788 s per "
        "epoch on 2 idle cores, estimated from a measured step "
        "(results/cpu-benchmark/quick-fresh-clone/table.md). A first run in under a minute: "
        "--data synthetic --model resnet_tiny --epochs 1 --steps-per-epoch 5.",
        formatter_class=HelpFormatter,
    )
    parser.add_argument(
        "--precision",
        type=precision_arg,
        default="mixed",
        help="a jaxamp policy: mixed (float16 compute), mixed_bf16, mixed_float8, fp32 (true float32), bf16, "
        "bfloat16_kahan (bfloat16 params and optimizer state, updates by Kahan summation; or _stochastic, "
        "_nearest), bfloat16_int8 (bfloat16_stochastic with the momentum in 8 bits, a scale per 256 elements; "
        "or _fp8, _int8_per_tensor), 'p=f32,c=f16,o=f32', 'p=bf16,u=kahan,state=int8,block=64', ...; or tf32, "
        "which is no policy: float32 at JAX's default matmul precision (default: %(default)s)",
    )
    parser.add_argument(
        "--route",
        default="auto",
        choices=config_lib.ROUTES,
        help="how the policy reaches the model: apply_policy (params cast where they are created, the "
        "model's apply through jaxamp.autocast), autocast (jaxamp.autocast of the plain model's apply), "
        "or auto, which is apply_policy (default: %(default)s)",
    )
    parser.add_argument(
        "--model",
        default="resnet18",
        type=one_of(config_lib.MODEL_NAMES, "model"),
        metavar="MODEL",
        help=f"the network to train: {', '.join(config_lib.MODEL_NAMES)}",
    )
    add_data_arguments(parser)
    add_training_arguments(parser)
    parser.add_argument(
        "--checkpoint-dir",
        default=None,
        help="save the state here after every epoch (orbax, atomic) (default: none, no checkpoints)",
    )
    parser.add_argument(
        "--checkpoint-every",
        type=positive_int,
        default=None,
        help="also save every N steps (needs --checkpoint-dir) (default: none, after each epoch only)",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue exactly from the latest checkpoint in --checkpoint-dir",
    )
    add_process_flags(parser)
    parser.add_argument(
        "--distributed",
        action="store_true",
        help="join a multi-process run described by the cluster environment (SLURM, Open MPI, ...)",
    )
    parser.add_argument(
        "--out",
        type=output_file,
        default=None,
        help="write per-epoch results and the environment to this JSON file "
        "(checked before training starts) (default: none, nothing is written; the run says so when it ends)",
    )
    return parser


def config_from_args(args: argparse.Namespace, **overrides) -> config_lib.TrainConfig:
    fields = {
        "epochs": args.epochs,
        "batch_size": args.batch_size,
        "eval_batch_size": args.eval_batch_size,
        "lr": args.lr,
        "seed": args.seed,
        "steps_per_epoch": args.steps_per_epoch,
        "eval_every": args.eval_every,
        "loss_scale": args.loss_scale,
        "label_smoothing": args.label_smoothing,
        "dataset": args.dataset,
        "data": args.data,
        "data_dir": args.data_dir,
        "progress": not args.no_progress,
        "grad_accum": args.grad_accum,
        "max_consecutive_skips": args.max_consecutive_skips,
        "max_overflows_at_min_scale": args.max_overflows_at_min_scale,
        "inject_nonfinite": args.inject_nonfinite,
        "record_overflow": args.record_overflow,
    }
    fields.update(overrides)
    return config_lib.TrainConfig(**fields)


def main(argv: list[str] | None = None, *, entry_point: bool = False) -> int:
    """Runs the command with `argv` (default: the command line); returns the exit status.

    Args:
        argv: the flags.
        entry_point: run as ``python -m experiments.cifar``: once the flags
            are parsed, and before JAX starts, let the CUDA plugin register
            quietly where no GPU is visible
            (`jaxamp.diagnostics.allow_compiling_without_gpu`).
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.resume and not args.checkpoint_dir:
        parser.error("--resume needs --checkpoint-dir")
    if args.checkpoint_every and not args.checkpoint_dir:
        parser.error("--checkpoint-every needs --checkpoint-dir")
    import jax  # pylint: disable=import-outside-toplevel  # after the flags: see the imports above

    import jaxamp  # pylint: disable=import-outside-toplevel
    from experiments import checkpointing, distributed, train  # pylint: disable=import-outside-toplevel
    from experiments import data as data_lib  # pylint: disable=import-outside-toplevel

    if entry_point:
        jaxamp.diagnostics.allow_compiling_without_gpu()  # before JAX starts: no CUDA traceback without a GPU
    try:
        train.resolve_route(args.route, train.resolve_precision(args.precision))
    except ValueError as error:
        parser.error(str(error))
    config = config_from_args(
        args,
        model=args.model,
        precision=args.precision,
        route=args.route,
        checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=args.checkpoint_every,
        resume=args.resume,
        out=args.out,
    )
    out_before = outputs.file_version(config.out)
    out_folder = os.path.dirname(os.path.abspath(config.out)) if config.out else None
    try:
        distributed.initialize(
            args.coordinator_address,
            args.num_processes,
            args.process_id,
            from_cluster_environment=args.distributed,
        )
        with interrupts.watched(), outputs.removed_if_left_empty(config.checkpoint_dir, out_folder):
            results = train.train_and_evaluate(config)
    except KeyboardInterrupt:
        argv = sys.argv[1:] if argv is None else argv
        print(interrupted_advice(config, argv, out_before), file=sys.stderr)
        return interrupts.exit_status(entry_point)
    except jaxamp.LossScaleStuckError as error:
        print(f"error: {stuck_advice(error, config)}", file=sys.stderr)
        return 1
    except (
        data_lib.DataUnavailableError,
        checkpointing.CheckpointError,
        distributed.DistributedSetupError,
        train.ConfigError,
    ) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    summary = results["summary"]
    print(
        f"median per epoch: train {summary['train_time_s']:.2f}s"
        + (f", test {summary['test_time_s']:.2f}s" if summary.get("test_time_s") is not None else "")
        + (
            f" | final test accuracy {summary['final_test_accuracy']:.2%}"
            if summary.get("final_test_accuracy") is not None
            else ""
        )
    )
    if jax.process_index() == 0:
        if config.out:
            print(f"results written to {config.out}")
        else:
            print(
                "results not written: add --out FILE to keep them (per-epoch results and the environment, JSON)"
            )
    return 0


def interrupted_advice(
    config: config_lib.TrainConfig, argv: list[str], out_before: tuple[int, int] | None = None
) -> str:
    """The message printed instead of a traceback when the run is interrupted (Ctrl-C).

    Args:
        config: the run's settings.
        argv: the flags as given, for the command that resumes.
        out_before: `experiments.outputs.file_version` of ``--out`` before
            the run: the message says the finished epochs are there only if
            this run wrote the file.
    """
    from experiments import checkpointing  # pylint: disable=import-outside-toplevel

    saved = results_sentence(config.out, out_before)
    if not config.checkpoint_dir:
        return (
            f"interrupted; no checkpoint was kept (no --checkpoint-dir).{saved} To be able to resume an "
            "interrupted run, add --checkpoint-dir DIR (and --checkpoint-every N for mid-epoch checkpoints)."
        )
    latest = checkpointing.latest_checkpoint(config.checkpoint_dir)
    if latest is None:
        return (
            f"interrupted before the first checkpoint in {config.checkpoint_dir}; nothing to resume.{saved} "
            "Run the same command again to start afresh."
        )
    resume_argv = argv if "--resume" in argv else [*argv, "--resume"]
    return (
        f"interrupted; the last checkpoint kept is {latest}.{saved} Resume with: "
        f"python -m experiments.cifar {shlex.join(resume_argv)}"
    )


def results_sentence(out: str | None, out_before: tuple[int, int] | None) -> str:
    """What an interrupted run left in ``--out``: the epochs it wrote there, or that it wrote nothing."""
    if not out:
        return ""
    if outputs.file_version(out) in (None, out_before):
        return f" No epoch finished, so nothing was written to {out}."
    try:
        with open(out, encoding="utf-8") as file:
            finished = len(json.load(file)["epochs"])
    except (OSError, ValueError, KeyError, TypeError):
        return f" The results of the finished epochs are in {out}."
    return f" The results of the {finished} finished epoch{'' if finished == 1 else 's'} are in {out}."


def stuck_advice(error: jaxamp.LossScaleStuckError, config: config_lib.TrainConfig) -> str:
    """The one message printed when the overflow guard stops a run."""
    from experiments import checkpointing  # pylint: disable=import-outside-toplevel

    latest = checkpointing.latest_checkpoint(config.checkpoint_dir) if config.checkpoint_dir else None
    kept = f" The last good checkpoint, {latest}, is kept; --resume continues from it." if latest else ""
    return (
        f"stopped at step {error.steps}: {error.reason}; the loss scale is {error.loss_scale:g} and "
        f"{error.skipped_steps} steps were skipped in all.{kept} Try --precision mixed_bf16, a lower "
        f"--lr (now {config.lr:g}), or --loss-scale static:N; --max-consecutive-skips 0 turns this "
        "check off."
    )


if __name__ == "__main__":
    sys.exit(main(entry_point=True))
