"""What the commands write, checked before they work; nothing left behind when they fail.

A bad ``--out`` (experiments.cifar) or ``--out-dir`` (every other command)
is refused by argparse before any data loads or anything compiles: exit
status 2, one line naming the path and the problem, no traceback. It used to
fail only when first written, after an epoch of training.
"""

import argparse
import contextlib
import json
import os
import shutil
import tempfile

import pytest

from experiments import checkpointing, cifar, compare, train
from experiments.benchmark import __main__ as benchmark
from experiments.lm import __main__ as lm
from experiments.lm import on_paper

TINY_CIFAR = ["--model", "resnet_tiny", "--data", "synthetic", "--no-progress", "--epochs", "1",
              "--batch-size", "8", "--steps-per-epoch", "1"]  # fmt: skip
OUT_DIR_COMMANDS = {"lm": lm.main, "compare": compare.main, "benchmark": benchmark.main,
                    "lm.on_paper": on_paper.main}  # fmt: skip


@pytest.fixture
def no_training(monkeypatch):
    """Fails the test if a run starts: the path must be refused before."""

    def started(*args, **kwargs):
        raise AssertionError("the run started before its output path was checked")

    monkeypatch.setattr(train, "train_and_evaluate", started)


def refused(main, argv, capsys) -> str:
    """Runs `main(argv)`, expecting argparse's exit 2; returns the error line."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert "Traceback" not in error
    return error.strip().splitlines()[-1]


def test_an_existing_directory_as_out_is_refused_before_training(tmp_path, capsys, no_training):
    line = refused(cifar.main, [*TINY_CIFAR, "--out", str(tmp_path)], capsys)
    example = tmp_path / "results.json"
    assert line.endswith(f"argument --out: {tmp_path} is a directory, not a file; name a file, e.g. {example}")


def test_an_out_under_a_file_is_refused_naming_the_file(tmp_path, capsys, no_training):
    (tmp_path / "notes.txt").write_text("a file, not a directory")
    out = tmp_path / "notes.txt" / "run" / "results.json"
    line = refused(cifar.main, [*TINY_CIFAR, "--out", str(out)], capsys)
    assert f"cannot create {out}: {tmp_path / 'notes.txt'} is a file, not a directory" in line


@contextlib.contextmanager
def read_only_directory(mode=0o555, files=(), folders=()):
    """A directory of `mode` (holding `files` and `folders`, each writable by anyone) for a user other
    than its owner, also for root (who ignores modes): seteuid to nobody."""
    path = tempfile.mkdtemp(prefix="jaxamp_outputs_")
    for name in files:
        with open(os.path.join(path, name), "w") as file:
            file.write("{}\n")
        os.chmod(os.path.join(path, name), 0o666)
    for name in folders:
        os.mkdir(os.path.join(path, name))
        os.chmod(os.path.join(path, name), 0o777)
    os.chmod(path, mode)
    is_root = os.geteuid() == 0
    if is_root:
        os.seteuid(65534)  # the real uid stays root, so this is undone below
    try:
        yield path
    finally:
        if is_root:
            os.seteuid(0)
        os.chmod(path, 0o755)
        shutil.rmtree(path)


def test_an_out_in_a_directory_without_write_permission_is_refused(capsys, no_training):
    with read_only_directory() as locked:
        out = os.path.join(locked, "sub", "results.json")
        line = refused(cifar.main, [*TINY_CIFAR, "--out", out], capsys)
        assert f"cannot create {out}: no permission to write in {locked}" in line
        assert not os.path.exists(os.path.join(locked, "sub"))


def test_an_existing_writable_out_in_a_directory_without_write_permission_is_refused(capsys, no_training):
    """The file itself may be written, but it is replaced through a temporary file beside it: the
    check passed, the run trained, and the first write ended in a PermissionError traceback."""
    with read_only_directory(files=["results.json"]) as locked:
        out = os.path.join(locked, "results.json")
        line = refused(cifar.main, [*TINY_CIFAR, "--out", out], capsys)
        assert line.endswith(
            f"argument --out: cannot replace {out}: no permission to write in {locked} (it is written to a "
            "temporary file there, then renamed); name a file in a directory you can write to"
        )


@pytest.mark.parametrize("main", OUT_DIR_COMMANDS.values(), ids=OUT_DIR_COMMANDS.keys())
def test_an_existing_shared_out_dir_in_a_folder_that_may_not_be_written_is_accepted(
    main, capsys, monkeypatch
):
    """A shared scratch folder (``/tmp/runs``, mode 777) whose parent only root may write: the run
    writes inside it, never beside it, so it is accepted. Fails if an existing ``--out-dir`` is
    checked against its parent, as a folder still to be made is."""

    class Accepted(Exception):
        """Raised where the command would begin its work, once its flags were accepted."""

    def accepted(*args, **kwargs):
        raise Accepted

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", _parse_then(accepted))
    with read_only_directory(folders=["shared"]) as locked:
        shared = os.path.join(locked, "shared")
        with open(os.path.join(shared, "written by this user"), "w"):
            pass  # the scenario: this user may write in it, not beside it
        assert not os.access(locked, os.W_OK, effective_ids=os.access in os.supports_effective_ids)
        with pytest.raises(Accepted):
            main(["--out-dir", shared])
    assert "error" not in capsys.readouterr().err


def _parse_then(after):
    """argparse's ``parse_args``, then `after` with its result: a command stopped once its flags parse."""
    parse_args = argparse.ArgumentParser.parse_args

    def parse_then(self, *args, **kwargs):
        return after(parse_args(self, *args, **kwargs))

    return parse_then


