"""CIFAR-10 training with jaxamp: the recipe of the study, in JAX.

Read top to bottom, this is the whole recipe:

1. `resolve_precision` turns ``--precision`` into a `jaxamp.Policy` and a
   matmul precision (``fp32`` is true float32, ``tf32`` is JAX's default).
2. `create_train_state` wraps the plain Flax model with `jaxamp.apply_policy`
   and builds a `jaxamp.TrainState` with SGD (Nesterov momentum, weight
   decay, warm-up and cosine decay) and the policy's loss scale.
3. `train_step` gathers, augments and normalizes a batch on the device,
   differentiates through the loss scale with
   `jaxamp.scaled_value_and_grad`, and lets `TrainState.apply_gradients`
   skip the step if the gradients overflowed.
4. `train_and_evaluate` keeps the uint8 data set on the device, compiles the
   steps ahead of time, and runs epochs with a progress bar, timing train and
   test passes with ``block_until_ready``, checkpointing and writing results
   as it goes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import platform
import tempfile
import time
from collections.abc import Callable
from typing import Any

import flax
import jax
import jax.numpy as jnp
import jaxlib
import numpy as np
import optax

import jaxamp
from experiments import data as data_lib
from experiments.models import create_model

# Precisions beyond jaxamp.get_policy's: float32 with an explicit matmul precision.
_FLOAT32_PRECISIONS = {"fp32": "highest", "tf32": "default"}


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Everything that defines a run; the CLI flags map onto these fields."""

    model: str = "resnet18"
    precision: str = "mixed"
    loss_scale: str = "default"
    dataset: str = "cifar10"
    data: str = "tfds"
    data_dir: str | None = None
    epochs: int = 2
    batch_size: int = 128
    eval_batch_size: int = 500
    lr: float = 0.1
    momentum: float = 0.9
    weight_decay: float = 5e-4
    warmup_epochs: float = 1.0
    label_smoothing: float = 0.0
    steps_per_epoch: int | None = None
    eval_every: int = 1
    seed: int = 0
    checkpoint_dir: str | None = None
    resume: bool = False
    out: str | None = None
    progress: bool = True


@dataclasses.dataclass(frozen=True)
class Precision:
    """A resolved ``--precision``: the policy and the matmul precision.

    Attributes:
        name: what the user asked for (``fp32``, ``tf32``, ``mixed``, ...).
        policy: the jaxamp policy.
        matmul_precision: ``highest`` (true float32) or ``default`` (TF32 on
            Ampere and later GPUs for float32 inputs).
    """

    name: str
    policy: jaxamp.Policy
    matmul_precision: str

    def context(self) -> contextlib.AbstractContextManager:
        """The matmul-precision context that traces and compiles run in."""
        return jax.default_matmul_precision(self.matmul_precision)


def resolve_precision(name: str) -> Precision:
    """Resolves ``--precision``: ``fp32``, ``tf32`` or any jaxamp policy spec."""
    key = "".join(name.split()).lower()
    if key in _FLOAT32_PRECISIONS:
        return Precision(key, jaxamp.get_policy("float32"), _FLOAT32_PRECISIONS[key])
    return Precision(name, jaxamp.get_policy(name), "default")


def resolve_loss_scale(spec: str, policy: jaxamp.Policy) -> jaxamp.LossScale:
    """Resolves ``--loss-scale``: ``default``, ``dynamic``, ``static:N`` or ``none``."""
    key = "".join(spec.split()).lower()
    if key == "default":
        return jaxamp.default_loss_scale(policy)
    if key == "dynamic":
        return jaxamp.DynamicLossScale()
    if key == "none":
        return jaxamp.NoOpLossScale()
    if key.startswith("static:"):
        try:
            return jaxamp.StaticLossScale(float(key.removeprefix("static:")))
        except ValueError:
            pass
    raise ValueError(
        f"Unknown loss scale {spec!r}; choose default, dynamic, none or static:N "
        "with N a positive number (e.g. static:1024)."
    )


