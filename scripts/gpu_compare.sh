#!/usr/bin/env bash
# The prepared GPU run of the CIFAR study, for a lent accelerator (synthetic data:
# the device machine has no network and no tensorflow-datasets).
#
# Here, once, before the call (the device machine lacks jmp):
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 -d .whl jmp==0.0.4
# Then run this script there with `.whl` carried. It writes table.md,
# results.json and the two plots to $OUT (or to results/gpu/ when $OUT is unset).
# Settings: MODELS, PRECISIONS, STEPS (train steps and test batches per epoch), EPOCHS.
set -euo pipefail
cd "$(dirname "$0")/.."

if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1

out_dir="${OUT:-results/gpu}"
mkdir -p "$out_dir"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$out_dir/gpu.txt" 2>/dev/null || true
python3 -m experiments.compare \
  --models "${MODELS:-resnet18,resnet50,resnet101,mobilenetv2}" \
  --precisions "${PRECISIONS:-fp32,tf32,mixed,mixed_bf16}" \
  --data synthetic --steps-per-epoch "${STEPS:-100}" --epochs "${EPOCHS:-2}" \
  --no-progress --out-dir "$out_dir" 2>&1 | tee "$out_dir/log.txt"
