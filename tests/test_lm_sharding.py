"""FSDP-sharded training of the language model gives the one-device losses.

A device count is fixed when JAX starts, so the sharded runs happen in fresh
processes: one with 8 virtual CPU devices (`eight_device_runs`, shared by the
tests below), and two processes of one device each on loopback. The runs
train the same tiny float32 model on the same synthetic batches (one more, under
mixed_bf16, shows the stated communication), so the losses of one device,
8 devices and 2 processes must agree within `RTOL`. The two processes run
`train.train_and_evaluate` after `experiments.distributed.initialize`, as the
command line does with ``--coordinator-address``, ``--num-processes`` and
``--process-id``, twice in one start (the command line takes one
``--gather-dtype`` per start).
"""

import json
import os
import subprocess

import pytest
from fresh_processes import FreshProcess, xla_flags
from jax.sharding import PartitionSpec

import jaxamp
from experiments.lm.sharding import leaf_spec

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RTOL = 1e-5  # float32, summed in another order over devices and processes
# Params gathered in bfloat16: a float32 param a hair from a rounding boundary rounds the other
# way once its gradient was summed in another order (measured: 1.1e-5 after 3 steps).
RTOL_BFLOAT16_GATHERS = 1e-4
# The 8-device process shares the suite's compilation cache (tests/conftest.py), so reruns skip
# compiling. The two processes do not: one loading from the cache while the other compiles
# outwaits gloo's 30 s rendezvous.
CACHED = {
    "JAX_COMPILATION_CACHE_DIR": os.path.join(REPO_ROOT, ".jax_cache"),
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1",
}

# Every run: 3 steps of 8 windows of 17 tokens, evaluated after each; `train.train_and_evaluate`
# with the settings below, on a `Sharding` over the devices named, printed as one JSON line.
_RUN = """
import json, sys, jax
from experiments import distributed
from experiments.lm import config, train
from experiments.lm.sharding import Sharding
TINY = dict(model="tiny", context=16, batch_size=8, steps=3, eval_every=1, eval_batches=1, data="synthetic",
            progress=False)

def run(sharding=None, **settings):
    result = train.train_and_evaluate(config.LMConfig(**{**TINY, **settings}), log=lambda line: None,
                                      sharding=sharding)
    return {"evaluations": result["evaluations"], "checksum": result["summary"]["state_checksum"],
            "collectives": result["cost"]["collectives_per_device"],
            "stated": result["cost"]["collectives_stated"],
            "flops_per_step": result["cost"]["flops_per_step"],
            "analytic_flops_per_step": result["analytic_flops_per_step"],
            "figures": {name: result["summary"].get(name)
                        for name in ("train_time_s", "steps", "achieved_tflops", "mfu", "peak_used")}}
"""

_EIGHT_DEVICES = (
    _RUN
    + """
import jaxamp
from experiments.lm import figures
figures.device_spec = lambda: jaxamp.diagnostics.gpu_spec("h200")  # a peak to divide by, as on a GPU
one = Sharding.over_devices(jax.devices()[:1])
runs = {"one": run(one), "fsdp": run()}
runs["one gather bfloat16"] = run(one, gather_dtype="bfloat16")
runs["stated mixed_bf16"] = run(precision="mixed_bf16", gather_dtype="bfloat16")
print(json.dumps(runs))
"""
)

_TWO_PROCESSES = (
    _RUN
    + """
port, index, gathers = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
distributed.initialize(f"127.0.0.1:{port}", 2, index)
assert jax.process_count() == 2 and jax.device_count() == 2
print(json.dumps({gather: run(gather_dtype=None if gather == "default" else gather) for gather in gathers}))
"""
)


def last_json_line(finished: subprocess.CompletedProcess | tuple[str, str], returncode: int) -> dict:
    stdout, stderr = (finished.stdout, finished.stderr) if hasattr(finished, "stdout") else finished
    assert returncode == 0, stderr[-3000:]
    return json.loads(stdout.strip().splitlines()[-1])


def losses(run):
    return [(entry["train_loss"], entry["held_out_loss"]) for entry in run["evaluations"]]


