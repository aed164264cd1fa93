"""Token data for the language model: bytes of the Python standard library.

Three sources, one shape (`Corpus`: train and held-out token arrays):

* ``stdlib`` (the default): every ``*.py`` file under the running Python's
  standard library (``sysconfig.get_paths()["stdlib"]``, third-party
  ``site-packages`` and ``dist-packages`` left out), in sorted path order,
  as bytes. Tokens are bytes, so the vocabulary is 256 and the held-out
  loss in bits per token is bits per byte. A file is held out when a stable
  hash of its relative path says so (`is_held_out`: SHA-256, about 5%), so
  the split never changes with the file order, the machine or the seed; it
  changes only with the Python version, whose library it reads.
* ``synthetic``: uniform random tokens, for timing (nothing to learn).
* ``tfds``: a TFDS text data set prepared in ``--data-dir``; not provided
  here (see `load_corpus`).

Batches are windows of ``context + 1`` tokens at random offsets. The offsets
of a whole global batch come from the seed and the step alone, so the
global batch is the same for any number of processes; each process then
reads only the rows of its own share (`batch_rows`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import sysconfig

import numpy as np

SOURCES = ("stdlib", "synthetic")
HELD_OUT_PERCENT = 5
_SKIPPED_FOLDERS = ("site-packages", "dist-packages", "__pycache__")
_SYNTHETIC_TOKENS = (1 << 20, 1 << 16)


class DataUnavailableError(RuntimeError):
    """The corpus cannot be read; the message says where we looked and what to do."""


@dataclasses.dataclass(frozen=True)
class Corpus:
    """Token ids in two splits, as uint8 (bytes) or int32 arrays.

    Attributes:
        name: ``stdlib`` or ``synthetic``.
        train: training tokens, one long sequence.
        held_out: held-out tokens, one long sequence.
        vocab_size: token ids lie in ``[0, vocab_size)``.
        description: where it came from (folder, file counts).
    """

    name: str
    train: np.ndarray
    held_out: np.ndarray
    vocab_size: int
    description: str


def is_held_out(relative_path: str) -> bool:
    """Whether a file belongs to the held-out split: its path's SHA-256, mod 100, below 5."""
    digest = hashlib.sha256(relative_path.replace(os.sep, "/").encode()).digest()
    return int.from_bytes(digest[:8], "big") % 100 < HELD_OUT_PERCENT


def stdlib_files(root: str) -> list[str]:
    """Relative paths of the ``*.py`` files under `root`, sorted, third-party folders skipped."""
    paths = []
    for folder, subfolders, files in os.walk(root):
        subfolders[:] = sorted(name for name in subfolders if name not in _SKIPPED_FOLDERS)
        paths.extend(
            os.path.relpath(os.path.join(folder, name), root) for name in files if name.endswith(".py")
        )
    return sorted(paths)


def load_stdlib_corpus(root: str | None = None) -> Corpus:
    """The standard library's source as bytes, split by `is_held_out`.

    Args:
        root: the folder to read; the running Python's standard library when None.

    Raises:
        DataUnavailableError: the folder is missing or holds no Python files
            for both splits.
    """
    root = root or sysconfig.get_paths()["stdlib"]
    if not os.path.isdir(root):
        raise DataUnavailableError(
            f"The standard-library folder {root!r} does not exist or is not a folder. Pass --data-dir "
            "with a folder of *.py files, or --data synthetic for random tokens."
        )
    splits: dict[bool, list[bytes]] = {False: [], True: []}
    for path in stdlib_files(root):
        try:
            with open(os.path.join(root, path), "rb") as file:
                splits[is_held_out(path)].append(file.read())
        except OSError:
            continue  # an unreadable file (a broken link, no permission) is left out, not fatal
    counts = {held_out: len(files) for held_out, files in splits.items()}
    if not counts[False] or not counts[True]:
        raise DataUnavailableError(
            f"{root!r} holds {counts[False]} training and {counts[True]} held-out readable *.py files; "
            "both splits need at least one. Pass --data-dir with a larger folder of Python files, or "
            "--data synthetic."
        )
    train, held_out = (np.frombuffer(b"".join(splits[flag]), np.uint8) for flag in (False, True))
    return Corpus(
        name="stdlib",
        train=train,
        held_out=held_out,
        vocab_size=256,
        description=(
            f"{root}: {counts[False]} files ({train.size:,} bytes) for training, "
            f"{counts[True]} held out ({held_out.size:,} bytes)"
        ),
    )


def synthetic_corpus(vocab_size: int = 256, seed: int = 0) -> Corpus:
    """Uniform random tokens (nothing to learn), for timing and offline runs."""
    rng = np.random.default_rng(seed)
    dtype = np.uint8 if vocab_size <= 256 else np.int32
    train, held_out = (rng.integers(0, vocab_size, size, dtype=dtype) for size in _SYNTHETIC_TOKENS)
    description = f"{train.size:,} + {held_out.size:,} random tokens"
    return Corpus("synthetic", train, held_out, vocab_size, description)


def load_corpus(source: str, data_dir: str | None = None, vocab_size: int = 256, seed: int = 0) -> Corpus:
    """The corpus of ``--data``: ``stdlib`` (from `data_dir` if given) or ``synthetic``.

    Raises:
        DataUnavailableError: an unknown source, or a folder that cannot be used.
    """
    if source == "stdlib":
        return load_stdlib_corpus(data_dir)
    if source == "synthetic":
        return synthetic_corpus(vocab_size, seed)
    raise DataUnavailableError(
        f"--data {source!r} is not available: choose one of {', '.join(SOURCES)}. (A TFDS text data "
        "set is not wired in yet; the standard-library corpus needs no download.)"
    )


def check_fits(corpus: Corpus, context: int) -> None:
    """Raises unless both splits hold at least one window of ``context + 1`` tokens."""
    for split, tokens in (("training", corpus.train), ("held-out", corpus.held_out)):
        if tokens.size < context + 1:
            raise DataUnavailableError(
                f"The {split} split of {corpus.description} has {tokens.size} tokens, fewer than one "
                f"window of {context + 1}; use a larger folder or a smaller --context."
            )


def batch_offsets(num_tokens: int, batch_size: int, context: int, seed: int, step: int) -> np.ndarray:
    """Start offsets of a step's global batch of windows: a function of (seed, step) only."""
    rng = np.random.default_rng([seed, step])
    return rng.integers(0, num_tokens - context, size=batch_size)


def held_out_offsets(num_tokens: int, num_windows: int, context: int) -> np.ndarray:
    """Start offsets of the held-out windows: evenly spaced over the split, fixed."""
    last = num_tokens - context - 1
    return np.linspace(0, last, num_windows).astype(np.int64)


def batch_rows(tokens: np.ndarray, offsets: np.ndarray, context: int, rows: slice) -> np.ndarray:
    """The windows ``tokens[o : o + context + 1]`` for this process's `rows` of `offsets`, as int32.

    Only the process's own rows are read from the corpus.
    """
    mine = offsets[rows]
    index = mine[:, None] + np.arange(context + 1)[None, :]
    return tokens[index].astype(np.int32)
