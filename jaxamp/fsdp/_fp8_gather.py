"""FP8 weight gathers for FSDP: one amax all-reduce, shards quantized, FP8 bytes gathered.

What torchao's FP8 all-gather of FSDP weights does (tensorwise current
scaling, ``precompute_float8_dynamic_scale_for_fsdp``), written for
`jaxamp.fsdp.fsdp_loss`'s ``shard_map``. For the eligible weights
``w_1 .. w_n``, of which each device holds a shard:

```text
local_amax = [max |shard_i| for i in 1..n]      # float32[n], this device's shards
amax       = pmax(local_amax, axis)             # ONE all-reduce for all n weights
for each weight i:                              # every device has the same amax_i
    scale_i = fp8.max / amax_i                  # 1 if amax_i is 0 or not finite, float32's
                                                # largest if amax_i is so small that it overflows
    q_i     = clip(shard_i * scale_i, -fp8.max, fp8.max).astype(fp8)   # saturating
    full_i  = all_gather(q_i, axis)             # FP8 bytes on the wire
    w_i     = (full_i * (1 / scale_i)).astype(dequantize dtype)       # NaN if amax_i is not finite
backward, straight through the quantization (as torchao):
    grad_shard_i = psum_scatter(grad_w_i.astype(reduce dtype), axis).astype(shard dtype)
```

After the ``pmax`` the scale of a weight is the one `jaxamp.fp8.quantize`
of the full weight would choose, on every device, so the gathered weight is
exactly the full weight quantized and dequantized with its global scale, and
the scale need not travel beside the FP8 bytes. A scale from each device's
own shard would gather shards scaled differently and dequantize them with
one device's scale: the loss divergence of pytorch/ao#4300 (stale or
unsynchronized scales). The scales are of this step's weights, never kept.
A weight holding an inf or a NaN comes out NaN, so the loss is not finite
and the step is skipped, as `jaxamp.fp8.quantize` arranges for matmuls. A
weight of zeros (a zero-initialized kernel) comes out zeros; a weight so
small that its scale would overflow float32 (an amax below 448 / 3.4e38)
is scaled by float32's largest value, as TransformerEngine's
``compute_scale_from_amax`` does. Neither makes the loss NaN.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

FP8_GATHER_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))
"""The FP8 dtypes weights may be gathered in: e4m3 (TransformerEngine's and torchao's weight format) or e5m2."""


def _key_name(key: Any) -> Any:
    return getattr(key, "key", getattr(key, "name", None))


def fp8_gather_eligible(path: Sequence[Any], shape: Sequence[int], dtype: Any, sharded: bool) -> bool:
    """Whether `jaxamp.fsdp.fsdp_loss` gathers this parameter in FP8 under an FP8 gather dtype.

    Eligible: the weights of matmuls, that is a floating parameter that is
    sharded (replicated ones are not gathered), has two or more dimensions
    and is not named ``bias``. So Dense and attention kernels and embedding
    tables travel in FP8; vectors (biases, norm scales and offsets) and the
    many-dimensional biases of ``nn.DenseGeneral`` stay in the dequantize
    dtype: they are a small share of the bytes and are added, not
    multiplied, where FP8's 3 mantissa bits would show. Embedding tables are
    included: a tied embedding is the output projection's weight, and a
    table is often the largest leaf; embeddings looked up from FP8 carry
    its rounding (3 mantissa bits: up to 2**-4 relative).

    Args:
        path: the parameter's key path in the params pytree.
        shape: its global shape.
        dtype: its dtype.
        sharded: whether it is split over the devices.
    """
    if not (sharded and jnp.issubdtype(dtype, jnp.floating) and len(shape) >= 2):
        return False
    return not (path and _key_name(path[-1]) == "bias")


def gather_fp8(
    shards: Sequence[jax.Array],
    dimensions: Sequence[int],
    reduce_dtypes: Sequence[Any],
    *,
    axis: str,
    fp8_dtype: Any,
    dequantize_dtype: Any,
) -> list[jax.Array]:
    """All-gathers the weights of which `shards` are this device's shards, in FP8 (see the module docstring).

    Runs inside ``shard_map`` over `axis`.

    Args:
        shards: this device's shard of each weight.
        dimensions: the dimension each weight is split along.
        reduce_dtypes: the dtype each weight's gradient is reduce-scattered in.
        axis: the mesh axis the weights are split over.
        fp8_dtype: one of `FP8_GATHER_DTYPES`.
        dequantize_dtype: the dtype the gathered weights are returned in.

    Returns:
        The full weights in `dequantize_dtype`, in the order of `shards`.
    """
    if not shards:
        return []
    local_amax = jnp.stack([jnp.max(jnp.abs(shard.astype(jnp.float32))) for shard in shards])
    amax = jax.lax.pmax(jax.lax.stop_gradient(local_amax), axis)
    return [
        _gather_quantized(shard, amax[index], axis, dimension, fp8_dtype, dequantize_dtype, reduce_dtype)
        for index, (shard, dimension, reduce_dtype) in enumerate(zip(shards, dimensions, reduce_dtypes))
    ]


def _gather_quantized(shard, amax, axis, dimension, fp8_dtype, dequantize_dtype, reduce_dtype):
    """One weight: quantized with the global `amax`, gathered in FP8, dequantized; straight-through VJP."""
    fp8_max = float(jnp.finfo(fp8_dtype).max)

    @jax.custom_vjp
    def gather(local, amax):
        usable = jnp.isfinite(amax) & (amax > 0)
        scale = jnp.minimum(fp8_max / jnp.where(usable, amax, 1.0), jnp.finfo(jnp.float32).max)
        scale = jnp.where(usable, scale, 1.0)
        quantized = jnp.clip(local.astype(jnp.float32) * scale, -fp8_max, fp8_max).astype(fp8_dtype)
        full = jax.lax.all_gather(quantized, axis, axis=dimension, tiled=True)
        scale_inv = jnp.where(jnp.isfinite(amax), 1.0 / scale, jnp.nan)
        return (full.astype(jnp.float32) * scale_inv).astype(dequantize_dtype)

    def forward(local, amax):
        return gather(local, amax), None

    def backward(_, full_grad):
        summed = jax.lax.psum_scatter(
            full_grad.astype(reduce_dtype), axis, scatter_dimension=dimension, tiled=True
        )
        return summed.astype(shard.dtype), jnp.zeros((), jnp.float32)

    gather.defvjp(forward, backward)
    return gather(shard, amax)
