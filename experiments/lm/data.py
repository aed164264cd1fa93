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
* ``tfds:NAME[:FEATURE]``: the text feature of a TFDS data set already
  prepared in the TFDS data dir (``--data-dir``, else TFDS's default),
  never downloaded: the examples' bytes, joined by newlines, in the order
  the prepared files hold them. Training reads the ``train`` split; the
  held-out split is ``validation``, else ``test``, else the last 5% of
  ``train``'s examples. Each process reads only its share of the examples
  of each split (`tfds_share`), never the whole data set (`load_tfds_corpus`).

Batches are windows of ``context + 1`` tokens at random offsets. The offsets
of a whole global batch come from the seed and the step alone, so the
global batch is the same for any number of processes; each process then
reads only the rows of its own share (`batch_rows`). (With ``tfds``, whose
processes hold different examples, each process draws its rows from its own
tokens: the batches depend on the process count.)
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import sysconfig

import numpy as np

SOURCES = ("stdlib", "synthetic", "tfds:NAME[:FEATURE]")
HELD_OUT_PERCENT = 5
_TFDS_PREFIX = "tfds:"
_VERSION = re.compile(r"\d+(\.\d+)*")  # "tiny_shakespeare:1.0.0": a version, not a feature
_SKIPPED_FOLDERS = ("site-packages", "dist-packages", "__pycache__")
_SYNTHETIC_TOKENS = (1 << 20, 1 << 16)


class DataUnavailableError(RuntimeError):
    """The corpus cannot be read; the message says where we looked and what to do."""


@dataclasses.dataclass(frozen=True)
class Corpus:
    """Token ids in two splits, as uint8 (bytes) or int32 arrays.

    Attributes:
        name: ``stdlib``, ``synthetic`` or ``tfds:NAME``.
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


@dataclasses.dataclass(frozen=True)
class TfdsSource:
    """``--data tfds:NAME[:FEATURE]``, parsed.

    Attributes:
        name: what `tfds.builder` takes: ``NAME``, ``NAME/CONFIG``,
            ``NAME:VERSION``.
        feature: the text feature to read; None for the data set's only one.
    """

    name: str
    feature: str | None = None


def parse_source(text: str) -> str | TfdsSource:
    """``stdlib``, ``synthetic`` or a `TfdsSource`, from the text of ``--data``.

    A last ``:PART`` is the feature unless it is a version number, so
    ``tfds:tiny_shakespeare:1.0.0:text`` names version 1.0.0 and feature ``text``.

    Raises:
        ValueError: naming the text and the valid forms.
    """
    if text in ("stdlib", "synthetic"):
        return text
    if isinstance(text, str) and text.startswith(_TFDS_PREFIX):
        name, feature = text[len(_TFDS_PREFIX) :], None
        head, colon, tail = name.rpartition(":")
        if colon and head and not _VERSION.fullmatch(tail):
            name, feature = head, tail
        if name and feature != "":
            return TfdsSource(name, feature)
    raise ValueError(
        f"--data {text!r} is invalid: expected stdlib, synthetic, or tfds:NAME[:FEATURE] (a TFDS text "
        "data set prepared in --data-dir, e.g. tfds:tiny_shakespeare or tfds:lm1b:text)."
    )


def load_corpus(
    source: str,
    data_dir: str | None = None,
    vocab_size: int = 256,
    seed: int = 0,
    process_index: int = 0,
    process_count: int = 1,
) -> Corpus:
    """The corpus of ``--data``: ``stdlib`` (from `data_dir` if given), ``synthetic`` or ``tfds:...``.

    Args:
        source: the text of ``--data``.
        data_dir: a folder of ``*.py`` files for ``stdlib``; the TFDS data
            dir for ``tfds:...`` (None: TFDS's default).
        vocab_size: token ids of ``synthetic``.
        seed: the seed of ``synthetic``.
        process_index, process_count: this process's share of a ``tfds:...``
            data set (the other sources are small and read whole).

    Raises:
        DataUnavailableError: an unknown source, or data that cannot be used.
    """
    try:
        parsed = parse_source(source)
    except ValueError as error:
        raise DataUnavailableError(str(error)) from None
    if parsed == "stdlib":
        return load_stdlib_corpus(data_dir)
    if parsed == "synthetic":
        return synthetic_corpus(vocab_size, seed)
    return load_tfds_corpus(parsed, data_dir, process_index, process_count)


def tfds_share(start: int, stop: int, process_index: int, process_count: int) -> tuple[int, int]:
    """The examples ``[first, last)`` of ``[start, stop)`` that one process reads: an even cut."""
    count = stop - start
    return (
        start + process_index * count // process_count,
        start + (process_index + 1) * count // process_count,
    )


def load_tfds_corpus(
    source: TfdsSource, data_dir: str | None = None, process_index: int = 0, process_count: int = 1
) -> Corpus:
    """One process's share of a prepared TFDS text data set, as bytes.

    The data set must already be prepared in `data_dir` (nothing is
    downloaded). Training reads ``train``; the held-out split is
    ``validation``, else ``test``, else ``train``'s last 5% of examples
    (training then reads the first 95%). Each split's examples are cut
    evenly between the processes (`tfds_share`) and each process reads only
    its part, with `tfds.data_source` where the files are ArrayRecord (no
    TensorFlow needed) and `tfds.as_numpy` otherwise (TFRecord files, which
    need TensorFlow: without it, an error says so first). The text feature of
    its examples, encoded as UTF-8 where TFDS returns str, is joined with
    newlines.

    Raises:
        DataUnavailableError: tensorflow-datasets is missing; the data set is
            unknown or not prepared in `data_dir`; it has no such feature or no
            single text feature; no ``train`` split; or this process's share
            is empty.
    """
    try:
        import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
    except ImportError as error:
        raise DataUnavailableError(
            f"--data tfds:{source.name} reads TFDS, but tensorflow-datasets cannot be imported ({error}). "
            "Install the experiments' dependencies (pip install -e . --group experiments), or use "
            "--data stdlib, which needs nothing."
        ) from error
    from experiments.data import (  # pylint: disable=g-import-not-at-top
        _without_tfds_unprepared_warnings,
        tensorflow_installed,
    )

    where = (
        f"the TFDS data dir {data_dir!r}" if data_dir else "TFDS's default data dir (~/tensorflow_datasets)"
    )
    prepare = (
        f"Prepare it once where it can be downloaded (tfds build {source.name.split(':')[0]} "
        f"--data_dir DIR), then pass --data-dir DIR; this command never downloads."
    )
    with _without_tfds_unprepared_warnings():
        try:
            builder = tfds.builder(source.name, data_dir=data_dir)
        except (tfds.core.registered.DatasetNotFoundError, ValueError) as error:
            first_line = str(error).splitlines()[0] if str(error) else type(error).__name__
            raise DataUnavailableError(
                f"--data tfds:{source.name}: TFDS knows no such data set, and none is prepared under that "
                f"name in {where} ({first_line}). Check the name (and --data-dir), or use --data stdlib."
            ) from None
        if not builder.is_prepared():
            raise DataUnavailableError(
                f"--data tfds:{source.name}: the data set is not prepared in {where} (looked in "
                f"{builder.data_dir}). {prepare}"
            )
        if builder.info.file_format != tfds.core.FileFormat.ARRAY_RECORD and not tensorflow_installed():
            raise DataUnavailableError(
                f"--data tfds:{source.name}: the data set is prepared in {builder.data_dir} as TFRecord "
                "files, which only TensorFlow reads, and TensorFlow is not installed. Install it (pip "
                "install --group tensorflow), or prepare the data set as ArrayRecord files, read without "
                f"it (tfds build {source.name.split(':')[0]} --file_format=array_record --data_dir DIR)."
            )
    feature = _text_feature(builder, source, tfds)
    splits = builder.info.splits
    if "train" not in splits:
        raise DataUnavailableError(
            f"--data tfds:{source.name} has no 'train' split (it has {', '.join(sorted(splits))}); "
            "the language model trains on 'train'. Use another data set, or --data stdlib."
        )
    num_train = splits["train"].num_examples
    held_out_split = next((name for name in ("validation", "test") if name in splits), None)
    if held_out_split:
        parts = {
            "train": ("train", 0, num_train),
            "held-out": (held_out_split, 0, splits[held_out_split].num_examples),
        }
    else:
        cut = num_train * (100 - HELD_OUT_PERCENT) // 100
        parts = {"train": ("train", 0, cut), "held-out": ("train", cut, num_train)}
    tokens, described = {}, []
    for role, (split, start, stop) in parts.items():
        first, last = tfds_share(start, stop, process_index, process_count)
        if first == last:
            raise DataUnavailableError(
                f"--data tfds:{source.name}: process {process_index} of {process_count} gets no examples "
                f"of {split}[{start}:{stop}] for its {role} share; use a larger data set or fewer processes."
            )
        texts = _read_texts(builder, f"{split}[{first}:{last}]", feature, tfds)
        tokens[role] = np.frombuffer(b"\n".join(texts), np.uint8)
        described.append(f"{split}[{first}:{last}] ({tokens[role].size:,} bytes) for {role}")
    share = f", process {process_index} of {process_count}'s share" if process_count > 1 else ""
    return Corpus(
        name=f"tfds:{source.name}",
        train=tokens["train"],
        held_out=tokens["held-out"],
        vocab_size=256,
        description=f"TFDS {source.name} in {builder.data_dir}, feature {feature!r}{share}: "
        + ", ".join(described),
    )


def _text_feature(builder, source: TfdsSource, tfds) -> str:
    """The feature to read: the one named, or the data set's only text feature."""
    features = builder.info.features
    texts = sorted(
        name
        for name, feature in features.items()
        if isinstance(feature, tfds.features.Text)
        or (isinstance(feature, tfds.features.Tensor) and feature.shape == () and feature.np_dtype == object)
    )
    if source.feature is None:
        if len(texts) == 1:
            return texts[0]
        found = f"text features {', '.join(texts)}" if texts else "no text feature"
        raise DataUnavailableError(
            f"--data tfds:{source.name} has {found} (features: {', '.join(sorted(features))}); name the "
            f"one to read, e.g. --data tfds:{source.name}:{(texts or ['FEATURE'])[0]}."
        )
    if source.feature not in texts:
        what = "is not a text feature" if source.feature in features else "is not a feature"
        raise DataUnavailableError(
            f"--data tfds:{source.name}:{source.feature}: {source.feature!r} {what} of the data set; its "
            f"text features: {', '.join(texts) or 'none'} (all features: {', '.join(sorted(features))})."
        )
    return source.feature


def _read_texts(builder, split: str, feature: str, tfds) -> list[bytes]:
    """The `feature` of every example of `split`, in file order, as bytes."""
    if builder.info.file_format == tfds.core.FileFormat.ARRAY_RECORD:
        examples = builder.as_data_source(split=split)
    else:
        examples = tfds.as_numpy(builder.as_dataset(split=split, shuffle_files=False))
    return [
        text.encode() if isinstance(text, str) else bytes(text)
        for text in (example[feature] for example in examples)
    ]


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
