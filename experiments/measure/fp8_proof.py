"""Proof that FP8 ran, or did not: small programs compiled for an H200 without a GPU.

Each is compiled for an H200 target without a GPU
(`jaxamp.diagnostics.gpu_target_device`); the measurement prints its compiled
`jaxamp.precision_report` and what `jaxamp.diagnostics.check_fp8` says:

1. a dense layer in FP8 with per-tensor current scaling (the reference
   pattern of `experiments.measure.fp8_scaling_cost`: ``lax.dot_general`` on FP8
   operands with the ``ANY_F8_ANY_F8_F32`` preset, a custom VJP whose two
   backward GEMMs take the cotangent in ``float8_e5m2``), forward and
   backward: three cuBLASLt FP8 GEMMs, no warning; then the same layer
   written as ``x @ w`` under ``jaxamp.autocast(..., "mixed_float8")``;
2. the bfloat16 quantize-dequantize pattern ``convert(convert(x, f8),
   bf16) @ ...``: XLA folds the round trip and runs a bfloat16 GEMM; the
   check warns;
3. matmuls that fall back to bfloat16 on purpose, under jaxamp's
   ``jaxamp_fp8_fallback_<reason>`` scopes: rows with their reasons, no
   warning;
4. a Flax ``nn.Dense`` with Flax's FP8 ops as its ``dot_general_cls``,
   forward and backward: the deprecated quantize-dequantize
   ``Fp8DotGeneralOp`` (bfloat16 GEMMs; the check warns) and
   ``Fp8DirectDotGeneralOp`` (FP8 GEMMs), where the installed Flax has them.

Needs the CUDA PJRT plugin. Writes fp8_proof.txt.
"""

from __future__ import annotations

import os
import re
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.linen import fp8_ops

import jaxamp
from experiments.measure.fp8_scaling_cost import MATMUL, current_scaling_dot_general
from experiments.measure.gpu_target import target_device

E4M3 = jnp.float8_e4m3fn


def fp8_dense_step(x, w, g):
    """The layer's output and its gradients for the cotangent `g`."""
    y, vjp = jax.vjp(lambda x, w: current_scaling_dot_general(x, w, MATMUL), x, w)
    return y, vjp(g)


def autocast_dense_step(x, w, g):
    """The same layer as a plain matmul under ``jaxamp.autocast(..., "mixed_float8")``."""
    y, vjp = jax.vjp(jaxamp.autocast(lambda x, w: x @ w, "mixed_float8"), x, w)
    return y, vjp(g)


def quantize_dequantize_dense(x, w):
    """FP8 numerics, bfloat16 math: the pattern XLA folds away."""
    return x.astype(E4M3).astype(jnp.bfloat16) @ w.astype(E4M3).astype(jnp.bfloat16)


def with_fallbacks(x, w, q, k):
    """A matmul whose sizes are not multiples of 16 and a batched attention core."""
    with jax.named_scope("jaxamp_fp8_fallback_shape_not_multiple_of_16"):
        y = x @ w
    with jax.named_scope("jaxamp_fp8_fallback_batch_dims"):
        scores = jnp.einsum("bqd,bkd->bqk", q, k)
    return y, scores


def flax_dense_step(dot_general_cls):
    """value_and_grad of a Flax Dense layer's sum, with its variables and input as arguments."""
    model = nn.Dense(768, dot_general_cls=dot_general_cls, dtype=jnp.bfloat16)

    def step(variables, x):
        return jax.value_and_grad(lambda v: model.apply(v, x).astype(jnp.float32).sum())(variables)

    x = jax.ShapeDtypeStruct((256, 768), jnp.bfloat16)
    return step, (jax.eval_shape(model.init, jax.random.key(0), x), x)


def show(out, title: str, fun, shapes=None, args=None) -> None:
    """Prints the compiled report of fun on bfloat16 arrays of `shapes` (or on `args`), and the check."""
    device = target_device("h200")
    if args is None:
        args = [jax.ShapeDtypeStruct(shape, jnp.bfloat16) for shape in shapes]
        title = f"{title}: {', '.join(f'bfloat16{list(shape)}' for shape in shapes)}"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # Flax's deprecated FP8 op says so
        report = jaxamp.precision_report(fun, *jaxamp.diagnostics.on_device(args, device), compiled=True)
    out.print(f"== {title}\n{report}")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", jaxamp.diagnostics.Fp8NotUsedWarning)
        missed = jaxamp.diagnostics.check_fp8(report)
    out.print(f"check_fp8: {len(missed)} op(s) missed FP8")
    for warning in caught:
        if issubclass(warning.category, jaxamp.diagnostics.Fp8NotUsedWarning):
            # Paths relative to the repository, so the output reads the same on every machine.
            message = re.sub(r"\S*site-packages/", "", str(warning.message).replace(os.getcwd() + os.sep, ""))
            out.print(f"Fp8NotUsedWarning: {message}")
    out.print()


def add_arguments(parser) -> None:
    del parser  # no flags of its own


def run(args, out) -> None:
    del args
    target_device("h200")  # the CUDA plugin missing: what to install, in one line, before any output
    out.print(
        f"jax {jax.__version__}, compiled for {jaxamp.diagnostics.GPU_TARGETS['h200'].description} (no GPU)\n"
    )
    show(out, "FP8 dense layer, forward and backward", fp8_dense_step, [(256, 768), (768, 3072), (256, 3072)])
    show(
        out,
        'the same layer as x @ w under jaxamp.autocast(..., "mixed_float8")',
        autocast_dense_step,
        [(256, 768), (768, 3072), (256, 3072)],
    )
    show(out, "bfloat16 quantize-dequantize", quantize_dequantize_dense, [(256, 768), (768, 3072)])
    show(out, "fallbacks under their scopes", with_fallbacks, [(24, 40), (40, 24), (2, 64, 32), (2, 64, 32)])
    for name in ("Fp8DotGeneralOp", "Fp8DirectDotGeneralOp"):
        if hasattr(fp8_ops, name):
            step, step_args = flax_dense_step(getattr(fp8_ops, name))
            show(
                out,
                f"flax nn.Dense(768, dot_general_cls={name}), forward and backward, x bfloat16[256, 768]",
                step,
                args=step_args,
            )
    out.save_printed("fp8_proof.txt")
