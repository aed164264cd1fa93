"""Policy scopes where programs nest: loops, rematerialized blocks, gradients, nested models.

`apply_policy` runs a Flax model through `jaxamp.autocast` and opens a
policy scope around each call of a normalization layer or an overridden
class. These scenarios are the places where a scope meets the rest of a
real program: a loop whose carry starts from the model's input, a block
that ends in a normalization under ``nn.remat``/``nn.jit``/``nnx.remat``
(the scope ends inside a nested jaxpr), the same for a block overridden to
compute in float32 that ends without a cast of its own, a normalization
inside a jitted block of an overridden class (a scope opened inside another
scope's body), a class overridden to FP8, ``autocast(jax.grad(...))`` (the
forward and backward equations of a scope carry different name stacks), a
model under a policy inside another, and an NNX method that changes a
plain Python attribute.
"""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxamp

F16 = np.dtype(jnp.float16)
X = jax.random.normal(jax.random.key(0), (4, 16))


def _equations(fun, *args):
    """(primitive, input dtypes, output dtypes) of each top-level equation of `fun`'s jaxpr."""
    jaxpr = jax.make_jaxpr(fun)(*args).jaxpr
    return [
        (
            equation.primitive.name,
            [str(atom.aval.dtype) for atom in equation.invars],
            [str(atom.aval.dtype) for atom in equation.outvars],
        )
        for equation in jaxpr.eqns
    ]


class LoopFromInput(nn.Module):
    @nn.compact
    def __call__(self, x):
        dense = nn.Dense(16)
        dense(x)  # creates the params outside the loop, as linen needs
        return jax.lax.fori_loop(0, 3, lambda _, h: jnp.tanh(dense(h)), x)


class NnxLoopFromInput(nnx.Module):
    def __init__(self, rngs):
        self.dense = nnx.Linear(16, 16, rngs=rngs)

    def __call__(self, x):
        return jax.lax.fori_loop(0, 3, lambda _, h: jnp.tanh(self.dense(h)), x)


@pytest.mark.parametrize("policy", ["mixed_float16", "float16"])
def test_a_loop_whose_carry_starts_from_the_input_traces_and_runs_its_matmuls_in_half(policy):
    """Fails if the model is traced with float16 inputs beside float32 params (the carry's dtype changes)."""
    linen = jaxamp.apply_policy(LoopFromInput(), policy)
    variables = linen.init(jax.random.key(1), X)
    nnx_model = jaxamp.apply_policy(NnxLoopFromInput(nnx.Rngs(1)), policy)
    output_dtype = jaxamp.get_policy(policy).output_dtype

    assert linen.apply(variables, X).dtype == output_dtype
    assert nnx_model(X).dtype == output_dtype
    assert jaxamp.precision_report(linen.apply, variables, X).count_by_dtype() == {"float16": 2}
    assert jaxamp.precision_report(lambda model, x: model(x), nnx_model, X).count_by_dtype() == {"float16": 1}


