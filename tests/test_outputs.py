"""What a command leaves on disk when it stops early (`experiments.outputs`).

Each command's own scenario (interrupted before its first result, nothing
left behind) is in tests/test_command_outputs.py; here the two parts alone.
"""

import os

import pytest

from experiments import outputs


def test_the_missing_folders_on_the_way_to_a_path_are_listed_outermost_first(tmp_path, monkeypatch):
    assert outputs.missing_folders(str(tmp_path / "a" / "b" / "c")) == [
        str(tmp_path / "a"), str(tmp_path / "a" / "b"), str(tmp_path / "a" / "b" / "c")
    ]  # fmt: skip
    assert outputs.missing_folders(str(tmp_path)) == []
    monkeypatch.chdir(tmp_path)
    assert outputs.missing_folders("new") == [str(tmp_path / "new")]


def test_a_failed_block_takes_back_the_folders_it_made_parents_included_and_nothing_else(tmp_path):
    (tmp_path / "kept").mkdir()
    with (
        pytest.raises(KeyboardInterrupt),
        outputs.removed_if_left_empty(
            str(tmp_path / "new" / "deep" / "ckpt"), None, str(tmp_path / "kept" / "out")
        ),
    ):
        os.makedirs(tmp_path / "new" / "deep" / "ckpt")
        os.makedirs(tmp_path / "kept" / "out")
        raise KeyboardInterrupt
    assert os.listdir(tmp_path) == ["kept"] and os.listdir(tmp_path / "kept") == []


def test_a_folder_that_holds_what_the_run_wrote_stays_with_the_folders_above_it(tmp_path):
    with pytest.raises(RuntimeError, match="late"), outputs.removed_if_left_empty(str(tmp_path / "a" / "b")):
        os.makedirs(tmp_path / "a" / "b" / "empty")
        (tmp_path / "a" / "b" / "results.json").write_text("{}")
        raise RuntimeError("failed late")
    assert sorted(os.listdir(tmp_path / "a" / "b")) == ["empty", "results.json"]


def test_a_folder_the_block_names_once_made_is_taken_back_with_its_new_parent(tmp_path):
    with pytest.raises(KeyboardInterrupt), outputs.removed_if_left_empty(str(tmp_path / "runs")) as made:
        run = tmp_path / "runs" / "lm-20260101-000000"
        os.makedirs(run)
        made.append(str(run))
        raise KeyboardInterrupt
    assert os.listdir(tmp_path) == []


def test_a_block_that_finishes_keeps_every_folder_it_made(tmp_path):
    with outputs.removed_if_left_empty(str(tmp_path / "a" / "b")) as made:
        os.makedirs(tmp_path / "a" / "b")
    assert made == [str(tmp_path / "a"), str(tmp_path / "a" / "b")]
    assert (tmp_path / "a" / "b").is_dir()


def test_a_folder_that_existed_before_the_block_is_never_removed(tmp_path):
    with pytest.raises(KeyboardInterrupt), outputs.removed_if_left_empty(str(tmp_path)) as made:
        made.append(str(tmp_path / "gone-already"))
        raise KeyboardInterrupt
    assert tmp_path.is_dir()


def test_a_file_version_changes_when_the_file_is_replaced_and_is_none_without_a_file(tmp_path):
    path = tmp_path / "results.json"
    assert outputs.file_version(str(path)) is None and outputs.file_version(None) is None
    path.write_text("{}")
    first = outputs.file_version(str(path))
    assert first == (os.stat(path).st_ino, os.stat(path).st_mtime_ns)
    assert outputs.file_version(str(path)) == first
    (tmp_path / "new").write_text("{}")
    os.replace(tmp_path / "new", path)  # as an atomic write replaces it
    assert outputs.file_version(str(path)) not in (None, first)
