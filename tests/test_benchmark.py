"""Tests for `experiments.benchmark`: every section on tiny settings, the
roofline by hand, the budget, the anchors' overflow handling, the PyTorch
reference models. No test asserts a timing."""

import json
import math
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxamp
from experiments.benchmark import budget as budget_lib
from experiments.benchmark import checks, loss_scale, output, roofline, targets, timing, torch_amp, workload
from experiments.benchmark.__main__ import (
    build_parser,
    resolve_settings,
)
from experiments.benchmark.__main__ import (
    main as benchmark_main,
)
from experiments.benchmark.results import Results
from experiments.benchmark.sections import run_sections
from experiments.models import create_model

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_RUN = [
    "--models",
    "resnet_tiny",
    "--precisions",
    "mixed",
    "--batch-size",
    "4",
    "--rounds",
    "1",
    "--steps",
    "1",
    "--num-train",
    "8",
    "--loss-scale-models",
    "mlp",
    "--loss-scale-batch-size",
    "4",
    "--torch-models",
    "resnet_tiny",
]


def test_a_tiny_run_of_every_section_writes_its_fields_table_plots_and_exits_0_whatever_it_measured(
    tmp_path,
):
    exit_code = benchmark_main([*TINY_RUN, "--out-dir", str(tmp_path)])
    results = json.loads((tmp_path / "results.json").read_text())
    entry = results["throughput"]["resnet_tiny"]["mixed"]
    for field in (
        "train_images_per_s",
        "eval_images_per_s",
        "compile_s",
        "memory",
        "flops_per_image",
        "achieved_tflops",
        "measured_epoch_s",
    ):
        assert field in entry, field
    assert entry["memory"]["total_bytes"] == sum(
        entry["memory"][k] for k in ("temp_bytes", "argument_bytes", "output_bytes")
    )
    assert set(results["loss_scale"]["mlp"]) == set(loss_scale.VARIANTS)
    assert results["loss_scale"]["mlp"]["plain"]["ratio_to_plain"] == 1.0
    assert set(results["attribution"]["step_time"]["mlp"]) == {"none", "leaves", "leaves+record"}
    assert results["attribution"]["step_time"]["mlp"]["none"]["ratio_to_none"] == 1.0
    assert 0 < results["pipeline"]["share"]
    if torch_amp.torch_available():
        assert results["torch"]["resnet_tiny"]["mixed"]["autocast_dtype"] == "bfloat16"  # on CPU
    table = (tmp_path / "table.md").read_text()
    assert "## Throughput" in table and "## What loss scaling costs" in table and "## Targets" in table
    assert (
        "## What overflow attribution costs" in table
        and "| mlp: step time, attribution leaves / none |" in table
    )
    for plot in ("throughput.png", "memory.png", "overhead.png"):
        assert (tmp_path / plot).stat().st_size > 0
    assert exit_code == 0  # it ran; a missed target is in the table, and fails only under --check
    assert table.count("**missed**") == sum(not check["met"] for check in results["checks"])


@pytest.fixture
def a_run_that_misses_a_timing_target(monkeypatch):
    """The benchmark with its sections stubbed out and one timed target missed."""
    from experiments.benchmark import sections

    monkeypatch.setattr(sections, "run_sections", lambda settings, budget, results: None)
    missed = {"check": "mlp: DynamicLossScale / NoOpLossScale", "value": 1.2, "target": "<= 1.10"}
    monkeypatch.setattr(checks, "all_checks", lambda *args: [{**missed, "met": False, "timed": True}])


@pytest.mark.parametrize("flags, exit_code", [([], 0), (["--check"], 1)])
def test_a_missed_timing_target_is_reported_and_fails_the_run_only_under_check(
    a_run_that_misses_a_timing_target, tmp_path, capsys, flags, exit_code
):
    """Fails where a missed target alone makes the exit status 1 (it did)."""
    assert benchmark_main([*TINY_RUN, "--no-plots", "--out-dir", str(tmp_path), *flags]) == exit_code

    log = capsys.readouterr().out
    assert "missed 1 target(s): mlp: DynamicLossScale / NoOpLossScale" in log
    assert (
        "| mlp: DynamicLossScale / NoOpLossScale | 1.200 | <= 1.10 | **missed** |"
        in (tmp_path / "table.md").read_text()
    )


