"""Data parallel over several devices and several processes gives the one-device result.

Each run here is a fresh JAX process (a device count is fixed when JAX
starts), so the file is small: one reference run in this process, one run on
two devices of one process, and one run of two processes on loopback.
"""

import json
import os
import re
import socket
import subprocess
import sys

import pytest

from experiments import cifar

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# float32 at the highest matmul precision, so the only difference between
# the runs is the order of the cross-device sums: losses agree to RTOL.
RUN = [
    "--model", "resnet_tiny", "--data", "synthetic", "--no-progress", "--precision", "fp32",
    "--epochs", "1", "--steps-per-epoch", "3", "--batch-size", "8", "--eval-batch-size", "8",
]  # fmt: skip
RTOL = 1e-5


def run_experiment(extra, devices=1, **popen):
    environment = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
    return subprocess.Popen(
        [sys.executable, "-m", "experiments.cifar", *RUN, *extra],
        cwd=REPO_ROOT, env=environment, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen,
    )  # fmt: skip


def finish(process):
    stdout, stderr = process.communicate(timeout=600)
    assert process.returncode == 0, stderr
    return stdout


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
    out = tmp_path_factory.mktemp("one_device") / "run.json"
    assert cifar.main([*RUN, "--out", str(out)]) == 0
    return json.loads(out.read_text())["epochs"][0]


def assert_same_training(epoch, reference):
    assert epoch["train_loss"] == pytest.approx(reference["train_loss"], rel=RTOL)
    assert epoch["test_loss"] == pytest.approx(reference["test_loss"], rel=RTOL)
    assert epoch["skipped_steps"] == reference["skipped_steps"] == 0


def test_two_devices_of_one_process_train_like_one_device_and_reject_an_indivisible_batch(
    tmp_path, one_device
):
    out = tmp_path / "run.json"
    finish(run_experiment(["--out", str(out)], devices=2))
    results = json.loads(out.read_text())

    assert results["environment"]["device_count"] == 2
    assert_same_training(results["epochs"][0], one_device)

    rejected = run_experiment(["--batch-size", "7"], devices=2)
    _, stderr = rejected.communicate(timeout=300)
    assert rejected.returncode == 1
    assert "--batch-size 7 does not split over 2 devices" in stderr and "Traceback" not in stderr


def free_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_two_processes_on_loopback_end_identical_train_like_one_process_and_checkpoint(
    tmp_path, one_device
):
    address = f"127.0.0.1:{free_port()}"
    outs = [tmp_path / f"process{index}.json" for index in range(2)]
    checkpoints = tmp_path / "checkpoints"
    processes = [
        run_experiment(
            ["--coordinator-address", address, "--num-processes", "2", "--process-id", str(index),
             "--out", str(outs[index]), "--checkpoint-dir", str(checkpoints), "--checkpoint-every", "2"]
        )  # fmt: skip
        for index in range(2)
    ]
    stdouts = [finish(process) for process in processes]

    epoch_line = re.compile(r"\[process \d\] epoch +1/1 .* state ([0-9a-f]{12})")
    checksums = [epoch_line.findall(stdout) for stdout in stdouts]
    assert len(checksums[0]) == 1 and checksums[0] == checksums[1]
    assert not outs[1].exists()  # only process 0 writes results
    results = json.loads(outs[0].read_text())
    assert (results["environment"]["process_count"], results["environment"]["device_count"]) == (2, 2)
    assert_same_training(results["epochs"][0], one_device)
    # orbax's multi-process save: both processes call it, one complete checkpoint per save
    assert sorted(os.listdir(checkpoints)) == ["2", "3"]
    assert all((checkpoints / step / "commit_success.txt").exists() for step in ("2", "3"))
