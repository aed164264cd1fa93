"""FP8 weight gathers under FSDP (`jaxamp.fsdp` with an FP8 gather dtype, `jaxamp.fsdp._fp8_gather`).

The settings, the eligible leaves and the errors are checked here, on this
process's devices. What the programs communicate and compute is checked on 8
virtual CPU devices in one fresh process, `tests/fsdp_fp8_gather_run.py`,
started in the background as soon as the tests are collected
(tests/fresh_processes.py): the collectives of a small GPT's train step, a
weight whose shards differ wildly in magnitude, a small MLP against one
device, and a short run of the tiny language model.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fresh_processes import FreshProcess, xla_flags
from jax.sharding import Mesh
from jax.tree_util import DictKey, GetAttrKey

import jaxamp
from jaxamp.fsdp import CommunicationPolicy, fp8_gather_eligible, get_communication_policy

# The existing FP8 parity target: mixed_float8's final held-out loss within 2% of mixed_bf16's
# (results/fp8-parity/tiny/parity.md).
FP8_LOSS_RTOL = 0.02


def one_device_mesh():
    return Mesh(np.array(jax.devices()[:1]), ("data",))


# --- the setting ------------------------------------------------------------------


def test_an_fp8_gather_dtype_dequantizes_into_bfloat16_or_the_policy_compute_dtype():
    fp8 = CommunicationPolicy(gather_dtype="float8_e4m3fn", reduce_dtype="f32")
    assert fp8.fp8_gathers and fp8.dequantize_dtype == jnp.bfloat16
    assert str(fp8) == "gather=float8_e4m3fn,reduce=float32,dequantize=bfloat16"
    assert get_communication_policy(str(fp8)) == fp8 == get_communication_policy("gather=fp8,reduce=f32")
    assert fp8.gather_dtype_for(jnp.float32) == jnp.bfloat16  # the leaves not gathered in FP8

    from_policy = CommunicationPolicy.from_policy("float16", gather_dtype="e4m3")
    assert (from_policy.gather_dtype, from_policy.dequantize_dtype) == (jnp.float8_e4m3fn, jnp.float16)
    assert not CommunicationPolicy.from_policy("mixed_float8").fp8_gathers  # FP8 gathers are asked for


@pytest.mark.parametrize(
    "make, words",
    [
        (lambda: CommunicationPolicy(gather_dtype="fp8", reduce_dtype="fp8"),
         ["reduce_dtype float8_e4m3fn", "not summed in FP8", "reduce_dtype=None", "'float32'"]),
        (lambda: get_communication_policy("gather=bf16,reduce=float8_e5m2"), ["reduce_dtype float8_e5m2"]),
        (lambda: CommunicationPolicy(gather_dtype="bf16", dequantize_dtype="f32"),
         ["dequantize_dtype=float32", "FP8 gathers only", "gather_dtype='float8_e4m3fn'"]),
        (lambda: CommunicationPolicy(gather_dtype="fp8", dequantize_dtype="e5m2"),
         ["dequantize_dtype float8_e5m2", "'bfloat16'"]),
        (lambda: CommunicationPolicy(gather_dtype=jnp.float8_e4m3fnuz), ["float8_e4m3fnuz", "float8_e4m3fn"]),
    ],
)  # fmt: skip
def test_fp8_where_it_cannot_go_is_refused_naming_the_fix(make, words):
    with pytest.raises(ValueError) as raised:
        make()
    assert all(word in str(raised.value) for word in words), str(raised.value)


def test_the_weights_of_matmuls_are_eligible_and_vectors_and_biases_are_not():
    def eligible(name, shape, dtype=jnp.float32, sharded=True):
        return fp8_gather_eligible((DictKey("layer"), DictKey(name)), shape, dtype, sharded)

    assert eligible("kernel", (64, 256)) and eligible("embedding", (256, 64))
    assert eligible("kernel", (64, 3, 4, 16))  # an attention projection (nn.DenseGeneral)
    assert not eligible("bias", (64,)) and not eligible("scale", (64,))
    assert not eligible("bias", (3, 4, 16))  # nn.DenseGeneral's bias: added, not multiplied
    assert not eligible("kernel", (64, 256), sharded=False)  # replicated: never gathered
    assert not eligible("kernel", (64, 256), dtype=jnp.int32)
    # A module whose fields are attributes (Equinox, a dataclass): the leaf is named by its attribute.
    assert not fp8_gather_eligible((GetAttrKey("layer"), GetAttrKey("bias")), (3, 4, 16), jnp.float32, True)
    assert fp8_gather_eligible((GetAttrKey("layer"), GetAttrKey("weight")), (64, 256), jnp.float32, True)


def test_on_one_device_the_loss_sees_the_fp8_rounded_kernel_and_the_bias_in_bfloat16():
    """Quantize-then-dequantize with the tensor's scale, straight-through gradients in float32."""
    params = {"kernel": jnp.arange(12.0).reshape(3, 4) / 7, "bias": jnp.linspace(-1.0, 1.0, 4) / 3}
    inputs = jnp.arange(6.0).reshape(2, 3) / 5
    seen = {}

    def loss_fn(params, inputs):
        seen.update(jax.tree.map(lambda leaf: leaf.dtype, params))
        return jnp.mean((inputs @ params["kernel"].astype(jnp.float32) + params["bias"]) ** 2)

    sharded = jaxamp.fsdp.fsdp_loss(loss_fn, one_device_mesh(), "gather=fp8,reduce=f32,dequantize=f32")
    loss, grads = jax.jit(jax.value_and_grad(sharded))(params, inputs)
    values, scale_inv = jaxamp.fp8.quantize(params["kernel"])
    expected_params = {"kernel": values.astype(jnp.float32) * scale_inv, "bias": params["bias"]}
    expected_loss, expected_grads = jax.value_and_grad(loss_fn)(expected_params, inputs)
    assert seen == {"kernel": jnp.float32, "bias": jnp.float32}
    np.testing.assert_allclose(loss, expected_loss, rtol=1e-6)
    for grad, expected in zip(jax.tree.leaves(grads), jax.tree.leaves(expected_grads)):
        np.testing.assert_allclose(grad, expected, rtol=1e-6)  # the gradient passes straight through
    assert not np.array_equal(expected_params["kernel"], params["kernel"])  # it was rounded


