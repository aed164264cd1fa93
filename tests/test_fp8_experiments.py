"""The experiments with ``mixed_float8``: the CIFAR recipe's route and the benchmark's FP8 figures.

FP8 reaches a model by either route (`jaxamp.apply_policy` runs the model
through `jaxamp.autocast`), so the recipe's ``auto`` route is
``apply_policy`` for FP8 policies too, and the benchmark compiles FP8 by
both routes. All on the CPU, nothing compiled: the FP8 figures are read
from a hand-built report. Each test says which fault would make it fail.
"""

import jax
import jax.numpy as jnp
import pytest
from test_kernel_roofline import TWO_KERNELS

import jaxamp
from experiments import train
from experiments.benchmark import checks, roofline, targets, workload
from experiments.benchmark.budget import Budget
from experiments.benchmark.results import Results
from jaxamp._report import OpRecord, PrecisionReport


@pytest.mark.parametrize(
    "precision, route, resolved",
    [
        ("mixed_float8", "auto", "apply_policy"),
        ("mixed_fp8", "autocast", "autocast"),
        ("p=f32,c=bf16,o=f32,matmul=float8", "auto", "apply_policy"),
        ("mixed_bf16", "auto", "apply_policy"),
        ("fp32", "auto", "apply_policy"),
        ("mixed", "autocast", "autocast"),
    ],
)
def test_auto_is_apply_policy_for_every_policy_and_an_explicit_route_is_kept(precision, route, resolved):
    """Fails if ``auto`` stopped being the recipe's apply_policy for some policy, or an
    explicit ``--route autocast`` were overridden."""
    assert train.resolve_route(route, train.resolve_precision(precision)) == resolved


def test_an_unknown_route_is_refused_naming_it_and_the_choices():
    with pytest.raises(
        train.ConfigError, match=r"Unknown route 'layers'; choose one of auto, apply_policy, autocast"
    ):
        train.validate_config(train.TrainConfig(precision="mixed_float8", route="layers"))


def _scopes_of(primitive, jaxpr, scope=""):
    """The name scope of every `primitive` equation of `jaxpr` and of the jaxprs it carries."""
    for equation in jaxpr.eqns:
        here = "/".join(part for part in (scope, str(equation.source_info.name_stack)) if part)
        if equation.primitive is primitive:
            yield here
        for param in equation.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _scopes_of(primitive, inner, here)


def test_the_recipes_fp8_state_runs_its_convolutions_through_fp8_autocast():
    """The train state `create_train_state` builds for ``mixed_float8``: float32 params (the
    plain model's), and an ``apply_fn`` whose convolutions are traced under autocast's FP8
    scope, the stem (3 input channels) under its shape fallback. Fails if the route fell back
    to the plain model or to bfloat16 autocast (no jaxamp_fp8 scope), or if the params were
    cast."""
    config = train.TrainConfig(model="resnet_tiny", precision="mixed_float8", batch_size=4)
    state = jax.eval_shape(
        lambda: train.create_train_state(config, train.resolve_precision("mixed_float8"), 10, 1)
    )
    assert {leaf.dtype for leaf in jax.tree.leaves(state.params)} == {jnp.dtype(jnp.float32)}
    variables = {"params": state.params, "batch_stats": state.batch_stats}
    images = jax.ShapeDtypeStruct((4, 32, 32, 3), jnp.float32)
    closed = jax.make_jaxpr(lambda variables, images: state.apply_fn(variables, images, train=False))(
        variables, images
    )
    scopes = list(_scopes_of(jax.lax.conv_general_dilated_p, closed.jaxpr))
    fallbacks = [scope for scope in scopes if "jaxamp_fp8_fallback" in scope]
    assert len(fallbacks) == 1 and "jaxamp_fp8_fallback_shape_not_multiple_of_16" in fallbacks[0]
    assert len(scopes) > 1 and all("jaxamp_fp8" in scope for scope in scopes)


@pytest.mark.parametrize(
    "precision, routes",
    [("fp32", ("apply_policy",)), ("mixed", workload.ROUTES), ("mixed_float8", workload.ROUTES)],
)
def test_the_benchmark_compiles_half_and_fp8_precisions_by_both_routes_and_float32_by_one(precision, routes):
    """Fails if a half or FP8 precision lost one of its routes, or float32 compiled twice."""
    assert workload.routes_for(precision) == routes


def _op(primitive, dtype, flops, op_name):
    return OpRecord(primitive, (dtype, dtype), "bfloat16", flops, op_name=op_name)


