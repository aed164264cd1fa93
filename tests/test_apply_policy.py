"""Tests for `jaxamp.apply_policy` on linen and NNX models.

The models here are written the way published models are: with no dtype
arguments at all, or with dtype fields pinned to float32. Only
`apply_policy` makes them mixed precision: the wrapped model is traced as it
is and `jaxamp.autocast` rewrites the traced program op by op (matmuls and
convolutions in the compute dtype, reductions and normalizations in
float32, a bias or a norm's scale added in float32 and rounded once).
Normalization layers and overridden classes run in a policy scope of their
own. What the models actually compute in is read from the rewritten jaxprs:
`jaxamp.precision_report` for the matmuls and convolutions, the dtype each
param enters the computation in, the dtype a layer hands to the next one,
and the policy scope a layer's operations run in. Values a model returns on
the side (``capture_intermediates``, sown NNX values, batch statistics) come
back in the dtypes the model was traced with.
"""

import functools
import re
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx, traverse_util

import jaxamp

F32, F16, BF16 = np.dtype(jnp.float32), np.dtype(jnp.float16), np.dtype(jnp.bfloat16)
IMAGES = jax.random.normal(jax.random.key(1), (2, 4, 4, 3))

# name: (param dtype, compute dtype, output dtype)
POLICIES = {
    "float32": (F32, F32, F32),
    "mixed_float16": (F32, F16, F32),
    "mixed_bfloat16": (F32, BF16, F32),
    "float16": (F16, F16, F16),
}
HALF_POLICIES = ["mixed_float16", "mixed_bfloat16", "float16"]


# --- what a traced function does with its inputs ---------------------------------


def leaf_name(path):
    return "/".join(str(key.key) for key in path if isinstance(key, jax.tree_util.DictKey))


# Operations that only move or cast a value: a param is followed through them
# to the operations that compute with it.
STRUCTURAL = frozenset(
    {"convert_element_type", "reshape", "broadcast_in_dim", "squeeze", "expand_dims", "transpose"}
)
HEAVY = ("dot_general", "conv_general_dilated")
POLICY_SCOPE = re.compile(r"jaxamp_policy\.[a-z0-9.-]+")


def policy_scope_of(equation):
    """The innermost jaxamp policy scope `equation` was traced in (its name), or None."""
    scopes = POLICY_SCOPE.findall(str(equation.source_info.name_stack))
    return scopes[-1] if scopes else None


def is_variable(atom):
    return not isinstance(atom, jax.extend.core.Literal)


def param_uses(fun, tree, *args):
    """{leaf name: {(dtype, policy scope)}}: how the rewritten `fun` computes with each leaf of `tree`.

    Each leaf is followed through casts and reshapes to the operations that
    compute with it; each such operation adds the dtype the leaf enters it in
    and the policy scope it runs in (None outside any).
    """
    jaxpr = jax.make_jaxpr(fun)(tree, *args).jaxpr
    readers = {}
    for equation in jaxpr.eqns:
        for operand in filter(is_variable, equation.invars):
            readers.setdefault(operand, []).append(equation)
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    uses = {}
    for (path, _), invar in zip(leaves, jaxpr.invars, strict=False):
        found, pending = set(), [invar]
        while pending:
            value = pending.pop()
            for equation in readers.get(value, ()):
                if equation.primitive.name in STRUCTURAL:
                    pending.extend(equation.outvars)
                else:
                    found.add((np.dtype(value.aval.dtype), policy_scope_of(equation)))
        uses[leaf_name(path)] = found
    return uses


def read_dtypes(uses):
    """{leaf name: the dtypes it enters the computation in}, from `param_uses`."""
    return {name: {dtype for dtype, _ in found} for name, found in uses.items()}


def read_scopes(uses):
    """{leaf name: the policy scopes of the operations computing with it}, from `param_uses`."""
    return {name: {scope for _, scope in found} for name, found in uses.items()}


def expected_reads(param_dtype, compute_dtype, **kernels):
    """The dtype each ConvNet param is computed with, by param name.

    Kernels are cast to the compute dtype of their layer's matmul or
    convolution (`kernels`: layer -> another compute dtype); a bias is added
    in its own dtype to the upcast activation (float32 under the mixed
    policies) and the sum rounded once; the batch norm's params are used in
    float32.
    """
    compute = {layer: kernels.get(layer, compute_dtype) for layer in ("conv", "dense", "head")}
    return {
        "conv/kernel": {compute["conv"]},
        "conv/bias": {param_dtype},
        "norm/scale": {F32},
        "norm/bias": {F32},
        "dense/kernel": {compute["dense"]},
        "dense/bias": {param_dtype},
        "head/kernel": {compute["head"]},
    }


def dtypes_of(tree):
    return {leaf.dtype for leaf in jax.tree.leaves(tree)}


def traced_intermediates(model, variables, inputs=IMAGES):
    """Abstract outputs and `capture_intermediates` of a linen model's apply."""
    capture = functools.partial(model.apply, capture_intermediates=True, mutable=["intermediates"])
    outputs, state = jax.eval_shape(capture, variables, inputs)
    return outputs, state["intermediates"]


# --- linen ---------------------------------------------------------------------------


class Projection(nn.Module):
    """A custom layer that reads its param with `self.param` and multiplies."""

    features: int

    @nn.compact
    def __call__(self, x):
        kernel = self.param("kernel", nn.initializers.lecun_normal(), (x.shape[-1], self.features))
        return x @ kernel


class ConvNet(nn.Module):
    """A model written with no dtype anywhere."""

    def setup(self):
        self.conv = nn.Conv(4, (3, 3))
        self.norm = nn.BatchNorm()
        self.dense = nn.Dense(8)
        self.head = Projection(3)

    def features(self, x, train=False):
        x = self.norm(self.conv(x), use_running_average=not train)
        return nn.relu(x).reshape((x.shape[0], -1))

    def __call__(self, x, train=False):
        return self.head(self.dense(self.features(x, train)))


