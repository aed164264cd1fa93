"""Issue 51's measurements: the CPU parity of mixed_mxfp8 and mixed_nvfp4, and the B200 programs on paper.

`blackwell_parity` is run with its language-model runs replaced by one that
parses the flags it was given with `experiments.lm`'s own parser and records
the configs they make (a real run trains for minutes); its page is built
from those records. `blackwell_gemms` (two matmuls in place of its nine) and
`mxfp8_b200` compile for a B200 target without a GPU (nothing runs), and
skip without the CUDA PJRT plugin. Each test says which fault would make it fail.
"""

import dataclasses
import json
import os

import pytest

import jaxamp
from experiments.lm.__main__ import build_parser, configs_from_args, parse_args
from experiments.measure import blackwell_gemms, blackwell_parity
from experiments.measure.__main__ import main

# Final held-out bits per byte a run reports, by (label, seed): bfloat16 at 2.0; mxfp8 0.2% and 1% worse.
BITS = {
    ("mixed_bf16", 0): 2.0,
    ("mixed_bf16", 1): 2.0,
    ("mixed_mxfp8", 0): 2.004,
    ("mixed_mxfp8", 1): 2.02,
    ("mixed_nvfp4", 0): 2.01,
    ("mixed_nvfp4", 1): 1.99,
    ("mixed_nvfp4 (no-hadamard)", 0): 2.1,
    ("mixed_nvfp4 (no-hadamard)", 1): 2.1,
    ("mixed_nvfp4 (nearest-gradients)", 0): 2.08,
    ("mixed_nvfp4 (nearest-gradients)", 1): 2.08,
}


def payload(command, configs):
    """An ``experiments.lm`` results.json of `configs`, each finished at its `BITS`."""
    runs = []
    for config in configs:
        run = {"config": config}
        bits = BITS[(blackwell_parity.label(run), config["seed"])]
        run["summary"] = {"held_out_bits_per_byte": bits, "skipped_steps": 0}
        runs.append(run)
    return {"command": command, "environment": {"load_average_at_start": 0.5, "cpu_count": 2}, "runs": runs}


def test_the_parity_page_gives_each_runs_gap_to_bfloat16_and_judges_the_worst_seed():
    """MXFP8 is 0.2% and 1.0% worse than bfloat16: 1.0% misses its 0.5% target; NVFP4's worst
    seed (0.5%) meets its 1.5%; an ablation keeps a row of its own. Fails if the gap's sign
    flipped, the best seed were judged, a target were mistyped, or an ablation lost its name."""
    configs = [
        {"precision": precision, "seed": seed, "block_recipe": "full"}
        for precision in ("mixed_bf16", "mixed_mxfp8", "mixed_nvfp4")
        for seed in (0, 1)
    ]
    ablation = [{"precision": "mixed_nvfp4", "seed": seed, "block_recipe": "no-hadamard"} for seed in (0, 1)]
    page = blackwell_parity.parity([payload("formats", configs), payload("no-hadamard", ablation)], "parity")
    rows = {line.split("|")[1].strip(): line for line in page.splitlines() if line.startswith("| mixed")}
    assert "+0.20%" in rows["mixed_mxfp8"] and "+1.00%" in rows["mixed_mxfp8"]
    assert "+5.00%" in rows["mixed_nvfp4 (no-hadamard)"] and "-0.50%" in rows["mixed_nvfp4"]
    assert "mixed_mxfp8: largest gap 1.00% (target at most 0.5%: MISSED)." in page
    assert "mixed_nvfp4: largest gap 0.50% (target at most 1.5%: met)." in page


def test_the_parity_measurement_asks_the_language_model_for_the_issues_runs(tmp_path, monkeypatch):
    """Each of the three runs' flags, as `experiments.lm` parses them, make the small model at
    lr 3e-4, batch 8, in the run's NVFP4 recipe. Fails if the learning rate changed or the
    ablations ran the full recipe (their rows would be missing)."""
    made = {}

    def run_lm(flags, out, subfolder):
        configs = configs_from_args(parse_args(build_parser(), flags))
        made[subfolder] = configs
        folder = os.path.join(out.path, subfolder)
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, "results.json"), "w", encoding="utf-8") as file:
            json.dump(payload(" ".join(flags), [dataclasses.asdict(config) for config in configs]), file)
        return folder

    monkeypatch.setattr(blackwell_parity, "run_lm", run_lm)
    assert main(["blackwell-parity", "--seeds", "0,1", "--steps", "20", "--out", str(tmp_path)]) == 0
    assert {name: {(c.precision, c.block_recipe) for c in configs} for name, configs in made.items()} == {
        "formats": {("mixed_bf16", "full"), ("mixed_mxfp8", "full"), ("mixed_nvfp4", "full")},
        "no-hadamard": {("mixed_nvfp4", "no-hadamard")},
        "nearest-gradients": {("mixed_nvfp4", "nearest-gradients")},
    }
    for config in (config for configs in made.values() for config in configs):
        assert (config.model, config.lr, config.batch_size, config.steps) == ("small", 3e-4, 8, 20)
    page = (tmp_path / "parity.md").read_text()
    assert "| mixed_nvfp4 (no-hadamard)" in page and "| mixed_nvfp4 (nearest-gradients)" in page


