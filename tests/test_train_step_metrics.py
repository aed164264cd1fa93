"""The CIFAR train step against a batch worked out by hand.

`experiments.train.make_train_step` is run on a tiny model (one dense layer
over the flattened image, then BatchNorm over the ten logits) and a batch of
8 images, and everything it returns is compared with the same step written
out here in plain `jax.numpy`::

    micro-batch k of K (batch_indices split into K rows, in order):
        key_k   = rng if K == 1 else split(rng, K)[k]
        x       = normalize(augment(key_k, images[indices_k]))
        h       = flatten(x) @ kernel + bias
        logits  = (h - mean(h)) / sqrt(var(h) + eps) * scale + shift   # train mode: the batch's statistics
        loss_k  = mean(logsumexp(logits) - logits[label])
        running = 0.9 * running + 0.1 * (mean(h), var(h))            # threaded from micro-batch to micro-batch
    loss    = mean_k loss_k,  correct = sum_k #(argmax(logits) == label)
    params  = params - mean_k grad(loss_k)                          # SGD with learning rate 1

Faults this catches (each one a way the step can go wrong unnoticed by a
run that only checks that training "works"): the model called with
``train=False`` (running statistics instead of the batch's) or without its
``batch_stats``; the correct count inverted, summed over another axis or
dropped; the loss summed instead of averaged over micro-batches, or
reported scaled; a metric renamed or of another dtype; a micro-batch given
another augmentation key (one micro-batch not keyed by the step's own key);
the batch split into micro-batches along the wrong axis; the batch
statistics not threaded or not returned; the injected-fault metric or the
finite check of injected gradients lost; the data-parallel sharding
constraint dropped or put on another axis.
"""

import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec

import jaxamp
from experiments import data as data_lib
from experiments import train
from experiments.distributed import DataParallel
from experiments.fault_injection import inject_nonfinite

NUM_CLASSES = 10
BATCH = 8
EPSILON = 1e-5
MOMENTUM = 0.9
# Not the order of the data set, and two training examples never used.
BATCH_INDICES = np.array([5, 2, 9, 0, 3, 6, 1, 8], np.int32)
# Running statistics that are not BatchNorm's initial ones (0 and 1), so a
# model call that loses them starts over visibly.
RUNNING_MEAN = np.linspace(-0.5, 0.5, NUM_CLASSES, dtype=np.float32)
RUNNING_VAR = np.linspace(0.5, 2.0, NUM_CLASSES, dtype=np.float32)


class DenseBatchNorm(nn.Module):
    """One dense layer over the flattened image, then BatchNorm over the logits."""

    @nn.compact
    def __call__(self, images, train):
        hidden = nn.Dense(NUM_CLASSES)(images.reshape(images.shape[0], -1))
        return nn.BatchNorm(use_running_average=not train, momentum=MOMENTUM, epsilon=EPSILON)(hidden)


def initial_state(loss_scale=None):
    model = DenseBatchNorm()
    variables = model.init(jax.random.key(1), jnp.zeros((1, 32, 32, 3)), train=False)
    params = jax.tree.map(lambda leaf: leaf, variables["params"])
    # A scale and shift that are not 1 and 0, so their gradients and effects show.
    params["BatchNorm_0"]["scale"] = jnp.linspace(0.5, 1.5, NUM_CLASSES)
    params["BatchNorm_0"]["bias"] = jnp.linspace(-0.2, 0.3, NUM_CLASSES)
    batch_stats = {"BatchNorm_0": {"mean": jnp.asarray(RUNNING_MEAN), "var": jnp.asarray(RUNNING_VAR)}}
    return jaxamp.TrainState.create(
        apply_fn=model.apply,
        params=params,
        tx=optax.sgd(1.0),
        loss_scale=jaxamp.StaticLossScale(8.0) if loss_scale is None else loss_scale,
        batch_stats=batch_stats,
    )


