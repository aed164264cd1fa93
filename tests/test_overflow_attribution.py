"""Why was the step skipped: the gradient leaves, the layer, the pass.

A 4-layer MLP in float16 under a loss scale of 2**15, made to overflow in its
third layer in two ways:

* backward only: a loss term on layer 3's output whose cotangent (4 x 2**15)
  is beyond float16's 65504, while every forward value stays finite;
* forward: layer 3's weights scaled so that its output is beyond 65504.

The step must be skipped, `NonFiniteGradients` must name exactly the leaves
the inf reached, and the `OverflowRecord` must name layer 3 and the pass.
"""

from __future__ import annotations

import inspect

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from fresh_processes import FreshProcess, xla_flags
from overflow_mlp import MODEL, SCALE, WIDTH, init_params, new_state

import jaxamp
from jaxamp.diagnostics import NonFiniteGradients, OverflowRecord, nonfinite_grads_of, record_overflow

LAYER_3_TERM = 4.0  # its cotangent, times SCALE, is 131072 > 65504


def loss_fn(params, x, y, layer_3_term):
    out, layer_3 = MODEL(params, x)
    return jnp.mean((out - y) ** 2) + layer_3_term * jnp.sum(layer_3), out


@jax.jit
def train_step(state, x, y, layer_3_term):
    _, grads, grads_finite, record = jaxamp.scaled_value_and_grad(
        loss_fn, state.loss_scale, has_aux=True, record_overflow=True
    )(state.params, x, y, layer_3_term)
    return state.apply_gradients(grads=grads, grads_finite=grads_finite), record


def batch(key=1):
    x = jax.random.normal(jax.random.key(key), (4, WIDTH))
    return x, jnp.zeros((4, WIDTH))


def leaves_of_layers(*layers):
    return [f"{layer - 1}/{name}" for layer in layers for name in ("bias", "kernel")]


@pytest.fixture(scope="module")
def backward_overflow():
    state = new_state(init_params(jax.random.key(0)))
    before = state
    state, record = train_step(state, *batch(), LAYER_3_TERM)
    return before, state, record


def test_a_backward_only_overflow_skips_the_step(backward_overflow):
    before, state, record = backward_overflow
    assert int(state.skipped_steps) == 1 and int(state.step) == 0
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), before.params, state.params))
    assert np.all(np.isfinite(np.asarray(record.forward_amax))), "the forward pass stays finite"


def test_the_gradient_attribution_names_the_leaves_of_layers_1_to_3_and_none_of_layer_4(backward_overflow):
    _, state, _ = backward_overflow
    record = state.nonfinite_grads
    assert sorted(record.nonfinite_paths()) == sorted(leaves_of_layers(1, 2, 3))
    assert int(record.skipped_at) == 0
    assert record.summary().startswith("step 1 skipped: non-finite grads in 6 of 8 leaves: 0/bias")


def test_the_backward_attribution_names_layer_3_and_the_backward_pass(backward_overflow):
    _, _, record = backward_overflow
    first = record.first_overflow()
    assert first is not None
    assert (first.site.name, first.pass_, first.site.dtype) == ("layer_3", "backward", "float16")
    assert not np.isfinite(first.amax)
    assert [site.name for site in record.sites] == ["layer_1", "layer_2", "layer_3", "layer_4"]
    assert np.isfinite(float(record.backward_amax[3])), "layer 4's backward stays finite"
    assert "backward overflow first in layer_3 at overflow_mlp.py:" in record.summary()
    assert "(mlp) (dot_general, float16, amax inf; the dtype's max is 65504)" in record.summary()


def test_a_finite_step_after_the_skip_keeps_the_attribution_of_the_skipped_one(backward_overflow):
    _, state, _ = backward_overflow
    state, record = train_step(state, *batch(), 0.0)
    assert int(state.step) == 1 and int(state.skipped_steps) == 1
    assert record.first_overflow() is None
    assert int(state.nonfinite_grads.skipped_at) == 0
    assert int(state.nonfinite_grads.steps_taken) == 2
    assert sorted(state.nonfinite_grads.nonfinite_paths()) == sorted(leaves_of_layers(1, 2, 3))


