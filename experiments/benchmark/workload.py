"""One model x precision, compiled: the train and eval steps the sections time.

Built only from the training recipe's public pieces
(`experiments.train.create_train_state`, `make_train_step`,
`make_eval_step`), so the benchmark times exactly the step
``python -m experiments.cifar`` trains with: the batch is gathered,
augmented and normalized on the device inside the step.

A policy reaches the model by one of two routes (`ROUTES`): the recipe's
``apply_policy`` (params cast where they are created, the model's ``apply``
run through `jaxamp.autocast`, normalization layers in their policy scope)
or ``autocast`` (the plain float32 model's ``apply`` rewritten primitive by
primitive). Both train the same params with the same loss scale in the
same step; that they compile to the same memory is what the benchmark's
``targets`` section shows.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import jaxamp
from experiments import data as data_lib
from experiments import train
from experiments.benchmark import roofline
from experiments.models import create_model
from jaxamp.diagnostics import hlo_precision_report

ROUTES = ("apply_policy", "autocast")


@dataclasses.dataclass
class DeviceSet:
    """Synthetic CIFAR-shaped data on the device (uint8 images, int32 labels)."""

    dataset: data_lib.Dataset
    images: jax.Array
    labels: jax.Array


def device_set(num_train: int, seed: int = 0) -> DeviceSet:
    """`num_train` random CIFAR-shaped examples, copied to the device once."""
    dataset = data_lib.synthetic_dataset(num_train=num_train, num_test=1, seed=seed)
    return DeviceSet(dataset, jax.device_put(dataset.train_images), jax.device_put(dataset.train_labels))


def train_config(model: str, precision: str, batch_size: int) -> train.TrainConfig:
    return train.TrainConfig(
        model=model, precision=precision, batch_size=batch_size, data="synthetic", epochs=1
    )


def abstract_train_state(
    config: train.TrainConfig, steps_per_epoch: int, num_classes: int = 10, route: str = "apply_policy"
) -> Any:
    """The train state's shapes and dtypes, without computing it, its model applied by `route`."""
    precision = train.resolve_precision(config.precision)
    state = jax.eval_shape(lambda: train.create_train_state(config, precision, num_classes, steps_per_epoch))
    return apply_route(state, config.model, precision.policy, route, num_classes)


def apply_route(state: Any, model: str, policy: jaxamp.Policy, route: str, num_classes: int = 10) -> Any:
    """`state` with its model applied by `route` (one of `ROUTES`).

    ``apply_policy`` returns the recipe's state unchanged. ``autocast``
    replaces its ``apply_fn`` with ``jaxamp.autocast(plain_model.apply,
    policy)``: the params are the same (``apply_policy`` adds no variables
    and keeps them in the policy's float32 param dtype), and so are the
    optimizer and the policy's loss scale.

    Raises:
        ValueError: `route` is not one of `ROUTES`.
    """
    if route == "apply_policy":
        return state
    if route == "autocast":
        plain_model = create_model(model, num_classes)
        return state.replace(apply_fn=jaxamp.autocast(plain_model.apply, policy))
    raise ValueError(
        f"Unknown route {route!r}; choose one of {', '.join(ROUTES)} (how the policy reaches the model)."
    )


def routes_for(precision_name: str, routes: tuple[str, ...] = ROUTES) -> tuple[str, ...]:
    """The routes of `routes` that `precision_name` is compiled by.

    A float32 precision by the recipe's route only (a float32 policy changes
    nothing, so the routes would compile the same program); a half or FP8
    precision by every route in `routes`.
    """
    if is_fp8_precision(precision_name) or is_half_precision(precision_name):
        return routes
    return ("apply_policy",)


def is_fp8_precision(precision_name: str) -> bool:
    """Whether `precision_name`'s policy runs its matmuls in FP8 (``mixed_float8``)."""
    return train.resolve_precision(precision_name).policy.fp8_matmuls


def is_half_precision(precision_name: str) -> bool:
    """Whether `precision_name`'s policy computes in float16 or bfloat16 (where the routes differ)."""
    return compute_dtype_name(precision_name) in ("float16", "bfloat16")


