"""The public API: four namespaces, each documented, immutable where it holds constants, used by the experiments.

``jaxamp`` is the core a training script needs; ``jaxamp.diagnostics`` and
``jaxamp.fsdp`` are loaded on first use; ``jaxamp.fp8`` holds FP8's building
blocks and delayed scaling. The experiments are the project's
own users and may only use what a user may.
"""

from __future__ import annotations

import ast
import importlib
import pathlib
import subprocess
import sys
import warnings

import numpy as np
import pytest

import jaxamp

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
NAMESPACES = ("jaxamp", "jaxamp.diagnostics", "jaxamp.fsdp", "jaxamp.fp8")


def public_names(namespace: str) -> list[str]:
    return list(importlib.import_module(namespace).__all__)


@pytest.mark.parametrize("namespace", NAMESPACES)
def test_every_public_name_has_a_docstring_and_an_entry_in_the_api_reference(namespace):
    api = "".join(page.read_text() for page in sorted((REPO_ROOT / "docs" / "reference").glob("*.md")))
    module = importlib.import_module(namespace)
    for name in module.__all__:
        value = getattr(module, name)
        # Constants (tables, dtypes) carry their docstring in the source, after the assignment.
        if not isinstance(value, (dict, tuple, np.dtype)) and not hasattr(value, "items"):
            assert (value.__doc__ or "").strip(), f"{namespace}.{name} has no docstring"
        # A name that is also its module's name is entered by its full path, headed by the public name.
        entered = f"::: {namespace}.{name}\n" in api or f'heading: "{namespace}.{name}"' in api
        # A value that two namespaces export is entered once, by either path.
        entered = entered or any(
            name in public_names(other)
            and getattr(importlib.import_module(other), name) is value
            and f"::: {other}.{name}\n" in api
            for other in NAMESPACES
        )
        assert entered, f"docs/reference/ does not document {namespace}.{name}"


def test_the_core_namespace_is_small_and_holds_no_diagnostics():
    core = set(public_names("jaxamp"))
    # 26 until NNXOptimizer, NNX's counterpart of TrainState; 29 with OptimizerStorage and split_precision,
    # the optimizer's storage moved out of Policy (issue 49).
    assert len(core) <= 29, sorted(core)
    assert not core & set(public_names("jaxamp.diagnostics"))
    assert not core & set(public_names("jaxamp.fsdp"))


def test_a_name_that_moved_out_of_the_core_still_works_and_says_where_it_went():
    with pytest.warns(DeprecationWarning, match=r"jaxamp\.check_fp8 moved to jaxamp\.diagnostics\.check_fp8"):
        check_fp8 = jaxamp.check_fp8
    assert check_fp8 is jaxamp.diagnostics.check_fp8
    with pytest.warns(DeprecationWarning, match=r"jaxamp\.fsdp\.fsdp_loss"):
        assert jaxamp.fsdp_loss is jaxamp.fsdp.fsdp_loss
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        jaxamp.no_such_name  # noqa: B018


def test_the_public_constants_cannot_be_changed_in_place():
    with pytest.raises(TypeError):
        jaxamp.diagnostics.GPU_TARGETS["b300"] = jaxamp.diagnostics.GPU_TARGETS["h200"]
    with pytest.raises(TypeError):
        jaxamp.diagnostics.GPU_TARGETS["h200"].peak_flops["float16"] = 0.0
    with pytest.raises(TypeError):
        jaxamp.diagnostics.FP8_FALLBACK_REASONS["mine"] = "a reason"
    assert isinstance(jaxamp.NORMALIZATION_LAYERS, tuple)


