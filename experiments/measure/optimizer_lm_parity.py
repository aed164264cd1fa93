"""bfloat16 params and AdamW state in the language model: each update rounding's held-out bits/byte against float32 masters.

The small language model on the standard-library corpus (`experiments.lm`,
150 steps of 8 windows of 128 bytes, two seeds) under float32 (``fp32``),
float32 master weights (``mixed_bf16``) and bfloat16 params and AdamW
state under each update rounding (``bfloat16_nearest``,
``bfloat16_stochastic``, ``bfloat16_kahan``); ``--lr`` sets the peak
learning rate (3e-4, a tenth of the recipe's, is where rounding to
nearest loses most updates). The run writes its results.json, table.md and
plots; then summary.md gives, per recipe, the held-out bits/byte of each
seed, their mean, the seed spread (largest minus smallest seed) and the gap
of the mean to the float32-master recipe's (``mixed_bf16``), all in percent
of ``mixed_bf16``'s mean; and the two targets: Kahan's and stochastic
rounding's mean within 1% of ``mixed_bf16``'s, nearest rounding's gap at
least twice the seed spread (the larger of nearest's and ``mixed_bf16``'s).
"""

from __future__ import annotations

import statistics

from experiments.flags import positive_float, positive_int
from experiments.measure.lm_runs import read_results, run_lm
from experiments.measure.markdown import table

RECIPES = "fp32,mixed_bf16,bfloat16_nearest,bfloat16_stochastic,bfloat16_kahan"

BASELINE = "mixed_bf16"


def summarize(results: dict, folder: str, command: str) -> str:
    """summary.md of the run in `folder` (its results.json's contents, `results`), made by `command`."""
    by_recipe: dict[str, dict[int, float]] = {}
    for run in results["runs"]:
        summary = run.get("summary") or {}
        if "held_out_bits_per_byte" in summary:
            by_recipe.setdefault(run["config"]["precision"], {})[run["config"]["seed"]] = summary[
                "held_out_bits_per_byte"
            ]
    base_mean = statistics.mean(by_recipe[BASELINE].values())

    def percent(value: float) -> str:
        return f"{100 * value / base_mean:+.2f}%"

    def spread(recipe: str) -> float:
        values = by_recipe[recipe].values()
        return max(values) - min(values)

    seeds = sorted({seed for values in by_recipe.values() for seed in values})
    lines = [
        f"# Held-out bits/byte against float32 master weights ({BASELINE}): {folder}",
        "",
        f"From `{results['command']}`; made by `{command}`.",
        "",
        (
            f"Gap: the recipe's mean over seeds minus {BASELINE}'s mean; spread: the recipe's largest minus "
            f"smallest seed; paired: the recipe minus {BASELINE} at the same seed. All in percent of "
            f"{BASELINE}'s mean ({base_mean:.4f})."
        ),
        "",
    ]
    rows = []
    for recipe, values in by_recipe.items():
        mean = statistics.mean(values.values())
        paired = ", ".join(
            percent(values[seed] - by_recipe[BASELINE][seed]) for seed in seeds if seed in by_recipe[BASELINE]
        )
        rows.append(
            [
                recipe,
                *(f"{values[seed]:.4f}" if seed in values else "" for seed in seeds),
                f"{mean:.4f}",
                percent(mean - base_mean),
                percent(spread(recipe)).lstrip("+"),
                paired,
            ]
        )
    header = ["recipe", *(f"seed {seed}" for seed in seeds), "mean", "gap", "seed spread", "paired"]
    lines.append(table(header, rows).rstrip())
    lines.append("")
    for recipe in ("bfloat16_kahan", "bfloat16_stochastic"):
        if recipe in by_recipe:
            gap = statistics.mean(by_recipe[recipe].values()) - base_mean
            met = "met" if abs(gap) <= 0.01 * base_mean else "missed"
            lines.append(f"- {recipe}: mean {percent(gap)} from {BASELINE}'s (target within 1%: {met}).")
    if "bfloat16_nearest" in by_recipe:
        gap = statistics.mean(by_recipe["bfloat16_nearest"].values()) - base_mean
        widest = max(spread("bfloat16_nearest"), spread(BASELINE))
        met = "met" if gap >= 2 * widest else "missed"
        lines.append(
            f"- bfloat16_nearest: mean {percent(gap)} from {BASELINE}'s, against a seed spread of "
            f"{percent(widest).lstrip('+')} (the larger of the two recipes'); the gap is "
            f"{gap / widest:.1f} times the spread (target at least 2: {met})."
        )
    return "\n".join(lines) + "\n"


def add_arguments(parser) -> None:
    parser.add_argument("--lr", type=positive_float, help="peak learning rate (default: the recipe's, 3e-3)")
    parser.add_argument("--seeds", default="0,1", help="comma-separated seeds")
    parser.add_argument("--steps", type=positive_int, default=150, help="training steps")
    parser.add_argument("--precisions", default=RECIPES, help="comma-separated experiments.lm precisions")


def run(args, out) -> None:
    flags = [
        "--model", "small", "--precisions", args.precisions, "--seeds", args.seeds, "--steps", str(args.steps),
        "--batch-size", "8", "--eval-every", str(min(50, args.steps)),
    ]  # fmt: skip
    if args.lr:
        flags += ["--lr", str(args.lr)]
    folder = run_lm(flags, out)
    text = summarize(read_results(folder), folder, out.command)
    out.print(text.rstrip())
    out.write("summary.md", text)
