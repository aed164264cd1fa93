"""The train step compiled for GPU targets, on a machine without a GPU.

For each target (`jaxamp.diagnostics.GPU_TARGETS`), model and precision, the training
recipe's train step is lowered with its arguments as ``ShapeDtypeStruct``s
on the target's compile-only device (`jaxamp.diagnostics.gpu_target_device`) and
compiled. Recorded: compile time; ``memory_analysis()`` (temp, argument,
output bytes; the argument bytes include the uint8 CIFAR-10 training set
the step gathers from); the dtype of every convolution and matmul in the
optimized HLO (cuDNN and cuBLAS custom calls included); and the roofline
bound on paper of the optimized program (`jaxamp.diagnostics.kernel_roofline`:
its convolution and matmul FLOPs at the peaks of their dtypes, and bytes
estimated from its own kernels, since the executable's own cost analysis is
empty for a deviceless compile), over the whole step and kernel by kernel.

Each half precision (``mixed``, ``mixed_bf16``, any float16 or bfloat16
policy) is compiled by both routes a policy can take
(`experiments.benchmark.workload.ROUTES`): ``apply_policy``, the recipe's,
recorded under the precision's name, and ``autocast``, recorded under
``"<precision> autocast"``. Beside each: temp memory, bytes moved per step,
the share of convolution and matmul FLOPs in half precision, and the
ratios of temp memory and bytes moved to ``fp32``'s.

Bytes moved is an estimate from the optimized program
(`jaxamp.diagnostics.bytes_accessed`): XLA's ``cost_analysis()`` is empty
for a program compiled without its GPU. It counts every operand a kernel
reads, so each step includes the whole uint8 training set once (the
gather's operand, 154 MB for CIFAR-10), alike in every route.

An FP8 precision (``mixed_float8``) is compiled by both routes too, each
with what `jaxamp.PrecisionReport.fp8_rows` reads from the
optimized program: the share of convolution FLOPs in FP8, forward and
backward (XLA rewrites a forward convolution of scaled FP8 operands into a
cuDNN FP8 graph; the backward convolutions are bfloat16 by design), the
share of matmul FLOPs in FP8, every fallback with its reason, and its temp
memory and bytes moved against ``mixed_bf16`` by the same route.

Caveats: nothing is autotuned (cuDNN and cuBLAS take default algorithms,
whose workspace is what is counted), and the cuDNN and CUDA versions are
those the target config states.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax
import jax.numpy as jnp

import jaxamp
from experiments import data as data_lib
from experiments import train
from experiments.benchmark import roofline, workload
from experiments.benchmark.budget import Budget, SkipWork
from experiments.benchmark.results import Results

_CIFAR10_SHAPES = {"images": (roofline.CIFAR10_TRAIN_EXAMPLES, 32, 32, 3)}


_HALF_DTYPES = ("float16", "bfloat16")
_FP8_DTYPES = ("float8_e4m3fn", "float8_e5m2")
# What an FP8 precision's memory is set against: the same policy without FP8, by the same route.
_FP8_BASELINE = "mixed_bf16"

_MB = 1e6


def variant_key(precision: str, route: str) -> str:
    """The results key of `precision` compiled by `route`: the recipe's route keeps the precision's name."""
    return precision if route == "apply_policy" else f"{precision} {route}"


def abstract_arguments(
    model: str, precision: str, batch_size: int, device, route: str = "apply_policy"
) -> tuple:
    """The train step's arguments as ShapeDtypeStructs on `device`, the model applied by `route`."""
    config = workload.train_config(model, precision, batch_size)
    steps_per_epoch = roofline.CIFAR10_TRAIN_EXAMPLES // batch_size
    state = workload.abstract_train_state(config, steps_per_epoch, route=route)
    data = (
        jax.ShapeDtypeStruct(_CIFAR10_SHAPES["images"], jnp.uint8),
        jax.ShapeDtypeStruct((roofline.CIFAR10_TRAIN_EXAMPLES,), jnp.int32),
        jax.ShapeDtypeStruct((batch_size,), jnp.int32),
        jax.eval_shape(lambda: jax.random.key(0)),
    )
    return jaxamp.diagnostics.on_device((state, *data), device)