def the_dataset():
    return data_lib.synthetic_dataset(num_train=10, num_test=2, num_classes=NUM_CLASSES, seed=3)


def micro_batch_keys(rng, num_micro_batches):
    return [rng] if num_micro_batches == 1 else list(jax.random.split(rng, num_micro_batches))


@jax.jit
def hidden_by_hand(params, images, mean, std, indices, key):
    inputs = data_lib.normalize(data_lib.augment(key, images[indices]), mean, std)
    dense = params["Dense_0"]
    return jnp.dot(inputs.reshape(indices.shape[0], -1), dense["kernel"], precision="highest") + dense["bias"]


def logits_by_hand(params, hidden):
    norm = params["BatchNorm_0"]
    mean, var = hidden.mean(0), hidden.var(0)
    return (hidden - mean) / jnp.sqrt(var + EPSILON) * norm["scale"] + norm["bias"]


@jax.jit
def micro_batch_by_hand(params, images, labels, mean, std, indices, key):
    """One micro-batch: (loss, its gradient, the hidden features, the logits)."""

    def loss_fn(params):
        hidden = hidden_by_hand(params, images, mean, std, indices, key)
        logits = logits_by_hand(params, hidden)
        loss = jnp.mean(jax.nn.logsumexp(logits, -1) - logits[jnp.arange(indices.shape[0]), labels[indices]])
        return loss, (hidden, logits)

    (loss, (hidden, logits)), grad = jax.value_and_grad(loss_fn, has_aux=True)(params)
    return loss, grad, hidden, logits


def by_hand(state, dataset, labels, indices, key):
    return micro_batch_by_hand(
        state.params,
        jnp.asarray(dataset.train_images),
        jnp.asarray(labels),
        jnp.asarray(dataset.mean),
        jnp.asarray(dataset.std),
        jnp.asarray(indices),
        key,
    )


def step_by_hand(state, dataset, labels, rng, num_micro_batches):
    """The step written out (see the module docstring): metrics, new params, new batch stats."""
    rows = BATCH_INDICES.reshape(num_micro_batches, -1)
    keys = micro_batch_keys(rng, num_micro_batches)
    losses, grads, correct = [], [], 0
    running_mean, running_var = RUNNING_MEAN, RUNNING_VAR
    for indices, key in zip(rows, keys):
        loss, grad, hidden, logits = by_hand(state, dataset, labels, indices, key)
        losses.append(float(loss))
        grads.append(grad)
        correct += int(np.sum(np.argmax(logits, -1) == labels[indices]))
        running_mean = MOMENTUM * running_mean + (1 - MOMENTUM) * hidden.mean(0)
        running_var = MOMENTUM * running_var + (1 - MOMENTUM) * hidden.var(0)
    mean_grad = jax.tree.map(lambda *leaves: sum(leaves) / num_micro_batches, *grads)
    new_params = jax.tree.map(lambda param, grad: param - grad, state.params, mean_grad)
    return np.mean(losses), correct, new_params, (running_mean, running_var)


def labels_half_right(state, dataset, rng, num_micro_batches):
    """Labels that the initial model gets right on exactly 5 of the 8 batch rows.

    Rows 0, 1, 3, 4 and 6 are labelled with the class the model predicts,
    the others with the next class: a count of 5 tells right from wrong, and
    from 8 - 5 (the count inverted).
    """
    labels = np.zeros(len(dataset.train_labels), np.int32)
    rows = BATCH_INDICES.reshape(num_micro_batches, -1)
    for indices, key in zip(rows, micro_batch_keys(rng, num_micro_batches)):
        labels[indices] = np.argmax(by_hand(state, dataset, labels, indices, key)[3], -1)
    wrong = BATCH_INDICES[[2, 5, 7]]
    labels[wrong] = (labels[wrong] + 1) % NUM_CLASSES
    return labels


