"""The model is traced in half, and runs as the program says: five programs a half trace used to change.

Each scenario runs by both routes (`jaxamp.autocast` of a function, `jaxamp.apply_policy` of a
Flax model) in float16 and bfloat16 against float32:

1. a Python constant the half dtype rounds (an epsilon of 1e-12 is 0 in float16; 1e-6 rounds in
   both);
2. a mask filled with -1e9 (-inf in float16), a fully masked row included;
3. a value between two float32 layers (1.6e5, inf in float16), and what a float32 layer sows;
4. a model zoo's ``dtype=float32`` default against a layer pinned to float32 by its author;
5. ``jax.nn.dot_product_attention`` on a CPU.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxamp

POLICIES = ["mixed_float16", "mixed_bfloat16"]
HALF = {"mixed_float16": jnp.dtype(jnp.float16), "mixed_bfloat16": jnp.dtype(jnp.bfloat16)}
F32 = jnp.dtype(jnp.float32)


# --- 1. constants --------------------------------------------------------------------------------


def inverse_rms(h, eps):
    """A hand-written RMS norm's scale, as gemma's RMSNorm writes it."""
    return jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + eps)


class HandWrittenNorm(nn.Module):
    eps: float

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(8, kernel_init=nn.initializers.ones)(x)
        return inverse_rms(h, self.eps)


@pytest.mark.parametrize("eps", [1e-12, 1e-6])
@pytest.mark.parametrize("route", ["autocast", "apply_policy"])
@pytest.mark.parametrize("policy", POLICIES)
def test_an_epsilon_keeps_its_value_on_a_row_of_zeros(policy, route, eps):
    """A padding row (all zeros) normalizes by ``rsqrt(eps)``: 1e6 or 1000 exactly in float32.

    Fails where the trace rounded the epsilon: 1e-12 is 0 in float16 (an inf, then NaN), and 1e-6
    is 1.013e-6 in float16 and 9.98e-7 in bfloat16 (a scale 0.6% or 0.1% off).
    """
    x = jnp.zeros((2, 4)).at[0].set(1.0)
    if route == "autocast":
        got = jaxamp.autocast(lambda h: inverse_rms(h, eps), policy)(x)
    else:
        model = HandWrittenNorm(eps)
        variables = model.init(jax.random.key(0), x)
        got = jaxamp.apply_policy(model, policy).apply(variables, x)
    np.testing.assert_allclose(got[1], np.full(1, 1 / np.sqrt(np.float32(eps))), rtol=1e-6)


# --- 2. mask fills --------------------------------------------------------------------------------

MASK = jnp.array([[True, True, False, False], [False] * 4])  # the second query is padding


def select_masked(scores, mask):
    return jax.nn.softmax(jnp.where(mask, scores, -1e9), axis=-1)


def additive_masked(scores, mask):
    return jax.nn.softmax(scores + jnp.where(mask, 0.0, -1e9), axis=-1)


class MaskedAttention(nn.Module):
    additive: bool

    @nn.compact
    def __call__(self, x, mask):
        scores = nn.Dense(4, kernel_init=nn.initializers.ones)(x)
        return (additive_masked if self.additive else select_masked)(scores, mask)


@pytest.mark.parametrize("additive", [False, True], ids=["where", "additive"])
@pytest.mark.parametrize("route", ["autocast", "apply_policy"])
@pytest.mark.parametrize("policy", POLICIES)
def test_a_fully_masked_row_softmaxes_to_a_uniform_row_not_to_nan(policy, route, additive):
    """Fails where -1e9 became -inf: a row of -inf softmaxes to NaN, which poisons the loss."""
    x = jnp.ones((2, 3))
    if route == "autocast":
        scores = x @ jnp.ones((3, 4))
        fun = additive_masked if additive else select_masked
        got = jaxamp.autocast(fun, policy)(scores, MASK)
    else:
        model = MaskedAttention(additive)
        variables = model.init(jax.random.key(0), x, MASK)
        got = jaxamp.apply_policy(model, policy).apply(variables, x, MASK)
    np.testing.assert_allclose(got, [[0.5, 0.5, 0.0, 0.0], [0.25] * 4], atol=1e-3)


def test_a_product_of_constants_beyond_float16_keeps_its_op_in_float32():
    """300 * 300 fits float16 factor by factor, not as a product: the product's size is what a
    constant's lineage carries (the sum of the factors would say 600, and the op would overflow)."""
    def shifted(x, w):
        return x @ w - jnp.full((4,), 300.0) * jnp.full((4,), 300.0)

    got = jaxamp.autocast(shifted, "mixed_float16")(jnp.ones((2, 4)), jnp.eye(4))
    np.testing.assert_allclose(got, np.full((2, 4), 1.0 - 9e4), rtol=1e-3)


