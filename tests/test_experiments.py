"""The CIFAR experiments: the real train step per model, the CLI, compare."""

import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fresh_processes import FreshProcess

import jaxamp
from experiments import cifar, compare, train
from experiments import data as data_lib
from experiments.models import MODELS
from jaxamp._optimizer.low_precision import LowPrecisionState
from jaxamp._optimizer.quantized import QuantizedArray

QUICK_RUN = ["--model", "resnet_tiny", "--data", "synthetic", "--steps-per-epoch", "2", "--no-progress"]


def tiny_dataset(num_train=16, num_test=8):
    return data_lib.synthetic_dataset(num_train=num_train, num_test=num_test, seed=0)


def abstract_train_step(model_name, precision, batch_size=2):
    """The experiments' real train step for a model, to be traced (never compiled).

    The step is wrapped in `jax.jit` so that a second trace at the same shapes
    (`jax.eval_shape`, then `jaxamp.precision_report`) reuses the first.
    """
    dataset = tiny_dataset()
    config = train.TrainConfig(model=model_name, precision=precision, batch_size=batch_size)
    resolved = train.resolve_precision(precision)
    state = jax.eval_shape(lambda: train.create_train_state(config, resolved, 10, steps_per_epoch=1))
    step = jax.jit(train.make_train_step(config, dataset))
    images = jax.ShapeDtypeStruct(dataset.train_images.shape, jnp.uint8)
    labels = jax.ShapeDtypeStruct(dataset.train_labels.shape, jnp.int32)
    indices = jax.ShapeDtypeStruct((batch_size,), jnp.int32)
    rng = jax.eval_shape(lambda: jax.random.key(0))
    return state, step, (images, labels, indices, rng)


# ResNet101 and ResNet152 are ResNet50 with more blocks per stage (the slowest
# models to trace): each is traced under one half dtype, every other model under both.
ZOO_PRECISIONS = [
    (model, precision)
    for model in sorted(MODELS)
    for precision in ("mixed_float16", "mixed_bfloat16")
    if (model, precision) not in {("resnet101", "mixed_bfloat16"), ("resnet152", "mixed_float16")}
]


@pytest.mark.parametrize("model_name, precision", ZOO_PRECISIONS)
def test_every_model_trains_in_half_precision_with_float32_params_and_logits(model_name, precision):
    state, step, batch = abstract_train_step(model_name, precision)
    new_state, metrics = jax.eval_shape(step, state, *batch)

    assert {leaf.dtype for leaf in jax.tree.leaves(new_state.params)} == {jnp.dtype(jnp.float32)}
    assert {leaf.dtype for leaf in jax.tree.leaves(new_state.batch_stats)} == {jnp.dtype(jnp.float32)}
    assert metrics["loss"].dtype == jnp.float32
    logits = jax.eval_shape(
        lambda s, x: s.apply_fn({"params": s.params, "batch_stats": s.batch_stats}, x, train=False),
        state,
        jax.ShapeDtypeStruct((2, 32, 32, 3), jnp.float32),
    )
    assert logits.shape == (2, 10) and logits.dtype == jnp.float32
    # Every convolution and matmul, forward and backward, runs in the compute dtype.
    report = jaxamp.precision_report(step, state, *batch)
    assert report.fraction(jaxamp.get_policy(precision).compute_dtype) == 1.0


@pytest.mark.parametrize("route", ["apply_policy", "autocast"])
@pytest.mark.parametrize("precision", ["bfloat16_kahan", "bfloat16_stochastic", "bfloat16_nearest"])
def test_a_precision_naming_an_update_rounding_trains_bfloat16_params_and_momentum_by_it(precision, route):
    """The update rounding of ``--precision`` reaches the optimizer: fails if the step keeps optax's own
    update (float32 momentum, no compensation buffer) or float32 params."""
    dataset = tiny_dataset()
    config = train.TrainConfig(model="resnet_tiny", precision=precision, route=route, batch_size=2)
    resolved = train.resolve_precision(precision)
    state = jax.eval_shape(lambda: train.create_train_state(config, resolved, 10, steps_per_epoch=1))
    step = jax.jit(train.make_train_step(config, dataset))
    images = jax.ShapeDtypeStruct(dataset.train_images.shape, jnp.uint8)
    labels = jax.ShapeDtypeStruct(dataset.train_labels.shape, jnp.int32)
    indices = jax.ShapeDtypeStruct((2,), jnp.int32)
    rng = jax.eval_shape(lambda: jax.random.key(0))
    new_state, _ = jax.eval_shape(step, state, images, labels, indices, rng)
    opt_state = new_state.opt_state
    assert isinstance(opt_state, LowPrecisionState)
    bfloat16 = {jnp.dtype(jnp.bfloat16)}
    momentum = [leaf for leaf in jax.tree.leaves(opt_state.inner_state) if leaf.ndim > 0]
    assert momentum and {leaf.dtype for leaf in momentum} == bfloat16
    assert {leaf.dtype for leaf in jax.tree.leaves(new_state.params)} == bfloat16
    assert (opt_state.compensation is not None) == (precision == "bfloat16_kahan")
    if opt_state.compensation is not None:
        assert {leaf.dtype for leaf in jax.tree.leaves(opt_state.compensation)} == bfloat16


