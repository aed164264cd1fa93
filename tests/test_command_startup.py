"""A command answers a mistyped flag before JAX, Flax or TensorFlow load.

The flags are parsed first, from modules that import nothing heavy
(`experiments.config`, `experiments.lm.config`, `experiments.flags`); the
heavy imports follow in ``main`` (the benchmark's sections run from
`experiments.benchmark.sections`). A mistyped flag took 9-15 s to be reported
on a busy machine when they came first. Checked by what is imported, not by
timing: a fresh process runs the command and lists the heavy modules loaded.
"""

import os
import subprocess
import sys

import pytest

import jaxamp
from experiments import config as config_lib
from experiments import flags
from experiments.lm import config as lm_config
from experiments.lm import model as lm_model
from experiments.models import MODELS

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HEAVY = ("jax", "jaxlib", "flax", "optax", "orbax.checkpoint", "tensorflow", "tensorflow_datasets", "jaxamp")

RUN_AND_LIST_HEAVY_MODULES = """
import runpy, sys
sys.argv = [{module!r}, "--no-such-flag"]
try:
    runpy.run_module({module!r}, run_name="__main__")
except SystemExit as exit:
    print(exit.code, [name for name in {heavy!r} if name in sys.modules])
"""


@pytest.mark.parametrize(
    "module",
    [
        "experiments.cifar",
        "experiments.lm",
        "experiments.compare",
        "experiments.benchmark",
        "experiments.lm.on_paper",
    ],
)
def test_a_mistyped_flag_is_answered_before_any_heavy_import(module):
    process = subprocess.run(
        [sys.executable, "-c", RUN_AND_LIST_HEAVY_MODULES.format(module=module, heavy=HEAVY)],
        check=False, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert "error: unrecognized arguments: --no-such-flag" in process.stderr
    assert process.stdout.strip() == "2 []", process.stdout + process.stderr


def test_the_model_names_the_flags_offer_are_the_models_there_are():
    assert config_lib.MODEL_NAMES == tuple(sorted(MODELS))
    assert lm_model.SIZES is lm_config.SIZES and lm_model.ATTENTION_CHOICES is lm_config.ATTENTION_CHOICES


def test_the_gpu_targets_the_flags_offer_are_the_targets_jaxamp_compiles_for():
    assert flags.GPU_TARGET_NAMES == tuple(jaxamp.diagnostics.GPU_TARGETS)


def test_the_fp8_choices_on_paper_offers_are_those_the_benchmark_takes():
    from experiments.benchmark import targets
    from experiments.lm import on_paper

    assert on_paper.FP8_WHERE == targets.FP8_WHERE


FAST_PATH_POLICIES = [name for name in config_lib.KNOWN_PRECISIONS if name not in ("fp32", "tf32")]


@pytest.mark.parametrize("name", FAST_PATH_POLICIES)
def test_every_precision_accepted_without_jaxamp_is_one_jaxamp_accepts(name):
    """The flag's fast path can never accept a name that jaxamp.get_policy would refuse."""
    assert isinstance(jaxamp.get_policy(name), jaxamp.Policy)


def test_a_precision_outside_the_fast_path_is_still_checked_by_jaxamp():
    assert config_lib.check_precision("p=f32,c=bf16,o=f32") == "p=f32,c=bf16,o=f32"
    with pytest.raises(ValueError, match="float17"):
        config_lib.check_precision("float17")
