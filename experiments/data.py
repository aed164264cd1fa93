"""Image data for the experiments: loading, normalizing, augmenting, batching.

Everything a training run needs from its data lives here, in two halves:

* Host side, run once per run: `load_dataset` returns a `Dataset` of whole
  uint8 numpy arrays, from TFDS (CIFAR-10; without TensorFlow, from its binary
  archive), from the Debian IDX files (Fashion-MNIST), or generated at random
  (`synthetic_dataset`, for timing and offline runs).
* Device side, pure jax and jittable: `epoch_batches` shuffles indices,
  `augment` crops and flips uint8 images, `normalize` turns them into float32.

Images stay uint8 until `normalize`, so a whole dataset fits on the device at a
quarter of its float32 size and augmentation moves only bytes.

Typical use::

  data = load_dataset('cifar10')
  images = jax.device_put(data.train_images)
  for step_indices in epoch_batches(epoch_rng, len(data.train_labels), 128):
    batch = augment(augment_rng, images[step_indices])
    inputs = normalize(batch, data.mean, data.std)
"""

import contextlib
import dataclasses
import glob
import gzip
import hashlib
import importlib.util
import logging
import os
import shutil
import socket
import sys
import tarfile
import urllib.parse
import urllib.request
import zlib

import jax
import jax.numpy as jnp
import numpy as np

DATASETS = ("cifar10", "fashion_mnist", "synthetic")
SOURCES = ("tfds", "synthetic")

# (train, test) sizes of each real dataset, reused by its synthetic stand-in.
_SPLIT_SIZES = {
    "cifar10": (50_000, 10_000),
    "fashion_mnist": (60_000, 10_000),
    "synthetic": (50_000, 10_000),
}
_IMAGE_SHAPE = (32, 32, 3)

_CIFAR10_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-binary.tar.gz"
_CIFAR10_ARCHIVE = "cifar-10-binary.tar.gz"
# The binary archive: per split, files of records of a label byte and the image's 1024 red,
# 1024 green and 1024 blue bytes, row by row.
_CIFAR10_FILES = {"train": tuple(f"data_batch_{n}.bin" for n in range(1, 6)), "test": ("test_batch.bin",)}
_CIFAR10_RECORD_BYTES = 1 + 32 * 32 * 3
# The archive's size and SHA-256, as TFDS registered them for _CIFAR10_URL (a test checks they agree).
_CIFAR10_SIZE = 170_052_171
_CIFAR10_SHA256 = "c4a38c50a1bc5f3a1c5537f2155ab9d68f9f25eb1ed8d9ddda3db29a59bca1dd"
_DOWNLOAD_TIMEOUT_S = 60.0
# The dependency group with TensorFlow, which TFDS needs to extract, prepare and read CIFAR-10.
_TENSORFLOW_GROUP = "pip install --group tensorflow"
_CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
_CIFAR10_STD = (0.2470, 0.2435, 0.2616)
_NETWORK_PROBE_TIMEOUT_S = 5.0

# Uniform uint8 pixels: mean 127.5 and variance (256**2 - 1) / 12, over 255.
_UNIFORM_MEAN = (0.5, 0.5, 0.5)
_UNIFORM_STD = (0.2898,) * 3

FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"
_FASHION_MNIST_FILES = {
    "train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
    "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"),
}
_IDX_IMAGES_MAGIC = 0x00000803  # unsigned bytes, 3 dimensions
_IDX_LABELS_MAGIC = 0x00000801  # unsigned bytes, 1 dimension
_AUGMENT_PADDING = 4
# os.access with effective ids: what this process may do, also after seteuid.
_EFFECTIVE_IDS = os.access in os.supports_effective_ids


class DataUnavailableError(RuntimeError):
    """The requested data is not on disk and cannot be fetched.

    The message is complete advice for a person (where we looked and what to do
    next); command-line tools print it as is, without a traceback.
    """