@pytest.mark.parametrize(
    "load_at_start, load_at_end, cores, says",
    [
        (1.8, 1.2, 2, "1.8 at the start, 1.2 at the end, not above the 2 cores: no more work than cores"),
        (1.0, 3.5, 2, "1.0 at the start, 3.5 at the end, above the 2 cores: other work shared the machine"),
        (5.0, 5.0, 16, "not above the 16 cores"),
        (1.5, 0.5, None, "1.5 at the start, 0.5 at the end."),
    ],
)
def test_the_tables_sentence_on_machine_load_follows_the_measured_load_and_core_count(
    load_at_start, load_at_end, cores, says
):
    """Fails where the sentence is fixed text (it said 'above the core count' beside a load of 1.8 on 2)."""
    environment = {
        "device": "cpu",
        "platform": "cpu",
        "jax": jax.__version__,
        "command": "python -m experiments.benchmark",
        "settings": {},
        "wall_s": 10.0,
        "load_average_at_start": load_at_start,
        "load_average_at_end": load_at_end,
        "cpu_count": cores,
    }
    table = output.table({"environment": environment})
    assert says in table
    busy = cores is not None and max(load_at_start, load_at_end) > cores
    assert ("other work shared the machine" in table) == busy


@pytest.mark.parametrize(
    "precision, float32_peak", [("fp32", "float32"), ("tf32", "tf32"), ("mixed", "tf32")]
)
def test_the_bound_is_the_librarys_kernel_roofline_with_float32_matmuls_at_tf32_except_under_fp32(
    precision, float32_peak
):
    """A float32 matmul of 2 x 256 x 512 x 128 FLOPs, bounded on an H100: the
    benchmark's bound is `jaxamp.diagnostics.kernel_roofline` of the compiled
    program, at the float32 peak under true fp32 and at TF32's otherwise.
    Fails if the benchmark bounded the step by a formula of its own."""
    text = jax.jit(lambda a, b: a @ b).lower(jnp.ones((256, 512)), jnp.ones((512, 128))).compile().as_text()
    spec = jaxamp.diagnostics.GPU_TARGETS["h100"]
    bound = roofline.step_bound(text, spec, precision)
    assert bound == jaxamp.diagnostics.kernel_roofline(text, spec, float32_peak=float32_peak)
    assert bound.compute_s == pytest.approx(2 * 256 * 512 * 128 / spec.peak_flops[float32_peak])
    assert bound.memory_s == pytest.approx(jaxamp.diagnostics.bytes_accessed(text) / spec.memory_bandwidth)
    assert roofline.epoch_bound(0.01, 128) == pytest.approx(0.01 * 390)  # 50000 // 128 steps


@pytest.mark.parametrize(
    "precision, dtype, peak",
    [
        ("fp32", "float32", "float32"),
        ("tf32", "float32", "tf32"),
        ("mixed", "float32", "tf32"),
        ("mixed", "float16", "float16"),
        ("mixed_bf16", "bfloat16", "bfloat16"),
        ("mixed_float8", "float8_e4m3fn", "float8_e4m3fn"),
    ],
)
def test_the_share_of_peak_divides_by_the_peak_of_the_precisions_heavy_math(precision, dtype, peak):
    assert roofline.main_peak_key(precision, dtype) == peak


def test_a_budget_skips_and_lists_work_that_would_not_fit_rather_than_overrunning(tmp_path):
    budget = budget_lib.Budget(seconds=0.0)
    settings = resolve_settings(
        build_parser().parse_args(TINY_RUN + ["--sections", "throughput,loss_scale,pipeline"])
    )
    results = Results(str(tmp_path), {"environment": {}})
    run_sections(settings, budget, results)
    assert [item["work"] for item in budget.skipped] == [
        "throughput resnet_tiny mixed",
        "loss_scale mlp",
        "pipeline resnet_tiny mixed",
    ]
    assert all("budget left" in item["reason"] for item in budget.skipped)
    assert "throughput" not in results.data and "loss_scale" not in results.data


def test_a_budget_refuses_work_expected_to_outlast_it_and_names_both_times():
    budget = budget_lib.Budget(seconds=100.0)
    budget.require("short", 10.0)
    with pytest.raises(budget_lib.SkipWork, match=r"long: expected 500s, (99|100)s of the budget left"):
        budget.require("long", 500.0)


def test_results_are_on_disk_after_every_measurement_and_a_failed_write_keeps_the_old_file(
    tmp_path, monkeypatch
):
    results = Results(str(tmp_path), {"environment": {"device": "cpu"}})
    results.put(("throughput", "resnet18", "mixed"), {"train_images_per_s": 1.0})
    on_disk = json.loads((tmp_path / "results.json").read_text())
    assert on_disk["throughput"]["resnet18"]["mixed"] == {"train_images_per_s": 1.0}
    assert results.get(("throughput", "resnet18", "fp32")) is None

    def broken_replace(*args):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(OSError):
        results.put(("loss_scale",), {"mlp": {}})
    assert json.loads((tmp_path / "results.json").read_text()) == on_disk
    assert os.listdir(tmp_path) == ["results.json"]  # no temporary file left behind


