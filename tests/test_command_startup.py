"""A command answers a mistyped flag before JAX, Flax or TensorFlow load.

The flags are parsed first, from modules that import nothing heavy
(`experiments.config`, `experiments.lm.config`, `experiments.flags`); the
heavy imports follow in ``main`` (the benchmark's sections run from
`experiments.benchmark.sections`). A mistyped flag took 9-15 s to be reported
on a busy machine when they came first. Checked by what is imported, not by
timing: a fresh process runs the command and lists the heavy modules loaded.
"""

import os
import re
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
sys.argv = [{module!r}, *{argv!r}]
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
        [sys.executable, "-c", RUN_AND_LIST_HEAVY_MODULES.format(module=module, argv=["--no-such-flag"], heavy=HEAVY)],
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


def test_the_precisions_the_flags_take_are_the_names_jaxamp_knows_and_tf32():
    """One vocabulary: every name jaxamp.get_policy knows is one --precision takes, each alias
    beside its policy names the same policy there, and tf32 alone is no policy."""
    from jaxamp import _policy

    known_to_jaxamp = {*_policy._NAMED_POLICIES, *_policy._NAMED_FP8_POLICIES,
                       *_policy._NAMED_UPDATE_POLICIES, *_policy._NAMED_STATE_POLICIES,
                       *_policy.DTYPE_NAMES}  # fmt: skip
    assert set(config_lib.KNOWN_PRECISIONS) - {config_lib.TF32} == known_to_jaxamp
    for name, aliases in config_lib.POLICY_NAMES.items():
        assert all(jaxamp.get_policy(alias) == jaxamp.get_policy(name) for alias in aliases), name
    with pytest.raises(ValueError):
        jaxamp.get_policy(config_lib.TF32)


def test_a_mistyped_precision_is_answered_before_jax_loads_naming_the_nearest_and_each_name_once():
    """It took 2 s (JAX loaded to ask jaxamp), printed every flag's usage, and a 628-character line
    naming fp32 three times and tf32 not at all."""
    process = subprocess.run(
        [sys.executable, "-c", RUN_AND_LIST_HEAVY_MODULES.format(
            module="experiments.cifar", argv=["--precision", "mixd"], heavy=HEAVY)],
        check=False, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert process.stdout.strip() == "2 []", process.stdout + process.stderr
    usage, error, *choices = process.stderr.strip().splitlines()
    assert usage == "usage: python -m experiments.cifar [flags]  (--help lists them, with their defaults)"
    assert error == (
        "python -m experiments.cifar: error: argument --precision: unknown precision 'mixd'. Did you mean "
        "mixed? Choose one of:"
    )
    assert "\n".join(choices) == config_lib.PRECISION_CHOICES
    for name in ("fp32", "tf32", "mixed", "mixed_float16", "bf16", "bfloat16_kahan"):
        assert len(re.findall(rf"(?<![\w.]){name}(?!\w)", config_lib.PRECISION_CHOICES)) == 1, name
    assert "tf32: float32 with JAX's default matmul precision" in config_lib.PRECISION_CHOICES


@pytest.mark.parametrize("name", [alias for aliases in config_lib.POLICY_NAMES.values() for alias in aliases])
def test_every_alias_is_accepted_without_jaxamp(name):
    assert config_lib.check_precision(name) == name


def test_a_policy_spec_is_checked_by_jaxamp():
    assert config_lib.check_precision("p=f32,c=bf16,o=f32") == "p=f32,c=bf16,o=f32"
    with pytest.raises(ValueError, match="float17"):
        config_lib.check_precision("p=f32,c=float17")