@dataclasses.dataclass(frozen=True)
class CompiledStep:
    """A train step compiled for a GPU target, read for the figures on paper.

    Attributes:
        compiled: the executable (``memory_analysis()``, ``as_text()``).
        text: its optimized HLO.
        report: matmuls and convolutions by dtype (`jaxamp.diagnostics.hlo_precision_report`).
        total_flops: XLA's FLOP count of the step (the heavy FLOPs where XLA gives none).
        bytes_accessed: the step's memory traffic (`jaxamp.diagnostics.bytes_accessed`).
        compile_s: seconds the lowering and compilation took.
        bound: the program's roofline at the target's peaks, over the whole
            step (``global_s``) and kernel by kernel (``per_kernel_s``):
            a `jaxamp.diagnostics.KernelRoofline`.
    """

    compiled: Any
    text: str
    report: Any
    total_flops: float
    bytes_accessed: float
    compile_s: float
    bound: Any


FP8_WHERE = ("pays", "everywhere")
"""Where an FP8 precision runs FP8: only where the target says it pays (the default), or at every eligible matmul."""


def compile_step(step, arguments, precision: str, context, spec, fp8_where: str = "pays") -> CompiledStep:
    """`step` (donating its first argument) compiled for `arguments` placed on a GPU target.

    Args:
        step: the train step, a function of (state, *batch).
        arguments: its abstract arguments, on the target device (`jaxamp.diagnostics.on_device`).
        precision: ``fp32``, ``tf32`` or a policy name: which peak each FLOP runs at.
        context: the precision's matmul-precision context manager.
        spec: the target's `jaxamp.diagnostics.GpuSpec`.
        fp8_where: under an FP8 policy, ``pays`` (each matmul in FP8 only where it
            pays on `spec`, as on that GPU) or ``everywhere``.
    """
    if fp8_where not in FP8_WHERE:
        raise ValueError(f"fp8_where={fp8_where!r}; choose one of {', '.join(FP8_WHERE)}.")
    has_fp8 = "float8_e4m3fn" in spec.peak_flops
    deciding = jaxamp.diagnostics.fp8_target(spec if fp8_where == "pays" and has_fp8 else "everywhere")
    with context, deciding:
        start = time.perf_counter()
        lowered = jax.jit(step, donate_argnums=0).lower(*arguments)
        compiled = lowered.compile()
        compile_s = time.perf_counter() - start
    text = compiled.as_text()
    # The lowered program says which GEMMs asked for FP8, so one that XLA ran
    # wider shows as "requested, not fp8" rather than as a plain bfloat16 GEMM.
    fp8 = train.resolve_precision(precision).policy.fp8_matmuls
    lowered_text = jaxamp.diagnostics.lowered_hlo_text(lowered) if fp8 else None
    report = jaxamp.diagnostics.hlo_precision_report(text, lowered_text)
    heavy_flops = report.flops_by_dtype()
    total_flops = roofline.cost_of(lowered).get("flops", float(sum(heavy_flops.values())))
    bytes_accessed = jaxamp.diagnostics.bytes_accessed(text)
    bound = roofline.step_bound(text, spec, precision)
    return CompiledStep(compiled, text, report, total_flops, bytes_accessed, compile_s, bound)


