"""The benchmark's Markdown table and PNG plots, rendered from its results."""

from __future__ import annotations

import os
from typing import Any

from experiments.benchmark import attribution, targets
from experiments.results import write_text_atomically

_MB = 1e6


def _fmt(value: Any, spec: str = ".2f", missing: str = "") -> str:
    return missing if value is None else format(value, spec)


def _throughput_rows(throughput: dict) -> list[str]:
    rows = [
        (
            "| model | precision | train img/s | vs fp32 | vs tf32 | eval img/s | compile s (train+eval) "
            "| temp MB | temp vs fp32 | temp+arg+out MB | peak bytes in use MB | GFLOP/img | TFLOP/s | share of peak "
            "| epoch s from measured step | epoch s bound on paper |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for model, precisions in throughput.items():
        fp32_temp = precisions.get("fp32", {}).get("memory", {}).get("temp_bytes")
        for precision, entry in precisions.items():
            memory = entry.get("memory", {})
            peak = entry.get("process_peak_bytes")
            cells = [
                model,
                precision,
                _fmt(entry.get("train_images_per_s"), ".1f", "skipped"),
                _fmt(entry.get("train_ratio_to_fp32")),
                _fmt(entry.get("train_ratio_to_tf32")),
                _fmt(entry.get("eval_images_per_s"), ".1f"),
                f"{sum(entry.get('compile_s', {}).values()):.1f}",
                f"{memory.get('temp_bytes', 0) / _MB:.0f}",
                _fmt(memory["temp_bytes"] / fp32_temp if fp32_temp and "temp_bytes" in memory else None),
                f"{memory.get('total_bytes', 0) / _MB:.0f}",
                _fmt(peak / _MB if peak else None, ".0f", "n/a")
                + ("" if peak is None else _peak_mark(entry)),
                _fmt(entry.get("flops_per_image", 0) / 1e9, ".3f"),
                _fmt(entry.get("achieved_tflops"), ".3f"),
                _fmt(entry.get("share_of_peak"), ".1%", "n/a"),
                _fmt(entry.get("measured_epoch_s"), ".1f"),
                _fmt(entry.get("roofline_epoch_s"), ".2f", "n/a"),
            ]
            rows.append("| " + " | ".join(cells) + " |")
    return rows


def _peak_mark(entry: dict) -> str:
    """Marks a peak that also counts earlier work of the process (not this step's alone)."""
    return "" if entry.get("process_peak_note", "").startswith("exact") else " (cumulative)"


def _loss_scale_rows(loss_scale: dict) -> list[str]:
    rows = ["| model | variant | ms/step | vs plain |", "|---|---|---|---|"]
    for model, variants in loss_scale.items():
        for variant, entry in variants.items():
            rows.append(
                f"| {model} | {variant} | {entry['ms_per_step']:.2f} | {entry['ratio_to_plain']:.3f} |"
            )
    return rows


def _torch_rows(torch: dict, throughput: dict) -> list[str]:
    rows = [
        (
            "| model | precision | PyTorch recipe | PyTorch train img/s | jaxamp train img/s | jaxamp / PyTorch "
            "| PyTorch eval img/s | jaxamp eval img/s |"
        ),
        "|---|---|---|---|---|---|---|---|",
    ]
    for model, precisions in torch.items():
        for precision, entry in precisions.items():
            ours = throughput.get(model, {}).get(precision, {})
            recipe = f"autocast {entry['autocast_dtype']}" if entry["autocast_dtype"] else "float32"
            recipe += " + GradScaler" if entry["grad_scaler"] else ""
            ours_train = ours.get("train_images_per_s")
            ratio = ours_train / entry["train_images_per_s"] if ours_train else None
            rows.append(
                f"| {model} | {precision} | {recipe} | {entry['train_images_per_s']:.1f} "
                f"| {_fmt(ours_train, '.1f', 'not run')} | {_fmt(ratio)} | {entry['eval_images_per_s']:.1f} "
                f"| {_fmt(ours.get('eval_images_per_s'), '.1f', 'not run')} |"
            )
    return rows


def load_sentence(load_at_start: float, load_at_end: float, cpu_count: int | None) -> str:
    """What the measured 1-minute load averages say about the machine's other work.

    The load average counts the processes running or waiting to run,
    the benchmark's own included. Above the core count (`os.cpu_count()`),
    something else competed for the cores during the run and its timings
    are noisier; at or below it, no more work than cores was running. Without
    a core count (results written before it was recorded), only the figures
    are given.
    """
    figures = f"1-minute load average {load_at_start:.1f} at the start, {load_at_end:.1f} at the end"
    if not cpu_count:
        return figures + "."
    cores = f"{cpu_count} core{'s' if cpu_count != 1 else ''}"
    if max(load_at_start, load_at_end) > cpu_count:
        return f"{figures}, above the {cores}: other work shared the machine, so timings are noisy."
    return f"{figures}, not above the {cores}: no more work than cores was running."


_SECTION_TITLES = {
    "throughput": "throughput and memory",
    "loss_scale": "loss scaling's cost",
    "attribution": "overflow attribution's cost",
    "pipeline": "input pipeline",
    "torch": "PyTorch AMP",
}


def title(settings: dict) -> str:
    """The page's heading: what the run measured (its sections, the GPUs it compiled for)."""
    parts = [
        _SECTION_TITLES.get(section, section)
        for section in settings.get("sections", [])
        if section != "targets"
    ]
    if settings.get("targets"):
        parts.append("compiled for " + ", ".join(target.upper() for target in settings["targets"]))
    return "# Benchmark: " + (", ".join(parts) or "nothing run")


def settings_table(settings: dict) -> list[str]:
    """The run's settings as a two-column Markdown table, lists joined by commas."""
    lines = ["| setting | value |", "|---|---|"]
    for name, value in settings.items():
        shown = (", ".join(map(str, value)) or "none") if isinstance(value, (list, tuple)) else value
        lines.append(f"| `{name}` | {shown} |")
    return lines


def header(environment: dict) -> list[str]:
    """The page's first lines: the title, the device and command, the settings."""
    return [
        title(environment["settings"]),
        "",
        f"Device: {environment['device']}. JAX {environment['jax']}. Command: `{environment['command']}`",
        "",
        *settings_table(environment["settings"]),
    ]


def table(results: dict) -> str:
    """The whole run as Markdown: title, settings, one table per section, checks, skipped work."""
    environment = results["environment"]
    lines = header(environment)
    if "wall_s" in environment:
        lines += [
            "",
            f"Run: {environment['wall_s']:.0f} s wall clock; "
            + load_sentence(
                environment["load_average_at_start"],
                environment["load_average_at_end"],
                environment.get("cpu_count"),
            ),
        ]
    if environment.get("run_note"):
        lines += ["", f"Run: {environment['run_note']}"]
    if environment["platform"] == "cpu" and results.get("throughput"):
        lines += [
            "",
            (
                "On CPU, XLA computes float16 and bfloat16 in float32: a mixed step's speed and memory "
                "there say nothing about a GPU (no saving is claimed)."
            ),
        ]
    sections = [
        ("Throughput, memory and distance to the hardware", "throughput", _throughput_rows),
        ("What loss scaling costs (mixed_float16 step, fixed batch)", "loss_scale", _loss_scale_rows),
    ]
    for title, key, render in sections:
        if results.get(key):
            lines += ["", f"## {title}", "", *render(results[key])]
    if results.get("attribution"):
        lines += [
            "",
            "## What overflow attribution costs (mixed_float16 step)",
            "",
            *attribution.table_rows(results["attribution"]),
        ]
    if results.get("throughput"):
        lines += [
            "",
            (
                "The bound on paper is a roofline lower bound (peak FLOP/s and bandwidth from the "
                "datasheet), not a measurement; n/a where the device is not a known GPU."
            ),
        ]
    if results.get("pipeline"):
        pipeline = results["pipeline"]
        lines += [
            "",
            "## Input pipeline",
            "",
            (
                f"{pipeline['model']} {pipeline['precision']}: gather+crop+flip+normalize "
                f"{pipeline['pipeline_ms']:.2f} ms of a {pipeline['train_step_ms']:.2f} ms train step "
                f"({pipeline['share']:.1%}, timed alone: an upper estimate)."
            ),
        ]
    if results.get("torch"):
        lines += [
            "",
            "## PyTorch AMP, same device, same run",
            "",
            *_torch_rows(results["torch"], results.get("throughput", {})),
        ]
    if results.get("targets"):
        lines += [
            "",
            "## Compiled for GPU targets on this machine (no GPU; no autotuning)",
            "",
            *targets.table_rows(results["targets"]),
        ]
        fp8_rows = targets.fp8_table_rows(results["targets"])
        if fp8_rows:
            lines += ["", "### FP8 (mixed_float8) against mixed_bf16, compiled", "", *fp8_rows]
    if results.get("checks"):
        lines += ["", "## Targets", "", "| check | measured | target | |", "|---|---|---|---|"]
        for check in results["checks"]:
            lines.append(
                f"| {check['check']} | {check['value']:.3f} | {check['target']} "
                f"| {'met' if check['met'] else '**missed**'} |"
            )
    if results.get("skipped"):
        lines += ["", "## Skipped", ""] + [
            f"- {item['work']}: {item['reason']}" for item in results["skipped"]
        ]
    return "\n".join(lines) + "\n"


def plots(results: dict, out_dir: str) -> list[str]:
    """PNG plots of throughput, memory and loss-scale overhead; returns the paths written."""
    import matplotlib  # pylint: disable=g-import-not-at-top

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

    written = []

    def bars(path, title, ylabel, groups: dict[str, dict[str, float]]):
        if not groups:
            return
        labels = sorted(
            {label for values in groups.values() for label in values},
            key=list(dict.fromkeys(label for values in groups.values() for label in values)).index,
        )
        figure, axis = plt.subplots(figsize=(max(5, 1.6 * len(groups) + 2), 3.6))
        width = 0.8 / max(1, len(labels))
        for index, label in enumerate(labels):
            xs = [group_index + index * width for group_index in range(len(groups))]
            axis.bar(xs, [values.get(label, 0) for values in groups.values()], width, label=label)
        axis.set_xticks([group_index + 0.4 - width / 2 for group_index in range(len(groups))], list(groups))
        axis.set_title(title)
        axis.set_ylabel(ylabel)
        axis.legend(fontsize=7)
        figure.tight_layout()
        full_path = os.path.join(out_dir, path)
        figure.savefig(full_path + ".tmp.png", dpi=110)
        plt.close(figure)
        os.replace(full_path + ".tmp.png", full_path)
        written.append(full_path)

    device = results["environment"]["device"]
    throughput = results.get("throughput", {})
    speed = {
        model: {p: e["train_images_per_s"] for p, e in precisions.items() if "train_images_per_s" in e}
        for model, precisions in throughput.items()
    }
    for model, precisions in results.get("torch", {}).items():
        speed.setdefault(model, {}).update(
            {f"torch {p}": e["train_images_per_s"] for p, e in precisions.items()}
        )
    bars("throughput.png", f"Train throughput ({device})", "images/s", speed)
    memory = {
        model: {p: e["memory"]["temp_bytes"] / _MB for p, e in precisions.items()}
        for model, precisions in throughput.items()
    }
    for target, models in results.get("targets", {}).items():
        for model, precisions in models.items():
            memory.setdefault(f"{model}\n({target})", {}).update(
                {p: e["memory"]["temp_bytes"] / _MB for p, e in precisions.items()}
            )
    bars("memory.png", "Temp memory of the compiled train step", "MB", memory)
    overhead = {
        model: {v: e["ratio_to_plain"] for v, e in variants.items()}
        for model, variants in results.get("loss_scale", {}).items()
    }
    bars("overhead.png", f"Step time / plain step ({device})", "ratio", overhead)
    return written


def write(results: dict, out_dir: str) -> None:
    """Writes ``table.md`` and the plots."""
    write_text_atomically(os.path.join(out_dir, "table.md"), table(results))
    plots(results, out_dir)