@pytest.mark.parametrize(
    "param_dtype, communication",
    [
        (jnp.float32, "gather=fp8,reduce=bf16,dequantize=f32,allow_narrow_reduce"),
        (jnp.bfloat16, "gather=e5m2,reduce=f32,dequantize=f16"),
    ],
)
def test_on_one_device_the_gathered_kernel_has_the_dequantize_dtype_and_its_gradient_the_reduce_then_param_dtype(
    param_dtype, communication
):
    """The loss reads the kernel in the dequantize dtype; its gradient is rounded to the reduce
    dtype (summed there) and handed back in the param's. Fails if either dtype were dropped
    (float32 in its place) on the way in or out."""
    kernel = (jnp.arange(12.0).reshape(3, 4) / 7 + 1 / 3).astype(param_dtype)
    inputs = jnp.arange(6.0).reshape(2, 3) / 5 + 0.1
    seen = {}

    def loss_fn(params, inputs):
        seen["kernel"] = params["kernel"].dtype
        return jnp.sum(jnp.sin(inputs @ params["kernel"].astype(jnp.float32)))

    sharded = jaxamp.fsdp.fsdp_loss(loss_fn, one_device_mesh(), communication)
    grads = jax.jit(jax.grad(sharded))({"kernel": kernel}, inputs)["kernel"]
    policy = get_communication_policy(communication)
    assert seen["kernel"] == policy.dequantize_dtype and grads.dtype == param_dtype
    values, scale_inv = jaxamp.fp8.quantize(kernel, policy.gather_dtype)
    gathered = (values.astype(jnp.float32) * scale_inv).astype(policy.dequantize_dtype)
    expected = jax.grad(loss_fn)({"kernel": gathered}, inputs)["kernel"]
    np.testing.assert_array_equal(grads, expected.astype(policy.reduce_dtype).astype(param_dtype))
    assert policy.reduce_dtype == jnp.float32 or not np.array_equal(grads, expected)  # it was rounded