LAYERS = ("conv", "norm", "dense", "head")
LAYER_OF_CLASS = {nn.Conv: "conv", nn.BatchNorm: "norm", nn.Dense: "dense", Projection: "head"}


@functools.cache
def linen_model(policy, overrides=()):
    """The wrapped ConvNet and its abstract variables (`overrides` as pairs).

    Dtypes, reports and jaxprs need only shapes, so nothing is compiled.
    """
    model = jaxamp.apply_policy(ConvNet(), policy, overrides=dict(overrides))
    return model, jax.eval_shape(model.init, jax.random.key(0), IMAGES)


def linen_jaxpr(policy, overrides=(), **apply_kwargs):
    """The rewritten jaxpr of the wrapped ConvNet's apply."""
    model, variables = linen_model(policy, overrides)
    return jax.make_jaxpr(functools.partial(model.apply, **apply_kwargs))(variables, IMAGES).jaxpr


def linen_param_uses(policy, overrides=()):
    """`param_uses` of the wrapped ConvNet's params, named 'layer/param'."""
    model, variables = linen_model(policy, overrides)
    uses = param_uses(model.apply, variables, IMAGES)
    return {name.removeprefix("params/"): found for name, found in uses.items() if name.startswith("params/")}


def layer_of(equation):
    """The ConvNet layer `equation` was traced in (from its name stack), or None."""
    names = str(equation.source_info.name_stack).split("/")
    return next((name for name in reversed(names) if name in LAYERS), None)


def matmul_operands_by_layer(jaxpr):
    """{layer: (lhs dtype, rhs dtype)} of each layer's matmul or convolution."""
    return {
        layer_of(equation): tuple(np.dtype(operand.aval.dtype) for operand in equation.invars[:2])
        for equation in jaxpr.eqns
        if equation.primitive.name in HEAVY
    }


def scopes_by_layer(jaxpr):
    """{layer: the policy scopes its operations run in (None: the model's own policy)}."""
    scopes = {}
    for equation in jaxpr.eqns:
        if layer_of(equation) is not None:
            scopes.setdefault(layer_of(equation), set()).add(policy_scope_of(equation))
    return scopes


def results_of(jaxpr, layer):
    """The dtypes in which the operations after `layer` read what it made.

    A cast traced between layers is followed: it is how a result leaves a
    policy scope in the scope's exit dtype. (A cast inside the next layer is
    that layer's own business: the batch norm upcasts what it reads.)
    """
    made = {
        variable for equation in jaxpr.eqns if layer_of(equation) == layer for variable in equation.outvars
    }
    dtypes = set()
    for equation in jaxpr.eqns:
        if layer_of(equation) == layer:
            continue
        for operand in filter(is_variable, equation.invars):
            if operand in made:
                exits = equation.primitive.name == "convert_element_type" and layer_of(equation) is None
                dtypes.add(np.dtype(equation.params["new_dtype"] if exits else operand.aval.dtype))
    return dtypes


def norm_scope(compute_dtype):
    """The policy scope a normalization layer runs in under a policy computing in `compute_dtype`.

    Float32 inside, the caller's compute dtype on the way out; none where
    that is the caller's own policy.
    """
    return None if compute_dtype == F32 else f"jaxamp_policy.c-float32.o-{compute_dtype.name}"


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_linen_params_are_created_in_the_param_dtype_and_batch_stats_in_float32(policy):
    param_dtype, _, _ = POLICIES[policy]
    _, variables = linen_model(policy)
    assert dtypes_of(variables["params"]) == {param_dtype}
    assert dtypes_of(variables["batch_stats"]) == {F32}


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_linen_variables_have_the_unwrapped_models_structure_and_names(policy):
    wrapped = jax.eval_shape(jaxamp.apply_policy(ConvNet(), policy).init, jax.random.key(0), IMAGES)
    unwrapped = jax.eval_shape(ConvNet().init, jax.random.key(0), IMAGES)
    assert jax.tree.structure(wrapped) == jax.tree.structure(unwrapped)

    def shapes(variables):
        return {name: leaf.shape for name, leaf in traverse_util.flatten_dict(variables, sep="/").items()}

    assert shapes(wrapped) == shapes(unwrapped)
    assert sorted(shapes(wrapped)) == [
        "batch_stats/norm/mean",
        "batch_stats/norm/var",
        "params/conv/bias",
        "params/conv/kernel",
        "params/dense/bias",
        "params/dense/kernel",
        "params/head/kernel",
        "params/norm/bias",
        "params/norm/scale",
    ]


