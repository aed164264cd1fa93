"""Tests for `jaxamp.all_finite` and `jaxamp.select_tree`."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxamp

INF, NAN = float("inf"), float("nan")


def grads(poison=None, dtype=jnp.float32):
    """A small gradient tree of mixed dtypes; `poison` lands in one float leaf."""
    tree = {
        "dense": {"kernel": jnp.ones((2, 3), jnp.float32), "bias": jnp.zeros(3, jnp.bfloat16)},
        "embed": jnp.full((4,), 0.5, jnp.float16),
        "numpy": np.ones(2, np.float32),
        "count": jnp.array(2**31 - 1, jnp.int32),
        "mask": jnp.array([True, False]),
    }
    if poison is not None:
        tree["target"] = jnp.array([1.0, poison, 2.0], dtype)
    return tree


@pytest.mark.parametrize("tree", [{}, [], (), None, {"a": None}], ids=repr)
def test_a_tree_without_leaves_is_finite(tree):
    result = jaxamp.all_finite(tree)
    assert isinstance(result, jax.Array)
    assert (result.shape, result.dtype, bool(result)) == ((), jnp.bool_, True)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32], ids=lambda dtype: dtype.__name__)
@pytest.mark.parametrize("poison", [INF, -INF, NAN, 1.0], ids=["inf", "-inf", "nan", "finite"])
def test_one_non_finite_value_in_any_float_dtype_makes_the_tree_non_finite(poison, dtype, jit):
    check = jax.jit(jaxamp.all_finite) if jit else jaxamp.all_finite
    result = check(grads(poison, dtype))
    assert (result.shape, result.dtype) == ((), jnp.bool_)
    assert bool(result) == np.isfinite(poison)


@pytest.mark.parametrize("poison", [INF, NAN])
def test_a_numpy_leaf_is_checked_too(poison):
    assert not jaxamp.all_finite({"ok": jnp.ones(2), "numpy": np.array([poison], np.float32)})


def test_integer_bool_and_python_leaves_are_ignored():
    tree = {
        "max_int": jnp.array([np.iinfo(np.int32).max]),
        "flags": jnp.array([True, False]),
        "python": 3,
        "numpy_int": np.int64(-1),
    }
    assert jaxamp.all_finite(tree)
    assert jaxamp.all_finite({**tree, "x": jnp.ones(2)})
    assert not jaxamp.all_finite({**tree, "x": jnp.array([0.0, NAN])})


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("pred", [True, False])
def test_select_tree_picks_a_whole_tree_and_keeps_every_dtype(pred, jit):
    on_true = grads(2.0)
    on_false = jax.tree.map(lambda leaf: leaf + 1 if leaf.dtype != jnp.bool_ else ~leaf, on_true)
    select = jax.jit(jaxamp.select_tree) if jit else jaxamp.select_tree
    chosen = select(jnp.asarray(pred), on_true, on_false)
    expected = on_true if pred else on_false
    assert jax.tree.structure(chosen) == jax.tree.structure(expected)
    for got, want in zip(jax.tree.leaves(chosen), jax.tree.leaves(expected), strict=True):
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(got, want)


def test_select_tree_with_a_traced_predicate_selects_per_call():
    @jax.jit
    def keep_old_unless_finite(new, old):
        return jaxamp.select_tree(jaxamp.all_finite(new), new, old)

    old = {"w": jnp.zeros(3, jnp.float16), "step": jnp.array(4, jnp.int32)}
    finite_new = {"w": jnp.ones(3, jnp.float16), "step": jnp.array(5, jnp.int32)}
    overflowed_new = {"w": jnp.array([1.0, INF, 1.0], jnp.float16), "step": jnp.array(5, jnp.int32)}
    chosen = keep_old_unless_finite(finite_new, old)
    np.testing.assert_array_equal(chosen["w"], finite_new["w"])
    assert chosen["step"] == 5
    chosen = keep_old_unless_finite(overflowed_new, old)
    np.testing.assert_array_equal(chosen["w"], old["w"])
    assert chosen["step"] == 4


def test_select_tree_does_not_propagate_nan_from_the_branch_not_taken():
    chosen = jaxamp.select_tree(jnp.array(False), {"w": jnp.array([NAN, INF])}, {"w": jnp.array([1.0, 2.0])})
    np.testing.assert_array_equal(chosen["w"], [1.0, 2.0])


@pytest.mark.parametrize(
    "on_true, on_false",
    [
        ({"a": jnp.ones(2)}, {"b": jnp.ones(2)}),
        ({"a": jnp.ones(2)}, {"a": jnp.ones(2), "b": jnp.ones(2)}),
        ([jnp.ones(2)], (jnp.ones(2),)),
    ],
    ids=["renamed_key", "extra_key", "list_vs_tuple"],
)
def test_select_tree_rejects_trees_of_different_structure(on_true, on_false):
    message = (
        "select_tree needs two trees of the same structure; got\n"
        f"  on_true:  {jax.tree.structure(on_true)}\n  on_false: {jax.tree.structure(on_false)}"
    )
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        jaxamp.select_tree(jnp.array(True), on_true, on_false)


def test_select_tree_needs_a_scalar_predicate():
    message = "select_tree needs a scalar predicate; got shape (2,)."
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        jaxamp.select_tree(jnp.array([True, False]), jnp.ones(2), jnp.zeros(2))


def test_select_tree_returns_on_true_dtypes_even_when_on_false_is_wider():
    on_true = {"w": jnp.array([1.0, 2.0], jnp.float16), "step": jnp.array(1, jnp.int32)}
    on_false = {"w": jnp.array([3.0, 4.0], jnp.float32), "step": jnp.array(2, jnp.int32)}
    chosen = jaxamp.select_tree(jnp.array(False), on_true, on_false)
    assert chosen["w"].dtype == jnp.float16
    np.testing.assert_array_equal(chosen["w"], [3.0, 4.0])
    assert chosen["step"] == 2


def test_the_skip_decision_is_computed_once_not_in_every_selection():
    """A step over 40 leaves that keeps each leaf where the gradients are not finite: the decision (a
    count of the non-finite leaves) is one computation that every selection reads. Combined as a
    reduction of booleans, XLA made it a chain of 39 ``and``s and copied the chain into each of the 80
    selections' kernels (over 3,000 ``and``s, a third of a language model's train step's compile)."""
    leaves = [jnp.zeros((8, 4 + index)) for index in range(40)]

    def step(params, moments, grads):
        finite = jaxamp.all_finite(grads)
        return jaxamp.select_tree(finite, jax.tree.map(lambda p, g: p - g, params, grads), params), (
            jaxamp.select_tree(finite, jax.tree.map(lambda m, g: 0.9 * m + g, moments, grads), moments)
        )

    compiled = jax.jit(step).lower(leaves, leaves, leaves).compile().as_text()
    assert compiled.count(" and(") < 40 + 40  # the count's reduction and each leaf's own, not 80 chains
