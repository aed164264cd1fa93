"""Where a measurement writes: a new folder unless one is named, files written atomically, the command beside them.

    out = RunFolder.create("autocast-cost", out_dir=None, argv=["autocast-cost"])
    out.print("1. eager calls ...")        # shown now, and kept
    out.save_printed("autocast_cost.txt")  # what was printed, as a file
    out.write("table.md", text)            # readers see the old file or the new one, never half
    out.finish()                           # COMMAND: the command, the commit it ran on, the date

Without ``--out`` a measurement writes into a new folder
``runs/measure-NAME-YYYYMMDD-HHMMSS`` (`experiments.results.run_directory`),
so running one never overwrites a result committed under ``results/``;
``--out DIR`` names the folder (made if missing), e.g. ``results/<question>/...``
to publish. When the measurement has finished, ``COMMAND`` records how to
make the folder again::

    command: python -m experiments.measure autocast-cost --out results/autocast-cost/calls
    commit: 1a2b3c4d5e6f... (with uncommitted changes)
    date: 2026-12-06 10:30
    wrote: autocast_cost.txt

A measurement that fails writes no ``COMMAND``, and a folder it made and
left empty is removed, with the folders it made above it
(`experiments.outputs.removed_if_left_empty`).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import shlex
import subprocess
from typing import Any

from experiments import interrupts

COMMAND_FILE = "COMMAND"
_REPOSITORY = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def commit() -> str:
    """The checked-out commit of the repository these measurements come from, and whether it was edited."""
    try:
        head = subprocess.run(
            ["git", "-C", _REPOSITORY, "rev-parse", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        changes = subprocess.run(
            ["git", "-C", _REPOSITORY, "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout, or git is missing)"
    return f"{head} (with uncommitted changes)" if changes else head


@dataclasses.dataclass
class RunFolder:
    """One measurement's output folder.

    Attributes:
        path: the folder.
        command: the command that runs the measurement again, as typed.
        written: the files written so far, relative to `path`.
        printed: the lines `print` showed.
    """

    path: str
    command: str
    written: list[str] = dataclasses.field(default_factory=list)
    printed: list[str] = dataclasses.field(default_factory=list)

    @classmethod
    def create(cls, name: str, out_dir: str | None, argv: list[str]) -> RunFolder:
        """The folder `out_dir` (made if missing), or a new one under ``runs/`` named after `name`.

        Args:
            name: the measurement's name (``autocast-cost``).
            out_dir: the folder the user named, or None.
            argv: the arguments after ``python -m experiments.measure``.
        """
        from experiments.results import run_directory  # pylint: disable=import-outside-toplevel  # loads JAX

        if out_dir is None:
            path = run_directory(f"measure-{name}")
        else:
            os.makedirs(out_dir, exist_ok=True)
            path = out_dir
        return cls(path, "python -m experiments.measure " + shlex.join(argv))

    def file(self, name: str) -> str:
        """The path of `name` inside the folder (its parent folders made), for a writer of its own.

        Raises:
            KeyboardInterrupt: a Ctrl-C arrived (`experiments.interrupts`): no file is begun after it.
        """
        interrupts.stop_if_interrupted()
        path = os.path.join(self.path, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if name not in self.written:
            self.written.append(name)
        return path

    def write(self, name: str, text: str) -> str:
        """Writes `text` to `name` in the folder, atomically; returns its path."""
        from experiments.results import write_text_atomically  # pylint: disable=import-outside-toplevel

        path = self.file(name)
        write_text_atomically(path, text)
        return path

    def write_json(self, name: str, payload: Any) -> str:
        """Writes `payload` to `name` as indented JSON, atomically; returns its path."""
        return self.write(name, json.dumps(payload, indent=1) + "\n")

    def print(self, text: str = "") -> None:
        """Shows `text` now (the measurement's progress and findings) and keeps it for `save_printed`.

        Raises:
            KeyboardInterrupt: a Ctrl-C arrived (`experiments.interrupts`): the measurement stops here.
        """
        interrupts.stop_if_interrupted()
        print(text, flush=True)
        self.printed.append(text)

    def save_printed(self, name: str) -> str:
        """Writes everything `print` showed so far to `name` in the folder; returns its path."""
        return self.write(name, "\n".join(self.printed) + "\n")

    def finish(self) -> str:
        """Writes ``COMMAND`` (the command, the commit, the date and the files written); returns its path."""
        record = [
            f"command: {self.command}",
            f"commit: {commit()}",
            f"date: {datetime.datetime.now():%Y-%m-%d %H:%M}",
            f"wrote: {', '.join(self.written) or 'nothing'}",
        ]
        return self.write(COMMAND_FILE, "\n".join(record) + "\n")