@pytest.mark.parametrize("policy, rtol", [("float32", 0), ("mixed_float16", 2e-2), ("mixed_bfloat16", 5e-2)])
def test_linen_float32_weights_of_the_unwrapped_model_load_unchanged(policy, rtol):
    pretrained = jax.jit(ConvNet().init)(jax.random.key(3), IMAGES)
    expected = jax.jit(ConvNet().apply)(pretrained, IMAGES)
    model, _ = linen_model(policy)
    outputs = jax.jit(model.apply)(pretrained, IMAGES)
    assert outputs.dtype == F32
    np.testing.assert_allclose(outputs, expected, rtol=rtol, atol=rtol * float(jnp.max(jnp.abs(expected))))


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_linen_each_layer_hands_the_next_one_the_compute_dtype_and_the_output_is_in_the_output_dtype(policy):
    param_dtype, compute_dtype, output_dtype = POLICIES[policy]
    jaxpr = linen_jaxpr(policy)
    # The conv reads the input cast at the model's entry; the dense and the
    # head read what the layer before handed on: all in the compute dtype.
    assert matmul_operands_by_layer(jaxpr) == {
        layer: (compute_dtype, compute_dtype) for layer in ("conv", "dense", "head")
    }
    # The conv's and the dense's bias adds are rounded to the compute dtype,
    # and the batch norm hands its float32 result on in it too.
    assert {layer: results_of(jaxpr, layer) for layer in ("conv", "norm", "dense")} == {
        layer: {compute_dtype} for layer in ("conv", "norm", "dense")
    }
    model, variables = linen_model(policy)
    outputs, intermediates = traced_intermediates(model, variables)
    assert outputs.dtype == output_dtype
    # capture_intermediates gives the unwrapped model's entries (one per layer
    # and one root entry, not one more for the wrapper), in the dtype the
    # model was traced and ran in: the compute dtype, the batch norm's
    # included (it hands its result back in its caller's compute dtype).
    _, unwrapped = jax.eval_shape(
        functools.partial(ConvNet().apply, capture_intermediates=True, mutable=["intermediates"]),
        variables,
        IMAGES,
    )
    assert jax.tree.structure(intermediates) == jax.tree.structure(unwrapped["intermediates"])
    assert set(intermediates) == {*LAYERS, "__call__"}
    assert dtypes_of(intermediates) == {compute_dtype}


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_linen_a_second_model_under_an_equal_policy_hands_on_the_compute_dtype_too(policy):
    _, compute_dtype, _ = POLICIES[policy]

    def hand_offs():
        model = jaxamp.apply_policy(ConvNet(), policy)
        variables = jax.eval_shape(model.init, jax.random.key(0), IMAGES)
        jaxpr = jax.make_jaxpr(model.apply)(variables, IMAGES).jaxpr
        handed_on = {layer: results_of(jaxpr, layer) for layer in ("conv", "norm", "dense")}
        return matmul_operands_by_layer(jaxpr), handed_on

    first, second = hand_offs(), hand_offs()
    assert first == (
        {layer: (compute_dtype, compute_dtype) for layer in ("conv", "dense", "head")},
        {layer: {compute_dtype} for layer in ("conv", "norm", "dense")},
    )
    assert second == first


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_linen_every_matmul_and_conv_runs_in_the_compute_dtype(policy):
    _, compute_dtype, _ = POLICIES[policy]
    model, variables = linen_model(policy)
    report = jaxamp.precision_report(model.apply, variables, IMAGES)
    assert report.count_by_dtype() == {compute_dtype.name: 3}
    assert report.fraction(compute_dtype) == 1.0


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_linen_kernels_are_read_in_the_compute_dtype_biases_in_the_param_dtype_norm_params_in_float32(policy):
    param_dtype, compute_dtype, _ = POLICIES[policy]
    uses = linen_param_uses(policy)
    assert read_dtypes(uses) == expected_reads(param_dtype, compute_dtype)
    # Only the batch norm's params are used in a policy scope of its own.
    assert read_scopes(uses) == {
        name: {norm_scope(compute_dtype)} if name.startswith("norm/") else {None} for name in uses
    }


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_linen_batch_norm_computes_in_float32_and_hands_on_the_compute_dtype(policy):
    _, compute_dtype, _ = POLICIES[policy]
    jaxpr = linen_jaxpr(policy, train=True, mutable=["batch_stats"])
    norm = [equation for equation in jaxpr.eqns if layer_of(equation) == "norm"]
    computing = [equation for equation in norm if equation.primitive.name not in STRUCTURAL]
    names = {equation.primitive.name for equation in computing}
    assert {"reduce_sum", "rsqrt", "square", "sub", "mul", "add"} <= names
    # The statistics, the running averages and the normalization itself
    # (scale and bias included) are all computed in float32.
    assert {np.dtype(outvar.aval.dtype) for equation in computing for outvar in equation.outvars} == {F32}
    assert {np.dtype(operand.aval.dtype) for equation in computing for operand in equation.invars} == {F32}
    assert {policy_scope_of(equation) for equation in norm} == {norm_scope(compute_dtype)}
    # Its result goes on to the next layer in the compute dtype.
    assert results_of(jaxpr, "norm") == {compute_dtype}
    assert matmul_operands_by_layer(jaxpr)["dense"] == (compute_dtype, compute_dtype)


@pytest.mark.parametrize("policy", ["mixed_float16", "float16"])
def test_linen_batch_stats_update_in_float32(policy):
    model, _ = linen_model(policy)
    variables = jax.jit(model.init)(jax.random.key(0), IMAGES)
    outputs, updates = jax.jit(functools.partial(model.apply, train=True, mutable=["batch_stats"]))(
        variables, IMAGES
    )
    assert set(updates) == {"batch_stats"}
    assert jax.tree.structure(updates["batch_stats"]) == jax.tree.structure(variables["batch_stats"])
    assert dtypes_of(updates["batch_stats"]) == {F32}
    for new, old in zip(jax.tree.leaves(updates["batch_stats"]), jax.tree.leaves(variables["batch_stats"])):
        assert not np.array_equal(new, old)
    assert outputs.dtype == POLICIES[policy][2]


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_linen_backward_matmuls_run_in_the_compute_dtype_too(policy):
    _, compute_dtype, _ = POLICIES[policy]
    model, variables = linen_model(policy)

    def loss(params, batch_stats):
        return jnp.mean(model.apply({"params": params, "batch_stats": batch_stats}, IMAGES) ** 2)

    args = (variables["params"], variables["batch_stats"])
    report = jaxamp.precision_report(jax.grad(loss), *args)
    assert len(report.ops) > 3  # the forward pass has three
    assert report.fraction(compute_dtype) == 1.0
    assert dtypes_of(jax.eval_shape(jax.grad(loss), *args)) == {F32}


class PinnedFloat32Encoder(nn.Module):
    """A published-style model that pins float32 into every layer."""

    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        x = nn.Conv(8, (3,), dtype=self.dtype, param_dtype=jnp.float32)(x)
        x = nn.LayerNorm(dtype=self.dtype)(x)
        x = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=8, dtype=self.dtype)(x)
        x = nn.Einsum((8, 4), "bld,de->ble", dtype=self.dtype)(x)
        return nn.Dense(3, dtype=jnp.float32, param_dtype=jnp.float32)(x)