def assert_same_losses(runs, reference, rtol=RTOL):
    """Every evaluation's held-out loss, and train loss after step 0, within `rtol` of `reference`."""
    assert len(runs["evaluations"]) == len(reference["evaluations"]) == 4
    for entry, expected in zip(runs["evaluations"], reference["evaluations"]):
        assert entry["step"] == expected["step"]
        for name in ("held_out_loss", "train_loss") if entry["step"] else ("held_out_loss",):
            assert abs(entry[name] - expected[name]) <= rtol * abs(expected[name]), (entry, expected)


# The runs of one process with 8 virtual CPU devices: one device, all 8 (plain `jit`), one device
# gathering in bfloat16 and 8 devices under mixed_bf16 gathering in bfloat16 (reductions left at
# their default), their MFU against an H200's peaks. Started in the background while other tests
# run (tests/fresh_processes.py).
EIGHT_DEVICES = FreshProcess(
    "eight_device_runs", "-c", _EIGHT_DEVICES,
    env={**CACHED, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags("--xla_force_host_platform_device_count=8")},
    timeout=900,
)  # fmt: skip


@pytest.fixture(scope="module")
def eight_device_runs():
    finished = EIGHT_DEVICES.result()
    return last_json_line(finished, finished.returncode)


def test_a_state_array_is_split_along_its_largest_divisible_axis_or_replicated():
    assert leaf_spec((64, 256), 8) == PartitionSpec(None, "data")
    assert leaf_spec((256, 64), 8) == PartitionSpec("data")
    assert leaf_spec((3, 5), 8) == PartitionSpec()  # nothing divides: a full copy per device
    assert leaf_spec((), 8) == PartitionSpec()
    assert leaf_spec((64, 256), 1) == PartitionSpec()


def test_the_collectives_count_every_dtype_a_step_communicates_in():
    """int8 codes of 8-bit optimizer state and FP8 gathers (float8_e4m3fn) are counted with their
    bytes, beside float32 and bool; a fault reading only names of letters then digits would skip the
    FP8 gather or fail on int8's ``s8``."""
    from experiments.lm.figures import collectives

    hlo = "\n".join([
        "  %a = s8[64,256]{1,0} all-gather(s8[8,256]{1,0} %codes), dimensions={0}",
        "  %b = f8e4m3fn[16,256]{1,0} all-gather-start(f8e4m3fn[2,256]{1,0} %w), dimensions={0}",
        "  %c = f32[4]{0} all-reduce(f32[4]{0} %g), to_apply=%sum",
        "  %d = pred[7]{0} all-reduce(pred[7]{0} %f), to_apply=%and",
        "  %e = f32[8,2]{1,0} reduce-scatter(f32[64,2]{1,0} %h), dimensions={0}",
    ])  # fmt: skip
    assert collectives(hlo) == {
        "all-gather int8": {"count": 1, "result_bytes": 64 * 256},
        "all-gather float8_e4m3fn": {"count": 1, "result_bytes": 16 * 256},
        "all-reduce float32": {"count": 1, "result_bytes": 16},
        "all-reduce bool": {"count": 1, "result_bytes": 7},
        "reduce-scatter float32": {"count": 1, "result_bytes": 64},
    }


def test_eight_sharded_devices_train_like_one_device(eight_device_runs):
    """Fails if a batch row is lost or doubled across devices, or if the state is not
    actually sharded (no all-gather or reduce-scatter in the compiled step)."""
    one, fsdp = eight_device_runs["one"], eight_device_runs["fsdp"]
    assert_same_losses(fsdp, one)
    assert one["collectives"] == {}
    assert any(name.startswith("all-gather") for name in fsdp["collectives"])
    assert any(name.startswith(("reduce-scatter", "all-reduce")) for name in fsdp["collectives"])


