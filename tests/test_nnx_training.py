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


def test_a_step_the_caller_skips_with_finite_gradients_changes_nothing_but_the_loss_scale():
    """A training loop may skip a step of its own (a loss spike, one bad micro-batch): it passes
    ``grads_finite=False`` with gradients that are all finite. Fails if the caller's flag is not
    passed on to `jaxamp.loss_scaling`, which would read the gradients as finite and apply them."""
    model = Net(nnx.Rngs(0))
    optimizer = jaxamp.NNXOptimizer(model, optax.adam(1e-2), jaxamp.DynamicLossScale(2.0**10))
    _, grads, grads_finite = jaxamp.scaled_value_and_grad(loss_fn, optimizer.loss_scale)(model, X)
    assert bool(grads_finite)
    model_before, optimizer_before = arrays(model), kept(optimizer)

    optimizer.update(model, grads, grads_finite=jnp.asarray(False))

    assert_same(model_before, arrays(model))
    assert_same(optimizer_before, kept(optimizer))
    assert int(optimizer.step[...]) == 0 and int(optimizer.skipped_steps) == 1
    assert float(optimizer.loss_scale.loss_scale) == 2.0**9


def loss_of_data_then_model(x, model):
    return loss_fn(model, x)


@pytest.mark.parametrize("jitted", [True, False], ids=["nnx.jit", "eager"])
def test_a_model_that_is_the_second_argument_of_the_loss_is_differentiated_and_kept_when_skipped(jitted):
    """``loss(x, model)`` with ``argnums=1``: the gradients are the model's params' (an ``nnx.State``,
    as ``nnx.value_and_grad`` gives them), and a step skipped for an inf in the data puts back the
    batch statistics and the dropout's RNG count that the call moved."""
    model, twin = Net(nnx.Rngs(0)), Net(nnx.Rngs(0))
    grad_fn = jaxamp.scaled_value_and_grad(loss_of_data_then_model, jaxamp.StaticLossScale(4.0), argnums=1)
    grad_fn = nnx.jit(grad_fn) if jitted else grad_fn
    loss, grads, grads_finite = grad_fn(X, model)
    expected_loss, expected = nnx.value_and_grad(loss_of_data_then_model, argnums=1)(X, twin)
    assert bool(grads_finite) and float(loss) == pytest.approx(float(expected_loss), rel=1e-6)
    assert jax.tree.structure(grads) == jax.tree.structure(expected)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)

    before = arrays(model)
    *_, grads_finite = grad_fn(X_INF, model)
    assert not bool(grads_finite)
    assert_same(before, arrays(model))


def test_skipped_steps_count_every_skip_and_consecutive_ones_only_those_in_a_row():
    model = Net(nnx.Rngs(0))
    optimizer = jaxamp.NNXOptimizer(model, optax.sgd(0.1), jaxamp.DynamicLossScale(2.0**10))
    for x in (X_INF, X, X_INF):
        step(model, optimizer, x)
    assert int(optimizer.step[...]) == 1 and int(optimizer.skipped_steps) == 2
    assert int(optimizer.loss_scale.consecutive_skipped_steps) == 1


class OverflowingMLP(nnx.Module):
    """Four layers in an ``nnx.List``; the third one's weights 10,000 times too large for float16."""

    def __init__(self, rngs):
        sizes = [(32, 16), (16, 16), (16, 16), (16, 10)]
        self.layers = nnx.List([nnx.Linear(fan_in, fan_out, rngs=rngs) for fan_in, fan_out in sizes])
        self.layers[2].kernel[...] = self.layers[2].kernel[...] * 1e4

    def __call__(self, x):
        for layer in self.layers[:-1]:
            x = nnx.relu(layer(x))
        return self.layers[-1](x)


def test_an_nnx_run_stuck_on_overflows_is_stopped_naming_its_layers_and_leaves_by_their_paths():
    """The linen guide's MLP, in NNX: every step overflows backward in ``layers/3`` (whose weight
    gradient multiplies ``layers/2``'s large outputs by the scaled cotangent). The record names the
    layer as linen's names ``Dense_3``, the non-finite leaves are named by their paths in the model
    (no NNX ``/value``), and `jaxamp.OverflowGuard` on the `NNXOptimizer` lists them and the layer
    where they start, as it does for a `jaxamp.TrainState`."""
    model = jaxamp.apply_policy(OverflowingMLP(nnx.Rngs(1)), "mixed_float16")
    optimizer = jaxamp.NNXOptimizer(model, optax.adam(1e-3), jaxamp.DynamicLossScale())
    x, labels = jax.random.normal(jax.random.key(0), (8, 32)), jnp.arange(8)

    @nnx.jit
    def recording_step(model, optimizer):
        def loss_fn(model):
            return optax.softmax_cross_entropy_with_integer_labels(model(x), labels).mean()

        *_, grads, grads_finite, record = jaxamp.scaled_value_and_grad(
            loss_fn, optimizer.loss_scale, record_overflow=True
        )(model)
        optimizer.update(model, grads, grads_finite=grads_finite)
        return record

    first = recording_step(model, optimizer).first_overflow()
    assert (first.site.name, first.pass_) == ("layers/3", "backward")
    skipped = ["layers/0/bias", "layers/0/kernel", "layers/1/bias", "layers/1/kernel", "layers/3/kernel"]
    assert optimizer.nonfinite_grads.nonfinite_paths() == skipped
    assert jaxamp.diagnostics.nonfinite_grads_of(optimizer).summary().startswith(
        "step 1 skipped: non-finite grads in 5 of 8 leaves: layers/0/bias, layers/0/kernel"
    )
    for _ in range(5):
        recording_step(model, optimizer)
    with pytest.raises(jaxamp.LossScaleStuckError) as stuck:
        jaxamp.OverflowGuard(max_consecutive_skips=5).check(optimizer)
    assert stuck.value.nonfinite_paths == skipped
    assert stuck.value.deepest_layers == ["layers/3"]
    assert "non-finite gradients start at layers/3" in str(stuck.value)

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
    """A float16 model's optimizer made without a loss scale had none: its small gradients underflowed.
    (Half params take an optimizer that computes in float32.)"""
    tx = jaxamp.low_precision_optimizer(optax.sgd(0.1), param_dtype=None, state_dtype=jnp.float32)
    assert jaxamp.NNXOptimizer(make_model(), tx).loss_scale == expected


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
