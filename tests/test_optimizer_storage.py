"""One home for the optimizer's storage: `jaxamp.OptimizerStorage`, beside a policy that names dtypes alone.

A precision name may say both (``"bfloat16_int8"``); `jaxamp.split_precision`
reads it into a `jaxamp.Policy` with dtypes alone and an `OptimizerStorage`,
and `jaxamp.optimizer_for_policy` builds the optimizer it asks for. A Policy
made with the storage fields, the old spelling, still works and warns.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxamp
from experiments import train

PARAMS = {"kernel": jnp.full((64, 64), 0.5, jnp.bfloat16)}
GRADS = {"kernel": jnp.full((64, 64), 0.1, jnp.bfloat16)}


@pytest.mark.parametrize(
    "name, dtypes, storage",
    [
        ("bfloat16_kahan", "bfloat16", jaxamp.OptimizerStorage("kahan")),
        ("bf16_int8", "bfloat16", jaxamp.OptimizerStorage("stochastic", "int8")),
        ("bfloat16_int8_per_tensor", "bfloat16", jaxamp.OptimizerStorage("stochastic", "int8", None)),
        ("p=bf16,u=kahan,state=fp8,block=2048", "bfloat16", jaxamp.OptimizerStorage("kahan", jnp.float8_e4m3fn, 2048)),
        ("bfloat16", "bfloat16", jaxamp.OptimizerStorage("nearest")),
        ("float16", "float16", jaxamp.OptimizerStorage("nearest", jnp.float32)),
        ("mixed_bf16", "mixed_bf16", None),
    ],
)  # fmt: skip
def test_a_precision_name_splits_into_a_policy_of_dtypes_alone_and_the_optimizers_storage(name, dtypes, storage):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # reading a name is no deprecated use
        policy, read = jaxamp.split_precision(name)
        assert policy == jaxamp.get_policy(dtypes)
    assert read == storage
    assert (policy.update_rounding, policy.state_format) == (None, None)


def test_the_old_spelling_warns_and_still_builds_the_optimizer_it_names():
    with pytest.warns(DeprecationWarning, match=r"A Policy names dtypes alone.*jaxamp.split_precision\(name\)"):
        policy = jaxamp.get_policy("bfloat16_kahan")
    old = jaxamp.optimizer_for_policy(optax.adam(1e-2), policy, key=0)
    new = jaxamp.optimizer_for_policy(optax.adam(1e-2), "bfloat16_kahan", key=0)
    assert_same_step(old, new)
    assert old.init(PARAMS).compensation is not None  # Kahan's buffer


def assert_same_step(tx, other):
    """One step of each from the same params and gradients: the same updates and state, bit for bit."""
    updates, state = jax.jit(tx.update)(GRADS, tx.init(PARAMS), PARAMS)
    other_updates, other_state = jax.jit(other.update)(GRADS, other.init(PARAMS), PARAMS)
    assert jax.tree.structure(state) == jax.tree.structure(other_state)
    for leaf, other_leaf in zip(jax.tree.leaves((updates, state)), jax.tree.leaves((other_updates, other_state))):
        np.testing.assert_array_equal(leaf, other_leaf)


@pytest.mark.parametrize(
    "storage, arguments",
    [
        (jaxamp.OptimizerStorage(), {}),
        (jaxamp.OptimizerStorage("kahan", "int8", 2048), {"rounding": "kahan", "state_dtype": "int8", "block_size": 2048}),
        (jaxamp.OptimizerStorage("nearest", jnp.float32), {"rounding": "nearest", "state_dtype": jnp.float32}),
    ],
    ids=["defaults", "kahan-int8-2048", "nearest-float32"],
)  # fmt: skip
def test_a_storage_builds_the_optimizer_its_arguments_build(storage, arguments):
    assert_same_step(
        storage.optimizer(optax.adam(1e-2), param_dtype=jnp.bfloat16, key=3),
        jaxamp.low_precision_optimizer(optax.adam(1e-2), param_dtype=jnp.bfloat16, key=3, **arguments),
    )


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"rounding": "sr"}, r"^OptimizerStorage rounding must be one of 'nearest', 'stochastic', 'kahan'; got 'sr'\.$"),
        ({"state_dtype": "int4"}, r"state_dtype must be a floating dtype .*; got int4\.$"),
        ({"block_size": 300}, r"^OptimizerStorage block_size must be a power of two .*; got 300\.$"),
    ],
)  # fmt: skip
def test_a_storage_is_checked_when_it_is_made(settings, message):
    with pytest.raises(ValueError, match=message):
        jaxamp.OptimizerStorage(**settings)


def test_the_experiments_one_precision_flag_gives_the_models_policy_and_the_optimizers_storage():
    precision = train.resolve_precision("bfloat16_int8")
    assert precision.policy == jaxamp.get_policy("bfloat16")
    assert precision.storage == jaxamp.OptimizerStorage("stochastic", "int8")
    assert precision.describe() == "params=bfloat16,compute=bfloat16,output=bfloat16,update=stochastic,state=int8"
    adam = optax.adam(1e-3)
    assert train.resolve_precision("mixed_bf16").optimizer(adam, key=0) is adam


def test_a_per_tensor_8_bit_storage_reads_back_from_its_own_text():
    """``str`` of a storage is a precision spec: per-tensor scales say ``block=tensor``."""
    storage = jaxamp.OptimizerStorage("nearest", "int8", None)
    assert str(storage) == "update=nearest,state=int8,block=tensor"
    assert jaxamp.split_precision(f"p=bf16,{storage}")[1] == storage


def test_a_storage_without_a_state_dtype_keeps_the_state_of_params_of_any_dtype_in_bfloat16():
    """``optimizer(inner, param_dtype=None)``: each param keeps its dtype; Adam's moments are bfloat16."""
    tx = jaxamp.OptimizerStorage("nearest").optimizer(optax.adam(1e-3), param_dtype=None)
    params = {"w": jnp.ones((8,), jnp.bfloat16)}
    floating = [leaf for leaf in jax.tree.leaves(tx.init(params)) if jnp.issubdtype(leaf.dtype, jnp.floating)]
    assert floating and {leaf.dtype for leaf in floating} == {jnp.dtype(jnp.bfloat16)}
