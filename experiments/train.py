"""CIFAR-10 training with jaxamp: the recipe of the study, in JAX.

Read top to bottom, this is the whole recipe:

1. `resolve_precision` turns ``--precision`` into a `jaxamp.Policy` and a
   matmul precision (``fp32`` is true float32, ``tf32`` is JAX's default).
2. `create_train_state` applies the policy to the plain Flax model with
   `jaxamp.apply_policy` (or, with ``--route autocast``, `jaxamp.autocast`
   of the plain model's ``apply``: `resolve_route`) and builds a
   `jaxamp.TrainState` with SGD (Nesterov momentum, weight decay, warm-up
   and cosine decay) and the policy's loss scale; a policy that names an
   update rounding (``bfloat16_kahan``) keeps params and momentum in bfloat16
   through `jaxamp.low_precision_optimizer`.
3. `train_step` gathers, augments and normalizes a batch on the device,
   differentiates through the loss scale with
   `jaxamp.scaled_value_and_grad` (over ``--grad-accum`` micro-batches), and
   lets `TrainState.apply_gradients` skip the step if the gradients
   overflowed.
4. `train_and_evaluate` keeps the uint8 data set on every device, shards each
   batch over a mesh of all devices (`experiments.distributed`), compiles the
   steps ahead of time, and runs epochs: it checkpoints
   (`experiments.checkpointing`), stops an overflow storm with
   `jaxamp.OverflowGuard`, and writes results (`experiments.results`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxamp
from experiments import data as data_lib
from experiments import interrupts
from experiments.checkpointing import (
    Checkpointer,
    CheckpointError,
    Position,
    check_folder_usable,
    signature,
)
from experiments.config import FLOAT32_PRECISIONS, ROUTES, TrainConfig, parse_loss_scale, validate_rate
from experiments.distributed import DataParallel, host_value
from experiments.fault_injection import inject_nonfinite
from experiments.grad_accumulation import accumulate_gradients
from experiments.models import MODELS, create_model
from experiments.progress import Progress
from experiments.results import (  # also re-exported from here for compare and older callers
    environment,
    format_epoch,
    skipped_steps_line,
    state_checksum,
    state_finite,
    summarize,
    write_json_atomically,
)

# TrainConfig, ROUTES, parse_loss_scale and validate_rate live in experiments.config (no JAX), so
# the command answers a bad flag before JAX loads; callers may still take them from here.


class ConfigError(ValueError):
    """A setting of `TrainConfig` is invalid; the message names it and the valid values."""


def validate_config(config: TrainConfig) -> None:
    """Checks every setting before anything loads or compiles.

    Raises:
        ConfigError: naming the flag, the bad value and what is valid.
    """

    def fail(flag, value, valid):
        raise ConfigError(f"{flag} {value!r} is invalid: expected {valid}.")

    def is_int(value):
        return isinstance(value, (int, np.integer)) and not isinstance(value, bool)

    for name in ("epochs", "batch_size", "eval_batch_size", "eval_every", "grad_accum"):
        value = getattr(config, name)
        if not (is_int(value) and value >= 1):
            fail(f"--{name.replace('_', '-')}", value, "an integer >= 1")
    for name in ("steps_per_epoch", "checkpoint_every"):
        value = getattr(config, name)
        if value is not None and not (is_int(value) and value >= 1):
            fail(f"--{name.replace('_', '-')}", value, "an integer >= 1, or none")
    for name in ("max_consecutive_skips", "max_overflows_at_min_scale"):
        value = getattr(config, name)
        if not (is_int(value) and value >= 0):
            fail(f"--{name.replace('_', '-')}", value, "an integer >= 0 (0 turns the limit off)")
    if not (isinstance(config.lr, (int, float)) and math.isfinite(config.lr) and config.lr > 0):
        fail("--lr", config.lr, "a finite number > 0")
    if config.model not in MODELS:
        fail("--model", config.model, f"one of {', '.join(sorted(MODELS))}")
    if config.dataset not in data_lib.DATASETS:
        fail("--dataset", config.dataset, f"one of {', '.join(data_lib.DATASETS)}")
    if config.data not in data_lib.SOURCES:
        fail("--data", config.data, f"one of {', '.join(data_lib.SOURCES)}")
    try:
        validate_rate(config.inject_nonfinite)
        resolve_route(config.route, resolve_precision(config.precision))
        parse_loss_scale(config.loss_scale)
    except (ValueError, TypeError) as error:
        raise ConfigError(str(error)) from None


@dataclasses.dataclass(frozen=True)
class Precision:
    """A resolved ``--precision``: the policy, the optimizer's storage and the matmul precision.

    Attributes:
        name: what the user asked for (``fp32``, ``tf32``, ``mixed``, ...).
        policy: the jaxamp policy (its dtypes).
        matmul_precision: ``highest`` (true float32) or ``default`` (TF32 on
            Ampere and later GPUs for float32 inputs).
        storage: how `jaxamp.low_precision_optimizer` stores params and
            state (``bfloat16_int8``, and every name with half params), or
            None: the optimizer as it is.
    """

    name: str
    policy: jaxamp.Policy
    matmul_precision: str
    storage: jaxamp.OptimizerStorage | None = None

    def optimizer(self, inner: optax.GradientTransformation, *, key: int) -> optax.GradientTransformation:
        """`inner`, or `inner` in `jaxamp.low_precision_optimizer` as `storage` says."""
        if self.storage is None:
            return inner
        return self.storage.optimizer(inner, param_dtype=self.policy.param_dtype, key=key)

    def describe(self) -> str:
        """The policy and the storage as one grammar string (``params=bfloat16,...,update=kahan``)."""
        return str(self.policy) + ("" if self.storage is None else f",{self.storage}")

    def context(self) -> contextlib.AbstractContextManager:
        """The matmul-precision context that traces and compiles run in."""
        return jax.default_matmul_precision(self.matmul_precision)


def resolve_precision(name: str) -> Precision:
    """Resolves ``--precision``: ``fp32``, ``tf32`` or any jaxamp policy spec."""
    key = "".join(name.split()).lower()
    if key in FLOAT32_PRECISIONS:
        return Precision(key, jaxamp.get_policy("float32"), FLOAT32_PRECISIONS[key])
    policy, storage = jaxamp.split_precision(name)
    return Precision(name, policy, "default", storage)


def resolve_route(route: str, precision: Precision) -> str:
    """Resolves ``--route``: how `precision`'s policy reaches the model.

    ``auto`` is ``apply_policy``: `jaxamp.apply_policy` casts the params
    where they are created and runs the model's ``apply`` through
    `jaxamp.autocast`, FP8 policies (``mixed_float8``) included.
    ``autocast`` rewrites the plain model's ``apply`` itself; both compute
    the same program.

    Returns:
        ``apply_policy`` or ``autocast``.

    Raises:
        ValueError: `route` is not one of `ROUTES`.
    """
    if route not in ROUTES:
        raise ValueError(f"Unknown route {route!r}; choose one of {', '.join(ROUTES)}.")
    return "apply_policy" if route == "auto" else route


def resolve_loss_scale(spec: str, policy: jaxamp.Policy) -> jaxamp.LossScale:
    """Resolves ``--loss-scale``: ``default``, ``dynamic``, ``static:N`` or ``none``."""
    kind, value = parse_loss_scale(spec)
    if kind == "default":
        return jaxamp.default_loss_scale(policy)
    if kind == "dynamic":
        return jaxamp.DynamicLossScale()
    if kind == "none":
        return jaxamp.NoOpLossScale()
    return jaxamp.StaticLossScale(value)


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
    """Builds the mixed-precision model and its `jaxamp.TrainState`.

    The policy reaches the model by ``config.route`` (`resolve_route`). Both
    routes start from the same params, in the policy's param dtype:
    ``apply_policy`` adds no variables, and ``autocast`` initializes the plain
    model (in float32, cast here) and rewrites only its ``apply``. The
    optimizer is the precision's (`Precision.optimizer`), which computes in
    float32 for half params.
    """
    plain_model = create_model(config.model, num_classes)
    if resolve_route(config.route, precision) == "autocast":
        model, apply_fn = plain_model, jaxamp.autocast(plain_model.apply, precision.policy)
    else:
        model = jaxamp.apply_policy(plain_model, precision.policy)
        apply_fn = model.apply
    sample = jnp.zeros((1, 32, 32, 3), jnp.float32)
    variables = jax.jit(lambda rng: model.init(rng, sample, train=False))(jax.random.key(config.seed))
    params = variables["params"]
    params = precision.policy.cast_to_param(params)  # the autocast route's plain model makes float32
    return jaxamp.TrainState.create(
        apply_fn=apply_fn,
        params=params,
        tx=precision.optimizer(create_optimizer(config, steps_per_epoch), key=config.seed),
        loss_scale=resolve_loss_scale(config.loss_scale, precision.policy),
        batch_stats=variables.get("batch_stats"),
    )


def cross_entropy(logits: jax.Array, labels: jax.Array, num_classes: int, smoothing: float) -> jax.Array:
    """Mean softmax cross-entropy in float32, with optional label smoothing."""
    targets = optax.smooth_labels(jax.nn.one_hot(labels, num_classes), smoothing)
    return optax.softmax_cross_entropy(logits.astype(jnp.float32), targets).mean()


def make_train_step(
    config: TrainConfig, dataset: data_lib.Dataset, data_parallel: DataParallel | None = None
) -> Callable:
    """Returns ``train_step(state, images, labels, batch_indices, rng)``.

    `images` and `labels` are the whole uint8 training set on the device; the
    step gathers its batch, augments (random crop with 4-pixel padding,
    horizontal flip) and normalizes it on the device. With
    ``config.grad_accum = K`` the batch is K micro-batches whose gradients
    are accumulated (`experiments.grad_accumulation`). With `data_parallel`
    every micro-batch is sharded over its mesh's ``data`` axis. With
    ``config.inject_nonfinite`` a seeded share of steps get inf or NaN
    gradients (`experiments.fault_injection`). With ``config.record_overflow``
    each micro-batch's `jaxamp.diagnostics.OverflowRecord` is taken, the
    worst of them kept for the step, and the state keeps the last skipped
    step's (``state.overflow_record``).

    The metrics are the loss (mean over the batch), the number of correct
    predictions and whether the step was injected.
    """
    num_micro_batches = config.grad_accum

    def train_step(state, images, labels, batch_indices, rng):
        micro_indices = batch_indices.reshape(num_micro_batches, -1)
        micro_rngs = rng[None] if num_micro_batches == 1 else jax.random.split(rng, num_micro_batches)
        if data_parallel is not None:
            micro_indices = jax.lax.with_sharding_constraint(micro_indices, data_parallel.batch_sharded(1))

        def micro_batch_grads(params, batch_stats, micro_batch):
            indices, augment_rng = micro_batch
            batch_images = data_lib.normalize(
                data_lib.augment(augment_rng, images[indices]), dataset.mean, dataset.std
            )
            batch_labels = labels[indices]

            def loss_fn(params):
                logits, updates = state.apply_fn(
                    {"params": params, "batch_stats": batch_stats},
                    batch_images,
                    train=True,
                    mutable=["batch_stats"],
                )
                loss = cross_entropy(logits, batch_labels, dataset.num_classes, config.label_smoothing)
                return loss, (logits, updates["batch_stats"])

            (loss, (logits, new_batch_stats)), grads, grads_finite, *record = jaxamp.scaled_value_and_grad(
                loss_fn, state.loss_scale, has_aux=True, record_overflow=config.record_overflow
            )(params)
            metrics = {"loss": loss, "correct": jnp.sum(jnp.argmax(logits, -1) == batch_labels)}
            if record:
                metrics["overflow_record"] = record[0]
            return (metrics, new_batch_stats), grads, grads_finite

        new_batch_stats, grads, grads_finite, metrics = accumulate_gradients(
            micro_batch_grads, state.params, state.batch_stats, (micro_indices, micro_rngs)
        )
        grads, injected = inject_nonfinite(grads, rng, config.inject_nonfinite)
        if config.inject_nonfinite:
            grads_finite = grads_finite & jaxamp.all_finite(grads)
        state = state.apply_gradients(
            grads=grads,
            grads_finite=grads_finite,
            batch_stats=new_batch_stats,
            overflow_record=metrics.get("overflow_record"),
        )
        metrics = {
            "loss": metrics["loss"] / num_micro_batches,
            "correct": metrics["correct"],
            "injected": injected.astype(jnp.int32),
        }
        return state, metrics

    return train_step


def with_overflow_record(state, train_step: Callable, device_data, batch_size: int):
    """`state` holding a cleared overflow record of `train_step`'s shape (``--record-overflow``).

    The step keeps the last skipped step's record in ``state.overflow_record``
    (`jaxamp.TrainState.apply_gradients`); starting from a cleared one of the
    same sites (found by tracing the step once, without running it) keeps
    the state's structure fixed, so the step compiled ahead of time takes
    every later state, and a checkpoint restores into it.
    """
    return state.with_overflow_record_of(
        train_step,
        device_data.train_images,
        device_data.train_labels,
        jax.ShapeDtypeStruct((batch_size,), jnp.int32),
        jax.eval_shape(lambda: jax.random.key(0)),
    )


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


def put_on_device(
    dataset: data_lib.Dataset, eval_batch_size: int, data_parallel: DataParallel | None = None
) -> DeviceData:
    """Copies the uint8 data set to every device once, test set in padded batches.

    Every device holds the whole (uint8) set; each gathers only its shard of
    a batch inside the step.
    """
    data_parallel = data_parallel or DataParallel.over_all_devices()
    num_test = len(dataset.test_labels)
    padded = -(-num_test // eval_batch_size) * eval_batch_size
    pad = padded - num_test
    test_images = np.concatenate([dataset.test_images, np.zeros((pad, 32, 32, 3), np.uint8)])
    test_labels = np.concatenate([dataset.test_labels, np.zeros((pad,), np.int32)])
    mask = np.arange(padded) < num_test
    test_batches = [
        tuple(
            data_parallel.replicate(array[start : start + eval_batch_size])
            for array in (test_images, test_labels, mask)
        )
        for start in range(0, padded, eval_batch_size)
    ]
    return DeviceData(
        train_images=data_parallel.replicate(dataset.train_images),
        train_labels=data_parallel.replicate(dataset.train_labels.astype(np.int32)),
        test_batches=test_batches,
        test_batch_sizes=[
            int(mask[start : start + eval_batch_size].sum()) for start in range(0, padded, eval_batch_size)
        ],
        num_train=len(dataset.train_labels),
    )


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


@dataclasses.dataclass
class _Run:
    """What every epoch of one run shares: settings, compiled steps, outputs."""

    config: TrainConfig
    data_parallel: DataParallel
    device_data: DeviceData
    steps_per_epoch: int
    rng_key_data: list[int]
    epoch_plan: Callable
    train_step: Callable
    eval_step: Callable
    guard: jaxamp.OverflowGuard
    checkpointer: Checkpointer | None
    results: dict[str, Any]
    log: Callable[[str], None]

    def epoch_key(self, epoch: int) -> jax.Array:
        """The key of an epoch's order and augmentation: the run's key folded with it."""
        key = jax.random.wrap_key_data(np.asarray(self.rng_key_data, np.uint32))
        return self.data_parallel.replicate(jax.random.fold_in(key, epoch))

    def is_check_step(self, global_step: int) -> bool:
        """Whether the host checks the guard (and maybe checkpoints) after this step.

        Every ``--checkpoint-every`` steps (with a checkpoint folder) and
        every ``--max-consecutive-skips`` (or ``--max-overflows-at-min-scale``)
        steps, so a storm is caught within twice its limit; never per step
        unless asked for.
        """
        config = self.config
        intervals = [
            config.checkpoint_every if self.checkpointer else None,
            config.max_consecutive_skips,
            config.max_overflows_at_min_scale,
        ]
        return any(interval and global_step % interval == 0 for interval in intervals)


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
        are also written to ``config.out`` after every epoch, when set (by
        process 0 only).

    Raises:
        ConfigError: an invalid setting.
        experiments.data.DataUnavailableError: the data set is missing or damaged.
        experiments.distributed.DistributedSetupError: the batch does not
            split over the devices.
        experiments.checkpointing.CheckpointError: the checkpoint folder or
            the checkpoint to resume is unusable.
        jaxamp.LossScaleStuckError: an overflow storm (the last good
            checkpoint is kept).
    """
    validate_config(config)
    precision = resolve_precision(config.precision)
    data_parallel = DataParallel.over_all_devices()
    data_parallel.check_batch_size(config.batch_size, config.grad_accum)
    if config.checkpoint_dir:
        check_folder_usable(config.checkpoint_dir)  # at once, creating nothing
    elif config.resume:
        raise ConfigError("--resume needs --checkpoint-dir: the folder of the run to continue.")
    if dataset is None:
        dataset = data_lib.load_dataset(config.dataset, config.data, config.data_dir, seed=config.seed)
    checkpointer = None
    if config.checkpoint_dir:  # made once the data has loaded: a run that cannot start leaves no folder
        checkpointer = Checkpointer(
            config.checkpoint_dir, signature(config, data_parallel.device_count), resume=config.resume
        )
    if config.batch_size > len(dataset.train_labels):
        raise ConfigError(
            f"--batch-size {config.batch_size} exceeds the {len(dataset.train_labels)} "
            "training examples; choose a smaller batch."
        )
    full_epoch_steps = len(dataset.train_labels) // config.batch_size
    steps_per_epoch = min(full_epoch_steps, config.steps_per_epoch or full_epoch_steps)
    device_data = put_on_device(dataset, config.eval_batch_size, data_parallel)
    if data_parallel.process_count > 1:
        process_log = log
        log = lambda line: process_log(f"[process {jax.process_index()}] {line}")

    with precision.context():
        state = create_train_state(config, precision, dataset.num_classes, steps_per_epoch)
        if config.record_overflow:
            state = with_overflow_record(
                state, make_train_step(config, dataset), device_data, config.batch_size
            )
        state = data_parallel.replicate(state)
        results: dict[str, Any] = {
            "config": dataclasses.asdict(config),
            "environment": {
                **environment(config, precision),
                "route": resolve_route(config.route, precision),
            },
            "steps_per_epoch": steps_per_epoch,
            "num_params": int(sum(leaf.size for leaf in jax.tree.leaves(state.params))),
            "epochs": [],
        }
        position = Position(
            epoch=1,
            steps_done=0,
            rng_key_data=[int(word) for word in jax.random.key_data(jax.random.key(config.seed + 1))],
            epoch_sums=_zero_sums(),
        )
        if config.resume:
            state, position, saved_results = checkpointer.restore_latest(state)
            results["epochs"] = saved_results["epochs"]
            log(
                f"Resumed from {config.checkpoint_dir} at epoch {position.epoch}, "
                f"after {position.steps_done} of its {steps_per_epoch} steps."
            )

        epoch_plan, train_step, eval_step, compile_times = _compile(
            config, dataset, state, device_data, steps_per_epoch, data_parallel
        )
        results["compile_time_s"] = compile_times
        log(
            f"{config.model} | {precision.name} ({precision.describe()}, matmul "
            f"{precision.matmul_precision}, route {resolve_route(config.route, precision)}) | "
            f"{jax.devices()[0].device_kind} x{data_parallel.device_count}"
            f" | compile: train {compile_times['train_step']:.1f}s, test {compile_times['eval_step']:.1f}s"
        )
        run = _Run(
            config=config,
            data_parallel=data_parallel,
            device_data=device_data,
            steps_per_epoch=steps_per_epoch,
            rng_key_data=position.rng_key_data,
            epoch_plan=epoch_plan,
            train_step=train_step,
            eval_step=eval_step,
            guard=jaxamp.OverflowGuard(config.max_consecutive_skips, config.max_overflows_at_min_scale),
            checkpointer=checkpointer,
            results=results,
            log=log,
        )
        for epoch in range(position.epoch, config.epochs + 1):
            resumed_at = position if epoch == position.epoch else None
            state = _run_epoch(run, state, epoch, resumed_at)
    results["summary"] = summarize(results["epochs"])
    interrupts.stop_if_interrupted()
    if config.out and data_parallel.is_main_process:
        write_json_atomically(config.out, results)
    return results