def test_on_eight_devices_a_steps_flops_are_all_eight_programs_and_mfu_is_against_eight_peaks(
    eight_device_runs,
):
    """XLA counts the FLOPs of one device's program; a step's are the 8 devices' together: as
    many as one device's whole step, and about the analytic FLOPs per token times the tokens
    (XLA counts attention's softmax, the loss and the optimizer besides: measured 1.08 times).
    Achieved FLOP/s are the step's FLOPs over its seconds, MFU those over 8 peaks. Fails if the
    step's FLOPs are one device's (an eighth: achieved FLOP/s and MFU 8 times too low)."""
    h200 = jaxamp.diagnostics.gpu_spec("h200")
    one, fsdp = eight_device_runs["one"], eight_device_runs["fsdp"]
    assert fsdp["flops_per_step"] == pytest.approx(one["flops_per_step"], rel=0.05)
    assert 0.9 < fsdp["flops_per_step"] / fsdp["analytic_flops_per_step"] < 1.25
    figures = fsdp["figures"]
    step_s = figures["train_time_s"] / figures["steps"]
    assert figures["achieved_tflops"] == pytest.approx(fsdp["flops_per_step"] / step_s / 1e12)
    peak = h200.peak_flops[figures["peak_used"]]
    assert figures["peak_used"] == "float32"
    assert figures["mfu"] == pytest.approx(fsdp["flops_per_step"] / step_s / (8 * peak))


def test_bfloat16_gathers_move_half_the_bytes_and_gradients_are_summed_in_float32(eight_device_runs):
    """On 8 devices under mixed_bf16 with --gather-dtype bfloat16 and no --reduce-dtype, the
    program gathers every sharded param in bfloat16 and reduce-scatters its gradient in float32,
    the default (read before partitioning: XLA on CPU then widens bfloat16 collectives to
    float32, and plain jit states none, its partitioner adds float32 ones). Fails if the flag
    does not reach the program or the default reduction narrows to bfloat16."""
    plain, stated = eight_device_runs["fsdp"]["stated"], eight_device_runs["stated mixed_bf16"]["stated"]
    assert plain == {}
    assert "all-gather bfloat16" in stated and "all-gather float32" not in stated
    assert stated["reduce-scatter float32"]["count"] == stated["all-gather bfloat16"]["count"]
    assert "reduce-scatter bfloat16" not in stated
    # Half float32's bytes: each reduce-scatter's float32 output is an eighth of its param.
    assert (
        stated["all-gather bfloat16"]["result_bytes"] * 2
        == stated["reduce-scatter float32"]["result_bytes"] * 8
    )
    fp32_loss = eight_device_runs["fsdp"]["evaluations"][-1]["held_out_loss"]
    loss = eight_device_runs["stated mixed_bf16"]["evaluations"][-1]["held_out_loss"]
    assert abs(loss - fp32_loss) < 1e-2 * fp32_loss


# The two processes of one start, side by side in one background command that picks a free
# port of 127.0.0.1 for them and prints each one's exit status and output as one JSON line
# (tests/distributed_loopback_run.py does the same for the CIFAR command line).
_PAIR = """
import json, sys
from tests.distributed_loopback_run import free_port, run_side_by_side
port = str(free_port())
commands = [[sys.executable, "-c", sys.argv[1], port, str(index), *sys.argv[2:]] for index in range(2)]
print(json.dumps(run_side_by_side(commands, timeout=850)))
"""
GATHERS = ["default", "bfloat16"]
TWO_PROCESSES = FreshProcess(
    "two_process_runs", "-c", _PAIR, _TWO_PROCESSES, *GATHERS,
    env={"JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags()}, timeout=900,
)  # fmt: skip


@pytest.fixture(scope="module")
def two_process_runs():
    """What process 0 and process 1 printed last, once both exited 0."""
    return [
        last_json_line((process["stdout"], process["stderr"]), process["returncode"])
        for process in TWO_PROCESSES.last_json_line()
    ]


def test_two_processes_on_loopback_train_like_one_and_end_with_the_same_state(
    eight_device_runs, two_process_runs
):
    """Each process reads only its 4 rows of every batch of 8, and gathers params as XLA chooses
    or (with `jaxamp.fsdp.fsdp_loss`) in bfloat16. Fails if a process reads the wrong rows (the losses
    differ from one device's), the bfloat16 gathers differ across processes from one device's,
    or the processes' states diverge."""
    first, second = two_process_runs
    references = {
        "default": eight_device_runs["one"],
        "bfloat16": eight_device_runs["one gather bfloat16"],
    }
    for gather in GATHERS:
        assert_same_losses(
            first[gather], references[gather], RTOL if gather == "default" else RTOL_BFLOAT16_GATHERS
        )
        assert losses(first[gather]) == losses(second[gather])
        assert first[gather]["checksum"] == second[gather]["checksum"]
    assert "all-gather bfloat16" in first["bfloat16"]["stated"]