def compile_for(
    target: str, model: str, precision: str, batch_size: int, route: str = "apply_policy"
) -> dict:
    """Compiles one train step for `target` and describes what it would run.

    Args:
        target: a name of `jaxamp.diagnostics.GPU_TARGETS`.
        model: a name of `experiments.models.MODELS`.
        precision: ``fp32``, ``tf32`` or a jaxamp policy name.
        batch_size: images per step.
        route: how the policy reaches the model, one of
            `experiments.benchmark.workload.ROUTES`.
    """
    spec = jaxamp.diagnostics.gpu_spec(target)
    device = jaxamp.diagnostics.gpu_target_device(spec)
    config = workload.train_config(model, precision, batch_size)
    dataset = data_lib.synthetic_dataset(num_train=1, num_test=1)  # mean/std only
    arguments = abstract_arguments(model, precision, batch_size, device, route)
    step = compile_step(
        train.make_train_step(config, dataset),
        arguments,
        precision,
        train.resolve_precision(precision).context(),
        spec,
    )
    compiled, report = step.compiled, step.report
    heavy_flops = report.flops_by_dtype()
    total_flops, bytes_accessed, bound, compile_s = (
        step.total_flops,
        step.bytes_accessed,
        step.bound,
        step.compile_s,
    )
    compute_dtype = workload.compute_dtype_name(precision)
    fp8 = workload.is_fp8_precision(precision)
    # An FP8 policy's heavy ops run in FP8 or, where FP8 cannot run, in its
    # compute dtype: both count as "in the policy's precision" here.
    in_policy = (compute_dtype, *(_FP8_DTYPES if fp8 else ()))
    entry = {
        "target": target,
        "device_kind": device.device_kind,
        "model": model,
        "precision": precision,
        "route": route,
        "batch_size": batch_size,
        "compile_s": compile_s,
        "memory": workload.memory_of(compiled),
        "heavy_ops_by_dtype": report.count_by_dtype(),
        "heavy_flops_by_dtype": heavy_flops,
        "cudnn_convolutions": sum(op.primitive.startswith("__cudnn$conv") for op in report.ops),
        "heavy_ops_in_compute_dtype": sum(op.compute_dtype in in_policy for op in report.ops)
        / len(report.ops),
        "half_flop_share": sum(report.fraction(dtype) for dtype in _HALF_DTYPES),
        "flops_per_step": total_flops,
        "bytes_accessed_per_step": bytes_accessed,
        "roofline_step_s": bound.global_s,
        "roofline_compute_s": bound.compute_s,
        "roofline_memory_s": bound.memory_s,
        "roofline_epoch_s": roofline.epoch_bound(bound.global_s, batch_size),
        "roofline_per_kernel_s": bound.per_kernel_s,
        "roofline_per_kernel_epoch_s": roofline.epoch_bound(bound.per_kernel_s, batch_size),
    }
    if fp8:
        entry["fp8"] = fp8_summary(report)
    return entry


def _is_convolution(op) -> bool:
    return "conv" in op.primitive.lower()  # convolution, __cudnn$convForward[Graph], __cudnn$convBackward*


def fp8_summary(report) -> dict:
    """FP8 shares and rows of a compiled program's `jaxamp.PrecisionReport`.

    Returns:
        ``conv_share_forward``, ``conv_share_backward``: the share of the
        convolution FLOPs of that pass with FP8 operands (None without
        convolutions); ``matmul_share_forward``, ``matmul_share_backward``:
        the same for matmuls; ``share``: of all matmul and convolution FLOPs;
        ``rows``: `PrecisionReport.fp8_rows` as dicts (status, direction,
        operand dtypes, primitive, reason, ops, FLOPs).
    """

    def share(ops):
        total = sum(op.flops for op in ops)
        return sum(op.flops for op in ops if op.is_fp8) / total if total else None

    summary = {}
    for kind, keep in (("conv", _is_convolution), ("matmul", lambda op: not _is_convolution(op))):
        for direction in ("forward", "backward"):
            summary[f"{kind}_share_{direction}"] = share(
                [op for op in report.ops if keep(op) and op.direction == direction]
            )
    summary["share"] = share(report.ops)
    summary["rows"] = [dataclasses.asdict(row) for row in report.fp8_rows()]
    return summary


def run(
    targets: list[str],
    models: list[str],
    precisions: list[str],
    batch_size: int,
    budget: Budget,
    results: Results,
    routes: tuple[str, ...] = workload.ROUTES,
) -> None:
    """Compiles every target x model x precision x route that fits the budget.

    A float32 precision (``fp32``, ``tf32``) is compiled once, by the
    recipe's route (a float32 policy changes nothing, so the routes would
    compile the same program); a half or FP8 precision once per route in
    `routes` (`workload.routes_for`).
    """
    compile_estimate = 0.0
    for target in targets:
        for model in models:
            for precision in precisions:
                for route in workload.routes_for(precision, routes):
                    compile_s = _compile_and_record(
                        target, model, precision, route, batch_size, budget, results, compile_estimate
                    )
                    compile_estimate = max(compile_estimate, compile_s)


