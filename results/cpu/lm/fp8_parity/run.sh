#!/usr/bin/env bash
# FP8 training parity on a CPU: language models on the standard-library corpus,
# mixed_float8 against mixed_bf16, both through autocast (so the FP8 matmuls
# are the only difference), the same seeds and steps. Each run writes
# results.json, table.md and plots, then parity.md: the final held-out loss of
# each precision per seed and their relative gap (target: within 2%).
#   bash results/cpu/lm/fp8_parity/run.sh [tiny|small|all]   (default: all)
#   tiny:  2 layers of width 64, 300 steps of 16 windows of 64 bytes  -> fp8_parity/
#   small: 4 layers of width 128, 150 steps of 8 windows of 128 bytes -> fp8_parity/small/
set -euo pipefail
cd "$(dirname "$0")/../../../.."
python=${PYTHON:-python}
which=${1:-all}

parity_table() {
  "$python" - "$1" <<'PY'
import json, sys

out = sys.argv[1]
payload = json.load(open(f"{out}/results.json"))
final = {(run["config"]["precision"], run["config"]["seed"]): run["summary"] for run in payload["runs"]}
lines = [
    f"Command: `{payload['command']}` (in `bash results/cpu/lm/fp8_parity/run.sh`)",
    "",
    f"Load average at the start: {payload['environment']['load_average_at_start']:.1f} "
    f"on {payload['environment']['cpu_count']} CPUs.",
    "",
    "| seed | steps | held-out loss mixed_bf16 | held-out loss mixed_float8 | gap | "
    "bits/byte mixed_bf16 | bits/byte mixed_float8 | skipped (bf16, fp8) |",
    "|---:|---:|---:|---:|---:|---:|---:|---|",
]
gaps = []
for seed in sorted({seed for _, seed in final}):
    bf16, fp8 = final[("mixed_bf16", seed)], final[("mixed_float8", seed)]
    gap = fp8["held_out_loss"] / bf16["held_out_loss"] - 1
    gaps.append(gap)
    lines.append(
        f"| {seed} | {fp8['steps']} | {bf16['held_out_loss']:.4f} | {fp8['held_out_loss']:.4f} | {gap:+.2%} "
        f"| {bf16['held_out_bits_per_byte']:.4f} | {fp8['held_out_bits_per_byte']:.4f} "
        f"| {bf16['skipped_steps']}, {fp8['skipped_steps']} |"
    )
worst = max(abs(gap) for gap in gaps)
lines += ["", f"Largest gap in final held-out loss: {worst:.2%} (target at most 2%: "
          f"{'met' if worst <= 0.02 else 'MISSED'})."]
open(f"{out}/parity.md", "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
PY
}

if [[ $which == tiny || $which == all ]]; then
  out=results/cpu/lm/fp8_parity
  nice -n 5 "$python" -m experiments.lm --model tiny --precisions mixed_float8,mixed_bf16 --route autocast \
    --seeds 0,1 --steps 300 --eval-every 50 --no-progress --out-dir "$out"
  parity_table "$out"
fi
if [[ $which == small || $which == all ]]; then
  out=results/cpu/lm/fp8_parity/small
  nice -n 5 "$python" -m experiments.lm --model small --precisions mixed_float8,mixed_bf16 --route autocast \
    --seeds 0,1 --steps 150 --batch-size 8 --eval-every 50 --no-progress --out-dir "$out"
  parity_table "$out"
fi