@dataclasses.dataclass
class Workload:
    """A compiled train and eval step of one model x precision, ready to time.

    Attributes:
        model, precision, batch_size: what it is.
        train_compiled, eval_compiled: the compiled executables.
        compile_seconds: ``{"train": s, "eval": s}``, lowering included.
        state: the train state (donated and replaced by each train step).
        train_inputs: per-step arguments after the state (images, labels,
            batch indices, rng), cycled by the timing loop.
        eval_inputs: the eval step's arguments after the state.
    """

    model: str
    precision: str
    batch_size: int
    train_compiled: Any
    eval_compiled: Any
    compile_seconds: dict[str, float]
    state: Any
    train_inputs: list[tuple]
    eval_inputs: tuple

    def train_step(self):
        """Runs one train step; returns its metrics."""
        batch = self.train_inputs[self._calls % len(self.train_inputs)]
        self._calls += 1
        self.state, metrics = self.train_compiled(self.state, *batch)
        return metrics

    def eval_step(self):
        """Runs one eval step on a batch; returns its summed metrics."""
        return self.eval_compiled(self.state, *self.eval_inputs)

    def __post_init__(self):
        self._calls = 0

    def step_cost(self) -> dict[str, Any]:
        """FLOPs, bytes and heavy-op FLOPs by dtype of one compiled train step."""
        cost = roofline.cost_of(self.train_compiled)
        report = hlo_precision_report(self.train_compiled.as_text())
        return {
            "flops": cost.get("flops", float(sum(report.flops_by_dtype().values()))),
            "bytes_accessed": cost.get("bytes accessed"),
            "heavy_flops_by_dtype": report.flops_by_dtype(),
            "heavy_ops_by_dtype": report.count_by_dtype(),
        }


def build(model: str, precision_name: str, batch_size: int, data: DeviceSet, steps: int = 4) -> Workload:
    """Compiles the train and eval steps of `model` under `precision_name`.

    Args:
        model: a name of `experiments.models.MODELS`.
        precision_name: ``fp32``, ``tf32`` or a jaxamp policy name.
        batch_size: images per step, train and eval.
        data: the device-resident data set to gather batches from.
        steps: distinct batches (index rows and rngs) to cycle through.
    """
    config = train_config(model, precision_name, batch_size)
    precision = train.resolve_precision(precision_name)
    num_train = int(data.images.shape[0])
    steps_per_epoch = max(1, num_train // batch_size)
    state = train.create_train_state(config, precision, data.dataset.num_classes, steps_per_epoch)
    indices = data_lib.epoch_batches(jax.random.key(1), num_train, batch_size)
    train_inputs = [
        (data.images, data.labels, indices[step % indices.shape[0]], jax.random.key(100 + step))
        for step in range(steps)
    ]
    eval_inputs = (
        data.images[:batch_size],
        data.labels[:batch_size],
        jnp.ones((batch_size,), bool),
    )
    compile_seconds = {}
    with precision.context():
        start = time.perf_counter()
        train_compiled = (
            jax.jit(train.make_train_step(config, data.dataset), donate_argnums=0)
            .lower(state, *train_inputs[0])
            .compile()
        )
        compile_seconds["train"] = time.perf_counter() - start
        start = time.perf_counter()
        eval_compiled = jax.jit(train.make_eval_step(data.dataset)).lower(state, *eval_inputs).compile()
        compile_seconds["eval"] = time.perf_counter() - start
    return Workload(
        model,
        precision_name,
        batch_size,
        train_compiled,
        eval_compiled,
        compile_seconds,
        state,
        train_inputs,
        eval_inputs,
    )


def memory_of(compiled: Any) -> dict[str, int]:
    """Temp, argument and output bytes of a compiled executable, and their sum."""
    stats = compiled.memory_analysis()
    memory = {
        "temp_bytes": int(stats.temp_size_in_bytes),
        "argument_bytes": int(stats.argument_size_in_bytes),
        "output_bytes": int(stats.output_size_in_bytes),
        "alias_bytes": int(stats.alias_size_in_bytes),
    }
    memory["total_bytes"] = memory["temp_bytes"] + memory["argument_bytes"] + memory["output_bytes"]
    return memory


def peak_bytes_in_use() -> int | None:
    """The device's peak bytes in use so far in this process (GPUs); None on CPU."""
    stats = jax.devices()[0].memory_stats()
    return int(stats["peak_bytes_in_use"]) if stats and "peak_bytes_in_use" in stats else None


def compute_dtype_name(precision_name: str) -> str:
    return np.dtype(train.resolve_precision(precision_name).policy.compute_dtype).name
