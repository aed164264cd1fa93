"""Exact resume: checkpoints hold every counter, and a killed run resumes bit for bit."""

import dataclasses
import json
import os
import pathlib
import random
import shlex
import signal
import subprocess
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxamp
from experiments import cifar, train
from experiments.checkpointing import Checkpointer, CheckpointError, Position, signature

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIGNATURE = {"model": "tiny", "batch_size": 8, "device_count": 1}


def fresh_state():
    return jaxamp.TrainState.create(
        apply_fn=None,
        params={"w": jnp.ones(3)},
        tx=optax.sgd(0.1, momentum=0.9),
        loss_scale=jaxamp.DynamicLossScale(2.0**4, period=2, hysteresis=2),
    )


def position():
    return Position(epoch=1, steps_done=5, rng_key_data=[0, 1], epoch_sums={"loss": 1.5})


def test_a_restored_checkpoint_holds_every_loss_scale_field_skipped_steps_and_step_bit_identical(tmp_path):
    state = fresh_state()
    # clean, clean (the scale grows), overflow (tolerated by hysteresis), overflow (backs off), clean
    for gradient in [1.0, 1.0, np.inf, np.nan, 1.0]:
        state = state.apply_gradients(grads={"w": jnp.full(3, gradient)})
    scale = state.loss_scale
    # The state moved away from every initial value, so a lost field cannot pass unnoticed.
    assert float(scale.loss_scale) == 2.0**4 and int(scale.counter) == 1
    assert int(scale.overflows_until_backoff) == 0 and int(scale.skipped_steps) == 2
    assert int(state.skipped_steps) == 2 and int(state.step) == 3

    Checkpointer(str(tmp_path), SIGNATURE, resume=False).save(5, state, position(), {"epochs": []})
    restored, restored_position, _ = Checkpointer(str(tmp_path), SIGNATURE, resume=True).restore_latest(
        fresh_state()
    )

    for name in jaxamp.DynamicLossScale._data_fields:
        before, after = getattr(state.loss_scale, name), getattr(restored.loss_scale, name)
        assert after.dtype == before.dtype and np.array_equal(after, before), name
    for name in ("step", "skipped_steps"):
        assert getattr(restored, name).dtype == jnp.int32
        assert int(getattr(restored, name)) == int(getattr(state, name)), name
    equal = jax.tree.map(
        np.array_equal, (restored.params, restored.opt_state), (state.params, state.opt_state)
    )
    assert all(jax.tree.leaves(equal))
    assert train.state_checksum(restored) == train.state_checksum(state)
    assert restored_position == position()
    # The last skipped step (the 4th, NaN) and its leaf, as the state had them.
    assert restored.nonfinite_grads.summary() == state.nonfinite_grads.summary()
    assert restored.nonfinite_grads.summary() == "step 4 skipped: non-finite grads in 1 of 1 leaves: w"


@pytest.mark.parametrize(
    "changed, named",
    [
        ({"batch_size": 16}, "--batch-size (checkpoint 8, this run 16)"),
        ({"device_count": 2}, "the device count (checkpoint 1, this run 2)"),
        ({"model": "other"}, "--model (checkpoint 'tiny', this run 'other')"),
    ],
)
def test_a_checkpoint_made_with_other_settings_is_refused_naming_each(tmp_path, changed, named):
    Checkpointer(str(tmp_path), SIGNATURE, resume=False).save(5, fresh_state(), position(), {"epochs": []})

    with pytest.raises(CheckpointError, match="Refusing to resume") as raised:
        Checkpointer(str(tmp_path), {**SIGNATURE, **changed}, resume=True)
    assert named in str(raised.value)


def state_with_an_overflow_record():
    """`fresh_state` as a ``--record-overflow`` run holds it: with the (cleared) record of one matmul."""

    def loss(params):
        return jaxamp.autocast(lambda w: jnp.sum(jnp.ones((2, 3)) @ w), "mixed_float16")(params["w"])

    state = fresh_state()
    *_, record = jaxamp.scaled_value_and_grad(loss, state.loss_scale, record_overflow=True)(state.params)
    return state.replace(overflow_record=record.cleared())