def test_a_forward_overflow_names_layer_3_and_the_forward_pass_first():
    params = init_params(jax.random.key(0))
    params[2] = {"kernel": params[2]["kernel"] * 1e6, "bias": params[2]["bias"]}
    state, record = train_step(new_state(params), *batch(), 0.0)
    assert int(state.skipped_steps) == 1
    first = record.first_overflow()
    assert (first.site.name, first.pass_) == ("layer_3", "forward")
    assert np.isfinite(float(record.forward_amax[1])), "layer 2's output stays finite"


def weight_gradient_overflow(w, x):
    """One float16 matmul whose output (0.4) and output cotangent (100) are finite and whose
    weight gradient (8 rows of 100 x 100: 80000) is beyond 65504."""
    return jnp.sum(jaxamp.autocast(lambda w, x: x @ w, "mixed_float16")(w, x) * 100.0)


W_SMALL, X_LARGE = jnp.full((4, 4), 0.001), jnp.full((8, 4), 100.0)


def test_an_overflow_in_a_weight_gradient_alone_is_named_as_the_matmuls_backward_overflow():
    _, grads, finite, record = jaxamp.scaled_value_and_grad(
        weight_gradient_overflow, jaxamp.NoOpLossScale(), record_overflow=True
    )(W_SMALL, X_LARGE)
    assert not bool(finite) and not np.isfinite(np.asarray(grads)).any()
    first = record.first_overflow()
    assert first is not None and (first.pass_, first.index, first.amax) == ("backward", 0, np.inf)
    assert float(record.forward_amax[0]) == pytest.approx(0.4, rel=1e-2)


def test_a_sites_backward_amax_is_the_largest_of_its_output_and_operand_cotangents():
    """Two float16 matmuls, all finite: ``h = x @ w1`` (w1 = 0.25, so h = x) and ``y = h @ w2``
    (w2 = 0.5), loss ``sum(y) * 100``, x all v. Layer 2's output cotangent is 100, its operands'
    are ``dh = 4 * 100 * 0.5 = 200`` and ``dw2 = 8 * v * 100``; layer 1's output cotangent is dh
    (200) and its weight gradient ``dw1 = 8 * v * 200`` (the data's is not computed). At v = 0.01
    the cotangents of the outputs lead (200 and 200); at v = 10 the weight gradients (16000, 8000)."""

    def loss(w1, w2, x):
        def model(w1, w2, x):
            return (x @ w1) @ w2

        return jnp.sum(jaxamp.autocast(model, "mixed_float16")(w1, w2, x)) * 100.0

    w1, w2 = jnp.full((4, 4), 0.25), jnp.full((4, 4), 0.5)
    for v, expected in [(0.01, [200.0, 200.0]), (10.0, [16000.0, 8000.0])]:
        _, _, finite, record = jaxamp.scaled_value_and_grad(
            loss, jaxamp.NoOpLossScale(), argnums=(0, 1), record_overflow=True
        )(w1, w2, jnp.full((8, 4), v))
        assert bool(finite) and record.backward_recorded
        np.testing.assert_allclose(np.asarray(record.backward_amax), expected, rtol=1e-2)


def test_a_record_of_a_program_without_a_matmul_has_no_sites_and_no_amaxes():
    outputs, record = record_overflow(jaxamp.autocast(jnp.tanh, "mixed_float16"))(jnp.ones(3))
    np.testing.assert_allclose(outputs, np.tanh(1.0), rtol=1e-3)
    assert record.sites == () and record.unrecorded == 0
    assert record.forward_amax.shape == (0,) and record.forward_amax.dtype == jnp.float32
    assert record.first_overflow() is None


def test_a_function_that_runs_more_matmuls_when_traced_again_is_refused_with_the_reason():
    """`scaled_value_and_grad` sizes the probe on a first trace: a function whose second trace
    runs two autocast calls where the first ran one cannot be recorded."""
    traces = []

    def loss(w):
        traces.append(w)
        h = X_LARGE / 100
        for _ in traces:
            h = jaxamp.autocast(lambda h, w: h @ w, "mixed_float16")(h, w)
        return jnp.sum(h)

    step = jaxamp.scaled_value_and_grad(loss, jaxamp.NoOpLossScale(), record_overflow=True)
    with pytest.raises(RuntimeError) as refused:
        step(W_SMALL)
    assert str(refused.value) == (
        "record_overflow: the function ran more matmuls under autocast than when the probe was sized; "
        "a function recorded for overflows must run the same autocast calls every time it is traced."
    )


