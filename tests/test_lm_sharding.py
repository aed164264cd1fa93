"""FSDP-sharded training of the language model gives the one-device losses.

A device count is fixed when JAX starts, so the sharded runs happen in one
fresh process with 8 virtual CPU devices: the same tiny fp32 run on a mesh
of one device and on all 8 with the state sharded, compared there.
"""

import json
import os
import subprocess
import sys

import pytest
from jax.sharding import PartitionSpec

import jaxamp
from experiments.lm.sharding import leaf_spec

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RTOL = 1e-5
EIGHT_DEVICES = {
    **os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"
}

_SCRIPT = """
import json, jax
from experiments.lm import config, train
from experiments.lm.sharding import Sharding
settings = config.LMConfig(model="tiny", precision="fp32", context=16, batch_size=8, steps=3, eval_every=1,
                           eval_batches=1, data="synthetic", progress=False)
runs = {}
meshes = (("one", Sharding.over_devices(jax.devices()[:1])), ("fsdp", Sharding.over_all_devices()))
for name, sharding in meshes:
    run = train.train_and_evaluate(settings, log=lambda line: None, sharding=sharding)
    runs[name] = {"evaluations": run["evaluations"], "collectives": run["cost"]["collectives_per_device"],
                  "checksum": run["summary"]["state_checksum"]}
print(json.dumps(runs))
"""


def test_a_state_array_is_split_along_its_largest_divisible_axis_or_replicated():
    assert leaf_spec((64, 256), 8) == PartitionSpec(None, "data")
    assert leaf_spec((256, 64), 8) == PartitionSpec("data")
    assert leaf_spec((3, 5), 8) == PartitionSpec()  # nothing divides: a full copy per device
    assert leaf_spec((), 8) == PartitionSpec()
    assert leaf_spec((64, 256), 1) == PartitionSpec()


def test_eight_sharded_devices_train_like_one_device():
    """Fails if a batch row is lost or doubled across devices, or if the state is not
    actually sharded (no all-gather or reduce-scatter in the compiled step)."""
    finished = subprocess.run(
        [sys.executable, "-c", _SCRIPT],
        cwd=REPO_ROOT, env=EIGHT_DEVICES, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert finished.returncode == 0, finished.stderr[-3000:]
    runs = json.loads(finished.stdout.strip().splitlines()[-1])
    one, fsdp = runs["one"], runs["fsdp"]
    assert len(one["evaluations"]) == len(fsdp["evaluations"]) == 4
    for single, sharded in zip(one["evaluations"], fsdp["evaluations"]):
        assert abs(sharded["held_out_loss"] - single["held_out_loss"]) <= RTOL * abs(single["held_out_loss"])
        if single["step"]:
            assert abs(sharded["train_loss"] - single["train_loss"]) <= RTOL * abs(single["train_loss"])
    assert one["collectives"] == {}
    assert any(name.startswith("all-gather") for name in fsdp["collectives"])
    assert any(name.startswith(("reduce-scatter", "all-reduce")) for name in fsdp["collectives"])


_COMMUNICATION_SCRIPT = """
import json, jax
from experiments.lm import config, train
runs = {}
for name, gather, reduce in (("xla", None, None), ("stated", "bfloat16", "float32")):
    settings = config.LMConfig(model="tiny", precision="mixed_bf16", context=16, batch_size=8, steps=2,
                               eval_every=2, eval_batches=1, data="synthetic", progress=False,
                               gather_dtype=gather, reduce_dtype=reduce)
    run = train.train_and_evaluate(settings, log=lambda line: None)
    runs[name] = {"collectives": run["cost"]["collectives_stated"],
                  "loss": run["evaluations"][-1]["held_out_loss"]}
print(json.dumps(runs))
"""


@pytest.mark.skipif(not hasattr(jaxamp, "fsdp_loss"), reason="this jaxamp has no jaxamp.fsdp_loss")
def test_bfloat16_gathers_move_half_the_bytes_and_gradients_are_summed_in_float32():
    """On 8 devices under mixed_bf16 with --gather-dtype bfloat16 --reduce-dtype float32, the
    program gathers every sharded param in bfloat16 and reduce-scatters its gradient in float32
    (read before partitioning: XLA on CPU then widens bfloat16 collectives to float32, and
    plain jit states none, its partitioner adds float32 ones). Fails if the flags do not
    reach the program."""
    finished = subprocess.run(
        [sys.executable, "-c", _COMMUNICATION_SCRIPT],
        cwd=REPO_ROOT, env=EIGHT_DEVICES, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert finished.returncode == 0, finished.stderr[-3000:]
    runs = json.loads(finished.stdout.strip().splitlines()[-1])
    plain, stated = runs["xla"]["collectives"], runs["stated"]["collectives"]
    assert plain == {}
    assert "all-gather bfloat16" in stated and "all-gather float32" not in stated
    assert stated["reduce-scatter float32"]["count"] == stated["all-gather bfloat16"]["count"]
    assert "reduce-scatter bfloat16" not in stated
    assert abs(runs["stated"]["loss"] - runs["xla"]["loss"]) < 1e-2 * runs["xla"]["loss"]


def test_two_processes_on_loopback_train_like_one_and_end_with_the_same_state(tmp_path, capsys):
    """Each process reads only its 4 rows of every batch of 8; fails if a process reads the
    wrong rows (the losses differ from one process's) or the processes' states diverge."""
    import random

    from experiments.lm import __main__ as lm_cli

    flags = [
        "--model", "tiny", "--precisions", "fp32", "--context", "16", "--batch-size", "8", "--steps", "3",
        "--eval-every", "1", "--eval-batches", "1", "--data", "synthetic", "--no-progress",
    ]  # fmt: skip
    port = random.randint(20000, 40000)
    environment = {**os.environ, "JAX_PLATFORMS": "cpu"}
    processes = [
        subprocess.Popen(
            [sys.executable, "-m", "experiments.lm", *flags, "--coordinator-address", f"127.0.0.1:{port}",
             "--num-processes", "2", "--process-id", str(index), "--out-dir", str(tmp_path / "two")],
            cwd=REPO_ROOT, env=environment, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        for index in range(2)
    ]
    outputs = [process.communicate(timeout=900) for process in processes]
    for process, (_, stderr) in zip(processes, outputs):
        assert process.returncode == 0, stderr[-3000:]
    assert lm_cli.main([*flags, "--out-dir", str(tmp_path / "one")]) == 0
    single = capsys.readouterr().out

    def evaluation_lines(text):
        # Each evaluation line without its timing: step, train and held-out loss, loss scale, skips.
        lines = [line for line in text.splitlines() if line.startswith("step ")]
        return [line.split("| train")[0] + line.split("s loss")[1] for line in lines]

    first, second = (stdout for stdout, _ in outputs)
    assert evaluation_lines(first) == evaluation_lines(single) != []
    checksums = [line.split()[-1] for line in (first + second).splitlines() if "state checksum" in line]
    assert len(checksums) == 2 and checksums[0] == checksums[1]
