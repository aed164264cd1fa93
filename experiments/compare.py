"""Run models x precisions and write the study's table and plots.

    python -m experiments.compare --models resnet18,resnet50,resnet101,mobilenetv2 --precisions fp32,mixed
    python -m experiments.compare --dataset fashion_mnist --models resnet_tiny \\
        --precisions fp32,mixed,mixed_bf16 --epochs 3

Writes a new run directory, ``runs/compare-<YYYYMMDD-HHMMSS>/`` (or ``--out-dir``;
the committed study lives in ``results/<device>/<dataset>/``): ``results.json`` (every run's
per-epoch figures and environment, rewritten after each run so a crash loses
nothing finished), ``table.md`` (the study's shape: rows are precisions,
cells ``train: Xs test: Ys``, then speed-up and accuracy rows),
``seconds_per_epoch.png`` and ``accuracy.png``.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

# Nothing heavy here: the flags are parsed before JAX, Flax or TensorFlow load (in `main`).
from experiments import cifar, interrupts, outputs
from experiments import config as config_lib
from experiments.flags import ArgumentParser, HelpFormatter, comma_list, output_directory


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="python -m experiments.compare",
        description="Train every model under every precision; write a Markdown table and PNG plots.",
        epilog="The defaults (4 models x 2 precisions x 2 CIFAR-10 epochs) take many hours on a CPU: "
        "ResNet18 alone trains about 1.9 hours on 2 idle cores (2 epochs of 1,662 s in fp32 and "
        "2 of 1,788 s in mixed, estimated from a measured step: "
        "results/cpu-benchmark/quick-fresh-clone/table.md); ResNet50, ResNet101 and MobileNetV2 "
        "are not timed on a CPU. A first run: --models resnet_tiny --data synthetic --epochs 1 "
        "--steps-per-epoch 5.",
        formatter_class=HelpFormatter,
    )
    parser.add_argument(
        "--models",
        type=comma_list(list(config_lib.MODEL_NAMES), what="model"),
        default=["resnet18", "resnet50", "resnet101", "mobilenetv2"],
        help="comma-separated (default: resnet18,resnet50,resnet101,mobilenetv2)",
    )
    parser.add_argument(
        "--precisions",
        type=comma_list(None, cifar.precision_arg),
        default=["fp32", "mixed"],
        help="comma-separated; the first is the baseline of the speed-up row (default: fp32,mixed)",
    )
    cifar.add_data_arguments(parser)
    cifar.add_training_arguments(parser)
    parser.add_argument(
        "--out-dir",
        type=output_directory,
        default=None,
        help="where to write the table, plots and results.json (default: a new runs/compare-<time>/; "
        "the published study is results/<device>/<dataset>/)",
    )
    return parser


def title(results: dict[str, Any]) -> str:
    """The table page's heading, naming the data set."""
    return f"# Train and test time, and accuracy, by model and precision ({results['dataset']})"


def write_table(results: dict[str, Any], models: list[str], precisions: list[str]) -> str:
    """The study's table: one row per precision, one column per model."""
    runs = results["runs"]
    header = "| | " + " | ".join(models) + " |"
    lines = [header, "|---" * (len(models) + 1) + "|"]

    def cell(model, precision):
        summary = runs.get(f"{model}/{precision}", {}).get("summary")
        if not summary:
            return "not run"
        test = summary.get("test_time_s")
        return (
            f"train: {summary['train_time_s']:.1f}s test: {test:.1f}s"
            if test is not None
            else (f"train: {summary['train_time_s']:.1f}s")
        )

    for precision in precisions:
        lines.append(f"| {precision} | " + " | ".join(cell(model, precision) for model in models) + " |")
    baseline = precisions[0]
    for precision in precisions[1:]:
        speedups = []
        for model in models:
            base = runs.get(f"{model}/{baseline}", {}).get("summary")
            other = runs.get(f"{model}/{precision}", {}).get("summary")
            speedups.append(
                f"{base['train_time_s'] / other['train_time_s']:.2f}x" if base and other else "n/a"
            )
        lines.append(f"| train speed-up {precision} vs {baseline} | " + " | ".join(speedups) + " |")
    for precision in precisions:
        accuracies = []
        for model in models:
            summary = runs.get(f"{model}/{precision}", {}).get("summary") or {}
            accuracy = summary.get("final_test_accuracy")
            accuracies.append(f"{accuracy:.2%}" if accuracy is not None else "n/a")
        lines.append(f"| test accuracy {precision} | " + " | ".join(accuracies) + " |")
    return "\n".join(lines) + "\n"


