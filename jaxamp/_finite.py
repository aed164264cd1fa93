"""Finiteness checks and functional selection between pytrees.

These are the two halves of a skipped step: `all_finite` decides, and
`select_tree` keeps the old state where the decision says so, without leaving
traced code (no ``if``, no host sync).
"""

from __future__ import annotations

from typing import TypeVar

import jax
import jax.numpy as jnp
import numpy as np

T = TypeVar("T")


def leaf_finite_flags(tree) -> jax.Array:
    """One bool per leaf of `tree` (``jax.tree.leaves`` order): whether all its values are finite.

    Integer, bool and non-array leaves are finite by definition. These are the
    per-leaf reductions `all_finite` combines, and the ones
    `jaxamp.diagnostics.NonFiniteGradients` keeps, so XLA computes each once.
    """
    flags = [
        jnp.all(jnp.isfinite(leaf))
        if isinstance(leaf, (jax.Array, np.ndarray, np.generic)) and jnp.issubdtype(leaf.dtype, jnp.inexact)
        else jnp.array(True)
        for leaf in jax.tree.leaves(tree)
    ]
    return jnp.stack(flags) if flags else jnp.zeros([0], bool)


def every(flags: jax.Array) -> jax.Array:
    """Whether every element of the bool vector `flags` is true (True when it is empty).

    Counted as the number of false flags, an integer reduction, so that XLA
    computes it once. A reduction of booleans over a few dozen per-leaf flags
    XLA rewrites into a chain of scalar ``and``s, cheap enough that it copies
    the chain into every kernel that reads the result; a skipped step selects
    every leaf of the params and the optimizer state on it, so the copies'
    compile time would grow with the leaves times the selections.
    """
    return jnp.sum(~flags, dtype=jnp.int32) == 0


def all_finite(tree) -> jax.Array:
    """Returns whether every floating-point value in `tree` is finite.

    Integer and bool leaves are finite by definition and are skipped; so are
    non-array leaves. Each leaf is reduced on its own (`leaf_finite_flags`)
    and the per-leaf flags are combined, which XLA fuses with whatever
    produced the leaves.

    Args:
        tree: a pytree of arrays (gradients, usually).

    Returns:
        A scalar bool array; ``True`` for a tree with no floating leaves.
    """
    return every(leaf_finite_flags(tree))


def select_tree(pred: jax.Array, on_true: T, on_false: T) -> T:
    """Picks `on_true` or `on_false` leaf by leaf, with ``jnp.where``.

    Args:
        pred: a scalar bool (array).
        on_true: the tree returned where `pred` is true.
        on_false: a tree of the same structure, returned where it is false.

    Returns:
        A tree of that structure; each leaf has the dtype of `on_true`'s leaf.

    Raises:
        ValueError: `pred` is not a scalar, or the trees differ in structure.
    """
    pred = jnp.asarray(pred)
    if pred.shape != ():
        raise ValueError(f"select_tree needs a scalar predicate; got shape {pred.shape}.")
    true_structure = jax.tree.structure(on_true)
    false_structure = jax.tree.structure(on_false)
    if true_structure != false_structure:
        raise ValueError(
            "select_tree needs two trees of the same structure; got\n"
            f"  on_true:  {true_structure}\n  on_false: {false_structure}"
        )
    return jax.tree.map(
        lambda when_true, when_false: jnp.where(pred, when_true, when_false).astype(
            jnp.result_type(when_true)
        ),
        on_true,
        on_false,
    )