@dataclasses.dataclass(frozen=True)
class Dataset:
    """A whole image classification dataset held in host memory.

    Attributes:
      name: 'cifar10', 'fashion_mnist' or 'synthetic'.
      train_images: uint8 [N, 32, 32, 3].
      train_labels: int32 [N].
      test_images: uint8 [M, 32, 32, 3].
      test_labels: int32 [M].
      num_classes: number of classes; labels are in [0, num_classes).
      mean: per-channel mean in [0, 1] pixel units, for `normalize`.
      std: per-channel standard deviation in [0, 1] pixel units.
    """

    name: str
    train_images: np.ndarray
    train_labels: np.ndarray
    test_images: np.ndarray
    test_labels: np.ndarray
    num_classes: int
    mean: tuple[float, float, float]
    std: tuple[float, float, float]


# ---------------------------------------------------------------------------
# Loading (host side).
# ---------------------------------------------------------------------------


def load_dataset(
    dataset: str = "cifar10",
    source: str = "tfds",
    data_dir: str | None = None,
    *,
    seed: int = 0,
) -> Dataset:
    """Loads a whole dataset into uint8 numpy arrays.

    Args:
      dataset: 'cifar10', 'fashion_mnist', or 'synthetic' (random CIFAR-shaped
        data, whatever the source).
      source: 'tfds' reads the real data; 'synthetic' returns random data with
        the real dataset's split sizes, for timing and offline runs.
      data_dir: for 'cifar10', the TFDS data directory (default: TFDS's own,
        usually ~/tensorflow_datasets); for 'fashion_mnist', the directory with
        the four IDX .gz files (default: /usr/share/datasets/fashion-mnist).
      seed: seed of the synthetic data; unused for real data.

    Returns:
      The dataset, with uint8 [N, 32, 32, 3] images and int32 labels.

    Raises:
      ValueError: `dataset` or `source` is not one of the valid choices.
      DataUnavailableError: the real data is neither on disk nor downloadable.
    """
    if dataset not in DATASETS:
        raise ValueError(f"Unknown dataset {dataset!r}; choose one of {', '.join(DATASETS)}.")
    if source not in SOURCES:
        raise ValueError(f"Unknown data source {source!r}; choose one of {', '.join(SOURCES)}.")
    if dataset == "synthetic" or source == "synthetic":
        num_train, num_test = _SPLIT_SIZES[dataset]
        return synthetic_dataset(num_train, num_test, seed=seed)
    if dataset == "cifar10":
        return _load_cifar10_tfds(data_dir)
    return _load_fashion_mnist(data_dir or FASHION_MNIST_DIR)


def synthetic_dataset(
    num_train: int = 50_000,
    num_test: int = 10_000,
    num_classes: int = 10,
    seed: int = 0,
) -> Dataset:
    """Returns random CIFAR-shaped data: uniform uint8 pixels, uniform labels.

    Nothing can be learned from it; it exists so that timing runs and tests need
    neither a download nor a disk.

    Args:
      num_train: number of training examples.
      num_test: number of test examples.
      num_classes: labels are drawn uniformly from [0, num_classes).
      seed: seed of numpy's random generator; equal seeds give equal data.

    Returns:
      A `Dataset` named 'synthetic' whose mean and std are those of uniform
      uint8 pixels.
    """
    rng = np.random.default_rng(seed)

    def images(count):
        return rng.integers(0, 256, (count, *_IMAGE_SHAPE), dtype=np.uint8)

    def labels(count):
        return rng.integers(0, num_classes, (count,), dtype=np.int32)

    return Dataset(
        name="synthetic",
        train_images=images(num_train),
        train_labels=labels(num_train),
        test_images=images(num_test),
        test_labels=labels(num_test),
        num_classes=num_classes,
        mean=_UNIFORM_MEAN,
        std=_UNIFORM_STD,
    )


