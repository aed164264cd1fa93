#!/usr/bin/env bash
# The CPU parity runs of results/cpu/lm/: tiny (both routes) and small models,
# fp32 vs mixed_bf16 vs mixed, two seeds, the same steps each.
set -euo pipefail
cd "$(dirname "$0")/../../.."
python=${PYTHON:-python}
nice -n 10 "$python" -m experiments.lm --model tiny --precisions fp32,mixed_bf16,mixed \
  --route apply_policy,autocast --seeds 0,1 --steps 300 --eval-every 50 --no-progress \
  --out-dir results/cpu/lm/tiny
nice -n 10 "$python" -m experiments.lm --model small --precisions fp32,mixed_bf16,mixed \
  --seeds 0,1 --steps 150 --batch-size 8 --eval-every 50 --no-progress --out-dir results/cpu/lm/small
