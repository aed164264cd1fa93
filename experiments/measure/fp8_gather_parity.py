"""FP8 weight gathers against bfloat16 gathers on 8 virtual CPU devices: the tiny language model, seed by seed.

The tiny language model on the standard-library corpus (`experiments.lm`:
300 steps of 16 windows of 64 bytes, the settings of ``fp8-parity``),
``mixed_float8`` through autocast, params and optimizer state sharded
(`jaxamp.fsdp.fsdp_loss`), gradients summed in float32; the only difference
is ``--gather-dtype``. Writes bfloat16/ and float8_e4m3fn/ (each run's
results.json, table.md and plots) and parity.md: the final held-out loss
per seed, the relative gap (the FP8 parity target: within 2%) and the
all-gather bytes per step of each.
"""

from __future__ import annotations

import os

from experiments.flags import positive_int
from experiments.measure.lm_runs import read_results, run_lm
from experiments.measure.markdown import table

GATHERS = ("bfloat16", "float8_e4m3fn")
DEVICES = 8
TARGET = 0.02


def add_arguments(parser) -> None:
    parser.add_argument("--seeds", default="0,1", help="comma-separated seeds")
    parser.add_argument("--steps", type=positive_int, default=300, help="training steps")


def parity(payloads: dict[str, dict], command: str) -> str:
    """parity.md: per seed, the FP8-gather run's final held-out loss and all-gather bytes against bfloat16's."""
    runs = {
        gather: {run["config"]["seed"]: run for run in payload["runs"]}
        for gather, payload in payloads.items()
    }
    rows, gaps = [], []
    for seed in sorted(runs["bfloat16"]):
        bf16, fp8 = runs["bfloat16"][seed], runs["float8_e4m3fn"][seed]
        gap = fp8["summary"]["held_out_loss"] / bf16["summary"]["held_out_loss"] - 1
        gaps.append(gap)
        gathered = [
            sum(
                total["result_bytes"]
                for name, total in run["cost"]["collectives_per_device"].items()
                if name.startswith("all-gather")
            )
            for run in (bf16, fp8)
        ]
        rows.append(
            [
                seed,
                fp8["summary"]["steps"],
                f"{bf16['summary']['held_out_loss']:.4f}",
                f"{fp8['summary']['held_out_loss']:.4f}",
                f"{gap:+.2%}",
                f"{gathered[0]:,} / {gathered[1]:,} ({gathered[1] / gathered[0]:.3f}x)",
                f"{bf16['summary']['skipped_steps']}, {fp8['summary']['skipped_steps']}",
            ]
        )
    worst = max(abs(gap) for gap in gaps)
    header = [
        "seed",
        "steps",
        "held-out loss, bf16 gathers",
        "held-out loss, FP8 gathers",
        "gap",
        "all-gather bytes per step, bf16 / FP8 (CPU executable)",
        "skipped (bf16, FP8)",
    ]
    return (
        "\n".join(
            [
                f"Commands (run by `{command}`, {DEVICES} virtual CPU devices):",
                "",
                *(f"- `{payload['command']}`" for payload in payloads.values()),
                "",
                table(header, rows, "rrrrrll").rstrip(),
                "",
                (
                    f"Largest gap in final held-out loss: {worst:.2%} (FP8 parity target at most {TARGET:.0%}: "
                    f"{'met' if worst <= TARGET else 'MISSED'})."
                ),
                "",
                (
                    "XLA on CPU widens bfloat16 all-gathers to float32 and FP8 ones to float16, so the CPU "
                    "executable's bytes are twice the program's; the ratio is the program's."
                ),
            ]
        )
        + "\n"
    )


def run(args, out) -> None:
    env = {
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={DEVICES}".strip(),
    }
    payloads = {}
    for gather in GATHERS:
        flags = [
            "--model", "tiny", "--precisions", "mixed_float8", "--route", "autocast", "--sharding", "fsdp",
            "--gather-dtype", gather, "--reduce-dtype", "float32", "--seeds", args.seeds,
            "--steps", str(args.steps), "--eval-every", str(min(50, args.steps)),
        ]  # fmt: skip
        payloads[gather] = read_results(run_lm(flags, out, gather, env))
    text = parity(payloads, out.command)
    out.print(text.rstrip())
    out.write("parity.md", text)
