"""A call split into array leaves and a hashable rest, NNX modules included.

`jaxamp.autocast` traces with the arrays abstract and everything else
static. NNX modules (and ``nnx.Rngs``) are split (``nnx.split``) into a
static graph and their state, whose arrays are traced like any other; the
state the call leaves behind (batch statistics, RNG counts) is written back
to the caller's modules afterwards, or it would be silently lost, and so
are the plain Python attributes the call changed (a counter, a flag), as
``nnx.jit`` does.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable
from typing import Any

import flax.errors
import jax
import numpy as np
from flax import nnx

_ARRAY = "array"  # placeholder for a traced leaf in the static key


# NNX objects that hold state: modules, and also ``nnx.Rngs`` (whose counts a
# call advances). Older Flax releases have no common base, only Module.
_NNX_STATEFUL = getattr(nnx, "Pytree", nnx.Module)


def _is_nnx_module(value: Any) -> bool:
    return isinstance(value, _NNX_STATEFUL)


def _is_array(value: Any) -> bool:
    return isinstance(value, (jax.Array, np.ndarray, np.generic))


@dataclasses.dataclass(frozen=True)
class _ModuleSlot:
    graphdef: Any
    state_tree: Any
    num_leaves: int
    # The dtype of each array of the state the module came in with, by key path.
    dtypes: tuple[tuple[str, Any], ...] = ()


@dataclasses.dataclass(frozen=True)
class LeafOrigin:
    """Where a traced leaf comes from.

    Attributes:
        path: its key path in ``(fun, args, kwargs)`` (for NNX state, the
            path of the module, then the state's own path).
        variable_type: the NNX ``Variable`` class holding it (``nnx.Param``,
            ``nnx.BatchStat``...), or None for a plain array.
    """

    path: tuple
    variable_type: type | None = None


@dataclasses.dataclass(frozen=True)
class SplitCall:
    """``fun(*args, **kwargs)`` as traced leaves plus a static description.

    Attributes:
        leaves: the arrays, NNX state included, in order.
        static_key: everything else, hashable when the static values are.
        modules: the caller's NNX modules, in the order of their slots.
        origins: per leaf, where it comes from (`LeafOrigin`).
    """

    leaves: tuple
    static_key: Hashable
    modules: tuple
    _call_tree: Any
    _slots: tuple
    origins: tuple = ()

    def run(self, *leaves) -> tuple[Any, list, list]:
        """Calls the function on `leaves`.

        Returns:
            Its outputs, the modules' new states, and per module the plain
            attributes the call changed, as ``(path, name, value)``.
        """
        leaf_iter = iter(leaves)
        merged_modules, rebuilt = [], []
        for slot in self._slots:
            if slot == _ARRAY:
                rebuilt.append(next(leaf_iter))
            elif isinstance(slot, _ModuleSlot):
                state = jax.tree.unflatten(slot.state_tree, [next(leaf_iter) for _ in range(slot.num_leaves)])
                module = nnx.merge(slot.graphdef, state)
                merged_modules.append(module)
                rebuilt.append(module)
            else:
                _, kind, value = slot
                rebuilt.append(float(value) if kind is float else value)
        fun, args, kwargs = jax.tree.unflatten(self._call_tree, rebuilt)
        before = [_plain_attributes(module) for module in merged_modules]
        outputs = fun(*args, **kwargs)
        changes = [
            _changed_attributes(old, _plain_attributes(module))
            for old, module in zip(before, merged_modules, strict=True)
        ]
        return outputs, [nnx.state(module) for module in merged_modules], changes

    def state_output_dtypes(self, states: list) -> list:
        """Per array leaf of the modules' `states` after the call, the dtype it came in with.

        State a module held before the call (a param, a batch statistic)
        comes back in its own dtype, whatever dtype it was traced with; state
        the call created (a sown value) is None: as traced.
        """
        slots = [slot for slot in self._slots if isinstance(slot, _ModuleSlot)]
        dtypes = []
        for slot, state in zip(slots, states, strict=True):
            before = dict(slot.dtypes)
            dtypes.extend(
                before.get(jax.tree_util.keystr(path))
                for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]
                if _is_array(leaf)
            )
        return dtypes

    def write_back(self, states: list, attribute_changes: list) -> None:
        """Updates each caller's module whose state or plain attributes the call changed."""
        for module, changes in zip(self.modules, attribute_changes, strict=True):
            if changes:
                submodules = dict(nnx.iter_modules(module))
                for path, name, value in changes:
                    _set_attribute(submodules[path], name, value)
        for module, state in zip(self.modules, states, strict=True):
            old_leaves = jax.tree.leaves(nnx.state(module))
            new_leaves = jax.tree.leaves(state)
            # Updating an unchanged module would still mutate its Variables,
            # which plain jax.jit rejects for a module closed over.
            if len(old_leaves) != len(new_leaves) or any(
                new is not old for new, old in zip(new_leaves, old_leaves)
            ):
                _update(module, state)


def _holds_state(value: Any) -> bool:
    """Whether `value` is or holds NNX state or arrays (which the state carries, not the graph)."""
    stateful = (nnx.Variable, _NNX_STATEFUL, jax.Array, np.ndarray)
    return any(
        isinstance(leaf, stateful)
        for leaf in jax.tree.leaves(value, is_leaf=lambda leaf: isinstance(leaf, stateful))
    )


def _plain_attributes(module: Any) -> dict[tuple, dict[str, Any]]:
    """Per submodule path, the attributes that are neither state nor modules (NNX's own left out)."""
    if not isinstance(module, nnx.Module):
        return {}
    return {
        path: {
            name: value
            for name, value in vars(submodule).items()
            if not name.startswith("_pytree__") and not _holds_state(value)
        }
        for path, submodule in nnx.iter_modules(module)
    }


def _changed_attributes(before: dict, after: dict) -> list[tuple]:
    """``(path, name, new value)`` of each plain attribute that differs, or is new, after the call."""
    changes = []
    for path, attributes in after.items():
        old = before.get(path, {})
        for name, value in attributes.items():
            if name not in old or not _same(old[name], value):
                changes.append((path, name, value))
    return changes


def _same(old: Any, new: Any) -> bool:
    if old is new:
        return True
    try:
        return bool(old == new)
    except Exception:  # noqa: BLE001 (a value whose == is no bool: count it as changed)
        return False


def _set_attribute(module: nnx.Module, name: str, value: Any) -> None:
    try:
        setattr(module, name, value)
    except flax.errors.TraceContextError as error:
        raise ValueError(
            f"autocast could not write the attribute {name!r} that the call changed back to the "
            f"{type(module).__name__} module: NNX forbids it for a module that a plain JAX transformation "
            "(jax.jit, jax.grad, make_jaxpr) closes over. Use nnx.jit / nnx.grad, or pass the module as "
            "an argument of the transformed function."
        ) from error


def _update(module: nnx.Module, state) -> None:
    try:
        nnx.update(module, state)
    except flax.errors.TraceContextError as error:
        raise ValueError(
            f"autocast could not write the changed state (batch statistics, RNG counts) back to the "
            f"{type(module).__name__} module: NNX forbids it for a module that a plain JAX transformation "
            "(jax.jit, jax.grad, make_jaxpr) closes over. Use nnx.jit / nnx.grad, or pass the module as "
            "an argument of the transformed function."
        ) from error


def split_call(fun: Callable[..., Any], args: tuple, kwargs: dict) -> SplitCall:
    """Splits ``fun(*args, **kwargs)`` into traced arrays and a static rest.

    Arrays are traced wherever they are, `fun` included (an Equinox module is
    a pytree of its arrays and static fields); NNX modules are split into
    their graph (static) and state (traced); anything else is static.
    """
    paths_and_leaves, call_tree = jax.tree_util.tree_flatten_with_path(
        (fun, args, kwargs), is_leaf=_is_nnx_module
    )
    traced, slots, modules, origins = [], [], [], []
    for path, leaf in paths_and_leaves:
        if _is_nnx_module(leaf):
            graphdef, state = nnx.split(leaf)
            state_with_paths, state_tree = jax.tree_util.tree_flatten_with_path(state)
            traced.extend(state_leaf for _, state_leaf in state_with_paths)
            origins.extend(_state_origins(path, state))
            dtypes = tuple(
                (jax.tree_util.keystr(state_path), leaf.dtype) for state_path, leaf in state_with_paths
            )
            slots.append(_ModuleSlot(graphdef, state_tree, len(state_with_paths), dtypes))
            modules.append(leaf)
        elif _is_array(leaf):
            traced.append(leaf)
            origins.append(LeafOrigin(path))
            slots.append(_ARRAY)
        else:
            # The type too: 1, 1.0 and True are equal keys but trace differently.
            # A float by its repr, which round-trips: 0.0 == -0.0 though 1 / x
            # differs, and nan != nan would miss the cache on every call.
            value = repr(leaf) if type(leaf) is float else leaf
            slots.append(("static", type(leaf), value))
    slots = tuple(slots)
    return SplitCall(tuple(traced), (call_tree, slots), tuple(modules), call_tree, slots, tuple(origins))


def _state_origins(module_path: tuple, state: Any) -> list[LeafOrigin]:
    """A `LeafOrigin` per array leaf of an NNX module's `state`, in ``jax.tree.flatten`` order."""
    origins = []
    variables = jax.tree_util.tree_flatten_with_path(
        state, is_leaf=lambda leaf: isinstance(leaf, nnx.Variable)
    )
    for path, variable in variables[0]:
        variable_type = type(variable) if isinstance(variable, nnx.Variable) else None
        count = len(jax.tree.leaves(variable))
        origins.extend([LeafOrigin((*module_path, *path), variable_type)] * count)
    return origins