def _load_cifar10_tfds(data_dir: str | None) -> Dataset:
    """Prepares CIFAR-10 with TFDS if needed, then reads both splits whole.

    Without TensorFlow, which TFDS needs for this, reads the binary archive
    instead (`_load_cifar10_archive`).
    """
    if not tensorflow_installed():
        return _load_cifar10_archive(data_dir)
    try:
        import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
    except ImportError as err:
        raise DataUnavailableError(
            f"CIFAR-10 is read with tensorflow-datasets, which cannot be imported here ({err}).\n"
            "Ways forward:\n"
            "  1. Install the experiments' dependencies (pip >= 25.1): pip install -e . --group experiments\n"
            "  2. Pass `--data synthetic` for timing or offline runs."
        ) from err

    if data_dir is not None:
        _check_readable_folder(data_dir, "CIFAR-10", writable=True)
    with _without_tfds_unprepared_warnings():
        builder = tfds.builder("cifar10", data_dir=data_dir)
        data_dir_root = os.fspath(builder.data_dir_root)
        manual_dir = os.path.join(data_dir_root, "downloads", "manual")
        _prepare_cifar10(builder, manual_dir)
    return _cifar10_dataset(_read_tfds_split(builder, "train"), _read_tfds_split(builder, "test"))


def _cifar10_dataset(train: tuple[np.ndarray, np.ndarray], test: tuple[np.ndarray, np.ndarray]) -> Dataset:
    """CIFAR-10 from its ``(images, labels)`` splits, however they were read."""
    return Dataset(
        name="cifar10",
        train_images=train[0],
        train_labels=train[1],
        test_images=test[0],
        test_labels=test[1],
        num_classes=10,
        mean=_CIFAR10_MEAN,
        std=_CIFAR10_STD,
    )


class _TfdsUnpreparedWarning(logging.Filter):
    """Drops TFDS's warning that a data set's version folder is not prepared.

    TFDS logs "Variant folder .../cifar10/3.0.2 has no dataset_info.json"
    (through absl) whenever it looks at a data dir where CIFAR-10 is not
    prepared yet, which is exactly the case this module then reports in its
    own words; printed first, the warning reads like a failure of its own.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Variant folder %s has no %s")


@contextlib.contextmanager
def _without_tfds_unprepared_warnings():
    """Silences only `_TfdsUnpreparedWarning`'s message, only inside the block."""
    logger, quiet = logging.getLogger("absl"), _TfdsUnpreparedWarning()
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)


def _prepare_cifar10(builder, manual_dir: str) -> None:
    """Runs `download_and_prepare`, turning every way it can fail into advice.

    TFDS takes the archive from `manual_dir` when it is there (checking its
    checksum), and downloads it otherwise. Without a network its downloader
    retries with exponential backoff for more than three minutes before giving
    up, so when the data is neither prepared nor placed by hand we first check
    that the download host is reachable at all, and fail at once if not.
    """
    import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top

    archive = os.path.join(manual_dir, _CIFAR10_ARCHIVE)
    needs_download = not (builder.is_prepared() or os.path.exists(archive) or _has_cached_download(builder))
    if needs_download:
        unreachable_reason = _unreachable_reason(_CIFAR10_URL)
        if unreachable_reason:
            raise DataUnavailableError(_cifar10_unavailable_message(builder, manual_dir, unreachable_reason))
    config = tfds.download.DownloadConfig(
        manual_dir=manual_dir,
        # Prepared copies on GCS are only a shortcut; offline, some TFDS
        # versions block for minutes trying to reach them.
        try_download_gcs=False,
    )
    try:
        builder.download_and_prepare(download_config=config)
    except tfds.download.download_manager.NonMatchingChecksumError as err:
        checked = archive if os.path.exists(archive) else "The downloaded archive"
        raise DataUnavailableError(_wrong_archive_message(checked, by_tfds=True)) from err
    except Exception as err:  # pylint: disable=broad-except
        # TFDS reports a failed download through many exception types (requests,
        # urllib3, its own DownloadError, OSError); all mean the same to a user.
        raise DataUnavailableError(
            _cifar10_unavailable_message(builder, manual_dir, f"{type(err).__name__}: {_first_line(err)}")
        ) from err


def _has_cached_download(builder) -> bool:
    """Whether a previous run downloaded the archive but did not prepare it."""
    downloads_dir = os.path.join(os.fspath(builder.data_dir_root), "downloads")
    return bool(glob.glob(os.path.join(downloads_dir, "*cifar-10-binary*")))


