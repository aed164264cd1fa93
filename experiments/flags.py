"""The command-line flags' shared parts: help that shows every default, and
number types that refuse bad values with a message naming them.

Every command (``experiments.cifar``, ``experiments.compare``,
``experiments.benchmark``) builds its parser with `HelpFormatter` and types
each numeric flag with one of the types here, so ``--batch-size 0`` or
``--budget -1`` stops at once with exit status 2 and one line naming the
flag, the value and what is expected, before any work starts. The output
paths (``--out``, ``--out-dir``) are checked the same way (`output_file`,
`output_directory`), so a bad one fails before training, not after an epoch.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import types
from collections.abc import Callable, Sequence

# The keys of jaxamp.diagnostics.GPU_TARGETS, for the flags that name a GPU to compile for
# (tests/test_command_startup.py checks they agree): importing jaxamp would load JAX first.
GPU_TARGET_NAMES = ("v100", "a100", "h100", "h200", "b200")

# What this process may do (also after seteuid), not what its real user may.
_EFFECTIVE_IDS = os.access in os.supports_effective_ids


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser, whose errors show a one-line usage instead of every flag.

    A mistyped flag is answered with two lines (exit status 2)::

        usage: python -m experiments.cifar [flags]  (--help lists them, with their defaults)
        python -m experiments.cifar: error: argument --precision: ...
    """

    def format_usage(self) -> str:
        usage = self.usage or f"{self.prog} [flags]"
        return f"usage: {usage % {'prog': self.prog}}  (--help lists them, with their defaults)\n"

    def error(self, message: str):
        self.exit(2, f"{self.format_usage()}{self.prog}: error: {message}\n")