def test_interleaved_timing_warms_up_then_alternates_the_order_every_round():
    calls = []
    steps = {name: (lambda name=name: calls.append(name)) for name in ("a", "b")}
    medians = timing.interleaved_medians(steps, rounds=3, steps=2, warmup=1, synchronize=lambda _: None)
    assert set(medians) == {"a", "b"}
    assert calls == ["a", "b"] + ["a", "a", "b", "b"] + ["b", "b", "a", "a"] + ["a", "a", "b", "b"]


def test_every_anchor_recipe_skips_an_injected_overflow_the_way_its_library_does():
    model, images, labels = loss_scale.make_problem("mlp", batch_size=4)
    overflowing = jnp.full_like(images, jnp.inf)
    scale_of = {
        "jaxamp_dynamic": lambda state: state.loss_scale.loss_scale,
        "flax_dynamic_scale": lambda state: state[3].scale,
        "jmp_dynamic": lambda state: state[3].loss_scale,
    }

    def params_of(name, state):
        return jax.tree.map(np.asarray, state.params if name.startswith("jaxamp") else state[0])

    def unchanged(before, after):
        return jax.tree.all(jax.tree.map(np.array_equal, before, after))

    for name, (step, state) in loss_scale.build_variants(model, images).items():
        step = jax.jit(step)
        skipped, _ = step(state, overflowing, labels)
        assert unchanged(params_of(name, state), params_of(name, skipped)) == (name != "plain"), name
        if name in scale_of:  # a dynamic loss scale halves on an overflow
            assert float(scale_of[name](skipped)) == float(scale_of[name](state)) / 2, name
        if name == "optax_apply_if_finite":
            assert int(skipped[1].notfinite_count) == 1
        applied, _ = step(state, images, labels)  # a clean step moves every recipe's params
        assert not unchanged(params_of(name, state), params_of(name, applied)), name


def test_the_attribution_versions_skip_alike_and_differ_only_in_what_they_record():
    """Inf images: every version skips the step; `leaves` and `leaves+record` name the same leaves,
    and only `leaves+record` keeps the record, which names the first layer's forward pass."""
    model, images, labels = loss_scale.make_problem("mlp", batch_size=4)
    overflowing = jnp.full_like(images, jnp.inf)
    variants = loss_scale.build_variants(model, images, loss_scale.ATTRIBUTION_VARIANTS)
    skipped = {name: jax.jit(step)(state, overflowing, labels)[0] for name, (step, state) in variants.items()}
    assert all(int(state.skipped_steps) == 1 and int(state.step) == 0 for state in skipped.values())
    none, leaves, record = (skipped[name] for name in loss_scale.ATTRIBUTION_VARIANTS)
    assert none.nonfinite_grads is None and none.overflow_record is None
    assert leaves.nonfinite_grads.nonfinite_paths() == record.nonfinite_grads.nonfinite_paths()
    assert "Dense_0/kernel" in leaves.nonfinite_grads.nonfinite_paths() and leaves.overflow_record is None
    first = record.overflow_record.first_overflow()
    assert (first.site.name, first.pass_) == ("Dense_0", "forward")


def test_the_attribution_versions_compiled_for_a_target_differ_only_in_the_state_they_keep():
    """What `attribution.compile_on_target` lowers, on this CPU's device (no compile)."""
    from experiments.benchmark import attribution

    device = jax.devices()[0]
    steps = {
        version: attribution._abstract_step(version, "resnet_tiny", 4, device)
        for version in attribution.VERSIONS
    }
    states = {version: arguments[0] for version, (_, arguments) in steps.items()}
    assert states["none"].nonfinite_grads is None and states["none"].overflow_record is None
    assert states["leaves"].nonfinite_grads is not None and states["leaves"].overflow_record is None
    record = states["leaves+record"].overflow_record
    assert record.sites[-1].name == "Dense_0" and record.backward_recorded
    assert all(leaf.shape == (len(record.sites),) for leaf in jax.tree.leaves(record))


