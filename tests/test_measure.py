"""``python -m experiments.measure NAME``: the list, a mistyped name, the folder a measurement writes.

The measurements themselves are run in a small form where they are cheap:
`communication_bytes` by tests/test_fsdp.py, `fp8_scaling_cost` by
tests/test_fp8_report.py; here, `fp8_payoff` (no compile) stands for all of
them as the entry point sees them.
"""

import json
import math
import os
import signal
import subprocess
import sys

import pytest

import jaxamp
from experiments.measure import MEASUREMENTS
from experiments.measure.__main__ import main, measurement_names, summary
from experiments.measure.markdown import table

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAMES = [module.replace("_", "-") for module in MEASUREMENTS]


def test_help_lists_every_measurement_with_the_first_line_of_its_docstring(capsys):
    assert main(["--help"]) == 0
    listing = capsys.readouterr().out
    for name, module in measurement_names().items():
        (line,) = [line for line in listing.splitlines() if line.split()[:1] == [name]]
        assert line.split(None, 1)[1] == summary(module) != ""


@pytest.mark.parametrize("name", NAMES)
def test_each_measurement_describes_itself_and_its_flags(name, capsys):
    """Fails if a module lacks the measurement's shape (docstring, add_arguments, run) or its flags clash."""
    with pytest.raises(SystemExit) as exit_:
        main([name, "--help"])
    assert exit_.value.code == 0
    shown = capsys.readouterr().out
    assert f"usage: python -m experiments.measure {name}" in shown
    assert summary(name.replace("-", "_")) in shown and "--out OUT" in shown


