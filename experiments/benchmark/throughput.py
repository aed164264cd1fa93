"""Throughput, memory and distance to the hardware, per model x precision.

For one model, every precision's train and eval steps are compiled (compile
time recorded apart), then timed interleaved. Per precision it records:

* train and eval images/s, and the train ratios to ``fp32`` and ``tf32``;
* the compiled train step's ``memory_analysis()`` on this device (on CPU,
  XLA computes half precision in float32, so a mixed step's memory there
  equals fp32's: no saving is claimed) and, on a GPU, the process's peak
  bytes in use after this model's timing;
* FLOPs per image (XLA's cost analysis of the compiled step), achieved
  TFLOP/s; on a known GPU the share of the precision's peak and the
  roofline bound of the compiled step (`experiments.benchmark.roofline`)
  beside the measured seconds per CIFAR-10 epoch.
"""

from __future__ import annotations

import jax

from experiments.benchmark import roofline, timing, workload
from experiments.benchmark.budget import Budget, SkipWork
from experiments.benchmark.results import Results
from jaxamp.diagnostics import GpuSpec, spec_for_device_kind


def device_spec() -> GpuSpec | None:
    """The published spec of this process's device, if it is a known GPU."""
    device = jax.devices()[0]
    return spec_for_device_kind(device.device_kind) if device.platform == "gpu" else None


def distance_to_hardware(entry: dict, cost: dict, spec: GpuSpec | None, hlo_text: str) -> dict:
    """Achieved TFLOP/s, share of peak and the roofline bound for one measured entry.

    Args:
        entry: the measured entry (``precision``, ``batch_size``, ``train_step_s``, ...).
        cost: its compiled train step's `workload.Workload.step_cost`.
        spec: this device's GPU, or None where it is not a known GPU.
        hlo_text: the compiled train step's optimized program.
    """
    batch_size, step_s = entry["batch_size"], entry["train_step_s"]
    result = {
        "flops_per_image": cost["flops"] / batch_size,
        "achieved_tflops": cost["flops"] / step_s / 1e12,
        "measured_epoch_s": roofline.epoch_bound(step_s, batch_size),
    }
    if spec is None:
        return result
    main_key = roofline.main_peak_key(entry["precision"], entry["compute_dtype"])
    result["share_of_peak"] = cost["flops"] / step_s / spec.peak_flops[main_key]
    result["peak_used"] = main_key
    bound = roofline.step_bound(hlo_text, spec, entry["precision"])
    result["roofline_step_s"] = bound.global_s
    result["roofline_epoch_s"] = roofline.epoch_bound(bound.global_s, batch_size)
    return result


def run_model(
    model: str,
    precisions: list[str],
    batch_size: int,
    data: workload.DeviceSet,
    rounds: int,
    steps: int,
    budget: Budget,
    results: Results,
    compile_estimate: float = 0.0,
    only_workload_of_process: bool = False,
) -> tuple[float, dict[str, workload.Workload]]:
    """Compiles and times one model under every precision that fits the budget.

    On a GPU, the peak bytes in use are the process's: exact only when this
    is the process's one model x precision (`only_workload_of_process`).

    Returns:
        The longest train+eval compile seen (an estimate for the next model)
        and the workloads built, by precision.
    """
    built: dict[str, workload.Workload] = {}
    entries: dict[str, dict] = {}
    for precision in precisions:
        work = f"throughput {model} {precision}"
        try:
            budget.require(work + " (compile)", compile_estimate)
        except SkipWork as skip:
            budget.skip(work, str(skip))
            continue
        built[precision] = item = workload.build(model, precision, batch_size, data)
        compile_estimate = max(compile_estimate, sum(item.compile_seconds.values()))
        entries[precision] = {
            "model": model,
            "precision": precision,
            "batch_size": batch_size,
            "compute_dtype": workload.compute_dtype_name(precision),
            "compile_s": item.compile_seconds,
            "memory": workload.memory_of(item.train_compiled),
            "cost": item.step_cost(),
        }
        results.put(("throughput", model, precision), entries[precision])
        print(
            f"compiled {model} {precision}: {item.compile_seconds['train']:.1f}s + "
            f"{item.compile_seconds['eval']:.1f}s",
            flush=True,
        )
    if not built:
        return compile_estimate, built
    # One warm-up step each tells how long the timed rounds will take.
    first_step_s = {
        p: timing.timed(item.train_step)[1] + timing.timed(item.eval_step)[1] for p, item in built.items()
    }
    try:
        budget.require(f"timing {model}", (rounds * steps + 2) * sum(first_step_s.values()))
    except SkipWork as skip:
        budget.skip(f"timing {model}", str(skip))
        return compile_estimate, built
    train_s = timing.interleaved_medians({p: item.train_step for p, item in built.items()}, rounds, steps)
    eval_s = timing.interleaved_medians({p: item.eval_step for p, item in built.items()}, rounds, steps)
    peak_bytes = workload.peak_bytes_in_use()
    spec = device_spec()
    for precision, entry in entries.items():
        entry["train_step_s"] = train_s[precision]
        entry["eval_step_s"] = eval_s[precision]
        entry["train_images_per_s"] = batch_size / train_s[precision]
        entry["eval_images_per_s"] = batch_size / eval_s[precision]
        for baseline in ("fp32", "tf32"):
            if baseline in train_s:
                entry[f"train_ratio_to_{baseline}"] = train_s[baseline] / train_s[precision]
        if peak_bytes is not None:
            entry["process_peak_bytes"] = peak_bytes
            entry["process_peak_note"] = (
                "exact: the only model x precision of this process"
                if only_workload_of_process
                else "cumulative peak of the process so far (includes earlier work); "
                "run one model x precision "
                "per process for an exact figure"
            )
        entry.update(
            distance_to_hardware(entry, entry["cost"], spec, built[precision].train_compiled.as_text())
        )
        results.put(("throughput", model, precision), entry)
        print(
            f"{model:<12} {precision:<11} train {entry['train_images_per_s']:9.1f} img/s  "
            f"eval {entry['eval_images_per_s']:9.1f} img/s",
            flush=True,
        )
    return compile_estimate, built