@pytest.mark.parametrize("policy", HALF_POLICIES)
def test_linen_a_model_pinned_to_float32_still_computes_in_the_policy_dtype(policy):
    param_dtype, compute_dtype, output_dtype = POLICIES[policy]
    tokens = jnp.ones((2, 5, 6))
    model = jaxamp.apply_policy(PinnedFloat32Encoder(), policy)
    variables = jax.eval_shape(model.init, jax.random.key(0), tokens)
    assert dtypes_of(variables["params"]) == {param_dtype}
    report = jaxamp.precision_report(model.apply, variables, tokens)
    assert len(report.ops) == 9  # conv, q/k/v, two attention einsums, out, einsum, dense
    assert report.fraction(compute_dtype) == 1.0
    assert jax.eval_shape(model.apply, variables, tokens).dtype == output_dtype
    # Unwrapped, the same model computes in float32 from half-precision inputs.
    unwrapped = jaxamp.precision_report(PinnedFloat32Encoder().apply, variables, tokens.astype(compute_dtype))
    assert unwrapped.fraction(F32) == 1.0


def scope_name(spec):
    """The policy scope a layer overridden with `spec` runs in: its compute dtype inside, its output dtype out."""
    policy = jaxamp.get_policy(spec)
    return f"jaxamp_policy.c-{np.dtype(policy.compute_dtype).name}.o-{np.dtype(policy.output_dtype).name}"


@pytest.mark.parametrize(
    "overrides, changed, handed_on",
    [
        ({nn.Dense: "float32"}, {"dense": F32}, {"dense": F32}),
        ({Projection: "float32"}, {"head": F32}, {}),
        ({nn.Conv: "mixed_bfloat16"}, {"conv": BF16}, {}),
        ({nn.BatchNorm: "params=float32,compute=float16,output=float16"}, {"norm": F16}, {"norm": F16}),
        ({nn.Dense: "float32", Projection: "float32"}, {"dense": F32, "head": F32}, {"dense": F32}),
    ],
    ids=["dense_float32", "custom_layer_float32", "conv_bfloat16", "batch_norm_float16", "two_classes"],
)
def test_linen_overrides_run_a_layer_class_under_its_own_policy(overrides, changed, handed_on):
    # Each layer's compute dtype; the batch norm's is float32 unless overridden.
    expected = {"conv": F16, "norm": F32, "dense": F16, "head": F16, **changed}
    pairs = tuple(overrides.items())
    model, variables = linen_model("mixed_float16", pairs)
    assert dtypes_of(variables["params"]) == {F32}
    jaxpr = linen_jaxpr("mixed_float16", pairs)

    # Each matmul and conv runs in its layer's compute dtype, the others'
    # reading the compute dtype of the model whatever the layer before them.
    assert matmul_operands_by_layer(jaxpr) == {
        layer: (expected[layer], expected[layer]) for layer in ("conv", "dense", "head")
    }
    report = jaxamp.precision_report(model.apply, variables, IMAGES)
    matmul_dtypes = [expected[layer].name for layer in ("conv", "dense", "head")]
    assert report.count_by_dtype() == {name: matmul_dtypes.count(name) for name in set(matmul_dtypes)}
    kernels = {layer: dtype for layer, dtype in changed.items() if layer != "norm"}
    assert read_dtypes(linen_param_uses("mixed_float16", pairs)) == expected_reads(F32, F16, **kernels)

    # An overridden layer runs in its override's policy scope; the others as
    # without overrides (the batch norm in its float32 one).
    scopes = {"conv": {None}, "norm": {norm_scope(F16)}, "dense": {None}, "head": {None}}
    scopes.update({LAYER_OF_CLASS[module_class]: {scope_name(spec)} for module_class, spec in pairs})
    assert scopes_by_layer(jaxpr) == scopes
    # What an overridden layer hands on is in its override's output dtype.
    assert {layer: results_of(jaxpr, layer) for layer in handed_on} == {
        layer: {dtype} for layer, dtype in handed_on.items()
    }
    assert jax.eval_shape(model.apply, variables, IMAGES).dtype == F32


@pytest.mark.parametrize("method", ["features", ConvNet.features], ids=["name", "function"])
def test_linen_method_is_routed_through_the_policy(method):
    model, variables = linen_model("mixed_float16")
    features = jax.eval_shape(functools.partial(model.apply, method=method), variables, IMAGES)
    assert (features.shape, features.dtype) == ((2, 64), F32)
    report = jaxamp.precision_report(functools.partial(model.apply, method=method), variables, IMAGES)
    assert report.count_by_dtype() == {"float16": 1}
    partial_variables = jax.eval_shape(
        functools.partial(model.init, method=method), jax.random.key(0), IMAGES
    )
    assert set(partial_variables["params"]) == {"conv", "norm"}
    assert dtypes_of(partial_variables["params"]) == {F32}


def test_linen_an_unknown_method_is_an_attribute_error():
    model, variables = linen_model("mixed_float16")
    with pytest.raises(AttributeError, match="encode"):
        model.apply(variables, IMAGES, method="encode")


# --- NNX ---------------------------------------------------------------------------------


class NnxProjection(nnx.Module):
    """A custom layer that multiplies by its own `nnx.Param`."""

    def __init__(self, in_features, out_features, *, rngs):
        self.kernel = nnx.Param(jax.random.normal(rngs.params(), (in_features, out_features)) * 0.1)

    def __call__(self, x):
        return x @ self.kernel[...]


class NnxConvNet(nnx.Module):
    """The NNX twin of ConvNet: no dtype anywhere."""

    def __init__(self, *, rngs):
        self.conv = nnx.Conv(3, 4, (3, 3), rngs=rngs)
        self.norm = nnx.BatchNorm(4, use_running_average=True, rngs=rngs)
        self.dense = nnx.Linear(64, 8, rngs=rngs)
        self.head = NnxProjection(8, 3, rngs=rngs)

    def __call__(self, x):
        x = nnx.relu(self.norm(self.conv(x)))
        return self.head(self.dense(x.reshape((x.shape[0], -1))))


NNX_LAYER_OF_CLASS = {nnx.Linear: "dense", NnxProjection: "head", nnx.BatchNorm: "norm"}


