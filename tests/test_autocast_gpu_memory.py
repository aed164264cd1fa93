"""`jaxamp.autocast` and `jaxamp.apply_policy` need the same memory on a compiled bottleneck ResNet.

Compiled for an H200 target on this CPU (skipped without the CUDA PJRT
plugin). The float32 activations that autocast once kept for the backward
pass came from BatchNorm and ReLU: BatchNorm's float32 statistics, scale and
offset made the normalized activation, and so the residual sum, float32;
and ``jax.nn.relu``'s derivative, traced for float32, gave XLA float32
cotangents to keep. With broadcast operands weak
(`jaxamp._autocast.rules.follow_rule`) and a custom JVP rewritten for
its inputs' current dtypes (`jaxamp._autocast.higher_order.custom_jvp_rule`),
both stay float16. `apply_policy` runs the model through autocast, its
BatchNorms in a normalization scope (float32 inside, float16 out), so the
two routes compile to the same memory.
"""

import functools

import jax
import jax.numpy as jnp
import optax
import pytest

import jaxamp
from experiments.models import resnet

# Two bottleneck stages, 16 and 32 inner channels: each block has the three
# BatchNorms and the residual sum of ResNet50's, and compiles in seconds.
TinyBottleneckResNet = functools.partial(
    resnet.ResNet, stage_sizes=[1, 1], block_cls=resnet.Bottleneck, num_filters=16
)
BATCH = 32


def _train_step(apply_fn):
    """One SGD step of softmax cross-entropy, BatchNorm in train mode, as the recipe's."""

    def step(params, batch_stats, images, labels):
        def loss_fn(params):
            logits, updates = apply_fn(
                {"params": params, "batch_stats": batch_stats}, images, mutable=["batch_stats"]
            )
            loss = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels)
            return loss.mean(), updates["batch_stats"]

        grads, new_stats = jax.grad(loss_fn, has_aux=True)(params)
        params = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
        return params, new_stats

    return step


def _temp_bytes(route: str) -> int:
    device = jaxamp.diagnostics.gpu_target_device("h200")
    model = TinyBottleneckResNet()
    images = jax.ShapeDtypeStruct((BATCH, 32, 32, 3), jnp.float32)
    variables = jax.eval_shape(model.init, jax.random.key(0), images)
    apply_fn = {
        "float32": model.apply,
        "apply_policy": jaxamp.apply_policy(model, "mixed_float16").apply,
        "autocast": jaxamp.autocast(model.apply, "mixed_float16"),
    }[route]
    arguments = jaxamp.diagnostics.on_device(
        (variables["params"], variables["batch_stats"], images, jax.ShapeDtypeStruct((BATCH,), jnp.int32)),
        device,
    )
    compiled = jax.jit(_train_step(apply_fn)).lower(*arguments).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_a_bottleneck_resnet_train_step_needs_half_of_float32s_temp_memory_by_either_route():
    """Before the rules kept BatchNorm's and ReLU's outputs float16, autocast needed 0.74x of float32's."""
    if not jaxamp.diagnostics.cuda_plugin_available():
        pytest.skip("needs the CUDA PJRT plugin (pip install 'jax-mixed-precision[gpu-aot]')")
    float32, apply_policy, autocast = (
        _temp_bytes(route) for route in ("float32", "apply_policy", "autocast")
    )
    assert autocast <= 0.53 * float32, (autocast / float32, apply_policy / float32)
    assert abs(apply_policy - autocast) <= 0.02 * autocast, apply_policy / autocast