def _unreachable_reason(url: str) -> str | None:
    """Returns why `url`'s host cannot be reached, or None if it can (or may).

    With a proxy configured the host is reached through it, so we cannot tell
    cheaply and leave the answer to the download itself.
    """
    parsed = urllib.parse.urlparse(url)
    if urllib.request.getproxies().get(parsed.scheme):
        return None
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    try:
        with socket.create_connection((parsed.hostname, port), timeout=_NETWORK_PROBE_TIMEOUT_S):
            return None
    except OSError as err:
        return f"cannot reach {parsed.hostname}: {err}"


def _cifar10_unavailable_message(builder, manual_dir: str, reason: str) -> str:
    if os.path.exists(os.path.join(manual_dir, _CIFAR10_ARCHIVE)):
        archive_status = "found, but preparing from it failed"
    else:
        archive_status = "not there"
    return (
        f"CIFAR-10 is not prepared in the TFDS data dir {builder.data_dir_root}"
        f" and TFDS could not get it ({reason}).\n"
        f"Looked for a manually downloaded {_CIFAR10_ARCHIVE} in {manual_dir}:"
        f" {archive_status}.\n"
        "Ways forward:\n"
        "  1. Run once with network access; TFDS downloads CIFAR-10 (170 MB)"
        f" and prepares it in {builder.data_dir_root}.\n"
        f"  2. Download {_CIFAR10_URL} elsewhere, place {_CIFAR10_ARCHIVE} in"
        f" {manual_dir}, and rerun (TFDS checks its checksum).\n"
        "  3. Pass `--data synthetic` for timing or offline runs (random"
        " images; accuracy means nothing)."
    )


def _first_line(err: Exception) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else "no details"


def _read_tfds_split(builder, split: str) -> tuple[np.ndarray, np.ndarray]:
    """Reads a whole prepared split as (uint8 images, int32 labels)."""
    import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top

    images, labels = tfds.as_numpy(builder.as_dataset(split=split, batch_size=-1, as_supervised=True))
    return images.astype(np.uint8), labels.astype(np.int32)


def tensorflow_installed() -> bool:
    """Whether TensorFlow can be imported here (checked without importing it).

    TFDS needs it to extract CIFAR-10's archive, to encode its images while
    preparing it, and to read the TFRecord files it prepares; it comes with
    the experiments' ``tensorflow`` dependency group.
    """
    return importlib.util.find_spec("tensorflow") is not None


def _load_cifar10_archive(data_dir: str | None) -> Dataset:
    """CIFAR-10 read straight from its binary archive, where TensorFlow is not installed.

    The data folder is TFDS's (`data_dir`, else ``$TFDS_DATA_DIR``, else
    ``~/tensorflow_datasets``). The archive is the one placed in its
    ``downloads/manual/``, or one an earlier run left in TFDS's download
    cache; without either it is downloaded into ``downloads/manual/`` (after
    a quick check that the host is reachable). Its size and SHA-256 must be
    the ones TFDS registered. Nothing is prepared or written besides the
    downloaded archive, and neither TensorFlow nor TFDS is imported.
    """
    if data_dir is not None:
        _check_readable_folder(data_dir, "CIFAR-10", writable=True)
    root = data_dir or os.environ.get("TFDS_DATA_DIR") or os.path.expanduser("~/tensorflow_datasets")
    manual_dir = os.path.join(root, "downloads", "manual")
    archive = _cifar10_archive_on_disk(root, manual_dir)
    if archive is None and glob.glob(os.path.join(root, "cifar10", "*", "dataset_info.json")):
        raise DataUnavailableError(
            f"CIFAR-10 is prepared in the TFDS data dir {root} as TFRecord files, which"
            " only TensorFlow reads, and TensorFlow is not installed.\n"
            "Ways forward:\n"
            f"  1. Install it (pip >= 25.1): {_TENSORFLOW_GROUP}\n"
            f"  2. Download {_CIFAR10_URL}, place {_CIFAR10_ARCHIVE} in {manual_dir}, and rerun"
            " (read without TensorFlow).\n"
            "  3. Pass `--data synthetic` for timing or offline runs."
        )
    if archive is None:
        archive = _download_cifar10(manual_dir)
    _check_cifar10_archive(archive)
    return _cifar10_dataset(*_read_cifar10_archive(archive))