def test_a_record_taps_the_weights_but_computes_no_gradient_of_the_data():
    """The data is nobody's to differentiate: its cotangent, a whole matmul, is not computed for
    the record. One matmul forward, one for the weight gradient, as without a record."""

    def matmuls(record_overflow):
        step = jaxamp.scaled_value_and_grad(
            weight_gradient_overflow, jaxamp.NoOpLossScale(), record_overflow=record_overflow
        )
        jaxpr = jax.make_jaxpr(step)(W_SMALL, X_LARGE)
        return str(jaxpr).count("dot_general[")

    assert matmuls(record_overflow=True) == matmuls(record_overflow=False) == 2


def test_loss_scaling_keeps_the_same_attribution_without_a_train_state():
    params = init_params(jax.random.key(0))
    tx = jaxamp.loss_scaling(optax.sgd(0.1), jaxamp.StaticLossScale(SCALE))
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state):
        (_, _), grads, finite = jaxamp.scaled_value_and_grad(
            loss_fn, jaxamp.loss_scale_of(opt_state), has_aux=True
        )(params, *batch(), LAYER_3_TERM)
        updates, opt_state = tx.update(grads, opt_state, params, grads_finite=finite)
        return optax.apply_updates(params, updates), opt_state

    _, opt_state = step(params, opt_state)
    record = nonfinite_grads_of(opt_state)
    assert sorted(record.nonfinite_paths()) == sorted(leaves_of_layers(1, 2, 3))


def test_the_overflow_guard_names_the_leaves_from_layer_3_back():
    state = new_state(init_params(jax.random.key(0)))
    for _ in range(2):
        state, _ = train_step(state, *batch(), LAYER_3_TERM)
    where = r"non-finite gradients start at 2: .* 6 leaves, from there back: 2/bias, 2/kernel, 1/bias, 1/kernel and 2"
    with pytest.raises(jaxamp.LossScaleStuckError, match=where) as raised:
        jaxamp.OverflowGuard(max_consecutive_skips=2).check(state)
    assert sorted(raised.value.nonfinite_paths) == sorted(leaves_of_layers(1, 2, 3))


def test_a_resumed_run_reads_the_same_attribution(backward_overflow, tmp_path):
    _, state, _ = backward_overflow
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "state", state)
    checkpointer.wait_until_finished()
    fresh = new_state(init_params(jax.random.key(5)))
    restored = checkpointer.restore(tmp_path / "state", fresh)
    assert restored.nonfinite_grads.nonfinite_paths() == state.nonfinite_grads.nonfinite_paths()
    assert restored.nonfinite_grads.summary() == state.nonfinite_grads.summary()
    assert int(restored.nonfinite_grads.steps_taken) == 1


def test_gradients_of_another_structure_are_refused_with_the_params_named():
    record = NonFiniteGradients.for_params({"a": jnp.zeros(2), "b": jnp.zeros(3)})
    with pytest.raises(ValueError, match=r"gradients have 3 leaves.*params with 2 \(a, b"):
        record.after_step(jnp.ones([3], bool), jnp.array(False))


def test_no_session_no_record_and_no_change_to_the_program():
    params, (x, _) = init_params(jax.random.key(0)), batch()
    plain = jax.make_jaxpr(MODEL)(params, x)
    assert "custom_vjp" not in str(plain) and "reduce_max" not in str(plain)
    outputs, record = record_overflow(MODEL)(params, x)
    np.testing.assert_array_equal(outputs[0], MODEL(params, x)[0])
    assert not record.backward_recorded and len(record.sites) == 4


# Models nobody here wrote the layers of: Flax linen, NNX and Equinox, through autocast.


class LinenMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        for index in range(4):
            x = nn.Dense(WIDTH)(x)
            x = jnp.tanh(x) if index < 3 else x
        return x