def create_optimizer(config: TrainConfig, steps_per_epoch: int) -> optax.GradientTransformation:
    """SGD with Nesterov momentum and weight decay, warm-up then cosine decay.

    Weight decay is added to the gradient before momentum, as PyTorch's SGD
    does, so the recipe matches the study's.
    """
    total_steps = max(1, config.epochs * steps_per_epoch)
    warmup_steps = min(int(config.warmup_epochs * steps_per_epoch), total_steps - 1)
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=config.lr,
        warmup_steps=warmup_steps,
        decay_steps=total_steps,
        end_value=0.0,
    )
    return optax.chain(
        optax.add_decayed_weights(config.weight_decay),
        optax.sgd(schedule, momentum=config.momentum, nesterov=True),
    )


def create_train_state(
    config: TrainConfig, precision: Precision, num_classes: int, steps_per_epoch: int
) -> jaxamp.TrainState:
    """Builds the mixed-precision model and its `jaxamp.TrainState`."""
    model = jaxamp.apply_policy(create_model(config.model, num_classes), precision.policy)
    sample = jnp.zeros((1, 32, 32, 3), jnp.float32)
    variables = jax.jit(lambda rng: model.init(rng, sample, train=False))(jax.random.key(config.seed))
    return jaxamp.TrainState.create(
        apply_fn=model.apply,
        params=variables["params"],
        tx=create_optimizer(config, steps_per_epoch),
        loss_scale=resolve_loss_scale(config.loss_scale, precision.policy),
        batch_stats=variables.get("batch_stats"),
    )


def cross_entropy(logits: jax.Array, labels: jax.Array, num_classes: int, smoothing: float) -> jax.Array:
    """Mean softmax cross-entropy in float32, with optional label smoothing."""
    targets = optax.smooth_labels(jax.nn.one_hot(labels, num_classes), smoothing)
    return optax.softmax_cross_entropy(logits.astype(jnp.float32), targets).mean()


def make_train_step(config: TrainConfig, dataset: data_lib.Dataset) -> Callable:
    """Returns ``train_step(state, images, labels, batch_indices, rng)``.

    `images` and `labels` are the whole uint8 training set on the device; the
    step gathers its batch, augments (random crop with 4-pixel padding,
    horizontal flip) and normalizes it on the device.
    """

    def train_step(state, images, labels, batch_indices, rng):
        batch_images = data_lib.normalize(
            data_lib.augment(rng, images[batch_indices]), dataset.mean, dataset.std
        )
        batch_labels = labels[batch_indices]

        def loss_fn(params):
            logits, updates = state.apply_fn(
                {"params": params, "batch_stats": state.batch_stats},
                batch_images,
                train=True,
                mutable=["batch_stats"],
            )
            loss = cross_entropy(logits, batch_labels, dataset.num_classes, config.label_smoothing)
            return loss, (logits, updates["batch_stats"])

        (loss, (logits, new_batch_stats)), grads, grads_finite = jaxamp.scaled_value_and_grad(
            loss_fn, state.loss_scale, has_aux=True
        )(state.params)
        state = state.apply_gradients(grads=grads, grads_finite=grads_finite, batch_stats=new_batch_stats)
        metrics = {
            "loss": loss,
            "correct": jnp.sum(jnp.argmax(logits, -1) == batch_labels),
        }
        return state, metrics

    return train_step


def make_eval_step(dataset: data_lib.Dataset) -> Callable:
    """Returns ``eval_step(state, images, labels, mask)`` → summed metrics.

    The test pass runs under the same policy as training (the model's
    ``apply`` is the policy-wrapped one). `mask` marks the real examples of a
    padded last batch.
    """

    def eval_step(state, images, labels, mask):
        logits = state.apply_fn(
            {"params": state.params, "batch_stats": state.batch_stats},
            data_lib.normalize(images, dataset.mean, dataset.std),
            train=False,
        )
        losses = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels)
        correct = (jnp.argmax(logits, -1) == labels) & mask
        return {"loss": jnp.sum(jnp.where(mask, losses, 0.0)), "correct": jnp.sum(correct)}

    return eval_step


@dataclasses.dataclass
class DeviceData:
    """The data set as device arrays, padded for fixed-size test batches."""

    train_images: jax.Array
    train_labels: jax.Array
    test_batches: list[tuple[jax.Array, jax.Array, jax.Array]]
    test_batch_sizes: list[int]
    num_train: int