def _cifar10_archive_on_disk(root: str, manual_dir: str) -> str | None:
    """The archive placed in `manual_dir`, else the one in TFDS's download cache under `root`, else None."""
    placed = os.path.join(manual_dir, _CIFAR10_ARCHIVE)
    if os.path.isfile(placed):
        return placed
    cached = sorted(
        path
        for path in glob.glob(os.path.join(root, "downloads", "*cifar-10-binary*"))
        if os.path.isfile(path) and not path.endswith(".INFO")
    )
    return cached[0] if cached else None


def _download_cifar10(manual_dir: str) -> str:
    """Downloads the archive to `manual_dir` (through a ``.part`` file, removed if it fails)."""
    unreachable_reason = _unreachable_reason(_CIFAR10_URL)
    if unreachable_reason:
        raise DataUnavailableError(_cifar10_not_downloaded_message(manual_dir, unreachable_reason))
    archive = os.path.join(manual_dir, _CIFAR10_ARCHIVE)
    partial = archive + ".part"
    print(f"Downloading {_CIFAR10_URL} (162 MiB) to {archive}", file=sys.stderr, flush=True)
    try:
        os.makedirs(manual_dir, exist_ok=True)
        with (
            urllib.request.urlopen(_CIFAR10_URL, timeout=_DOWNLOAD_TIMEOUT_S) as response,
            open(partial, "wb") as out,
        ):
            shutil.copyfileobj(response, out, 1 << 20)
    except OSError as err:  # urllib's URLError and HTTPError are OSErrors
        with contextlib.suppress(OSError):
            os.remove(partial)
        reason = f"{type(err).__name__}: {_first_line(err)}"
        raise DataUnavailableError(_cifar10_not_downloaded_message(manual_dir, reason)) from err
    os.replace(partial, archive)
    return archive


def _cifar10_not_downloaded_message(manual_dir: str, reason: str) -> str:
    archive = os.path.join(manual_dir, _CIFAR10_ARCHIVE)
    return (
        f"CIFAR-10 is not in {manual_dir} and could not be downloaded ({reason}).\n"
        "Ways forward:\n"
        f"  1. Run once with network access; CIFAR-10's archive (162 MiB) is downloaded to {archive}"
        " and read from there.\n"
        f"  2. Download {_CIFAR10_URL} elsewhere, place {_CIFAR10_ARCHIVE} in {manual_dir}, and rerun"
        " (its checksum is checked).\n"
        "  3. Pass `--data synthetic` for timing or offline runs (random images; accuracy means nothing)."
    )


def _wrong_archive_message(checked: str, *, by_tfds: bool) -> str:
    """Advice for an archive of another size or checksum, found by TFDS or by `_check_cifar10_archive`."""
    return (
        f"{checked} is not the CIFAR-10 archive {'TFDS' if by_tfds else 'this project'} expects: its size or"
        " checksum differs from the ones TFDS registered for"
        f" {_CIFAR10_URL} (an interrupted download, or another file).\n"
        "Ways forward:\n"
        f"  1. Download {_CIFAR10_URL} again, replace the file, and rerun.\n"
        f"  2. Delete the file and run with network access; {'TFDS downloads it' if by_tfds else 'it is downloaded'}.\n"
        "  3. Pass `--data synthetic` for timing or offline runs."
    )


def _check_cifar10_archive(archive: str) -> None:
    """Raises DataUnavailableError unless `archive` has the size and SHA-256 TFDS registered."""
    digest = hashlib.sha256()
    with open(archive, "rb") as file:
        for chunk in iter(lambda: file.read(1 << 20), b""):
            digest.update(chunk)
    if os.path.getsize(archive) != _CIFAR10_SIZE or digest.hexdigest() != _CIFAR10_SHA256:
        raise DataUnavailableError(_wrong_archive_message(archive, by_tfds=False))