def test_a_resume_without_record_overflow_is_refused_naming_the_flag_not_calling_the_checkpoint_unreadable(
    tmp_path,
):
    """The checkpoint of a --record-overflow run holds its overflow record, so a run without the flag
    restores into a state of another structure. Were the flag's difference not caught first, orbax's
    failure would read "cannot be read; delete that checkpoint": advice that deletes a good one."""
    recorded = train.TrainConfig(model="resnet_tiny", record_overflow=True)
    plain = dataclasses.replace(recorded, record_overflow=False)
    Checkpointer(str(tmp_path), signature(recorded, 1), resume=False).save(
        5, state_with_an_overflow_record(), position(), {"epochs": []}
    )
    with pytest.raises(CheckpointError) as raised:
        Checkpointer(str(tmp_path), signature(plain, 1), resume=True).restore_latest(fresh_state())
    assert str(raised.value) == (
        f"Refusing to resume from {tmp_path / '5'}: it was made with other settings: --record-overflow "
        "(checkpoint True, this run False). Resume with the checkpoint's settings, or start afresh in a new "
        "folder."
    )


def test_a_new_run_never_writes_into_a_folder_that_holds_another_runs_checkpoints(tmp_path):
    Checkpointer(str(tmp_path), SIGNATURE, resume=False).save(5, fresh_state(), position(), {"epochs": []})
    with pytest.raises(CheckpointError, match="pass --resume"):
        Checkpointer(str(tmp_path), SIGNATURE, resume=False)


KILLED_RUN = [
    "--model", "resnet_tiny", "--data", "synthetic", "--no-progress", "--precision", "mixed",
    "--epochs", "2", "--steps-per-epoch", "12", "--batch-size", "8", "--eval-batch-size", "8",
    "--checkpoint-every", "3", "--inject-nonfinite", "0.25",
]  # fmt: skip


def final_checksums(path):
    with open(path) as file:
        epochs = json.load(file)["epochs"]
    return [(record["epoch"], record["state_checksum"], record["train_loss"]) for record in epochs]


def test_a_run_killed_after_its_first_checkpoint_resumes_to_the_uninterrupted_final_state(tmp_path):
    # The uninterrupted run and the resumption share this process's compiled steps, and the
    # killed run loads them from the suite's compilation cache (tests/conftest.py).
    uninterrupted_out = tmp_path / "uninterrupted.json"
    common = [*KILLED_RUN, "--checkpoint-dir"]
    assert cifar.main([*common, str(tmp_path / "uninterrupted"), "--out", str(uninterrupted_out)]) == 0

    killed_dir, killed_out = tmp_path / "killed", tmp_path / "killed.json"
    process = subprocess.Popen(
        [sys.executable, "-m", "experiments.cifar", *KILLED_RUN,
         "--checkpoint-dir", str(killed_dir), "--out", str(killed_out)],
        cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        env={**os.environ, "JAX_COMPILATION_CACHE_DIR": jax.config.jax_compilation_cache_dir},
    )  # fmt: skip
    deadline = time.monotonic() + 300
    while not (killed_dir.is_dir() and any(name.isdigit() for name in os.listdir(killed_dir))):
        assert process.poll() is None, process.stderr.read().decode()
        assert time.monotonic() < deadline, "no checkpoint within 300 s"
        time.sleep(0.05)
    # An arbitrary moment after the first checkpoint; 7 more saves and 2 test passes follow,
    # so the run is still going even on a fast machine.
    time.sleep(random.uniform(0.0, 0.3))
    process.send_signal(signal.SIGKILL)
    assert process.wait() == -signal.SIGKILL, "the run finished before it could be killed"
    process.stderr.close()

    assert cifar.main([*common, str(killed_dir), "--out", str(killed_out), "--resume"]) == 0

    uninterrupted = final_checksums(uninterrupted_out)
    assert [epoch for epoch, _, _ in uninterrupted] == [1, 2]
    assert final_checksums(killed_out) == uninterrupted
    # The injected overflows moved the loss scale, so the checksum covers a scale that changed.
    assert json.loads(uninterrupted_out.read_text())["epochs"][-1]["loss_scale"] < 2.0**15


