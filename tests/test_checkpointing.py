"""The checkpoint folder and its messages (`experiments.checkpointing`), part by part.

The scenarios of a whole run (a resume bit for bit, a resume refused naming
the setting that differs, Ctrl-C and an overflow storm) are in
tests/test_resume.py; here what each part decides and says.
"""

import os

import jax.numpy as jnp
import optax
import pytest

import jaxamp
from experiments import checkpointing, train
from experiments.checkpointing import Checkpointer, CheckpointError, Position

SIGNATURE = {"model": "tiny", "batch_size": 8, "device_count": 1}


def state():
    return jaxamp.TrainState.create(apply_fn=None, params={"w": jnp.ones(2)}, tx=optax.sgd(0.1))


def position():
    return Position(epoch=2, steps_done=3, rng_key_data=[0, 7], epoch_sums={"loss": 0.5})


def refusal(function, *args, **kwargs) -> str:
    with pytest.raises(CheckpointError) as raised:
        function(*args, **kwargs)
    return str(raised.value)


def test_the_latest_checkpoint_is_the_highest_step_folder_not_the_last_in_name_order(tmp_path):
    for name in ("9", "10", "2", "11.orbax-checkpoint-tmp-1", "notes", "x10"):
        (tmp_path / name).mkdir()
    assert checkpointing.latest_checkpoint(str(tmp_path)) == os.path.join(str(tmp_path), "10")


def test_there_is_no_latest_checkpoint_in_a_missing_or_stepless_folder(tmp_path):
    assert checkpointing.latest_checkpoint(str(tmp_path / "missing")) is None
    (tmp_path / "12.orbax-checkpoint-tmp-3").mkdir()
    assert checkpointing.latest_checkpoint(str(tmp_path)) is None


def test_a_new_or_missing_folder_is_usable_and_nothing_is_made(tmp_path):
    checkpointing.check_folder_usable(str(tmp_path))
    checkpointing.check_folder_usable(str(tmp_path / "new" / "deep"))
    assert os.listdir(tmp_path) == []


def test_a_folder_of_this_experiments_checkpoints_is_usable(tmp_path):
    for name in ("3", "6", "9.orbax-checkpoint-tmp-12"):
        (tmp_path / name).mkdir()
    checkpointing.check_folder_usable(str(tmp_path))


def test_a_file_given_as_the_folder_is_refused_naming_it(tmp_path):
    (tmp_path / "ckpt").write_text("")
    assert refusal(checkpointing.check_folder_usable, str(tmp_path / "ckpt")) == (
        f"--checkpoint-dir {tmp_path / 'ckpt'} is a file, not a folder; name a folder."
    )


def test_a_folder_holding_other_files_is_refused_naming_the_first_five(tmp_path):
    for name in ("3", "a", "b", "c", "d", "e", "f", "3.orbax-checkpoint-tmp"):
        (tmp_path / name).mkdir()
    assert refusal(checkpointing.check_folder_usable, str(tmp_path)) == (
        f"--checkpoint-dir {tmp_path} holds a, b, c, d, e ..., which is not a checkpoint of this experiment; "
        "name an empty or new folder, or one that only this experiment's checkpoints use."
    )
    (tmp_path / "f").rmdir()
    assert "holds a, b, c, d, e, which is not" in refusal(checkpointing.check_folder_usable, str(tmp_path))


def test_a_folder_without_permission_is_refused_naming_the_folder_checked(tmp_path, monkeypatch):
    asked = []

    def access(path, mode, *, effective_ids=False):
        asked.append((path, mode, effective_ids))
        return False

    monkeypatch.setattr(os, "access", access)
    assert refusal(checkpointing.check_folder_usable, str(tmp_path)) == (
        f"No permission to write checkpoints in {tmp_path}; choose a folder you can write to, or fix its "
        "permissions."
    )
    new = tmp_path / "a" / "b"
    assert refusal(checkpointing.check_folder_usable, str(new)) == (
        f"No permission to write checkpoints in {tmp_path} (to create {new}); choose a folder you can write "
        "to, or fix its permissions."
    )
    everything = os.R_OK | os.W_OK | os.X_OK
    assert asked == [(str(tmp_path), everything, True), (str(tmp_path), everything, True)]
    assert checkpointing._EFFECTIVE_IDS is True