def put_on_device(dataset: data_lib.Dataset, eval_batch_size: int) -> DeviceData:
    """Copies the uint8 data set to the device once, test set in padded batches."""
    num_test = len(dataset.test_labels)
    padded = -(-num_test // eval_batch_size) * eval_batch_size
    pad = padded - num_test
    test_images = np.concatenate([dataset.test_images, np.zeros((pad, 32, 32, 3), np.uint8)])
    test_labels = np.concatenate([dataset.test_labels, np.zeros((pad,), np.int32)])
    mask = np.arange(padded) < num_test
    test_batches = [
        tuple(
            jax.device_put(array[start : start + eval_batch_size])
            for array in (test_images, test_labels, mask)
        )
        for start in range(0, padded, eval_batch_size)
    ]
    return DeviceData(
        train_images=jax.device_put(dataset.train_images),
        train_labels=jax.device_put(dataset.train_labels.astype(np.int32)),
        test_batches=test_batches,
        test_batch_sizes=[
            int(mask[start : start + eval_batch_size].sum()) for start in range(0, padded, eval_batch_size)
        ],
        num_train=len(dataset.train_labels),
    )


def environment(config: TrainConfig, precision: Precision) -> dict[str, Any]:
    """What ran where: device, versions, precision and sizes, for the results."""
    device = jax.devices()[0]
    return {
        "device_kind": device.device_kind,
        "platform": device.platform,
        "device_count": jax.device_count(),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "flax": flax.__version__,
        "optax": optax.__version__,
        "jaxamp": jaxamp.__version__,
        "precision": precision.name,
        "policy": str(precision.policy),
        "matmul_precision": precision.matmul_precision,
        "model": config.model,
        "batch_size": config.batch_size,
        "dataset": config.dataset,
        "data": config.data,
    }


def write_json_atomically(path: str, payload: dict[str, Any]) -> None:
    """Writes JSON to a temporary file beside `path`, then renames it.

    A crash mid-write leaves the previous file intact, never half a file.
    """
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=directory, suffix=".tmp", delete=False) as handle:
        json.dump(payload, handle, indent=2)
        handle.write("\n")
        temporary = handle.name
    os.replace(temporary, path)


class Checkpointer:
    """Saves and restores the train state and the results so far (orbax)."""

    def __init__(self, directory: str):
        import orbax.checkpoint as ocp

        self._ocp = ocp
        self._manager = ocp.CheckpointManager(
            os.path.abspath(directory),
            options=ocp.CheckpointManagerOptions(max_to_keep=2, create=True),
        )

    def latest_epoch(self) -> int | None:
        return self._manager.latest_step()

    def save(self, epoch: int, state: jaxamp.TrainState, results: dict[str, Any]) -> None:
        ocp = self._ocp
        self._manager.save(
            epoch,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(_checkpointed(state)),
                results=ocp.args.JsonSave(results),
            ),
        )
        self._manager.wait_until_finished()

    def restore(self, epoch: int, state: jaxamp.TrainState) -> tuple[jaxamp.TrainState, dict[str, Any]]:
        ocp = self._ocp
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, _checkpointed(state))
        restored = self._manager.restore(
            epoch,
            args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract), results=ocp.args.JsonRestore()),
        )
        return state.replace(**restored["state"]), restored["results"]


def _checkpointed(state: jaxamp.TrainState) -> dict[str, Any]:
    """The parts of the state that change: everything but apply_fn and tx."""
    return {
        "step": state.step,
        "params": state.params,
        "opt_state": state.opt_state,
        "batch_stats": state.batch_stats,
        "loss_scale": state.loss_scale,
        "skipped_steps": state.skipped_steps,
    }


