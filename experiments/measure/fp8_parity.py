"""FP8 training parity on a CPU: the language model under mixed_float8 against mixed_bf16, seed by seed.

Both precisions through ``--route autocast`` (so the FP8 matmuls are the
only difference), the same seeds, steps and batches, on the
standard-library corpus (`experiments.lm`):

* ``--model tiny``: 2 layers of width 64, 300 steps of 16 windows of 64 bytes;
* ``--model small``: 4 layers of width 128, 150 steps of 8 windows of 128 bytes.

The run writes its results.json, table.md and plots; then parity.md gives
the final held-out loss of each precision per seed and their relative gap
(target: within 2%).
"""

from __future__ import annotations

from experiments.flags import positive_int
from experiments.measure.lm_runs import read_results, run_lm
from experiments.measure.markdown import table

# Each model's steps and batch size, as published.
STEPS = {"tiny": 300, "small": 150}
BATCH_SIZE = {"tiny": [], "small": ["--batch-size", "8"]}
TARGET = 0.02


def add_arguments(parser) -> None:
    parser.add_argument("--model", choices=list(STEPS), default="tiny", help="the language model's size")
    parser.add_argument("--seeds", default="0,1", help="comma-separated seeds")
    parser.add_argument("--steps", type=positive_int, help="training steps (default: 300 tiny, 150 small)")


def parity(payload: dict, command: str) -> str:
    """parity.md: per seed, mixed_float8's final held-out loss against mixed_bf16's."""
    final = {(run["config"]["precision"], run["config"]["seed"]): run["summary"] for run in payload["runs"]}
    rows, gaps = [], []
    for seed in sorted({seed for _, seed in final}):
        bf16, fp8 = final[("mixed_bf16", seed)], final[("mixed_float8", seed)]
        gap = fp8["held_out_loss"] / bf16["held_out_loss"] - 1
        gaps.append(gap)
        rows.append(
            [
                seed,
                fp8["steps"],
                f"{bf16['held_out_loss']:.4f}",
                f"{fp8['held_out_loss']:.4f}",
                f"{gap:+.2%}",
                f"{bf16['held_out_bits_per_byte']:.4f}",
                f"{fp8['held_out_bits_per_byte']:.4f}",
                f"{bf16['skipped_steps']}, {fp8['skipped_steps']}",
            ]
        )
    worst = max(abs(gap) for gap in gaps)
    header = [
        "seed",
        "steps",
        "held-out loss mixed_bf16",
        "held-out loss mixed_float8",
        "gap",
        "bits/byte mixed_bf16",
        "bits/byte mixed_float8",
        "skipped (bf16, fp8)",
    ]
    environment = payload["environment"]
    return (
        "\n".join(
            [
                f"Command: `{payload['command']}` (run by `{command}`)",
                "",
                (
                    f"Load average at the start: {environment['load_average_at_start']:.1f} "
                    f"on {environment['cpu_count']} CPUs."
                ),
                "",
                table(header, rows, "rrrrrrrl").rstrip(),
                "",
                (
                    f"Largest gap in final held-out loss: {worst:.2%} (target at most {TARGET:.0%}: "
                    f"{'met' if worst <= TARGET else 'MISSED'})."
                ),
            ]
        )
        + "\n"
    )


def run(args, out) -> None:
    steps = args.steps or STEPS[args.model]
    flags = [
        "--model", args.model, "--precisions", "mixed_float8,mixed_bf16", "--route", "autocast",
        "--seeds", args.seeds, "--steps", str(steps), *BATCH_SIZE[args.model], "--eval-every", str(min(50, steps)),
    ]  # fmt: skip
    text = parity(read_results(run_lm(flags, out)), out.command)
    out.print(text.rstrip())
    out.write("parity.md", text)
