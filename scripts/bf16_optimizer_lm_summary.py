"""The bfloat16-optimizer parity runs of `experiments.lm`, summarized against their parity targets.

    python scripts/bf16_optimizer_lm_summary.py results/cpu/lm/bf16_optimizer_low_lr > .../summary.md

Reads the ``results.json`` of one ``python -m experiments.lm`` run over the
recipes and seeds; per recipe: the held-out bits/byte of each seed, their
mean, the seed spread (largest minus smallest seed) and the gap of the mean
to the float32-master recipe's (``mixed_bf16``), all in percent of
``mixed_bf16``'s mean; and the two targets: Kahan's and stochastic
rounding's mean within 1% of ``mixed_bf16``'s, nearest rounding's gap at
least twice the seed spread (the larger of nearest's and ``mixed_bf16``'s).
"""

from __future__ import annotations

import json
import statistics
import sys

BASELINE = "mixed_bf16"


def summarize(folder: str) -> str:
    with open(f"{folder}/results.json", encoding="utf-8") as file:
        results = json.load(file)
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
        f"From `{results['command']}`; made by `python scripts/bf16_optimizer_lm_summary.py {folder}`.",
        "",
        (
            f"Gap: the recipe's mean over seeds minus {BASELINE}'s mean; spread: the recipe's largest minus "
            f"smallest seed; paired: the recipe minus {BASELINE} at the same seed. All in percent of "
            f"{BASELINE}'s mean ({base_mean:.4f})."
        ),
        "",
        "| recipe | "
        + " | ".join(f"seed {seed}" for seed in seeds)
        + " | mean | gap | seed spread | paired |",
        "|---|" + "---:|" * (len(seeds) + 4),
    ]
    for recipe, values in by_recipe.items():
        mean = statistics.mean(values.values())
        paired = ", ".join(
            percent(values[seed] - by_recipe[BASELINE][seed]) for seed in seeds if seed in by_recipe[BASELINE]
        )
        lines.append(
            f"| {recipe} | "
            + " | ".join(f"{values[seed]:.4f}" if seed in values else "" for seed in seeds)
            + f" | {mean:.4f} | {percent(mean - base_mean)} | {percent(spread(recipe)).lstrip('+')} | {paired} |"
        )
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


if __name__ == "__main__":
    print(summarize(sys.argv[1].rstrip("/")), end="")