def test_the_fp8_summary_splits_convolution_and_matmul_shares_by_pass():
    """A hand-built compiled report: a forward FP8 cuDNN graph (300 FLOPs) beside a stem
    fallback (100), two bfloat16 backward convolutions (400), a forward FP8 matmul (50) and a
    backward fallback matmul (50). Fails if the shares mixed convolutions with matmuls or
    the passes with each other, or if a row went missing from the table."""
    forward, backward = "jit(step)/jaxamp_fp8", "jit(step)/transpose(jvp(jaxamp_fp8))"
    report = PrecisionReport(
        (
            _op("__cudnn$convForwardGraph", "float8_e4m3fn", 300, forward),
            _op(
                "__cudnn$convForward",
                "bfloat16",
                100,
                "jit(step)/jaxamp_fp8_fallback_shape_not_multiple_of_16",
            ),
            _op(
                "__cudnn$convBackwardFilter", "bfloat16", 200, backward + "/jaxamp_fp8_fallback_conv_backward"
            ),
            _op("__cudnn$convForward", "bfloat16", 200, backward + "/jaxamp_fp8_fallback_conv_backward"),
            _op("__cublas$lt$matmul$f8", "float8_e4m3fn", 50, forward),
            _op("dot", "bfloat16", 50, backward + "/jaxamp_fp8_fallback_shape_not_multiple_of_16"),
        ),
        compiled=True,
    )
    summary = targets.fp8_summary(report)
    assert {key: value for key, value in summary.items() if key != "rows"} == {
        "conv_share_forward": 0.75,
        "conv_share_backward": 0.0,
        "matmul_share_forward": 1.0,
        "matmul_share_backward": 0.0,
        "share": 350 / 900,
    }
    assert sum(row["flops"] for row in summary["rows"]) == 900
    entry = {
        "device_kind": "NVIDIA H200",
        "precision": "mixed_float8",
        "route": "autocast",
        "memory": {"temp_bytes": 2e6},
        "bytes_accessed_per_step": 3e9,
        "heavy_flops_by_dtype": {"float8_e4m3fn": 350, "bfloat16": 550},
        "heavy_ops_in_compute_dtype": 1.0,
        "fp8": {**summary, "baseline": "mixed_bf16 autocast", "temp_ratio": 0.9, "bytes_ratio": 0.8},
    }
    table = "\n".join(targets.fp8_table_rows({"h200": {"resnet18": {"mixed_float8 autocast": entry}}}))
    assert (
        "| NVIDIA H200 | resnet18 | mixed_float8 | autocast | 75.0% | 0.0% | 100.0% | 0.0% | 38.9% | 2 | 0.90 "
        "| 3.00 | 0.80 | mixed_bf16 autocast |" in table
    )
    assert (
        "| autocast | fallback | backward | bfloat16 x bfloat16 | __cudnn$convBackwardFilter | conv_backward | 1 | 22.2% |"
        in table
    )
    (check,) = checks.target_checks({"h200": {"resnet18": {"mixed_float8 autocast": entry}}})
    assert check["check"] == "h200 resnet18 mixed_float8 autocast: convolutions and matmuls in FP8 or half"


def test_fp8_gemms_are_bounded_at_the_fp8_peak_and_gpus_without_fp8_are_skipped_with_the_reason(tmp_path):
    """The roofline counts FP8 FLOPs at the FP8 peak (not TF32's, the float32 fallback), and
    an A100 (no FP8 tensor cores, no FP8 peak) is skipped, not compiled. Fails if FP8 FLOPs
    fell to the TF32 peak or the A100 were compiled (a KeyError on its missing FP8 peak)."""
    fp8_gemm = TWO_KERNELS.replace("%x = bf16", "%x = f8e4m3fn").replace("%w = bf16", "%w = f8e4m3fn")
    h200 = jaxamp.diagnostics.GPU_TARGETS["h200"]
    gemm, _ = roofline.step_bound(fp8_gemm, h200, "mixed_float8").kernels
    assert gemm.compute_s == pytest.approx(2 * 4096**3 / h200.peak_flops["float8_e4m3fn"])
    assert roofline.main_peak_key("mixed_float8", "float8_e4m3fn") == "float8_e4m3fn"
    assert roofline.main_peak_key("mixed_float8", "bfloat16") == "bfloat16"
    budget = Budget()
    results = Results(str(tmp_path), {"environment": {}})
    targets.run(["a100"], ["resnet_tiny"], ["mixed_float8"], 4, budget, results)
    reason = "the a100 has no FP8 tensor cores (Hopper and later have them: h100, h200, b200)"
    assert budget.skipped == [
        {"work": "target a100 resnet_tiny mixed_float8", "reason": reason},
        {"work": "target a100 resnet_tiny mixed_float8 autocast", "reason": reason},
    ]
    assert "targets" not in results.data