def test_a_new_out_in_a_folder_that_may_be_read_and_written_but_not_searched_is_refused(capsys, no_training):
    """Making a file in a folder needs search (x) permission as well as write (w): mode rw-."""
    with read_only_directory(mode=0o766) as locked:
        out = os.path.join(locked, "results.json")
        line = refused(cifar.main, [*TINY_CIFAR, "--out", out], capsys)
    assert line.endswith(
        f"cannot create {out}: no permission to write in {locked}; name a file in a directory you can "
        "write to"
    )


def test_an_out_dir_in_a_folder_that_may_be_read_and_written_but_not_searched_is_refused(capsys):
    with read_only_directory(mode=0o766) as locked:
        out_dir = os.path.join(locked, "lm")
        line = refused(lm.main, ["--out-dir", out_dir], capsys)
    assert f"cannot create {out_dir}: no permission to write in {locked}" in line


def test_a_checkpoint_dir_in_a_folder_that_may_be_read_and_written_but_not_searched_is_refused():
    with read_only_directory(mode=0o766) as locked, pytest.raises(checkpointing.CheckpointError) as raised:
        checkpointing.check_folder_usable(os.path.join(locked, "ckpt"))
    assert str(raised.value).startswith(
        f"No permission to write checkpoints in {locked} (to create {os.path.join(locked, 'ckpt')})"
    )


@pytest.mark.parametrize("main", OUT_DIR_COMMANDS.values(), ids=OUT_DIR_COMMANDS.keys())
def test_a_file_as_out_dir_is_refused_by_every_command(main, tmp_path, capsys):
    a_file = tmp_path / "table.md"
    a_file.write_text("not a directory")
    line = refused(main, ["--out-dir", str(a_file)], capsys)
    assert line.endswith(f"argument --out-dir: {a_file} is a file, not a directory; name a directory")


def test_an_out_dir_that_cannot_be_created_is_refused_and_nothing_is_made(capsys):
    with read_only_directory() as locked:
        out_dir = os.path.join(locked, "runs", "lm")
        line = refused(lm.main, ["--out-dir", out_dir], capsys)
        assert f"cannot create {out_dir}: no permission to write in {locked}" in line
        assert os.listdir(locked) == []


def test_a_good_out_is_accepted_and_not_created_by_the_check(tmp_path):
    out = tmp_path / "new" / "results.json"
    args = cifar.build_parser().parse_args([*TINY_CIFAR, "--out", str(out)])
    assert args.out == str(out) and not (tmp_path / "new").exists()