class Progress:
    """A per-epoch progress bar showing loss and images/s.

    The loss shown is that of a step dispatched at the previous refresh, long
    finished by now, so reading it never waits for the device to drain its
    queue of steps; images/s counts the steps known to be finished.
    """

    def __init__(self, total: int, description: str, enabled: bool, batch_size: int):
        self._bar = None
        if enabled:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total, desc=description, leave=False, unit="step")
        self._batch_size = batch_size
        self._pending: tuple[int, jax.Array] | None = None
        self._start = time.perf_counter()
        self._refresh_every = max(1, total // 50)

    def update(self, step: int, loss: jax.Array) -> None:
        if self._bar is None:
            return
        self._bar.update(1)
        if step % self._refresh_every:
            return
        if self._pending is not None:
            finished_step, finished_loss = self._pending
            loss_value = float(finished_loss)
            elapsed = time.perf_counter() - self._start
            self._bar.set_postfix(
                loss=f"{loss_value:.4f}",
                img_s=f"{finished_step * self._batch_size / elapsed:,.0f}",
            )
        self._pending = (step, loss)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def train_and_evaluate(
    config: TrainConfig,
    dataset: data_lib.Dataset | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Trains and evaluates one model under one precision; returns the results.

    Args:
        config: the run's settings.
        dataset: the data; loaded from `config` when None.
        log: where the per-epoch lines go.

    Returns:
        The results: environment, compile times, and per-epoch figures. They
        are also written to ``config.out`` after every epoch, when set.

    Raises:
        experiments.data.DataUnavailableError: the data set is missing.
        ValueError: an invalid precision, loss scale or model name.
    """
    precision = resolve_precision(config.precision)
    if dataset is None:
        dataset = data_lib.load_dataset(config.dataset, config.data, config.data_dir, seed=config.seed)
    if config.batch_size > len(dataset.train_labels):
        raise ValueError(
            f"--batch-size {config.batch_size} exceeds the {len(dataset.train_labels)} "
            "training examples; choose a smaller batch."
        )
    full_epoch_steps = len(dataset.train_labels) // config.batch_size
    steps_per_epoch = min(full_epoch_steps, config.steps_per_epoch or full_epoch_steps)
    device_data = put_on_device(dataset, config.eval_batch_size)

    with precision.context():
        state = create_train_state(config, precision, dataset.num_classes, steps_per_epoch)
        results: dict[str, Any] = {
            "config": dataclasses.asdict(config),
            "environment": environment(config, precision),
            "steps_per_epoch": steps_per_epoch,
            "num_params": int(sum(leaf.size for leaf in jax.tree.leaves(state.params))),
            "epochs": [],
        }
        checkpointer = Checkpointer(config.checkpoint_dir) if config.checkpoint_dir else None
        first_epoch = 1
        if checkpointer and config.resume and checkpointer.latest_epoch() is not None:
            state, saved = checkpointer.restore(checkpointer.latest_epoch(), state)
            results["epochs"] = saved["epochs"]
            first_epoch = checkpointer.latest_epoch() + 1
            log(f"Resumed from {config.checkpoint_dir} after epoch {first_epoch - 1}.")

        epoch_plan, train_step, eval_step, compile_times = _compile(
            config, dataset, state, device_data, steps_per_epoch
        )
        results["compile_time_s"] = compile_times
        log(
            f"{config.model} | {precision.name} ({precision.policy}, matmul "
            f"{precision.matmul_precision}) | {jax.devices()[0].device_kind} | "
            f"compile: train {compile_times['train_step']:.1f}s, test {compile_times['eval_step']:.1f}s"
        )

        rng = jax.random.key(config.seed + 1)
        for epoch in range(first_epoch, config.epochs + 1):
            epoch_rng = jax.random.fold_in(rng, epoch)
            state, train_metrics = _train_epoch(
                config, epoch_plan, train_step, state, device_data, epoch_rng, epoch
            )
            record = {"epoch": epoch, **train_metrics}
            if epoch % config.eval_every == 0 or epoch == config.epochs:
                record.update(_evaluate(eval_step, state, device_data, config.steps_per_epoch))
            record["loss_scale"] = float(state.loss_scale.loss_scale)
            record["skipped_steps"] = int(state.skipped_steps)
            results["epochs"].append(record)
            log(format_epoch(record, config.epochs))
            if config.out:
                write_json_atomically(config.out, results)
            if checkpointer:
                checkpointer.save(epoch, state, results)
    results["summary"] = summarize(results["epochs"])
    if config.out:
        write_json_atomically(config.out, results)
    return results


def make_epoch_plan(num_train: int, batch_size: int, steps_per_epoch: int) -> Callable:
    """Returns ``plan(rng)`` → one epoch's per-step batch indices and RNG keys.

    The permutation and the keys are made on the device and handed back as
    one array per step, all in a single dispatch.
    """

    def plan(rng):
        shuffle_rng, augment_rng = jax.random.split(rng)
        batches = data_lib.epoch_batches(shuffle_rng, num_train, batch_size)[:steps_per_epoch]
        return tuple(batches), tuple(jax.random.split(augment_rng, steps_per_epoch))

    return plan


def _compile(config, dataset, state, device_data, steps_per_epoch):
    """Compiles the epoch plan, train and eval steps ahead of time, timing each.

    Everything a timed epoch runs is compiled here, so no compilation lands in
    the train or test times.
    """
    batch_indices = jnp.zeros((config.batch_size,), jnp.int32)
    rng = jax.random.key(0)
    start = time.perf_counter()
    epoch_plan = (
        jax.jit(make_epoch_plan(device_data.num_train, config.batch_size, steps_per_epoch))
        .lower(rng)
        .compile()
    )
    train_step = (
        jax.jit(make_train_step(config, dataset), donate_argnums=0)
        .lower(state, device_data.train_images, device_data.train_labels, batch_indices, rng)
        .compile()
    )
    train_compile = time.perf_counter() - start
    start = time.perf_counter()
    eval_step = jax.jit(make_eval_step(dataset)).lower(state, *device_data.test_batches[0]).compile()
    eval_compile = time.perf_counter() - start
    compile_times = {"train_step": train_compile, "eval_step": eval_compile}
    return epoch_plan, train_step, eval_step, compile_times


def _train_epoch(config, epoch_plan, train_step, state, device_data, rng, epoch):
    start = time.perf_counter()
    batches, step_rngs = epoch_plan(rng)
    progress = Progress(len(batches), f"epoch {epoch}/{config.epochs}", config.progress, config.batch_size)
    step_metrics = []
    for step, (batch_indices, step_rng) in enumerate(zip(batches, step_rngs), start=1):
        state, metrics = train_step(
            state, device_data.train_images, device_data.train_labels, batch_indices, step_rng
        )
        step_metrics.append(metrics)
        progress.update(step, metrics["loss"])
    state = jax.block_until_ready(state)
    train_time = time.perf_counter() - start
    progress.close()
    losses = jnp.stack([metrics["loss"] for metrics in step_metrics])
    correct = jnp.stack([metrics["correct"] for metrics in step_metrics])
    images = len(batches) * config.batch_size
    return state, {
        "train_time_s": train_time,
        "train_loss": float(jnp.mean(losses)),
        "train_accuracy": float(jnp.sum(correct)) / images,
        "images_per_s": images / train_time,
    }


def _evaluate(eval_step, state, device_data, max_batches: int | None):
    """The test pass: all test batches, or the first `max_batches` for quick runs."""
    batches = device_data.test_batches[:max_batches]
    num_examples = sum(device_data.test_batch_sizes[:max_batches])
    start = time.perf_counter()
    totals = [eval_step(state, *batch) for batch in batches]
    totals = jax.block_until_ready(totals)
    test_time = time.perf_counter() - start
    return {
        "test_time_s": test_time,
        "test_examples": num_examples,
        "test_loss": float(sum(total["loss"] for total in totals)) / num_examples,
        "test_accuracy": float(sum(total["correct"] for total in totals)) / num_examples,
    }


def format_epoch(record: dict[str, Any], epochs: int) -> str:
    """The one line printed after each epoch."""
    line = (
        f"epoch {record['epoch']:>3}/{epochs} | train {record['train_time_s']:7.2f}s"
        f" loss {record['train_loss']:.4f}"
    )
    if "test_time_s" in record:
        line += f" | test {record['test_time_s']:6.2f}s acc {record['test_accuracy']:.2%}"
    line += (
        f" | {record['images_per_s']:,.0f} img/s | loss scale {record['loss_scale']:g}"
        f" | skipped {record['skipped_steps']}"
    )
    return line


def summarize(epochs: list[dict[str, Any]]) -> dict[str, Any]:
    """Median times per epoch and final accuracy.

    Medians resist the noise of a shared machine; compilation is already
    excluded from every figure.
    """
    if not epochs:
        return {}
    tested = [record for record in epochs if "test_time_s" in record]
    return {
        "train_time_s": float(np.median([record["train_time_s"] for record in epochs])),
        "test_time_s": float(np.median([record["test_time_s"] for record in tested])) if tested else None,
        "images_per_s": float(np.median([record["images_per_s"] for record in epochs])),
        "final_test_accuracy": tested[-1]["test_accuracy"] if tested else None,
        "final_train_loss": epochs[-1]["train_loss"],
        "skipped_steps": epochs[-1]["skipped_steps"],
        "epochs": len(epochs),
    }
