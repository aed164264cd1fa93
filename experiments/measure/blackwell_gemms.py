"""Block-scaled GEMMs on a B200, on paper: each matmul's training pass in bf16, FP8, MXFP8 and NVFP4.

For GPT-2 124M's matmuls (8192 tokens) and the four of the 5B-parameter
layer TransformerEngine benchmarks (15872 tokens, hidden 4096), the
training pass of ``x[M, K] @ w[K, N]`` (forward, dgrad and wgrad, bfloat16
operands and cotangent) is compiled for a B200 target stating cuDNN 9.10
without a GPU: plain bfloat16, `jaxamp.fp8_dot_general` (per-tensor
current scaling) and `jaxamp.fp8.block_scaled_dot_general` in MXFP8 and
NVFP4. For each: the GEMM kernels XLA compiled them to, the sum of every
kernel's roofline bound (`jaxamp.diagnostics.kernel_roofline`), its speed-up
over bfloat16, and `jaxamp.diagnostics.fp8_matmul_cost`'s speed-up (the
model ``mixed_*``'s rule decides by). Beside the 5B shapes, TransformerEngine's
published forward-GEMM speed-ups on a B300 (autocast mode, quantization
included; its docs' ``gemm_profiling`` page), a measurement, not a bound.
Needs the CUDA PJRT plugin. Writes gemms.md.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp

import jaxamp
from experiments.measure.gpu_target import compile_for
from experiments.measure.markdown import table

MATMUL = (((1,), (0,)), ((), ()))
FORMATS = ("bfloat16", "float8", "mxfp8", "nvfp4")
CUDNN = (9, 10)

# (name, M, K, N, TransformerEngine's B300 forward speed-ups over BF16 (FP8 current, MXFP8, NVFP4) or None).
# TE's figures: docs/examples/gemm_profiling/gemm_profiling.rst, "Fprop Shapes" in autocast mode:
# BF16 / FP8Current / MXFP8 / NVFP4 ms of 1.071/0.605/0.579/0.392, 0.307/0.317/0.269/0.256,
# 1.393/0.924/0.924/0.635 and 1.426/1.033/1.076/0.649.
SHAPES = (
    ("GPT-2 124M attention qkv", 8192, 768, 2304, None),
    ("GPT-2 124M attention out", 8192, 768, 768, None),
    ("GPT-2 124M MLP up", 8192, 768, 3072, None),
    ("GPT-2 124M MLP down", 8192, 3072, 768, None),
    ("GPT-2 124M logits", 8192, 768, 50304, None),
    ("TE 5B attention qkv", 15872, 4096, 12288, (1.071 / 0.605, 1.071 / 0.579, 1.071 / 0.392)),
    ("TE 5B attention out", 15872, 4096, 4096, (0.307 / 0.317, 0.307 / 0.269, 0.307 / 0.256)),
    ("TE 5B MLP up", 15872, 4096, 16384, (1.393 / 0.924, 1.393 / 0.924, 1.393 / 0.635)),
    ("TE 5B MLP down", 15872, 16384, 4096, (1.426 / 1.033, 1.426 / 1.076, 1.426 / 0.649)),
)
# TE's whole layer (4 forward + 4 dgrad + 4 wgrad GEMMs), B300, autocast: BF16 12.758 ms per layer,
# FP8Current 9.147, MXFP8 8.984, NVFP4 6.453.
TE_LAYER = {"float8": 12.758 / 9.147, "mxfp8": 12.758 / 8.984, "nvfp4": 12.758 / 6.453}


def training_pass(matmul_format: str):
    """One matmul's forward and both gradients, in `matmul_format`."""

    def product(x, w):
        if matmul_format == "bfloat16":
            return jnp.dot(x, w, preferred_element_type=jnp.bfloat16)
        if matmul_format == "float8":
            return jaxamp.fp8_dot_general(x, w, MATMUL)
        return jaxamp.fp8.block_scaled_dot_general(x, w, MATMUL, matmul_format)

    def step(x, w, g):
        y, vjp = jax.vjp(product, x, w)
        return y, vjp(g)

    return step


