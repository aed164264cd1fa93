"""Overrides nested three deep: each layer runs, creates its params and hands on its result by its own policy.

The model is ``Root (mixed_float16) > Outer (float32) > Middle
(mixed_bfloat16) > Leaf (bfloat16)``, each with a dense layer of its own,
the leaf's result handed straight back up through Middle and Outer. Three
faults that once passed every test are caught here, for linen and NNX:

* the outermost scope taken for an equation instead of the innermost (the
  inner layers' matmuls run in Outer's float32);
* a value leaving nested scopes cast outermost first (the root would read
  Leaf's bfloat16 exit dtype instead of Outer's float32);
* a layer's policy not passed on to the layers it calls (Leaf's own dense
  layer would get its params in float32, not bfloat16), or, for NNX, every
  module inheriting the root's policy instead of its holder's.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import jaxamp
from tests.test_autocast_rule_classes import all_equations

F16, BF16, F32 = jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)
X = jnp.ones((2, 4))


class LinenLeaf(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(4, name="dense")(x)


class LinenMiddle(nn.Module):
    @nn.compact
    def __call__(self, x):
        return LinenLeaf(name="leaf")(nn.Dense(4, name="dense")(x))


class LinenOuter(nn.Module):
    @nn.compact
    def __call__(self, x):
        return LinenMiddle(name="middle")(nn.Dense(4, name="dense")(x))


class LinenRoot(nn.Module):
    @nn.compact
    def __call__(self, x):
        return jnp.tanh(LinenOuter(name="outer")(nn.Dense(4, name="dense")(x)))


LINEN_OVERRIDES = {LinenOuter: "float32", LinenMiddle: "mixed_bfloat16", LinenLeaf: "bfloat16"}


class NnxLeaf(nnx.Module):
    def __init__(self, rngs):
        self.dense = nnx.Linear(4, 4, rngs=rngs)

    def __call__(self, x):
        return self.dense(x)


class NnxMiddle(nnx.Module):
    def __init__(self, rngs):
        self.dense = nnx.Linear(4, 4, rngs=rngs)
        self.leaf = NnxLeaf(rngs)

    def __call__(self, x):
        return self.leaf(self.dense(x))


class NnxOuter(nnx.Module):
    def __init__(self, rngs):
        self.dense = nnx.Linear(4, 4, rngs=rngs)
        self.middle = NnxMiddle(rngs)

    def __call__(self, x):
        return self.middle(self.dense(x))


class NnxRoot(nnx.Module):
    def __init__(self, rngs):
        self.dense = nnx.Linear(4, 4, rngs=rngs)
        self.outer = NnxOuter(rngs)

    def __call__(self, x):
        return jnp.tanh(self.outer(self.dense(x)))


NNX_OVERRIDES = {NnxOuter: "float32", NnxMiddle: "mixed_bfloat16", NnxLeaf: "bfloat16"}

# Root, Outer, Middle, Leaf, in program order.
MATMUL_DTYPES = [F16, F32, BF16, BF16]
KERNEL_DTYPES = {"dense": F32, "outer": F32, "middle": F32, "leaf": BF16}


def _matmul_and_tanh_dtypes(fun, *args):
    jaxpr = jax.make_jaxpr(fun)(*args).jaxpr
    matmuls = [eq.invars[0].aval.dtype for eq in all_equations(jaxpr) if eq.primitive.name == "dot_general"]
    (tanh,) = [eq for eq in all_equations(jaxpr) if eq.primitive.name == "tanh"]
    return matmuls, tanh.invars[0].aval.dtype


def _owner(path: tuple) -> str:
    """The innermost of root/outer/middle/leaf that holds a param at `path`."""
    names = [str(getattr(key, "key", key)) for key in path]
    for name in ("leaf", "middle", "outer"):
        if name in names:
            return name
    return "dense"


def test_linen_overrides_three_deep_run_create_params_and_hand_back_by_their_own_policies():
    model = jaxamp.apply_policy(LinenRoot(), "mixed_float16", overrides=LINEN_OVERRIDES)
    variables = model.init(jax.random.key(0), X)
    kernels = {
        _owner(path): leaf.dtype
        for path, leaf in jax.tree_util.tree_flatten_with_path(variables["params"])[0]
        if getattr(path[-1], "key", None) == "kernel"
    }
    assert kernels == KERNEL_DTYPES
    matmuls, tanh_input = _matmul_and_tanh_dtypes(model.apply, variables, X)
    assert matmuls == MATMUL_DTYPES
    assert tanh_input == F32  # Outer's exit dtype, the last scope the leaf's result leaves
    assert model.apply(variables, X).dtype == F32


def test_nnx_overrides_three_deep_run_create_params_and_hand_back_by_their_holders_policies():
    model = jaxamp.apply_policy(NnxRoot(nnx.Rngs(0)), "mixed_float16", overrides=NNX_OVERRIDES)
    kernels = {
        _owner(path): leaf.dtype
        for path, leaf in jax.tree_util.tree_flatten_with_path(nnx.state(model, nnx.Param))[0]
        if any(getattr(key, "key", None) == "kernel" for key in path)
    }
    assert kernels == KERNEL_DTYPES
    graphdef, state = nnx.split(model)

    def call(state, x):
        return nnx.merge(graphdef, state)(x)

    matmuls, tanh_input = _matmul_and_tanh_dtypes(call, state, X)
    assert matmuls == MATMUL_DTYPES
    assert tanh_input == F32
    assert model(X).dtype == F32


@pytest.mark.parametrize("depth", [2, 3])
def test_linen_an_inner_override_wins_over_its_outer_one_at_each_depth(depth):
    """Two deep: Outer > Middle only; three deep: Outer > Middle > Leaf. The innermost policy
    decides the innermost matmul."""
    overrides = {LinenOuter: "float32", LinenMiddle: "mixed_bfloat16"}
    if depth == 3:
        overrides[LinenLeaf] = "float32"
    model = jaxamp.apply_policy(LinenRoot(), "mixed_float16", overrides=overrides)
    variables = model.init(jax.random.key(0), X)
    matmuls, _ = _matmul_and_tanh_dtypes(model.apply, variables, X)
    assert matmuls == [F16, F32, BF16, F32 if depth == 3 else BF16]
