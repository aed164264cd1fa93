"""The experiments keep three promises that a wrong line breaks silently.

* Gradient accumulation adds no finite value of a micro-batch whose
  gradients are not all finite (its finite leaves are left out too); its inf
  and NaN values are kept, so the step's gradients name the leaves that
  overflowed.
* Evaluation sees the test images as they are: never cropped, flipped or
  drawn at random, and every test image once.
* A run's summary reports the skipped and injected steps of the whole run
  once: the last epoch's cumulative counts, not their sum.
* Each epoch's record says what the state is and where the run ran: the
  checksum covers params, optimizer state, batch statistics and loss scale;
  the state counts as finite whatever the overflow record of a skipped step
  holds; the epoch's line and the environment are read whole.
* A timed epoch compiles nothing: the train step, the test step and the
  epoch plan are compiled before the first epoch starts its clock. Checked
  structurally (which compilations happen inside an epoch), never by timing.

Negative controls (each injected by hand and seen to fail here): the
accumulator adding a non-finite micro-batch's gradients; the eval step
augmenting its images; the steps jitted lazily instead of compiled ahead of
the first epoch; the summary adding up the per-epoch skip counts, which are
already cumulative.
"""

import contextlib
import hashlib
import logging
import platform
import types

import flax
import jax
import jax.numpy as jnp
import jaxlib
import numpy as np
import optax
import pytest
from jax.extend.core import ClosedJaxpr, Jaxpr

import jaxamp
from experiments import data as data_lib
from experiments import results, train
from experiments.config import TrainConfig
from experiments.grad_accumulation import accumulate_gradients
from experiments.results import summarize
from jaxamp.diagnostics import OverflowRecord, OverflowSite

# --- gradient accumulation ---------------------------------------------------------------------------

PARAMS = {"w": jnp.zeros(3, jnp.float32), "b": jnp.zeros((), jnp.float32)}


def micro_batch_grads(params, carry, micro_batch):
    """Gradients given by the micro-batch itself; the carry counts the micro-batches seen."""
    grads = {"w": micro_batch["w"], "b": micro_batch["b"]}
    finite = jnp.all(jnp.isfinite(grads["w"])) & jnp.isfinite(grads["b"])
    return ({"loss": jnp.sum(micro_batch["w"])}, carry + 1), grads, finite


def micro_batches(num, bad_index=None, bad_value=jnp.inf, bad_leaf="w"):
    w = jnp.arange(1.0, 3 * num + 1).reshape(num, 3)
    b = jnp.arange(1.0, num + 1) * 10
    if bad_index is not None:
        if bad_leaf == "w":
            w = w.at[bad_index, 1].set(bad_value)
        else:
            b = b.at[bad_index].set(bad_value)
    return {"w": w, "b": b}


@pytest.mark.parametrize("num", [2, 4])
@pytest.mark.parametrize("bad_value", [jnp.inf, -jnp.inf, jnp.nan], ids=["inf", "-inf", "nan"])
@pytest.mark.parametrize("bad_leaf", ["w", "b"])
def test_a_non_finite_micro_batch_adds_none_of_its_finite_gradients_wherever_it_falls(
    num, bad_value, bad_leaf
):
    """Fails if the accumulator adds the bad micro-batch's finite gradients (of either leaf), or
    drops its non-finite value (then the step's gradients would not show which leaf overflowed)."""
    for bad_index in range(num):
        batches = micro_batches(num, bad_index, bad_value, bad_leaf)
        carry, grads, grads_finite, _ = jax.jit(accumulate_gradients, static_argnums=0)(
            micro_batch_grads, PARAMS, jnp.int32(0), batches
        )
        keep = np.arange(num) != bad_index
        expected = {
            "w": np.asarray(batches["w"])[keep].sum(axis=0) / num,
            "b": np.float32(np.asarray(batches["b"])[keep].sum() / num),
        }
        if bad_leaf == "w":
            expected["w"][1] = bad_value / num
        else:
            expected["b"] = np.float32(bad_value / num)
        assert not bool(grads_finite)
        assert int(carry) == num
        np.testing.assert_array_equal(grads["w"], expected["w"])
        np.testing.assert_array_equal(grads["b"], expected["b"])