class NormBlock(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.LayerNorm()(nn.Dense(16)(x))


class Blocks(nn.Module):
    wrap: str
    block: type = NormBlock

    @nn.compact
    def __call__(self, x):
        block = {"remat": nn.remat, "jit": nn.jit, "plain": lambda block: block}[self.wrap](self.block)
        h = block()(x)
        return nn.Dense(16)(h * 2.0 + 1.0)


@pytest.mark.parametrize("wrap", ["plain", "remat", "jit"])
def test_a_block_ending_in_a_norm_hands_on_half_precision_even_under_remat_or_jit(wrap):
    """The norm's scope ends inside the nested jaxpr; what leaves it must still be float16.

    Fails if the elementwise ops between blocks run in float32 (a float32
    residual stream, kept for the backward pass) because the exit cast
    stopped at the body's boundary.
    """
    model = jaxamp.apply_policy(Blocks(wrap), "mixed_float16")
    variables = model.init(jax.random.key(1), X)
    equations = _equations(model.apply, variables, X)
    between = [eq for eq in equations if eq[0] in ("mul", "add") and "float16" in eq[1] + eq[2]]
    assert ("mul", ["float16"], ["float16"]) in [(name, ins[:1], outs) for name, ins, outs in between], (
        equations
    )


class TanhBlock(nn.Module):
    """A block that ends in an op of its own (no cast, unlike a Flax norm's last ``astype``)."""

    @nn.compact
    def __call__(self, x):
        return jnp.tanh(nn.Dense(16)(x))


@pytest.mark.parametrize("wrap", ["plain", "remat", "jit"])
def test_a_block_overridden_to_output_float16_hands_on_float16_even_under_remat_or_jit(wrap):
    """A block that computes in float32 and outputs float16 (``p=f32,c=f32,o=f16``) and ends in
    ``tanh``: its float32 result is cast to float16 where the model reads it, wrapped or not.

    Fails if a nested jaxpr's outputs do not carry the scope they were made in out to the
    equation that holds the body (under ``nn.remat`` or ``nn.jit``): the ops after the block
    would then read its float32 ``tanh`` and run in float32.
    """
    model = jaxamp.apply_policy(
        Blocks(wrap, TanhBlock), "mixed_float16", overrides={TanhBlock: "p=f32,c=f32,o=f16"}
    )
    variables = model.init(jax.random.key(1), X)
    equations = _equations(model.apply, variables, X)
    assert [(ins, outs) for name, ins, outs in equations if name == "mul"] == [
        (["float16", "float16"], ["float16"])
    ], equations


class JittedNormBlock(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.jit(NormBlock)()(x)


class DenseAfterJittedBlock(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(16)(JittedNormBlock()(x))


def _nested_equations(jaxpr, depth=0):
    """(depth, primitive, input dtypes) of each equation of `jaxpr`, nested jaxprs inlined after theirs."""
    found = []
    for equation in jaxpr.eqns:
        found.append((depth, equation.primitive.name, [str(atom.aval.dtype) for atom in equation.invars]))
        for value in equation.params.values():
            inner = getattr(value, "jaxpr", value)
            if isinstance(inner, jax.extend.core.Jaxpr):
                found += _nested_equations(inner, depth + 1)
    return found


def test_a_norm_inside_a_jitted_block_of_an_overridden_class_opens_its_scope_there():
    """A ``mixed_float16`` model whose ``JittedNormBlock`` is overridden to ``mixed_bfloat16``: inside
    the block's ``nn.jit`` body, the matmul runs in bfloat16 and the LayerNorm's statistics in
    float32; the model's own Dense stays float16.

    Fails if the rewrite made for a scope cannot open another scope in a body it rewrites (the
    rewrites of scopes share one table of them).
    """
    model = jaxamp.apply_policy(
        DenseAfterJittedBlock(), "mixed_float16", overrides={JittedNormBlock: "mixed_bfloat16"}
    )
    variables = model.init(jax.random.key(1), X)
    equations = _nested_equations(jax.make_jaxpr(model.apply)(variables, X).jaxpr)
    matmuls = [(depth, ins) for depth, name, ins in equations if name == "dot_general"]
    assert matmuls == [(1, ["bfloat16", "bfloat16"]), (0, ["float16", "float16"])], equations
    sums = [(depth, ins) for depth, name, ins in equations if name == "reduce_sum"]
    assert sums and all(ins == ["float32"] and depth == 1 for depth, ins in sums), equations


class Head(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(32)(x)


class DenseThenHead(nn.Module):
    @nn.compact
    def __call__(self, x):
        return Head()(nn.Dense(32)(x))


def test_a_class_overridden_to_mixed_float8_runs_its_matmul_in_fp8_inside_a_bfloat16_model():
    """Only the overridden class's matmul is FP8 (its shapes, 16 by 32 by 32, are eligible).

    Fails if a policy scope loses its FP8 setting on the way to its rules (the head then runs in
    bfloat16 like the rest of the model).
    """
    x = jax.random.normal(jax.random.key(2), (16, 32))
    model = jaxamp.apply_policy(DenseThenHead(), "mixed_bfloat16", overrides={Head: "mixed_float8"})
    variables = model.init(jax.random.key(1), x)
    report = jaxamp.precision_report(model.apply, variables, x)
    assert report.count_by_dtype() == {"bfloat16": 1, "float8_e4m3fn": 1}


class NnxBlock(nnx.Module):
    def __init__(self, rngs):
        self.dense = nnx.Linear(16, 16, rngs=rngs)
        self.norm = nnx.LayerNorm(16, rngs=rngs)

    def __call__(self, x):
        return self.norm(self.dense(x))


class NnxRematNet(nnx.Module):
    def __init__(self, rngs):
        self.block = NnxBlock(rngs)
        self.out = nnx.Linear(16, 16, rngs=rngs)

    def __call__(self, x):
        h = nnx.remat(lambda block, x: block(x))(self.block, x)
        return self.out(h * 2.0)


def test_nnx_a_rematerialized_block_ending_in_a_norm_hands_on_half_precision():
    model = jaxamp.apply_policy(NnxRematNet(nnx.Rngs(0)), "mixed_float16")
    graphdef, state = nnx.split(model)
    equations = _equations(lambda state, x: nnx.merge(graphdef, state)(x), state, X)
    assert [outputs for name, _, outputs in equations if name == "mul"] == [["float16"]], equations


class RMSNormModel(nn.Module):
    @nn.compact
    def __call__(self, x):
        return (nn.RMSNorm()(x) * jnp.arange(16.0)).sum()


def test_a_gradient_taken_inside_autocast_keeps_the_norms_residuals_in_float32():
    """``autocast(jax.grad(...))`` of an apply_policy model: the backward pass reads the
    forward residuals of the normalization scope unrounded. Fails if the residuals were
    rounded to float16 on their way to the backward equations (relative error 0.45)."""
    x = X * 300.0
    plain = RMSNormModel()
    plain_variables = plain.init(jax.random.key(1), x)
    model = jaxamp.apply_policy(RMSNormModel(), "mixed_float16")
    variables = model.init(jax.random.key(1), x)
    reference = jax.grad(lambda x: plain.apply(plain_variables, x))(x)

    outside = jax.grad(lambda x: model.apply(variables, x))(x)
    inside = jaxamp.autocast(jax.grad(lambda x: model.apply(variables, x)))(x)

    for gradient in (outside, inside):
        relative = float(jnp.linalg.norm(gradient - reference) / jnp.linalg.norm(reference))
        assert relative < 1e-2, relative


class Sub(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(4)(x)


class Outer(nn.Module):
    inner: nn.Module

    @nn.compact
    def __call__(self, x):
        return nn.Dense(4)(self.inner(nn.Dense(4)(x)))


def test_linen_a_model_under_a_policy_inside_another_keeps_its_own_policy():
    x = jnp.ones((2, 4))
    model = jaxamp.apply_policy(Outer(inner=jaxamp.apply_policy(Sub(), "float32")), "mixed_float16")
    variables = model.init(jax.random.key(0), x)

    assert jaxamp.precision_report(model.apply, variables, x).count_by_dtype() == {"float16": 2, "float32": 1}
    assert set(variables["params"]) == {"Dense_0", "Dense_1", "inner"}


def test_linen_a_model_under_a_policy_inside_another_is_out_of_reach_of_the_outer_overrides():
    """Outer ``mixed_float16`` with ``nn.Dense`` overridden to ``mixed_bfloat16``, inner ``float16``:
    the outer model's two Dense layers run in bfloat16, the inner model's Dense in float16 with
    float16 params, as the inner model's own policy (which has no overrides) says.

    Fails if the inner model runs with the outer model's overrides (its Dense in bfloat16), or if
    its layers take the outer model's policy where they have no override (float32 params).
    """
    x = jnp.ones((2, 4))
    inner = jaxamp.apply_policy(Sub(), "float16")
    model = jaxamp.apply_policy(Outer(inner=inner), "mixed_float16", overrides={nn.Dense: "mixed_bfloat16"})
    variables = model.init(jax.random.key(0), x)

    report = jaxamp.precision_report(model.apply, variables, x)
    assert report.count_by_dtype() == {"bfloat16": 2, "float16": 1}
    param_dtypes = jax.tree.map(lambda leaf: str(leaf.dtype), variables["params"])
    assert param_dtypes["inner"] == {"Dense_0": {"bias": "float16", "kernel": "float16"}}
    assert param_dtypes["Dense_0"] == param_dtypes["Dense_1"] == {"bias": "float32", "kernel": "float32"}


def test_linen_a_model_under_a_policy_inside_a_plain_model_is_refused_with_the_way_out():
    """The message, matched whole, names the model's class and the override that gives it its policy."""
    with pytest.raises(TypeError) as raised:
        Outer(inner=jaxamp.apply_policy(Sub(), "mixed_float16")).init(jax.random.key(0), jnp.ones((2, 4)))
    assert str(raised.value) == (
        "This apply_policy model (Sub) was called as a layer of a model that runs under no policy, which "
        "would leave it in the traced dtypes. Apply the policy to the outermost model, and give this part "
        "a policy of its own with overrides={Sub: policy}."
    )


class Counting(nnx.Module):
    def __init__(self, rngs):
        self.dense = nnx.Linear(4, 4, rngs=rngs)
        self.calls = 0

    def __call__(self, x):
        self.calls += 1
        return self.dense(x)


def test_nnx_a_plain_attribute_a_call_changes_is_written_back_eagerly_and_under_nnx_jit():
    """Fails if the change made on autocast's merged copy of the model were lost (calls stays 0)."""
    model = jaxamp.apply_policy(Counting(nnx.Rngs(0)), "mixed_float16")
    x = jnp.ones((2, 4))

    model(x)
    model(x)
    assert model.calls == 2
    jitted = nnx.jit(lambda model, x: model(x))
    jitted(model, x)
    jitted(model, x)
    assert model.calls == 4
    assert model(x).dtype == jnp.float32


class ShapeNoting(nnx.Module):
    """Notes the shape it last saw, in an attribute its ``__init__`` never made, and so does its layer."""

    def __init__(self, rngs):
        self.dense = NotingLinear(4, 4, rngs=rngs)

    def __call__(self, x):
        self.last_shape = x.shape
        return self.dense(x)


class NotingLinear(nnx.Linear):
    def __call__(self, x):
        self.last_dtype = str(x.dtype)
        return super().__call__(x)


@pytest.mark.parametrize("route", ["autocast", "apply_policy"])
def test_nnx_an_attribute_a_call_creates_is_written_back_as_a_plain_call_creates_it(route):
    """A plain call leaves ``model.last_shape`` and ``model.dense.last_dtype`` set; so must autocast.

    Fails if only attributes that existed before the call are compared (the new ones dropped), or
    if a submodule's change is written to the root.
    """
    plain = ShapeNoting(nnx.Rngs(0))
    plain(jnp.ones((2, 4)))
    assert plain.last_shape == (2, 4) and plain.dense.last_dtype == "float32"

    model = ShapeNoting(nnx.Rngs(0))
    call = jaxamp.autocast(model) if route == "autocast" else jaxamp.apply_policy(model, "mixed_float16")
    model = model if route == "autocast" else call
    call(jnp.ones((3, 4)))
    assert model.last_shape == (3, 4)
    assert model.dense.last_dtype == "float16", "the layer saw the compute dtype, and noted it on itself"
    assert "last_dtype" not in vars(model)


@dataclasses.dataclass
class BatchSummary:
    """A plain record (no pytree) holding a NumPy array: its ``==`` raises, as NumPy's does in ``bool``."""

    shape: np.ndarray


class Summarizing(nnx.Module):
    def __init__(self, rngs):
        self.dense = nnx.Linear(4, 4, rngs=rngs)
        self.summary = BatchSummary(np.zeros(2, int))

    def __call__(self, x):
        self.summary = BatchSummary(np.asarray(x.shape))
        return self.dense(x)


def test_nnx_an_attribute_whose_equality_raises_is_written_back_when_the_call_replaces_it():
    """Whether the call changed ``summary`` cannot be asked with ``==`` (it raises on the arrays
    inside); counted as changed, it is written back. Fails if such an attribute counts as unchanged."""
    model = jaxamp.apply_policy(Summarizing(nnx.Rngs(0)), "mixed_float16")
    model(jnp.ones((3, 4)))
    np.testing.assert_array_equal(model.summary.shape, [3, 4])


class Router(nn.Module):
    @nn.compact
    def __call__(self, x):
        logits = nn.Dense(4)(x)
        return logits, jnp.argmax(logits, axis=-1)


class RoutedLookup(nn.Module):
    @nn.compact
    def __call__(self, x):
        logits, choice = Router()(x)
        table = self.param("table", nn.initializers.normal(1.0), (4, 16))
        return jnp.take(table, choice, axis=0) * jnp.max(logits, axis=-1, keepdims=True)


def test_an_integer_made_inside_an_overridden_class_leaves_its_scope_as_an_integer():
    """A router overridden to compute in float32 and hand on float16 returns its logits and its
    choice, an int32 index the model looks a row up with. Only the logits leave the scope in
    float16; the lookup reads the index as made.

    Fails if every value leaving a scope is cast to its exit dtype, integers included (the lookup
    would take float16 indices).
    """
    model = RoutedLookup()
    variables = model.init(jax.random.key(1), X)
    policy_model = jaxamp.apply_policy(model, "mixed_float16", overrides={Router: "p=f32,c=f32,o=f16"})
    np.testing.assert_allclose(
        policy_model.apply(variables, X), model.apply(variables, X), rtol=2e-2, atol=2e-2
    )
