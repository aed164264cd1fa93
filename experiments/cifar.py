"""Train a CIFAR-10 model under a precision policy and time every epoch.

python -m experiments.cifar --precision mixed
python -m experiments.cifar --precision fp32 --model mobilenetv2 --out fp32.json
python -m experiments.cifar --precision mixed --data synthetic --steps-per-epoch 5
"""

from __future__ import annotations

import argparse
import sys

from experiments import data as data_lib
from experiments import train
from experiments.models import MODELS

_DATASETS = ("cifar10", "fashion_mnist")
_DATA_SOURCES = ("tfds", "synthetic")


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def positive_float(text: str) -> float:
    """An argparse type: a number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {value}")
    return value


def precision_arg(text: str) -> str:
    """An argparse type: fp32, tf32 or any jaxamp policy spec."""
    try:
        train.resolve_precision(text)
    except (ValueError, TypeError) as error:
        raise argparse.ArgumentTypeError(f"{error} Also accepted: fp32, tf32.") from None
    return text


def loss_scale_arg(text: str) -> str:
    """An argparse type: default, dynamic, none or static:N."""
    try:
        train.resolve_loss_scale(text, train.resolve_precision("mixed").policy)
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
        default=train.TrainConfig.epochs,
        help="(default: %(default)s; 30 for accuracy)",
    )
    parser.add_argument("--batch-size", type=positive_int, default=train.TrainConfig.batch_size)
    parser.add_argument("--lr", type=positive_float, default=train.TrainConfig.lr, help="peak learning rate")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--steps-per-epoch",
        type=positive_int,
        default=None,
        help="cap on the train steps and on the test batches of each epoch, for quick runs",
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
    parser.add_argument("--label-smoothing", type=float, default=0.0)
    parser.add_argument("--no-progress", action="store_true", help="no progress bar inside epochs")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m experiments.cifar",
        description="Train a CIFAR-10 model under a jaxamp precision policy, timing every epoch.",
    )
    parser.add_argument(
        "--precision",
        type=precision_arg,
        default="mixed",
        help="fp32 (true float32), tf32 (float32 at JAX's default matmul precision), or any jaxamp policy: "
        "mixed, mixed_bf16, bf16, 'p=f32,c=f16,o=f32', ... (default: %(default)s)",
    )
    parser.add_argument("--model", default="resnet18", choices=sorted(MODELS))
    add_data_arguments(parser)
    add_training_arguments(parser)
    parser.add_argument(
        "--checkpoint-dir", default=None, help="save the state here after every epoch (orbax)"
    )
    parser.add_argument(
        "--resume", action="store_true", help="continue from the latest checkpoint in --checkpoint-dir"
    )
    parser.add_argument(
        "--out", default=None, help="write per-epoch results and the environment to this JSON file"
    )
    return parser


def config_from_args(args: argparse.Namespace, **overrides) -> train.TrainConfig:
    fields = {
        "epochs": args.epochs,
        "batch_size": args.batch_size,
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
    }
    fields.update(overrides)
    return train.TrainConfig(**fields)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.resume and not args.checkpoint_dir:
        parser.error("--resume needs --checkpoint-dir")
    config = config_from_args(
        args,
        model=args.model,
        precision=args.precision,
        checkpoint_dir=args.checkpoint_dir,
        resume=args.resume,
        out=args.out,
    )
    try:
        results = train.train_and_evaluate(config)
    except data_lib.DataUnavailableError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
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
    if config.out:
        print(f"results written to {config.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
