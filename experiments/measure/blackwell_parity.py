"""Block-scaled training parity on a CPU: the small language model under mixed_mxfp8 and mixed_nvfp4.

The small model (4 layers of width 128) for 150 steps of 8 windows of 128
bytes at a peak learning rate of 3e-4, seeds 0 and 1, on the standard-library
corpus (`experiments.lm`), by the ``apply_policy`` route (NVFP4's recipe
keeps the output head in bfloat16 there), in three runs:

* ``mixed_bf16``, ``mixed_mxfp8`` and ``mixed_nvfp4`` (the full recipe);
* ``mixed_nvfp4`` without the random Hadamard transform (``--block-recipe no-hadamard``);
* ``mixed_nvfp4`` with nearest rounding of gradients (``--block-recipe nearest-gradients``).

On a CPU each block-scaled GEMM is a float32 GEMM of the dequantized values:
the recipe's numerics, not its speed. parity.md gives each run's final
held-out bits per byte per seed and its gap to ``mixed_bf16``'s (targets:
MXFP8 within 0.5%, NVFP4 within 1.5%).
"""

from __future__ import annotations

import os

from experiments.flags import positive_int
from experiments.measure.lm_runs import read_results, run_lm
from experiments.measure.markdown import table

TARGETS = {"mixed_mxfp8": 0.005, "mixed_nvfp4": 0.015}
# (subfolder, precisions, NVFP4 recipe)
RUNS = (
    ("formats", "mixed_bf16,mixed_mxfp8,mixed_nvfp4", "full"),
    ("no-hadamard", "mixed_nvfp4", "no-hadamard"),
    ("nearest-gradients", "mixed_nvfp4", "nearest-gradients"),
)


def add_arguments(parser) -> None:
    parser.add_argument("--seeds", default="0,1", help="comma-separated seeds")
    parser.add_argument("--steps", type=positive_int, default=150, help="training steps")
    parser.add_argument(
        "--runs",
        default=",".join(name for name, _, _ in RUNS),
        help=f"comma-separated, which of the runs to make: {', '.join(name for name, _, _ in RUNS)}; the "
        "others are read from the folder if an earlier call made them",
    )


def label(run: dict) -> str:
    """``mixed_nvfp4``, or ``mixed_nvfp4 (no-hadamard)`` for an ablation."""
    recipe = run["config"].get("block_recipe", "full")
    return run["config"]["precision"] + ("" if recipe == "full" else f" ({recipe})")


def parity(payloads: list[dict], command: str) -> str:
    """parity.md: each run's final held-out bits per byte per seed, against mixed_bf16's."""
    final = {(label(run), run["config"]["seed"]): run["summary"] for payload in payloads for run in payload["runs"]}
    seeds = sorted({seed for _, seed in final})
    labels = list(dict.fromkeys(name for name, _ in final))
    rows, verdicts = [], []
    for name in labels:
        gaps = []
        cells = []
        for seed in seeds:
            bits = final[(name, seed)]["held_out_bits_per_byte"]
            reference = final[("mixed_bf16", seed)]["held_out_bits_per_byte"]
            gaps.append(bits / reference - 1)
            cells += [f"{bits:.4f}", f"{gaps[-1]:+.2%}"]
        skipped = ", ".join(str(final[(name, seed)]["skipped_steps"]) for seed in seeds)
        rows.append([name, *cells, skipped])
        target = TARGETS.get(name)
        if target is not None:
            worst = max(abs(gap) for gap in gaps)
            verdicts.append(
                f"{name}: largest gap {worst:.2%} (target at most {target:.1%}: {'met' if worst <= target else 'MISSED'})."
            )
    header = ["precision", *(c for seed in seeds for c in (f"bits/byte seed {seed}", f"gap seed {seed}")), "skipped"]
    commands = "; ".join(f"`{payload['command']}`" for payload in payloads)
    environment = payloads[0]["environment"]
    return "\n".join(
        [
            "# Block-scaled training parity on a CPU: the small language model, MXFP8 and NVFP4 against bfloat16",
            "",
            f"Command: `{command}`, which ran {commands}.",
            "",
            (
                f"Load average at the start: {environment['load_average_at_start']:.1f} on "
                f"{environment['cpu_count']} CPUs. Final held-out bits per byte after the last step; gap: "
                "against mixed_bf16 at the same seed (positive: worse)."
            ),
            "",
            table(header, rows, "l" + "rr" * len(seeds) + "l").rstrip(),
            "",
            *verdicts,
            "",
        ]
    )


def run(args, out) -> None:
    wanted = args.runs.split(",")
    unknown = [name for name in wanted if name not in {name for name, _, _ in RUNS}]
    if unknown:
        raise SystemExit(f"error: --runs {unknown[0]!r}: choose from {', '.join(name for name, _, _ in RUNS)}")
    payloads = []
    for name, precisions, recipe in RUNS:
        folder = os.path.join(out.path, name)
        if name in wanted:
            flags = [
                "--model", "small", "--precisions", precisions, "--seeds", args.seeds, "--steps", str(args.steps),
                "--batch-size", "8", "--lr", "3e-4", "--eval-every", str(min(50, args.steps)),
                "--block-recipe", recipe, "--no-progress",
            ]  # fmt: skip
            run_lm(flags, out, name)
        if os.path.exists(os.path.join(folder, "results.json")):
            payloads.append(read_results(folder))
    if not payloads or payloads[0]["runs"][0]["config"]["precision"] != "mixed_bf16":
        raise SystemExit("error: parity.md needs the formats run (mixed_bf16 among them): add --runs formats.")
    text = parity(payloads, out.command)
    out.print(text.rstrip())
    out.write("parity.md", text)