def _compile_and_record(
    target: str,
    model: str,
    precision: str,
    route: str,
    batch_size: int,
    budget: Budget,
    results: Results,
    compile_estimate: float,
) -> float:
    """Compiles one variant if the budget allows and records it with its ratios to fp32.

    Returns:
        Its compile seconds (0 when skipped).
    """
    key = variant_key(precision, route)
    work = f"target {target} {model} {key}"
    if (
        workload.is_fp8_precision(precision)
        and "float8_e4m3fn" not in jaxamp.diagnostics.gpu_spec(target).peak_flops
    ):
        with_fp8 = [
            name
            for name, spec in jaxamp.diagnostics.GPU_TARGETS.items()
            if "float8_e4m3fn" in spec.peak_flops
        ]
        budget.skip(
            work, f"the {target} has no FP8 tensor cores (Hopper and later have them: {', '.join(with_fp8)})"
        )
        return 0.0
    try:
        budget.require(work, compile_estimate)
        entry = compile_for(target, model, precision, batch_size, route)
    except SkipWork as skip:
        budget.skip(work, str(skip))
        return 0.0
    except jax.errors.JaxRuntimeError as error:
        # e.g. a CUDA 13 ptxas, which no longer compiles for the V100's sm_70:
        # put a CUDA 12 ptxas first on PATH to compile for it.
        budget.skip(work, f"XLA could not compile it here: {str(error).splitlines()[0]}")
        return 0.0
    fp32 = results.get(("targets", target, model, "fp32"))
    if fp32 is not None and key != "fp32":
        entry["temp_ratio_to_fp32"] = entry["memory"]["temp_bytes"] / fp32["memory"]["temp_bytes"]
        entry["bytes_ratio_to_fp32"] = entry["bytes_accessed_per_step"] / fp32["bytes_accessed_per_step"]
    if "fp8" in entry:
        baseline_key = variant_key(_FP8_BASELINE, route)
        baseline = results.get(("targets", target, model, baseline_key))
        if baseline is not None:
            entry["fp8"]["baseline"] = baseline_key
            entry["fp8"]["temp_ratio"] = entry["memory"]["temp_bytes"] / baseline["memory"]["temp_bytes"]
            entry["fp8"]["bytes_ratio"] = (
                entry["bytes_accessed_per_step"] / baseline["bytes_accessed_per_step"]
            )
    results.put(("targets", target, model, key), entry)
    print(
        f"{target} {model:<12} {key:<20} temp {entry['memory']['temp_bytes'] / _MB:8.0f} MB  "
        f"moved {entry['bytes_accessed_per_step'] / 1e9:6.2f} GB  "
        f"half {entry['half_flop_share']:.1%}  compile {entry['compile_s']:.1f}s"
        + (f"  fp8 {entry['fp8']['share']:.1%}" if "fp8" in entry else ""),
        flush=True,
    )
    return entry["compile_s"]


def _fmt(value: float | None, spec: str = ".2f") -> str:
    return "" if value is None else format(value, spec)


