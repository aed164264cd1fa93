"""Under a mixed policy the model is traced in the compute dtype, so what it decides while traced sees half.

A fused attention kernel, a Pallas kernel, a ``dtype`` check and a sown
value see the dtype the model runs in, while float32 params and state are
still read in float32 where the rules want float32: a normalization's scale,
BatchNorm's running statistics. The H200-target checks compile the GPU
program on this CPU (skipped without the CUDA PJRT plugin, and for cuDNN
attention without ``libcudnn``).
"""

import functools
import importlib.util
import os

import flax.linen as nn
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.experimental import pallas as pl

import jaxamp
from tests.test_autocast_rule_classes import all_equations

BF16, F32 = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)


class Attention(nn.Module):
    """A self-attention block through `jax.nn.dot_product_attention`, no dtype anywhere."""

    implementation: str | None = "cudnn"
    heads: int = 2

    @nn.compact
    def __call__(self, x):
        qkv = nn.DenseGeneral((3, self.heads, x.shape[-1] // self.heads))(nn.LayerNorm()(x))
        query, key, value = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        y = jax.nn.dot_product_attention(
            query, key, value, is_causal=True, implementation=self.implementation
        )
        return x + nn.DenseGeneral(x.shape[-1], axis=(-2, -1))(y)


class Transformer(nn.Module):
    implementation: str | None = "cudnn"

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(64, 32)(tokens)
        for _ in range(2):
            x = Attention(self.implementation)(x)
            x = x + nn.Dense(32)(nn.gelu(nn.Dense(128)(nn.LayerNorm()(x))))
        return nn.Dense(64)(nn.LayerNorm()(x))


TOKENS = jnp.arange(4 * 16).reshape(4, 16) % 64


def float32_params(implementation="cudnn"):
    # cuDNN's attention refuses float32 operands, so the params come from the
    # same model with the XLA attention (the params do not depend on it).
    del implementation
    return Transformer(None).init(jax.random.key(0), TOKENS)["params"]


def loss_of(apply_fn):
    def loss_fn(params, tokens):
        logits = apply_fn({"params": params}, tokens)
        return jnp.mean(jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1))

    return loss_fn


def routes(model):
    return {
        "apply_policy": loss_of(jaxamp.apply_policy(model, "mixed_bfloat16").apply),
        "autocast": jaxamp.autocast(loss_of(model.apply), "mixed_bfloat16"),
    }


@pytest.mark.parametrize("route", ["apply_policy", "autocast"])
def test_cudnn_attention_traces_under_both_routes_with_float32_params(route):
    """Fails with cuDNN's "Q must be fp16/bf16..., got float32" if the model is traced in float32."""
    seen = []
    attention = jax.nn.dot_product_attention

    def recording_attention(query, key, value, **kwargs):
        seen.append(query.dtype)
        if not _cudnn_importable():  # cuDNN's own check needs the library: run JAX's XLA attention
            kwargs["implementation"] = None
        return attention(query, key, value, **kwargs)

    params = float32_params()
    loss_fn = routes(Transformer("cudnn"))[route]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(jax.nn, "dot_product_attention", recording_attention)
        jax.eval_shape(jax.value_and_grad(loss_fn), params, TOKENS)
    # The half trace first, every layer in bfloat16; then a trace as given, which reads the
    # program's literals (cuDNN refuses float32 at its first layer, JAX's XLA attention takes it).
    half, given = seen[: seen.index(F32)], seen[seen.index(F32) :]
    assert half and set(half) == {BF16} and set(given) == {F32}


@pytest.mark.parametrize("route", ["apply_policy", "autocast"])
def test_the_xla_attention_sees_bfloat16_and_matches_float32(route):
    params = float32_params()
    loss_fn = routes(Transformer(None))[route]
    loss, grads = jax.value_and_grad(loss_fn)(params, TOKENS)
    want_loss, want_grads = jax.value_and_grad(loss_of(Transformer(None).apply))(params, TOKENS)
    assert jax.tree.map(lambda leaf: leaf.dtype, grads) == jax.tree.map(lambda leaf: leaf.dtype, want_grads)
    np.testing.assert_allclose(loss, want_loss, rtol=2e-2)


def _cudnn_importable() -> bool:
    """Whether JAX can load libcudnn (the ``nvidia-cudnn-cu12`` wheel's ``nvidia.cudnn``)."""
    try:
        return importlib.util.find_spec("nvidia.cudnn") is not None
    except ModuleNotFoundError:
        return False


def _compiled_step(loss_fn, params):
    device = jaxamp.diagnostics.gpu_target_device("h200")
    arguments = jaxamp.diagnostics.on_device((params, jax.ShapeDtypeStruct((8, 256), jnp.int32)), device)

    def step(params, tokens):
        grads = jax.grad(loss_fn)(params, tokens)
        return jax.tree.map(lambda p, g: p - 1e-3 * g, params, grads)

    return jax.jit(step, donate_argnums=0).lower(*arguments).compile()


def test_on_an_h200_target_cudnn_attention_runs_and_memory_is_within_ten_percent_of_the_hand_cast_recipe():
    """The recipe: params cast to bfloat16 at the step's entry, the plain model on them."""
    if not jaxamp.diagnostics.cuda_plugin_available() or not _cudnn_importable():
        pytest.skip("needs the CUDA PJRT plugin and libcudnn (see experiments.lm.on_paper)")
    model = Transformer("cudnn")
    params = jax.eval_shape(lambda: float32_params())

    def hand_cast(params, tokens):
        half = jax.tree.map(lambda param: param.astype(jnp.bfloat16), params)
        return loss_of(model.apply)(half, tokens)

    temp = {}
    for name, loss_fn in {"hand_cast": hand_cast, **routes(model)}.items():
        compiled = _compiled_step(loss_fn, params)
        assert compiled.as_text().count("__cudnn$fmha") >= 2, name  # forward and backward
        temp[name] = compiled.memory_analysis().temp_size_in_bytes
    for route in ("apply_policy", "autocast"):
        assert temp[route] <= 1.10 * temp["hand_cast"], temp


# --- Pallas ---------------------------------------------------------------------------


def _double_kernel(seen, strict=True):
    """A kernel written for bfloat16 alone, which checks its operand's dtype while traced (unless not
    `strict`, for a float32 init)."""

    def kernel(x_ref, o_ref):
        seen.append(x_ref.dtype)
        if strict and x_ref.dtype != BF16:
            raise TypeError(f"this kernel takes bfloat16, not {x_ref.dtype}")
        o_ref[...] = x_ref[...] * 2

    def double(x):
        return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=True)(x)

    return double