def _read_cifar10_archive(archive: str) -> tuple[tuple[np.ndarray, np.ndarray], ...]:
    """((train images, labels), (test images, labels)) of the archive, HWC uint8 and int32, in file order."""
    splits = []
    try:
        with tarfile.open(archive, "r:gz") as tar:
            members = {
                os.path.basename(member.name): member for member in tar.getmembers() if member.isfile()
            }
            for files in _CIFAR10_FILES.values():
                content = b"".join(tar.extractfile(members[name]).read() for name in files)
                if not content or len(content) % _CIFAR10_RECORD_BYTES:
                    raise ValueError(f"{len(content)} bytes, not whole records of {_CIFAR10_RECORD_BYTES}")
                records = np.frombuffer(content, np.uint8).reshape(-1, _CIFAR10_RECORD_BYTES)
                images = records[:, 1:].reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
                splits.append((np.ascontiguousarray(images), records[:, 0].astype(np.int32)))
    except (OSError, EOFError, KeyError, ValueError, tarfile.TarError, zlib.error) as err:
        raise DataUnavailableError(
            f"{archive} cannot be read as CIFAR-10's archive ({type(err).__name__}: {_first_line(err)}). "
            f"Download {_CIFAR10_URL} again, replace the file, and rerun; or pass `--data synthetic`."
        ) from err
    return tuple(splits)


def _load_fashion_mnist(data_dir: str) -> Dataset:
    """Reads Fashion-MNIST from its original IDX files, as CIFAR-shaped images.

    The files are read directly rather than through TFDS because Debian's
    dataset-fashion-mnist package recompresses them, so TFDS's checksums of the
    upstream archives do not match.

    Each 28x28 grey image becomes 32x32x3: it is zero-padded by 2 pixels on
    every side (black, like Fashion-MNIST's own background) and its grey value is
    copied to all three channels, so CIFAR models run on it unchanged. Mean and
    std are computed over these converted training images, padding included, as
    that is what `normalize` sees.
    """
    _check_readable_folder(data_dir, "Fashion-MNIST")
    _check_fashion_mnist_files(data_dir)
    splits = {}
    for split, (images_file, labels_file) in _FASHION_MNIST_FILES.items():
        images = _read_idx_images(os.path.join(data_dir, images_file))
        labels = _read_idx_labels(os.path.join(data_dir, labels_file))
        if len(images) != len(labels):
            raise DataUnavailableError(
                f"{images_file} holds {len(images)} images but {labels_file} holds"
                f" {len(labels)} labels (in {data_dir}); the files are from"
                " different releases or damaged. Reinstall them with"
                " `apt-get install --reinstall dataset-fashion-mnist`."
            )
        splits[split] = (_grey28_to_rgb32(images), labels)
    mean, std = _pixel_mean_std(splits["train"][0][..., 0])
    return Dataset(
        name="fashion_mnist",
        train_images=splits["train"][0],
        train_labels=splits["train"][1],
        test_images=splits["test"][0],
        test_labels=splits["test"][1],
        num_classes=10,
        mean=(mean,) * 3,
        std=(std,) * 3,
    )


def _check_readable_folder(data_dir: str, name: str, writable: bool = False) -> None:
    """Raises DataUnavailableError if `data_dir` exists but this user may not use it.

    TFDS writes into its data dir (it prepares the data there), so CIFAR-10's
    must be writable too; Fashion-MNIST's IDX files are only read.
    """
    if os.path.exists(data_dir) and not os.path.isdir(data_dir):
        raise DataUnavailableError(_a_file_given_as_data_dir(data_dir, name))
    if not os.path.isdir(data_dir):
        return
    mode = os.R_OK | os.X_OK | (os.W_OK if writable else 0)
    if not os.access(data_dir, mode, effective_ids=_EFFECTIVE_IDS):
        needed = "read and write" if writable else "read"
        raise DataUnavailableError(
            f"No permission to {needed} the {name} data folder {data_dir}; fix its permissions,"
            " or pass --data-dir naming a folder you can use."
        )