def test_clean_micro_batches_average_to_the_mean_gradient():
    batches = micro_batches(4)
    _, grads, grads_finite, metrics = accumulate_gradients(micro_batch_grads, PARAMS, jnp.int32(0), batches)
    assert bool(grads_finite)
    np.testing.assert_array_equal(grads["w"], np.asarray(batches["w"]).mean(axis=0))
    np.testing.assert_array_equal(grads["b"], np.asarray(batches["b"]).mean())
    assert float(metrics["loss"]) == float(np.sum(batches["w"]))


def test_two_non_finite_micro_batches_of_four_leave_the_other_two():
    batches = micro_batches(4, 0)
    batches["b"] = batches["b"].at[2].set(jnp.nan)
    _, grads, grads_finite, _ = accumulate_gradients(micro_batch_grads, PARAMS, jnp.int32(0), batches)
    assert not bool(grads_finite)
    expected_w = np.asarray(batches["w"])[[1, 3]].sum(axis=0) / 4
    expected_w[1] = np.inf  # micro-batch 0's inf
    np.testing.assert_array_equal(grads["w"], expected_w)
    assert np.isnan(grads["b"]), "micro-batch 2's NaN"


# --- evaluation sees the test images as they are -----------------------------------------------------

RANDOM_PRIMITIVES = {
    "random_bits",
    "random_seed",
    "random_wrap",
    "random_split",
    "random_fold_in",
    "threefry2x32",
}


def all_primitive_names(jaxpr):
    for equation in jaxpr.eqns:
        yield equation.primitive.name
        for value in equation.params.values():
            for candidate in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(candidate, ClosedJaxpr):
                    yield from all_primitive_names(candidate.jaxpr)
                elif isinstance(candidate, Jaxpr):
                    yield from all_primitive_names(candidate)


def tiny_dataset():
    return data_lib.synthetic_dataset(num_train=8, num_test=6, seed=0)


def test_the_eval_step_draws_no_random_numbers_while_the_train_step_does():
    """Augmentation needs random numbers; a test step with any has augmented (or dropped) something."""
    dataset = tiny_dataset()
    config = train.TrainConfig(model="resnet_tiny", precision="mixed", batch_size=4)
    state = jax.eval_shape(
        lambda: train.create_train_state(config, train.resolve_precision("mixed"), 10, steps_per_epoch=1)
    )
    images = jax.ShapeDtypeStruct((4, 32, 32, 3), jnp.uint8)
    labels = jax.ShapeDtypeStruct((4,), jnp.int32)
    mask = jax.ShapeDtypeStruct((4,), jnp.bool_)
    eval_jaxpr = jax.make_jaxpr(train.make_eval_step(dataset))(state, images, labels, mask)
    assert not RANDOM_PRIMITIVES & set(all_primitive_names(eval_jaxpr.jaxpr))

    # The control: the train step's augmentation does show up this way.
    all_images = jax.ShapeDtypeStruct(dataset.train_images.shape, jnp.uint8)
    all_labels = jax.ShapeDtypeStruct(dataset.train_labels.shape, jnp.int32)
    rng = jax.eval_shape(lambda: jax.random.key(0))
    train_jaxpr = jax.make_jaxpr(train.make_train_step(config, dataset))(
        state, all_images, all_labels, jax.ShapeDtypeStruct((4,), jnp.int32), rng
    )
    assert RANDOM_PRIMITIVES & set(all_primitive_names(train_jaxpr.jaxpr))


