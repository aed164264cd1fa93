#!/usr/bin/env bash
# GPT-2 (124M) at context 1024, 8 sequences per step, compiled for an H200 on a
# machine without one: mixed_float8 against mixed_bf16, both through autocast.
# Needs the CUDA PJRT plugin of the installed JAX (pip install 'jaxamp[gpu-aot]').
set -euo pipefail
cd "$(dirname "$0")/../../../.."
JAX_PLATFORMS=cpu nice -n 5 "${PYTHON:-python}" -m experiments.lm.on_paper --target h200 \
  --precisions mixed_bf16,mixed_float8 --routes autocast --out-dir results/cpu/lm/h200_on_paper_fp8
# Bytes moved per step split by kernel (GEMMs, FP8 quantization, the rest): traffic.json.
PYTHONPATH="${PYTHONPATH:-}:$PWD" JAX_PLATFORMS=cpu nice -n 5 "${PYTHON:-python}" results/cpu/lm/h200_on_paper_fp8/traffic.py