# --- 3. float32 islands ------------------------------------------------------------------------


def between_float32_scopes(w1, w2, x):
    with jaxamp.float32_scope():
        h = x @ w1
    h = jax.nn.relu(h)  # an op of the half-precision caller
    with jaxamp.float32_scope():
        return h @ w2


class TwoFloat32Layers(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Dense(4, use_bias=False, kernel_init=nn.initializers.constant(4e4))(x))
        self.sow("intermediates", "between", h)
        return nn.Dense(1, use_bias=False, kernel_init=nn.initializers.constant(1 / 6.4e5))(h)


@pytest.mark.parametrize("route", ["autocast", "apply_policy"])
@pytest.mark.parametrize("policy", POLICIES)
def test_a_value_between_two_float32_layers_stays_float32(policy, route):
    """1.6e5 between the layers: inf in float16, rounded in bfloat16; the output is 1.0 in float32.

    Fails where the op between the layers rounded the value to the caller's half dtype.
    """
    x = jnp.ones((1, 4))
    if route == "autocast":
        w1, w2 = jnp.full((4, 4), 4e4), jnp.full((4, 1), 1 / 6.4e5)
        got = jaxamp.autocast(between_float32_scopes, policy)(w1, w2, x)
    else:
        model = TwoFloat32Layers()
        variables = model.init(jax.random.key(0), x)
        half = jaxamp.apply_policy(model, policy, overrides={nn.Dense: "float32"})
        got, sown = half.apply(variables, x, mutable=["intermediates"])
        between = sown["intermediates"]["between"][0]
        assert between.dtype == F32
        np.testing.assert_allclose(between, np.full((1, 4), 1.6e5), rtol=1e-6)
    np.testing.assert_allclose(got, [[1.0]], rtol=1e-6)


@pytest.mark.parametrize("policy", POLICIES)
def test_what_a_float32_layer_makes_is_captured_in_float32_and_the_rest_in_half(policy):
    """``capture_intermediates`` returns each layer's output in the dtype it ran in."""
    x = jnp.ones((1, 4))
    model = TwoFloat32Layers()
    variables = model.init(jax.random.key(0), x)

    class Head(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(3)(TwoFloat32Layers(name="body")(nn.Dense(4)(x)))

    head = Head()
    head_variables = head.init(jax.random.key(0), x)
    half = jaxamp.apply_policy(head, policy, overrides={TwoFloat32Layers: "float32"})
    _, captured = half.apply(head_variables, x, capture_intermediates=True)
    intermediates = captured["intermediates"]
    assert intermediates["Dense_0"]["__call__"][0].dtype == HALF[policy]
    assert intermediates["body"]["__call__"][0].dtype == F32
    assert intermediates["Dense_1"]["__call__"][0].dtype == HALF[policy]
    del variables


# --- 4. a model's declared compute dtypes --------------------------------------------------------


class ZooBlock(nn.Module):
    dtype: str = "float32"

    @nn.compact
    def __call__(self, x):
        y = nn.Conv(8, (3, 3), dtype=self.dtype)(x)
        return nn.relu(nn.BatchNorm(use_running_average=True, dtype=self.dtype)(y)) + x


class Zoo(nn.Module):
    """A model zoo's layout: ``dtype=float32`` declared by the model and passed down to every layer."""

    dtype: str = "float32"

    @nn.compact
    def __call__(self, x):
        x = nn.Conv(8, (3, 3), dtype=self.dtype)(x)
        x = ZooBlock(dtype=self.dtype)(x)
        return nn.Dense(10, dtype=self.dtype)(x.mean(axis=(1, 2)))


class Router(nn.Module):
    """A layer pinned to float32 by its author, in a model that declares no dtype."""

    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Dense(16)(x))
        return nn.Dense(4, dtype=jnp.float32)(h)


