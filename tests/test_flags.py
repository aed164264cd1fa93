"""The commands' shared flag parts (`experiments.flags`): types that refuse bad values naming them,
help that shows every default, errors that name the nearest valid name.

What a user meets through a whole command is in tests/test_bad_input.py and
tests/test_command_outputs.py; here each part on its own, as argparse calls it.
"""

import argparse
import os

import pytest

from experiments import flags


def refusal(parse, text) -> str:
    with pytest.raises(argparse.ArgumentTypeError) as raised:
        parse(text)
    return str(raised.value)


@pytest.mark.parametrize(
    "text, expected",
    [("1", 1), ("7", 7), (" 3 ", 3)],
)
def test_a_positive_integer_is_read_as_one(text, expected):
    assert flags.positive_int(text) == expected


@pytest.mark.parametrize(
    "parse, text, message",
    [
        (flags.positive_int, "0", "expected a positive integer, got 0"),
        (flags.positive_int, "1.5", "expected a positive integer, got '1.5'"),
        (flags.non_negative_int, "-1", "expected an integer >= 0, got -1"),
        (flags.integer_at_least(2, "an integer >= 2"), "1", "expected an integer >= 2, got 1"),
        (flags.positive_float, "0", "expected a positive finite number, got 0.0"),
        (flags.positive_float, "inf", "expected a positive finite number, got inf"),
        (flags.positive_float, "nan", "expected a positive finite number, got nan"),
        (flags.positive_float, "fast", "expected a positive number, got 'fast'"),
        (flags.fraction_below_one, "1", "expected a number in [0, 1), got 1.0"),
        (flags.fraction_below_one, "-0.5", "expected a number in [0, 1), got -0.5"),
        (flags.fraction_below_one, "half", "expected a number in [0, 1), got 'half'"),
    ],
)
def test_a_bad_number_is_refused_naming_it_and_what_is_expected(parse, text, message):
    assert refusal(parse, text) == message


def test_the_edges_of_each_number_type_are_accepted():
    assert flags.non_negative_int("0") == 0
    assert flags.integer_at_least(2, "an integer >= 2")("2") == 2
    assert flags.positive_float("1e-9") == 1e-9
    assert flags.fraction_below_one("0") == 0.0
    assert flags.fraction_below_one("0.999") == 0.999


def test_a_comma_list_is_split_trimmed_lowered_and_each_item_checked():
    seen = []
    parse = flags.comma_list(["fp32", "mixed"], validate=seen.append, what="precision")
    assert parse(" FP32, mixed ,") == ["fp32", "mixed"]
    assert seen == ["fp32", "mixed"]
    assert refusal(parse, "fp32,mixd") == (
        "unknown precision 'mixd'. Did you mean mixed? Choose one of: fp32, mixed"
    )
    assert refusal(parse, " , ") == "expected a comma-separated list, got nothing"
    assert flags.comma_list(None)("anything,else") == ["anything", "else"]


def test_a_comma_list_names_its_items_as_choices_by_default():
    assert refusal(flags.comma_list(["a"]), "b").startswith("unknown choice 'b'.")


def test_one_of_takes_a_name_in_any_case_and_refuses_another_naming_the_nearest():
    parse = flags.one_of(["resnet18", "resnet34", "mobilenetv2"], "model")
    assert parse(" ResNet18 ") == "resnet18"
    assert refusal(parse, "resnet19") == (
        "unknown model 'resnet19'. Did you mean resnet18? Choose one of: resnet18, resnet34, mobilenetv2"
    )
    assert refusal(parse, "vgg") == "unknown model 'vgg'. Choose one of: resnet18, resnet34, mobilenetv2"


def test_an_unknown_name_with_a_listing_lists_it_on_lines_of_its_own():
    message = flags.unknown_name("precision", "Mix d", ["mixed", "fp32"], "  a: mixed\n  b: fp32")
    assert message == "unknown precision 'Mix d'. Did you mean mixed? Choose one of:\n  a: mixed\n  b: fp32"