def test_a_leaf_the_eligibility_rule_refuses_is_gathered_unrounded():
    """fsdp_loss(fp8_eligible=...): e.g. embedding tables kept out of FP8, as torchao does."""
    params = {"embedding": jnp.arange(12.0).reshape(3, 4) / 7, "kernel": jnp.arange(12.0).reshape(4, 3) / 7}

    def loss_fn(params, tokens):
        return jnp.mean(params["embedding"][tokens] @ params["kernel"]), params

    def kernels_only(path, shape, dtype, sharded):
        return fp8_gather_eligible(path, shape, dtype, sharded) and path[-1].key != "embedding"

    sharded = jaxamp.fsdp.fsdp_loss(
        loss_fn, one_device_mesh(), "gather=fp8,dequantize=f32", has_aux=True, fp8_eligible=kernels_only
    )
    _, gathered = jax.jit(sharded)(params, jnp.array([0, 2]))
    values, scale_inv = jaxamp.fp8.quantize(params["kernel"])
    np.testing.assert_array_equal(gathered["embedding"], params["embedding"])
    np.testing.assert_allclose(gathered["kernel"], values.astype(jnp.float32) * scale_inv, rtol=1e-7)
    assert not np.array_equal(gathered["kernel"], params["kernel"])


def test_the_language_model_dequantizes_fp8_gathers_into_its_compute_dtype():
    from experiments.lm import config

    settings = config.LMConfig(sharding="fsdp", gather_dtype="float8_e4m3fn", reduce_dtype="float32")
    communication = config.communication_policy(settings, jaxamp.get_policy("mixed_float8"))
    assert str(communication) == "gather=float8_e4m3fn,reduce=float32,dequantize=bfloat16"
    float16 = config.communication_policy(settings, jaxamp.get_policy("p=f32,c=f16,o=f32"))
    assert float16.dequantize_dtype == jnp.float16
    fp8_sums = config.LMConfig(sharding="fsdp", gather_dtype="float8_e4m3fn", reduce_dtype="float8_e4m3fn")
    with pytest.raises(config.ConfigError, match="not summed in FP8"):
        config.communication_policy(fp8_sums, jaxamp.get_policy("mixed_float8"))


# --- 8 virtual CPU devices -----------------------------------------------------------

