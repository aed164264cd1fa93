"""Training a Flax NNX model with a loss scale: a skipped step changes nothing but the scale.

`jaxamp.scaled_value_and_grad` of an NNX module, and `jaxamp.NNXOptimizer`
(``nnx.Optimizer`` around `jaxamp.loss_scaling`), on a model with batch
statistics and dropout, whose RNG stream counts its calls.
"""

import jax
import jax.numpy as jnp
import jmp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxamp

X = jnp.arange(32, dtype=jnp.float32).reshape(8, 4) / 8
Y = jnp.arange(8) % 3
X_INF = X.at[0, 0].set(jnp.inf)


class Net(nnx.Module):
    def __init__(self, rngs):
        self.dense = nnx.Linear(4, 8, rngs=rngs)
        self.norm = nnx.BatchNorm(8, rngs=rngs)
        self.dropout = nnx.Dropout(0.25, rngs=rngs)
        self.head = nnx.Linear(8, 3, rngs=rngs)

    def __call__(self, x):
        return self.head(self.dropout(nnx.relu(self.norm(self.dense(x)))))


def loss_fn(model, x):
    return optax.softmax_cross_entropy_with_integer_labels(model(x), Y).mean()


def step(model, optimizer, x):
    loss, grads, grads_finite = jaxamp.scaled_value_and_grad(loss_fn, optimizer.loss_scale)(model, x)
    optimizer.update(model, grads, grads_finite=grads_finite)
    return loss


def arrays(node):
    """Every variable's value, by path: what a step may change."""
    return {path: np.asarray(variable[...]) for path, variable in nnx.to_flat_state(nnx.state(node))
            if not jax.dtypes.issubdtype(variable[...].dtype, jax.dtypes.prng_key)}  # fmt: skip


def kept(optimizer):
    """What a skipped step leaves in the optimizer: all but the loss scale and the record of the skip."""
    return {path: value for path, value in arrays(optimizer).items()
            if "loss_scale" not in path and "nonfinite_grads" not in path}  # fmt: skip


def assert_same(before, after):
    assert before.keys() == after.keys()
    for path in before:
        np.testing.assert_array_equal(after[path], before[path], err_msg=str(path))


@pytest.mark.parametrize("jitted", [True, False], ids=["nnx.jit", "eager"])
def test_a_skipped_step_leaves_model_and_optimizer_as_they_were_and_halves_the_scale(jitted):
    model = jaxamp.apply_policy(Net(nnx.Rngs(0)), "mixed_float16")
    optimizer = jaxamp.NNXOptimizer(model, optax.adam(1e-2), jaxamp.DynamicLossScale(2.0**10))
    train_step = nnx.jit(step) if jitted else step
    train_step(model, optimizer, X)
    model_before, optimizer_before, scale_before = arrays(model), kept(optimizer), optimizer.loss_scale

    loss = train_step(model, optimizer, X_INF)

    assert not np.isfinite(float(loss))
    assert_same(model_before, arrays(model))  # params, batch statistics, the dropout's RNG count
    assert_same(optimizer_before, kept(optimizer))  # Adam's moments and count, the optimizer's step
    assert float(optimizer.loss_scale.loss_scale) == float(scale_before.loss_scale) / 2
    assert int(optimizer.step[...]) == 1 and int(optimizer.skipped_steps) == 1

    train_step(model, optimizer, X)
    assert int(optimizer.step[...]) == 2 and int(optimizer.opt_state.inner_state[0].count[...]) == 2
    assert int(model.dropout.rngs.count[...]) == 2  # the skipped step's draw was put back


def test_a_plain_nnx_optimizer_counts_skipped_steps_in_step_and_adam_does_not():
    """Why `NNXOptimizer` exists: ``nnx.Optimizer.update`` adds one to ``step`` on every call, whatever
    its optax transformation decided (flax 0.12's ``self.step[...] += 1``). If this test fails, flax
    counts differently, and `NNXOptimizer.update` should be read again."""
    model = Net(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, jaxamp.loss_scaling(optax.adam(1e-2), jaxamp.DynamicLossScale()),
                              wrt=nnx.Param)  # fmt: skip
    for _ in range(3):
        loss_scale = jax.tree.map(lambda variable: variable[...], jaxamp.loss_scale_of(optimizer.opt_state),
                                  is_leaf=lambda node: isinstance(node, nnx.Variable))  # fmt: skip
        _, grads, grads_finite = jaxamp.scaled_value_and_grad(loss_fn, loss_scale)(model, X_INF)
        optimizer.update(model, grads, grads_finite=grads_finite)
    assert int(optimizer.step[...]) == 3
    assert int(optimizer.opt_state.inner_state[0].count[...]) == 0


def test_a_finite_step_is_nnx_optimizers_step_to_the_bit():
    plain_model, scaled_model = Net(nnx.Rngs(0)), Net(nnx.Rngs(0))
    plain = nnx.Optimizer(plain_model, optax.adam(1e-2), wrt=nnx.Param)
    scaled = jaxamp.NNXOptimizer(scaled_model, optax.adam(1e-2), jaxamp.StaticLossScale(2.0**8))

    _, grads = nnx.value_and_grad(loss_fn)(plain_model, X)
    plain.update(plain_model, grads)
    step(scaled_model, scaled, X)

    assert_same(arrays(plain_model), arrays(scaled_model))
    assert int(scaled.step[...]) == int(plain.step[...]) == 1 and int(scaled.skipped_steps) == 0