def functional(model):
    """`model`'s call as a pure function of its state, for tracing."""
    graphdef, state = nnx.split(model)
    return (lambda state, x: nnx.merge(graphdef, state)(x)), state


def nnx_param_uses(model):
    """`param_uses` of the model's state (params and batch statistics), named 'layer/variable'."""
    call, state = functional(model)
    return param_uses(call, state, IMAGES)


def nnx_expected_reads(param_dtype, compute_dtype, **kernels):
    """`expected_reads`, and the batch norm's running statistics used in float32."""
    return {**expected_reads(param_dtype, compute_dtype, **kernels), "norm/mean": {F32}, "norm/var": {F32}}


def param_dtypes(model):
    return dtypes_of(nnx.state(model, nnx.Param))


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_nnx_state_stays_in_the_param_dtype_and_outputs_come_in_the_output_dtype(policy):
    param_dtype, _, output_dtype = POLICIES[policy]
    model = jaxamp.apply_policy(NnxConvNet(rngs=nnx.Rngs(0)), policy)
    assert param_dtypes(model) == {param_dtype}
    assert dtypes_of(nnx.state(model, nnx.BatchStat)) == {F32}
    before = jax.tree.map(np.asarray, nnx.state(model))
    assert model(IMAGES).dtype == output_dtype
    after = nnx.state(model)
    assert jax.tree.structure(after) == jax.tree.structure(before)
    for new, old in zip(jax.tree.leaves(after), jax.tree.leaves(before), strict=True):
        assert new.dtype == old.dtype
        np.testing.assert_array_equal(new, old)


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_nnx_layers_compute_in_the_compute_dtype_with_biases_in_the_param_dtype_and_norms_in_float32(policy):
    param_dtype, compute_dtype, _ = POLICIES[policy]
    model = jaxamp.apply_policy(NnxConvNet(rngs=nnx.Rngs(0)), policy)
    call, state = functional(model)
    report = jaxamp.precision_report(call, state, IMAGES)
    assert report.count_by_dtype() == {compute_dtype.name: 3}
    # Each layer reads the previous one's result in the compute dtype.
    assert [op.operand_dtypes for op in report.ops] == [(compute_dtype.name, compute_dtype.name)] * 3
    uses = nnx_param_uses(model)
    expected = nnx_expected_reads(param_dtype, compute_dtype)
    if param_dtype != F32:
        # NNX's BatchNorm returns float32 when traced (its statistics are
        # float32), so Flax promotes the next Linear's float16 bias to float32
        # where it is added: the add runs in float32 and rounds once to float16.
        expected["dense/bias"] = {F32}
    assert read_dtypes(uses) == expected
    assert read_scopes(uses) == {
        name: {norm_scope(compute_dtype)} if name.startswith("norm/") else {None} for name in uses
    }


@pytest.mark.parametrize("policy", ["mixed_float16", "float16"])
def test_nnx_the_original_module_is_untouched(policy):
    original = NnxConvNet(rngs=nnx.Rngs(0))
    before = jax.tree.map(np.asarray, nnx.state(original))
    classes = {path: type(module) for path, module in nnx.iter_modules(original)}
    model = jaxamp.apply_policy(original, policy)
    model(IMAGES)
    assert {path: type(module) for path, module in nnx.iter_modules(original)} == classes
    for new, old in zip(jax.tree.leaves(nnx.state(original)), jax.tree.leaves(before), strict=True):
        assert new.dtype == old.dtype
        np.testing.assert_array_equal(new, old)
    call, state = functional(original)
    assert jaxamp.precision_report(call, state, IMAGES).fraction(F32) == 1.0
    assert original(IMAGES).dtype == F32


def test_nnx_grad_gives_float32_grads_and_leaves_the_params_float32():
    model = jaxamp.apply_policy(NnxConvNet(rngs=nnx.Rngs(0)), "mixed_float16")

    def loss(model):
        return jnp.mean(model(IMAGES) ** 2)

    grads = nnx.grad(loss)(model)
    leaves = jax.tree.leaves(grads)
    assert len(leaves) == 7
    assert dtypes_of(grads) == {F32}
    assert all(np.all(np.isfinite(leaf)) for leaf in leaves)
    assert any(np.any(leaf != 0) for leaf in leaves)
    assert param_dtypes(model) == {F32}


def test_nnx_batch_stats_update_in_float32_in_train_mode():
    model = jaxamp.apply_policy(NnxConvNet(rngs=nnx.Rngs(0)), "mixed_float16")
    model.train()
    before = jax.tree.map(np.asarray, nnx.state(model, nnx.BatchStat))
    assert model(IMAGES).dtype == F32
    after = nnx.state(model, nnx.BatchStat)
    assert dtypes_of(after) == {F32}
    for new, old in zip(jax.tree.leaves(after), jax.tree.leaves(before), strict=True):
        assert not np.array_equal(new, old)


@pytest.mark.parametrize(
    "overrides, changed",
    [
        ({nnx.Linear: "float32"}, {"dense": F32}),
        ({NnxProjection: "float32"}, {"head": F32}),
        ({nnx.BatchNorm: "params=float32,compute=float16,output=float16"}, {"norm": F16}),
    ],
    ids=["linear_float32", "custom_layer_float32", "batch_norm_float16"],
)
def test_nnx_overrides_run_a_layer_class_under_its_own_policy(overrides, changed):
    expected = {"conv": F16, "norm": F32, "dense": F16, "head": F16, **changed}
    model = jaxamp.apply_policy(NnxConvNet(rngs=nnx.Rngs(0)), "mixed_float16", overrides=overrides)
    call, state = functional(model)
    report = jaxamp.precision_report(call, state, IMAGES)
    # conv, dense, head in program order, each in its layer's compute dtype.
    assert [op.operand_dtypes for op in report.ops] == [
        (expected[layer].name, expected[layer].name) for layer in ("conv", "dense", "head")
    ]
    uses = nnx_param_uses(model)
    kernels = {layer: dtype for layer, dtype in changed.items() if layer != "norm"}
    assert read_dtypes(uses) == nnx_expected_reads(F32, F16, **kernels)
    # The overridden layer computes in its override's policy scope; the
    # others as without overrides.
    scopes = {"conv": {None}, "norm": {norm_scope(F16)}, "dense": {None}, "head": {None}}
    scopes.update(
        {NNX_LAYER_OF_CLASS[module_class]: {scope_name(spec)} for module_class, spec in overrides.items()}
    )
    by_layer = {}
    for name, found in read_scopes(uses).items():
        by_layer.setdefault(name.split("/")[0], set()).update(found)
    assert by_layer == scopes
    assert param_dtypes(model) == {F32}
    assert model(IMAGES).dtype == F32


