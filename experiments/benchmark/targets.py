"""The train step compiled for GPU targets, on a machine without a GPU.

For each target (`jaxamp.GPU_TARGETS`), model and precision, the training
recipe's train step is lowered with its arguments as ``ShapeDtypeStruct``s
on the target's compile-only device (`jaxamp.gpu_target_device`) and
compiled. Recorded: compile time; ``memory_analysis()`` (temp, argument,
output bytes; the argument bytes include the uint8 CIFAR-10 training set
the step gathers from); the dtype of every convolution and matmul in the
optimized HLO (cuDNN and cuBLAS custom calls included); and the roofline
bound on paper, from the pre-optimization module's FLOPs (the executable's
own cost analysis is empty for a deviceless compile) split by the dtypes
of the optimized program's heavy ops, and bytes estimated from the
optimized program's own kernels (`jaxamp.hlo_report.bytes_accessed`).

Caveats: nothing is autotuned (cuDNN and cuBLAS take default algorithms,
whose workspace is what is counted), and the cuDNN and CUDA versions are
those the target config states.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp

import jaxamp
from experiments import data as data_lib
from experiments import train
from experiments.benchmark import roofline, workload
from experiments.benchmark.budget import Budget, SkipWork
from experiments.benchmark.results import Results
from jaxamp import hlo_report

_CIFAR10_SHAPES = {"images": (roofline.CIFAR10_TRAIN_EXAMPLES, 32, 32, 3)}


def abstract_arguments(model: str, precision: str, batch_size: int, device) -> tuple:
    """The train step's arguments as ShapeDtypeStructs on `device`."""
    config = workload.train_config(model, precision, batch_size)
    steps_per_epoch = roofline.CIFAR10_TRAIN_EXAMPLES // batch_size
    state = workload.abstract_train_state(config, steps_per_epoch)
    data = (
        jax.ShapeDtypeStruct(_CIFAR10_SHAPES["images"], jnp.uint8),
        jax.ShapeDtypeStruct((roofline.CIFAR10_TRAIN_EXAMPLES,), jnp.int32),
        jax.ShapeDtypeStruct((batch_size,), jnp.int32),
        jax.eval_shape(lambda: jax.random.key(0)),
    )
    return jaxamp.on_device((state, *data), device)


def compile_for(target: str, model: str, precision: str, batch_size: int) -> dict:
    """Compiles one train step for `target` and describes what it would run."""
    spec = jaxamp.gpu_targets.gpu_spec(target)
    device = jaxamp.gpu_target_device(spec)
    config = workload.train_config(model, precision, batch_size)
    dataset = data_lib.synthetic_dataset(num_train=1, num_test=1)  # mean/std only
    arguments = abstract_arguments(model, precision, batch_size, device)
    with train.resolve_precision(precision).context():
        start = time.perf_counter()
        lowered = jax.jit(train.make_train_step(config, dataset), donate_argnums=0).lower(*arguments)
        compiled = lowered.compile()
        compile_s = time.perf_counter() - start
    text = compiled.as_text()
    report = jaxamp.hlo_precision_report(text)
    heavy_flops = report.flops_by_dtype()
    total_flops = roofline.cost_of(lowered).get("flops", float(sum(heavy_flops.values())))
    bytes_accessed = hlo_report.bytes_accessed(text)
    bound = roofline.roofline(
        roofline.flops_by_peak(precision, heavy_flops, total_flops), bytes_accessed, spec
    )
    compute_dtype = workload.compute_dtype_name(precision)
    return {
        "target": target,
        "device_kind": device.device_kind,
        "model": model,
        "precision": precision,
        "batch_size": batch_size,
        "compile_s": compile_s,
        "memory": workload.memory_of(compiled),
        "heavy_ops_by_dtype": report.count_by_dtype(),
        "heavy_flops_by_dtype": heavy_flops,
        "cudnn_convolutions": sum(op.primitive.startswith("__cudnn$conv") for op in report.ops),
        "heavy_ops_in_compute_dtype": sum(op.compute_dtype == compute_dtype for op in report.ops)
        / len(report.ops),
        "flops_per_step": total_flops,
        "bytes_accessed_per_step": bytes_accessed,
        "roofline_step_s": bound["bound_s"],
        "roofline_compute_s": bound["compute_s"],
        "roofline_memory_s": bound["memory_s"],
        "roofline_epoch_s": roofline.epoch_bound(bound["bound_s"], batch_size),
    }


def run(
    targets: list[str],
    models: list[str],
    precisions: list[str],
    batch_size: int,
    budget: Budget,
    results: Results,
) -> None:
    """Compiles every target x model x precision that fits the budget."""
    compile_estimate = 0.0
    for target in targets:
        for model in models:
            for precision in precisions:
                work = f"target {target} {model} {precision}"
                try:
                    budget.require(work, compile_estimate)
                except SkipWork as skip:
                    budget.skip(work, str(skip))
                    continue
                try:
                    entry = compile_for(target, model, precision, batch_size)
                except jax.errors.JaxRuntimeError as error:
                    # e.g. a CUDA 13 ptxas, which no longer compiles for the V100's sm_70:
                    # put a CUDA 12 ptxas first on PATH to compile for it.
                    budget.skip(work, f"XLA could not compile it here: {str(error).splitlines()[0]}")
                    continue
                fp32 = results.get(("targets", target, model, "fp32"))
                if fp32 is not None and precision != "fp32":
                    entry["temp_ratio_to_fp32"] = entry["memory"]["temp_bytes"] / fp32["memory"]["temp_bytes"]
                compile_estimate = max(compile_estimate, entry["compile_s"])
                results.put(("targets", target, model, precision), entry)
                print(
                    f"{target} {model:<12} {precision:<11} temp {entry['memory']['temp_bytes'] / 1e6:8.0f} MB  "
                    f"ops {entry['heavy_ops_by_dtype']}  compile {entry['compile_s']:.1f}s",
                    flush=True,
                )
