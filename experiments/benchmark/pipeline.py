"""The input pipeline's share of a train step.

The train step gathers its batch from the device-resident uint8 data set,
crops, flips and normalizes it (`experiments.data.augment`,
`experiments.data.normalize`) before the model runs. This section jits that
pipeline alone and times it interleaved with the whole train step; the
share is ``pipeline / train step``. Alone, the pipeline writes its batch to
memory and pays its own dispatch, which inside the step XLA may fuse away:
the share is an upper estimate.
"""

from __future__ import annotations

import jax

from experiments import data as data_lib
from experiments.benchmark import timing
from experiments.benchmark.workload import DeviceSet, Workload


def measure(workload: Workload, data: DeviceSet, rounds: int, steps: int) -> dict[str, float]:
    """Median ms of the pipeline and of the train step, and the share."""
    mean, std = data.dataset.mean, data.dataset.std

    @jax.jit
    def pipeline(images, batch_indices, rng):
        return data_lib.normalize(data_lib.augment(rng, images[batch_indices]), mean, std)

    batches = [(images, indices, rng) for images, _, indices, rng in workload.train_inputs]
    calls = iter(range(10**9))

    def pipeline_step():
        return pipeline(*batches[next(calls) % len(batches)])

    medians = timing.interleaved_medians(
        {"pipeline": pipeline_step, "train_step": workload.train_step}, rounds, steps
    )
    return {
        "model": workload.model,
        "precision": workload.precision,
        "pipeline_ms": 1e3 * medians["pipeline"],
        "train_step_ms": 1e3 * medians["train_step"],
        "share": medians["pipeline"] / medians["train_step"],
    }
