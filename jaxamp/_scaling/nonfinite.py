"""Which gradient leaves were not finite when a step was skipped.

A skipped step says more than "skipped" if the optimizer state keeps, next to
the loss scale's counters, one bool per parameter leaf: whether that leaf's
gradient held an inf or a NaN in the last skipped step. `jaxamp.loss_scaling`
and `jaxamp.TrainState` keep a `NonFiniteGradients` record and update it in
every step:

```python
leaf_finite = [all(isfinite(g)) for g in leaves(grads)]   # the flags all_finite reduces
steps_taken += 1
if not grads_finite:                                      # this step is skipped
    nonfinite = not leaf_finite                           # one bool per leaf
    skipped_at = steps_taken - 1                          # the step's index, from 0
```

The per-leaf reductions are those `jaxamp.all_finite` computes before it
combines them (`jaxamp._finite.leaf_finite_flags`; XLA computes each once),
the record is a few bytes per leaf, and nothing leaves the device in the
step. On the host, `nonfinite_paths`
and `summary` name the leaves by their paths in the params
(``encoder/layers_3/mlp/Dense_1/kernel``). The paths are static metadata of
the record (part of its tree structure, fixed when the params are), so a
checkpoint holds only the arrays and a restored run reads the same record.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

_NEVER = -1
_NUMBERED = re.compile(r"(.*?)(\d+)")


def leaf_path(path: tuple) -> str:
    """A pytree key path as ``"/"``-separated names: ``encoder/layers_3/kernel``."""
    names = []
    for key in path:
        for attribute in ("key", "name", "idx"):
            if hasattr(key, attribute):
                names.append(str(getattr(key, attribute)))
                break
        else:
            names.append(str(key))
    return "/".join(names)


def leaf_paths(tree: Any) -> tuple[str, ...]:
    """The `leaf_path` of each leaf of `tree`, in ``jax.tree.leaves`` order; an NNX variable's value
    is named by the variable's path (``head/kernel``, not ``head/kernel/value``)."""
    paths = []
    for path, node in jax.tree_util.tree_leaves_with_path(tree, is_leaf=_is_nnx_variable):
        inner = jax.tree_util.tree_leaves_with_path(node) if _is_nnx_variable(node) else [((), node)]
        paths.extend(leaf_path(path if len(inner) == 1 else (*path, *inner_path)) for inner_path, _ in inner)
    return tuple(paths)


def _is_nnx_variable(node: Any) -> bool:
    return isinstance(node, nnx.Variable)


