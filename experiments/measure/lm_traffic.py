"""Where the bytes moved per step go: GPT-2 (124M) compiled for an H200, by kind of kernel.

Compiles the language model's train step as `experiments.lm.on_paper`
does (context 1024, 8 sequences, the autocast route) under ``mixed_bf16``
and ``mixed_float8`` for a GPU without one, and splits the bytes it moves
per step (each kernel of the optimized program reads its operands and
writes its result once: `jaxamp.diagnostics.kernel_roofline`'s kernels, which
add up to `jaxamp.diagnostics.bytes_accessed`) by kind of kernel
(`experiments.lm.on_paper.kernel_class`): FP8 GEMMs, other GEMMs, FP8
quantization kernels (fusions traced under jaxamp's ``jaxamp_fp8`` scope
outside a fallback: amax reductions, scaling and casts to FP8), and
everything else. A bound's input, not a measurement. Needs the CUDA PJRT
plugin. Writes traffic.json.
"""

from __future__ import annotations

from experiments.flags import GPU_TARGET_NAMES, comma_list, positive_int
from experiments.lm import on_paper
from experiments.lm.config import SIZES, LMConfig
from experiments.measure.gpu_target import target_device


def add_arguments(parser) -> None:
    parser.add_argument("--target", choices=GPU_TARGET_NAMES, default="h200", help="the GPU to compile for")
    parser.add_argument("--model", choices=sorted(SIZES), default="gpt2", help="the language model's size")
    parser.add_argument("--precisions", type=comma_list(None), default=["mixed_bf16", "mixed_float8"])
    parser.add_argument(
        "--fp8-where",
        choices=on_paper.FP8_WHERE,
        default="pays",
        help="mixed_float8: FP8 only where it pays on the target, or everywhere",
    )
    parser.add_argument("--batch-size", type=positive_int, default=8, help="sequences per step")
    parser.add_argument(
        "--vocab-size", type=positive_int, default=on_paper.GPT2_VOCAB, help="vocabulary size"
    )


def run(args, out) -> None:
    target_device(args.target)  # the CUDA plugin missing: what to install, in one line
    found = {}
    for precision in args.precisions:
        config = LMConfig(model=args.model, precision=precision, route="autocast", batch_size=args.batch_size)
        entry = on_paper.compile_with_attention_fallback(
            args.target, config, args.vocab_size, fp8_where=args.fp8_where
        )
        by_kind = entry["bytes_per_step_by_class"]
        if sum(by_kind.values()) != entry["bytes_accessed_per_step"]:
            raise AssertionError(
                f"the kernels' bytes {by_kind} do not add up to {entry['bytes_accessed_per_step']}"
            )
        found[precision] = by_kind
        out.print(
            f"{precision} { ({key: f'{value / 1e9:.1f} GB' for key, value in sorted(by_kind.items())}) }"
        )
    out.write_json("traffic.json", {"command": out.command, "bytes_per_step": found})