def test_a_mistyped_name_is_refused_with_the_nearest_one_before_jax_loads():
    """Checked in a fresh process, by what it imported: the name is answered before JAX loads."""
    script = (
        "import sys\n"
        "from experiments.measure.__main__ import main\n"
        "try:\n"
        "    main(['autocats-cost'])\n"
        "except SystemExit as exit:\n"
        "    print(exit.code, 'jax' in sys.modules)\n"
    )
    process = subprocess.run(
        [sys.executable, "-c", script],
        check=False,
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert process.stdout.split() == ["2", "False"], process.stdout + process.stderr
    assert "unknown measurement 'autocats-cost'. Did you mean autocast-cost?" in process.stderr
    assert "Choose one of: autocast-cost, trace-cost" in process.stderr


def test_a_measurement_writes_a_new_folder_under_runs_with_its_command_and_commit(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["fp8-payoff"]) == 0
    (folder,) = os.listdir(tmp_path / "runs")
    assert folder.startswith("measure-fp8-payoff-")
    written = sorted(os.listdir(tmp_path / "runs" / folder))
    assert written == ["COMMAND", "crossovers.md"]
    record = (tmp_path / "runs" / folder / "COMMAND").read_text().splitlines()
    assert record[0] == "command: python -m experiments.measure fp8-payoff"
    assert record[1].startswith("commit: ") and record[3] == "wrote: crossovers.md"
    page = (tmp_path / "runs" / folder / "crossovers.md").read_text()
    assert (
        page.startswith("# Where FP8 pays") and "Command: `python -m experiments.measure fp8-payoff`" in page
    )


def test_out_names_the_folder_and_a_second_run_replaces_its_files(tmp_path):
    out = tmp_path / "results" / "fp8-pays" / "crossovers"
    for _ in range(2):
        assert main(["fp8-payoff", "--out", str(out)]) == 0
    assert sorted(os.listdir(out)) == ["COMMAND", "crossovers.md"]  # no temporary file left behind
    assert f"--out {out}" in (out / "COMMAND").read_text()


def test_a_measurement_that_cannot_run_here_says_what_to_install_and_leaves_no_folder(
    tmp_path, monkeypatch, capsys
):
    """The CUDA plugin missing (faked here, so the test is the same with or without it)."""

    def no_plugin(target):
        raise RuntimeError(f"Compiling for a GPU target needs the CUDA PJRT plugin ({target}).")

    monkeypatch.setattr(jaxamp.diagnostics, "gpu_target_device", no_plugin)
    monkeypatch.setattr(jaxamp.diagnostics, "cuda_plugin_available", lambda: False)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        main(["mxfp8-b200"])
    assert str(exit_.value.code).startswith("error: Compiling for a GPU target needs the CUDA PJRT plugin")
    assert os.listdir(tmp_path) == []  # nor the runs/ it made for it


def test_ctrl_c_stops_a_measurement_before_its_next_file_even_where_python_dropped_the_exception(
    tmp_path, monkeypatch, capsys
):
    """The files written so far stay, complete, without a COMMAND file; the status is 130."""
    from experiments.measure import fp8_payoff

    def interrupted_between_two_files(args, out):
        out.write("first.md", "done\n")
        try:
            os.kill(os.getpid(), signal.SIGINT)
        except KeyboardInterrupt:
            pass  # stands for the exception Python drops inside a garbage collection's callback
        out.write("second.md", "never\n")

    monkeypatch.setattr(fp8_payoff, "run", interrupted_between_two_files)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal
    try:
        assert main(["fp8-payoff", "--out", str(tmp_path / "out")]) == 130
    finally:
        signal.signal(signal.SIGINT, previous)
    assert sorted(os.listdir(tmp_path / "out")) == ["first.md"]
    assert capsys.readouterr().err == (
        f"fp8-payoff: interrupted; the files written so far (first.md) are in {tmp_path / 'out'}, without a "
        "COMMAND file. Run the command again to measure afresh.\n"
    )


def test_a_bad_flag_of_a_measurement_exits_2_naming_it(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["optimizer-parity", "--steps", "0"])
    assert exit_.value.code == 2
    assert "argument --steps: expected a positive integer, got 0" in capsys.readouterr().err


def test_a_markdown_table_aligns_figures_right_and_refuses_a_ragged_row():
    assert table(["recipe", "ms"], [["float32", "3.1"]]) == "| recipe | ms |\n|---|---:|\n| float32 | 3.1 |\n"
    with pytest.raises(ValueError, match="a row of 1 cells in a table of 2 columns"):
        table(["recipe", "ms"], [["float32"]])


def test_the_nnx_model_trains_end_to_end_and_its_skipped_step_counts_only_as_skipped(tmp_path):
    """The NNX recipe of docs/guides/flax.md through the experiments: an inf in batch 2 of 4."""
    out = tmp_path / "nnx"
    argv = ["nnx-parity", "--data", "synthetic", "--steps", "4", "--batch-size", "8", "--test-examples", "16",
            "--inject-inf-every", "2", "--precisions", "mixed_float16", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    (run,) = json.loads((out / "results.json").read_text())["runs"]
    assert run["steps_skipped"] == 1 and run["steps_applied"] == run["adam_count"] == 3
    assert run["loss_scale"] == 2.0**14 and math.isfinite(run["last_loss"])
    assert "| mixed_float16 |" in (out / "table.md").read_text()


def test_the_first_step_measurement_counts_the_compiled_programs_kernels_and_lines():
    """The program's size, which does not move between runs as the times do: a function of two
    elementwise outputs and a reduction compiles to kernels XLA names fusions, and the MLP's plain
    train step (the measurement's baseline) to a program of some dozens of them."""
    import jax
    import jax.numpy as jnp

    from experiments.measure.optimizer_first_step import first_step, program_size

    compiled = jax.jit(lambda x: (jnp.sin(x) * 2, jnp.exp(x).sum(axis=1))).lower(jnp.ones((64, 64))).compile()
    kernels, lines = program_size(compiled)
    assert kernels == compiled.as_text().count(" fusion(") >= 1
    assert lines == compiled.as_text().count("\n")

    lower_s, compile_s, cpu_s, (step_kernels, step_lines) = first_step("mlp", "plain")
    assert min(lower_s, compile_s, cpu_s) > 0
    assert 20 <= step_kernels < step_lines


@pytest.mark.parametrize(
    ("loop", "scanned", "layers", "width"), [("lm", "lm-scan", 4, 128), ("gpt2", "gpt2-scan", 12, 768)]
)
def test_the_first_steps_scanned_language_models_hold_each_block_param_once_over_their_layers(
    loop, scanned, layers, width
):
    """``lm-scan`` and ``gpt2-scan`` are ``lm`` and ``gpt2`` with their blocks scanned: the same params,
    each of a block's 12 stacked over the layers (16 leaves against 12 per layer and 4 more), under
    every variant's policy and optimizer, on windows of 128 tokens and the next; ``--models`` leaves
    the GPT-2 pair out unless named."""
    import argparse

    import jax

    from experiments.measure import optimizer_first_step

    parser = argparse.ArgumentParser()
    optimizer_first_step.add_arguments(parser)
    assert parser.parse_args([]).models == list(optimizer_first_step.DEFAULT_MODELS)
    assert {loop, scanned} <= set(optimizer_first_step.MODELS)
    assert ("gpt2" in loop) != ({loop, scanned} <= set(optimizer_first_step.DEFAULT_MODELS))
    for variant in optimizer_first_step.VARIANTS:
        (loop_state, loop_windows), (scanned_state, scanned_windows) = (
            optimizer_first_step.STEPS[model](variant)[1] for model in (loop, scanned)
        )
        assert loop_windows.shape == scanned_windows.shape == (8, 129)
        loop_leaves = jax.tree.leaves(loop_state.params)
        scanned_leaves = jax.tree.leaves(scanned_state.params)
        assert (len(loop_leaves), len(scanned_leaves)) == (12 * layers + 4, 16)
        assert sum(leaf.size for leaf in loop_leaves) == sum(leaf.size for leaf in scanned_leaves)
        assert scanned_state.params["blocks"]["mlp"]["up"]["kernel"].shape == (layers, width, 4 * width)
        assert {leaf.dtype for leaf in scanned_leaves} == {leaf.dtype for leaf in loop_leaves}


@pytest.mark.parametrize("target", [None, "cpu", "a100"])
def test_the_first_step_measurement_compiles_every_variant_for_the_target_it_names(tmp_path, monkeypatch, target):
    """``--target`` reaches every compile (the warm-up's too) and the table's header; without it, and
    with ``--target cpu``, this CPU. The compiles are stubbed: this checks where they are sent, not
    what they take."""
    from experiments.measure import optimizer_first_step

    asked, compiled_for = [], []
    monkeypatch.setattr(optimizer_first_step, "target_device", lambda name: asked.append(name) or f"device of {name}")

    def first_step(model, variant, device=None):
        compiled_for.append((model, variant, device))
        return 0.1, 0.2, 0.3, (10, 100)

    monkeypatch.setattr(optimizer_first_step, "first_step", first_step)
    argv = ["optimizer-first-step", "--models", "mlp", "--rounds", "1", "--out", str(tmp_path / "out")]
    assert main(argv + ([] if target is None else ["--target", target])) == 0
    on_cpu = target in (None, "cpu")
    device = None if on_cpu else "device of a100"
    assert asked == ([] if on_cpu else ["a100"])
    assert compiled_for == [("mlp", variant, device) for variant in ("plain", *optimizer_first_step.VARIANTS)]
    header = (tmp_path / "out" / "first_step.md").read_text().splitlines()[0]
    assert ("compiled for this CPU" if on_cpu else "compiled for NVIDIA A100") in header


def test_the_first_step_measurement_refuses_a_target_it_does_not_know():
    with pytest.raises(SystemExit):
        main(["optimizer-first-step", "--target", "b300"])


def test_the_first_step_compiled_for_a_gpu_is_the_gpus_program():
    """With a GPU target the step is compiled for that GPU on this machine: its kernels are CUDA
    kernels (XLA's GPU backend merges the optimizer's per-leaf outputs into fewer of them than the
    CPU's), not this CPU's."""
    from experiments.measure.gpu_target import target_device
    from experiments.measure.optimizer_first_step import first_step

    if not jaxamp.diagnostics.cuda_plugin_available():
        pytest.skip("needs the CUDA PJRT plugin (pip install 'jax-mixed-precision[gpu-aot]')")
    *_, (cpu_kernels, _) = first_step("mlp", "bfloat16")
    *_, (gpu_kernels, _) = first_step("mlp", "bfloat16", target_device("h200"))
    assert 10 <= gpu_kernels < cpu_kernels