@pytest.mark.parametrize(
    "precision, state_format", [("bfloat16_int8", "int8"), ("bf16_fp8", "float8_e4m3fn")]
)
def test_a_precision_naming_an_8_bit_state_keeps_the_resnets_momentum_in_it(precision, state_format):
    """The 8-bit state of ``--precision`` reaches SGD's momentum: each convolution kernel of 4096
    elements or more is stored as codes and block scales, the smaller leaves in float32."""
    dataset = tiny_dataset()
    config = train.TrainConfig(model="resnet_tiny", precision=precision, batch_size=2)
    resolved = train.resolve_precision(precision)
    state = jax.eval_shape(lambda: train.create_train_state(config, resolved, 10, steps_per_epoch=1))
    step = jax.jit(train.make_train_step(config, dataset))
    images = jax.ShapeDtypeStruct(dataset.train_images.shape, jnp.uint8)
    labels = jax.ShapeDtypeStruct(dataset.train_labels.shape, jnp.int32)
    rng = jax.eval_shape(lambda: jax.random.key(0))
    new_state, _ = jax.eval_shape(step, state, images, labels, jax.ShapeDtypeStruct((2,), jnp.int32), rng)
    momentum = jax.tree.leaves(
        new_state.opt_state.inner_state, is_leaf=lambda leaf: isinstance(leaf, QuantizedArray)
    )
    quantized = [leaf for leaf in momentum if isinstance(leaf, QuantizedArray)]
    assert sorted(leaf.shape for leaf in quantized) == [(3, 3, 16, 32), (3, 3, 32, 32), (3, 3, 32, 64), (3, 3, 64, 64)]
    assert {leaf.format for leaf in quantized} == {state_format}
    others = {leaf.dtype for leaf in momentum if not isinstance(leaf, QuantizedArray) and leaf.ndim > 0}
    assert others == {jnp.dtype(jnp.float32)}
    assert {leaf.dtype for leaf in jax.tree.leaves(new_state.params)} == {jnp.dtype(jnp.bfloat16)}


@pytest.mark.parametrize("precision", ["mixed_float16", "mixed_bfloat16"])
def test_a_compiled_step_of_the_tiny_resnet_trains_and_keeps_float32_state(precision):
    dataset = tiny_dataset()
    config = train.TrainConfig(model="resnet_tiny", precision=precision, batch_size=4, epochs=1)
    state = train.create_train_state(config, train.resolve_precision(precision), 10, steps_per_epoch=4)
    step = jax.jit(train.make_train_step(config, dataset))
    images, labels = jnp.asarray(dataset.train_images), jnp.asarray(dataset.train_labels)
    before = jax.tree.map(np.asarray, state.params)

    for index in range(2):
        state, metrics = step(state, images, labels, jnp.arange(4) + 4 * index, jax.random.key(index))

    assert np.isfinite(float(metrics["loss"]))
    assert int(state.step) == 2 and int(state.skipped_steps) == 0
    changed = jax.tree.map(lambda old, new: not np.array_equal(old, new), before, state.params)
    assert all(jax.tree.leaves(changed))
    assert {leaf.dtype for leaf in jax.tree.leaves(state.params)} == {jnp.dtype(jnp.float32)}


@pytest.mark.parametrize(
    "name, policy, matmul_precision",
    [
        ("fp32", "params=float32,compute=float32,output=float32", "highest"),
        # every float32 name of jaxamp.get_policy is true float32 on the command line too
        ("float32", "params=float32,compute=float32,output=float32", "highest"),
        ("full", "params=float32,compute=float32,output=float32", "highest"),
        ("tf32", "params=float32,compute=float32,output=float32", "default"),
        ("mixed", "params=float32,compute=float16,output=float32", "default"),
        ("mixed_bf16", "params=float32,compute=bfloat16,output=float32", "default"),
    ],
)
def test_precision_names_resolve_to_a_policy_and_a_matmul_precision(name, policy, matmul_precision):
    resolved = train.resolve_precision(name)
    assert (str(resolved.policy), resolved.matmul_precision) == (policy, matmul_precision)


@pytest.mark.parametrize(
    "spec, expected_type, scale",
    [
        ("dynamic", jaxamp.DynamicLossScale, 2.0**15),
        ("static:1024", jaxamp.StaticLossScale, 1024.0),
        ("none", jaxamp.NoOpLossScale, 1.0),
    ],
)
def test_loss_scale_flag_values(spec, expected_type, scale):
    loss_scale = train.resolve_loss_scale(spec, jaxamp.get_policy("mixed"))
    assert isinstance(loss_scale, expected_type) and float(loss_scale.loss_scale) == scale


