"""What overflow attribution costs a train step: step time here, bytes moved on a GPU target.

Three versions of one ``mixed_float16`` step, which differ only in what they
record about a skipped step (`experiments.benchmark.loss_scale` builds them):

* ``none``: no attribution (the train state's ``nonfinite_grads`` set to None);
* ``leaves``: the gradient attribution a `jaxamp.TrainState` keeps by default,
  one bool per parameter leaf (`jaxamp.diagnostics.NonFiniteGradients`);
* ``leaves+record``: also ``record_overflow=True``, each matmul's and
  convolution's amax forward and backward, kept in the state
  (`jaxamp.diagnostics.OverflowRecord`).

On this machine each step is timed interleaved, as the ``loss_scale`` section
times its variants, and the medians are given as ratios to ``none``. For each
GPU target (``--target``), the training recipe's own step
(`experiments.train.make_train_step`, ``--record-overflow`` for the third)
is compiled in the three versions without running, and its bytes moved
(`jaxamp.diagnostics.bytes_accessed` of the optimized program) and temporary
memory are given as ratios to ``none``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jaxamp
from experiments import data as data_lib
from experiments import train
from experiments.benchmark import loss_scale, targets, workload

VERSIONS = ("none", "leaves", "leaves+record")
PRECISION = "mixed"  # float16, where steps overflow
_VARIANT_OF_VERSION = dict(zip(VERSIONS, loss_scale.ATTRIBUTION_VARIANTS, strict=True))


def measure(model_name: str, batch_size: int, rounds: int, steps: int) -> dict[str, dict[str, float]]:
    """Median ms per step of each version, timed interleaved, and its ratio to ``none``."""
    medians = loss_scale.measure(
        model_name,
        batch_size,
        rounds,
        steps,
        variants=loss_scale.ATTRIBUTION_VARIANTS,
        baseline=_VARIANT_OF_VERSION["none"],
    )
    none_ms = medians[_VARIANT_OF_VERSION["none"]]["ms_per_step"]
    return {
        version: {
            "ms_per_step": medians[variant]["ms_per_step"],
            "ratio_to_none": medians[variant]["ms_per_step"] / none_ms,
        }
        for version, variant in _VARIANT_OF_VERSION.items()
    }


def _abstract_step(version: str, model: str, batch_size: int, device) -> tuple[Any, tuple]:
    """The recipe's train step in `version` and its abstract arguments on `device`."""
    config = dataclasses.replace(
        workload.train_config(model, PRECISION, batch_size), record_overflow=version == "leaves+record"
    )
    dataset = data_lib.synthetic_dataset(num_train=1, num_test=1)  # mean/std only
    step = train.make_train_step(config, dataset)
    state, *batch = targets.abstract_arguments(model, PRECISION, batch_size, device)
    if version == "none":
        state = state.replace(nonfinite_grads=None)
    elif version == "leaves+record":
        state = state.with_overflow_record_of(step, *batch)
    return step, jaxamp.diagnostics.on_device((state, *batch), device)


def compile_on_target(target: str, model: str, batch_size: int) -> dict[str, dict[str, float]]:
    """Bytes moved and temp memory of the three versions compiled for `target`, and their ratios."""
    spec = jaxamp.diagnostics.gpu_spec(target)
    device = jaxamp.diagnostics.gpu_target_device(spec)
    precision = train.resolve_precision(PRECISION)
    figures = {}
    for version in VERSIONS:
        step, arguments = _abstract_step(version, model, batch_size, device)
        compiled = targets.compile_step(step, arguments, PRECISION, precision.context(), spec)
        figures[version] = {
            "bytes_accessed_per_step": compiled.bytes_accessed,
            "temp_bytes": workload.memory_of(compiled.compiled)["temp_bytes"],
            "compile_s": compiled.compile_s,
        }
    for version in VERSIONS:
        for key in ("bytes_accessed_per_step", "temp_bytes"):
            figures[version][f"{key}_ratio_to_none"] = figures[version][key] / figures["none"][key]
    return figures


def table_rows(attribution: dict) -> list[str]:
    """The section's Markdown tables: step time here, and bytes and memory on each GPU target."""
    rows = []
    step_time = attribution.get("step_time", {})
    if step_time:
        rows += [
            "| model | none ms/step | leaves vs none | leaves+record vs none |",
            "|---|---|---|---|",
        ]
        for model, versions in step_time.items():
            rows.append(
                f"| {model} | {versions['none']['ms_per_step']:.2f} "
                f"| {versions['leaves']['ratio_to_none']:.3f} | {versions['leaves+record']['ratio_to_none']:.3f} |"
            )
    compiled = attribution.get("targets", {})
    if compiled:
        rows += [
            "",
            (
                "| target | model | none GB moved | leaves vs none | leaves+record vs none | none temp MB "
                "| leaves vs none | leaves+record vs none |"
            ),
            "|---|---|---|---|---|---|---|---|",
        ]
        for target, models in compiled.items():
            for model, versions in models.items():
                rows.append(
                    f"| {target} | {model} | {versions['none']['bytes_accessed_per_step'] / 1e9:.2f} "
                    f"| {versions['leaves']['bytes_accessed_per_step_ratio_to_none']:.4f} "
                    f"| {versions['leaves+record']['bytes_accessed_per_step_ratio_to_none']:.4f} "
                    f"| {versions['none']['temp_bytes'] / 1e6:.0f} "
                    f"| {versions['leaves']['temp_bytes_ratio_to_none']:.4f} "
                    f"| {versions['leaves+record']['temp_bytes_ratio_to_none']:.4f} |"
                )
    rows += [
        "",
        (
            "none: no attribution; leaves: which gradient leaves were not finite (a TrainState's default); "
            "leaves+record: also each matmul's and convolution's amax, forward and backward "
            "(record_overflow=True). Step time: median of interleaved rounds on this machine; GPU targets: "
            "the recipe's mixed (float16) train step compiled without a GPU, bytes moved estimated from the "
            "optimized program's kernels."
        ),
    ]
    return rows