class LinenPallas(nn.Module):
    kernel: object

    @nn.compact
    def __call__(self, x):
        return self.kernel(nn.Dense(8)(x))


class NnxPallas(nnx.Module):
    def __init__(self, kernel, rngs):
        self.kernel = kernel
        self.dense = nnx.Linear(4, 8, rngs=rngs)

    def __call__(self, x):
        return self.kernel(self.dense(x))


def test_a_pallas_kernel_in_a_linen_and_an_nnx_model_receives_bfloat16():
    """The kernel refuses float32: the trace that reads the literals as written fails, and the half
    trace runs with the literals as it rounded them."""
    seen = []
    x = jnp.ones((8, 4))
    variables = LinenPallas(_double_kernel(seen, strict=False)).init(jax.random.key(0), x)
    seen.clear()
    linen_model = LinenPallas(_double_kernel(seen))
    out = jaxamp.apply_policy(linen_model, "mixed_bfloat16").apply(variables, x)
    assert seen == [BF16, F32] and out.dtype == F32
    np.testing.assert_allclose(out, 2 * nn.Dense(8).apply({"params": variables["params"]["Dense_0"]}, x), rtol=2e-2)

    seen.clear()
    kernel = _double_kernel(seen)  # a kernel of its own: newer JAX caches a kernel's trace per function
    nnx_model = jaxamp.apply_policy(NnxPallas(kernel, nnx.Rngs(0)), "mixed_bfloat16")
    out = nnx_model(x)
    assert seen == [BF16, F32] and out.dtype == F32
    assert {leaf.dtype for leaf in jax.tree.leaves(nnx.state(nnx_model, nnx.Param))} == {F32}


# --- sown values, and what stays float32 ---------------------------------------------------