# JAX_PLATFORMS=cpu: the CUDA plugin, where installed, registers without a GPU (for the H200 program).
RUN = FreshProcess(
    "fp8_gathers", "tests/fsdp_fp8_gather_run.py", env={"JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags()}
)


@pytest.fixture(scope="module")
def fp8_gathers():
    return RUN.last_json_line()


def totals_of(stages, stage):
    totals = {}
    for total in stages[stage]:
        totals.setdefault(total["kind"], {})[total["dtype"]] = total
    return totals


def row(report, setting):
    return next(row for row in report["rows"] if row["setting"] == setting)["stages"]


def test_the_weights_are_all_gathered_as_float8_e4m3fn_and_the_vectors_in_bfloat16(fp8_gathers):
    """Read from the partitioned program, which every backend receives, and from the H200's."""
    report = fp8_gathers["collectives"]
    fp8 = totals_of(row(report, "fsdp_loss gather=fp8,reduce=f32"), "partitioned")
    assert set(fp8["all-gather"]) == {"float8_e4m3fn", "bfloat16"}
    assert fp8["all-gather"]["float8_e4m3fn"]["result_bytes"] == report["fp8_param_count"]
    vectors = report["sharded_param_count"] - report["fp8_param_count"]
    assert 0 < vectors and fp8["all-gather"]["bfloat16"]["result_bytes"] == 2 * vectors
    # The backward pass is unchanged: float32 reduce-scatters of every sharded gradient.
    assert set(fp8["reduce-scatter"]) == {"float32"}
    assert fp8["reduce-scatter"]["float32"]["operand_bytes"] == 4 * report["sharded_param_count"]
    if "h200" not in fp8_gathers["collectives"]:
        pytest.skip(f"no H200 program: {fp8_gathers['collectives']['h200 skipped']}")
    h200 = {total["dtype"]: total for total in report["h200"] if total["kind"] == "all-gather"}
    assert h200["float8_e4m3fn"]["result_bytes"] == report["fp8_param_count"]


def test_fp8_gathers_add_one_all_reduce_of_one_amax_per_weight(fp8_gathers):
    """One collective for all the weights' scales, not one per weight, and at most 0.55x the bytes.

    Fails if the amaxes were reduced weight by weight (as many all-reduces as
    weights) or not at all (a scale per shard).
    """
    report = fp8_gathers["collectives"]
    bf16 = totals_of(row(report, "fsdp_loss gather=bf16,reduce=f32"), "partitioned")["all-reduce"]["float32"]
    fp8 = totals_of(row(report, "fsdp_loss gather=fp8,reduce=f32"), "partitioned")["all-reduce"]["float32"]
    assert report["fp8_weight_count"] > 1
    assert fp8["count"] == bf16["count"] + 1
    assert fp8["operand_bytes"] - bf16["operand_bytes"] == 4 * report["fp8_weight_count"]
    assert report["ratio partitioned"] <= 0.55


def test_every_shard_is_scaled_by_its_weight_s_global_amax(fp8_gathers):
    """pytorch/ao#4300: shards 2**28 apart in magnitude, each device's amax different.

    The gathered weight equals `jaxamp.fp8.quantize` of the full weight,
    dequantized: the small shards underflow to zero under the one global
    scale. With a scale per shard they would not, and the weight would differ
    by far more than the test allows.
    """
    check = fp8_gathers["global_scale"]
    assert check["specs"] == "P('data',)"  # device k holds rows 8k..8k+7
    assert check["vs_global_scale"] < 1e-6
    assert check["per_shard_vs_global"] > 1e-3 and check["vs_scale_per_shard"] > 1e-3
    assert check["zero_fraction"] > 0.2


def test_the_sharded_step_is_the_unsharded_one_with_its_weights_rounded_to_fp8(fp8_gathers):
    mlp = fp8_gathers["mlp"]
    assert mlp["vs_quantized_loss"] < 1e-5 and mlp["vs_quantized_grads"] < 1e-5
    assert mlp["vs_float32_loss"] < FP8_LOSS_RTOL
    assert mlp["grad_specs_match_params"]
    assert not mlp["inf_weight_loss_finite"]  # a non-finite weight makes the step skip, not saturate
    # A zero-initialized kernel (every shard's amax 0) gathers as zeros, not NaN.
    assert mlp["zero_kernel_grads_finite"]
    assert mlp["zero_kernel_vs_quantized_loss"] < 1e-5 and mlp["zero_kernel_vs_quantized_head_grads"] < 1e-5


def test_the_tiny_language_model_trains_with_fp8_gathers_as_with_bfloat16_gathers(fp8_gathers):
    """mixed_float8, 40 steps on 8 devices: the held-out loss within the FP8 parity tolerance."""
    bf16, fp8 = fp8_gathers["lm"]["bfloat16"], fp8_gathers["lm"]["float8_e4m3fn"]
    # Its CPU executable widens FP8 gathers to float16 as it widens bfloat16 ones to float32: the
    # ratio of the bytes holds there too.
    gathered = {
        run: sum(
            total["result_bytes"] for name, total in collectives.items() if name.startswith("all-gather")
        )
        for run, collectives in (("bf16", bf16["collectives"]), ("fp8", fp8["collectives"]))
    }
    assert "all-gather float16" in fp8["collectives"] and gathered["fp8"] <= 0.55 * gathered["bf16"]
    final_bf16, final_fp8 = bf16["held_out_losses"][-1], fp8["held_out_losses"][-1]
    assert final_fp8 < bf16["held_out_losses"][0]  # it learned
    assert abs(final_fp8 - final_bf16) <= FP8_LOSS_RTOL * final_bf16, (final_fp8, final_bf16)
