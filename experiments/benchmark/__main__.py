"""``python -m experiments.benchmark``: see `experiments.benchmark` for what it measures."""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import sys
import time

# Nothing heavy here: the flags are parsed before JAX, Flax or PyTorch load (in `main`), so a
# mistyped flag is answered at once.
from experiments import interrupts
from experiments.cifar import precision_arg
from experiments.config import MODEL_NAMES
from experiments.flags import (
    GPU_TARGET_NAMES,
    ArgumentParser,
    HelpFormatter,
    comma_list,
    output_directory,
    positive_float,
    positive_int,
)

SECTIONS = ("throughput", "loss_scale", "attribution", "pipeline", "torch", "targets")
PRECISIONS = ("fp32", "tf32", "mixed", "mixed_bf16")
STUDY_MODELS = "resnet18,resnet50,resnet101,mobilenetv2"
# --quick: a reduced set that runs in minutes on a 2-core CPU.
QUICK = {
    "models": "resnet18",
    "precisions": "fp32,mixed",
    "batch_size": 32,
    "rounds": 3,
    "steps": 2,
    "num_train": 1024,
    "loss_scale_models": "mlp,resnet18",
    "loss_scale_batch_size": 32,
    "torch_models": "resnet18",
}


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="python -m experiments.benchmark",
        description="Side-by-side benchmark: throughput, memory, distance to the hardware, loss-scale cost, "
        "input pipeline, PyTorch AMP, GPU targets compiled without a GPU.",
        formatter_class=HelpFormatter,
    )
    models = list(MODEL_NAMES)

    def default(key: str, full: object) -> str:
        return f"(default: {full}; with --quick: {QUICK[key]})"

    quick_flags = " ".join(f"--{key.replace('_', '-')} {value}" for key, value in QUICK.items())
    parser.add_argument("--quick", action="store_true", help=f"a reduced set for a CPU: {quick_flags}")
    parser.add_argument(
        "--sections",
        type=comma_list(SECTIONS, what="section"),
        default=None,
        help="comma-separated, run in the order given (default: throughput,loss_scale,attribution,"
        "pipeline,torch; only targets when --target is given; attribution compiles for --target too)",
    )
    parser.add_argument(
        "--models",
        type=comma_list(models, what="model"),
        default=None,
        help="comma-separated " + default("models", STUDY_MODELS),
    )
    parser.add_argument(
        "--precisions",
        type=comma_list(None, precision_arg),
        default=None,
        help="comma-separated " + default("precisions", ",".join(PRECISIONS)),
    )
    parser.add_argument(
        "--batch-size", type=positive_int, default=None, help="train batch size " + default("batch_size", 128)
    )
    parser.add_argument(
        "--rounds",
        type=positive_int,
        default=None,
        help="timed rounds (median over them) " + default("rounds", 5),
    )
    parser.add_argument(
        "--steps", type=positive_int, default=None, help="steps per variant per round " + default("steps", 10)
    )
    parser.add_argument(
        "--num-train",
        type=positive_int,
        default=None,
        help="device-resident synthetic examples to gather batches from " + default("num_train", 50_000),
    )
    parser.add_argument(
        "--loss-scale-models",
        type=comma_list(["mlp", *models], what="model"),
        default=None,
        help="models of the loss_scale and attribution sections "
        + default("loss_scale_models", "mlp,resnet18"),
    )
    parser.add_argument(
        "--loss-scale-batch-size",
        type=positive_int,
        default=None,
        help="batch size of the loss_scale and attribution sections " + default("loss_scale_batch_size", 128),
    )
    parser.add_argument(
        "--torch-models",
        type=comma_list(models, what="model"),
        default=None,
        help="models of the torch section (default: those of --models PyTorch has a reference for)",
    )
    parser.add_argument(
        "--target",
        type=comma_list([*GPU_TARGET_NAMES, "all"], what="target"),
        default=None,
        help=f"GPU targets to compile for without a GPU: {', '.join(GPU_TARGET_NAMES)} or all "
        "(default: none; h200 when --sections names targets)",
    )
    parser.add_argument(
        "--budget",
        type=positive_float,
        default=None,
        help="seconds for the whole run: work runs in order of importance, what would not fit is "
        "skipped and listed (default: no limit)",
    )
    parser.add_argument(
        "--out-dir",
        type=output_directory,
        default=None,
        help="where to write results.json, table.md and plots (default: a new "
        "runs/benchmark-<quick|full|targets-...>-<time>/; the published runs are in "
        "results/<device>/benchmark/)",
    )
    parser.add_argument("--no-plots", action="store_true", help="write results.json and table.md only")
    parser.add_argument(
        "--check",
        action="store_true",
        help="exit 1 when a target is missed (for CI and scripts); without it a missed target is reported "
        "in the table and the log, and the exit status only says whether the benchmark ran",
    )
    return parser