def plot(results: dict[str, Any], models: list[str], precisions: list[str], out_dir: str) -> list[str]:
    """Bar chart of seconds per epoch; test accuracy per epoch per precision."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    runs = results["runs"]
    device = results["device"]
    paths = []

    figure, axis = plt.subplots(figsize=(max(6.0, 1.8 + 1.8 * len(models)), 4.2))
    width = 0.8 / len(precisions)
    for index, precision in enumerate(precisions):
        times = [
            (runs.get(f"{model}/{precision}", {}).get("summary") or {}).get("train_time_s", np.nan)
            for model in models
        ]
        positions = np.arange(len(models)) + (index - (len(precisions) - 1) / 2) * width
        bars = axis.bar(positions, times, width, label=precision)
        axis.bar_label(bars, fmt="%.1f", fontsize=7)
    axis.set_xticks(np.arange(len(models)), models)
    axis.set_ylabel("train seconds per epoch (median)")
    axis.set_title(f"Train seconds per epoch, {device} (lower is better)", fontsize=10)
    axis.set_ylim(top=axis.get_ylim()[1] * 1.2)
    axis.legend(fontsize=8, ncols=len(precisions), loc="upper left")
    figure.tight_layout()
    path = os.path.join(out_dir, "seconds_per_epoch.png")
    figure.savefig(path, dpi=120)
    plt.close(figure)
    paths.append(path)

    figure, axes = plt.subplots(1, len(models), figsize=(max(5.0, 4 * len(models)), 3.8), squeeze=False)
    for axis, model in zip(axes[0], models):
        for precision in precisions:
            epochs = runs.get(f"{model}/{precision}", {}).get("epochs", [])
            tested = [record for record in epochs if "test_accuracy" in record]
            axis.plot(
                [record["epoch"] for record in tested],
                [100 * record["test_accuracy"] for record in tested],
                marker="o",
                label=precision,
            )
        axis.set_title(model)
        axis.set_xlabel("epoch")
        axis.set_ylabel("test accuracy (%)")
        axis.grid(alpha=0.3)
        axis.xaxis.get_major_locator().set_params(integer=True)
        axis.legend(fontsize=8)
    figure.suptitle(f"Test accuracy per epoch on {device}")
    figure.tight_layout()
    path = os.path.join(out_dir, "accuracy.png")
    figure.savefig(path, dpi=120)
    plt.close(figure)
    paths.append(path)
    return paths


def finished_runs(results: dict[str, Any], out_dir: str | None) -> str:
    """Where the runs that finished are, or that none did (and nothing was written)."""
    finished = len(results["runs"])
    if not finished:
        return "No run had finished, so nothing was written."
    path = os.path.join(out_dir, "results.json")
    return f"The results of the {finished} finished run{'' if finished == 1 else 's'} are in {path}."


def main(argv: list[str] | None = None, *, entry_point: bool = False) -> int:
    """Runs the command with `argv` (default: the command line); `entry_point` as in `cifar.main`."""
    args = build_parser().parse_args(argv)
    import jax  # pylint: disable=import-outside-toplevel  # after the flags: see the imports above

    import jaxamp  # pylint: disable=import-outside-toplevel
    from experiments import data as data_lib  # pylint: disable=import-outside-toplevel
    from experiments import distributed, train  # pylint: disable=import-outside-toplevel
    from experiments import results as results_lib  # pylint: disable=import-outside-toplevel

    if entry_point:
        jaxamp.diagnostics.allow_compiling_without_gpu()  # before JAX starts: no CUDA traceback without a GPU
    try:
        dataset = data_lib.load_dataset(args.dataset, args.data, args.data_dir, seed=args.seed)
    except data_lib.DataUnavailableError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    results: dict[str, Any] = {
        "device": jax.devices()[0].device_kind,
        "dataset": dataset.name,
        "command": "python -m experiments.compare " + " ".join(argv if argv is not None else sys.argv[1:]),
        "runs": {},
    }
    out_dir = args.out_dir
    try:
        # The run folder (and the runs/ above it) is removed again if the command fails leaving it empty.
        with interrupts.watched(), outputs.removed_if_left_empty(args.out_dir or outputs.RUNS_ROOT) as made:
            if out_dir:
                os.makedirs(out_dir, exist_ok=True)
            else:
                out_dir = results_lib.run_directory("compare")
                made.append(out_dir)
            results_path = os.path.join(out_dir, "results.json")
            for model in args.models:
                for precision in args.precisions:
                    print(f"\n=== {model} / {precision} ===", flush=True)
                    config = cifar.config_from_args(args, model=model, precision=precision)
                    results["runs"][f"{model}/{precision}"] = train.train_and_evaluate(config, dataset)
                    interrupts.stop_if_interrupted()
                    train.write_json_atomically(results_path, results)
    except KeyboardInterrupt:
        print(
            f"interrupted. {finished_runs(results, out_dir)} Run the command again to start afresh.",
            file=sys.stderr,
        )
        return interrupts.exit_status(entry_point)
    except (jaxamp.LossScaleStuckError, train.ConfigError, distributed.DistributedSetupError) as error:
        print(f"error: {error} {finished_runs(results, out_dir)}", file=sys.stderr)
        return 1

    table = write_table(results, args.models, args.precisions)
    results_lib.write_text_atomically(
        os.path.join(out_dir, "table.md"),
        f"{title(results)}\n\nDevice: {results['device']}. Data: {dataset.name}. "
        f"Command: `{results['command']}`\n\n" + table,
    )
    paths = plot(results, args.models, args.precisions, out_dir)
    print("\n" + table)
    print("wrote " + ", ".join([results_path, os.path.join(out_dir, "table.md"), *paths]))
    return 0


if __name__ == "__main__":
    sys.exit(main(entry_point=True))
