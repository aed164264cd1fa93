#!/usr/bin/env bash
# FP8 weight gathers against bfloat16 gathers on 8 virtual CPU devices: the tiny
# language model on the standard-library corpus, mixed_float8 through autocast,
# params and optimizer state sharded (jaxamp.fsdp.fsdp_loss), gradients summed in
# float32; the only difference is --gather-dtype. The settings of
# results/cpu/lm/fp8_parity (tiny: 300 steps of 16 windows of 64 bytes, seeds 0
# and 1). Writes bfloat16/ and float8_e4m3fn/ (results.json, table.md, plots)
# and parity.md: the final held-out loss per seed and the relative gap (the FP8
# parity target: within 2%).
#   bash results/cpu/lm/fp8_gather_parity/run.sh
set -euo pipefail
cd "$(dirname "$0")/../../../.."
python=${PYTHON:-python}
out=results/cpu/lm/fp8_gather_parity
export JAX_PLATFORMS=cpu XLA_FLAGS="${XLA_FLAGS:-} --xla_force_host_platform_device_count=8"

for gather in bfloat16 float8_e4m3fn; do
  nice -n 5 "$python" -m experiments.lm --model tiny --precisions mixed_float8 --route autocast \
    --sharding fsdp --gather-dtype "$gather" --reduce-dtype float32 \
    --seeds 0,1 --steps 300 --eval-every 50 --no-progress --out-dir "$out/$gather"
done

"$python" - "$out" <<'PY'
import json, sys

out = sys.argv[1]
runs, commands = {}, {}
for gather in ("bfloat16", "float8_e4m3fn"):
    payload = json.load(open(f"{out}/{gather}/results.json"))
    runs[gather] = {run["config"]["seed"]: run for run in payload["runs"]}
    commands[gather] = payload["command"]
lines = [
    "Commands (in `bash results/cpu/lm/fp8_gather_parity/run.sh`, 8 virtual CPU devices):",
    "",
    *(f"- `{command}`" for command in commands.values()),
    "",
    "| seed | steps | held-out loss, bf16 gathers | held-out loss, FP8 gathers | gap | "
    "all-gather bytes per step, bf16 / FP8 (CPU executable) | skipped (bf16, FP8) |",
    "|---:|---:|---:|---:|---:|---|---|",
]
gaps = []
for seed in sorted(runs["bfloat16"]):
    bf16, fp8 = runs["bfloat16"][seed], runs["float8_e4m3fn"][seed]
    gap = fp8["summary"]["held_out_loss"] / bf16["summary"]["held_out_loss"] - 1
    gaps.append(gap)
    gathered = [
        sum(total["result_bytes"] for name, total in run["cost"]["collectives_per_device"].items()
            if name.startswith("all-gather"))
        for run in (bf16, fp8)
    ]
    lines.append(
        f"| {seed} | {fp8['summary']['steps']} | {bf16['summary']['held_out_loss']:.4f} "
        f"| {fp8['summary']['held_out_loss']:.4f} | {gap:+.2%} | {gathered[0]:,} / {gathered[1]:,} "
        f"({gathered[1] / gathered[0]:.3f}x) | {bf16['summary']['skipped_steps']}, {fp8['summary']['skipped_steps']} |"
    )
worst = max(abs(gap) for gap in gaps)
lines += ["", f"Largest gap in final held-out loss: {worst:.2%} (FP8 parity target at most 2%: "
          f"{'met' if worst <= 0.02 else 'MISSED'}).",
          "", "XLA on CPU widens bfloat16 all-gathers to float32 and FP8 ones to float16, so the CPU "
          "executable's bytes are twice the program's; the ratio is the program's."]
open(f"{out}/parity.md", "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
PY