def resolve_settings(args: argparse.Namespace) -> dict:
    """Flags, then --quick's values, then the defaults."""
    defaults = {
        "models": STUDY_MODELS,
        "precisions": ",".join(PRECISIONS),
        "batch_size": 128,
        "rounds": 5,
        "steps": 10,
        "num_train": 50_000,
        "loss_scale_models": "mlp,resnet18",
        "loss_scale_batch_size": 128,
        "torch_models": None,
    }
    if args.quick:
        defaults.update(QUICK)
    settings = {}
    for key, default in defaults.items():
        value = getattr(args, key)
        if value is None and isinstance(default, str):
            value = [item.strip() for item in default.split(",")]
        settings[key] = default if value is None else value
    settings["targets"] = (
        list(GPU_TARGET_NAMES) if args.target and "all" in args.target else (args.target or [])
    )
    if args.sections:
        settings["sections"] = args.sections
    else:
        settings["sections"] = ["targets"] if settings["targets"] else [s for s in SECTIONS if s != "targets"]
    if "targets" in settings["sections"] and not settings["targets"]:
        settings["targets"] = ["h200"]
    if settings["torch_models"] is None:
        settings["torch_models"] = [
            m for m in settings["models"] if m in ("resnet18", "resnet50", "mobilenetv2", "resnet101")
        ]
    for key in ("batch_size", "rounds", "steps", "num_train", "loss_scale_batch_size"):
        if settings[key] < 1:
            raise ValueError(f"--{key.replace('_', '-')} must be at least 1, got {settings[key]}.")
    if settings["num_train"] < settings["batch_size"]:
        raise ValueError(
            f"--num-train {settings['num_train']} is below --batch-size {settings['batch_size']}; raise it."
        )
    return settings


def default_out_dir(args: argparse.Namespace, settings: dict) -> str:
    """A new run directory named for the kind of run: ``runs/benchmark-quick-<time>``, ..."""
    from experiments.results import run_directory  # pylint: disable=import-outside-toplevel

    if settings["sections"] == ["targets"]:
        run = "targets-" + "-".join(settings["targets"])
    else:
        run = "quick" if args.quick else "full"
    return run_directory(f"benchmark-{run}")


def main(argv: list[str] | None = None, *, entry_point: bool = False) -> int:
    """Runs the benchmark with `argv` (default: the command line); returns the exit status.

    Args:
        argv: the flags.
        entry_point: run as ``python -m experiments.benchmark``: once the flags
            are parsed, and before JAX starts, let the CUDA plugin register
            quietly where no GPU is visible
            (`jaxamp.diagnostics.allow_compiling_without_gpu`).
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        settings = resolve_settings(args)
    except ValueError as err:
        parser.error(str(err))
    import jax  # pylint: disable=import-outside-toplevel  # after the flags: see the imports above

    import jaxamp  # pylint: disable=import-outside-toplevel
    from experiments import train  # pylint: disable=import-outside-toplevel
    from experiments.benchmark import checks, output, sections  # pylint: disable=import-outside-toplevel
    from experiments.benchmark.budget import Budget  # pylint: disable=import-outside-toplevel
    from experiments.benchmark.results import Results  # pylint: disable=import-outside-toplevel
    from experiments.results import write_text_atomically  # pylint: disable=import-outside-toplevel

    if entry_point:
        jaxamp.diagnostics.allow_compiling_without_gpu()  # before JAX starts: no CUDA traceback without a GPU
    for precision in settings["precisions"]:
        try:
            train.resolve_precision(precision)
        except ValueError as err:
            parser.error(f"invalid precision {precision!r}: {err}")
    device = jax.devices()[0]
    out_dir = args.out_dir or default_out_dir(args, settings)
    command = "python -m experiments.benchmark " + " ".join(
        shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv)
    )
    results = Results(
        out_dir,
        {
            "environment": {
                "device": device.device_kind
                if device.platform != "cpu"
                else f"cpu ({platform.processor() or platform.machine()})",
                "platform": device.platform,
                "jax": jax.__version__,
                "python": platform.python_version(),
                "command": command.strip(),
                "settings": dict(settings),
                "load_average_at_start": os.getloadavg()[0],
                "cpu_count": os.cpu_count(),
            },
        },
    )
    budget = Budget(args.budget)
    print(
        f"device: {results.data['environment']['device']}; sections: {', '.join(settings['sections'])}; "
        f"writing {out_dir}",
        flush=True,
    )
    interrupted = False
    try:
        with interrupts.watched():
            sections.run_sections(settings, budget, results)
    except KeyboardInterrupt:
        interrupted = True
    finally:
        results.put(("environment", "load_average_at_end"), os.getloadavg()[0])
        results.put(("environment", "wall_s"), time.monotonic() - budget.start)
        results.put(("skipped",), budget.skipped)
        results.put(("checks",), checks.all_checks(results.data, device.platform == "gpu"))
        if args.no_plots:
            write_text_atomically(os.path.join(out_dir, "table.md"), output.table(results.data))
        else:
            output.write(results.data, out_dir)
    if interrupted:
        measured = set(results.data) - {"environment", "skipped", "checks"}
        kept = (
            "what had finished is in" if measured else "no measurement had finished; the environment alone is in"
        )
        print(f"interrupted; {kept} {out_dir}", file=sys.stderr)
        return interrupts.exit_status(entry_point)
    print(output.table(results.data))
    print(f"wrote {out_dir}")
    missed = [check for check in results.data["checks"] if not check["met"]]
    if not missed:
        print("all targets checked in this run were met")
        return 0
    print(f"missed {len(missed)} target(s): {'; '.join(check['check'] for check in missed)}")
    if any(check["timed"] for check in missed):
        print("Timings on a shared machine are noisy: rerun on an idle one before concluding.")
    if not args.check:
        print("The benchmark ran, so it exits 0; with --check a missed target makes it exit 1.")
    return 1 if args.check else 0


if __name__ == "__main__":
    sys.exit(main(entry_point=True))
