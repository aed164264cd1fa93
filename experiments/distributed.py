"""Data parallel training on JAX's own machinery: one mesh, one `data` axis.

One process or many, the experiment sees one thing: a `jax.sharding.Mesh`
over every device of every process, with a single axis named ``data``. The
global batch is sharded along it; params, optimizer state, batch statistics
and the loss scale are replicated. The train step is an ordinary
``jax.jit`` over those global arrays, so XLA inserts the gradient all-reduce,
BatchNorm computes its statistics over the global batch, and the finite check
of `jaxamp.all_finite` reduces over the global gradients: a step overflowed
on one device is skipped on all.

Processes join with `initialize` before anything else touches JAX
(``jax.distributed.initialize``; on CPU with the gloo collectives). Every
process then builds the same arrays from the same seed; `replicate` turns
host values into global arrays and `host_value` reads them back on any
process.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

DATA_AXIS = "data"


class DistributedSetupError(RuntimeError):
    """The processes could not join, or the batch does not split over the devices."""


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    from_cluster_environment: bool = False,
) -> None:
    """Joins this process to a multi-process run, or does nothing for one process.

    Must run before anything else initialises JAX's backends.

    Args:
        coordinator_address: ``HOST:PORT`` of process 0's coordinator.
        num_processes: how many processes take part.
        process_id: this process's index in ``0..num_processes - 1``.
        from_cluster_environment: let ``jax.distributed.initialize()`` read
            the three settings from the cluster environment (SLURM, Open MPI,
            Kubernetes, ...) instead.

    Raises:
        DistributedSetupError: only some of the three settings were given, or
            the coordinator could not be reached.
    """
    settings = {
        "--coordinator-address": coordinator_address,
        "--num-processes": num_processes,
        "--process-id": process_id,
    }
    given = [flag for flag, value in settings.items() if value is not None]
    if not given and not from_cluster_environment:
        return
    if given and len(given) < len(settings):
        missing = [flag for flag in settings if flag not in given]
        raise DistributedSetupError(
            f"A multi-process run needs all of --coordinator-address, --num-processes and "
            f"--process-id; {', '.join(missing)} missing. Give all three, or none for one process."
        )
    if given and not 0 <= process_id < num_processes:
        raise DistributedSetupError(
            f"--process-id {process_id} must lie in 0..{num_processes - 1} "
            f"for --num-processes {num_processes}."
        )
    _use_gloo_for_cpu_collectives()
    try:
        jax.distributed.initialize(
            coordinator_address=coordinator_address,
            num_processes=num_processes,
            process_id=process_id,
        )
    except (RuntimeError, ValueError) as error:
        where = coordinator_address or "the cluster environment"
        raise DistributedSetupError(
            f"Could not join the multi-process run through {where}: {error}. Check that every "
            "process got the same --coordinator-address and --num-processes, that process 0 "
            "runs, and that the port is free."
        ) from error


def _use_gloo_for_cpu_collectives() -> None:
    """CPU processes exchange gradients through gloo (GPUs use NCCL regardless).

    JAX 0.10 needs the option set; should a later JAX drop it, it chooses
    its CPU collectives itself, and the run goes on.
    """
    try:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    except (AttributeError, KeyError, ValueError):
        pass


@dataclasses.dataclass(frozen=True)
class DataParallel:
    """A mesh over all devices of all processes, with one ``data`` axis.

    Attributes:
        mesh: the mesh.
        replicated: the sharding of every state array (a full copy per device).
        batch_sharded: the sharding of a batch: split along its first axis.
    """

    mesh: Mesh

    @classmethod
    def over_all_devices(cls) -> DataParallel:
        return cls(Mesh(np.array(jax.devices()), (DATA_AXIS,)))

    @property
    def device_count(self) -> int:
        return self.mesh.devices.size

    @property
    def process_count(self) -> int:
        return jax.process_count()

    @property
    def is_main_process(self) -> bool:
        """Whether this process writes results and logs (process 0)."""
        return jax.process_index() == 0

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec())

    def batch_sharded(self, leading_unsharded_axes: int = 0) -> NamedSharding:
        """Shards the batch axis; `leading_unsharded_axes` axes come before it."""
        return NamedSharding(self.mesh, PartitionSpec(*([None] * leading_unsharded_axes), DATA_AXIS))

    def replicate(self, tree: Any) -> Any:
        """Copies every array of `tree` (the same on every process) to every device."""
        sharding = self.replicated

        def to_global(leaf):
            if not isinstance(leaf, (jax.Array, np.ndarray, np.generic)):
                return leaf
            if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
                data = np.asarray(jax.random.key_data(leaf))
                return jax.random.wrap_key_data(to_global(data), impl=jax.random.key_impl(leaf))
            host = np.asarray(leaf)
            return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

        return jax.tree.map(to_global, tree)

    def check_batch_size(self, batch_size: int, grad_accum: int = 1) -> None:
        """Raises unless each micro-batch splits evenly over the devices.

        Raises:
            DistributedSetupError: naming the batch, the micro-batch and the
                device and process counts.
        """
        if batch_size % grad_accum:
            raise DistributedSetupError(
                f"--batch-size {batch_size} is not divisible by --grad-accum {grad_accum}; "
                "the global batch is grad_accum micro-batches of equal size."
            )
        micro_batch = batch_size // grad_accum
        if micro_batch % self.device_count:
            suggestion = self.device_count * grad_accum * -(-micro_batch // self.device_count)
            split = f" ({grad_accum} micro-batches of {micro_batch})" if grad_accum > 1 else ""
            raise DistributedSetupError(
                f"--batch-size {batch_size}{split} does not split over {self.device_count} devices "
                f"in {self.process_count} process(es); choose a batch size whose micro-batch is a "
                f"multiple of {self.device_count}, e.g. {suggestion}."
            )


def host_value(array: Any) -> np.ndarray:
    """The whole value of `array` on this host, on any process.

    Replicated arrays are read from a local copy (no communication); sharded
    ones are gathered from every process.
    """
    if isinstance(array, jax.Array) and not array.is_fully_addressable:
        if array.is_fully_replicated:
            return np.asarray(array.addressable_data(0))
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(array, tiled=True))
    return np.asarray(array)