def test_the_model_sees_exactly_the_normalized_test_images_at_evaluation(monkeypatch):
    """A stand-in model records its input: it must be ``normalize(images)``, pixel for pixel.

    It predicts class ``row % 3`` for each row, so the correct count and the
    summed loss over the real (masked) rows are known in closed form.
    """
    dataset = tiny_dataset()
    seen = []

    def apply_fn(variables, images, train):
        seen.append((np.asarray(images), train))
        predicted = jnp.arange(images.shape[0]) % 3
        return 5.0 * jax.nn.one_hot(predicted, dataset.num_classes)

    def refuse(*args, **kwargs):
        raise AssertionError("evaluation called data.augment")

    monkeypatch.setattr(data_lib, "augment", refuse)
    state = types.SimpleNamespace(apply_fn=apply_fn, params={}, batch_stats={})
    images = jnp.asarray(dataset.test_images[:4])
    labels = jnp.array([0, 1, 2, 2], jnp.int32)
    mask = jnp.array([True, True, True, False])
    totals = train.make_eval_step(dataset)(state, images, labels, mask)
    ((model_input, train_flag),) = seen
    assert train_flag is False
    np.testing.assert_array_equal(model_input, data_lib.normalize(images, dataset.mean, dataset.std))
    assert int(totals["correct"]) == 3  # rows 0 to 2 right; row 3 (wrong) is padding
    logits = 5.0 * jax.nn.one_hot(jnp.arange(4) % 3, dataset.num_classes)
    losses = -jax.nn.log_softmax(logits)[jnp.arange(4), labels]
    np.testing.assert_allclose(float(totals["loss"]), float(losses[:3].sum()), rtol=1e-5)


@pytest.mark.parametrize("eval_batch_size", [2, 4, 6, 8])
def test_the_test_batches_on_the_device_are_the_test_set_unchanged_and_padded(eval_batch_size):
    dataset = tiny_dataset()
    device_data = train.put_on_device(dataset, eval_batch_size)
    images = np.concatenate([np.asarray(batch[0]) for batch in device_data.test_batches])
    labels = np.concatenate([np.asarray(batch[1]) for batch in device_data.test_batches])
    mask = np.concatenate([np.asarray(batch[2]) for batch in device_data.test_batches])
    assert mask.sum() == 6 and mask[:6].all()
    assert (images.dtype, labels.dtype) == (np.uint8, np.int32)
    np.testing.assert_array_equal(images[:6], dataset.test_images)
    np.testing.assert_array_equal(labels[:6], dataset.test_labels)
    assert sum(device_data.test_batch_sizes) == 6
    np.testing.assert_array_equal(device_data.train_images, dataset.train_images)
    np.testing.assert_array_equal(device_data.train_labels, dataset.train_labels)
    assert device_data.train_labels.dtype == np.int32
    assert device_data.num_train == 8


# --- a timed epoch compiles nothing ------------------------------------------------------------------


class _CompileLog(logging.Handler):
    """Collects the names of the functions XLA compiles (``jax_log_compiles``)."""

    def __init__(self):
        super().__init__(level=logging.WARNING)
        self.compiled: list[str] = []

    def emit(self, record):
        message = record.getMessage()
        if message.startswith("Finished XLA compilation of "):
            self.compiled.append(message.removeprefix("Finished XLA compilation of ").split(" in ")[0])


@contextlib.contextmanager
def compile_log():
    handler = _CompileLog()
    logger = logging.getLogger("jax")
    logger.addHandler(handler)
    try:
        with jax.log_compiles(True):
            yield handler
    finally:
        logger.removeHandler(handler)


def test_no_step_is_compiled_inside_a_timed_epoch_the_first_included(monkeypatch):
    """Every epoch (its train loop and its test pass) runs steps compiled before the first began.

    Fails if the steps are handed to the epochs jitted but not compiled, or
    if the compilation moves inside an epoch: either puts the train step's,
    the test step's or the epoch plan's compilation inside an epoch.
    """
    epochs = []
    run_epoch = train._run_epoch

    def recorded_epoch(run, state, epoch, resumed_at):
        before = len(log.compiled)
        epochs.append(
            {
                name: isinstance(getattr(run, name), jax.stages.Compiled)
                for name in ("train_step", "eval_step")
            }
        )
        epochs[-1]["start"] = before
        state = run_epoch(run, state, epoch, resumed_at)
        epochs[-1]["compiled"] = log.compiled[before:]
        return state

    monkeypatch.setattr(train, "_run_epoch", recorded_epoch)
    config = train.TrainConfig(
        model="resnet_tiny", precision="mixed", batch_size=4, eval_batch_size=4, epochs=2, progress=False
    )
    with compile_log() as log:
        results = train.train_and_evaluate(config, tiny_dataset(), log=lambda line: None)
    step_names = ("train_step", "eval_step", "plan")
    before_first_epoch = log.compiled[: epochs[0]["start"]]
    assert len(epochs) == 2
    for name in step_names:
        assert any(name in compiled for compiled in before_first_epoch), (name, log.compiled)
    for epoch in epochs:
        assert epoch["train_step"] and epoch["eval_step"]
        assert not [name for name in epoch["compiled"] if any(step in name for step in step_names)], epoch
    assert set(results["compile_time_s"]) == {"train_step", "eval_step"}


