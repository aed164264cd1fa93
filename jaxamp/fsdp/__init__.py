"""Fully sharded data parallel training with mixed-precision communication.

Parameters and optimizer state are sharded over one mesh axis (each leaf
split along one dimension, `fsdp_shardings`), and so is the batch (along its
leading dimension). Every step, each device gathers the full parameters,
computes the loss and gradients of its share of the batch, and the gradients
are summed over the devices and scattered back into shards. A
`CommunicationPolicy` states in which dtype those two collectives run, like
PyTorch FSDP's ``MixedPrecision(param_dtype, reduce_dtype)``: for instance
bfloat16 gathers (half the bytes of float32) and float32 reductions.

`fsdp_loss` turns a loss function into one that takes the sharded params and
the global batch; it is an ordinary JAX function, so it composes with
`jax.value_and_grad`, `jaxamp.scaled_value_and_grad`, `jax.jit` and
`jaxamp.TrainState` as they are. Inside, per leaf (``shard_map`` over the
axis):

```python
# forward: gather in the gather dtype
full = all_gather(shard.astype(gather_dtype), axis, tiled=True)
loss = pmean(loss_fn(full, local_batch), axis)
# backward (a custom VJP): reduce in the reduce dtype
grad_shard = psum_scatter(local_grad.astype(reduce_dtype), axis, tiled=True)
grad_shard = grad_shard.astype(shard.dtype)
```

The cast before the all-gather and the cast before the reduce-scatter are
written into the program, not left to XLA's sharding propagation: with plain
``jax.jit`` and shardings, the partitioner chooses per program whether a
cast that follows a gather moves in front of it, and a gradient computed in
bfloat16 is summed in bfloat16 before any cast back (JAX issue 27496),
because the sum sits inside the partitioned matmul. Leaves no dimension of
which divides by the axis size are replicated: they are not gathered (they
keep their dtype), and their gradients are all-reduced in the reduce dtype
(each device casts the leaf to it and then to a per-device value,
``jax.lax.pcast(..., to="varying")``, whose transpose is that sum).

Defaults: `CommunicationPolicy()` communicates in each parameter's own dtype;
`CommunicationPolicy.from_policy(policy)` gathers in the policy's compute
dtype and reduces in its param dtype. A reduce dtype narrower than a
parameter's dtype is refused unless ``allow_narrow_reduce=True``.

FP8 weight gathers: with ``gather_dtype="float8_e4m3fn"`` the weights of
matmuls (`fp8_gather_eligible`) are quantized shard by
shard with one global scale per weight, from a single ``pmax`` of all their
amaxes, gathered as FP8 bytes and dequantized into ``dequantize_dtype``
(bfloat16 by default), in which the other parameters are gathered; the
gradients are reduce-scattered as before, straight through the quantization
(`_fp8_gather` has the algorithm).

Examples:
    >>> mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
    >>> policy = jaxamp.get_policy("mixed_bf16")
    >>> model = jaxamp.apply_policy(Transformer(), policy)
    >>> communication = jaxamp.fsdp.CommunicationPolicy.from_policy(policy)  # bf16 gathers, f32 sums
    >>> def loss_fn(params, tokens, targets):
    ...     logits = model.apply({"params": params}, tokens)
    ...     return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
    >>> sharded_loss = jaxamp.fsdp.fsdp_loss(loss_fn, mesh, communication)
    >>> state = jaxamp.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-3))
    >>> state = jax.device_put(state, jaxamp.fsdp.fsdp_shardings(state, mesh))
    >>> @jax.jit
    ... def train_step(state, tokens, targets):
    ...     loss, grads, grads_finite = jaxamp.scaled_value_and_grad(
    ...         sharded_loss, state.loss_scale)(state.params, tokens, targets)
    ...     return state.apply_gradients(grads=grads, grads_finite=grads_finite), loss
"""

from jaxamp.fsdp._fp8_gather import fp8_gather_eligible
from jaxamp.fsdp._sharding import (
    CommunicationPolicy,
    fsdp_loss,
    fsdp_shardings,
    get_communication_policy,
    is_narrower,
    shard_dimension,
)

__all__ = [
    "CommunicationPolicy",
    "fp8_gather_eligible",
    "fsdp_loss",
    "fsdp_shardings",
    "get_communication_policy",
    "is_narrower",
    "shard_dimension",
]
