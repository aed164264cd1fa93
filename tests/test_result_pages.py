"""The result pages (``table.md``): a real title, and settings as a table, never a Python dict.

The docs site publishes every linked ``table.md`` as a page; without a
heading MkDocs titles it by its file name, "Table".
"""

import pathlib

import jax
import pytest

from experiments import compare
from experiments.benchmark import output as benchmark_output
from experiments.lm import on_paper
from experiments.lm import output as lm_output

REPO = pathlib.Path(__file__).resolve().parent.parent

BENCHMARK_ENVIRONMENT = {
    "device": "cpu (x86_64)",
    "platform": "cpu",
    "jax": jax.__version__,
    "command": "python -m experiments.benchmark --quick",
    "settings": {
        "models": ["resnet18"],
        "batch_size": 32,
        "targets": [],
        "sections": ["throughput", "pipeline"],
    },
}

PAGES = {
    "benchmark": lambda: benchmark_output.table({"environment": BENCHMARK_ENVIRONMENT}),
    "compare": lambda: compare.title({"dataset": "fashion_mnist"}),
    "lm": lambda: lm_output.markdown_table([], "python -m experiments.lm --quick"),
    "lm.on_paper": lambda: on_paper.markdown([], "python -m experiments.lm.on_paper"),
}


@pytest.mark.parametrize("page", PAGES.values(), ids=PAGES.keys())
def test_a_generated_page_opens_with_a_title(page):
    first_line = page().splitlines()[0]
    assert first_line.startswith("# ") and len(first_line) > len("# Table")


def test_the_benchmarks_settings_are_a_table_and_its_title_names_what_ran():
    page = benchmark_output.table({"environment": BENCHMARK_ENVIRONMENT})
    assert page.startswith("# Benchmark: throughput and memory, input pipeline\n")
    assert "| `models` | resnet18 |" in page and "| `batch_size` | 32 |" in page
    assert "| `targets` | none |" in page
    assert "{'" not in page and "Settings:" not in page


def test_the_lm_table_printed_at_the_end_of_a_run_has_no_page_title():
    assert not lm_output.markdown_table([]).startswith("#")


COMMITTED = sorted((REPO / "results").rglob("table.md"))


@pytest.mark.parametrize("page", COMMITTED, ids=lambda page: str(page.relative_to(REPO)))
def test_every_committed_result_page_has_a_title_and_no_settings_dict(page):
    text = page.read_text(encoding="utf-8")
    assert text.startswith("# "), "regenerate its header from its results.json"
    assert "Settings: {" not in text


def test_the_on_paper_title_names_the_gpu_compiled_for():
    assert on_paper.title([{"device_kind": "NVIDIA H200"}, {"error": "out of time"}]).startswith(
        "# Language model compiled for NVIDIA H200, on paper"
    )


RESULTS = REPO / "results"


def test_every_committed_result_says_the_command_and_commit_that_made_it():
    """Each folder of outputs under results/ (or the run folder above it) has a COMMAND file with the
    command and the commit; a question's folder may hold a README.md alone."""
    for folder in sorted(path for path in RESULTS.rglob("*") if path.is_dir()):
        outputs = [path.name for path in folder.iterdir() if path.is_file() and path.name != "README.md"]
        if not outputs:
            continue
        recorded = next(
            (above / "COMMAND" for above in (folder, *folder.parents) if (above / "COMMAND").exists()), None
        )
        assert recorded is not None and RESULTS in recorded.parents, (
            f"{folder.relative_to(REPO)} has no COMMAND"
        )
        lines = recorded.read_text(encoding="utf-8").splitlines()
        assert any(line.startswith("command: ") for line in lines), recorded
        assert any(line.startswith("commit: ") for line in lines), recorded