class NnxMLP(nnx.Module):
    def __init__(self, rngs):
        self.layer1 = nnx.Linear(WIDTH, WIDTH, rngs=rngs)
        self.layer2 = nnx.Linear(WIDTH, WIDTH, rngs=rngs)
        self.layer3 = nnx.Linear(WIDTH, WIDTH, rngs=rngs)
        self.layer4 = nnx.Linear(WIDTH, WIDTH, rngs=rngs)

    def __call__(self, x):
        x = jnp.tanh(self.layer1(x))
        x = jnp.tanh(self.layer2(x))
        x = jnp.tanh(self.layer3(x))
        return self.layer4(x)


class EqxMLP(eqx.Module):
    layers: list

    def __init__(self, key):
        self.layers = [eqx.nn.Linear(WIDTH, WIDTH, key=k) for k in jax.random.split(key, 4)]

    def __call__(self, x):
        x = jnp.tanh(self.layers[0](x))
        x = jnp.tanh(self.layers[1](x))
        x = jnp.tanh(self.layers[2](x))
        return self.layers[3](x)


def line_of(cls, text):
    source, first = inspect.getsourcelines(cls.__call__)
    return first + next(index for index, line in enumerate(source) if text in line)


def forward_overflow_site(fun, *args):
    _, record = record_overflow(fun)(*args)
    first = record.first_overflow()
    assert first is not None and first.pass_ == "forward"
    return first


def test_linen_names_the_module_path():
    x, _ = batch()
    model = LinenMLP()
    variables = model.init(jax.random.key(0), x)
    kernel = variables["params"]["Dense_2"]["kernel"]
    variables["params"]["Dense_2"]["kernel"] = kernel * 1e6
    site = forward_overflow_site(jaxamp.autocast(model.apply, "mixed_float16"), variables, x)
    assert site.site.name == "LinenMLP/Dense_2"
    site = forward_overflow_site(jaxamp.apply_policy(model, "mixed_float16").apply, variables, x)
    assert site.site.name == "Dense_2", "under apply_policy, the path inside its wrapper: the params' path"
    overridden = jaxamp.apply_policy(model, "mixed_float16", overrides={nn.Dense: "p=f32,c=f16,o=f16"})
    site = forward_overflow_site(overridden.apply, variables, x)
    assert site.site.name == "Dense_2", "the policy scope of an overridden layer is jaxamp's, not a name"


def test_nnx_names_the_users_source_line():
    model = NnxMLP(nnx.Rngs(0))
    model.layer3.kernel[...] = model.layer3.kernel[...] * 1e6
    x, _ = batch()
    site = forward_overflow_site(jaxamp.autocast(lambda m, x: m(x), "mixed_float16"), model, x)
    assert site.site.name.startswith(f"test_overflow_attribution.py:{line_of(NnxMLP, 'self.layer3(')} ")
    assert site.site.name.endswith("(NnxMLP.__call__)")


class NnxBlock(nnx.Module):
    def __init__(self, rngs):
        self.attn = nnx.Linear(WIDTH, WIDTH, rngs=rngs)
        self.mlp = nnx.Linear(WIDTH, WIDTH, rngs=rngs)

    def __call__(self, x):
        return x + self.mlp(jnp.tanh(self.attn(x)))


class TinyLM(nnx.Module):
    """Blocks in an ``nnx.List``, a head, and a probe the model calls on a block's layer directly."""

    def __init__(self, rngs):
        self.blocks = nnx.List([NnxBlock(rngs), NnxBlock(rngs)])
        self.head = nnx.Linear(WIDTH, WIDTH, rngs=rngs)

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x) + self.blocks[0].attn(x)


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_an_nnx_model_under_apply_policy_names_its_layers_by_their_paths_as_linen_does(policy):
    """An NNX model's record names each matmul by its layer's attribute path in the model, as a linen
    model's names ``Dense_3``: a source line (``model.py:34 (TinyLM.__call__)``) shared by every block
    does not say which block overflowed. Under float16 the second block's ``attn``, made to overflow,
    is the first overflow; under bfloat16 nothing overflows and the names are the same."""
    model = TinyLM(nnx.Rngs(0))
    model.blocks[1].attn.kernel[...] = model.blocks[1].attn.kernel[...] * 1e6
    model = jaxamp.apply_policy(model, policy)
    x, _ = batch()
    *_, record = jaxamp.scaled_value_and_grad(
        lambda model: jnp.mean(model(x) ** 2), jaxamp.StaticLossScale(1.0), record_overflow=True
    )(model)
    assert [site.name for site in record.sites] == [
        "blocks/0/attn", "blocks/0/mlp", "blocks/1/attn", "blocks/1/mlp", "head", "blocks/0/attn [2]",
    ]  # fmt: skip
    first = record.first_overflow()
    if policy == "mixed_bfloat16":
        assert first is None
        return
    assert (first.site.name, first.pass_) == ("blocks/1/attn", "forward")
    assert first.site.source == f"test_overflow_attribution.py:{line_of(NnxBlock, 'self.attn(')} (NnxBlock.__call__)"
    assert str(first).startswith(f"forward overflow first in blocks/1/attn at {first.site.source} ")


