"""Sharded training on 8 virtual CPU devices against one device; prints JSON.

Run by tests/test_fsdp.py in a fresh process (the device count is fixed
when JAX starts): ``python tests/fsdp_parity_run.py``. Each check computes
the same thing sharded with `jaxamp.fsdp.fsdp_loss` and unsharded, in float32,
and reports the largest relative difference.
"""

import json
import os
import pathlib
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh

import jaxamp
from jaxamp.diagnostics._collectives import collectives, compile_with_partitioned_hlo

# Every matmul in float32 on both sides: the runs then differ only in the
# order of the cross-device sums.
jax.config.update("jax_default_matmul_precision", "highest")
# A cached executable is not compiled, and XLA would write no partitioned module.
jax.config.update("jax_enable_compilation_cache", False)


class Mlp(nn.Module):
    """Two Dense layers around a LayerNorm; the last layer's bias (3) is replicated."""

    @nn.compact
    def __call__(self, x):
        x = nn.gelu(nn.Dense(64)(x))
        return nn.Dense(3)(nn.LayerNorm()(x))


def relative_difference(tree, reference):
    """The largest |a - b| / max|b| over the leaves."""
    return max(
        float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))) / np.max(np.abs(b)))
        for a, b in zip(jax.tree.leaves(tree), jax.tree.leaves(reference))
    )


def main():
    mesh = Mesh(np.array(jax.devices()), ("data",))
    images = jax.random.normal(jax.random.key(1), (16, 32))
    labels = jax.random.randint(jax.random.key(2), (16,), 0, 3)
    results = {}

    model = Mlp()
    params = model.init(jax.random.key(0), images)["params"]

    def loss_fn(params, images, labels):
        logits = model.apply({"params": params}, images)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
        return loss, {"accuracy": jnp.mean(logits.argmax(-1) == labels).astype(jnp.float32)}

    sharded_params = jax.device_put(params, jaxamp.fsdp.fsdp_shardings(params, mesh))
    results["param_specs"] = {
        jax.tree_util.keystr(path): str(leaf.sharding.spec)
        for path, leaf in jax.tree_util.tree_leaves_with_path(sharded_params)
    }

    # 1. Loss, aux and gradients of one batch.
    (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, images, labels)
    sharded = jaxamp.fsdp.fsdp_loss(loss_fn, mesh, has_aux=True)
    (sharded_loss, sharded_aux), sharded_grads = jax.jit(jax.value_and_grad(sharded, has_aux=True))(
        sharded_params, images, labels
    )
    results["loss"] = relative_difference(sharded_loss, loss)
    results["accuracy"] = relative_difference(sharded_aux["accuracy"], aux["accuracy"])
    results["grads"] = relative_difference(sharded_grads, grads)
    results["grad_specs_match_params"] = all(
        grad.sharding.spec == param.sharding.spec
        for grad, param in zip(jax.tree.leaves(sharded_grads), jax.tree.leaves(sharded_params))
    )

    # 2. Three Adam steps through TrainState with a dynamic loss scale.
    def train(state, step_loss):
        @jax.jit
        def train_step(state, images, labels):
            (loss, _), grads, grads_finite = jaxamp.scaled_value_and_grad(
                step_loss, state.loss_scale, has_aux=True
            )(state.params, images, labels)
            return state.apply_gradients(grads=grads, grads_finite=grads_finite), loss

        losses = []
        for _ in range(3):
            state, loss = train_step(state, images, labels)
            losses.append(float(loss))
        return state, losses

    def fresh_state():
        return jaxamp.TrainState.create(
            apply_fn=model.apply, params=params, tx=optax.adam(1e-2), loss_scale=jaxamp.DynamicLossScale()
        )

    state, losses = train(fresh_state(), loss_fn)
    sharded_state = fresh_state()
    sharded_state = jax.device_put(sharded_state, jaxamp.fsdp.fsdp_shardings(sharded_state, mesh))
    sharded_state, sharded_losses = train(sharded_state, sharded)
    results["train_losses"] = relative_difference(sharded_losses, losses)
    results["train_params"] = relative_difference(sharded_state.params, state.params)
    results["train_opt_state"] = relative_difference(
        [leaf for leaf in jax.tree.leaves(sharded_state.opt_state) if leaf.ndim],
        [leaf for leaf in jax.tree.leaves(state.opt_state) if leaf.ndim],
    )

    # 3. autocast composes inside: bfloat16 compute, bfloat16 gathers, float32 sums.
    mixed_loss = jaxamp.autocast(loss_fn, "mixed_bf16")
    (mixed, _), mixed_grads = jax.jit(
        jax.value_and_grad(
            jaxamp.fsdp.fsdp_loss(mixed_loss, mesh, "gather=bf16,reduce=f32", has_aux=True), has_aux=True
        )
    )(sharded_params, images, labels)
    results["autocast_bf16_loss"] = relative_difference(mixed, loss)
    results["autocast_bf16_grad_dtypes"] = sorted({str(leaf.dtype) for leaf in jax.tree.leaves(mixed_grads)})

    # 4. The sum of a replicated parameter's gradient (Dense_1's bias, 3
    # floats) runs in the reduce dtype too.
    for name, communication in [("default", None), ("narrow", "gather=bf16,reduce=bf16,allow_narrow_reduce")]:
        step = jax.jit(jax.grad(jaxamp.fsdp.fsdp_loss(loss_fn, mesh, communication, has_aux=True), has_aux=True))
        _, partitioned = compile_with_partitioned_hlo(step.lower(sharded_params, images, labels))
        results[f"replicated_sums_{name}"] = [
            [op.dtype, op.operand_bytes] for op in collectives(partitioned) if op.kind == "all-reduce"
        ]

    # 5. A batch that does not split over the devices.
    try:
        jax.jit(sharded)(sharded_params, images[:12], labels[:12])
        results["indivisible_batch_error"] = None
    except ValueError as error:
        results["indivisible_batch_error"] = str(error)

    print(json.dumps(results))


if __name__ == "__main__":
    main()