@struct.dataclass
class NonFiniteGradients:
    """Which gradient leaves were not finite in the last skipped step, and when.

    Created by `for_params`; updated in the step by `after_step` (jit-safe);
    read on the host by `nonfinite_paths`, `deepest_layers` and `summary`.

    Attributes:
        nonfinite: bool, one per parameter leaf (``jax.tree.leaves`` order):
            whether its gradient held an inf or a NaN in the last skipped
            step; all False until a step is skipped.
        skipped_at: int32, the index (from 0, applied and skipped steps
            alike) of the last skipped step; -1 until a step is skipped.
        steps_taken: int32, steps seen so far, applied and skipped.
        paths: the leaves' paths in the params (static metadata).
    """

    nonfinite: jax.Array
    skipped_at: jax.Array
    steps_taken: jax.Array
    paths: tuple[str, ...] = struct.field(pytree_node=False)

    @classmethod
    def for_params(cls, params: Any) -> NonFiniteGradients:
        """A record for gradients with the structure of `params`, no step seen yet."""
        paths = leaf_paths(params)
        return cls(
            nonfinite=jnp.zeros([len(paths)], bool),
            skipped_at=jnp.full([], _NEVER, jnp.int32),
            steps_taken=jnp.zeros([], jnp.int32),
            paths=paths,
        )

    def after_step(self, leaf_finite: jax.Array, grads_finite: jax.Array) -> NonFiniteGradients:
        """The record after one step: rewritten where the step is skipped (jit-safe, no host sync).

        Args:
            leaf_finite: bool, one per leaf of the grads: whether it is finite.
            grads_finite: scalar bool: whether the step's update is applied.

        Raises:
            ValueError: `leaf_finite` does not have one flag per leaf of the
                params the record was made for.
        """
        if leaf_finite.shape != self.nonfinite.shape:
            raise ValueError(
                f"The gradients have {leaf_finite.shape[0]} leaves, but the optimizer state was made for "
                f"params with {len(self.paths)} ({', '.join(self.paths[:3])}, ...). Pass gradients with "
                "the structure of the params the state was initialized with."
            )
        skipped = jnp.logical_not(grads_finite)
        return self.replace(
            nonfinite=jnp.where(skipped, jnp.logical_not(leaf_finite), self.nonfinite),
            skipped_at=jnp.where(skipped, self.steps_taken, self.skipped_at),
            steps_taken=self.steps_taken + 1,
        )

    def nonfinite_paths(self) -> list[str]:
        """The paths of the leaves whose gradients were not finite in the last skipped step (host)."""
        flags = np.asarray(host_value(self.nonfinite))
        return [path for path, flag in zip(self.paths, flags, strict=True) if flag]

    def deepest_layers(self) -> list[str]:
        """Where the last skipped step's non-finite gradients start: `deepest_layers` of its leaves (host)."""
        return deepest_layers(self.nonfinite_paths())

    def summary(self, limit: int = 4, cause: str | None = None) -> str:
        """One line: the last skipped step (counted from 1) and the first `limit` leaves it found
        non-finite (host).

        Args:
            limit: how many leaves to name.
            cause: what overflowed first, put before the leaves (the
                `jaxamp.diagnostics.FirstOverflow` of the step's record, as text).

        Examples:
            >>> state.nonfinite_grads.summary()
            'step 12 skipped: non-finite grads in 3 of 8 leaves: Dense_0/bias, Dense_0/kernel, ...'
        """
        if int(host_value(self.skipped_at)) == _NEVER:
            return "no step skipped"
        skipped = f"step {int(host_value(self.skipped_at)) + 1} skipped: " + (f"{cause}; " if cause else "")
        paths = self.nonfinite_paths()
        if not paths:
            return skipped + "every gradient leaf finite (the step was skipped for another reason)"
        shown = ", ".join(paths[:limit]) + (", ..." if len(paths) > limit else "")
        return skipped + f"non-finite grads in {len(paths)} of {len(self.paths)} leaves: {shown}"


def layer_of(path: str) -> str:
    """The layer a leaf belongs to: its path without the leaf's own name (a top-level leaf is its own)."""
    return path.rpartition("/")[0] or path


def _name_key(name: str) -> tuple[str, int]:
    """A name as its stem and trailing number (``Dense_10``: ``("Dense_", 10)``; -1 without one)."""
    numbered = _NUMBERED.fullmatch(name)
    return (numbered[1], int(numbered[2])) if numbered else (name, -1)


def _runs_later(layer: str, other: str) -> bool:
    """Whether the names say that `layer` was made, so runs, after `other`: at the first name where
    they differ, one stem with a larger number."""
    for name, other_name in zip(layer.split("/"), other.split("/")):
        if name != other_name:
            (stem, number), (other_stem, other_number) = _name_key(name), _name_key(other_name)
            return stem == other_stem and number > other_number >= 0
    return False


def layer_order_key(layer: str) -> tuple[tuple[str, int], ...]:
    """A sort key that puts layers in the order their names give (``Dense_9`` before ``Dense_10``)."""
    return tuple(_name_key(name) for name in layer.split("/"))


def deepest_layers(nonfinite_paths: Sequence[str]) -> list[str]:
    """The layers with a non-finite gradient leaf after which no such layer runs, by name.

    One layer when the names tell (see the module docstring); several, in
    name order, when they do not; none when no leaf is given.

    Examples:
        >>> deepest_layers(["Dense_0/kernel", "Dense_10/bias", "Dense_9/kernel"])
        ['Dense_10']
        >>> deepest_layers(["Conv_0/kernel", "Dense_0/kernel"])
        ['Conv_0', 'Dense_0']
    """
    layers = sorted({layer_of(path) for path in nonfinite_paths}, key=layer_order_key)
    return [layer for layer in layers if not any(_runs_later(other, layer) for other in layers)]


def host_value(value: Any) -> np.ndarray:
    """A value on this host, also for an array replicated across processes."""
    if isinstance(value, jax.Array) and not value.is_fully_addressable:
        return np.asarray(value.addressable_data(0))
    return np.asarray(value)