def _zero_sums() -> dict[str, float]:
    return {"loss": 0.0, "correct": 0.0, "injected": 0.0}


def _fold_sums(sums: dict[str, float], step_metrics: list[dict[str, jax.Array]]) -> dict[str, float]:
    """Adds the metrics of finished steps to an epoch's running sums, in float32.

    Runs only where the host waits anyway (a check, a checkpoint, the epoch's
    end); a resumed run folds at the same steps as an uninterrupted one, so
    both get the same sums to the bit.
    """
    if not step_metrics:
        return sums
    return {
        name: float(
            np.float32(total)
            + np.sum(np.stack([host_value(metrics[name]) for metrics in step_metrics]), dtype=np.float32)
        )
        for name, total in sums.items()
    }


def _run_epoch(run: _Run, state, epoch: int, resumed_at: Position | None):
    """Trains one epoch (from `resumed_at` if given), tests, records, checkpoints."""
    config, steps = run.config, run.steps_per_epoch
    steps_done = resumed_at.steps_done if resumed_at else 0
    sums = resumed_at.epoch_sums if resumed_at else _zero_sums()
    start = time.perf_counter()
    batches, step_rngs = run.epoch_plan(run.epoch_key(epoch))
    progress = Progress(
        steps, f"epoch {epoch}/{config.epochs}", config.progress, config.batch_size, initial=steps_done
    )
    pending: list[dict[str, jax.Array]] = []
    for step in range(steps_done, steps):
        interrupts.stop_if_interrupted()
        state, metrics = run.train_step(
            state, run.device_data.train_images, run.device_data.train_labels, batches[step], step_rngs[step]
        )
        pending.append(metrics)
        progress.update(step + 1, metrics["loss"])
        global_step = (epoch - 1) * steps + step + 1
        if step + 1 < steps and run.is_check_step(global_step):
            sums, pending = _fold_sums(sums, pending), []
            run.guard.check(state)  # before any save: a stuck state never replaces a good checkpoint
            if run.checkpointer and config.checkpoint_every and global_step % config.checkpoint_every == 0:
                position = Position(epoch, step + 1, run.rng_key_data, sums)
                run.checkpointer.save(global_step, state, position, run.results)
    sums = _fold_sums(sums, pending)
    state = jax.block_until_ready(state)
    train_time = time.perf_counter() - start

    images = steps * config.batch_size
    previous = run.results["epochs"][-1] if run.results["epochs"] else {}
    record = {
        "epoch": epoch,
        "train_time_s": train_time,
        "train_loss": sums["loss"] / steps,
        "train_accuracy": sums["correct"] / images,
        "images_per_s": (steps - steps_done) * config.batch_size / train_time,
    }
    if epoch % config.eval_every == 0 or epoch == config.epochs:
        progress.describe(f"epoch {epoch}/{config.epochs}: testing")
        record.update(_evaluate(run.eval_step, state, run.device_data, config.steps_per_epoch))
    progress.close()
    record["loss_scale"] = float(host_value(state.loss_scale.loss_scale))
    record["skipped_steps"] = int(host_value(state.skipped_steps))
    skipped_line = skipped_steps_line(state, record["skipped_steps"] - previous.get("skipped_steps", 0))
    if skipped_line:
        record["last_skipped_step"] = skipped_line
    record["injected_nonfinite"] = previous.get("injected_nonfinite", 0) + int(sums["injected"])
    record["state_finite"] = state_finite(state)
    record["state_checksum"] = state_checksum(state)
    run.results["epochs"].append(record)
    run.log(format_epoch(record, config.epochs))
    if skipped_line:
        run.log(f"  {skipped_line}")
    interrupts.stop_if_interrupted()
    if config.out and run.data_parallel.is_main_process:
        write_json_atomically(config.out, run.results)
    run.guard.check(state)
    if run.checkpointer:
        if not record["state_finite"]:
            raise CheckpointError(
                f"The state after epoch {epoch} holds inf or NaN; it was not saved, and the last good "
                f"checkpoint in {config.checkpoint_dir} is kept."
            )
        position = Position(epoch + 1, 0, run.rng_key_data, _zero_sums())
        run.checkpointer.save(epoch * steps, state, position, run.results)
    return state


