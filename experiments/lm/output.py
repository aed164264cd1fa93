"""What a set of language-model runs writes: JSON, a Markdown table, two plots.

``results.json`` holds every run (rewritten atomically after every
evaluation, so an interrupted run loses nothing it finished); ``table.md``
has one row per run and the held-out bits per byte of each precision
against float32's at the same seed; ``held_out_vs_step.png`` and
``held_out_vs_time.png`` plot the held-out loss of every run.
"""

from __future__ import annotations

import os
from typing import Any

from experiments.results import write_json_atomically, write_text_atomically

PARITY_TOLERANCE = 0.02


def write_json(out_dir: str, payload: dict[str, Any]) -> None:
    write_json_atomically(os.path.join(out_dir, "results.json"), payload)


def run_label(run: dict[str, Any]) -> str:
    config = run["config"]
    return f"{config['model']} {config['precision']} {config['route']} seed {config['seed']}"


def _relative_to_fp32(run: dict[str, Any], runs: list[dict[str, Any]]) -> float | None:
    """This run's final held-out bits per byte over fp32's, same model, route, seed and steps."""
    config = run["config"]
    for other in runs:
        other_config = other["config"]
        if other_config["precision"] == "fp32" and all(
            other_config[key] == config[key]
            for key in ("model", "route", "seed", "steps", "data", "batch_size")
        ) and "summary" in other:
            return run["summary"]["held_out_bits_per_byte"] / other["summary"]["held_out_bits_per_byte"] - 1
    return None


def _mib(value: float | None) -> str:
    return "n/a" if value is None else f"{value / 2**20:,.1f}"


# The heading of the table page (table.md), not of the table printed at the end of a run.
TITLE = "# Language model: held-out bits per byte by precision and route"


def markdown_table(
    runs: list[dict[str, Any]], command: str | None = None, environment: dict[str, Any] | None = None
) -> str:
    """One row per finished run; the fp32 column compares with fp32 at the same seed."""
    finished = [run for run in runs if "summary" in run]
    lines = []
    if command:
        lines += [TITLE, "", f"Command: `{command}`", ""]
    if environment:
        lines += [
            (f"{environment['device_kind']} x{environment['device_count']}, JAX {environment['jax']}, Python "
            f"{environment['python']}; load average {environment['load_average_at_start']:.1f} on "
            f"{environment['cpu_count']} CPUs at the start (timings on a shared machine are noisy)."),
            "",
        ]
    lines += [
        ("| model | precision | route | seed | steps | held-out bits/byte | vs fp32 | tokens/s | MFU "
        "| GFLOP/step | temp MiB | peak MiB | skipped | loss scale |"),
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for run in finished:
        config, summary = run["config"], run["summary"]
        relative = _relative_to_fp32(run, finished)
        flops = run["cost"]["flops_per_step"]
        mfu = summary.get("mfu")
        lines.append(
            f"| {config['model']} | {config['precision']} | {config['route']} | {config['seed']} "
            f"| {summary['steps']} | {summary['held_out_bits_per_byte']:.4f} "
            f"| {'' if relative is None else f'{relative:+.2%}'} | {summary['tokens_per_s']:,.0f} "
            f"| {'n/a' if mfu is None else f'{mfu:.1%}'} "
            f"| {'n/a' if flops is None else f'{flops / 1e9:,.2f}'} "
            f"| {_mib(run['cost']['memory_per_device']['temp_bytes'])} "
            f"| {_mib(summary.get('peak_memory_bytes'))} "
            f"| {summary['skipped_steps']} | {summary['loss_scale']:g} |"
        )
    halves = [
        abs(relative)
        for run in finished
        if run["config"]["precision"] != "fp32" and (relative := _relative_to_fp32(run, finished)) is not None
    ]
    if halves:
        verdict = "met" if max(halves) <= PARITY_TOLERANCE else "MISSED"
        lines += [
            "",
            (f"Largest held-out bits/byte difference from fp32 at the same seed: {max(halves):.2%} "
            f"(target at most {PARITY_TOLERANCE:.0%}: {verdict})."),
        ]
    notes = {run["summary"].get("mfu_note") for run in finished} - {None}
    if notes:
        lines += ["", "MFU: " + "; ".join(sorted(notes)) + "."]
    return "\n".join(lines) + "\n"


def write_table(
    out_dir: str,
    runs: list[dict[str, Any]],
    command: str | None = None,
    environment: dict[str, Any] | None = None,
) -> None:
    write_text_atomically(os.path.join(out_dir, "table.md"), markdown_table(runs, command, environment))


def write_plots(out_dir: str, runs: list[dict[str, Any]]) -> list[str]:
    """Held-out loss against step and against training time, one line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for x_key, x_label, name in (
        ("step", "step", "held_out_vs_step.png"),
        ("train_time_s", "training time (s, compilation and evaluation excluded)", "held_out_vs_time.png"),
    ):
        figure, axes = plt.subplots(figsize=(7, 4.5))
        for run in runs:
            evaluations = run["evaluations"]
            axes.plot(
                [entry[x_key] for entry in evaluations],
                [entry["held_out_bits_per_byte"] for entry in evaluations],
                marker=".",
                label=run_label(run),
            )
        axes.set_xlabel(x_label)
        axes.set_ylabel("held-out bits per byte")
        axes.grid(alpha=0.3)
        axes.legend(fontsize=7)
        figure.tight_layout()
        path = os.path.join(out_dir, name)
        figure.savefig(path, dpi=120)
        plt.close(figure)
        paths.append(path)
    return paths
