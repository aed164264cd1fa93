"""Bad input: one clear error each, exit status 2 for flags and 1 for the rest, no traceback.

NaN or inf in the input images is not an error but a skipped step; that case
is in tests/test_grad_accumulation.py (with and without accumulation it goes
through the same finite check).
"""

import argparse
import contextlib
import os
import pathlib
import re
import shutil
import tempfile

import jax.numpy as jnp
import optax
import pytest
from test_data import write_cifar10_archive, write_fashion_mnist

import jaxamp
from experiments import checkpointing, cifar, compare
from experiments.benchmark import __main__ as benchmark
from experiments.flags import HelpFormatter
from experiments.lm import __main__ as lm
from experiments.lm import on_paper

QUICK = [
    "--model", "resnet_tiny", "--data", "synthetic", "--no-progress", "--epochs", "1", "--batch-size", "8",
]  # fmt: skip


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--precision", "float17"], "unknown precision 'float17'. Did you mean float16? Choose one of:"),
        (["--model", "vgg"], "unknown model 'vgg'. Choose one of: mobilenetv2, resnet101,"),
        (["--model", "resnet19"], "unknown model 'resnet19'. Did you mean resnet18? Choose one of:"),
        (["--loss-scale", "adaptive"], "Unknown loss scale 'adaptive'"),
        (["--loss-scale", "static:inf"], "Unknown loss scale 'static:inf'"),
        (["--dataset", "imagenet"], "invalid choice: 'imagenet'"),
        (["--data", "imagenet"], "invalid choice: 'imagenet'"),
        (["--batch-size", "0"], "expected a positive integer, got 0"),
        (["--batch-size", "-8"], "expected a positive integer, got -8"),
        (["--batch-size", "8.5"], "expected a positive integer, got '8.5'"),
        (["--epochs", "0"], "expected a positive integer, got 0"),
        (["--epochs", "two"], "expected a positive integer, got 'two'"),
        (["--steps-per-epoch", "-1"], "expected a positive integer, got -1"),
        (["--grad-accum", "0"], "expected a positive integer, got 0"),
        (["--grad-accum", "1.5"], "expected a positive integer, got '1.5'"),
        (["--lr", "0"], "expected a positive finite number, got 0.0"),
        (["--lr", "-0.1"], "expected a positive finite number, got -0.1"),
        (["--lr", "nan"], "expected a positive finite number, got nan"),
        (["--lr", "inf"], "expected a positive finite number, got inf"),
        (["--lr", "fast"], "expected a positive number, got 'fast'"),
        (["--inject-nonfinite", "1.5"], "must lie in [0, 1)"),
        (["--max-consecutive-skips", "-1"], "expected an integer >= 0, got -1"),
        (["--seed", "-1"], "expected an integer >= 0, got -1"),
        (["--label-smoothing", "1.5"], "expected a number in [0, 1), got 1.5"),
        (["--label-smoothing", "-0.1"], "expected a number in [0, 1), got -0.1"),
        (["--checkpoint-every", "10"], "--checkpoint-every needs --checkpoint-dir"),
        (["--resume"], "--resume needs --checkpoint-dir"),
    ],
)
def test_a_bad_flag_exits_2_with_the_value_and_the_choices(argv, expected, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cifar.main(argv)
    assert exit_info.value.code == 2
    assert expected in capsys.readouterr().err


def run_cli(argv, capsys):
    """Runs the CLI in this process; returns (exit status, stderr)."""
    exit_code = cifar.main(argv)
    error = capsys.readouterr().err
    assert "Traceback" not in error
    return exit_code, error


def test_a_batch_that_does_not_split_into_micro_batches_exits_1(capsys):
    exit_code, error = run_cli([*QUICK, "--grad-accum", "3"], capsys)
    assert exit_code == 1 and "--batch-size 8 is not divisible by --grad-accum 3" in error


def test_partial_multi_process_flags_exit_1_naming_the_missing_ones(capsys):
    exit_code, error = run_cli([*QUICK, "--num-processes", "2", "--process-id", "0"], capsys)
    assert exit_code == 1 and "--coordinator-address missing" in error


def test_a_truncated_fashion_mnist_file_exits_1_naming_it(tmp_path, capsys):
    write_fashion_mnist(tmp_path)
    damaged = tmp_path / "train-images-idx3-ubyte.gz"
    damaged.write_bytes(damaged.read_bytes()[:40])  # cut inside the gzip stream
    exit_code, error = run_cli([*QUICK, "--dataset", "fashion_mnist", "--data", "tfds", "--data-dir",
                                str(tmp_path)], capsys)  # fmt: skip
    assert exit_code == 1 and str(damaged) in error and "truncated or damaged" in error


def test_a_truncated_cifar10_archive_exits_1_with_the_ways_forward(
    tmp_path, offline, capsys, needs_tensorflow_datasets
):
    archive = tmp_path / "downloads" / "manual" / "cifar-10-binary.tar.gz"
    write_cifar10_archive(archive)
    archive.write_bytes(archive.read_bytes()[:-200])
    argv = [*QUICK, "--dataset", "cifar10", "--data", "tfds", "--data-dir", str(tmp_path)]
    exit_code, error = run_cli(argv, capsys)
    assert exit_code == 1 and str(archive) in error and "Download" in error


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--budget", "-1"], "argument --budget: expected a positive finite number, got -1.0"),
        (["--budget", "0"], "argument --budget: expected a positive finite number, got 0.0"),
        (["--budget", "soon"], "argument --budget: expected a positive number, got 'soon'"),
        (["--rounds", "0"], "argument --rounds: expected a positive integer, got 0"),
        (["--batch-size", "-4"], "argument --batch-size: expected a positive integer, got -4"),
        (["--num-train", "many"], "argument --num-train: expected a positive integer, got 'many'"),
    ],
)
def test_a_bad_number_for_the_benchmark_exits_2_before_any_work(argv, expected, capsys):
    """Fails where --budget -1 is accepted (it was: the run measured nothing and exited 0)."""
    with pytest.raises(SystemExit) as exit_info:
        benchmark.main(argv)
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert expected in error and "Traceback" not in error