def test_micro_batches_that_are_one_array_count_along_its_leading_axis():
    """A tree of one leaf: K comes from that leaf (a mutant reading a second leaf has none)."""

    def grad_fn(params, carry, micro_batch):
        return (
            ({"loss": jnp.sum(micro_batch)}, carry),
            {"w": micro_batch, "b": micro_batch[0]},
            jnp.array(True),
        )

    batches = jnp.arange(12.0).reshape(4, 3)
    _, grads, grads_finite, _ = accumulate_gradients(grad_fn, PARAMS, jnp.int32(0), batches)
    assert bool(grads_finite)
    np.testing.assert_array_equal(grads["w"], np.asarray(batches).mean(axis=0))


@pytest.mark.parametrize("batch_size, steps", [(1, 6), (6, 1)])
def test_epoch_batches_accepts_the_smallest_and_the_largest_batch(batch_size, steps):
    """A batch of 1 and a batch of the whole set are valid bounds, not errors."""
    batches = data_lib.epoch_batches(jax.random.key(0), 6, batch_size)
    assert batches.shape == (steps, batch_size)
    assert sorted(np.asarray(batches).ravel().tolist()) == list(range(6))


@pytest.mark.parametrize("num", [1, 3])
def test_gradients_come_back_in_the_params_dtypes_with_integer_metrics_and_the_carry_threaded(num):
    """bfloat16 params get bfloat16 gradients; an integer count stays an integer; the carry reaches K."""
    params = {"w": jnp.zeros(3, jnp.bfloat16)}

    def grad_fn(params, carry, micro_batch):
        metrics = {"correct": jnp.sum(micro_batch > 1).astype(jnp.int32), "loss": jnp.sum(micro_batch)}
        return (metrics, carry + 1), {"w": micro_batch.astype(jnp.bfloat16)}, jnp.array(True)

    batches = jnp.arange(3.0 * num).reshape(num, 3)
    carry, grads, _, metrics = accumulate_gradients(grad_fn, params, jnp.int32(0), batches)
    assert int(carry) == num
    assert grads["w"].dtype == jnp.bfloat16
    assert metrics["correct"].dtype == jnp.int32
    assert int(metrics["correct"]) == int(np.sum(np.asarray(batches) > 1))


# --- data: the synthetic stand-in and the crop offsets -----------------------------------------------


def test_the_synthetic_dataset_is_chosen_by_name_whatever_the_source_and_keeps_its_seed():
    by_name = data_lib.load_dataset("synthetic", seed=3)  # the default source is tfds
    assert by_name.name == "synthetic"
    direct = data_lib.synthetic_dataset(len(by_name.train_labels), len(by_name.test_labels), seed=3)
    np.testing.assert_array_equal(by_name.test_images, direct.test_images)
    np.testing.assert_array_equal(by_name.test_labels, direct.test_labels)
    other_seed = data_lib.load_dataset("synthetic", seed=4)
    assert not np.array_equal(other_seed.test_labels, by_name.test_labels)


def test_synthetic_pixels_and_labels_cover_their_whole_ranges():
    dataset = data_lib.synthetic_dataset(num_train=64, num_test=256, num_classes=10, seed=0)
    for images, labels in (
        (dataset.train_images, dataset.train_labels),
        (dataset.test_images, dataset.test_labels),
    ):
        assert (images.min(), images.max()) == (0, 255)
        assert labels.dtype == np.int32
    assert set(dataset.test_labels.tolist()) == set(range(10))
    assert dataset.test_labels.shape == (256,) and dataset.test_images.shape == (256, 32, 32, 3)


def test_crop_offsets_are_uniform_over_the_nine_positions_of_each_axis():
    """Each image is one bright pixel at (4, 4): its crop puts it at (8 - dy, 8 - dx) or mirrored."""
    count = 900
    images = np.zeros((count, 16, 16, 1), np.uint8)
    images[:, 4, 4, 0] = 255
    augmented = np.asarray(data_lib.augment(jax.random.key(0), jnp.asarray(images)))
    rows = np.array([np.argwhere(image[..., 0] == 255)[0][0] for image in augmented])
    frequencies = np.bincount(8 - rows, minlength=9) / count
    assert frequencies.shape == (9,)
    assert np.all(frequencies > 0.06) and np.all(frequencies < 0.17), frequencies