def test_attribution_checks_hold_each_version_to_its_own_target():
    measured = {
        "step_time": {"mlp": {"leaves": {"ratio_to_none": 1.02}, "leaves+record": {"ratio_to_none": 1.12}}},
        "targets": {
            "h200": {
                "resnet18": {
                    "leaves": {"bytes_accessed_per_step_ratio_to_none": 1.0},
                    "leaves+record": {"bytes_accessed_per_step_ratio_to_none": 1.06},
                }
            }
        },
    }
    verdicts = {
        check["check"]: (check["met"], check["timed"]) for check in checks.attribution_checks(measured)
    }
    assert verdicts == {
        "mlp: step time, attribution leaves / none": (True, True),  # 1.02 <= 1.03
        "mlp: step time, attribution leaves+record / none": (False, True),  # 1.12 > 1.10
        "h200 resnet18: bytes moved, attribution leaves / none": (True, False),
        "h200 resnet18: bytes moved, attribution leaves+record / none": (False, False),  # 1.06 > 1.05
    }


def test_checks_say_met_and_missed_against_the_projects_targets():
    measured = {
        "mlp": {
            "jaxamp_dynamic": {"ms_per_step": 1.05},
            "jaxamp_noop": {"ms_per_step": 1.0},
            "jmp_dynamic": {"ms_per_step": 1.2},
        },
        "resnet18": {"jaxamp_dynamic": {"ms_per_step": 1.05}, "jaxamp_noop": {"ms_per_step": 1.0}},
    }
    verdicts = {check["check"]: check["met"] for check in checks.loss_scale_checks(measured)}
    assert verdicts == {
        "mlp: DynamicLossScale / NoOpLossScale": True,  # 5% <= 10%
        "mlp: jaxamp step / jmp_dynamic step": True,
        "resnet18: DynamicLossScale / NoOpLossScale": False,  # 5% > 3%
    }
    assert checks.throughput_checks({"resnet18": {}}, {}, on_gpu=False) == []


def test_a_target_checks_the_recipes_memory_and_every_routes_half_share():
    """autocast's temp memory is reported, not held to the recipe's target; its half share is checked.

    Fails if the memory target is applied to the autocast route (its 0.65
    would read missed) or if the autocast route's half share goes unchecked.
    """
    compiled = {
        "mixed": {"route": "apply_policy", "temp_ratio_to_fp32": 0.52, "heavy_ops_in_compute_dtype": 1.0},
        "mixed autocast": {
            "route": "autocast",
            "temp_ratio_to_fp32": 0.65,
            "heavy_ops_in_compute_dtype": 0.9,
        },
    }
    verdicts = {
        check["check"]: check["met"] for check in checks.target_checks({"h200": {"resnet50": compiled}})
    }
    assert verdicts == {
        "h200 resnet50 mixed: temp memory / fp32": True,
        "h200 resnet50 mixed: convolutions and matmuls in half": True,
        "h200 resnet50 mixed autocast: convolutions and matmuls in half": False,
    }


def test_the_torch_section_is_skipped_cleanly_when_torch_is_missing(tmp_path, monkeypatch):
    monkeypatch.setattr(torch_amp, "torch_available", lambda: False)
    budget = budget_lib.Budget()
    settings = resolve_settings(build_parser().parse_args(TINY_RUN + ["--sections", "torch"]))
    results = Results(str(tmp_path), {"environment": {}})
    run_sections(settings, budget, results)
    assert budget.skipped == [{"work": "torch", "reason": "PyTorch is not installed here (it is optional)"}]
    assert "torch" not in results.data


def test_importing_the_benchmark_does_not_import_torch():
    code = "import experiments.benchmark.__main__, sys; print('torch' in sys.modules)"
    completed = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=True
    )
    assert completed.stdout.strip() == "False"


@pytest.mark.parametrize("name", ["resnet18", "resnet50", "resnet101", "mobilenetv2", "resnet_tiny"])
def test_the_pytorch_models_have_exactly_our_parameter_counts(name):
    pytest.importorskip("torch", reason="PyTorch is optional")
    from experiments import torch_reference

    variables = jax.eval_shape(
        lambda: create_model(name).init(jax.random.key(0), jnp.zeros((1, 32, 32, 3)), train=False)
    )
    ours = sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(variables["params"]))
    assert torch_reference.parameter_count(torch_reference.create_model(name)) == ours


