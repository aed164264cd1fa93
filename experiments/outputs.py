"""What a command leaves on disk when it stops early, and what it may say it wrote.

One job: a command that fails or is interrupted leaves no empty folder behind
(neither the folder it made for its output, a run directory, ``--out-dir``
or ``--checkpoint-dir``, nor the parent folders it made on the way to it),
and its last message claims only files that this run wrote.

Imports nothing heavy, so every command may use it before JAX loads.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

RUNS_ROOT = "runs"
"""Where a command writes its new run directory unless told otherwise (relative to the working directory)."""


def missing_folders(path: str) -> list[str]:
    """The folders on the way to `path` that do not exist yet, `path` included, outermost first.

    Args:
        path: a folder a command may make (with ``os.makedirs``).

    Returns:
        Absolute paths; empty if `path` exists.
    """
    missing = []
    folder = os.path.abspath(path)
    while not os.path.lexists(folder):
        missing.append(folder)
        folder = os.path.dirname(folder)
    return missing[::-1]


@contextlib.contextmanager
def removed_if_left_empty(*paths: str | None) -> Iterator[list[str]]:
    """Removes the folders the block made on the way to `paths` if it fails leaving them empty.

    Algorithm::

        made = the folders of each path that do not exist yet (the path and
               its missing parents), and the folders the block appends to
               `made` (a run directory, named only once it is made)
        run the block
        if it raises (Ctrl-C included):
            for each folder of made, innermost first:
                remove it if it is empty (a parent emptied by removing its child too)
            raise again

    A folder that existed before the block is never removed, nor one that
    holds anything: what the run wrote stays, and so do the folders above it.

    Args:
        *paths: folders the block may make; None entries are ignored.

    Yields:
        `made`, for the block to append the folders it makes under a name it
        learns only then.
    """
    made = [folder for path in paths if path for folder in missing_folders(path)]
    try:
        yield made
    except BaseException:
        innermost_first = sorted(
            {os.path.abspath(folder) for folder in made},
            key=lambda folder: folder.count(os.sep),
            reverse=True,
        )
        for folder in innermost_first:
            with contextlib.suppress(OSError):  # it holds something, or is gone already
                os.rmdir(folder)
        raise


def file_version(path: str | None) -> tuple[int, int] | None:
    """Which file `path` is now: its inode and modification time, or None where there is none.

    A file written atomically (a temporary file renamed over it) gets a new
    version, so comparing the versions before and after a run tells whether
    the run wrote it.
    """
    if not path:
        return None
    try:
        status = os.stat(path)
    except OSError:
        return None
    return status.st_ino, status.st_mtime_ns
