"""FP8 weight gathers on 8 virtual CPU devices; prints one JSON line.

Run by tests/test_fsdp_fp8_gather.py in a fresh process (the device count is
fixed when JAX starts): ``python tests/fsdp_fp8_gather_run.py``. It reports

1. the collectives of one train step of the small GPT of
   `experiments.measure.communication_bytes` with bfloat16 and with FP8 gathers, as XLA's
   partitioner leaves them and as compiled for CPU, and with FP8 gathers as
   compiled for 8 H200s when the CUDA plugin is installed;
2. a weight whose 8 shards differ in magnitude by up to 2**28, gathered in
   FP8, against `jaxamp.fp8.quantize` of the full weight (one global scale)
   and against a scale per shard (the bug of pytorch/ao#4300);
3. the loss and gradients of a small MLP, sharded with FP8 gathers, against
   one device with its weights quantized and dequantized beforehand, and
   against one device in float32; the loss when a weight holds an inf; and
   the same comparison with its output layer's kernel zero-initialized;
4. a short run of the tiny language model, `experiments.lm.train`, with
   bfloat16 and with FP8 gathers: held-out losses.
"""

import json
import os
import pathlib
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh

import jaxamp
from experiments.measure import communication_bytes
from jaxamp.fp8 import quantize

FP8 = jaxamp.fsdp.CommunicationPolicy.from_policy("mixed_bf16", gather_dtype="float8_e4m3fn")
FP8_IN_FLOAT32 = jaxamp.fsdp.CommunicationPolicy(gather_dtype="float8_e4m3fn", dequantize_dtype="float32")
LM_STEPS = 40


def relative_difference(tree, reference):
    """The largest |a - b| / max|b| over the leaves."""
    return max(
        float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))) / np.max(np.abs(b)))
        for a, b in zip(jax.tree.leaves(tree), jax.tree.leaves(reference))
    )


def dequantized(x):
    values, scale_inv = quantize(x)
    return values.astype(jnp.float32) * scale_inv


def collectives_report(mesh):
    settings = {
        name: communication_bytes.SETTINGS[name]
        for name in (communication_bytes.BF16_GATHERS, communication_bytes.FP8_GATHERS)
    }
    report = communication_bytes.measure(mesh, 8, depth=1, settings=settings)
    for stage in ("partitioned", "compiled cpu"):
        report[f"ratio {stage}"] = (
            communication_bytes.gathered_bytes(report, communication_bytes.FP8_GATHERS, stage)[0]
            / (communication_bytes.gathered_bytes(report, communication_bytes.BF16_GATHERS, stage)[0])
        )
    try:
        gpu_mesh = communication_bytes.gpu_mesh("h200")
    except (ImportError, NotImplementedError, RuntimeError) as error:  # no CUDA plugin, or not registered
        report["h200 skipped"] = f"{type(error).__name__}: {error}"
        return report
    fp8_only = {
        communication_bytes.FP8_GATHERS: communication_bytes.SETTINGS[communication_bytes.FP8_GATHERS]
    }
    gpu = communication_bytes.measure(gpu_mesh, 8, depth=1, cpu_stages=False, settings=fp8_only)
    report["h200"] = gpu["rows"][0]["stages"]["compiled"]
    return report


def global_scale(mesh):
    """Rows 8k..8k+7 (device k's shard) of a (64, 16) weight scaled by 16**(k - 4)."""
    magnitudes = jnp.repeat(16.0 ** (jnp.arange(8) - 4), 8)[:, None]
    weight = jax.random.normal(jax.random.key(3), (64, 16)) * magnitudes

    def loss_fn(params, inputs):
        return jnp.mean(inputs @ params["w"]), params["w"]

    sharded = jaxamp.fsdp.fsdp_loss(loss_fn, mesh, FP8_IN_FLOAT32, has_aux=True)
    params = jax.device_put({"w": weight}, jaxamp.fsdp.fsdp_shardings({"w": weight}, mesh))
    _, gathered = jax.jit(sharded)(params, jnp.ones((8, 64)))
    per_shard = jnp.concatenate([dequantized(shard) for shard in jnp.split(weight, 8)])
    return {
        "specs": str(params["w"].sharding.spec),
        "vs_global_scale": relative_difference(gathered, dequantized(weight)),
        "vs_scale_per_shard": relative_difference(gathered, per_shard),
        "per_shard_vs_global": relative_difference(per_shard, dequantized(weight)),
        "zero_fraction": float(jnp.mean(gathered == 0)),
    }