def test_an_overflow_storm_stops_the_run_and_keeps_the_last_good_checkpoint(tmp_path, capsys):
    checkpoints = tmp_path / "checkpoints"
    # A peak learning rate of 1e6 blows the weights up after the warm-up's first step;
    # every later float16 forward pass overflows, whatever the scale.
    exit_code = cifar.main(
        [*KILLED_RUN[:-2], "--lr", "1e6", "--max-consecutive-skips", "3", "--checkpoint-every", "1",
         "--checkpoint-dir", str(checkpoints)]
    )  # fmt: skip

    error = capsys.readouterr().err
    assert exit_code == 1
    assert "3 steps in a row overflowed" in error and "--precision mixed_bf16" in error and "--lr" in error
    assert "Traceback" not in error
    stopped_at = int(error.split("stopped at step ")[1].split(":")[0])
    saved = sorted(int(name) for name in os.listdir(checkpoints) if name.isdigit())
    assert saved[-1] == stopped_at - 1  # nothing saved from the step the guard fired on
    assert f"The last good checkpoint, {checkpoints / str(saved[-1])}, is kept; --resume continues" in error
    meta = json.loads((checkpoints / str(saved[-1]) / "meta" / "metadata").read_text())
    assert meta["position"]["steps_done"] == stopped_at - 1


def test_an_unreadable_state_is_reported_in_a_short_first_line_naming_the_folder_and_the_fix(tmp_path):
    """Tensorstore's message is thousands of characters of JSON on one line; it used to come first,
    with the advice at its very end. Now the advice leads, and the cause is cut short below it."""
    Checkpointer(str(tmp_path), SIGNATURE, resume=False).save(5, fresh_state(), position(), {"epochs": []})
    for folder, _, files in os.walk(tmp_path / "5" / "state"):
        for name in files:
            if os.path.basename(folder) == "d":  # the array data files
                (pathlib.Path(folder) / name).write_bytes(b"damaged")
    with pytest.raises(CheckpointError) as error_info:
        Checkpointer(str(tmp_path), SIGNATURE, resume=True).restore_latest(fresh_state())
    first, *rest = str(error_info.value).splitlines()
    assert len(first) <= 200, first
    assert first == (
        f"The state in {tmp_path / '5'} cannot be read; delete that checkpoint to resume from an earlier "
        "one, or start afresh in a new folder."
    )
    assert len(rest) == 1 and rest[0].startswith("  cause: ") and len(rest[0]) < 400


def test_ctrl_c_names_the_last_checkpoint_and_the_command_that_resumes(tmp_path):
    """SIGINT, as Ctrl-C sends it, mid-run: exit status 130, no traceback (it was 28 lines of one,
    ending in experiments/distributed.py), the newest complete checkpoint and the resume command;
    a save under way when the signal came completes first."""
    checkpoints = tmp_path / "checkpoints"
    argv = [*KILLED_RUN[:-4], "--checkpoint-every", "1", "--epochs", "4",
            "--checkpoint-dir", str(checkpoints)]  # fmt: skip
    # A shell without job control starts background commands with SIGINT ignored, and Python
    # then keeps it ignored: the command runs with Python's own Ctrl-C handler, as in a terminal.
    as_in_a_terminal = (
        "import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
        f"sys.argv = ['experiments.cifar', *{argv!r}]; "
        "runpy.run_module('experiments.cifar', run_name='__main__')"
    )
    process = subprocess.Popen(
        [sys.executable, "-c", as_in_a_terminal],
        cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "JAX_COMPILATION_CACHE_DIR": jax.config.jax_compilation_cache_dir},
    )  # fmt: skip
    deadline = time.monotonic() + 300
    while not (checkpoints.is_dir() and any(name.isdigit() for name in os.listdir(checkpoints))):
        assert process.poll() is None, process.stderr.read()
        assert time.monotonic() < deadline, "no checkpoint within 300 s"
        time.sleep(0.05)
    time.sleep(0.5)
    process.send_signal(signal.SIGINT)
    error = process.communicate(timeout=120)[1]
    assert process.returncode == 130, error
    messages = [line for line in error.splitlines() if not line.startswith(("WARNING", "I0000"))]
    assert "Traceback" not in error and len(messages) == 1, error
    latest = max(int(name) for name in os.listdir(checkpoints) if name.isdigit())
    assert messages[0] == (
        f"interrupted; the last checkpoint kept is {checkpoints / str(latest)}. Resume with: "
        f"python -m experiments.cifar {shlex.join([*argv, '--resume'])}"
    )
    assert not [name for name in os.listdir(checkpoints) if not name.isdigit()], "a save left unfinished"


