"""Data parallel over several devices and several processes gives the one-device result.

Each run here is a fresh JAX process (a device count is fixed when JAX
starts), so the file is small: one reference run in this process, one run on
two devices of one process, and one run of two processes on loopback; the
last two start in the background once the tests are collected.
"""

import json
import os
import pathlib
import re

import pytest
from fresh_processes import FreshProcess, xla_flags

from experiments import cifar

# float32 at the highest matmul precision, so the only difference between
# the runs is the order of the cross-device sums: losses agree to RTOL.
RUN = [
    "--model", "resnet_tiny", "--data", "synthetic", "--no-progress", "--precision", "fp32",
    "--epochs", "1", "--steps-per-epoch", "3", "--batch-size", "8", "--eval-batch-size", "8",
]  # fmt: skip
RTOL = 1e-5


def devices_flag(devices):
    return {"XLA_FLAGS": xla_flags(f"--xla_force_host_platform_device_count={devices}")}


# The runs on two devices start in the background as soon as the tests are
# collected (tests/fresh_processes.py), while this process makes the reference.
TWO_DEVICES = FreshProcess(
    "two_devices", "-m", "experiments.cifar", *RUN, "--out", "{dir}/run.json", env=devices_flag(2), timeout=600
)
INDIVISIBLE_BATCH = FreshProcess(
    "indivisible_batch", "-m", "experiments.cifar", *RUN, "--batch-size", "7", env=devices_flag(2), timeout=300
)


@pytest.fixture
def two_devices():
    process = TWO_DEVICES.result()
    assert process.returncode == 0, process.stderr
    with open(os.path.join(TWO_DEVICES.directory, "run.json"), encoding="utf-8") as results:
        return json.load(results)


@pytest.fixture
def indivisible_batch():
    return INDIVISIBLE_BATCH.result()


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
    two_devices, indivisible_batch, one_device
):
    assert two_devices["environment"]["device_count"] == 2
    assert_same_training(two_devices["epochs"][0], one_device)

    assert indivisible_batch.returncode == 1
    stderr = indivisible_batch.stderr
    assert "--batch-size 7 does not split over 2 devices" in stderr and "Traceback" not in stderr


# The two processes run side by side in one background command
# (tests/distributed_loopback_run.py), which picks the port as it starts them.
LOOPBACK = FreshProcess(
    "loopback", "tests/distributed_loopback_run.py", "{dir}", *RUN, env=devices_flag(1), timeout=900
)


@pytest.fixture
def loopback():
    """The standard output of process 0 and process 1, and the folder they wrote into."""
    processes = LOOPBACK.last_json_line()
    for process in processes:
        assert process["returncode"] == 0, process["stderr"]
    return [process["stdout"] for process in processes], pathlib.Path(LOOPBACK.directory)


def test_two_processes_on_loopback_end_identical_train_like_one_process_and_checkpoint(loopback, one_device):
    stdouts, directory = loopback
    outs = [directory / f"process{index}.json" for index in range(2)]
    checkpoints = directory / "checkpoints"

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
