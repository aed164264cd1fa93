"""FSDP-style sharding: parameters and optimizer state split over the devices.

One mesh over every device of every process, with the one ``data`` axis of
`experiments.distributed`. Each array of the train state of ``fsdp``
sharding is split along its largest axis that the device count divides
(`leaf_spec`), and replicated when none does (biases of odd size, scalars
such as the loss scale and step counter). The global batch is split along
the same axis. The train step stays an ordinary ``jax.jit``; XLA gathers the
parameters each step needs and reduce-scatters their gradients.
``replicated`` sharding keeps a full copy of the state on every device
(plain data parallelism), for comparison.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from experiments.distributed import DATA_AXIS, DistributedSetupError


def leaf_spec(shape: tuple[int, ...], device_count: int) -> PartitionSpec:
    """The partition of one state array: its largest axis the devices divide, else none."""
    candidates = [
        axis for axis, size in enumerate(shape) if size % device_count == 0 and size >= device_count
    ]
    if device_count == 1 or not candidates:
        return PartitionSpec()
    axis = max(candidates, key=lambda index: (shape[index], -index))
    return PartitionSpec(*([None] * axis), DATA_AXIS)


@dataclasses.dataclass(frozen=True)
class Sharding:
    """Where the state and the batches of a run live.

    Attributes:
        mesh: all devices, one ``data`` axis.
        fsdp: split the state (True) or replicate it (False).
    """

    mesh: Mesh
    fsdp: bool

    @classmethod
    def over_all_devices(cls, kind: str = "fsdp") -> Sharding:
        return cls.over_devices(jax.devices(), kind)

    @classmethod
    def over_devices(cls, devices, kind: str = "fsdp") -> Sharding:
        """A mesh over `devices` (e.g. one device, to compare with a sharded run)."""
        return cls(Mesh(np.array(devices), (DATA_AXIS,)), fsdp=kind == "fsdp")

    @property
    def device_count(self) -> int:
        return self.mesh.devices.size

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec())

    @property
    def batch(self) -> NamedSharding:
        """Token windows [B, T]: rows split over the devices."""
        return NamedSharding(self.mesh, PartitionSpec(DATA_AXIS, None))

    def state(self, abstract_state: Any) -> Any:
        """The sharding of every leaf of a state (of `jax.eval_shape`'s output)."""

        def sharding_of(leaf):
            shape = getattr(leaf, "shape", ())
            if not self.fsdp:
                return self.replicated
            return NamedSharding(self.mesh, leaf_spec(tuple(shape), self.device_count))

        return jax.tree.map(sharding_of, abstract_state)

    def check_batch_size(self, batch_size: int) -> None:
        """Raises unless the batch splits evenly over devices and processes.

        Raises:
            DistributedSetupError: naming the batch and the device count.
        """
        if batch_size % self.device_count:
            suggestion = self.device_count * -(-batch_size // self.device_count)
            raise DistributedSetupError(
                f"--batch-size {batch_size} does not split over {self.device_count} devices in "
                f"{jax.process_count()} process(es); choose a multiple of {self.device_count}, "
                f"e.g. {suggestion}."
            )

    def process_rows(self, batch_size: int) -> slice:
        """The rows of a global batch that this process holds."""
        local = batch_size // jax.process_count()
        start = jax.process_index() * local
        return slice(start, start + local)

    def global_batch(self, local_rows: np.ndarray, batch_size: int) -> jax.Array:
        """This process's rows as its share of the global, row-sharded batch."""
        global_shape = (batch_size, *local_rows.shape[1:])
        return jax.make_array_from_process_local_data(self.batch, local_rows, global_shape)