def test_default_loss_scale_follows_the_policy():
    assert isinstance(
        train.resolve_loss_scale("default", jaxamp.get_policy("mixed")), jaxamp.DynamicLossScale
    )
    assert isinstance(
        train.resolve_loss_scale("default", jaxamp.get_policy("mixed_bf16")), jaxamp.NoOpLossScale
    )


# The command a reader types, run from the repository root in its own process; it
# starts in the background as soon as the tests are collected (tests/fresh_processes.py).
CLI_RUN = FreshProcess(
    "cli_run", "-m", "experiments.cifar", "--precision", "mixed", *QUICK_RUN, "--epochs", "1",
    "--out", "{dir}/run.json", timeout=300,
)  # fmt: skip


@pytest.fixture
def cli_run():
    """The finished command and the results file it wrote."""
    return CLI_RUN.result(), pathlib.Path(CLI_RUN.directory) / "run.json"


def test_the_cli_runs_end_to_end_and_writes_the_promised_json(cli_run):
    completed, out = cli_run
    assert completed.returncode == 0, completed.stderr
    assert "epoch   1/1 | train" in completed.stdout and "loss scale 32768" in completed.stdout
    # In a pipe there is no progress bar: no carriage-return frames in the log.
    assert "\r" not in completed.stdout + completed.stderr

    results = json.loads(out.read_text())
    environment = results["environment"]
    for key in ("device_kind", "jax", "flax", "precision", "matmul_precision", "batch_size", "policy"):
        assert key in environment
    assert environment["precision"] == "mixed" and environment["batch_size"] == 128
    assert (environment["device_count"], environment["process_count"]) == (1, 1)
    (epoch,) = results["epochs"]
    for key in (
        "train_time_s",
        "test_time_s",
        "train_loss",
        "test_accuracy",
        "images_per_s",
        "loss_scale",
        "skipped_steps",
    ):
        assert key in epoch
    assert (epoch["injected_nonfinite"], epoch["state_finite"]) == (0, True)
    assert len(epoch["state_checksum"]) == 64 and int(epoch["state_checksum"], 16) >= 0
    assert results["compile_time_s"]["train_step"] > 0


def test_missing_cifar10_stops_with_the_three_ways_forward(
    tmp_path, offline, capsys, needs_tensorflow_datasets
):
    exit_code = cifar.main(["--data", "tfds", "--data-dir", str(tmp_path), "--epochs", "1"])

    error = capsys.readouterr().err
    assert exit_code == 1
    assert str(tmp_path / "downloads" / "manual") in error
    assert "network" in error and "--data synthetic" in error
    assert "Traceback" not in error


def test_compare_writes_the_study_table_and_plots(tmp_path):
    out_dir = tmp_path / "results"
    exit_code = compare.main(
        [
            "--models",
            "resnet_tiny",
            "--precisions",
            "fp32,mixed",
            "--data",
            "synthetic",
            "--steps-per-epoch",
            "2",
            "--epochs",
            "1",
            "--no-progress",
            "--out-dir",
            str(out_dir),
        ]
    )

    assert exit_code == 0
    table = (out_dir / "table.md").read_text()
    assert "| fp32 | train: " in table and "| mixed | train: " in table
    assert "| train speed-up mixed vs fp32 |" in table and "| test accuracy mixed |" in table
    for plot in ("seconds_per_epoch.png", "accuracy.png"):
        assert (out_dir / plot).read_bytes().startswith(b"\x89PNG")
    runs = json.loads((out_dir / "results.json").read_text())["runs"]
    assert set(runs) == {"resnet_tiny/fp32", "resnet_tiny/mixed"}


def test_compare_rejects_an_unknown_model_with_the_choices(capsys):
    with pytest.raises(SystemExit):
        compare.main(["--models", "resnet18,vgg16"])
    assert "argument --models: unknown model 'vgg16'. Choose one of: mobilenetv2, resnet101," in capsys.readouterr().err


def test_the_progress_bar_draws_only_on_a_terminal(monkeypatch):
    from experiments import progress

    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)
    assert not progress.bar_wanted(True)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert progress.bar_wanted(True) and not progress.bar_wanted(False)


@pytest.mark.parametrize("out", [None, "run.json"])
def test_the_cli_says_where_its_results_went_or_that_none_were_written(out, monkeypatch, capsys):
    """Without --out nothing is written, and the run's last line says so and names the flag."""
    summary = {"train_time_s": 1.0, "test_time_s": 0.5, "final_test_accuracy": 0.1}
    monkeypatch.setattr(train, "train_and_evaluate", lambda config: {"summary": summary})
    assert cifar.main(QUICK_RUN + (["--out", out] if out else [])) == 0
    last_line = capsys.readouterr().out.splitlines()[-1]
    if out:
        assert last_line == "results written to run.json"
    else:
        assert last_line.startswith("results not written: add --out FILE")