class Sowing(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.Dense(8)(x)
        self.sow("intermediates", "hidden", h)
        return nn.LayerNorm()(h)


@pytest.mark.parametrize(
    "policy, compute", [("mixed_bfloat16", BF16), ("mixed_float16", jnp.dtype(jnp.float16))]
)
def test_sown_values_and_captured_intermediates_come_back_in_the_compute_dtype(policy, compute):
    x = jnp.ones((2, 4))
    model = Sowing()
    variables = model.init(jax.random.key(0), x)
    policy_model = jaxamp.apply_policy(model, policy)
    out, state = policy_model.apply(variables, x, mutable=["intermediates"])
    assert out.dtype == F32
    assert [leaf.dtype for leaf in jax.tree.leaves(state)] == [compute]
    _, captured = policy_model.apply(variables, x, capture_intermediates=True, mutable=["intermediates"])
    # The Dense, the LayerNorm (in its caller's compute dtype) and the model's own output.
    assert {leaf.dtype for leaf in jax.tree.leaves(captured)} == {compute}


class DenseBatchNorm(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.BatchNorm(use_running_average=False, momentum=0.99)(nn.Dense(4)(x))


def test_batchnorm_running_statistics_are_updated_in_float32_like_a_float32_model():
    """50 updates of momentum 0.99 toward a mean near 3: a bfloat16 running mean
    (spacing 0.0078 near 1) would stall on the steps of 0.01 * (3 - mean)."""
    model = DenseBatchNorm()
    batches = [jax.random.normal(jax.random.key(step), (8, 4)) + 3.0 for step in range(50)]
    variables = model.init(jax.random.key(0), batches[0])
    variables = {
        "params": jax.tree.map(lambda p: jnp.eye(4) if p.ndim == 2 else p, variables["params"]),
        "batch_stats": variables["batch_stats"],
    }
    apply = {
        "float32": jax.jit(functools.partial(model.apply, mutable=["batch_stats"])),
        "mixed_bfloat16": jax.jit(
            functools.partial(jaxamp.apply_policy(model, "mixed_bfloat16").apply, mutable=["batch_stats"])
        ),
    }
    stats = {name: variables["batch_stats"] for name in apply}
    for batch in batches:
        for name, fun in apply.items():
            _, updates = fun({"params": variables["params"], "batch_stats": stats[name]}, batch)
            stats[name] = updates["batch_stats"]
    got, want = stats["mixed_bfloat16"]["BatchNorm_0"], stats["float32"]["BatchNorm_0"]
    assert {leaf.dtype for leaf in jax.tree.leaves(got)} == {F32}
    np.testing.assert_allclose(got["mean"], want["mean"], rtol=2e-3)
    np.testing.assert_allclose(got["var"], want["var"], rtol=2e-2)
    # What a bfloat16 running mean would have reached: far outside that tolerance.
    mean_in_bf16 = jnp.zeros(4, jnp.bfloat16)
    for batch in batches:
        batch_mean = batch.astype(jnp.bfloat16).astype(jnp.float32).mean(0)
        mean_in_bf16 = (0.99 * mean_in_bf16 + 0.01 * batch_mean).astype(jnp.bfloat16)
    assert not np.allclose(mean_in_bf16.astype(jnp.float32), want["mean"], rtol=2e-3)


def test_a_layer_norms_float32_scale_is_read_in_float32_while_the_model_is_traced_in_bfloat16():
    """The scale 1.001 is not a bfloat16 value (its spacing at 1 is 0.0078): read in bfloat16 it
    would be 1.0. Every operation that reads the scale param reads it in float32."""
    model = nn.LayerNorm()
    x = jax.random.normal(jax.random.key(0), (4, 8))
    variables = {"params": {"scale": jnp.full((8,), 1.001), "bias": jnp.zeros(8)}}
    closed = jax.make_jaxpr(jaxamp.apply_policy(model, "mixed_bfloat16").apply)(variables, x)
    leaves, _ = jax.tree_util.tree_flatten_with_path(variables)
    scale = closed.jaxpr.invars[
        [jax.tree_util.keystr(path) for path, _ in leaves].index("['params']['scale']")
    ]
    readers = {scale}
    for equation in all_equations(closed.jaxpr):
        if readers & {atom for atom in equation.invars if not isinstance(atom, jax.extend.core.Literal)}:
            assert all(var.aval.dtype == F32 for var in equation.outvars), equation
            if equation.primitive.name in ("reshape", "broadcast_in_dim", "convert_element_type"):
                readers.update(equation.outvars)
    # The norm's arithmetic read it: the result differs from a scale of 1.0 by the 0.1%.
    out = jaxamp.apply_policy(model, "mixed_float16").apply(variables, x)
    ones = jaxamp.apply_policy(model, "mixed_float16").apply(
        {"params": {"scale": jnp.ones(8), "bias": jnp.zeros(8)}}, x
    )
    assert not np.array_equal(out, ones)


def test_a_statistic_the_program_casts_to_another_half_dtype_than_the_compute_one_is_cast():
    """Under ``mixed_bfloat16``, a mean of squares stays float32 through ``jnp.mean``'s own cast
    back to bfloat16; the program then casts it to float16 on purpose, and doubles it. Only a
    cast to the compute dtype is skipped: the doubling reads float16.

    Fails if a float32 statistic skipped every cast to a narrower dtype.
    """

    def fun(x, w):
        h = x @ w
        return jnp.mean(h * h).astype(jnp.float16) * 2.0

    x, w = jnp.ones((4, 8)), jnp.ones((8, 8))
    closed = jax.make_jaxpr(jaxamp.autocast(fun, "mixed_bfloat16"))(x, w)
    (doubling,) = [
        eq for eq in closed.jaxpr.eqns if eq.primitive.name == "mul" and not eq.outvars[0].aval.shape
    ]
    assert doubling.invars[0].aval.dtype == jnp.float16
    assert float(jaxamp.autocast(fun, "mixed_bfloat16")(x, w)) == 128.0


def _masked_mean(values, count):
    """``jnp.mean``'s recipe over `count` valid entries: summed in float32, cast back."""
    return (jnp.sum(values.astype(jnp.float32)) / count).astype(values.dtype)


def test_a_mean_over_a_count_passed_as_an_integer_array_stays_float32_past_65504():
    """A masked mean of squares of 100s (10000 each, 32 of them, over a count of 4: 80000) and its
    square root. The count is an integer input, which joins the statistic as a constant does.

    Fails if the integer count made the quotient no statistic: rounded to float16 it is inf.
    """

    def root_mean_square(x, w, count):
        h = x @ w
        return jnp.sqrt(_masked_mean(h * h, count))

    x, w, count = jnp.ones((4, 8)), jnp.full((8, 8), 12.5), jnp.array(4)
    got = jaxamp.autocast(root_mean_square)(x, w, count)
    np.testing.assert_allclose(got, np.sqrt(80000.0), rtol=1e-3)


def test_a_matmul_result_normalized_in_float32_by_hand_is_handed_on_in_float16():
    """A matmul's result is an activation, not a statistic: a layer norm written by hand upcasts
    it, normalizes it in float32 and casts it back to float16, and the ``tanh`` after it runs in
    float16.

    Fails if a matmul's result counted as a statistic (its normalization would stay float32).
    """

    def normalized(x, w):
        h = (x @ w).astype(jnp.float32)
        h = (h - h.mean(-1, keepdims=True)) * jax.lax.rsqrt(h.var(-1, keepdims=True) + 1e-5)
        return jnp.tanh(h.astype(x.dtype))

    x = jax.random.normal(jax.random.key(0), (4, 8))
    w = jax.random.normal(jax.random.key(1), (8, 8))
    closed = jax.make_jaxpr(jaxamp.autocast(normalized))(x, w)
    (tanh,) = [eq for eq in all_equations(closed.jaxpr) if eq.primitive.name == "tanh"]
    assert tanh.invars[0].aval.dtype == jnp.float16
    np.testing.assert_allclose(jaxamp.autocast(normalized)(x, w), normalized(x, w), atol=2e-2)


def test_a_float32_constant_the_program_casts_to_the_compute_dtype_is_cast_like_a_half_program():
    """A fill of -1e9 made in float32 and cast to the activation's float16 is -inf, as in a
    float16 program, and the select that reads it runs in float16. A constant is no statistic.

    Fails if what is made of constants alone counted as a statistic (its cast would be skipped,
    and the select would run in float32 on -1e9).
    """

    def masked(x, w):
        h = x @ w
        return jnp.where(h > 0, h, jnp.full(h.shape, -1e9, jnp.float32).astype(h.dtype))

    closed = jax.make_jaxpr(jaxamp.autocast(masked))(jnp.ones((4, 8)), jnp.ones((8, 8)))
    (select,) = [eq for eq in all_equations(closed.jaxpr) if eq.primitive.name == "select_n"]
    assert [str(atom.aval.dtype) for atom in select.invars[1:]] == ["float16", "float16"]


def test_a_function_that_refuses_half_inputs_is_traced_as_given_with_a_warning_naming_the_fix():
    """Some functions refuse half inputs while traced (JAX 0.12's LU for float16); they run as
    traced with the arguments as given, and say so: the warning names the error by its first line
    (or its class, if it has no message) and points at the user's call. One that fails either way
    raises the first error."""

    def float32_only(x, w):
        if x.dtype != jnp.float32:
            raise TypeError(f"float32_only takes float32, got {x.dtype}\n(a second line, not repeated)")
        return jnp.tanh(x @ w)

    x, w = jnp.ones((4, 8)), jnp.ones((8, 8)) / 8
    with pytest.warns(jaxamp._autocast.interpreter.HalfTraceRefusedWarning) as warned:
        out = jaxamp.autocast(float32_only)(x, w)
    (warning,) = warned
    assert str(warning.message) == (
        "jaxamp.autocast traced this function with its arguments as given, since traced in the compute "
        "dtype it raised TypeError: float32_only takes float32, got float16 Kernels and dtype checks in it "
        "see float32. To trace those arguments as given without this warning, pass float32_argnums (or "
        "float32_argnames) to autocast."
    )
    # The user's call, not a line of jaxamp. (Not `== __file__`: under mutmut, its trampolines
    # add frames between the two.)
    assert not warning.filename.startswith(os.path.dirname(jaxamp.__file__))
    np.testing.assert_allclose(out, float32_only(x, w), rtol=2e-3)
    assert out.dtype == F32
    # The matmul still runs in float16: only the trace was float32's.
    assert (
        jaxamp.precision_report(jaxamp.autocast(float32_only, float32_argnums=(0, 1)), x, w).fraction(
            jnp.float16
        )
        == 1.0
    )

    def never(x):
        raise ValueError(f"never takes {x.dtype}")

    with pytest.raises(ValueError, match="never takes float16"):
        jaxamp.autocast(never)(x)

    def float32_only_without_a_message(x):
        if x.dtype != jnp.float32:
            raise NotImplementedError
        return x

    with pytest.warns(
        jaxamp._autocast.interpreter.HalfTraceRefusedWarning,
        match="it raised NotImplementedError: NotImplementedError Kernels",
    ):
        jaxamp.autocast(float32_only_without_a_message)(x)


def test_a_function_that_refuses_half_inputs_and_takes_an_integer_too_is_traced_as_given():
    """A float32-only function with a step count beside its floating arguments: the integer is traced
    as given either way, the floating arguments are not, so the function is traced again as given
    and runs, with the warning.

    Fails if the fallback is refused as soon as any argument was traced as given (the integer), not
    only when all of them were: the half trace's TypeError would reach the user.
    """

    def float32_only(x, w, step):
        if x.dtype != jnp.float32:
            raise TypeError(f"float32_only takes float32, got {x.dtype}")
        return jnp.tanh(x @ w) * step

    x, w, step = jnp.ones((4, 8)), jnp.ones((8, 8)) / 8, jnp.array(3, jnp.int32)
    refused = jaxamp._autocast.interpreter.HalfTraceRefusedWarning
    with pytest.warns(refused, match="float32_only takes float32"):
        out = jaxamp.autocast(float32_only)(x, w, step)
    np.testing.assert_allclose(out, float32_only(x, w, step), rtol=2e-3)


class NnxDenseBatchNorm(nnx.Module):
    def __init__(self, rngs):
        self.dense = nnx.Linear(4, 4, kernel_init=nnx.initializers.ones, rngs=rngs)
        self.dense.kernel[...] = jnp.eye(4)
        self.norm = nnx.BatchNorm(4, momentum=0.99, rngs=rngs)
        self.seen = []

    def __call__(self, x):
        self.seen.append((self.dense.kernel[...].dtype, self.norm.mean[...].dtype))
        return self.norm(self.dense(x))


def test_nnx_batchnorm_running_statistics_are_traced_and_updated_in_float32_like_a_float32_model():
    """NNX state other than ``nnx.Param`` keeps its dtype while traced: the kernel is traced in
    bfloat16, the running mean in float32, and 50 updates of momentum 0.99 toward a mean near 3 end
    where float32's do (a bfloat16 mean would stall, as in the linen test above).

    Fails if a leaf's variable type is lost on the way to the trace (every NNX leaf then counts as a
    param and is traced in the compute dtype)."""
    batches = [jax.random.normal(jax.random.key(step), (8, 4)) + 3.0 for step in range(50)]
    reference, model = NnxDenseBatchNorm(nnx.Rngs(0)), NnxDenseBatchNorm(nnx.Rngs(0))
    model = jaxamp.apply_policy(model, "mixed_bfloat16")
    step, reference_step = nnx.jit(lambda model, x: model(x)), nnx.jit(lambda model, x: model(x))
    for batch in batches:
        step(model, batch)
        reference_step(reference, batch)
    assert (BF16, F32) in model.seen and (BF16, BF16) not in model.seen
    assert model.norm.mean[...].dtype == F32
    np.testing.assert_allclose(model.norm.mean[...], reference.norm.mean[...], rtol=2e-3)
    np.testing.assert_allclose(model.norm.var[...], reference.norm.var[...], rtol=2e-2)