def _compile(config, dataset, state, device_data, steps_per_epoch, data_parallel):
    """Compiles the epoch plan, train and eval steps ahead of time, timing each.

    Everything a timed epoch runs is compiled here, so no compilation lands in
    the train or test times. Every input and output is replicated over the
    mesh; the train step shards its batch itself.
    """
    replicated = data_parallel.replicated

    def abstract(shape_dtype):
        return jax.ShapeDtypeStruct(shape_dtype.shape, shape_dtype.dtype, sharding=replicated)

    rng = abstract(jax.eval_shape(lambda: jax.random.key(0)))
    batch_indices = abstract(jax.ShapeDtypeStruct((config.batch_size,), jnp.int32))
    start = time.perf_counter()
    epoch_plan = (
        jax.jit(
            make_epoch_plan(device_data.num_train, config.batch_size, steps_per_epoch),
            out_shardings=replicated,
        )
        .lower(rng)
        .compile()
    )
    interrupts.stop_if_interrupted()  # between compiles: each takes seconds
    train_step = (
        jax.jit(make_train_step(config, dataset, data_parallel), donate_argnums=0, out_shardings=replicated)
        .lower(state, device_data.train_images, device_data.train_labels, batch_indices, rng)
        .compile()
    )
    train_compile = time.perf_counter() - start
    interrupts.stop_if_interrupted()
    start = time.perf_counter()
    eval_step = (
        jax.jit(make_eval_step(dataset), out_shardings=replicated)
        .lower(state, *device_data.test_batches[0])
        .compile()
    )
    eval_compile = time.perf_counter() - start
    compile_times = {"train_step": train_compile, "eval_step": eval_compile}
    return epoch_plan, train_step, eval_step, compile_times


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
        "test_loss": float(sum(host_value(total["loss"]) for total in totals)) / num_examples,
        "test_accuracy": float(sum(host_value(total["correct"]) for total in totals)) / num_examples,
    }