def run_step(config, dataset, state, labels, rng, data_parallel=None):
    step = jax.jit(train.make_train_step(config, dataset, data_parallel))
    return step(
        state, jnp.asarray(dataset.train_images), jnp.asarray(labels), jnp.asarray(BATCH_INDICES), rng
    )


@pytest.mark.parametrize("num_micro_batches", [1, 2])
def test_the_step_reports_the_loss_and_correct_count_of_the_batch_and_updates_as_by_hand(num_micro_batches):
    """Loss, correct count, metric names and dtypes, params and batch statistics, to float32 rounding.

    With K = 2 each micro-batch normalizes over its own 4 rows (BatchNorm in
    train mode), its augmentation key is ``split(rng, 2)[k]``, and the loss
    is the mean of the two micro-batch means (not their sum).
    """
    dataset = the_dataset()
    state = initial_state()
    rng = jax.random.key(7)
    labels = labels_half_right(state, dataset, rng, num_micro_batches)
    config = train.TrainConfig(batch_size=BATCH, grad_accum=num_micro_batches)

    new_state, metrics = run_step(config, dataset, state, labels, rng)

    loss, correct, new_params, (running_mean, running_var) = step_by_hand(
        state, dataset, labels, rng, num_micro_batches
    )
    assert set(metrics) == {"loss", "correct", "injected"}
    assert metrics["loss"].dtype == jnp.float32 and metrics["loss"].shape == ()
    assert jnp.issubdtype(metrics["correct"].dtype, jnp.integer) and metrics["injected"].dtype == jnp.int32
    assert correct == 5
    assert int(metrics["correct"]) == correct
    assert int(metrics["injected"]) == 0
    np.testing.assert_allclose(float(metrics["loss"]), loss, rtol=1e-5)
    jax.tree.map(
        lambda got, want: np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6),
        new_state.params,
        new_params,
    )
    np.testing.assert_allclose(
        new_state.batch_stats["BatchNorm_0"]["mean"], running_mean, rtol=1e-5, atol=1e-6
    )
    np.testing.assert_allclose(new_state.batch_stats["BatchNorm_0"]["var"], running_var, rtol=1e-5, atol=1e-6)
    assert int(new_state.step) == 1 and int(new_state.skipped_steps) == 0


def test_one_micro_batch_is_augmented_with_the_steps_own_key_and_k_with_its_k_split_keys():
    """K = 1 uses the step's key itself, K = 2 and 4 the keys of ``split(rng, K)``, in order.

    The control: with any other key (``split(rng, 1)[0]``, or the keys
    reversed) the hand-computed loss differs from the step's by far more than
    float32 rounding, so the comparison above can tell the keys apart. K = 4
    fails where the step splits a fixed two keys (``split``'s default).
    """
    dataset = the_dataset()
    state = initial_state()
    rng = jax.random.key(7)
    labels = np.asarray(dataset.train_labels)
    for num_micro_batches, other_keys in [
        (1, [jax.random.split(rng, 1)[0]]),
        (2, list(jax.random.split(rng, 2))[::-1]),
        (4, list(jax.random.split(rng, 4))[::-1]),
    ]:
        config = train.TrainConfig(batch_size=BATCH, grad_accum=num_micro_batches)
        _, metrics = run_step(config, dataset, state, labels, rng)
        rows = BATCH_INDICES.reshape(num_micro_batches, -1)

        def loss_with(keys, rows=rows):
            return float(
                np.mean(
                    [by_hand(state, dataset, labels, indices, key)[0] for indices, key in zip(rows, keys)]
                )
            )

        np.testing.assert_allclose(
            float(metrics["loss"]), loss_with(micro_batch_keys(rng, num_micro_batches)), rtol=1e-5
        )
        assert abs(loss_with(other_keys) - float(metrics["loss"])) > 1e-3


def rng_with_injection(rate, injected):
    """The first step key (by seed) on which `inject_nonfinite` does, or does not, inject."""
    for seed in range(100):
        rng = jax.random.key(seed)
        if bool(inject_nonfinite({"w": jnp.zeros(1)}, rng, rate)[1]) == injected:
            return rng
    raise AssertionError("no such key in 100 seeds")


