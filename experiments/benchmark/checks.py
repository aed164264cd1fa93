"""The project's performance targets, checked against what a run measured.

Each check reads the results and says met or missed; a check whose inputs
were not measured in the run is left out. The benchmark prints them in the
table and the log; a missed target makes it exit 1 only under ``--check``
(timings on a shared machine are noisy: rerun on an idle one before
concluding).
"""

from __future__ import annotations

from typing import Any

# Loss-scale overhead allowed over NoOpLossScale, per model (CPU targets).
LOSS_SCALE_OVERHEAD = {"mlp": 1.10, "resnet18": 1.03}
PIPELINE_SHARE = 0.02
ANCHORS = ("flax_dynamic_scale", "jmp_dynamic", "optax_apply_if_finite")
TARGET_TEMP_RATIO = 0.55
# Overflow attribution's cost allowed over the step without it: step time here, bytes moved on a GPU target.
ATTRIBUTION_STEP_TIME = {"leaves": 1.03, "leaves+record": 1.10}
ATTRIBUTION_BYTES = {"leaves": 1.01, "leaves+record": 1.05}


def _check(name: str, value: float, target: str, met: bool, timed: bool = True) -> dict[str, Any]:
    """One verdict; `timed` says whether it rests on a timing (noisy) or on a compilation."""
    return {"check": name, "value": value, "target": target, "met": bool(met), "timed": timed}


def loss_scale_checks(loss_scale: dict) -> list[dict]:
    checks = []
    for model, variants in loss_scale.items():
        if model in LOSS_SCALE_OVERHEAD and {"jaxamp_dynamic", "jaxamp_noop"} <= set(variants):
            ratio = variants["jaxamp_dynamic"]["ms_per_step"] / variants["jaxamp_noop"]["ms_per_step"]
            allowed = LOSS_SCALE_OVERHEAD[model]
            checks.append(
                _check(
                    f"{model}: DynamicLossScale / NoOpLossScale", ratio, f"<= {allowed:.2f}", ratio <= allowed
                )
            )
        for anchor in ANCHORS:
            if anchor in variants and "jaxamp_dynamic" in variants:
                ratio = variants["jaxamp_dynamic"]["ms_per_step"] / variants[anchor]["ms_per_step"]
                checks.append(_check(f"{model}: jaxamp step / {anchor} step", ratio, "<= 1.00", ratio <= 1.0))
    return checks


def throughput_checks(throughput: dict, torch: dict, on_gpu: bool) -> list[dict]:
    """The GPU targets on throughput (only meaningful, and only checked, on a GPU)."""
    if not on_gpu:
        return []
    checks = []

    def ratio(model, precision, baseline):
        entries = throughput.get(model, {})
        if precision in entries and baseline in entries and "train_step_s" in entries[precision]:
            return entries[baseline]["train_step_s"] / entries[precision]["train_step_s"]
        return None

    for model, precision, baseline, target in [
        ("resnet18", "mixed", "tf32", 1.6),
        ("resnet18", "mixed", "fp32", 5.0),
        ("mobilenetv2", "mixed", "fp32", 1.0),
    ]:
        value = ratio(model, precision, baseline)
        if value is not None:
            checks.append(
                _check(
                    f"{model}: {precision} / {baseline} train speed", value, f">= {target}", value >= target
                )
            )
    mixed18 = throughput.get("resnet18", {}).get("mixed", {})
    if "measured_epoch_s" in mixed18:
        value = mixed18["measured_epoch_s"]
        checks.append(_check("resnet18 mixed: seconds per CIFAR-10 epoch", value, "< 1.5", value < 1.5))
    mixed50 = throughput.get("resnet50", {}).get("mixed", {})
    if "share_of_peak" in mixed50:
        value = mixed50["share_of_peak"]
        checks.append(_check("resnet50 mixed: share of half-precision peak", value, ">= 0.25", value >= 0.25))
    for model, precisions in torch.items():
        ours = throughput.get(model, {}).get("mixed", {})
        if "mixed" in precisions and "train_images_per_s" in ours:
            value = ours["train_images_per_s"] / precisions["mixed"]["train_images_per_s"]
            checks.append(
                _check(f"{model}: jaxamp mixed / PyTorch AMP train speed", value, ">= 1.00", value >= 1.0)
            )
    return checks


def target_checks(targets: dict) -> list[dict]:
    checks = []
    for target, models in targets.items():
        for model, precisions in models.items():
            for precision, entry in precisions.items():
                # The memory target is the recipe's (apply_policy); autocast's ratio is reported beside it.
                recipe_route = entry.get("route", "apply_policy") == "apply_policy"
                if precision.startswith("mixed") and recipe_route and "temp_ratio_to_fp32" in entry:
                    value = entry["temp_ratio_to_fp32"]
                    checks.append(
                        _check(
                            f"{target} {model} {precision}: temp memory / fp32",
                            value,
                            f"<= {TARGET_TEMP_RATIO}",
                            value <= TARGET_TEMP_RATIO,
                            timed=False,
                        )
                    )
                if precision.startswith("mixed"):
                    # An FP8 variant counts its FP8 ops with its bfloat16 ones (targets.compile_for).
                    in_what = "FP8 or half" if "fp8" in entry else "half"
                    value = entry["heavy_ops_in_compute_dtype"]
                    checks.append(
                        _check(
                            f"{target} {model} {precision}: convolutions and matmuls in {in_what}",
                            value,
                            "= 100%",
                            value == 1.0,
                            timed=False,
                        )
                    )
    return checks


def attribution_checks(attribution: dict) -> list[dict]:
    """The cost targets of the gradient attribution (``leaves``) and of the overflow record."""
    measured = [
        (f"{model}: step time", versions, "ratio_to_none", ATTRIBUTION_STEP_TIME, True)
        for model, versions in attribution.get("step_time", {}).items()
    ] + [
        (
            f"{target} {model}: bytes moved",
            versions,
            "bytes_accessed_per_step_ratio_to_none",
            ATTRIBUTION_BYTES,
            False,
        )
        for target, models in attribution.get("targets", {}).items()
        for model, versions in models.items()
    ]
    return [
        _check(
            f"{what}, attribution {version} / none",
            versions[version][ratio],
            f"<= {allowed:.2f}",
            versions[version][ratio] <= allowed,
            timed=timed,
        )
        for what, versions, ratio, limits, timed in measured
        for version, allowed in limits.items()
    ]


def all_checks(results: dict, on_gpu: bool) -> list[dict]:
    checks = loss_scale_checks(results.get("loss_scale", {}))
    checks += attribution_checks(results.get("attribution", {}))
    pipeline = results.get("pipeline")
    if pipeline:
        checks.append(
            _check(
                f"{pipeline['model']} {pipeline['precision']}: input pipeline share of the step",
                pipeline["share"],
                f"<= {PIPELINE_SHARE:.0%}",
                pipeline["share"] <= PIPELINE_SHARE,
            )
        )
    checks += throughput_checks(results.get("throughput", {}), results.get("torch", {}), on_gpu)
    checks += target_checks(results.get("targets", {}))
    return checks
