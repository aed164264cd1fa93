"""Checkpoints of optimizer state and of a whole `jaxamp.TrainState`, through flax.serialization and orbax.

Every storage of `jaxamp.low_precision_optimizer` (float32, bfloat16 with
stochastic rounding or Kahan, int8, float8_e4m3fn) and every loss scale is
saved after a few steps, restored into a freshly made state, and restored
bit for bit: the next step from it is the uninterrupted run's next step.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx, serialization

import jaxamp

INPUTS = jax.random.normal(jax.random.key(1), (32, 64))
TARGETS = INPUTS @ (0.1 * jax.random.normal(jax.random.key(2), (64, 64)))

STORAGES = {
    "optax.adam, float32 params": (optax.adam(1e-2), jnp.float32),
    "float32 state": (jaxamp.low_precision_optimizer(optax.adam(1e-2), state_dtype=jnp.float32, key=0), None),
    "bfloat16, stochastic": (jaxamp.low_precision_optimizer(optax.adam(1e-2), key=0), None),
    "bfloat16, kahan": (jaxamp.low_precision_optimizer(optax.adam(1e-2), rounding="kahan", key=0), None),
    "int8": (jaxamp.low_precision_optimizer(optax.adam(1e-2), state_dtype="int8", key=0), None),
    "float8_e4m3fn": (jaxamp.low_precision_optimizer(optax.adam(1e-2), state_dtype=jnp.float8_e4m3fn, key=0), None),
}  # fmt: skip
LOSS_SCALES = {
    "NoOpLossScale": jaxamp.NoOpLossScale,
    "StaticLossScale": lambda: jaxamp.StaticLossScale(2.0**8),
    "DynamicLossScale": lambda: jaxamp.DynamicLossScale(2.0**10, period=2),
}
ROUTES = ("flax.serialization.to_bytes", "flax.serialization.to_state_dict", "orbax")


def params_in(dtype):
    """A 64 x 64 kernel (4096 elements: stored in 8 bits) and a bias."""
    kernel = 0.1 * jax.random.normal(jax.random.key(0), (64, 64))
    return {"kernel": kernel.astype(dtype), "bias": jnp.zeros((64,), dtype)}


def mse(params):
    params = jax.tree.map(lambda p: p.astype(jnp.float32), params)
    return jnp.mean((INPUTS @ params["kernel"] + params["bias"] - TARGETS) ** 2)


def new_state(storage, loss_scale="DynamicLossScale"):
    tx, dtype = STORAGES[storage]
    return jaxamp.TrainState.create(
        apply_fn=None, params=params_in(dtype or jnp.bfloat16), tx=tx, loss_scale=LOSS_SCALES[loss_scale]()
    )


@jax.jit
def train_step(state, poison):
    _, grads, grads_finite = jaxamp.scaled_value_and_grad(mse, state.loss_scale)(state.params)
    grads = jax.tree.map(lambda grad: grad * poison, grads)
    return state.apply_gradients(grads=grads, grads_finite=grads_finite & jaxamp.all_finite(grads))


@functools.cache
def trained(storage, loss_scale="DynamicLossScale"):
    """The state after three steps (the second skipped: its gradients are inf), and after a fourth."""
    state = new_state(storage, loss_scale)
    for poison in (1.0, jnp.inf, 1.0):
        state = train_step(state, poison)
    return state, train_step(state, 1.0)


def holds_dicts_and_arrays_alone(state_dict):
    if isinstance(state_dict, dict):
        return all(map(holds_dicts_and_arrays_alone, state_dict.values()))
    return state_dict is None or isinstance(state_dict, (jax.Array, np.ndarray, np.generic))


def saved_and_restored(route, state, target, folder):
    if route == "flax.serialization.to_bytes":
        return serialization.from_bytes(target, serialization.to_bytes(state))
    if route == "flax.serialization.to_state_dict":
        state_dict = serialization.to_state_dict(state)
        assert holds_dicts_and_arrays_alone(state_dict)  # what any checkpoint writer takes
        return serialization.from_state_dict(target, state_dict)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(folder / "state", state)
    checkpointer.wait_until_finished()
    return checkpointer.restore(folder / "state", target)


def assert_bit_identical(restored, expected):
    assert jax.tree.structure(restored) == jax.tree.structure(expected)
    leaves = jax.tree_util.tree_flatten_with_path(expected)[0]
    for (path, want), got in zip(leaves, jax.tree.leaves(restored), strict=True):
        got, want = np.asarray(got), np.asarray(want)
        assert got.dtype == want.dtype and got.tobytes() == want.tobytes(), jax.tree_util.keystr(path)


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("storage", STORAGES)
def test_a_train_state_of_every_storage_resumes_bit_for_bit_from_its_checkpoint(storage, route, tmp_path):
    state, next_state = trained(storage)

    restored = saved_and_restored(route, state, new_state(storage), tmp_path)

    assert_bit_identical(restored, state)
    assert_bit_identical(train_step(restored, 1.0), next_state)


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("loss_scale", LOSS_SCALES)
def test_a_train_state_with_every_loss_scale_keeps_its_scale_and_skip_counts(loss_scale, route, tmp_path):
    state, next_state = trained("int8", loss_scale)

    restored = saved_and_restored(route, state, new_state("int8", loss_scale), tmp_path)

    assert_bit_identical(restored, state)
    assert int(restored.skipped_steps) == int(state.skipped_steps) == 1
    assert type(restored.loss_scale) is type(state.loss_scale)
    assert_bit_identical(train_step(restored, 1.0), next_state)


def test_an_nnx_optimizers_8_bit_state_resumes_bit_for_bit_from_its_checkpoint():
    def make():
        model = jaxamp.apply_policy(nnx.Linear(128, 64, rngs=nnx.Rngs(0)), "bfloat16")
        tx = jaxamp.low_precision_optimizer(optax.adam(1e-2), state_dtype="int8", key=0)
        return model, jaxamp.NNXOptimizer(model, tx, jaxamp.DynamicLossScale())

    x = jax.random.normal(jax.random.key(3), (8, 128))

    @nnx.jit
    def step(model, optimizer):
        loss_fn = lambda model: jnp.mean(model(x).astype(jnp.float32) ** 2)  # noqa: E731
        _, grads, grads_finite = jaxamp.scaled_value_and_grad(loss_fn, optimizer.loss_scale)(model)
        optimizer.update(model, grads, grads_finite=grads_finite)

    model, optimizer = make()
    step(model, optimizer)
    saved = serialization.to_bytes(nnx.to_pure_dict(nnx.state((model, optimizer))))
    step(model, optimizer)

    restored_model, restored_optimizer = make()
    state = nnx.state((restored_model, restored_optimizer))
    nnx.replace_by_pure_dict(state, serialization.from_bytes(nnx.to_pure_dict(state), saved))
    nnx.update((restored_model, restored_optimizer), state)
    step(restored_model, restored_optimizer)

    assert_bit_identical(nnx.to_pure_dict(nnx.state((restored_model, restored_optimizer))),
                         nnx.to_pure_dict(nnx.state((model, optimizer))))  # fmt: skip


def test_a_loss_scale_restored_from_a_checkpoint_missing_a_field_says_which_fields_it_has():
    saved = serialization.to_state_dict(jaxamp.DynamicLossScale(jnp.float32(2.0**15)))
    del saved["counter"]
    with pytest.raises(ValueError, match=r"Cannot restore a DynamicLossScale .* from a state dict with fields"):
        serialization.from_state_dict(jaxamp.DynamicLossScale(jnp.float32(1.0)), saved)
