#!/usr/bin/env bash
# The CPU parity runs of bfloat16 master weights and AdamW state: the small
# model, the steps of ../small (../run_parity.sh), float32 and float32 masters
# against bfloat16 params and AdamW state under each update rounding, two seeds.
# First at the recipe's learning rate (3e-3, here), then at a tenth of it
# (../bf16_optimizer_low_lr), where rounding to nearest loses most updates.
set -euo pipefail
cd "$(dirname "$0")/../../../.."
python=${PYTHON:-python}
nice -n 10 "$python" -m experiments.lm --model small \
  --precisions fp32,mixed_bf16,bfloat16_nearest,bfloat16_stochastic,bfloat16_kahan \
  --seeds 0,1 --steps 150 --batch-size 8 --eval-every 50 --no-progress --out-dir results/cpu/lm/bf16_optimizer
nice -n 10 "$python" -m experiments.lm --model small --lr 3e-4 \
  --precisions mixed_bf16,bfloat16_nearest,bfloat16_stochastic,bfloat16_kahan,fp32 \
  --seeds 0,1 --steps 150 --batch-size 8 --eval-every 50 --no-progress --out-dir results/cpu/lm/bf16_optimizer_low_lr