def test_ctrl_c_while_the_train_step_compiles_exits_130_with_the_message_not_a_crash(tmp_path):
    """SIGINT while XLA compiles: jaxlib raises KeyboardInterrupt in the waiting thread while the
    compilation goes on in XLA's, and the interpreter's teardown under it crashed (exit status -11,
    a segmentation fault, after the message). The command ends at once instead, with 130."""
    checkpoints = tmp_path / "checkpoints"
    argv = [*KILLED_RUN, "--checkpoint-dir", str(checkpoints)]
    # The signal is sent 0.1 s into the train step's compilation, which takes seconds.
    interrupted_while_compiling = textwrap.dedent(f"""
        import os, runpy, signal, sys, threading
        import jax
        signal.signal(signal.SIGINT, signal.default_int_handler)
        compile_program = jax.stages.Lowered.compile

        def compile_and_interrupt(lowered, *args, **kwargs):
            if "jit_train_step" in lowered.as_text().split("\\n", 1)[0]:
                threading.Timer(0.1, os.kill, (os.getpid(), signal.SIGINT)).start()
            return compile_program(lowered, *args, **kwargs)

        jax.stages.Lowered.compile = compile_and_interrupt
        sys.argv = ["experiments.cifar", *{argv!r}]
        runpy.run_module("experiments.cifar", run_name="__main__")
    """)
    process = subprocess.run(
        [sys.executable, "-c", interrupted_while_compiling],
        check=False, cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        timeout=300, env={**os.environ, "JAX_ENABLE_COMPILATION_CACHE": "false"},
    )  # fmt: skip
    messages = [line for line in process.stderr.splitlines() if not line.startswith(("WARNING", "I0000"))]
    assert process.returncode == 130, process.stderr
    assert not checkpoints.exists()  # created for the run, left empty: removed
    assert messages == [
        (
            f"interrupted before the first checkpoint in {checkpoints}; nothing to resume. Run the same "
            "command again to start afresh."
        )
    ], process.stderr


@pytest.mark.parametrize("existed_before", [False, True], ids=["made by the run", "made before"])
def test_a_run_stopped_before_its_first_checkpoint_leaves_no_folder_it_made(
    existed_before, tmp_path, monkeypatch, capsys
):
    """The folder the run created is removed while empty; one the user made is kept."""
    checkpoints = tmp_path / "checkpoints"
    if existed_before:
        checkpoints.mkdir()

    def stopped_before_the_first_checkpoint(config):
        os.makedirs(config.checkpoint_dir, exist_ok=True)  # as the checkpoint manager does
        raise KeyboardInterrupt

    monkeypatch.setattr(train, "train_and_evaluate", stopped_before_the_first_checkpoint)
    assert cifar.main([*KILLED_RUN[:-4], "--checkpoint-dir", str(checkpoints)]) == 130
    assert "interrupted before the first checkpoint" in capsys.readouterr().err
    assert checkpoints.exists() == existed_before


@pytest.mark.parametrize(
    "extra, expected",
    [
        ([], "interrupted; no checkpoint was kept (no --checkpoint-dir). To be able to resume"),
        (["--checkpoint-dir", "{tmp}/empty"], ("interrupted before the first checkpoint in {tmp}/empty; "
                                               "nothing to resume. Run the same command again")),
    ],
)  # fmt: skip
def test_ctrl_c_before_any_checkpoint_says_there_is_nothing_to_resume(
    extra, expected, tmp_path, monkeypatch, capsys
):
    def interrupted(config):
        raise KeyboardInterrupt

    monkeypatch.setattr(train, "train_and_evaluate", interrupted)
    extra = [item.format(tmp=tmp_path) for item in extra]
    assert cifar.main([*KILLED_RUN[:-4], *extra]) == 130
    error = capsys.readouterr().err
    assert error.startswith(expected.format(tmp=tmp_path)) and "Traceback" not in error
