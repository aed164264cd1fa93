"""Where FP8 pays, by GEMM shape and GPU, on paper: the rule `mixed_float8` follows, beside torchao's.

For each shape (M tokens, K in features, N out features) and each GPU with
FP8 tensor cores in `jaxamp.diagnostics.GPU_TARGETS`, the speed-up on paper of
one matmul's training pass in FP8 (quantization included) over bfloat16
(`jaxamp.diagnostics.fp8_matmul_cost`), the verdict of ``mixed_float8``'s
rule (FP8 where above 1), and two anchors: torchao's measured speed-ups at
its two published crossovers (float8 tensorwise, H100) and its auto-filter
for tensorwise training, which keeps a linear in bfloat16 when K <= 4096 and
N <= 1024. No compilation, no GPU. Writes crossovers.md.
"""

from __future__ import annotations

import jaxamp
from experiments.measure.markdown import table

# (name, M, K, N, torchao's measured speed-up or None)
SHAPES = (
    ("torchao crossover", 1024, 2048, 1024, 0.80),
    ("torchao crossover", 4096, 8192, 16384, 1.39),
    ("GPT-2 124M attention qkv", 8192, 768, 2304, None),
    ("GPT-2 124M attention out", 8192, 768, 768, None),
    ("GPT-2 124M MLP up", 8192, 768, 3072, None),
    ("GPT-2 124M MLP down", 8192, 3072, 768, None),
    ("GPT-2 124M logits", 8192, 768, 50304, None),
    ("GPT-2 d2048 attention qkv", 8192, 2048, 6144, None),
    ("GPT-2 d2048 attention out", 8192, 2048, 2048, None),
    ("GPT-2 d2048 MLP up", 8192, 2048, 8192, None),
    ("GPT-2 d2048 MLP down", 8192, 8192, 2048, None),
    ("TE layer attention qkv", 16384, 4096, 12288, None),
    ("TE layer attention out", 16384, 4096, 4096, None),
    ("TE layer MLP up", 16384, 4096, 16384, None),
    ("TE layer MLP down", 16384, 16384, 4096, None),
)


def torchao_filter_keeps_bf16(k: int, n: int) -> bool:
    """torchao's auto-filter for float8 tensorwise training: bfloat16 when K <= 4096 and N <= 1024."""
    return k <= 4096 and n <= 1024


def crossovers(command: str) -> str:
    """The page: each shape's speed-up and verdict on every GPU with FP8, beside torchao's."""
    targets = [
        name for name, spec in jaxamp.diagnostics.GPU_TARGETS.items() if "float8_e4m3fn" in spec.peak_flops
    ]
    rows = []
    for name, m, k, n, measured in SHAPES:
        cells = []
        for target in targets:
            cost = jaxamp.diagnostics.fp8_matmul_cost(m, k, n, target)
            cells += [f"{cost.speedup:.2f}x", "FP8" if cost.pays else "bf16"]
        anchor = f"{measured:.2f}x" if measured is not None else ""
        keeps = "bf16" if torchao_filter_keeps_bf16(k, n) else "FP8"
        rows.append([name, m, k, n, *cells, anchor, keeps])
    header = [
        "shape",
        "M",
        "K",
        "N",
        *(column for name in targets for column in (f"{name} speed-up", f"{name} rule")),
        "torchao measured",
        "torchao filter",
    ]
    align = "lrrr" + "rl" * len(targets) + "rl"
    lines = [
        "# Where FP8 pays: one matmul's training pass, FP8 with current scaling against bfloat16, on paper",
        "",
        f"Command: `{command}`",
        "",
        (
            "Speed-up = bfloat16 time / FP8 time, each the sum of its kernels' roofline bounds "
            "(`jaxamp.diagnostics.fp8_matmul_cost`: three GEMMs, and for FP8 the amax and quantization passes). "
            "Rule: what `mixed_float8` does on that GPU (FP8 where the speed-up is above 1). torchao: its "
            "measured speed-up (float8 tensorwise, H100) where published, and its auto-filter's choice (bf16 "
            "when K <= 4096 and N <= 1024)."
        ),
        "",
        table(header, rows, align),
    ]
    return "\n".join(lines)


def add_arguments(parser) -> None:
    del parser  # no flags of its own


def run(args, out) -> None:
    del args
    text = crossovers(out.command)
    out.print(text.rstrip())
    out.write("crossovers.md", text)