class HiddenLinear(nnx.Linear):
    """A Linear that no other test wraps: jaxamp's per-class caches start empty."""


class NnxTwoLinear(nnx.Module):
    def __init__(self, *, rngs):
        self.first = HiddenLinear(3, 4, rngs=rngs)
        self.second = nnx.Linear(4, 2, rngs=rngs)

    def __call__(self, x):
        return self.second(self.first(x))


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_nnx_a_layer_class_once_wrapped_on_its_own_still_hands_on_the_compute_dtype(policy):
    _, compute_dtype, output_dtype = POLICIES[policy]
    inputs = jnp.ones((1, 3))
    half = (compute_dtype.name, compute_dtype.name)
    standalone = jaxamp.apply_policy(HiddenLinear(3, 4, rngs=nnx.Rngs(0)), policy)
    assert standalone(inputs).dtype == output_dtype
    assert [op.operand_dtypes for op in jaxamp.precision_report(lambda x: standalone(x), inputs).ops] == [
        half
    ]

    model = jaxamp.apply_policy(NnxTwoLinear(rngs=nnx.Rngs(0)), policy)
    assert model(inputs).dtype == output_dtype
    # The second Linear reads what the first, of the class wrapped before,
    # hands on in the compute dtype.
    assert [op.operand_dtypes for op in jaxamp.precision_report(lambda x: model(x), inputs).ops] == [half] * 2
    assert param_dtypes(model) == {F32}


def test_nnx_a_model_already_under_a_policy_is_rejected():
    model = jaxamp.apply_policy(NnxConvNet(rngs=nnx.Rngs(0)), "mixed_float16")
    with pytest.raises(ValueError, match="already"):
        jaxamp.apply_policy(model, "float32")


# --- bad inputs ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "module",
    [object(), lambda x: x, ConvNet, "ConvNet", None],
    ids=["object", "function", "linen_class_not_instance", "string", "none"],
)
def test_apply_policy_needs_a_flax_module(module):
    with pytest.raises(TypeError, match="flax.linen.Module or a flax.nnx.Module"):
        jaxamp.apply_policy(module, "mixed_float16")


@pytest.mark.parametrize(
    "overrides",
    [{"Dense": "float32"}, {int: "float32"}, {nn.Dense(3): "float32"}, [(nn.Dense, "float32")]],
    ids=["class_name", "not_a_module_class", "module_instance", "list_of_pairs"],
)
@pytest.mark.parametrize("make_model", [ConvNet, lambda: NnxConvNet(rngs=nnx.Rngs(0))], ids=["linen", "nnx"])
def test_bad_overrides_are_a_type_error(make_model, overrides):
    with pytest.raises(TypeError, match="overrides"):
        jaxamp.apply_policy(make_model(), "mixed_float16", overrides=overrides)


@pytest.mark.parametrize(
    "policy, overrides",
    [("mixd_float16", None), ("mixed_float16", {nn.Dense: "flaot32"})],
    ids=["bad_policy", "bad_override_policy"],
)
def test_a_bad_policy_string_is_a_value_error(policy, overrides):
    with pytest.raises(ValueError, match="mixd_float16|flaot32"):
        jaxamp.apply_policy(ConvNet(), policy, overrides=overrides)


# --- models that exercise the edges of the mechanism -------------------------------


# (nn.SimpleCell is left out: it breaks its own scan in float16 even when
# given dtype=jnp.float16 directly, without jaxamp.)
@pytest.mark.parametrize("cell", [nn.LSTMCell, nn.GRUCell, nn.OptimizedLSTMCell])
def test_linen_a_recurrent_model_keeps_its_carry_and_computes_in_half_precision(cell):
    sequence = jnp.ones((2, 5, 3))
    model = jaxamp.apply_policy(nn.RNN(cell(8)), "mixed_float16")
    variables = model.init(jax.random.key(0), sequence)

    outputs = model.apply(variables, sequence)

    assert outputs.shape == (2, 5, 8) and outputs.dtype == F32
    assert jaxamp.precision_report(model.apply, variables, sequence).fraction(F16) == 1.0


def test_nnx_a_recurrent_model_keeps_its_carry_and_computes_in_half_precision():
    sequence = jnp.ones((2, 5, 3))
    model = jaxamp.apply_policy(nnx.RNN(nnx.LSTMCell(3, 8, rngs=nnx.Rngs(0))), "mixed_float16")

    outputs = model(sequence)

    assert outputs.shape == (2, 5, 8) and outputs.dtype == F32
    # Traced functionally: the RNN draws carry RNGs, which NNX forbids on a
    # module closed over by a trace, with or without jaxamp.
    call, state = functional(model)
    assert jaxamp.precision_report(call, state, sequence).fraction(F16) == 1.0


class Head(nn.Module):
    """A container: the override on it must reach the Dense inside."""

    @nn.compact
    def __call__(self, x):
        return nn.Dense(3)(nn.relu(nn.Dense(4)(x)))


class Classifier(nn.Module):
    @nn.compact
    def __call__(self, x):
        return Head()(nn.Dense(4)(x))


def test_linen_an_override_on_a_container_reaches_the_layers_it_calls():
    inputs = jnp.ones((2, 3))
    model = jaxamp.apply_policy(Classifier(), "mixed_float16", overrides={Head: "float32"})
    variables = model.init(jax.random.key(0), inputs)

    report = jaxamp.precision_report(model.apply, variables, inputs)

    assert [op.compute_dtype for op in report.ops] == ["float16", "float32", "float32"]