def test_a_half_precision_is_compiled_for_a_target_by_both_routes_with_memory_traffic_half_share(tmp_path):
    """fp32, then mixed by apply_policy and by autocast, compiled for an H200 on this CPU.

    Fails if the autocast route is not compiled for a half precision (or is
    compiled for fp32 too), if it runs the model without the policy
    (half share 0%, temp memory not below fp32's), if a field or ratio is
    dropped, or if the table leaves the route out.
    """
    if not jaxamp.diagnostics.cuda_plugin_available():
        pytest.skip("needs the CUDA PJRT plugin (pip install 'jax-mixed-precision[gpu-aot]')")
    results = Results(str(tmp_path), {"environment": {}})
    targets.run(["h200"], ["resnet_tiny"], ["fp32", "mixed"], 4, budget_lib.Budget(), results)
    entries = results.data["targets"]["h200"]["resnet_tiny"]
    assert set(entries) == {"fp32", "mixed", "mixed autocast"}
    assert [entries[key]["route"] for key in ("fp32", "mixed", "mixed autocast")] == [
        "apply_policy",
        "apply_policy",
        "autocast",
    ]
    fp32 = entries["fp32"]
    assert fp32["half_flop_share"] == 0.0 and set(fp32["heavy_ops_by_dtype"]) == {"float32"}
    for key in ("mixed", "mixed autocast"):
        entry = entries[key]
        assert entry["device_kind"] == "NVIDIA H200" and entry["cudnn_convolutions"] > 0
        assert entry["half_flop_share"] == 1.0 and entry["heavy_ops_in_compute_dtype"] == 1.0
        assert set(entry["heavy_ops_by_dtype"]) == {"float16"}
        assert 0 < entry["memory"]["temp_bytes"] < fp32["memory"]["temp_bytes"]
        assert entry["temp_ratio_to_fp32"] == entry["memory"]["temp_bytes"] / fp32["memory"]["temp_bytes"]
        assert 0 < entry["bytes_accessed_per_step"] < fp32["bytes_accessed_per_step"]
        bytes_ratio = entry["bytes_accessed_per_step"] / fp32["bytes_accessed_per_step"]
        assert entry["bytes_ratio_to_fp32"] == bytes_ratio
        assert entry["roofline_epoch_s"] > 0
        assert entry["roofline_per_kernel_epoch_s"] > 0
    table = "\n".join(targets.table_rows(results.data["targets"]))
    assert "| epoch s bound on paper | epoch s bound per kernel |" in table
    assert "| NVIDIA H200 | resnet_tiny | mixed | autocast |" in table
    assert "| NVIDIA H200 | resnet_tiny | mixed | apply_policy |" in table


def test_the_autocast_route_applies_the_plain_model_through_autocast_with_the_same_params():
    """No compile: the route's state, traced.

    Fails if the autocast route returns the recipe's state unchanged (its
    apply_fn is no autocast function), applies the plain model without
    autocast (the traced report is float32), or changes the params.
    """
    config = workload.train_config("resnet_tiny", "mixed", 4)
    recipe = workload.abstract_train_state(config, steps_per_epoch=10)
    autocast = workload.abstract_train_state(config, steps_per_epoch=10, route="autocast")
    assert hasattr(autocast.apply_fn, "rewrites") and not hasattr(recipe.apply_fn, "rewrites")
    same_leaf = lambda a, b: (a.shape, a.dtype) == (b.shape, b.dtype)
    assert all(jax.tree.leaves(jax.tree.map(same_leaf, recipe.params, autocast.params)))
    variables = {"params": autocast.params, "batch_stats": autocast.batch_stats}
    images = jax.ShapeDtypeStruct((4, 32, 32, 3), jnp.float32)
    report = jaxamp.precision_report(autocast.apply_fn, variables, images, train=False)
    assert report.fraction(jnp.float16) == 1.0
    with pytest.raises(ValueError, match="Unknown route 'amp'; choose one of apply_policy, autocast"):
        workload.apply_route(recipe, "resnet_tiny", jaxamp.get_policy("mixed_float16"), "amp")


def test_bad_settings_are_refused_with_the_flag_to_change():
    with pytest.raises(ValueError, match="--num-train 2 is below --batch-size 4"):
        resolve_settings(build_parser().parse_args(["--num-train", "2", "--batch-size", "4"]))
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--target", "b300"])


@pytest.mark.parametrize(
    "flags, targets_compiled",
    [(["--target", "h200"], ["h200"]), (["--target", "all"], ["v100", "a100", "h100", "h200", "b200"])],
)
def test_the_target_flag_alone_compiles_for_those_gpus_and_runs_nothing_else(flags, targets_compiled):
    settings = resolve_settings(build_parser().parse_args(flags))
    assert settings["sections"] == ["targets"]
    assert settings["targets"] == targets_compiled