def test_lm_with_a_missing_data_dir_leaves_no_run_folder(tmp_path, monkeypatch, capsys):
    """It left an empty runs/lm-<time>/ for every failed attempt."""
    monkeypatch.chdir(tmp_path)
    missing = tmp_path / "no-such-sources"
    assert lm.main(["--model", "tiny", "--no-progress", "--data-dir", str(missing)]) == 1
    error = capsys.readouterr().err
    assert str(missing) in error and "Traceback" not in error
    assert os.listdir(tmp_path) == []


def test_lm_with_a_missing_out_dir_data_leaves_out_dir_uncreated(tmp_path, capsys):
    out_dir = tmp_path / "results" / "lm"
    assert lm.main(["--no-progress", "--data-dir", str(tmp_path / "absent"), "--out-dir", str(out_dir)]) == 1
    assert not (tmp_path / "results").exists()


def test_resume_from_a_missing_checkpoint_folder_creates_nothing(tmp_path):
    """--resume naming a folder that does not exist is an error, and the folder stays absent."""
    missing = tmp_path / "checkpoints"
    expected = "--resume found no checkpoint in .*no such folder"
    with pytest.raises(checkpointing.CheckpointError, match=expected):
        checkpointing.Checkpointer(str(missing), {"model": "tiny"}, resume=True)
    assert not missing.exists()


def test_lm_quick_lets_flags_given_beside_it_win():
    """--quick's settings fill only the flags not given; it used to override them silently."""
    parser = lm.build_parser()
    args = lm.parse_args(parser, ["--quick", "--precisions", "mixed", "--steps", "30", "--eval-every", "10"])
    configs = lm.configs_from_args(args)
    assert [(config.precision, config.steps, config.eval_every, config.model) for config in configs] == [
        ("mixed", 30, 10, "tiny")
    ]
    quick = lm.configs_from_args(lm.parse_args(lm.build_parser(), ["--quick"]))
    assert [(config.precision, config.steps, config.eval_every) for config in quick] == [
        ("fp32", 100, 25),
        ("mixed_bf16", 100, 25),
    ]


def test_ctrl_c_in_lm_says_where_the_finished_evaluations_are(tmp_path, monkeypatch, capsys):
    """Exit status 130 and one line, no KeyboardInterrupt traceback."""
    from experiments.lm import train as lm_train

    def interrupted(config, corpus, log, on_record):
        on_record({"config": {}, "evaluations": []})  # one evaluation written, then Ctrl-C
        raise KeyboardInterrupt

    monkeypatch.setattr(lm_train, "train_and_evaluate", interrupted)
    out_dir = tmp_path / "lm"
    assert lm.main(["--data", "synthetic", "--no-progress", "--out-dir", str(out_dir)]) == 130
    error = capsys.readouterr().err
    assert error.strip() == (
        f"interrupted. The evaluations finished so far are in {out_dir / 'results.json'}. Language-model "
        "runs keep no checkpoints: run the command again to start afresh, with fewer --steps or "
        "--precisions for a shorter run."
    )


@pytest.mark.parametrize(
    "stop, status, first_words",
    [
        (KeyboardInterrupt(), 130, "interrupted."),
        # an error found in a later run, here a batch larger than the data: it was a traceback
        (train.ConfigError("--batch-size 9999 exceeds the 64 training examples."), 1,
         "error: --batch-size 9999 exceeds the 64 training examples."),
    ],
    ids=["Ctrl-C", "an error"],
)  # fmt: skip
def test_compare_stopped_in_its_second_run_names_the_finished_one_in_one_line(
    stop, status, first_words, tmp_path, monkeypatch, capsys
):
    """Exit status 130 or 1 and one line naming the results file; Ctrl-C was a KeyboardInterrupt traceback."""
    finished = []

    def second_run_stopped(config, dataset):
        if finished:
            raise stop
        finished.append(config.precision)
        return {"config": {"precision": config.precision}}

    monkeypatch.setattr(train, "train_and_evaluate", second_run_stopped)
    out_dir = tmp_path / "compare"
    argv = ["--models", "resnet_tiny", "--precisions", "fp32,mixed", "--data", "synthetic", "--no-progress",
            "--out-dir", str(out_dir)]  # fmt: skip
    assert compare.main(argv) == status
    again = " Run the command again to start afresh." if status == 130 else ""
    assert capsys.readouterr().err.strip() == (
        f"{first_words} The results of the 1 finished run are in {out_dir / 'results.json'}.{again}"
    )
    assert list(json.loads((out_dir / "results.json").read_text())["runs"]) == ["resnet_tiny/fp32"]