def test_linen_an_override_on_attention_covers_its_projections():
    tokens = jnp.ones((2, 5, 8))
    attention = nn.MultiHeadDotProductAttention(num_heads=2)
    model = jaxamp.apply_policy(
        attention, "mixed_float16", overrides={nn.MultiHeadDotProductAttention: "float32"}
    )
    variables = model.init(jax.random.key(0), tokens)

    assert jaxamp.precision_report(model.apply, variables, tokens).fraction(F32) == 1.0


class TiedLanguageModel(nn.Module):
    """Reads the embedding back through `self.variables`, as tied LM heads do."""

    @nn.compact
    def __call__(self, tokens):
        hidden = nn.Embed(11, 6, name="embed")(tokens)
        hidden = nn.Dense(6)(hidden)
        embedding = self.variables["params"]["embed"]["embedding"]
        return hidden @ embedding.T


@pytest.mark.parametrize("policy", HALF_POLICIES)
def test_linen_params_read_through_self_variables_are_cast_too(policy):
    _, compute_dtype, output_dtype = POLICIES[policy]
    tokens = jnp.array([[1, 2, 3]])
    model = jaxamp.apply_policy(TiedLanguageModel(), policy)
    variables = model.init(jax.random.key(0), tokens)

    logits = model.apply(variables, tokens)

    assert logits.shape == (1, 3, 11) and logits.dtype == output_dtype
    assert jaxamp.precision_report(model.apply, variables, tokens).fraction(compute_dtype) == 1.0


def test_linen_numpy_weights_are_cast_like_jax_arrays():
    model = jaxamp.apply_policy(ConvNet(), "mixed_float16")
    numpy_variables = jax.tree.map(np.asarray, model.init(jax.random.key(0), IMAGES))

    report = jaxamp.precision_report(lambda x: model.apply(numpy_variables, x), IMAGES)

    assert report.fraction(F16) == 1.0


class StackedProjections(nnx.Module):
    """Params held in an nnx.List and used directly."""

    def __init__(self, rngs):
        self.kernels = nnx.List([nnx.Param(jax.random.normal(rngs.params(), (3, 3))) for _ in range(2)])

    def __call__(self, x):
        for kernel in self.kernels:
            x = x @ kernel[...]
        return x


def test_nnx_params_in_containers_are_read_in_the_compute_dtype():
    model = jaxamp.apply_policy(StackedProjections(nnx.Rngs(0)), "mixed_float16")

    report = jaxamp.precision_report(lambda x: model(x), jnp.ones((2, 3)))

    assert [op.operand_dtypes for op in report.ops] == [("float16", "float16")] * 2
    assert param_dtypes(model) == {F32}


@pytest.mark.parametrize("policy", HALF_POLICIES)
def test_nnx_a_model_in_eval_mode_runs_inside_plain_jax_jit(policy):
    _, compute_dtype, output_dtype = POLICIES[policy]
    model = jaxamp.apply_policy(NnxConvNet(rngs=nnx.Rngs(0)), policy)

    outputs = jax.jit(lambda images: model(images))(IMAGES)

    assert outputs.dtype == output_dtype
    assert jaxamp.precision_report(lambda images: model(images), IMAGES).fraction(compute_dtype) == 1.0


class NnxDropoutNet(nnx.Module):
    def __init__(self, rngs):
        self.linear = nnx.Linear(4, 4, rngs=rngs)
        self.dropout = nnx.Dropout(0.5)

    def __call__(self, x, *, rngs):
        hidden = self.dropout(self.linear(x), rngs=rngs)
        self.sow(nnx.Intermediate, "hidden", hidden)
        return hidden


# sow() outside nnx.capture() is deprecated in flax 0.12 but still the way a
# call adds state, which is what this checks.
@pytest.mark.filterwarnings("ignore:Using 'Module.sow\\(\\)' outside")
def test_nnx_rngs_passed_to_a_call_advance_and_sown_values_come_back():
    model = jaxamp.apply_policy(NnxDropoutNet(nnx.Rngs(0)), "mixed_float16")
    rngs, inputs = nnx.Rngs(dropout=1), jnp.ones((2, 4))

    first, second = model(inputs, rngs=rngs), model(inputs, rngs=rngs)

    assert not np.array_equal(first == 0, second == 0)  # fresh masks each call
    assert rngs.dropout.count[...] == 2
    # Each call's sown value comes back, in the dtype the call was traced
    # and ran in (float16), equal to what the call returned (in float32).
    sown = nnx.state(model, nnx.Intermediate)["hidden"].get_value()
    assert len(sown) == 2
    assert dtypes_of(sown) == {jnp.dtype(jnp.float16)}
    np.testing.assert_array_equal(sown[0].astype(F32), first)
    np.testing.assert_array_equal(sown[1].astype(F32), second)
    # The linear under the dropout still computes in float16 (traced
    # functionally: the call changes the model's state).
    graphdef, state = nnx.split(model)
    report = jaxamp.precision_report(
        lambda state, x: nnx.merge(graphdef, state)(x, rngs=nnx.Rngs(dropout=2)), state, inputs
    )
    assert [op.operand_dtypes for op in report.ops] == [("float16", "float16")]


def test_nnx_a_submodule_already_under_a_policy_is_rejected_with_the_way_out():
    model = NnxTwoLinear(rngs=nnx.Rngs(0))
    model.first = jaxamp.apply_policy(model.first, "float32")
    with pytest.raises(ValueError, match="overrides"):
        jaxamp.apply_policy(model, "mixed_float16")


def test_linen_method_may_be_any_function_of_the_model_as_in_flax():
    model, variables = linen_model("mixed_float16")

    def features_plus_one(module, x):
        return module.features(x) + 1

    outputs = jax.eval_shape(functools.partial(model.apply, method=features_plus_one), variables, IMAGES)

    assert outputs.shape == (2, 64) and outputs.dtype == F32


