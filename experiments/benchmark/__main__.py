"""``python -m experiments.benchmark``: see `experiments.benchmark` for what it measures."""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import sys
import time

import jax

import jaxamp
from experiments import train
from experiments.benchmark import (
    checks,
    loss_scale,
    output,
    pipeline,
    targets,
    throughput,
    torch_amp,
    workload,
)
from experiments.benchmark.budget import Budget, SkipWork
from experiments.benchmark.results import Results
from experiments.flags import HelpFormatter, comma_list, output_directory, positive_float, positive_int
from experiments.models import MODELS
from experiments.results import run_directory, write_text_atomically

SECTIONS = ("throughput", "loss_scale", "pipeline", "torch", "targets")
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
    parser = argparse.ArgumentParser(
        prog="python -m experiments.benchmark",
        description="Side-by-side benchmark: throughput, memory, distance to the hardware, loss-scale cost, "
        "input pipeline, PyTorch AMP, GPU targets compiled without a GPU.",
        formatter_class=HelpFormatter,
    )
    models = sorted(MODELS)

    def default(key: str, full: object) -> str:
        return f"(default: {full}; with --quick: {QUICK[key]})"

    quick_flags = " ".join(f"--{key.replace('_', '-')} {value}" for key, value in QUICK.items())
    parser.add_argument("--quick", action="store_true", help=f"a reduced set for a CPU: {quick_flags}")
    parser.add_argument(
        "--sections",
        type=comma_list(SECTIONS),
        default=None,
        help="comma-separated, run in the order given (default: throughput,loss_scale,pipeline,"
        "torch; only targets when --target is given)",
    )
    parser.add_argument(
        "--models",
        type=comma_list(models),
        default=None,
        help="comma-separated " + default("models", STUDY_MODELS),
    )
    parser.add_argument(
        "--precisions",
        type=comma_list(None),
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
        type=comma_list(["mlp", *models]),
        default=None,
        help="models of the loss_scale section " + default("loss_scale_models", "mlp,resnet18"),
    )
    parser.add_argument(
        "--loss-scale-batch-size",
        type=positive_int,
        default=None,
        help="batch size of the loss_scale section " + default("loss_scale_batch_size", 128),
    )
    parser.add_argument(
        "--torch-models",
        type=comma_list(models),
        default=None,
        help="models of the torch section (default: those of --models PyTorch has a reference for)",
    )
    parser.add_argument(
        "--target",
        type=comma_list([*jaxamp.diagnostics.GPU_TARGETS, "all"]),
        default=None,
        help=f"GPU targets to compile for without a GPU: {', '.join(jaxamp.diagnostics.GPU_TARGETS)} or all "
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
        list(jaxamp.diagnostics.GPU_TARGETS) if args.target and "all" in args.target else (args.target or [])
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
    if settings["sections"] == ["targets"]:
        run = "targets-" + "-".join(settings["targets"])
    else:
        run = "quick" if args.quick else "full"
    return run_directory(f"benchmark-{run}")


class SectionRunner:
    """Runs the chosen sections in the order given (most important first), under the budget."""

    def __init__(self, settings: dict, budget: Budget, results: Results):
        self.settings, self.budget, self.results = settings, budget, results
        self.data = None
        self.built: dict[tuple[str, str], workload.Workload] = {}

    def device_data(self) -> workload.DeviceSet:
        if self.data is None:
            self.data = workload.device_set(self.settings["num_train"])
        return self.data

    def pipeline_workload_key(self) -> tuple[str, str]:
        precisions = self.settings["precisions"]
        return self.settings["models"][0], "mixed" if "mixed" in precisions else precisions[0]

    def throughput(self) -> None:
        settings = self.settings
        only_one = len(settings["models"]) == 1 and len(settings["precisions"]) == 1
        estimate = 0.0
        for model in settings["models"]:
            estimate, built = throughput.run_model(
                model,
                settings["precisions"],
                settings["batch_size"],
                self.device_data(),
                settings["rounds"],
                settings["steps"],
                self.budget,
                self.results,
                estimate,
                only_workload_of_process=only_one,
            )
            key = self.pipeline_workload_key()
            if model == key[0] and key[1] in built:
                self.built[key] = built[key[1]]  # kept for the pipeline section; the others are freed

    def _each_model(self, section: str, models: list[str], measure) -> None:
        """Records ``measure(model)`` under ``results[section][model]`` while the budget lasts."""
        for model in models:
            _guarded(
                self.budget,
                f"{section} {model}",
                lambda model=model: self.results.put((section, model), measure(model)),
            )

    def loss_scale(self) -> None:
        settings = self.settings
        self._each_model(
            "loss_scale",
            settings["loss_scale_models"],
            lambda model: loss_scale.measure(
                model, settings["loss_scale_batch_size"], settings["rounds"], settings["steps"]
            ),
        )

    def pipeline(self) -> None:
        model, precision = key = self.pipeline_workload_key()

        def measure():
            data = self.device_data()
            item = self.built.get(key) or workload.build(model, precision, self.settings["batch_size"], data)
            self.results.put(
                ("pipeline",), pipeline.measure(item, data, self.settings["rounds"], self.settings["steps"])
            )

        _guarded(self.budget, f"pipeline {model} {precision}", measure)

    def torch(self) -> None:
        settings = self.settings
        if not torch_amp.torch_available():
            self.budget.skip("torch", "PyTorch is not installed here (it is optional)")
            return
        precisions = [p for p in settings["precisions"] if p in PRECISIONS]
        num_train = min(settings["num_train"], 10_000)
        self._each_model(
            "torch",
            settings["torch_models"],
            lambda model: torch_amp.measure(
                model, precisions, settings["batch_size"], settings["rounds"], settings["steps"], num_train
            ),
        )

    def targets(self) -> None:
        settings = self.settings
        if not jaxamp.diagnostics.cuda_plugin_available():
            self.budget.skip(
                "targets", "the CUDA PJRT plugin is not installed (pip install 'jaxamp[gpu-aot]')"
            )
            return
        targets.run(
            settings["targets"],
            settings["models"],
            settings["precisions"],
            settings["batch_size"],
            self.budget,
            self.results,
        )


def run_sections(settings: dict, budget: Budget, results: Results) -> None:
    """Runs ``settings["sections"]`` in their order."""
    runner = SectionRunner(settings, budget, results)
    for section in settings["sections"]:
        getattr(runner, section)()


def _guarded(budget: Budget, work: str, fn) -> None:
    """Runs `fn` if any budget is left; a section that runs out midway is listed as skipped."""
    try:
        budget.require(work, 0.0 if budget.remaining() > 0 else 1.0)
        fn()
    except SkipWork as skip:
        budget.skip(work, str(skip))


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        settings = resolve_settings(args)
    except ValueError as err:
        parser.error(str(err))
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
    try:
        run_sections(settings, budget, results)
    finally:
        results.put(("environment", "load_average_at_end"), os.getloadavg()[0])
        results.put(("environment", "wall_s"), time.monotonic() - budget.start)
        results.put(("skipped",), budget.skipped)
        results.put(("checks",), checks.all_checks(results.data, device.platform == "gpu"))
        if args.no_plots:
            write_text_atomically(os.path.join(out_dir, "table.md"), output.table(results.data))
        else:
            output.write(results.data, out_dir)
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
    jaxamp.diagnostics.allow_compiling_without_gpu()  # before JAX starts: no CUDA traceback without a GPU
    sys.exit(main())
