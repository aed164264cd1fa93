"""Where results go: a new run directory per run, never the published
``results/``; files readable by others (0644, as ``open()`` writes them)."""

import datetime
import json
import os
import shutil
import stat
import subprocess

import pytest

from experiments import compare
from experiments.benchmark.__main__ import main as benchmark_main
from experiments.results import run_directory, write_json_atomically, write_text_atomically

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_COMPARE = [
    "--models", "resnet_tiny", "--precisions", "mixed", "--data", "synthetic",
    "--steps-per-epoch", "1", "--epochs", "1", "--batch-size", "4", "--eval-batch-size", "4",
    "--no-progress",
]  # fmt: skip
TINY_BENCHMARK = [
    "--quick", "--sections", "throughput", "--models", "resnet_tiny", "--precisions", "mixed",
    "--batch-size", "4", "--rounds", "1", "--steps", "1", "--num-train", "8", "--no-plots",
]  # fmt: skip


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.fixture
def umask_022():
    """The usual umask, so 'as open() would' means 0644 whatever the test runner's umask."""
    previous = os.umask(0o022)
    yield
    os.umask(previous)


def test_a_run_directory_is_named_by_command_and_time_and_never_shared(tmp_path):
    start = datetime.datetime(2026, 12, 1, 8, 30, 0)
    first = run_directory("compare", root=str(tmp_path / "runs"), now=start)
    second = run_directory("compare", root=str(tmp_path / "runs"), now=start)

    assert first == str(tmp_path / "runs" / "compare-20261201-083000")
    assert second == first + "-2"  # same second: a new directory, not the first one's
    assert os.path.isdir(first) and os.path.isdir(second) and os.listdir(first) == []


def test_files_written_atomically_are_readable_by_others_as_open_would_write_them(tmp_path, umask_022):
    """Fails where the temporary file's private 0600 survives the rename."""
    path = tmp_path / "table.md"
    write_text_atomically(str(path), "hello\n")
    assert path.read_text() == "hello\n"
    with open(tmp_path / "plain.txt", "w") as handle:
        handle.write("x")
    assert mode(path) == mode(tmp_path / "plain.txt") == 0o644


def test_an_atomic_write_is_renamed_from_beside_its_file_and_a_failed_one_leaves_the_old_file_alone(
    tmp_path, monkeypatch
):
    """The temporary file is made in the target's folder (a rename is atomic only within one file
    system), and a write that fails mid-way raises its own error, leaves the previous file as it
    was and no temporary file behind."""
    path = tmp_path / "results" / "results.json"
    write_text_atomically(str(path), "old\n")
    renamed = []
    real_replace = os.replace
    monkeypatch.setattr(
        os, "replace", lambda source, target: renamed.append(source) or real_replace(source, target)
    )

    write_text_atomically(str(path), "new\n")
    with pytest.raises(UnicodeEncodeError):
        write_text_atomically(str(path), "half \udc80 written\n")  # a lone surrogate cannot be encoded

    assert [os.path.dirname(source) for source in renamed] == [str(path.parent)]
    assert path.read_text() == "new\n"
    assert os.listdir(path.parent) == ["results.json"]


def test_a_results_file_is_indented_json_ending_in_a_newline_and_replaces_the_old_one(tmp_path):
    path = tmp_path / "out" / "results.json"
    write_json_atomically(str(path), {"old": True})
    write_json_atomically(str(path), {"epochs": [{"epoch": 1, "loss": 0.5}], "summary": None})

    assert path.read_text() == (
        '{\n  "epochs": [\n    {\n      "epoch": 1,\n      "loss": 0.5\n    }\n  ],\n  "summary": null\n}\n'
    )
    assert os.listdir(path.parent) == ["results.json"]


def test_runs_are_ignored_by_git():
    ignored = subprocess.run(
        ["git", "check-ignore", "-q", "runs/compare-20261201-083000/results.json"], check=False, cwd=REPO_ROOT
    )
    if ignored.returncode == 128:
        pytest.skip("not a git checkout")
    assert ignored.returncode == 0, "runs/ must be in .gitignore"


def run_from_the_repository_root(monkeypatch, main, argv) -> str:
    """Runs `main(argv)` where a user would, in the repository's root, as the
    README writes the command (no output flag); checks that ``git status`` of
    ``results/`` is what it was, and returns the run directory it made (the
    caller removes it)."""

    def git_status_of_results():
        status = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=all", "results/"],
            check=False,
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
        )
        if status.returncode != 0:
            pytest.skip("not a git checkout")
        return status.stdout

    monkeypatch.chdir(REPO_ROOT)
    runs = os.path.join(REPO_ROOT, "runs")
    before = set(os.listdir(runs)) if os.path.isdir(runs) else set()
    status_before = git_status_of_results()
    main(argv)
    assert git_status_of_results() == status_before
    (new,) = set(os.listdir(runs)) - before
    return os.path.join(runs, new)


@pytest.fixture
def removed_afterwards():
    """Paths the test made in the repository, removed when it ends."""
    paths = []
    yield paths
    for path in paths:
        shutil.rmtree(path, ignore_errors=True)


def test_compare_without_an_out_dir_leaves_results_alone_and_writes_a_new_run_directory(
    monkeypatch, umask_022, removed_afterwards
):
    """Fails where compare's default is results/<device>/<dataset>/ (it was)."""
    run = run_from_the_repository_root(monkeypatch, compare.main, TINY_COMPARE)
    removed_afterwards.append(run)

    assert os.path.basename(run).startswith("compare-")
    for name in ("results.json", "table.md", "seconds_per_epoch.png", "accuracy.png"):
        assert mode(os.path.join(run, name)) == 0o644, name
    with open(os.path.join(run, "results.json")) as handle:
        assert set(json.load(handle)["runs"]) == {"resnet_tiny/mixed"}


def test_the_quick_benchmark_without_an_out_dir_leaves_results_alone_and_writes_a_new_run_directory(
    monkeypatch, umask_022, removed_afterwards
):
    """Fails where --quick's default is results/<device>/benchmark/quick/ (it was)."""
    run = run_from_the_repository_root(monkeypatch, benchmark_main, TINY_BENCHMARK)
    removed_afterwards.append(run)

    assert os.path.basename(run).startswith("benchmark-quick-")
    for name in ("results.json", "table.md"):
        assert mode(os.path.join(run, name)) == 0o644, name
    with open(os.path.join(run, "results.json")) as handle:
        assert "resnet_tiny" in json.load(handle)["throughput"]