UPDATE_ROUNDINGS_NAMED = "Valid: nearest, stochastic, kahan"


@pytest.mark.parametrize(
    "main, argv",
    [
        (cifar.main, ["--precision", "p=bf16,update=sr"]),
        (compare.main, ["--precisions", "fp32,update=sr"]),  # the list splits at commas
        (lm.main, ["--precisions", "fp32,update=sr"]),  # the list splits at commas
        (benchmark.main, ["--precisions", "fp32,update=sr"]),  # the list splits at commas
    ],
    ids=["cifar", "compare", "lm", "benchmark"],
)
def test_a_bad_update_rounding_exits_2_naming_the_valid_ones(main, argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert "Unknown update rounding 'sr'" in error and UPDATE_ROUNDINGS_NAMED in error
    assert "Traceback" not in error


COMMANDS = {"cifar": cifar.main, "compare": compare.main, "benchmark": benchmark.main,
            "lm": lm.main, "lm.on_paper": on_paper.main}  # fmt: skip


def _help_of_each_flag(help_text: str) -> dict[str, str]:
    """A ``--help`` output's entries, keyed by each entry's first flag."""
    options = help_text.split("\noptions:\n", 1)[1]
    entries = re.split(r"\n(?=  -)", "\n" + options)
    return {entry.split()[0].rstrip(","): " ".join(entry.split()) for entry in entries if entry.strip()}


@pytest.mark.parametrize("main", COMMANDS.values(), ids=COMMANDS.keys())
def test_every_flag_of_every_command_says_its_default_in_help(main, capsys):
    """Fails for a flag whose help is silent about what happens without it (--out, --steps-per-epoch)."""
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    entries = _help_of_each_flag(capsys.readouterr().out)
    assert len(entries) > 3
    silent = [flag for flag, entry in entries.items() if flag != "-h" and not re.search(r"\bdefault\b", entry)]
    assert silent == []


@pytest.mark.parametrize("main", [cifar.main, compare.main, benchmark.main], ids=["cifar", "compare", "benchmark"])
def test_every_flag_with_a_default_shows_it_in_help(main, capsys):
    """Fails for a parser without the defaults formatter (cifar's --batch-size showed nothing)."""
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    assert "(default:" in capsys.readouterr().out
    parser = {cifar.main: cifar.build_parser, compare.main: compare.build_parser}.get(
        main, benchmark.build_parser
    )()
    assert parser.formatter_class is HelpFormatter
    formatter = HelpFormatter(parser.prog)
    for action in parser._actions:  # argparse has no public list of a parser's flags
        if action.default in (None, argparse.SUPPRESS) or isinstance(action.default, bool):
            continue  # no value to show: an optional setting or a switch
        shown = formatter._get_help_string(action) % {"default": action.default}
        assert "default" in shown, action.option_strings


@pytest.mark.parametrize("dataset", ["cifar10", "fashion_mnist"])
def test_a_file_given_as_the_data_folder_exits_1_saying_it_is_a_file(tmp_path, capsys, dataset):
    """Fails where a file passes for a folder (it did: 'nothing in it', or TFDS's own error)."""
    if dataset == "cifar10":
        pytest.importorskip("tensorflow_datasets", reason="preparing CIFAR-10 needs the experiments group")
    archive = tmp_path / "cifar-10-binary.tar.gz"
    archive.write_bytes(b"not a folder")
    argv = [*QUICK, "--dataset", dataset, "--data", "tfds", "--data-dir", str(archive)]
    exit_code, error = run_cli(argv, capsys)
    assert exit_code == 1
    assert f"--data-dir {archive} is a file, not a folder" in error
    if dataset == "cifar10":  # the archive itself: where to put it instead
        assert f"--data-dir {tmp_path / 'tensorflow_datasets'}" in error


def test_missing_cifar10_exits_1_with_the_projects_message_and_no_tfds_warning_first(
    tmp_path, offline, capsys, caplog, needs_tensorflow_datasets
):
    """Fails where TFDS's "Variant folder ... has no dataset_info.json" warning
    is logged before the project's message (it was)."""
    exit_code, error = run_cli([*QUICK, "--dataset", "cifar10", "--data", "tfds", "--data-dir",
                                str(tmp_path)], capsys)  # fmt: skip
    assert exit_code == 1
    # "is not prepared in the TFDS data dir", or without TensorFlow "is not in <its manual folder>"
    assert error.startswith("error: CIFAR-10 is not ") and "Ways forward" in error
    logged = [record.getMessage() for record in caplog.records]
    assert not [message for message in logged if "Variant folder" in message], logged


@contextlib.contextmanager
def without_permission(path):
    """Takes every permission on `path` away, also from root (who ignores modes)."""
    os.chmod(path, 0)
    is_root = os.geteuid() == 0
    if is_root:
        os.seteuid(65534)  # nobody; the real uid stays root, so this is undone below
    try:
        yield
    finally:
        if is_root:
            os.seteuid(0)
        os.chmod(path, 0o755)


@pytest.fixture
def shared_tmp():
    """A temporary folder that the unprivileged user may enter (pytest's is private to root)."""
    path = tempfile.mkdtemp(prefix="jaxamp_bad_input_")
    os.chmod(path, 0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_a_data_folder_without_permission_exits_1_naming_it(shared_tmp, capsys):
    data_dir = os.path.join(shared_tmp, "fashion")
    os.mkdir(data_dir)
    write_fashion_mnist(pathlib.Path(data_dir))
    with without_permission(data_dir):
        exit_code, error = run_cli([*QUICK, "--dataset", "fashion_mnist", "--data", "tfds", "--data-dir",
                                    data_dir], capsys)  # fmt: skip
    assert exit_code == 1 and f"No permission to read the Fashion-MNIST data folder {data_dir}" in error


def test_a_checkpoint_folder_without_permission_exits_1_naming_it(shared_tmp, capsys):
    checkpoints = os.path.join(shared_tmp, "checkpoints")
    os.mkdir(checkpoints)
    with without_permission(checkpoints):
        exit_code, error = run_cli([*QUICK, "--checkpoint-dir", checkpoints], capsys)
    assert exit_code == 1 and f"No permission to write checkpoints in {checkpoints}" in error


def test_a_checkpoint_folder_holding_other_files_exits_1_naming_them(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    exit_code, error = run_cli([*QUICK, "--checkpoint-dir", str(tmp_path)], capsys)
    assert exit_code == 1 and "holds notes.txt, which is not a checkpoint" in error


def test_a_damaged_checkpoint_exits_1_on_resume(tmp_path, capsys):
    (tmp_path / "12").mkdir()
    (tmp_path / "12" / "meta").write_text("garbage")
    exit_code, error = run_cli([*QUICK, "--checkpoint-dir", str(tmp_path), "--resume"], capsys)
    assert exit_code == 1 and f"{tmp_path / '12'} is not a readable checkpoint" in error


def test_resume_without_a_checkpoint_exits_1(tmp_path, capsys):
    exit_code, error = run_cli([*QUICK, "--checkpoint-dir", str(tmp_path), "--resume"], capsys)
    assert exit_code == 1 and "--resume found no checkpoint" in error


def test_resuming_with_another_batch_size_exits_1_naming_it(tmp_path, capsys):
    config = cifar.config_from_args(cifar.build_parser().parse_args(QUICK), model="resnet_tiny")
    state = jaxamp.TrainState.create(apply_fn=None, params={"w": jnp.ones(2)}, tx=optax.sgd(0.1))
    position = checkpointing.Position(1, 1, [0, 1], {"loss": 0.0})
    checkpointing.Checkpointer(
        str(tmp_path), checkpointing.signature(config, device_count=1), resume=False
    ).save(1, state, position, {"epochs": []})

    argv = [*QUICK[:-1], "16", "--checkpoint-dir", str(tmp_path), "--resume"]
    exit_code, error = run_cli(argv, capsys)
    assert exit_code == 1 and "--batch-size (checkpoint 8, this run 16)" in error