def _a_file_given_as_data_dir(path: str, name: str) -> str:
    """The message for a --data-dir that names a file: what the folder must hold."""
    if name != "CIFAR-10":
        expected = ", ".join(file for pair in _FASHION_MNIST_FILES.values() for file in pair)
        return (
            f"--data-dir {path} is a file, not a folder. For {name}, pass --data-dir naming the folder "
            f"that holds the four IDX .gz files ({expected})."
        )
    message = (
        f"--data-dir {path} is a file, not a folder. For CIFAR-10, pass --data-dir naming the TFDS data "
        f"folder (default ~/tensorflow_datasets), where TFDS prepares the data; a downloaded "
        f"{_CIFAR10_ARCHIVE} goes in its downloads/manual/ subfolder."
    )
    if os.path.basename(path) == _CIFAR10_ARCHIVE:
        folder = os.path.join(os.path.dirname(os.path.abspath(path)), "tensorflow_datasets")
        message += (
            f" For this archive: mkdir -p {os.path.join(folder, 'downloads', 'manual')}, move it there, "
            f"and pass --data-dir {folder}."
        )
    return message


def _check_fashion_mnist_files(data_dir: str) -> None:
    expected = [name for pair in _FASHION_MNIST_FILES.values() for name in pair]
    missing = [name for name in expected if not os.path.isfile(os.path.join(data_dir, name))]
    if missing:
        if missing == expected:
            found = "none is there"
        else:
            found = f"{', '.join(missing)} missing"
        raise DataUnavailableError(
            f"Fashion-MNIST not found in {data_dir}: expected the IDX files"
            f" {', '.join(expected)}; {found}.\n"
            "Ways forward:\n"
            "  1. `apt-get install dataset-fashion-mnist`, which puts them in"
            f" {FASHION_MNIST_DIR}.\n"
            "  2. Pass `--data-dir DIR` naming a directory that holds the four"
            " original IDX .gz files.\n"
            "  3. Pass `--data synthetic` for timing or offline runs."
        )


def _read_idx(path: str, magic: int, num_dims: int) -> np.ndarray:
    """Reads a gzipped IDX file of unsigned bytes, checking its header."""
    try:
        with gzip.open(path, "rb") as f:
            data = f.read()
    except PermissionError as err:
        raise DataUnavailableError(
            f"No permission to read {path}; fix its permissions or pass --data-dir with a readable copy."
        ) from err
    except (OSError, EOFError, zlib.error) as err:
        raise DataUnavailableError(
            f"{path} is not a readable gzip file ({type(err).__name__}: {_first_line(err)}); it is"
            " truncated or damaged. Reinstall it."
        ) from err
    header_size = 4 * (1 + num_dims)
    if len(data) < header_size:
        raise DataUnavailableError(
            f"{path} is {len(data)} bytes, too short for an IDX header of"
            f" {header_size} bytes; the file is damaged. Reinstall it."
        )
    header = np.frombuffer(data, dtype=">u4", count=1 + num_dims)
    if header[0] != magic:
        raise DataUnavailableError(
            f"{path} starts with magic number {int(header[0]):#010x}, expected"
            f" {magic:#010x} (IDX unsigned bytes, {num_dims} dimensions); it is"
            " not the file its name says. Reinstall it."
        )
    shape = tuple(int(d) for d in header[1:])
    expected_size = header_size + int(np.prod(shape))
    if len(data) != expected_size:
        raise DataUnavailableError(
            f"{path} is {len(data)} bytes uncompressed but its header {shape}"
            f" implies {expected_size}; the file is truncated or damaged."
            " Reinstall it."
        )
    return np.frombuffer(data, dtype=np.uint8, offset=header_size).reshape(shape)


def _read_idx_images(path: str) -> np.ndarray:
    images = _read_idx(path, _IDX_IMAGES_MAGIC, num_dims=3)
    if images.shape[1:] != (28, 28):
        raise DataUnavailableError(
            f"{path} holds images of shape {images.shape[1:]}, expected (28, 28) for Fashion-MNIST."
        )
    return images


def _read_idx_labels(path: str) -> np.ndarray:
    labels = _read_idx(path, _IDX_LABELS_MAGIC, num_dims=1)
    if labels.size and labels.max() > 9:
        raise DataUnavailableError(
            f"{path} holds label {int(labels.max())}, expected labels in 0..9 for Fashion-MNIST."
        )
    return labels.astype(np.int32)


def _grey28_to_rgb32(images: np.ndarray) -> np.ndarray:
    """[N, 28, 28] grey -> [N, 32, 32, 3]: zero-pad 2 pixels, copy to RGB."""
    padded = np.pad(images, ((0, 0), (2, 2), (2, 2)))
    return np.repeat(padded[..., None], 3, axis=-1)