def _needs_plugin():
    if not jaxamp.diagnostics.cuda_plugin_available():
        pytest.skip("needs the CUDA PJRT plugin (pip install 'jax-mixed-precision[gpu-aot]')")


# Two matmuls, M, K, N all different, large enough for 4 digits of their bounds in us (nothing
# runs: the programs are compiled only); they stand for TE's layer, with made-up TE figures.
SHAPES = (
    ("TE up", 8192, 4096, 2048, (1.5, 1.4, 2.0)),
    ("TE down", 8192, 2048, 4096, (1.5, 1.4, 2.0)),
)


def figures(line):
    """The cells of a markdown table row."""
    return [cell.strip() for cell in line.strip("|").split("|")]


def test_the_gemm_page_compares_each_formats_compiled_training_pass_with_bfloat16s(tmp_path, monkeypatch):
    """Each format's pass compiles to three GEMMs (cuDNN's block-scaled dot for MXFP8 and NVFP4,
    with cuDNN 9.10 stated), each compiled cell is bfloat16's bound over the format's, the layer
    line sums the TE rows, and the model cell is `fp8_matmul_cost` of x[M, K] @ w[K, N]. Fails if
    the backward were left out, a ratio inverted, the layer kept only its last row, the sizes
    reached the cost model in another order, or cuDNN 9.10 were not stated."""
    _needs_plugin()
    monkeypatch.setattr(blackwell_gemms, "SHAPES", SHAPES)
    assert main(["blackwell-gemms", "--out", str(tmp_path)]) == 0
    lines = (tmp_path / "gemms.md").read_text().splitlines()
    rows = [figures(line) for line in lines if line.startswith("| ")]
    bounds = {}
    for name, matmul_format, kernels, bound in (row for row in rows if len(row) == 4 and row[0] != "matmul"):
        bounds[name, matmul_format] = float(bound.replace(",", ""))
        if matmul_format in ("mxfp8", "nvfp4"):
            assert kernels == "3 x `__cudnn$blockScaledDot`", (name, matmul_format)
        else:
            assert kernels.startswith("3 x "), (name, matmul_format)
    for name, m, k, n, _ in SHAPES:
        (row,) = [row for row in rows if len(row) > 4 and row[0] == name]
        for index, matmul_format in enumerate(blackwell_gemms.FORMATS[1:]):
            compiled, model = (float(cell.rstrip("x")) for cell in row[5 + 3 * index : 7 + 3 * index])
            ratio = bounds[name, "bfloat16"] / bounds[name, matmul_format]
            assert compiled == pytest.approx(ratio, abs=0.006), (name, matmul_format)
            cost = jaxamp.diagnostics.fp8_matmul_cost(m, k, n, "b200", matmul_format=matmul_format)
            assert model == pytest.approx(cost.speedup, abs=0.006), (name, matmul_format)
    layer = next(line for line in lines if line.startswith("The four"))
    for matmul_format in blackwell_gemms.FORMATS[1:]:
        te = sum(bounds[name, "bfloat16"] for name in ("TE up", "TE down")) / sum(
            bounds[name, matmul_format] for name in ("TE up", "TE down")
        )
        assert f"{matmul_format}: {te:.2f}x here" in layer


def test_the_nvfp4_pass_multiplies_e2m1_values_and_the_mxfp8_pass_e4m3():
    """Fails if the measurement's pass ran another format than it names."""
    _needs_plugin()
    device = jaxamp.diagnostics.gpu_target_device("b200", cudnn_version=blackwell_gemms.CUDNN)
    for matmul_format, dtype in (("mxfp8", "float8_e4m3fn"), ("nvfp4", "float4_e2m1fn")):
        roofline, _ = blackwell_gemms.compiled_pass(device, 128, 64, 96, matmul_format)
        assert {name for kernel in roofline.kernels for name in kernel.flops} == {dtype}, matmul_format


def test_the_mxfp8_finding_lowers_to_the_block_scaled_op_and_compiles_to_cudnn_only_with_cudnn_9_10(tmp_path):
    """Fails if the stated cuDNN version were not replaced, the lowered program's custom call
    were read from the optimized one, the columns were swapped or the file not written."""
    _needs_plugin()
    assert main(["mxfp8-b200", "--out", str(tmp_path)]) == 0
    found = dict(line.split(": ", 1) for line in (tmp_path / "mxfp8_b200.txt").read_text().splitlines()[1:])
    for target in ("b200", "h200"):
        for cudnn in ("9.8", "9.10"):
            lowered = found[f"{target} (cuDNN {cudnn} stated)"].split("; ")[0]
            assert lowered == "lowered to ['__op$block_scaled_dot']"
    assert "__cudnn$blockScaledDot" in found["b200 (cuDNN 9.10 stated)"]
    assert "__cudnn$blockScaledDot" not in found["b200 (cuDNN 9.8 stated)"]
