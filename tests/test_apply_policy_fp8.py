"""FP8 matmuls for a Flax model through `apply_policy`, and overrides as policy scopes.

`apply_policy` runs the model through `jaxamp.autocast`, so a policy with FP8
matmuls (``"mixed_float8"``) reaches every Dense of an unedited Flax model,
and a class in ``overrides`` (even one deep inside a model nobody here
wrote) runs in its own policy's scope.
"""

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxamp

M, K, HIDDEN, N = 32, 64, 128, 48


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(N)(nn.gelu(nn.Dense(HIDDEN)(x)))


def _loss_grads(model, variables, x):
    def loss(variables):
        return jnp.mean(model.apply(variables, x).astype(jnp.float32) ** 2)

    return jax.grad(loss)(variables)


def test_a_flax_mlp_under_mixed_float8_has_gradients_close_to_mixed_bfloat16s_on_cpu():
    x = jax.random.normal(jax.random.key(0), (M, K))
    variables = MLP().init(jax.random.key(1), x)
    fp8 = jaxamp.apply_policy(MLP(), "mixed_float8")
    bf16 = jaxamp.apply_policy(MLP(), "mixed_bfloat16")

    fp8_grads, bf16_grads = _loss_grads(fp8, variables, x), _loss_grads(bf16, variables, x)

    assert jax.tree.map(lambda g: g.dtype, fp8_grads) == jax.tree.map(lambda g: g.dtype, variables)
    for fp8_grad, bf16_grad in zip(jax.tree.leaves(fp8_grads), jax.tree.leaves(bf16_grads), strict=True):
        relative = float(jnp.linalg.norm(fp8_grad - bf16_grad) / jnp.linalg.norm(bf16_grad))
        assert relative < 0.1, relative
    traced = jaxamp.precision_report(fp8.apply, variables, x)
    assert not traced.count_by_dtype().get("bfloat16"), traced  # both GEMMs asked for FP8


def test_compiled_for_an_h200_every_gemm_of_a_flax_mlp_under_mixed_float8_is_a_cublaslt_fp8_call():
    """Two Dense layers: two forward and four backward GEMMs, all ``__cublas$lt$matmul$f8``.

    The gradient with respect to the input is not asked for, so the first
    layer's input gradient GEMM is not in the program: five GEMMs.
    """
    if not jaxamp.diagnostics.cuda_plugin_available():
        pytest.skip("needs the CUDA PJRT plugin (pip install 'jax-mixed-precision[gpu-aot]')")
    device = jaxamp.diagnostics.gpu_target_device("h200")
    model = jaxamp.apply_policy(MLP(), "mixed_float8")
    x = jax.ShapeDtypeStruct((M, K), jnp.float32)
    variables = jax.eval_shape(model.init, jax.random.key(1), x)
    step = jax.value_and_grad(lambda variables, x: jnp.mean(model.apply(variables, x) ** 2))
    # So small GEMMs do not pay on an H200: FP8 is forced to prove every call.
    with jaxamp.diagnostics.fp8_target("everywhere"):
        report = jaxamp.precision_report(
            step, *jaxamp.diagnostics.on_device((variables, x), device), compiled=True
        )

    gemms = [op for op in report.ops if op.primitive.startswith("__cublas")]
    assert len(gemms) == 5, report
    assert {op.primitive for op in gemms} == {"__cublas$lt$matmul$f8"}, report
    assert report.fp8_fraction("forward") == report.fp8_fraction("backward") == 1.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert jaxamp.diagnostics.check_fp8(report) == ()


# --- overrides by class as policy scopes ------------------------------------------------


class ThirdPartyAttention(nn.Module):
    """Stands for a class deep inside a published model, two modules down."""

    @nn.compact
    def __call__(self, x):
        return nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=8)(x)


class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        return x + nn.Dense(8)(ThirdPartyAttention()(nn.LayerNorm()(x)))


class Encoder(nn.Module):
    @nn.compact
    def __call__(self, x):
        for _ in range(2):
            x = Block()(x)
        return nn.Dense(3)(x)


@pytest.mark.parametrize("overridden", [ThirdPartyAttention, nn.MultiHeadDotProductAttention])
@pytest.mark.parametrize("override", ["float32", "mixed_bfloat16"])
def test_linen_an_override_reaches_a_class_deep_inside_a_model_and_leaves_its_variables_alone(
    override, overridden
):
    tokens = jax.random.normal(jax.random.key(0), (2, 5, 8))
    plain = jax.eval_shape(Encoder().init, jax.random.key(1), tokens)
    model = jaxamp.apply_policy(Encoder(), "mixed_float16", overrides={overridden: override})
    variables = model.init(jax.random.key(1), tokens)

    assert jax.tree.structure(variables) == jax.tree.structure(plain)
    assert jax.tree.map(lambda leaf: (leaf.shape, leaf.dtype), variables) == jax.tree.map(
        lambda leaf: (leaf.shape, leaf.dtype), plain
    )
    report = jaxamp.precision_report(model.apply, variables, tokens)
    compute = jaxamp.get_policy(override).compute_dtype.name
    # Per block: q, k, v, two attention einsums and the output projection
    # inside the class; the block's Dense and the head outside it.
    assert report.count_by_dtype() == {compute: 12, "float16": 3}, report
    output = jax.eval_shape(model.apply, variables, tokens)
    assert output.dtype == jnp.float32


class NnxAttentionBlock(nnx.Module):
    def __init__(self, rngs):
        self.norm = nnx.LayerNorm(8, rngs=rngs)
        self.attention = nnx.MultiHeadAttention(num_heads=2, in_features=8, decode=False, rngs=rngs)
        self.out = nnx.Linear(8, 3, rngs=rngs)

    def __call__(self, x):
        return self.out(x + self.attention(self.norm(x)))


def test_nnx_an_override_reaches_a_class_inside_a_model_and_leaves_its_state_alone():
    tokens = jax.random.normal(jax.random.key(0), (2, 5, 8))
    original = NnxAttentionBlock(nnx.Rngs(0))
    model = jaxamp.apply_policy(original, "mixed_float16", overrides={nnx.MultiHeadAttention: "float32"})

    original_state, state = nnx.state(original), nnx.state(model)
    assert jax.tree.structure(state) == jax.tree.structure(original_state)
    for leaf, original_leaf in zip(jax.tree.leaves(state), jax.tree.leaves(original_state), strict=True):
        assert leaf.dtype == original_leaf.dtype
        np.testing.assert_array_equal(leaf, original_leaf)
    report = jaxamp.precision_report(lambda model, x: model(x), model, tokens)
    # q, k, v, the two attention einsums and the output projection in float32; the head in float16.
    assert report.count_by_dtype() == {"float32": 6, "float16": 1}, report
    assert model(tokens).dtype == jnp.float32