def test_update_without_grads_finite_reads_it_from_the_grads():
    model = Net(nnx.Rngs(0))
    optimizer = jaxamp.NNXOptimizer(model, optax.sgd(0.1))
    before = arrays(model)
    grads = jax.tree.map(lambda grad: jnp.full_like(grad, jnp.nan), nnx.state(model, nnx.Param))
    optimizer.update(model, grads)
    assert_same(before, arrays(model))
    assert int(optimizer.step[...]) == 0 and int(optimizer.skipped_steps) == 1


def test_the_gradients_of_a_model_with_an_rng_stream_are_its_params_gradients():
    """``jax.value_and_grad`` refused the dropout's uint32 RNG count ("grad requires real- or
    complex-valued inputs"); an NNX module is differentiated as ``nnx.value_and_grad`` does."""
    model, twin = Net(nnx.Rngs(0)), Net(nnx.Rngs(0))
    loss, grads, grads_finite = jaxamp.scaled_value_and_grad(loss_fn, jaxamp.StaticLossScale(4.0))(model, X)
    expected_loss, expected = nnx.value_and_grad(loss_fn)(twin, X)
    assert bool(grads_finite) and float(loss) == float(expected_loss)
    assert jax.tree.structure(grads) == jax.tree.structure(expected)
    jax.tree.map(np.testing.assert_array_equal, grads, expected)
    assert_same(arrays(twin), arrays(model))  # the batch statistics and RNG count moved alike


def test_recording_overflows_of_an_nnx_model_names_its_matmuls():
    model = jaxamp.apply_policy(Net(nnx.Rngs(0)), "mixed_float16")
    *_, grads_finite, record = jaxamp.scaled_value_and_grad(
        loss_fn, jaxamp.StaticLossScale(1.0), record_overflow=True
    )(model, X)
    assert bool(grads_finite) and len(record.sites) == 2 and record.first_overflow() is None


def test_a_loss_scale_that_does_not_count_skipped_steps_is_refused_naming_the_fix():
    with pytest.raises(TypeError, match=r"jaxamp.NNXOptimizer needs a jaxamp loss scale .* jmp loss scale"):
        jaxamp.NNXOptimizer(Net(nnx.Rngs(0)), optax.sgd(0.1), jmp.DynamicLossScale(jnp.float32(2.0**15)))


def test_an_optimizer_of_the_head_alone_updates_the_head_alone():
    """``wrt`` reaches ``nnx.Optimizer``: fine-tuning one layer (as with ``nnx.LoRAParam``)."""
    head_only = nnx.All(nnx.Param, nnx.PathContains("head"))
    model = Net(nnx.Rngs(0))
    optimizer = jaxamp.NNXOptimizer(model, optax.sgd(0.1), jaxamp.StaticLossScale(1.0), wrt=head_only)
    before = arrays(model)
    grads = nnx.grad(loss_fn, argnums=nnx.DiffState(0, head_only))(model, X)
    optimizer.update(model, grads)
    after = arrays(model)
    changed = {path[0] for path in before if not np.array_equal(before[path], after[path])}
    assert "head" in changed and "dense" not in changed
    assert int(optimizer.step[...]) == 1


@pytest.mark.parametrize(
    ("make_model", "expected"),
    [
        (lambda: jaxamp.apply_policy(Net(nnx.Rngs(0)), "mixed_float16"), jaxamp.DynamicLossScale()),
        (lambda: jaxamp.apply_policy(Net(nnx.Rngs(0)), "mixed_bfloat16"), jaxamp.NoOpLossScale()),
        (lambda: nnx.Linear(4, 3, param_dtype=jnp.float16, rngs=nnx.Rngs(0)), jaxamp.DynamicLossScale()),
        (lambda: Net(nnx.Rngs(0)), jaxamp.NoOpLossScale()),
    ],
    ids=["mixed_float16", "mixed_bfloat16", "float16_params", "float32"],
)
def test_an_optimizer_made_without_a_loss_scale_takes_the_one_the_models_dtypes_need(make_model, expected):
    """A float16 model's optimizer made without a loss scale had none: its small gradients underflowed."""
    assert jaxamp.NNXOptimizer(make_model(), optax.sgd(0.1)).loss_scale == expected


def test_the_optimizer_names_the_leaves_whose_gradients_were_not_finite():
    """`nonfinite_grads_of(optimizer)` raised "this NNXOptimizer keeps no record of non-finite
    gradients", though the record was in its state."""
    model = Net(nnx.Rngs(0))
    optimizer = jaxamp.NNXOptimizer(model, optax.sgd(0.1))
    grads = jax.tree.map(jnp.zeros_like, nnx.state(model, nnx.Param))
    grads["head"]["bias"] = jax.tree.map(lambda grad: jnp.full_like(grad, jnp.inf), grads["head"]["bias"])
    optimizer.update(model, grads)

    record = jaxamp.diagnostics.nonfinite_grads_of(optimizer)
    assert [path.split("/")[:2] for path in record.nonfinite_paths()] == [["head", "bias"]]
    assert record.summary().startswith("step 1 skipped: non-finite grads in 1 of 6 leaves: head/bias")
    assert int(record.skipped_at) == 0 and isinstance(record.nonfinite, jax.Array)