def test_a_run_signature_holds_every_setting_that_changes_a_step_and_the_device_count():
    config = train.TrainConfig(model="resnet_tiny", record_overflow=True, lr=0.5)
    signature = checkpointing.signature(config, device_count=4)
    assert set(signature) == set(checkpointing.SIGNATURE_FIELDS)
    assert signature["device_count"] == 4 and signature["record_overflow"] is True and signature["lr"] == 0.5
    assert all(signature[name] == getattr(config, name) for name in signature if name != "device_count")


def test_a_saved_checkpoint_is_named_by_its_step_and_restores_its_position_and_results(tmp_path):
    Checkpointer(str(tmp_path), SIGNATURE, resume=False).save(
        7, state(), position(), {"epochs": [{"epoch": 1}]}
    )
    assert checkpointing.latest_checkpoint(str(tmp_path)) == os.path.join(str(tmp_path), "7")
    resumed = Checkpointer(str(tmp_path), SIGNATURE, resume=True)
    assert resumed.latest_step() == 7 and resumed.directory == str(tmp_path)
    _, restored_position, results = resumed.restore_latest(state())
    assert restored_position == position() and results == {"epochs": [{"epoch": 1}]}


def test_resuming_an_existing_folder_without_checkpoints_is_refused(tmp_path):
    assert refusal(Checkpointer, str(tmp_path), SIGNATURE, resume=True) == (
        f"--resume found no checkpoint in {tmp_path}; run without --resume to start afresh, or name the "
        "folder of the run to continue."
    )


def test_a_checkpoint_whose_meta_lacks_its_position_is_unreadable_naming_it(tmp_path):
    checkpointer = Checkpointer(str(tmp_path), SIGNATURE, resume=False)
    checkpointer._manager.save(
        4,
        args=checkpointing.ocp.args.Composite(meta=checkpointing.ocp.args.JsonSave({"signature": SIGNATURE})),
    )
    checkpointer._manager.wait_until_finished()
    first, cause = refusal(Checkpointer, str(tmp_path), SIGNATURE, resume=True).splitlines()
    assert first == (
        f"{tmp_path / '4'} is not a readable checkpoint of this experiment; delete it to resume from an "
        "earlier one, or start afresh in a new folder."
    )
    assert cause == "  cause: KeyError: 'signature or position'"


def test_a_refusal_names_every_setting_that_differs(tmp_path):
    Checkpointer(str(tmp_path), SIGNATURE, resume=False).save(5, state(), position(), {"epochs": []})
    other = {**SIGNATURE, "batch_size": 16, "lr": 0.2}
    assert refusal(Checkpointer, str(tmp_path), other, resume=True) == (
        f"Refusing to resume from {tmp_path / '5'}: it was made with other settings: --batch-size "
        "(checkpoint 8, this run 16); --lr (checkpoint None, this run 0.2). Resume with the checkpoint's "
        "settings, or start afresh in a new folder."
    )


def test_the_cause_of_an_unreadable_checkpoint_is_one_line_cut_at_300_characters():
    long = ValueError("x" * 150 + "\n  " + "y" * 200)
    assert checkpointing._cause(long) == "  cause: ValueError: " + "x" * 150 + " " + "y" * 149 + " ..."
    assert checkpointing._cause(OSError("short")) == "  cause: OSError: short"
    assert len(checkpointing._cause(ValueError("z" * 300))) == len("  cause: ValueError: ") + 300


def test_the_saved_parts_are_the_state_that_changes_with_the_skipped_steps_attribution():
    plain = state()
    assert set(checkpointing.saved_parts(plain)) == {
        "step", "params", "opt_state", "batch_stats", "loss_scale", "nonfinite_grads"
    }  # fmt: skip
    assert checkpointing.saved_parts(plain)["params"] is plain.params
    assert "nonfinite_grads" not in checkpointing.saved_parts(plain.replace(nonfinite_grads=None))
    recorded = plain.replace(overflow_record=plain.nonfinite_grads)  # any pytree stands for the record
    assert checkpointing.saved_parts(recorded)["overflow_record"] is plain.nonfinite_grads