def test_ctrl_c_in_the_benchmark_writes_what_finished_and_exits_130(tmp_path, monkeypatch, capsys):
    """The sections run so far are written (table and results), then one line, no traceback."""
    from experiments.benchmark import sections

    def interrupted(settings, budget, results):
        results.put(("memory",), {"note": "finished before the interrupt"})
        raise KeyboardInterrupt

    monkeypatch.setattr(sections, "run_sections", interrupted)
    out_dir = tmp_path / "benchmark"
    argv = ["--models", "resnet_tiny", "--precisions", "mixed", "--no-plots", "--out-dir", str(out_dir)]
    assert benchmark.main(argv) == 130
    assert capsys.readouterr().err.strip() == f"interrupted; what had finished is in {out_dir}"
    assert (out_dir / "table.md").exists()


def test_cifar_with_missing_data_leaves_no_checkpoint_folder(tmp_path, capsys):
    """--checkpoint-dir used to be created before the data loaded, and stayed behind, empty."""
    checkpoints = tmp_path / "checkpoints"
    argv = ["--model", "resnet_tiny", "--dataset", "fashion_mnist", "--data", "tfds", "--no-progress",
            "--data-dir", str(tmp_path / "no-such-data"), "--checkpoint-dir", str(checkpoints)]  # fmt: skip
    assert cifar.main(argv) == 1
    assert "Traceback" not in capsys.readouterr().err
    assert not checkpoints.exists()


def interrupt(*args, **kwargs):
    raise KeyboardInterrupt


def interrupted_while_making_the_checkpoint_folder(config, *args, **kwargs):
    os.makedirs(config.checkpoint_dir)  # as orbax's checkpoint manager does, parents included
    raise KeyboardInterrupt