def test_an_injected_step_is_counted_and_skipped_and_a_clean_one_of_the_same_run_applied():
    """``--inject-nonfinite 0.5``: the step the injection hits reports it and leaves the state alone.

    Without a loss scale to overflow only the injected gradients are not
    finite, so the step's own finite check of them is what skips it; a clean
    step of the same configuration updates the params as by hand.
    """
    dataset = the_dataset()
    state = initial_state(loss_scale=jaxamp.NoOpLossScale())
    labels = np.asarray(dataset.train_labels)
    config = train.TrainConfig(batch_size=BATCH, inject_nonfinite=0.5)

    hit = rng_with_injection(0.5, injected=True)
    new_state, metrics = run_step(config, dataset, state, labels, hit)
    assert int(metrics["injected"]) == 1 and metrics["injected"].dtype == jnp.int32
    assert int(new_state.skipped_steps) == 1 and int(new_state.step) == 0
    jax.tree.map(np.testing.assert_array_equal, new_state.params, state.params)
    jax.tree.map(np.testing.assert_array_equal, new_state.batch_stats, state.batch_stats)
    assert np.isfinite(float(metrics["loss"]))

    missed = rng_with_injection(0.5, injected=False)
    new_state, metrics = run_step(config, dataset, state, labels, missed)
    _, _, new_params, _ = step_by_hand(state, dataset, labels, missed, 1)
    assert int(metrics["injected"]) == 0
    assert int(new_state.skipped_steps) == 0 and int(new_state.step) == 1
    jax.tree.map(
        lambda got, want: np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6),
        new_state.params,
        new_params,
    )


class BlackOutDenseBatchNorm(DenseBatchNorm):
    """`DenseBatchNorm`, but NaN throughout for a micro-batch of black images only (a stand-in overflow)."""

    @nn.compact
    def __call__(self, images, train):
        logits = super().__call__(images, train)
        return logits * jnp.where(images.max() < -1.0, jnp.nan, 1.0)


def test_a_step_with_one_non_finite_micro_batch_is_skipped_whole():
    """K = 2, the second micro-batch all black images: its loss and gradients are NaN.

    The accumulator adds zeros for it, so the mean gradient is finite; the
    step must still be skipped (params, batch statistics and step unchanged,
    `skipped_steps` 1) because the micro-batch's own finite flag is passed on.
    Fails if the step hands ``apply_gradients`` no flag (it would check the
    finite zero-filled gradients and apply half a batch), with fault
    injection off or on.
    """
    dataset = the_dataset()
    images = dataset.train_images.copy()
    images[BATCH_INDICES[4:]] = 0
    model = BlackOutDenseBatchNorm()
    state = initial_state(loss_scale=jaxamp.NoOpLossScale()).replace(apply_fn=model.apply)
    config = train.TrainConfig(batch_size=BATCH, grad_accum=2)
    step = jax.jit(train.make_train_step(config, dataset))
    labels = jnp.asarray(dataset.train_labels)

    new_state, metrics = step(
        state, jnp.asarray(images), labels, jnp.asarray(BATCH_INDICES), jax.random.key(7)
    )
    assert int(new_state.skipped_steps) == 1 and int(new_state.step) == 0
    jax.tree.map(np.testing.assert_array_equal, new_state.params, state.params)
    jax.tree.map(np.testing.assert_array_equal, new_state.batch_stats, state.batch_stats)
    assert np.isnan(float(metrics["loss"]))

    # The control: with no black micro-batch the same step is applied.
    new_state, _ = step(
        state, jnp.asarray(dataset.train_images), labels, jnp.asarray(BATCH_INDICES), jax.random.key(7)
    )
    assert int(new_state.skipped_steps) == 0 and int(new_state.step) == 1

    # With fault injection on but missing this step, the micro-batch's flag
    # still decides: the injected gradients' own check is joined to it, not
    # put in its place (which would pass the zero-filled, finite gradients).
    config = train.TrainConfig(batch_size=BATCH, grad_accum=2, inject_nonfinite=0.5)
    step = jax.jit(train.make_train_step(config, dataset))
    new_state, metrics = step(
        state,
        jnp.asarray(images),
        labels,
        jnp.asarray(BATCH_INDICES),
        rng_with_injection(0.5, injected=False),
    )
    assert int(metrics["injected"]) == 0
    assert int(new_state.skipped_steps) == 1 and int(new_state.step) == 0