def test_importing_jaxamp_loads_neither_the_diagnostics_nor_fsdp():
    completed = subprocess.run(
        [sys.executable, "-c", ("import sys, jaxamp; print(sorted(m for m in sys.modules if m.startswith("
                                "('jaxamp.diagnostics', 'jaxamp.fsdp'))))")],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert completed.returncode == 0, completed.stderr
    assert completed.stdout.strip() == "[]"


def _jaxamp_uses(path: pathlib.Path):
    """Every ``jaxamp.a.b`` attribute chain and ``from jaxamp.x import y`` in a file, as dotted names."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "jaxamp":
            for alias in node.names:
                yield node.lineno, f"{node.module}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("jaxamp."):
                    yield node.lineno, alias.name
        elif isinstance(node, ast.Attribute):
            parts = []
            inner = node
            while isinstance(inner, ast.Attribute):
                parts.append(inner.attr)
                inner = inner.value
            if isinstance(inner, ast.Name) and inner.id == "jaxamp":
                yield node.lineno, ".".join(["jaxamp", *reversed(parts)])


def is_public(dotted: str) -> bool:
    """Whether `dotted` starts with a public name: ``jaxamp.X`` or ``jaxamp.diagnostics.X``/``jaxamp.fsdp.X``."""
    parts = dotted.split(".")
    if len(parts) < 2:
        return True
    if parts[1] in jaxamp.__all__ or parts[1] == "__version__":
        return True
    namespace = ".".join(parts[:2])
    if namespace in NAMESPACES:
        return len(parts) == 2 or parts[2] in public_names(namespace)
    return False


def test_the_public_name_check_refuses_private_and_internal_names():
    assert is_public("jaxamp.autocast") and is_public("jaxamp.diagnostics.bytes_accessed.__name__")
    assert not is_public("jaxamp.diagnostics._hlo_report.bytes_accessed")
    assert not is_public("jaxamp._autocast.lineage._reduction_inputs_disabled")
    assert not is_public("jaxamp.fsdp._communication_dtype")


# Four measurements look inside the library on purpose, where no public name does what they measure:
# the float32-reduction-inputs rule switched off (its cost, off against on), the optimized HLO's
# kernels sorted by what they do (an FP8 GEMM's amax passes), 8-bit state with its codes rounded
# to nearest (what stochastic rounding buys; the library offers no nearest codes), and NVFP4's
# gradient quantized alone, its activations exact (the gradient rounding's own share of the error;
# the library quantizes both operands of a GEMM). Nothing else in the experiments may.
INTERNAL_ON_PURPOSE = {
    ("experiments/measure/reduction_cost.py", "jaxamp._autocast.lineage._reduction_inputs_disabled"),
    ("experiments/measure/fp8_scaling_cost.py", "jaxamp.diagnostics._hlo_report"),
    ("experiments/measure/quantized_optimizer_cost.py", "jaxamp._optimizer.low_precision"),
    ("experiments/measure/quantized_optimizer_cost.py", "jaxamp._optimizer.quantized.quantize"),
    ("experiments/measure/quantized_optimizer_cost.py", "jaxamp._optimizer.quantized.dequantize"),
    ("experiments/measure/blackwell_recipe.py", "jaxamp.fp8._block_formats.NVFP4"),
    ("experiments/measure/blackwell_recipe.py", "jaxamp.fp8._block_formats.dequantize"),
    ("experiments/measure/blackwell_recipe.py", "jaxamp.fp8._block_formats.hadamard"),
    ("experiments/measure/blackwell_recipe.py", "jaxamp.fp8._block_formats.quantize"),
}


def test_the_experiments_use_only_public_jaxamp_names():
    private = [
        f"{path.relative_to(REPO_ROOT)}:{line}: {dotted}"
        for path in sorted((REPO_ROOT / "experiments").rglob("*.py"))
        for line, dotted in _jaxamp_uses(path)
        if not is_public(dotted) and (str(path.relative_to(REPO_ROOT)), dotted) not in INTERNAL_ON_PURPOSE
    ]
    assert private == []


def test_the_traced_report_stays_in_the_core_and_the_compiled_one_loads_the_diagnostics():
    import jax.numpy as jnp

    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        report = jaxamp.precision_report(lambda x: x @ x, jnp.ones((4, 4), jnp.float16), compiled=True)
    assert report.compiled and report.count_by_dtype()
