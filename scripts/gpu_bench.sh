#!/usr/bin/env bash
# One GPU command that fits a few minutes: on one NVIDIA GPU with JAX, Flax, optax and
# PyTorch installed and no network, it runs, most important first, under a time budget
# and writing everything to $OUT as it goes:
#   1. the study's table: resnet18, resnet50, resnet101, mobilenetv2 x fp32, mixed, one
#      CIFAR-10-sized epoch of synthetic data each (python -m experiments.compare);
#   2. the same for tf32, mixed_bf16 and mixed_float8 (FP8 matmuls and forward convolutions,
#      through jaxamp.autocast), leaving BENCH_RESERVE seconds for what follows; the FP8 epoch
#      time against mixed_bf16's is printed to $OUT/fp8_cifar.txt;
#   3. ResNet18's exact peak device memory under fp32 and mixed (one process each: a
#      process's peak counts everything it ran before);
#   4. the side-by-side benchmark (python -m experiments.benchmark --budget <what is left>):
#      throughput, memory and roofline, PyTorch AMP, loss-scale cost, input pipeline.
# Whatever would not fit is skipped and listed in $OUT/skipped.txt. XLA's GPU compilations
# take dozens of seconds each: a persistent compilation cache lets the benchmark reuse the
# study's train steps where they are the same program.
#
# Results land in $OUT (default: a new runs/gpu-bench-<time>/; published results go under
# results/<question>/, each folder with its COMMAND). On a machine without network whose
# Python lacks a pure-Python dependency (jmp, say), put its wheels in .whl/ first and they
# are installed for the run:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 -d .whl jmp==0.0.4
#
# Settings (environment): BUDGET seconds for all of it (default 450), MODELS (the study's),
# STEPS (train steps and test batches per epoch; unset: a full epoch), BENCH_RESERVE
# (default 120), BENCH_ARGS (extra benchmark flags, placed last so they win), PYTHON
# (default python3). The same code path runs on a CPU with tiny settings:
#   PYTHON=.venv/bin/python OUT=/tmp/gpu_bench MODELS=resnet_tiny STEPS=2 BUDGET=900 BENCH_RESERVE=600 \
#     BENCH_ARGS="--models resnet_tiny --torch-models resnet_tiny --batch-size 8 --rounds 1 --steps 1 \
#                 --num-train 64 --loss-scale-models mlp --loss-scale-batch-size 8" \
#     bash scripts/gpu_bench.sh
set -uo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
python=${PYTHON:-python3}
budget=${BUDGET:-450}
reserve=${BENCH_RESERVE:-120}
models=${MODELS:-resnet18,resnet50,resnet101,mobilenetv2}
out=${OUT:-runs/gpu-bench-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$out"
: > "$out/skipped.txt"
left() { echo $(( budget - (SECONDS - start) )); }
skip() { echo "skipped $1: $2" | tee -a "$out/skipped.txt"; }

if compgen -G ".whl/*.whl" > /dev/null; then
  "$python" -m pip install -q --no-index --no-deps --no-compile --target /tmp/jaxamp-site .whl/*.whl
  export PYTHONPATH="/tmp/jaxamp-site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/jaxamp-jax-cache}
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$out/gpu.txt" 2>/dev/null || true
"$python" -c "import jax, flax, optax; print('jax', jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__, jax.devices())" \
  > "$out/versions.txt" 2>&1 || {
  cat "$out/versions.txt"
  echo "error: $python cannot import jax, flax and optax (set PYTHON to the interpreter that can)" >&2
  exit 2
}
"$python" -c "import torch; print('torch', torch.__version__)" >> "$out/versions.txt" 2>&1 || true
cat "$out/versions.txt"

steps_flag=()
if [[ -n "${STEPS:-}" ]]; then steps_flag=(--steps-per-epoch "$STEPS"); fi
read -r -a bench_args <<< "${BENCH_ARGS:-}"

# run NAME SECONDS COMMAND...: COMMAND under a timeout of SECONDS, its output in $out/NAME.log.
run() {
  local name=$1 seconds=$2
  shift 2
  if (( seconds < 10 )); then
    skip "$name" "$(( seconds > 0 ? seconds : 0 ))s of the budget left"
    return
  fi
  local began=$SECONDS status=0
  echo "=== $name (up to ${seconds}s) ==="
  timeout --signal=TERM --kill-after=10 "$seconds" "$@" > "$out/$name.log" 2>&1 || status=$?
  tail -n 30 "$out/$name.log"
  echo "=== $name: exit $status after $(( SECONDS - began ))s ==="
  if (( status == 124 || status == 137 )); then
    skip "$name (the rest)" "cut at ${seconds}s; what finished is in $out/$name/results.json"
  fi
}

run study "$(left)" "$python" -m experiments.compare --models "$models" --precisions fp32,mixed \
  --data synthetic --epochs 1 "${steps_flag[@]}" --no-progress --out-dir "$out/study"
run study_tf32_bf16 "$(( $(left) - reserve ))" "$python" -m experiments.compare --models "$models" \
  --precisions tf32,mixed_bf16,mixed_float8 --data synthetic --epochs 1 "${steps_flag[@]}" --no-progress \
  --out-dir "$out/study_tf32_bf16"
"$python" - "$out" <<'PY' | tee "$out/fp8_cifar.txt"
import json, sys

try:
    with open(f"{sys.argv[1]}/study_tf32_bf16/results.json") as file:
        runs = json.load(file)["runs"]
except (OSError, KeyError, ValueError):
    runs = {}
summaries = {key: run.get("summary") for key, run in runs.items() if run.get("summary")}
models = sorted({key.split("/")[0] for key in summaries})
for model in models:
    bf16, fp8 = summaries.get(f"{model}/mixed_bf16"), summaries.get(f"{model}/mixed_float8")
    if bf16 and fp8:
        print(f"cifar {model}: train epoch mixed_bf16 {bf16['train_time_s']:.2f}s, mixed_float8 "
              f"{fp8['train_time_s']:.2f}s, FP8 speed-up {bf16['train_time_s'] / fp8['train_time_s']:.2f}x")
    else:
        print(f"cifar {model}: mixed_float8 against mixed_bf16 not measured (a run was skipped or failed)")
if not models:
    print("cifar fp8: not measured (the run was skipped or failed; see study_tf32_bf16.log)")
PY
# A small resident data set, so that the peak is the step's own and not the data's.
for precision in fp32 mixed; do
  run "peak_memory_$precision" "$(( $(left) / 3 ))" "$python" -m experiments.benchmark --sections throughput \
    --models resnet18 --precisions "$precision" --rounds 2 --steps 5 --num-train 1024 "${bench_args[@]}" \
    --out-dir "$out/peak_memory_$precision"
done
"$python" - "$out" <<'PY' | tee "$out/peak_memory.txt"
import json, sys

peaks = {}
for precision in ("fp32", "mixed"):
    try:
        with open(f"{sys.argv[1]}/peak_memory_{precision}/results.json") as file:
            throughput = json.load(file)["throughput"]
        (entry,) = [entry for model in throughput.values() for entry in model.values()]
        peaks[precision] = entry.get("process_peak_bytes")
    except (OSError, KeyError, ValueError):
        peaks[precision] = None
if peaks["fp32"] and peaks["mixed"]:
    ratio = peaks["mixed"] / peaks["fp32"]
    verdict = "met" if ratio <= 0.55 else "MISSED"
    print(f"peak bytes in use: fp32 {peaks['fp32'] / 1e6:.0f} MB, mixed {peaks['mixed'] / 1e6:.0f} MB, "
          f"mixed/fp32 {ratio:.2f} (target at most 0.55: {verdict})")
else:
    print(f"peak bytes in use: not measured ({peaks}: no device memory stats here, or a run was skipped)")
PY
# --- The language model: GPT-2 (124M) at context 1024, python -m experiments.lm --------------
# tf32, mixed_bf16 and mixed_float8 (FP8 matmuls, through autocast) on synthetic tokens of GPT-2's
# padded vocabulary (50304): tokens/s and MFU against the GPU's published peak for each precision's
# matmuls (FP8's for mixed_float8). Targets: mixed_bf16 at 45% MFU or better, and at least 1.6x
# tf32's tokens/s; mixed_float8's tokens/s over mixed_bf16's is reported. LM_SECONDS (default 240)
# caps it; LM_MODEL, LM_BATCH, LM_STEPS and LM_VOCAB shrink it (a CPU check: LM_MODEL=tiny
# LM_BATCH=8 LM_STEPS=3 LM_VOCAB=256).
lm_seconds=$(( $(left) < ${LM_SECONDS:-240} ? $(left) : ${LM_SECONDS:-240} ))
run lm "$lm_seconds" "$python" -m experiments.lm --model "${LM_MODEL:-gpt2}" --data synthetic \
  --vocab-size "${LM_VOCAB:-50304}" --precisions tf32,mixed_bf16,mixed_float8 --batch-size "${LM_BATCH:-8}" \
  --steps "${LM_STEPS:-30}" --eval-every "${LM_STEPS:-30}" --eval-batches 1 --warmup-steps 0 \
  --no-progress --out-dir "$out/lm"
"$python" - "$out" <<'PY' | tee "$out/lm.txt"
import json, sys

try:
    with open(f"{sys.argv[1]}/lm/results.json") as file:
        runs = {run["config"]["precision"]: run["summary"] for run in json.load(file)["runs"] if "summary" in run}
except (OSError, KeyError, ValueError):
    runs = {}
for precision, summary in runs.items():
    mfu = "n/a" if summary.get("mfu") is None else f"{summary['mfu']:.1%}"
    print(f"lm {precision}: {summary['tokens_per_s']:,.0f} tokens/s, MFU {mfu}, "
          f"peak memory {summary.get('peak_memory_bytes')} bytes")
bf16, tf32 = runs.get("mixed_bf16"), runs.get("tf32")
if bf16 and bf16.get("mfu") is not None:
    print(f"lm mixed_bf16 MFU {bf16['mfu']:.1%} (target at least 45%: {'met' if bf16['mfu'] >= 0.45 else 'MISSED'})")
if bf16 and tf32:
    ratio = bf16["tokens_per_s"] / tf32["tokens_per_s"]
    print(f"lm mixed_bf16/tf32 tokens/s {ratio:.2f}x (target at least 1.6x: {'met' if ratio >= 1.6 else 'MISSED'})")
fp8 = runs.get("mixed_float8")
if fp8 and fp8.get("mfu") is not None:
    print(f"lm mixed_float8 MFU {fp8['mfu']:.1%} (against the {fp8.get('peak_used')} peak)")
if fp8 and bf16:
    print(f"lm mixed_float8/mixed_bf16 tokens/s {fp8['tokens_per_s'] / bf16['tokens_per_s']:.2f}x")
if not runs:
    print("lm: not measured (the run was skipped or failed; see lm.log)")
PY
bench_budget=$(( $(left) - 20 ))
if (( bench_budget >= 10 )); then  # --budget takes a positive number of seconds
  run benchmark "$(( bench_budget + 15 ))" "$python" -m experiments.benchmark --budget "$bench_budget" \
    --sections throughput,torch,loss_scale,pipeline --models resnet18,mobilenetv2,resnet50 \
    --torch-models resnet18,mobilenetv2,resnet50 "${bench_args[@]}" --out-dir "$out/benchmark"
else
  skip benchmark "$(( bench_budget > 0 ? bench_budget : 0 ))s of the budget left"
fi
grep -h "^skipped" "$out"/*.log >> "$out/skipped.txt" 2>/dev/null || true
echo "=== done in $(( SECONDS - start ))s of a ${budget}s budget; skipped: ==="
cat "$out/skipped.txt"
