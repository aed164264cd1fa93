#!/usr/bin/env bash
# FP8 where it pays, on paper, compiled for an H200 on a machine without one (issue 32).
# Needs the CUDA PJRT plugin of the installed JAX (pip install 'jaxamp[gpu-aot]'). Without
# libcudnn on PYTHONPATH the LM's attention is the einsum one (as in ../lm/h200_on_paper_fp8).
set -euo pipefail
cd "$(dirname "$0")/../../.."
run() { JAX_PLATFORMS=cpu nice -n 10 "${PYTHON:-python}" "$@"; }
# TransformerEngine's layer shape: one layer, d 4096, 32 heads, FFN 16384, sequence 2048, batch 8.
run scripts/fp8_layer_on_paper.py --out results/cpu/fp8_pays/te_layer.md --scalings current
# The same with FP8 delayed scaling as a row of its own (jaxamp.fp8, issue 32 item 3).
run scripts/fp8_layer_on_paper.py --out results/cpu/fp8_pays/te_layer_delayed.md
# The same with cuDNN's fused attention: needs libcudnn importable (pip download --no-deps -d DIR
# nvidia-cudnn-cu12; unzip DIR/nvidia_cudnn_cu12-*.whl -d DIR; DIR on PYTHONPATH), else it fails.
run scripts/fp8_layer_on_paper.py --attention cudnn --out results/cpu/fp8_pays/te_layer_cudnn.md --scalings current
# GPT-2 (124M, 12 layers, d 768) at context 1024, 8 sequences per step; then 4 layers at d 2048 and 4096.
for shape in "gpt2_124m" "gpt2_d2048_l4 --d-model 2048 --layers 4" "gpt2_d4096_l4 --d-model 4096 --layers 4"; do
  set -- $shape
  name=$1; shift
  run -m experiments.lm.on_paper --target h200 --precisions mixed_bf16,mixed_float8 --routes autocast \
    --fp8-where pays,everywhere "$@" --out-dir "results/cpu/fp8_pays/$name"
done
# The rule's verdict at GEMM shapes beside torchao's published crossovers and filter.
run scripts/fp8_payoff_table.py --out results/cpu/fp8_pays/crossovers.md