def sharding_constraints(jaxpr):
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "sharding_constraint":
            yield eqn
        for value in eqn.params.values():
            for inner in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(inner, jax.extend.core.ClosedJaxpr):
                    yield from sharding_constraints(inner.jaxpr)
                elif isinstance(inner, jax.extend.core.Jaxpr):
                    yield from sharding_constraints(inner)


@pytest.mark.parametrize("num_micro_batches", [1, 2])
def test_with_data_parallelism_each_micro_batch_is_sharded_along_its_batch_axis(num_micro_batches):
    """The step's only sharding constraint: the [K, B/K] indices, split on axis 1 over ``data``.

    Read from the traced step, so one device shows it; without
    `data_parallel` there is no constraint. Sharded, the step still computes
    the hand-worked loss.
    """
    dataset = the_dataset()
    state = initial_state()
    rng = jax.random.key(7)
    labels = np.asarray(dataset.train_labels)
    config = train.TrainConfig(batch_size=BATCH, grad_accum=num_micro_batches)
    data_parallel = DataParallel.over_all_devices()
    arguments = (
        state,
        jnp.asarray(dataset.train_images),
        jnp.asarray(labels),
        jnp.asarray(BATCH_INDICES),
        rng,
    )

    jaxpr = jax.make_jaxpr(train.make_train_step(config, dataset, data_parallel))(*arguments)
    (constraint,) = sharding_constraints(jaxpr.jaxpr)
    assert constraint.params["sharding"].spec == PartitionSpec(None, "data")
    assert constraint.params["sharding"].mesh == data_parallel.mesh
    (operand,) = constraint.invars
    assert operand.aval.shape == (num_micro_batches, BATCH // num_micro_batches)
    assert jnp.issubdtype(operand.aval.dtype, jnp.integer)
    unsharded = jax.make_jaxpr(train.make_train_step(config, dataset))(*arguments)
    assert not list(sharding_constraints(unsharded.jaxpr))

    _, metrics = run_step(config, dataset, state, labels, rng, data_parallel)
    loss, correct, _, _ = step_by_hand(state, dataset, labels, rng, num_micro_batches)
    np.testing.assert_allclose(float(metrics["loss"]), loss, rtol=1e-5)
    assert int(metrics["correct"]) == correct


# --- the epoch plan and the ahead-of-time compilation --------------------------------------------------


@pytest.mark.parametrize("num_train, batch_size, steps", [(10, 3, 3), (10, 3, 2), (8, 8, 1)])
def test_the_epoch_plan_is_the_shuffle_of_the_first_half_key_and_the_steps_keys_of_the_second(
    num_train, batch_size, steps
):
    """One step per row of ``epoch_batches(split(rng)[0])`` (cut to `steps`), keys ``split(split(rng)[1], steps)``.

    Fails if the plan shuffles and augments with the same key, drops or adds
    steps, or hands back something other than one index row and one key per step.
    """
    rng = jax.random.key(11)
    batches, keys = jax.jit(train.make_epoch_plan(num_train, batch_size, steps))(rng)
    shuffle_rng, augment_rng = jax.random.split(rng)
    assert isinstance(batches, tuple) and isinstance(keys, tuple)
    assert len(batches) == len(keys) == steps
    expected = data_lib.epoch_batches(shuffle_rng, num_train, batch_size)
    for step in range(steps):
        np.testing.assert_array_equal(batches[step], expected[step])
        assert batches[step].dtype == jnp.int32 and batches[step].shape == (batch_size,)
    expected_keys = jax.random.split(augment_rng, steps)
    for key, want in zip(keys, expected_keys):
        np.testing.assert_array_equal(jax.random.key_data(key), jax.random.key_data(want))
    shuffled_by_other_half = data_lib.epoch_batches(augment_rng, num_train, batch_size)
    assert not np.array_equal(expected, shuffled_by_other_half)  # the control: the halves differ


def test_the_compiled_steps_take_and_give_replicated_arrays_and_the_train_step_donates_its_state(monkeypatch):
    """`_compile` hands back compiled programs, not jitted functions, with the run's shardings.

    Every input and output of the three programs is replicated over the
    mesh (a program given another sharding fails; one given none is not told
    apart: XLA propagates the replicated inputs to its outputs, on one device
    as on eight), the train step donates exactly its state,
    and the two compile times are each measured from their own start: both
    non-negative and together no more than the call took (no speed is asserted).

    The train step is built for the run's data parallelism: on one device a
    step built without it compiles to the same program, so the call is
    watched instead (a mutant dropping the argument compiles a step that
    would not shard its batch over many devices). The test set is one
    batch, so a step compiled for another batch than the first fails.
    """
    built_with = []
    make_train_step = train.make_train_step

    def watched_make_train_step(*args, **kwargs):
        built_with.append((args, kwargs))
        return make_train_step(*args, **kwargs)

    monkeypatch.setattr(train, "make_train_step", watched_make_train_step)
    dataset = data_lib.synthetic_dataset(num_train=8, num_test=4, seed=0)
    config = train.TrainConfig(
        batch_size=BATCH, eval_batch_size=4, epochs=1, steps_per_epoch=1, progress=False
    )
    data_parallel = DataParallel.over_all_devices()
    device_data = train.put_on_device(dataset, config.eval_batch_size, data_parallel)
    state = data_parallel.replicate(initial_state())

    start = time.perf_counter()
    plan, train_step, eval_step, times = train._compile(config, dataset, state, device_data, 1, data_parallel)
    elapsed = time.perf_counter() - start

    ((args, kwargs),) = built_with
    assert len(args) == 3 and not kwargs
    assert args[0] is config and args[1] is dataset and args[2] is data_parallel
    assert len(device_data.test_batches) == 1
    assert set(times) == {"train_step", "eval_step"}
    assert 0 <= times["train_step"] and 0 <= times["eval_step"]
    assert times["train_step"] + times["eval_step"] <= elapsed
    for program in (plan, train_step, eval_step):
        assert isinstance(program, jax.stages.Compiled)
        shardings = jax.tree.leaves((program.input_shardings, program.output_shardings))
        assert shardings and all(
            isinstance(sharding, jax.sharding.NamedSharding)
            and sharding.spec == PartitionSpec()
            and sharding.mesh == data_parallel.mesh
            for sharding in shardings
        ), program
    state_args, *other_args = train_step.args_info[0]
    assert all(arg.donated for arg in jax.tree.leaves(state_args))
    assert not any(arg.donated for arg in jax.tree.leaves(other_args))
    assert not any(arg.donated for arg in jax.tree.leaves(eval_step.args_info))

    # The programs run: one planned step of the compiled train step, one test batch.
    batches, keys = plan(data_parallel.replicate(jax.random.key(0)))
    assert len(batches) == 1 and batches[0].shape == (BATCH,)
    new_state, metrics = train_step(
        state, device_data.train_images, device_data.train_labels, batches[0], keys[0]
    )
    assert set(metrics) == {"loss", "correct", "injected"} and int(new_state.step) == 1
    totals = eval_step(new_state, *device_data.test_batches[0])
    assert set(totals) == {"loss", "correct"}