def table_rows(targets: dict) -> list[str]:
    """The section's Markdown table: one row per target x model x precision x route, then a note."""
    rows = [
        (
            "| target | model | precision | route | temp MB | temp vs fp32 | bytes moved GB | bytes vs fp32 "
            "| half share of conv+matmul FLOPs | temp+arg+out MB | convolutions and matmuls by dtype "
            "| cuDNN convolutions | compile s | epoch s bound on paper | epoch s bound per kernel |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for models in targets.values():
        for model, variants in models.items():
            for entry in variants.values():
                ops = ", ".join(f"{count} {dtype}" for dtype, count in entry["heavy_ops_by_dtype"].items())
                memory = entry["memory"]
                # Results written before routes existed lack the new fields: their cells stay empty.
                half_share = entry.get("half_flop_share")
                cells = [
                    entry["device_kind"],
                    model,
                    entry["precision"],
                    entry.get("route", "apply_policy"),
                    f"{memory['temp_bytes'] / _MB:.0f}",
                    _fmt(entry.get("temp_ratio_to_fp32")),
                    f"{entry['bytes_accessed_per_step'] / 1e9:.2f}",
                    _fmt(entry.get("bytes_ratio_to_fp32")),
                    _fmt(half_share, ".1%"),
                    f"{memory['total_bytes'] / _MB:.0f}",
                    ops,
                    str(entry["cudnn_convolutions"]),
                    f"{entry['compile_s']:.1f}",
                    f"{entry['roofline_epoch_s']:.3f}",
                    _fmt(entry.get("roofline_per_kernel_epoch_s"), ".3f"),
                ]
                rows.append("| " + " | ".join(cells) + " |")
    rows += [
        "",
        (
            "Route: how the policy reaches the model (`apply_policy`, the recipe's, or `jaxamp.autocast` of "
            "the plain model's apply). Bytes moved: estimated from the optimized program's kernels "
            "(XLA's cost analysis is empty without the GPU); it includes one read of the whole uint8 "
            "training set per step (the gather's operand), alike in every route. Epoch bound on paper: "
            "the global roofline, max(FLOPs at peak, bytes at bandwidth) of the whole step; per kernel: "
            "the sum of each kernel's own max (`jaxamp.diagnostics.kernel_roofline`), the tighter bound."
        ),
    ]
    return rows


def fp8_table_rows(targets: dict) -> list[str]:
    """The FP8 variants' Markdown table and their fallbacks; empty without FP8 variants."""
    entries = [
        (model, entry)
        for models in targets.values()
        for model, variants in models.items()
        for entry in variants.values()
        if "fp8" in entry
    ]
    if not entries:
        return []
    rows = [
        (
            "| target | model | precision | route | FP8 share of conv FLOPs forward | backward "
            "| FP8 share of matmul FLOPs forward | backward | FP8 share of all | temp MB | temp vs baseline "
            "| bytes moved GB | bytes vs baseline | baseline |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    fallbacks = []
    for model, entry in entries:
        fp8 = entry["fp8"]
        cells = [
            entry["device_kind"],
            model,
            entry["precision"],
            entry["route"],
            _fmt(fp8["conv_share_forward"], ".1%"),
            _fmt(fp8["conv_share_backward"], ".1%"),
            _fmt(fp8["matmul_share_forward"], ".1%"),
            _fmt(fp8["matmul_share_backward"], ".1%"),
            _fmt(fp8["share"], ".1%"),
            f"{entry['memory']['temp_bytes'] / _MB:.0f}",
            _fmt(fp8.get("temp_ratio")),
            f"{entry['bytes_accessed_per_step'] / 1e9:.2f}",
            _fmt(fp8.get("bytes_ratio")),
            fp8.get("baseline", ""),
        ]
        rows.append("| " + " | ".join(cells) + " |")
        total = sum(entry["heavy_flops_by_dtype"].values()) or 1
        for row in fp8["rows"]:
            fallbacks.append(
                f"| {entry['device_kind']} | {model} | {entry['route']} | {row['status']} | {row['direction']} "
                f"| {' x '.join(row['operand_dtypes'])} | {row['primitive']} | {row['reason']} "
                f"| {row['ops']} | {row['flops'] / total:.1%} |"
            )
    rows += [
        "",
        (
            "Where FP8 was in question, by outcome (fp8: ran with FP8 operands; fallback: bfloat16 on "
            "purpose, with the reason; requested, not fp8: XLA ran a wider GEMM), from "
            "`jaxamp.PrecisionReport.fp8_rows` of the optimized program:"
        ),
        "",
        "| target | model | route | outcome | pass | operands | as | reason | ops | share of conv+matmul FLOPs |",
        "|---|---|---|---|---|---|---|---|---|---|",
        *fallbacks,
    ]
    return rows