def _pixel_mean_std(pixels: np.ndarray) -> tuple[float, float]:
    """Mean and std of uint8 pixels in [0, 1] units.

    Computed from a 256-bin histogram, which is exact and needs no float copy of
    the images.
    """
    counts = np.bincount(pixels.ravel(), minlength=256).astype(np.float64)
    values = np.arange(256, dtype=np.float64) / 255.0
    total = counts.sum()
    mean = (counts * values).sum() / total
    variance = (counts * (values - mean) ** 2).sum() / total
    return float(mean), float(np.sqrt(variance))


# ---------------------------------------------------------------------------
# Per-step transforms (device side, jittable).
# ---------------------------------------------------------------------------


def normalize(images_uint8: jax.Array, mean, std) -> jax.Array:
    """Maps uint8 pixels to float32 `(x / 255 - mean) / std`, per channel.

    Args:
      images_uint8: uint8 [..., C] images.
      mean: C per-channel means in [0, 1] pixel units (e.g. `Dataset.mean`).
      std: C per-channel standard deviations in [0, 1] pixel units.

    Returns:
      float32 array of the same shape. Mixed-precision policies cast it to their
      compute dtype later; keeping float32 here keeps the data pipeline
      independent of the policy.
    """
    pixels = jnp.asarray(images_uint8).astype(jnp.float32) / 255.0
    mean = jnp.asarray(mean, dtype=jnp.float32)
    std = jnp.asarray(std, dtype=jnp.float32)
    return (pixels - mean) / std


def augment(rng: jax.Array, images_uint8: jax.Array) -> jax.Array:
    """Standard CIFAR augmentation: random 4-pixel-padded crop, random flip.

    For each image independently::

      padded = zero-pad the image by 4 pixels on each side (H+8, W+8)
      dy, dx = uniform integers in [0, 8]
      image  = padded[dy:dy+H, dx:dx+W]
      image  = image[:, ::-1] with probability 1/2

    Pure jax (vmap of `dynamic_slice`), so it jits and runs on the device.

    Args:
      rng: a PRNG key; each image gets its own key split from it.
      images_uint8: uint8 [N, H, W, C] images.

    Returns:
      uint8 [N, H, W, C] augmented images. Labels are unaffected by design.
    """
    keys = jax.random.split(rng, images_uint8.shape[0])
    return jax.vmap(_crop_and_flip)(keys, images_uint8)


def _crop_and_flip(rng: jax.Array, image: jax.Array) -> jax.Array:
    height, width, channels = image.shape
    pad = _AUGMENT_PADDING
    offset_rng, flip_rng = jax.random.split(rng)
    padded = jnp.pad(image, ((pad, pad), (pad, pad), (0, 0)))
    dy, dx = jax.random.randint(offset_rng, (2,), 0, 2 * pad + 1)
    cropped = jax.lax.dynamic_slice(padded, (dy, dx, 0), (height, width, channels))
    flip = jax.random.bernoulli(flip_rng)
    return jnp.where(flip, cropped[:, ::-1, :], cropped)


def epoch_batches(rng: jax.Array, num_examples: int, batch_size: int) -> jax.Array:
    """Shuffled example indices for one epoch, one row per step.

    The last `num_examples % batch_size` examples of the permutation are
    dropped, so every step has the same static batch shape (one compilation).
    Jittable with `num_examples` and `batch_size` static.

    Args:
      rng: a PRNG key; a new key per epoch gives a new order.
      num_examples: size of the dataset being indexed.
      batch_size: examples per step.

    Returns:
      int32 [num_examples // batch_size, batch_size] indices; no index repeats.

    Raises:
      ValueError: `batch_size` is not positive or exceeds `num_examples`.
    """
    if not 0 < batch_size <= num_examples:
        raise ValueError(
            f"batch_size={batch_size} must be in 1..num_examples={num_examples};"
            " lower the batch size or use more examples."
        )
    num_steps = num_examples // batch_size
    order = jax.random.permutation(rng, num_examples)
    kept = order[: num_steps * batch_size]
    return kept.reshape(num_steps, batch_size).astype(jnp.int32)