def test_a_parser_error_shows_a_one_line_usage_and_the_error(capsys):
    parser = flags.ArgumentParser(prog="python -m experiments.x")
    parser.add_argument("--steps", type=flags.positive_int, default=1)
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args(["--steps", "0"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == (
        "usage: python -m experiments.x [flags]  (--help lists them, with their defaults)\n"
        "python -m experiments.x: error: argument --steps: expected a positive integer, got 0\n"
    )


def test_a_parser_with_its_own_usage_shows_that_one():
    parser = flags.ArgumentParser(prog="python -m experiments.measure", usage="%(prog)s NAME [flags]")
    assert parser.format_usage() == (
        "usage: python -m experiments.measure NAME [flags]  (--help lists them, with their defaults)\n"
    )


def test_help_shows_each_default_once_and_off_for_a_switch():
    parser = argparse.ArgumentParser()
    cases = {
        "--steps": ({"type": int, "default": 5, "help": "steps"}, "steps (default: %(default)s)"),
        "--names": ({"default": ["a", "b"], "help": "names"}, "names (default: a,b)"),
        "--fast": ({"action": "store_true", "help": "go fast"}, "go fast (default: off)"),
        "--bare": ({"action": "store_true"}, "(default: off)"),
        "--named": ({"default": 3, "help": "named (default: three)"}, "named (default: three)"),
        "--shown": ({"default": 4, "help": "shown (%(default)s)"}, "shown (%(default)s)"),
        "--optional": ({"default": None, "help": "optional"}, "optional"),
        "--quiet": ({"action": "store_true", "help": "quiet (default: loud)"}, "quiet (default: loud)"),
        "--unsaid": ({"default": argparse.SUPPRESS, "help": "unsaid"}, "unsaid"),
        "--plain": ({"default": False, "help": "plain"}, "plain"),
        "input": ({"default": "x", "nargs": "?", "help": "input"}, "input"),
    }
    formatter = flags.HelpFormatter("prog")
    for flag, (settings, shown) in cases.items():
        action = parser.add_argument(flag, **settings)
        assert formatter._get_help_string(action) == shown, flag


def test_the_process_flags_default_to_one_process():
    parser = argparse.ArgumentParser()
    flags.add_process_flags(parser)
    args = parser.parse_args([])
    assert (args.coordinator_address, args.num_processes, args.process_id) == (None, None, None)
    args = parser.parse_args(["--coordinator-address", "h:1", "--num-processes", "2", "--process-id", "0"])
    assert (args.coordinator_address, args.num_processes, args.process_id) == ("h:1", 2, 0)
    with pytest.raises(SystemExit):
        parser.parse_args(["--num-processes", "0"])


def test_an_output_file_that_may_be_written_is_accepted_and_nothing_is_made(tmp_path):
    existing = tmp_path / "results.json"
    existing.write_text("{}")
    assert flags.output_file(str(existing)) == str(existing)
    new = tmp_path / "new" / "deeper" / "results.json"
    assert flags.output_file(str(new)) == str(new)
    assert sorted(os.listdir(tmp_path)) == ["results.json"]


def test_an_output_file_that_is_a_directory_or_under_a_file_is_refused(tmp_path):
    assert refusal(flags.output_file, str(tmp_path)) == (
        f"{tmp_path} is a directory, not a file; name a file, e.g. {tmp_path / 'results.json'}"
    )
    (tmp_path / "notes").write_text("")
    under = tmp_path / "notes" / "run" / "results.json"
    assert refusal(flags.output_file, str(under)) == (
        f"cannot create {under}: {tmp_path / 'notes'} is a file, not a directory; choose a file path that "
        "does not pass through a file"
    )


def test_an_output_directory_that_exists_or_can_be_made_is_accepted_and_a_file_refused(tmp_path):
    assert flags.output_directory(str(tmp_path)) == str(tmp_path)
    assert flags.output_directory(str(tmp_path / "a" / "b")) == str(tmp_path / "a" / "b")
    (tmp_path / "table.md").write_text("")
    assert refusal(flags.output_directory, str(tmp_path / "table.md")) == (
        f"{tmp_path / 'table.md'} is a file, not a directory; name a directory"
    )
    assert refusal(flags.output_directory, str(tmp_path / "table.md" / "x")) == (
        f"cannot create {tmp_path / 'table.md' / 'x'}: {tmp_path / 'table.md'} is a file, not a directory; "
        "choose a directory path that does not pass through a file"
    )
    assert os.listdir(tmp_path) == ["table.md"]


def test_the_path_checks_ask_for_write_and_search_permission_as_this_process_may(tmp_path, monkeypatch):
    """What `os.access` is asked (the mode and the effective ids): permission bits do not stop root,
    so the answers are recorded here; tests/test_command_outputs.py checks them as another user."""
    assert flags._EFFECTIVE_IDS is (os.access in os.supports_effective_ids)
    asked = []

    def access(path, mode, *, effective_ids=False):
        asked.append((os.path.basename(path), mode, effective_ids))
        return False

    monkeypatch.setattr(os, "access", access)
    (tmp_path / "dir").mkdir()
    (tmp_path / "file.json").write_text("{}")
    assert refusal(flags.output_directory, str(tmp_path / "dir")) == (
        f"no permission to write in {tmp_path / 'dir'}; name a directory you can write to, or fix its "
        "permissions"
    )
    assert refusal(flags.output_file, str(tmp_path / "file.json")) == (
        f"no permission to write {tmp_path / 'file.json'}; name another file, or fix its permissions"
    )
    assert refusal(flags.output_file, str(tmp_path / "new.json")) == (
        f"cannot create {tmp_path / 'new.json'}: no permission to write in {tmp_path}; name a file in a "
        "directory you can write to"
    )
    wx = os.W_OK | os.X_OK
    assert asked == [("dir", wx, flags._EFFECTIVE_IDS), ("file.json", os.W_OK, flags._EFFECTIVE_IDS),
                     (tmp_path.name, wx, flags._EFFECTIVE_IDS)]  # fmt: skip


def test_an_existing_file_whose_folder_may_not_be_written_is_refused_naming_the_folder(tmp_path, monkeypatch):
    out = tmp_path / "results.json"
    out.write_text("{}")
    monkeypatch.setattr(os, "access", lambda path, mode, **kwargs: path == str(out))
    assert refusal(flags.output_file, str(out)) == (
        f"cannot replace {out}: no permission to write in {tmp_path} (it is written to a temporary file "
        "there, then renamed); name a file in a directory you can write to"
    )