def compiled_pass(device, m: int, k: int, n: int, matmul_format: str):
    """The pass's kernel roofline on a B200 and the GEMM kernels it compiled to."""
    structs = [jax.ShapeDtypeStruct(shape, jnp.bfloat16) for shape in ((m, k), (k, n), (m, n))]
    program = compile_for(training_pass(matmul_format), structs, device)
    roofline = jaxamp.diagnostics.kernel_roofline(program.text, "b200")
    gemms = [kernel.kind for kernel in roofline.kernels if kernel.flops]
    return roofline, gemms


def gemm_kinds(kinds: list[str]) -> str:
    """``3 x __cudnn$blockScaledDot``, or each kind counted."""
    counted = {kind: kinds.count(kind) for kind in dict.fromkeys(kinds)}
    return ", ".join(f"{count} x `{re.sub(r'[|]', '/', kind)}`" for kind, count in counted.items())


def add_arguments(parser) -> None:
    del parser  # no flags of its own


def run(args, out) -> None:
    del args
    device = jaxamp.diagnostics.gpu_target_device("b200", cudnn_version=CUDNN)
    rows, kernels = [], []
    totals = dict.fromkeys(FORMATS[1:], 0.0) | {"bfloat16": 0.0}
    for name, m, k, n, te in SHAPES:
        bounds = {}
        for matmul_format in FORMATS:
            roofline, gemms = compiled_pass(device, m, k, n, matmul_format)
            bounds[matmul_format] = roofline.per_kernel_s
            kernels.append([name, matmul_format, gemm_kinds(gemms), f"{roofline.per_kernel_s * 1e6:,.1f}"])
            if name.startswith("TE"):
                totals[matmul_format] += roofline.per_kernel_s
            out.print(f"{name} {matmul_format}: {roofline.per_kernel_s * 1e6:,.1f} us, {gemm_kinds(gemms)}")
        row = [name, m, k, n, f"{bounds['bfloat16'] * 1e6:,.1f}"]
        for index, matmul_format in enumerate(FORMATS[1:]):
            model = jaxamp.diagnostics.fp8_matmul_cost(m, k, n, "b200", matmul_format=matmul_format)
            row += [
                f"{bounds['bfloat16'] / bounds[matmul_format]:.2f}x",
                f"{model.speedup:.2f}x",
                "" if te is None else f"{te[index]:.2f}x",
            ]
        rows.append(row)
    header = ["matmul", "M", "K", "N", "bf16 us"]
    for matmul_format in FORMATS[1:]:
        header += [f"{matmul_format} compiled", f"{matmul_format} model", f"{matmul_format} TE B300 fwd"]
    layer = [
        f"{matmul_format}: {totals['bfloat16'] / totals[matmul_format]:.2f}x here, "
        f"{TE_LAYER[matmul_format]:.2f}x TE"
        for matmul_format in FORMATS[1:]
    ]
    page = "\n".join(
        [
            "# Block-scaled GEMMs on a B200, on paper: one matmul's training pass against bfloat16",
            "",
            f"Command: `{out.command}`",
            "",
            (
                "Each cell: bfloat16's time over the format's, for the training pass of `x[M, K] @ w[K, N]` "
                "(forward, dgrad, wgrad; quantization included). Compiled: the sum of the kernels' roofline "
                "bounds of the program XLA compiles for a B200 (cuDNN 9.10 stated; FP8 4.5, FP4 9, bf16 2.25 "
                "PFLOP/s dense, 8 TB/s). Model: `jaxamp.diagnostics.fp8_matmul_cost`, what the rule of "
                "`mixed_float8`, `mixed_mxfp8` and `mixed_nvfp4` decides by (above 1: the matmul runs in that "
                "format). TE B300 fwd: TransformerEngine's measured forward GEMM on a B300, autocast mode "
                "(its gemm_profiling page), a measurement of one GEMM of three on another GPU, beside for scale."
            ),
            "",
            table(header, rows, "lrrrr" + "rrr" * 3).rstrip(),
            "",
            f"The four TE 5B matmuls together: {'; '.join(layer)} (TE: the whole layer's 12 GEMMs, autocast).",
            "",
            "The GEMM kernels of each compiled pass:",
            "",
            table(["matmul", "format", "GEMM kernels", "bound us"], kernels, "lllr").rstrip(),
            "",
        ]
    )
    out.write("gemms.md", page)