def _relu_dtypes(fun, *args):
    """The dtypes of the program's ``max`` ops (``nn.relu``)."""
    closed = jax.make_jaxpr(fun)(*args)
    found = []

    def walk(jaxpr):
        for equation in jaxpr.eqns:
            if equation.primitive.name == "max":
                found.append(equation.outvars[0].aval.dtype)
            for value in equation.params.values():
                for inner in value if isinstance(value, (tuple, list)) else (value,):
                    if hasattr(inner, "eqns") or hasattr(getattr(inner, "jaxpr", None), "eqns"):
                        walk(getattr(inner, "jaxpr", inner))

    walk(closed.jaxpr)
    return found


@pytest.mark.parametrize("policy", POLICIES)
def test_a_model_wide_float32_default_computes_in_half_like_a_model_without_dtypes(policy):
    """Fails where the declared float32 cast the activations between the convolutions to float32."""
    x = jnp.ones((2, 8, 8, 3))
    model = Zoo()
    variables = model.init(jax.random.key(0), x)
    half = jaxamp.apply_policy(model, policy)
    relus = _relu_dtypes(lambda v, x: half.apply(v, x), variables, x)
    assert relus and set(relus) == {HALF[policy]}
    _, captured = half.apply(variables, x, capture_intermediates=True)
    assert captured["intermediates"]["ZooBlock_0"]["Conv_0"]["__call__"][0].dtype == HALF[policy]
    np.testing.assert_allclose(half.apply(variables, x), model.apply(variables, x), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("policy", POLICIES)
def test_a_layer_pinned_to_float32_by_its_author_stays_float32_and_an_override_puts_it_in_half(policy):
    x = jnp.ones((2, 8))
    model = Router()
    variables = model.init(jax.random.key(0), x)
    report = jaxamp.precision_report(jaxamp.apply_policy(model, policy).apply, variables, x)
    assert report.count_by_dtype() == {HALF[policy].name: 1, "float32": 1}
    overridden = jaxamp.apply_policy(model, policy, overrides={nn.Dense: policy})
    assert jaxamp.precision_report(overridden.apply, variables, x).count_by_dtype() == {HALF[policy].name: 2}


class Layers(nn.Module):
    """A block that declares no dtype between a model's ``dtype`` and its layers (a stack of them)."""

    layer_dtype: str = "float32"

    @nn.compact
    def __call__(self, x):
        for _ in range(2):
            x = nn.relu(nn.Dense(8, dtype=self.layer_dtype)(x))
        return x


class ZooWithLayers(nn.Module):
    dtype: str = "float32"

    @nn.compact
    def __call__(self, x):
        return nn.Dense(4, dtype=self.dtype)(Layers(layer_dtype=self.dtype)(x))


class NnxLayers(nnx.Module):
    def __init__(self, rngs, dtype):
        self.layers = nnx.List([nnx.Linear(8, 8, dtype=dtype, rngs=rngs) for _ in range(2)])

    def __call__(self, x):
        for layer in self.layers:
            x = nnx.relu(layer(x))
        return x


class NnxZooWithLayers(nnx.Module):
    def __init__(self, rngs, dtype=jnp.float32):
        self.dtype = dtype
        self.body = NnxLayers(rngs, dtype)
        self.head = nnx.Linear(8, 4, dtype=dtype, rngs=rngs)

    def __call__(self, x):
        return self.head(self.body(x))


@pytest.mark.parametrize("policy", POLICIES)
def test_a_model_wide_float32_default_reaches_half_through_a_block_that_declares_no_dtype(policy):
    """EasyDeL's layout: the model's ``dtype`` reaches its layers through blocks and lists that
    declare none; the layers are not pinned to float32 by their authors, and compute in half."""
    x = jnp.linspace(-1.0, 1.0, 16).reshape(2, 8)
    linen_model = ZooWithLayers()
    variables = linen_model.init(jax.random.key(0), x)
    linen_half = jaxamp.apply_policy(linen_model, policy)
    assert jaxamp.precision_report(linen_half.apply, variables, x).count_by_dtype() == {HALF[policy].name: 3}
    nnx_half = jaxamp.apply_policy(NnxZooWithLayers(nnx.Rngs(0)), policy)
    assert jaxamp.precision_report(nnx_half, x).count_by_dtype() == {HALF[policy].name: 3}


class BridgedMlp(nnx.Module):
    def __init__(self, rngs):
        self.first = nnx.Linear(8, 16, rngs=rngs)
        self.second = nnx.Linear(16, 4, rngs=rngs)

    def __call__(self, x):
        return self.second(nnx.relu(self.first(x)))


@pytest.mark.parametrize("policy", POLICIES)
def test_an_nnx_model_bridged_to_linen_runs_in_half(policy):
    """MaxText's layers are NNX modules behind ``nnx.bridge.ToLinen``, whose ``__getattr__`` runs a
    module method: reading its ``dtype`` from inside the policy's interceptor re-entered the
    interceptor until Python's recursion limit."""
    from flax.nnx import bridge

    x = jnp.linspace(-1.0, 1.0, 16).reshape(2, 8)
    model = bridge.to_linen(BridgedMlp)
    variables = model.init(jax.random.key(0), x)
    half = jaxamp.apply_policy(model, policy)
    assert jaxamp.precision_report(half.apply, variables, x).count_by_dtype() == {HALF[policy].name: 2}
    np.testing.assert_allclose(half.apply(variables, x), model.apply(variables, x), rtol=2e-2, atol=2e-2)


class NnxZoo(nnx.Module):
    def __init__(self, rngs, dtype=jnp.float32):
        self.dtype = dtype
        self.first = nnx.Linear(8, 16, dtype=dtype, rngs=rngs)
        self.router = nnx.Linear(16, 4, dtype=dtype, rngs=rngs)

    def __call__(self, x):
        return self.router(nnx.relu(self.first(x)))


class NnxRouter(nnx.Module):
    def __init__(self, rngs):
        self.first = nnx.Linear(8, 16, rngs=rngs)
        self.router = nnx.Linear(16, 4, dtype=jnp.float32, rngs=rngs)

    def __call__(self, x):
        return self.router(nnx.relu(self.first(x)))


@pytest.mark.parametrize("policy", POLICIES)
def test_nnx_drops_a_model_wide_float32_default_and_keeps_a_pinned_float32_layer(policy):
    x = jnp.ones((2, 8))
    zoo = jaxamp.apply_policy(NnxZoo(nnx.Rngs(0)), policy)
    assert jaxamp.precision_report(zoo, x).count_by_dtype() == {HALF[policy].name: 2}
    router = jaxamp.apply_policy(NnxRouter(nnx.Rngs(0)), policy)
    assert jaxamp.precision_report(router, x).count_by_dtype() == {HALF[policy].name: 1, "float32": 1}


# --- 5. jax.nn.dot_product_attention on a CPU ------------------------------------------------------


@pytest.mark.parametrize("implementation", [None, "xla"])
@pytest.mark.parametrize("policy", POLICIES)
def test_dot_product_attention_runs_on_a_cpu_under_autocast(policy, implementation):
    """Traced in float16, JAX asks for the ``F16_F16_F32`` dot algorithm, which a compiled CPU
    program refuses; jax.jit of the float16 call fails the same way without jaxamp."""
    q = jax.random.normal(jax.random.key(0), (1, 4, 2, 8))

    def attention(q):
        return jax.nn.dot_product_attention(q, q, q, implementation=implementation)

    got = jax.jit(jaxamp.autocast(attention, policy))(q)
    np.testing.assert_allclose(got, attention(q), atol=3e-2)


def test_on_an_h200_a_model_wide_float32_default_needs_the_memory_of_the_model_without_dtypes():
    """Compiled for an H200 without a GPU (the CUDA plugin): the train step of the zoo model under
    ``mixed_float16`` needs the temp memory of the same model written without dtypes."""
    if not jaxamp.diagnostics.cuda_plugin_available():
        pytest.skip("needs the CUDA PJRT plugin (pip install 'jax-mixed-precision[gpu-aot]')")
    device = jaxamp.diagnostics.gpu_target_device("h200")
    x = jnp.ones((8, 32, 32, 3))
    temp = {}
    for dtype in ("float32", None):
        model = Zoo(dtype=dtype)
        variables = model.init(jax.random.key(0), x)
        half = jaxamp.apply_policy(model, "mixed_float16")

        def loss(variables, x, half=half):
            return jnp.mean(half.apply(variables, x) ** 2)

        args = jaxamp.diagnostics.on_device((variables, x), device)
        compiled = jax.jit(jax.grad(loss)).lower(*args).compile()
        temp[dtype] = compiled.memory_analysis().temp_size_in_bytes
    assert temp["float32"] == temp[None], temp