def _library_module(name: str) -> types.ModuleType:
    """jaxamp's module `name`, loaded from its file without jaxamp's ``__init__`` (which loads JAX).

    For a module of the library that imports nothing but the standard library,
    so that the flags share its code and still parse before JAX loads.
    """
    package = importlib.util.find_spec("jaxamp")
    path = os.path.join(package.submodule_search_locations[0], f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"experiments.flags.{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# The library's message for a mistyped name (jaxamp.get_policy answers with the same):
# ``unknown model 'resnet19'. Did you mean resnet18? Choose one of: mobilenetv2, resnet101, ...``
unknown_name = _library_module("_unknown_name").unknown_name


def one_of(names: Sequence[str], what: str) -> Callable[[str], str]:
    """An argparse type: one of `names`, case-insensitive; a mistyped one is refused naming the nearest.

    Args:
        names: the valid names.
        what: what a name names, for the message (``model``).
    """

    def parse(text: str) -> str:
        name = text.strip().lower()
        if name not in names:
            raise argparse.ArgumentTypeError(unknown_name(what, text, names))
        return name

    return parse


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` with every flag's default.

    A switch (``store_true``) shows ``(default: off)``. A flag whose default
    is None (an optional setting) shows nothing added: its help says what
    happens without it, as ``default: ...``. Help that already names its
    default is left as written.
    """

    def _get_help_string(self, action: argparse.Action) -> str:
        help_text = action.help or ""
        if action.default is False and action.nargs == 0 and "default:" not in help_text:
            return f"{help_text} (default: off)".lstrip()
        if (
            "%(default)" in help_text
            or "default:" in help_text
            or any(action.default is nothing for nothing in (None, False, argparse.SUPPRESS))
            or not action.option_strings
        ):
            return help_text
        default = action.default
        shown = ",".join(map(str, default)) if isinstance(default, (list, tuple)) else "%(default)s"
        return f"{help_text} (default: {shown})".lstrip()


def integer_at_least(minimum: int, description: str) -> Callable[[str], int]:
    """An argparse type: an integer >= `minimum`, called `description` in errors."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {description}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected {description}, got {value}")
        return value

    return parse


positive_int = integer_at_least(1, "a positive integer")
non_negative_int = integer_at_least(0, "an integer >= 0")


def add_process_flags(parser: argparse.ArgumentParser) -> None:
    """The flags of one process of a multi-process run, as the cifar and lm commands share them."""
    parser.add_argument(
        "--coordinator-address",
        default=None,
        help="HOST:PORT of process 0, for several processes (default: none, one process)",
    )
    parser.add_argument(
        "--num-processes",
        type=positive_int,
        default=None,
        help="processes in a multi-process run (default: none, one process)",
    )
    parser.add_argument(
        "--process-id",
        type=non_negative_int,
        default=None,
        help="this process's index (default: none, one process)",
    )


def comma_list(choices: list[str] | None, validate=None, what: str = "choice"):
    """An argparse type for a comma-separated, case-insensitive list, each item checked.

    Args:
        choices: the valid items (None: any).
        validate: called with each item; raises ``argparse.ArgumentTypeError`` for a bad one.
        what: what an item names, for the message of one not in `choices` (``model``).
    """

    def parse(text: str) -> list[str]:
        items = [item.strip().lower() for item in text.split(",") if item.strip()]
        if not items:
            raise argparse.ArgumentTypeError("expected a comma-separated list, got nothing")
        for item in items:
            if choices is not None:
                one_of(choices, what)(item)
            if validate is not None:
                validate(item)
        return items

    return parse


def positive_float(text: str) -> float:
    """An argparse type: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a positive finite number, got {value}")
    return value


def fraction_below_one(text: str) -> float:
    """An argparse type: a number in [0, 1)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1), got {text!r}") from None
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1), got {value}")
    return value


def _nearest_existing(path: str) -> str:
    """`path` itself if it exists, else its nearest ancestor that does."""
    while not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return path


def _check_writable_folder(text: str, path: str, what: str, verb: str = "create") -> None:
    """Refuses `path` unless a file can be made beside it: the nearest existing folder on the way
    to its parent must be a directory this user may write into and search (``W_OK | X_OK``).

    A new file or directory is made there, and a file given as ``--out`` is
    replaced through a temporary file beside it (`experiments.results.write_text_atomically`),
    so an existing file needs its folder writable too. Nothing is created: a
    run that fails later leaves nothing behind.
    """
    ancestor = _nearest_existing(os.path.dirname(path))
    if not os.path.isdir(ancestor):
        raise argparse.ArgumentTypeError(
            f"cannot {verb} {text}: {ancestor} is a file, not a directory; choose a {what} path "
            "that does not pass through a file"
        )
    if not os.access(ancestor, os.W_OK | os.X_OK, effective_ids=_EFFECTIVE_IDS):
        why = " (it is written to a temporary file there, then renamed)" if verb == "replace" else ""
        raise argparse.ArgumentTypeError(
            f"cannot {verb} {text}: no permission to write in {ancestor}{why}; name a {what} in a directory "
            "you can write to"
        )


def output_file(text: str) -> str:
    """An argparse type: a file this run may write (``--out results.json``).

    Checked before any work, without creating anything: not a directory; if
    it exists, writable; and its folder (or, if that does not exist yet, the
    nearest existing one above it) a directory this user may write into,
    since the file is written through a temporary file beside it.
    """
    path = os.path.abspath(text)
    if os.path.isdir(path):
        raise argparse.ArgumentTypeError(
            f"{text} is a directory, not a file; name a file, e.g. {os.path.join(text, 'results.json')}"
        )
    if not os.path.exists(path):
        _check_writable_folder(text, path, "file")
        return text
    if not os.access(path, os.W_OK, effective_ids=_EFFECTIVE_IDS):
        raise argparse.ArgumentTypeError(
            f"no permission to write {text}; name another file, or fix its permissions"
        )
    _check_writable_folder(text, path, "file", verb="replace")
    return text


def output_directory(text: str) -> str:
    """An argparse type: a directory this run may write into (``--out-dir runs/x``).

    Checked before any work, without creating anything: not a file; if it
    exists, writable; if not, creatable.
    """
    path = os.path.abspath(text)
    if os.path.exists(path) and not os.path.isdir(path):
        raise argparse.ArgumentTypeError(f"{text} is a file, not a directory; name a directory")
    if os.path.isdir(path):
        if not os.access(path, os.W_OK | os.X_OK, effective_ids=_EFFECTIVE_IDS):
            raise argparse.ArgumentTypeError(
                f"no permission to write in {text}; name a directory you can write to, or fix its permissions"
            )
        return text
    _check_writable_folder(text, path, "directory")
    return text
