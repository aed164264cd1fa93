"""`jaxamp.low_precision_optimizer` on a Flax NNX model: 8-bit and bfloat16 state where NNX holds it.

Every route to the optimizer (`jaxamp.NNXOptimizer`, ``nnx.Optimizer``,
`jaxamp.optimizer_for_policy`) under every way of running a step (eagerly,
``nnx.jit``, ``nnx.split``/``merge`` under ``jax.jit``) takes the steps that
the same optimizer takes on the model's params as a plain pytree.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxamp
from jaxamp._optimizer.quantized import QuantizedArray

X = jax.random.normal(jax.random.key(1), (8, 128))
Y = jax.random.normal(jax.random.key(2), (8, 64))
STEPS = 3
POLICY_OF_FORMAT = {"int8": "bfloat16_int8", "float8_e4m3fn": "bfloat16_fp8"}


def model_in_bfloat16():
    """A 128 x 64 kernel (8192 elements: stored in 8 bits) and a bias (64: kept in float32)."""
    return jaxamp.apply_policy(nnx.Linear(128, 64, rngs=nnx.Rngs(0)), "bfloat16")


def loss_fn(model):
    return jnp.mean((model(X).astype(jnp.float32) - Y) ** 2)


def tx_of(route, state_format):
    if route == "optimizer_for_policy":
        return jaxamp.optimizer_for_policy(optax.adam(1e-2), POLICY_OF_FORMAT[state_format], key=0)
    return jaxamp.low_precision_optimizer(optax.adam(1e-2), state_dtype=state_format, key=0)


def optimizer_of(route, model, tx):
    if route == "nnx.Optimizer":
        return nnx.Optimizer(model, tx, wrt=nnx.Param)
    return jaxamp.NNXOptimizer(model, tx, jaxamp.NoOpLossScale())


def adam_state(optimizer):
    """Adam's state inside `optimizer` (inside `jaxamp.loss_scaling`'s state for `jaxamp.NNXOptimizer`)."""
    state = optimizer.opt_state
    state = state.inner_state if isinstance(optimizer, jaxamp.NNXOptimizer) else state
    return state.inner_state[0]


def step(model, optimizer):
    if isinstance(optimizer, jaxamp.NNXOptimizer):
        loss, grads, grads_finite = jaxamp.scaled_value_and_grad(loss_fn, optimizer.loss_scale)(model)
        optimizer.update(model, grads, grads_finite=grads_finite)
    else:
        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
    return loss


def run_steps(transform, model, optimizer):
    """`STEPS` steps of `step`, run as `transform` says; the model and optimizer are updated in place."""
    if transform == "eager":
        return [float(step(model, optimizer)) for _ in range(STEPS)]
    if transform == "nnx.jit":
        jitted = nnx.jit(step)
        return [float(jitted(model, optimizer)) for _ in range(STEPS)]
    graphdef, state = nnx.split((model, optimizer))

    @jax.jit
    def pure_step(state):
        model, optimizer = nnx.merge(graphdef, state)
        loss = step(model, optimizer)
        return nnx.state((model, optimizer)), loss

    losses = []
    for _ in range(STEPS):
        state, loss = pure_step(state)
        losses.append(float(loss))
    nnx.update((model, optimizer), state)
    return losses


def pytree_run(tx, jitted):
    """The same steps on the model's params as a plain dict, through ``tx.init``/``tx.update``, jitted or
    eagerly (XLA's CPU computes a jitted bfloat16 program's elementwise ops in float32 without rounding
    between them, so the two differ in the last bits)."""
    graphdef, params = nnx.split(model_in_bfloat16())
    params = nnx.to_pure_dict(params)

    def loss_of_params(params):
        model = nnx.merge(graphdef, nnx.State(params))
        return loss_fn(model)

    def pure_step(params, opt_state):
        loss, grads = jax.value_and_grad(loss_of_params)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    pure_step = jax.jit(pure_step) if jitted else pure_step

    opt_state, losses = tx.init(params), []
    for _ in range(STEPS):
        params, opt_state, loss = pure_step(params, opt_state)
        losses.append(float(loss))
    return params, losses


@pytest.mark.parametrize("state_format", ["int8", "float8_e4m3fn"])
@pytest.mark.parametrize("transform", ["eager", "nnx.jit", "split/merge under jax.jit"])
@pytest.mark.parametrize("route", ["jaxamp.NNXOptimizer", "nnx.Optimizer", "optimizer_for_policy"])
def test_an_nnx_model_takes_the_steps_its_params_take_as_a_pytree(route, transform, state_format):
    model = model_in_bfloat16()
    optimizer = optimizer_of(route, model, tx_of(route, state_format))

    losses = run_steps(transform, model, optimizer)

    expected_params, expected_losses = pytree_run(tx_of(route, state_format), jitted=transform != "eager")
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-6)
    assert losses[-1] < losses[0]
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    for name in ("kernel", "bias"):
        assert params[name].dtype == jnp.bfloat16
        np.testing.assert_array_equal(params[name], expected_params[name], err_msg=name)
    adam = adam_state(optimizer)
    for moment in (adam.mu, adam.nu):
        assert isinstance(moment["kernel"], QuantizedArray)
        assert moment["kernel"].codes[...].dtype == jnp.dtype(state_format)
        assert moment["bias"][...].dtype == jnp.float32
    assert int(optimizer.step[...]) == STEPS


def test_a_hand_written_loop_over_nnx_state_keeps_its_variables_around_the_codes_and_scales():
    """``tx.init`` and ``tx.update`` on ``nnx.state(model, nnx.Param)`` as given, Variables and all."""
    model = model_in_bfloat16()
    tx = jaxamp.low_precision_optimizer(optax.adam(1e-2), state_dtype="int8", key=0)
    params = nnx.state(model, nnx.Param)
    opt_state = tx.init(params)
    kernel_mu = opt_state.inner_state[0].mu["kernel"]
    assert isinstance(kernel_mu, QuantizedArray)
    assert isinstance(kernel_mu.codes, nnx.Param) and isinstance(kernel_mu.scales, nnx.Param)

    for _ in range(STEPS):
        grads = nnx.grad(loss_fn)(model)
        updates, opt_state = tx.update(grads, opt_state, nnx.state(model, nnx.Param))
        nnx.update(model, optax.apply_updates(nnx.state(model, nnx.Param), updates))

    expected_params, _ = pytree_run(
        jaxamp.low_precision_optimizer(optax.adam(1e-2), state_dtype="int8", key=0), jitted=False
    )
    np.testing.assert_array_equal(model.kernel[...], expected_params["kernel"])
    assert jax.tree.structure(opt_state) == jax.tree.structure(tx.init(nnx.state(model, nnx.Param)))


def arrays(node):
    """Every array of `node` by path, copied: what a step may change."""
    return {"/".join(map(str, path)): np.asarray(variable[...]) for path, variable in nnx.to_flat_state(nnx.state(node))}


def test_a_skipped_nnx_step_leaves_the_params_every_code_and_scale_and_the_key_as_they_were():
    model = model_in_bfloat16()
    tx = jaxamp.low_precision_optimizer(optax.adam(1e-2), state_dtype="int8", key=0)
    optimizer = jaxamp.NNXOptimizer(model, tx, jaxamp.DynamicLossScale(2.0**10))
    nnx.jit(step)(model, optimizer)
    before = arrays((model, optimizer))

    infinite = jax.tree.map(lambda grad: jnp.full_like(grad, jnp.inf), nnx.state(model, nnx.Param))
    nnx.jit(lambda model, optimizer: optimizer.update(model, infinite))(model, optimizer)

    after = arrays((model, optimizer))
    changed = {path for path in before if not np.array_equal(before[path], after[path])}
    assert changed and all("loss_scale" in path or "nonfinite_grads" in path for path in changed)
    assert int(optimizer.step[...]) == 1 and int(optimizer.skipped_steps) == 1


def test_bfloat16_state_trains_an_nnx_model_as_its_params_as_a_pytree():
    model = model_in_bfloat16()
    optimizer = jaxamp.NNXOptimizer(model, jaxamp.optimizer_for_policy(optax.adam(1e-2), "bfloat16_kahan", key=0))
    run_steps("nnx.jit", model, optimizer)
    expected_params, _ = pytree_run(jaxamp.optimizer_for_policy(optax.adam(1e-2), "bfloat16_kahan", key=0), jitted=True)
    np.testing.assert_array_equal(model.kernel[...], expected_params["kernel"])
    assert adam_state(optimizer).nu["kernel"][...].dtype == jnp.bfloat16


def test_the_codes_keep_the_params_sharding_annotation_and_the_scales_are_replicated():
    """The scales' shape is not the param's: its annotation (here ``(None, "model")``) does not fit them."""
    mesh = jax.make_mesh((1,), ("model",), axis_types=(jax.sharding.AxisType.Auto,))
    init = nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, "model"))
    with jax.set_mesh(mesh):
        model = jaxamp.apply_policy(nnx.Linear(128, 64, kernel_init=init, rngs=nnx.Rngs(0)), "bfloat16")
        tx = jaxamp.low_precision_optimizer(optax.adam(1e-2), state_dtype="int8")
        optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
        specs = nnx.get_partition_spec(nnx.state(optimizer))
    nu = specs["opt_state"]["inner_state"][0]["nu"]["kernel"]
    assert nu.codes.get_value() == jax.sharding.PartitionSpec(None, "model")
    assert nu.scales.get_value() == jax.sharding.PartitionSpec()