class Scaled(nn.Module):
    @nn.compact
    def __call__(self, x, scale):
        return nn.Dense(2)(x) * scale


def test_linen_a_second_apply_with_the_same_shapes_does_not_trace_again():
    model = jaxamp.apply_policy(Scaled(), "mixed_float16")
    inputs = jnp.ones((1, 3))
    variables = model.init(jax.random.key(0), inputs, 1.0)
    rewrites = model._autocast_apply.rewrites
    before = rewrites.traces

    unscaled = model.apply(variables, inputs, 1.0)
    assert rewrites.traces == before + 1
    np.testing.assert_array_equal(model.apply(variables, inputs, 1.0), unscaled)
    assert rewrites.traces == before + 1
    # An array scale is traced: one more trace, whatever its values.
    for scale in (0.5, 1.5, 2.5):
        outputs = model.apply(variables, inputs, jnp.float32(scale))
        np.testing.assert_allclose(outputs, unscaled * scale, rtol=2e-3)
    assert rewrites.traces == before + 2
    # A Python float is static: a new value is honoured, and kept for the next call.
    np.testing.assert_allclose(model.apply(variables, inputs, 3.0), unscaled * 3.0, rtol=2e-3)
    traces = rewrites.traces
    np.testing.assert_allclose(model.apply(variables, inputs, 3.0), unscaled * 3.0, rtol=2e-3)
    assert rewrites.traces == traces


# --- overrides on NNX containers, gradients against the float32 model --------------------


class NnxHead(nnx.Module):
    """A container: the override on it must reach the Linears inside."""

    def __init__(self, rngs):
        self.hidden = nnx.Linear(4, 4, rngs=rngs)
        self.out = nnx.Linear(4, 3, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.relu(self.hidden(x)))


class NnxClassifier(nnx.Module):
    def __init__(self, rngs):
        self.body = nnx.Linear(3, 4, rngs=rngs)
        self.head = NnxHead(rngs)

    def __call__(self, x):
        return self.head(self.body(x))


def test_nnx_an_override_on_a_container_reaches_the_layers_it_calls():
    inputs = jnp.ones((2, 3))
    model = jaxamp.apply_policy(NnxClassifier(nnx.Rngs(0)), "mixed_float16", overrides={NnxHead: "float32"})

    report = jaxamp.precision_report(lambda x: model(x), inputs)

    assert [op.operand_dtypes for op in report.ops] == [
        ("float16", "float16"),
        ("float32", "float32"),
        ("float32", "float32"),
    ]
    assert param_dtypes(model) == {F32}
    assert model(inputs).dtype == F32


# Mixed-precision gradients must match the float32 model's to 1% of each
# leaf's largest float32 gradient (float16 keeps 11 significant bits).
GRADIENT_TOLERANCE = 1e-2


def assert_close_to_float32_but_computed_in_half(grads, float32_grads):
    assert jax.tree.structure(grads) == jax.tree.structure(float32_grads)
    leaves = list(zip(jax.tree.leaves(grads), jax.tree.leaves(float32_grads), strict=True))
    for grad, reference in leaves:
        assert grad.dtype == F32
        largest = float(np.max(np.abs(reference)))
        assert largest > 0
        np.testing.assert_allclose(grad, reference, rtol=0, atol=GRADIENT_TOLERANCE * largest)
    # Not the float32 computation itself: half precision left its rounding.
    assert any(not np.array_equal(grad, reference) for grad, reference in leaves)


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_linen_scaled_gradients_match_the_unwrapped_float32_models(policy):
    variables = jax.jit(ConvNet().init)(jax.random.key(3), IMAGES)
    params, batch_stats = variables["params"], variables["batch_stats"]

    def loss(model):
        def of_params(params):
            return jnp.mean(model.apply({"params": params, "batch_stats": batch_stats}, IMAGES) ** 2)

        return of_params

    float32_grads = jax.jit(jax.grad(loss(ConvNet())))(params)
    mixed = jaxamp.apply_policy(ConvNet(), policy)
    loss_scale = jaxamp.default_loss_scale(policy)
    _, grads, grads_finite = jax.jit(jaxamp.scaled_value_and_grad(loss(mixed), loss_scale))(params)

    assert grads_finite
    assert_close_to_float32_but_computed_in_half(grads, float32_grads)


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_nnx_scaled_gradients_match_the_unwrapped_float32_models(policy):
    float32_model = NnxConvNet(rngs=nnx.Rngs(0))
    mixed = jaxamp.apply_policy(float32_model, policy)

    def loss(model):
        graphdef, _, rest = nnx.split(model, nnx.Param, ...)
        return lambda params: jnp.mean(nnx.merge(graphdef, params, rest)(IMAGES) ** 2)

    params = nnx.state(float32_model, nnx.Param)
    float32_grads = jax.jit(jax.grad(loss(float32_model)))(params)
    loss_scale = jaxamp.default_loss_scale(policy)
    _, grads, grads_finite = jax.jit(jaxamp.scaled_value_and_grad(loss(mixed), loss_scale))(params)

    assert grads_finite
    assert_close_to_float32_but_computed_in_half(grads, float32_grads)


class NnxWithHelpers(nnx.Module):
    def __init__(self, rngs):
        self.dense = nnx.Linear(3, 4, rngs=rngs)
        self.depth = 1

    def __call__(self, x):
        return self.dense(x)

    def num_layers(self):
        return self.depth

    def features(self, x, scale=1.0):
        return self.dense(x) * scale


def test_nnx_every_public_method_runs_under_the_policy_and_a_python_result_stays_python():
    model = jaxamp.apply_policy(NnxWithHelpers(nnx.Rngs(0)), "mixed_float16")
    x = jnp.ones((2, 3))

    assert model.num_layers() == 1 and type(model.num_layers()) is int
    assert model.features(x, scale=2.0).dtype == F32
    graphdef, state = nnx.split(model)
    report = jaxamp.precision_report(lambda state, x: nnx.merge(graphdef, state).features(x), state, x)
    assert report.count_by_dtype() == {"float16": 1}