def test_the_summary_reads_the_cumulative_skip_counts_of_the_last_epoch_not_their_sum():
    """Each epoch's skipped_steps and injected_nonfinite are already totals since the run began
    (the loss scale's counter, and the previous epoch's count plus this one's). Three epochs that
    skipped 2, 3 and 4 steps record 2, 5 and 9: the run skipped 9, not 16."""
    epochs = [
        {"epoch": epoch, "train_time_s": 1.0, "images_per_s": 10.0, "train_loss": 2.0,
         "skipped_steps": skipped, "injected_nonfinite": injected, "state_checksum": f"c{epoch}"}
        for epoch, skipped, injected in [(1, 2, 1), (2, 5, 3), (3, 9, 6)]
    ]  # fmt: skip
    summary = summarize(epochs)
    assert summary["skipped_steps"] == 9 and summary["injected_nonfinite"] == 6
    assert summary["epochs"] == 3 and summary["final_state_checksum"] == "c3"


def test_the_summary_is_the_median_of_each_figure_and_the_last_tested_epochs_accuracy():
    """Four epochs, the last three tested (``--eval-every`` aside, as after a resume): times and
    rates are medians (the train time over all four, the test time over the three tested), the
    accuracy and loss the last ones recorded. Read whole, so that a key renamed, a median over the
    wrong epochs or the accuracy of another epoch fails."""
    epochs = [
        {"epoch": 1, "train_time_s": 4.0, "images_per_s": 100.0, "train_loss": 2.3, "skipped_steps": 1},
        {"epoch": 2, "train_time_s": 1.0, "images_per_s": 400.0, "train_loss": 1.9, "skipped_steps": 1,
         "test_time_s": 0.5, "test_accuracy": 0.31},
        {"epoch": 3, "train_time_s": 2.0, "images_per_s": 200.0, "train_loss": 1.5, "skipped_steps": 2,
         "test_time_s": 0.6, "test_accuracy": 0.45},
        {"epoch": 4, "train_time_s": 3.0, "images_per_s": 300.0, "train_loss": 1.2, "skipped_steps": 2,
         "test_time_s": 0.9, "test_accuracy": 0.52},
    ]  # fmt: skip

    assert summarize(epochs) == {
        "train_time_s": 2.5,
        "test_time_s": 0.6,
        "images_per_s": 250.0,
        "final_test_accuracy": 0.52,
        "final_train_loss": 1.2,
        "skipped_steps": 2,
        "injected_nonfinite": 0,
        "final_state_checksum": None,
        "epochs": 4,
    }
    untested = summarize(epochs[:1])
    assert untested["test_time_s"] is None and untested["final_test_accuracy"] is None
    assert untested["train_time_s"] == 4.0
    assert summarize([]) == {}


# --- what each epoch records -----------------------------------------------------------------------


def small_state(**parts):
    """A train state with a params tree of two leaves, momentum in its optimizer state, batch
    statistics and a dynamic loss scale; `parts` replace fields."""
    params = {"b": jnp.array([0.5, -1.0], jnp.float32), "w": jnp.array([[1.0, 2.0]], jnp.float32)}
    state = jaxamp.TrainState.create(
        apply_fn=None,
        params=params,
        tx=optax.sgd(0.1, momentum=0.9),
        loss_scale=jaxamp.DynamicLossScale(2.0**10),
        batch_stats={"mean": jnp.array([3.0], jnp.float32)},
    )
    return state.replace(**parts)