def test_cifar_interrupted_before_its_first_epoch_leaves_nothing_and_says_nothing_was_written(
    tmp_path, monkeypatch, capsys
):
    """It said "The results of the finished epochs are in .../results.json" with no epoch finished,
    and left new/deep of --checkpoint-dir new/deep/ckpt behind."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(train, "train_and_evaluate", interrupted_while_making_the_checkpoint_folder)
    argv = [*TINY_CIFAR, "--checkpoint-dir", "new/deep/ckpt", "--out", "out/deep/results.json"]
    assert cifar.main(argv) == 130
    assert capsys.readouterr().err.strip() == (
        "interrupted before the first checkpoint in new/deep/ckpt; nothing to resume. No epoch finished, "
        "so nothing was written to out/deep/results.json. Run the same command again to start afresh."
    )
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("epochs", [1, 3])
def test_cifar_interrupted_after_finished_epochs_names_them_and_the_file(
    epochs, tmp_path, monkeypatch, capsys
):
    out = tmp_path / "run" / "results.json"

    def interrupted_after_epochs(config, *args, **kwargs):
        train.write_json_atomically(config.out, {"epochs": [{"epoch": n + 1} for n in range(epochs)]})
        raise KeyboardInterrupt

    monkeypatch.setattr(train, "train_and_evaluate", interrupted_after_epochs)
    assert cifar.main([*TINY_CIFAR, "--out", str(out)]) == 130
    finished = "1 finished epoch" if epochs == 1 else f"{epochs} finished epochs"
    assert capsys.readouterr().err.startswith(
        "interrupted; no checkpoint was kept (no --checkpoint-dir). "
        f"The results of the {finished} are in {out}."
    )


def test_cifar_interrupted_before_its_first_epoch_does_not_claim_an_older_runs_file(
    tmp_path, monkeypatch, capsys
):
    out = tmp_path / "results.json"
    out.write_text('{"epochs": [{"epoch": 1}, {"epoch": 2}]}\n')  # an earlier run's
    monkeypatch.setattr(train, "train_and_evaluate", interrupt)
    assert cifar.main([*TINY_CIFAR, "--out", str(out)]) == 130
    assert f"No epoch finished, so nothing was written to {out}." in capsys.readouterr().err
    assert out.read_text() == '{"epochs": [{"epoch": 1}, {"epoch": 2}]}\n'


def test_lm_interrupted_before_its_first_evaluation_leaves_no_run_folder(tmp_path, monkeypatch, capsys):
    """It left an empty runs/lm-<time>/ (and runs/) behind."""
    from experiments.lm import train as lm_train

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(lm_train, "train_and_evaluate", interrupt)
    assert lm.main(["--data", "synthetic", "--no-progress"]) == 130
    error = capsys.readouterr().err
    assert error.startswith("interrupted. No evaluation had finished, so nothing was written. Language-model")
    assert os.listdir(tmp_path) == []


def test_lm_interrupted_before_its_first_evaluation_does_not_claim_an_older_runs_results(
    tmp_path, monkeypatch, capsys
):
    from experiments.lm import train as lm_train

    (tmp_path / "results.json").write_text("{}\n")  # an earlier run's, in the --out-dir named again
    monkeypatch.setattr(lm_train, "train_and_evaluate", interrupt)
    assert lm.main(["--data", "synthetic", "--no-progress", "--out-dir", str(tmp_path)]) == 130
    assert "No evaluation had finished, so nothing was written." in capsys.readouterr().err


def test_compare_interrupted_before_its_first_run_leaves_no_run_folder(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(train, "train_and_evaluate", interrupt)
    argv = ["--models", "resnet_tiny", "--precisions", "fp32", "--data", "synthetic", "--no-progress"]
    assert compare.main(argv) == 130
    assert capsys.readouterr().err.strip() == (
        "interrupted. No run had finished, so nothing was written. Run the command again to start afresh."
    )
    assert os.listdir(tmp_path) == []


def test_the_benchmark_interrupted_before_any_measurement_says_so(tmp_path, monkeypatch, capsys):
    from experiments.benchmark import sections

    monkeypatch.setattr(sections, "run_sections", interrupt)
    out_dir = tmp_path / "benchmark"
    argv = ["--models", "resnet_tiny", "--precisions", "mixed", "--no-plots", "--out-dir", str(out_dir)]
    assert benchmark.main(argv) == 130
    assert capsys.readouterr().err.strip() == (
        f"interrupted; no measurement had finished; the environment alone is in {out_dir}"
    )
    assert sorted(os.listdir(out_dir)) == ["results.json", "table.md"]  # never an empty folder


def test_lm_on_paper_interrupted_before_its_first_compile_leaves_no_run_folder(tmp_path, monkeypatch, capsys):
    import jaxamp

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(jaxamp.diagnostics, "cuda_plugin_available", lambda: True)
    monkeypatch.setattr(on_paper, "compile_with_attention_fallback", interrupt)
    assert on_paper.main(["--precisions", "mixed_bf16", "--routes", "apply_policy"]) == 130
    assert capsys.readouterr().err.strip() == "interrupted; no compile had finished, so nothing was written."
    assert os.listdir(tmp_path) == []


def test_a_measurement_that_fails_leaves_no_folder_it_made_nor_their_parents(tmp_path, monkeypatch):
    from experiments.measure import fp8_payoff
    from experiments.measure.__main__ import main as measure

    def failed(args, out):
        raise RuntimeError("a measurement that fails before writing anything")

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(fp8_payoff, "run", failed)
    for out in ([], ["--out", "results/new/deep"]):
        with pytest.raises(RuntimeError, match="fails before writing anything"):
            measure(["fp8-payoff", *out])
        assert os.listdir(tmp_path) == []