def test_equinox_names_the_users_source_line():
    model = EqxMLP(jax.random.key(0))
    model = eqx.tree_at(lambda m: m.layers[2].weight, model, model.layers[2].weight * 1e6)
    x, _ = batch()
    site = forward_overflow_site(jaxamp.autocast(jax.vmap(model), "mixed_float16"), x)
    assert site.site.name == "eqx.nn.Linear [3]", "Equinox names its layers' scopes; the third one"
    _, record = record_overflow(jaxamp.autocast(jax.vmap(model), "mixed_float16"))(x)
    assert [site.name for site in record.sites] == [
        "eqx.nn.Linear",
        "eqx.nn.Linear [2]",
        "eqx.nn.Linear [3]",
        "eqx.nn.Linear [4]",
    ], "numbered from the second"
    assert site.site.source.startswith(f"test_overflow_attribution.py:{line_of(EqxMLP, 'self.layers[2](')} ")


def test_an_overflow_record_is_a_pytree_a_jitted_step_returns():
    record = OverflowRecord(jnp.array([1.0, jnp.inf]), jnp.zeros(2), (), 0, True)
    assert len(jax.tree.leaves(record)) == 2
    assert bool(jax.jit(lambda r: r.overflowed)(record))


SHARDED = FreshProcess(
    "overflow_sharded_findings", "-m", "tests.overflow_sharded_checks",
    env={"XLA_FLAGS": xla_flags("--xla_force_host_platform_device_count=8")}, timeout=600,
)  # fmt: skip


@pytest.fixture(scope="module")
def overflow_sharded_findings():
    return SHARDED.last_json_line()


@pytest.mark.parametrize("run", ["jit", "shard_map"])
def test_over_8_devices_an_overflow_on_one_device_is_named_once(overflow_sharded_findings, run):
    finding = overflow_sharded_findings[run]
    assert finding["skipped"] == 1
    assert finding["nonfinite_paths"] == sorted(leaves_of_layers(1, 2, 3))
    assert finding["first_overflow"] == ["layer_3", "backward"]


def test_an_autocast_function_called_inside_another_is_one_site_per_matmul():
    """An autocast call traced inside another's rewrite is part of it: its matmul is a site of the
    outer record, once, not a second block of rows the outer call's sizing did not count."""
    inner = jaxamp.autocast(lambda h, w: h @ w, "mixed_float16")
    outer = jaxamp.autocast(lambda x, w: jnp.tanh(inner(jnp.tanh(x @ w), w)), "mixed_float16")
    x = jnp.ones((2, 4))
    outputs, record = record_overflow(outer)(x, jnp.eye(4))
    np.testing.assert_allclose(outputs, np.tanh(np.tanh(np.ones((2, 4)))), rtol=1e-3)
    assert len(record.sites) == 2 and record.unrecorded == 0
    assert record.forward_amax.shape == (2,)


def test_a_convolution_is_a_site_and_its_overflow_is_named():
    """A ResNet's layers are convolutions: a record watches them as it watches matmuls."""
    x = jnp.ones((1, 4, 4, 2))
    w = jnp.full((3, 3, 2, 2), 1e4)  # each output sums 18 products of 1e4: beyond float16's 65504

    def conv(x, w):
        return jax.lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))

    _, record = record_overflow(jaxamp.autocast(conv, "mixed_float16"))(x, w)
    assert [site.primitive for site in record.sites] == ["conv_general_dilated"]
    assert record.first_overflow() is not None and record.first_overflow().pass_ == "forward"