def test_the_state_checksum_is_sha256_over_params_optimizer_state_statistics_and_loss_scale_in_order():
    state = small_state()
    digest = hashlib.sha256()
    parts = [state.params, state.opt_state, state.batch_stats, state.loss_scale]
    for leaf in jax.tree.leaves(parts):
        digest.update(np.ascontiguousarray(np.asarray(leaf)).tobytes())

    assert results.state_checksum(state) == digest.hexdigest()
    assert results.state_checksum(small_state()) == digest.hexdigest()  # a fresh, equal state
    # Each part counts: one changed value in any of them changes the checksum; the step does not.
    changed = [
        small_state(params={**state.params, "b": state.params["b"].at[1].set(-2.0)}),
        small_state(opt_state=jax.tree.map(lambda leaf: leaf + 1, state.opt_state)),
        small_state(batch_stats={"mean": jnp.array([4.0], jnp.float32)}),
        small_state(loss_scale=state.loss_scale.adjust(jnp.array(False))),
    ]
    assert len({results.state_checksum(other) for other in changed} | {digest.hexdigest()}) == 5
    assert results.state_checksum(small_state(step=jnp.array(7, jnp.int32))) == digest.hexdigest()


@pytest.mark.parametrize("part", ["params", "opt_state", "batch_stats"])
@pytest.mark.parametrize("value", [np.inf, np.nan])
def test_a_state_with_one_non_finite_value_in_any_part_is_not_finite(part, value):
    state = small_state()
    assert results.state_finite(state) is True
    poisoned = jax.tree.map(lambda leaf: leaf.at[0].set(value) if leaf.ndim else leaf, getattr(state, part))
    assert results.state_finite(state.replace(**{part: poisoned})) is False


def test_the_overflow_records_inf_of_a_skipped_step_leaves_the_state_finite():
    site = OverflowSite("dense", "model.py:3", "dot_general", "float16", (2, 2))
    record = OverflowRecord(
        forward_amax=jnp.array([np.inf], jnp.float32),
        backward_amax=jnp.array([np.nan], jnp.float32),
        sites=(site,),
    )
    state = small_state(overflow_record=record)
    assert results.state_finite(state) is True
    assert results.state_finite(state.replace(params={"w": jnp.array([np.nan])})) is False


def test_the_epoch_line_shows_each_figure_as_formatted_and_the_checksums_first_12_digits():
    record = {
        "epoch": 3, "train_time_s": 12.3456, "train_loss": 1.234567, "test_time_s": 1.5,
        "test_accuracy": 0.91234, "images_per_s": 12345.6, "loss_scale": 32768.0, "skipped_steps": 4,
        "injected_nonfinite": 2, "state_checksum": "0123456789abcdef" * 4,
    }  # fmt: skip
    assert results.format_epoch(record, epochs=10) == (
        "epoch   3/10 | train   12.35s loss 1.2346 | test   1.50s acc 91.23% | 12,346 img/s"
        " | loss scale 32768 | skipped 4 (injected 2) | state 0123456789ab"
    )
    untested = {key: value for key, value in record.items() if key not in ("test_time_s", "test_accuracy")}
    untested["injected_nonfinite"] = 0
    assert results.format_epoch(untested, epochs=10) == (
        "epoch   3/10 | train   12.35s loss 1.2346 | 12,346 img/s | loss scale 32768 | skipped 4"
        " | state 0123456789ab"
    )
    del untested["injected_nonfinite"]  # a record written before --inject-nonfinite existed
    assert results.format_epoch(untested, epochs=10).endswith("| skipped 4 | state 0123456789ab")


def test_the_environment_names_the_machine_the_versions_the_precision_and_the_run_sizes():
    config = TrainConfig(
        model="resnet_tiny", batch_size=64, grad_accum=2, dataset="fashion_mnist", data="idx"
    )
    precision = train.resolve_precision("mixed_bfloat16")
    device = jax.devices()[0]
    machine = {
        "device_kind": device.device_kind, "platform": device.platform,
        "device_count": jax.device_count(), "process_count": jax.process_count(),
        "python": platform.python_version(), "jax": jax.__version__, "jaxlib": jaxlib.__version__,
        "flax": flax.__version__, "optax": optax.__version__, "jaxamp": jaxamp.__version__,
    }  # fmt: skip
    assert results.machine() == machine
    assert results.environment(config, precision) == {
        **machine,
        "precision": "mixed_bfloat16",
        "policy": str(jaxamp.get_policy("mixed_bfloat16")),
        "matmul_precision": "default",
        "model": "resnet_tiny",
        "batch_size": 64,
        "grad_accum": 2,
        "dataset": "fashion_mnist",
        "data": "idx",
    }
