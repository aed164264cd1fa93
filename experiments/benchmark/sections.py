"""The benchmark's sections run in the order given, under the time budget.

`run_sections` is what ``python -m experiments.benchmark`` runs once its flags
are parsed and resolved (`experiments.benchmark.__main__.resolve_settings`);
each section is a method of `SectionRunner`, which builds the device-resident
data once and keeps the workload the pipeline section reuses.
"""

from __future__ import annotations

import jaxamp
from experiments import interrupts
from experiments.benchmark import attribution, loss_scale, pipeline, targets, throughput, torch_amp, workload
from experiments.benchmark.budget import Budget, SkipWork
from experiments.benchmark.results import Results


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

    def attribution(self) -> None:
        """Overflow attribution's cost: step time here, then bytes moved on each GPU target."""
        settings = self.settings
        for model in settings["loss_scale_models"]:
            _guarded(
                self.budget,
                f"attribution {model}",
                lambda model=model: self.results.put(
                    ("attribution", "step_time", model),
                    attribution.measure(
                        model, settings["loss_scale_batch_size"], settings["rounds"], settings["steps"]
                    ),
                ),
            )
        if settings["targets"] and not jaxamp.diagnostics.cuda_plugin_available():
            self.budget.skip(
                "attribution on GPU targets",
                "the CUDA PJRT plugin is not installed (pip install 'jax-mixed-precision[gpu-aot]')",
            )
            return
        for target in settings["targets"]:
            for model in settings["models"]:
                _guarded(
                    self.budget,
                    f"attribution {target} {model}",
                    lambda target=target, model=model: self.results.put(
                        ("attribution", "targets", target, model),
                        attribution.compile_on_target(target, model, settings["batch_size"]),
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
        precisions = [p for p in settings["precisions"] if p in torch_amp.PRECISIONS]
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
                "targets", "the CUDA PJRT plugin is not installed (pip install 'jax-mixed-precision[gpu-aot]')"
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
        interrupts.stop_if_interrupted()
        getattr(runner, section)()


def _guarded(budget: Budget, work: str, fn) -> None:
    """Runs `fn` if any budget is left; a section that runs out midway is listed as skipped."""
    interrupts.stop_if_interrupted()
    try:
        budget.require(work, 0.0 if budget.remaining() > 0 else 1.0)
        fn()
    except SkipWork as skip:
        budget.skip(work, str(skip))