class Mlp(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.gelu(nn.Dense(64)(x))
        return nn.Dense(16)(nn.LayerNorm()(x))


def mlp_parity(mesh):
    model = Mlp()
    images = jax.random.normal(jax.random.key(1), (16, 32))
    labels = jax.random.randint(jax.random.key(2), (16,), 0, 16)
    params = model.init(jax.random.key(0), images)["params"]

    def loss_fn(params, images, labels):
        logits = model.apply({"params": params}, images)
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    sharded_params = jax.device_put(params, jaxamp.fsdp.fsdp_shardings(params, mesh))
    step = jax.jit(jax.value_and_grad(jaxamp.fsdp.fsdp_loss(loss_fn, mesh, FP8_IN_FLOAT32)))
    loss, grads = step(sharded_params, images, labels)
    kernels_in_fp8 = {
        name: {**layer, "kernel": dequantized(layer["kernel"])} if "kernel" in layer else layer
        for name, layer in params.items()
    }
    quantized_loss, quantized_grads = jax.value_and_grad(loss_fn)(kernels_in_fp8, images, labels)
    plain_loss, plain_grads = jax.value_and_grad(loss_fn)(params, images, labels)
    with_inf = jax.tree.map(lambda leaf: leaf, sharded_params)
    with_inf["Dense_0"]["kernel"] = with_inf["Dense_0"]["kernel"].at[0, 0].set(jnp.inf)
    inf_loss, _ = step(with_inf, images, labels)
    # A zero-initialized output layer (as for a residual branch or LoRA's B): every shard all zeros.
    zero_kernel = jax.tree.map(lambda leaf: leaf, sharded_params)
    zero_kernel["Dense_1"]["kernel"] = zero_kernel["Dense_1"]["kernel"] * 0.0
    zero_loss, zero_grads = step(zero_kernel, images, labels)
    zero_kernels_in_fp8 = {
        **kernels_in_fp8,
        "Dense_1": {**kernels_in_fp8["Dense_1"], "kernel": jnp.zeros((64, 16))},
    }
    zero_plain_loss, zero_plain_grads = jax.value_and_grad(loss_fn)(zero_kernels_in_fp8, images, labels)
    return {
        "vs_quantized_loss": relative_difference(loss, quantized_loss),
        "vs_quantized_grads": relative_difference(grads, quantized_grads),
        "vs_float32_loss": relative_difference(loss, plain_loss),
        "vs_float32_grads": relative_difference(grads, plain_grads),
        "grad_specs_match_params": all(
            grad.sharding.spec == param.sharding.spec
            for grad, param in zip(jax.tree.leaves(grads), jax.tree.leaves(sharded_params))
        ),
        "inf_weight_loss_finite": bool(jnp.isfinite(inf_loss)),
        "zero_kernel_vs_quantized_loss": relative_difference(zero_loss, zero_plain_loss),
        "zero_kernel_grads_finite": all(
            bool(jnp.all(jnp.isfinite(grad))) for grad in jax.tree.leaves(zero_grads)
        ),
        # The layers below a zero kernel get zero gradients: only the head's are compared.
        "zero_kernel_vs_quantized_head_grads": relative_difference(
            zero_grads["Dense_1"], zero_plain_grads["Dense_1"]
        ),
    }


def lm_parity():
    from experiments.lm import config, train  # pylint: disable=import-outside-toplevel

    def run(gather_dtype):
        settings = config.LMConfig(
            model="tiny", precision="mixed_float8", route="autocast", context=32, batch_size=8,
            steps=LM_STEPS, eval_every=LM_STEPS, eval_batches=2, gather_dtype=gather_dtype,
            reduce_dtype="float32", progress=False,
        )  # fmt: skip
        result = train.train_and_evaluate(settings, log=lambda line: None)
        return {
            "held_out_losses": [entry["held_out_loss"] for entry in result["evaluations"]],
            "collectives": result["cost"]["collectives_per_device"],
        }

    return {"bfloat16": run("bfloat16"), "float8_e4m3fn": run("float8_e4m3fn")}


def main():
    jax.config.update(
        "jax_enable_compilation_cache", False
    )  # XLA must compile to write the partitioned module
    mesh = Mesh(np.array(jax.devices()), ("data",))
    results = {
        "collectives": collectives_report(mesh),
        "global_scale": global_scale(mesh),
        "mlp": mlp_parity(mesh),
        "lm": lm_parity(),
    }
    print(json.dumps(results))


if __name__ == "__main__":
    main()
