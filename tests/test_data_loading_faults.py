"""The loading half of `experiments.data`, fault by fault, without TFDS and without a network.

`tests/test_data.py` prepares CIFAR-10 through TFDS from a small archive and
reads small Fashion-MNIST IDX files; the tests here pin down the pieces
around them that a whole load passes through only on one path: the network
probe (port, timeout, proxies), the download-cache check, the advice
messages' branches, the permission check's mode, the IDX header checks and
the filter that keeps TFDS's own warning out of the way. Each test names
the fault it catches.
"""

import gzip
import logging
import os
import socket
import urllib.request

import numpy as np
import pytest
from test_data import write_fashion_mnist, write_idx

from experiments import data


class _Connection:
    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        return False


@pytest.fixture
def probes(monkeypatch):
    """Records every connection the probe opens; no proxy configured."""
    calls = []

    def create_connection(address, timeout):
        calls.append((address, timeout))
        return _Connection()

    monkeypatch.setattr(socket, "create_connection", create_connection)
    monkeypatch.setattr(urllib.request, "getproxies", dict)
    return calls


@pytest.mark.parametrize(
    "url, address",
    [
        ("https://www.cs.toronto.edu/~kriz/cifar-10-binary.tar.gz", ("www.cs.toronto.edu", 443)),
        ("http://example.org/data.tar.gz", ("example.org", 80)),
        ("https://example.org:8443/data.tar.gz", ("example.org", 8443)),
    ],
)
def test_the_network_probe_connects_to_the_urls_host_and_port_with_its_timeout(probes, url, address):
    """Fails if the default port (443 for https, 80 otherwise), the host or the 5 s timeout changes."""
    assert data._unreachable_reason(url) is None
    assert probes == [(address, 5.0)]


def test_an_unreachable_host_is_named_with_the_reason(monkeypatch):
    def refuse(address, timeout):
        raise ConnectionRefusedError(111, "Connection refused")

    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(urllib.request, "getproxies", dict)
    reason = data._unreachable_reason("https://www.cs.toronto.edu/x.tar.gz")
    assert reason == "cannot reach www.cs.toronto.edu: [Errno 111] Connection refused"


def test_with_a_proxy_for_the_urls_scheme_nothing_is_probed_and_with_another_schemes_it_is(
    probes, monkeypatch
):
    """Fails if the proxy check is dropped, inverted, or reads another scheme's proxy."""
    monkeypatch.setattr(urllib.request, "getproxies", lambda: {"https": "http://proxy:3128"})
    assert data._unreachable_reason("https://example.org/a") is None
    assert probes == []
    monkeypatch.setattr(urllib.request, "getproxies", lambda: {"http": "http://proxy:3128"})
    assert data._unreachable_reason("https://example.org/a") is None
    assert probes == [(("example.org", 443), 5.0)]


class _Builder:
    """What the loading helpers read of a TFDS builder: its data dir root."""

    def __init__(self, root):
        self.data_dir_root = root


class _PreparingBuilder(_Builder):
    """What `_prepare_cifar10` uses of a TFDS builder: whether it is prepared, and its download.

    The download records the configuration it is given and raises `failure`, if any.
    """

    def __init__(self, root, prepared, failure=None):
        super().__init__(root)
        self.prepared, self.failure, self.configs = prepared, failure, []

    def is_prepared(self):
        return self.prepared

    def download_and_prepare(self, download_config):
        self.configs.append(download_config)
        if self.failure is not None:
            raise self.failure


def test_an_archive_in_the_download_cache_is_found_by_its_name_and_nothing_else_is(tmp_path):
    builder = _Builder(tmp_path)
    assert not data._has_cached_download(builder)  # no downloads folder at all
    downloads = tmp_path / "downloads"
    downloads.mkdir()
    (downloads / "other_dataset.tar.gz").write_bytes(b"")
    (tmp_path / "www.cs.toronto.edu_kriz_cifar-10-binary.tar.gz").write_bytes(b"")  # not in downloads/
    assert not data._has_cached_download(builder)
    (downloads / "cs.toronto.edu_kriz_cifar-10-binaryXYZ.tar.gz").write_bytes(b"")
    assert data._has_cached_download(builder)


def test_the_unavailable_message_tells_a_placed_archive_from_a_missing_one(tmp_path):
    """Fails if the two branches swap, an empty manual folder passes for the archive, or the data dir,
    the manual folder or the reason go missing."""
    builder = _Builder(tmp_path / "tfds")
    manual_dir = str(tmp_path / "manual")
    message = data._cifar10_unavailable_message(builder, manual_dir, "REASON")
    assert f"{manual_dir}: not there." in message
    assert f"TFDS data dir {tmp_path / 'tfds'} and TFDS could not get it (REASON)" in message
    assert "--data synthetic" in message
    os.makedirs(manual_dir)  # the folder alone is not the archive
    assert f"{manual_dir}: not there." in data._cifar10_unavailable_message(builder, manual_dir, "REASON")
    with open(os.path.join(manual_dir, "cifar-10-binary.tar.gz"), "wb"):
        pass
    message = data._cifar10_unavailable_message(builder, manual_dir, "REASON")
    assert f"{manual_dir}: found, but preparing from it failed." in message


@pytest.mark.parametrize(
    "text, first", [("first line\nsecond line", "first line"), ("\n  only  \n", "only"), ("", "no details")]
)
def test_an_errors_first_line_stands_for_it(text, first):
    assert data._first_line(RuntimeError(text)) == first


@pytest.mark.parametrize(
    "writable, mode, needed",
    [
        ({}, os.R_OK | os.X_OK, "read"),  # the default: Fashion-MNIST's loader passes nothing
        ({"writable": False}, os.R_OK | os.X_OK, "read"),
        ({"writable": True}, os.R_OK | os.X_OK | os.W_OK, "read and write"),
    ],
)
def test_a_data_folder_is_checked_for_the_access_its_loader_needs(
    tmp_path, monkeypatch, writable, mode, needed
):
    """CIFAR-10's folder must be writable too (TFDS prepares there), Fashion-MNIST's only readable.

    The check asks `os.access` for exactly that mode with the effective ids;
    refused, the message says what was needed. Fails if the mode loses a
    bit, gains write for Fashion-MNIST (also by default), or the effective
    ids are dropped.
    """
    asked = []

    def access(path, requested, effective_ids):
        asked.append((path, requested, effective_ids))
        return granted

    monkeypatch.setattr(os, "access", access)
    granted = True
    data._check_readable_folder(str(tmp_path), "NAME", **writable)
    assert asked == [(str(tmp_path), mode, data._EFFECTIVE_IDS)]
    granted = False
    with pytest.raises(data.DataUnavailableError) as raised:
        data._check_readable_folder(str(tmp_path), "NAME", **writable)
    assert str(raised.value).startswith(f"No permission to {needed} the NAME data folder {tmp_path};")


def test_a_missing_data_folder_passes_the_check_and_a_file_does_not(tmp_path):
    """A folder that is not there yet is left to the loader (TFDS creates it); a file is refused."""
    data._check_readable_folder(str(tmp_path / "not_yet"), "CIFAR-10", writable=True)
    a_file = tmp_path / "notes.txt"
    a_file.write_text("x")
    with pytest.raises(data.DataUnavailableError) as raised:
        data._check_readable_folder(str(a_file), "Fashion-MNIST")
    assert str(raised.value).startswith(f"--data-dir {a_file} is a file, not a folder. For Fashion-MNIST,")


def test_a_file_given_as_the_data_folder_gets_the_advice_of_its_data_set(tmp_path):
    fashion = data._a_file_given_as_data_dir("/x/notes.txt", "Fashion-MNIST")
    assert "For Fashion-MNIST" in fashion
    for name in ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz", "t10k-images-idx3-ubyte.gz",
                 "t10k-labels-idx1-ubyte.gz"):  # fmt: skip
        assert name in fashion
    other = data._a_file_given_as_data_dir(str(tmp_path / "notes.txt"), "CIFAR-10")
    assert "TFDS data folder" in other and "mkdir" not in other
    archive = data._a_file_given_as_data_dir(str(tmp_path / "cifar-10-binary.tar.gz"), "CIFAR-10")
    folder = tmp_path / "tensorflow_datasets"
    assert archive.startswith(f"--data-dir {tmp_path / 'cifar-10-binary.tar.gz'} is a file, not a folder.")
    assert f"mkdir -p {folder / 'downloads' / 'manual'}" in archive
    assert archive.endswith(f"pass --data-dir {folder}.")


def test_missing_idx_files_are_listed_and_a_folder_by_a_files_name_counts_as_missing(tmp_path):
    write_fashion_mnist(tmp_path)
    os.remove(tmp_path / "t10k-labels-idx1-ubyte.gz")
    os.remove(tmp_path / "train-images-idx3-ubyte.gz")
    os.mkdir(tmp_path / "train-images-idx3-ubyte.gz")
    with pytest.raises(data.DataUnavailableError) as raised:
        data._check_fashion_mnist_files(str(tmp_path))
    assert "; train-images-idx3-ubyte.gz, t10k-labels-idx1-ubyte.gz missing." in str(raised.value)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(data.DataUnavailableError, match="; none is there"):
        data._check_fashion_mnist_files(str(empty))


def test_a_file_that_is_not_gzip_is_named_as_damaged(tmp_path):
    path = tmp_path / "train-images-idx3-ubyte.gz"
    path.write_bytes(b"plain bytes, not gzip")
    with pytest.raises(gzip.BadGzipFile) as gzips_own, gzip.open(path, "rb") as f:
        f.read()
    with pytest.raises(data.DataUnavailableError) as raised:
        data._read_idx(str(path), 0x803, 3)
    # gzip's own words stand in the message as the cause.
    assert str(raised.value) == (
        f"{path} is not a readable gzip file (BadGzipFile: {gzips_own.value}); it is truncated or damaged."
        " Reinstall it."
    )


def test_an_unreadable_idx_file_is_named(tmp_path, monkeypatch):
    def refuse(path, mode):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(gzip, "open", refuse)
    with pytest.raises(data.DataUnavailableError, match=r"^No permission to read /data/x\.gz;"):
        data._read_idx("/data/x.gz", 0x803, 3)


@pytest.mark.parametrize("num_dims, size", [(3, 15), (1, 7)])
def test_a_file_shorter_than_its_header_is_named_with_both_sizes(tmp_path, num_dims, size):
    """The header is 4 bytes of magic and 4 per dimension: 16 for images, 8 for labels."""
    path = tmp_path / "short.gz"
    with gzip.open(path, "wb") as f:
        f.write(bytes(size))
    with pytest.raises(data.DataUnavailableError) as raised:
        data._read_idx(str(path), 0x800 + num_dims, num_dims)
    assert f"is {size} bytes, too short for an IDX header of {size + 1} bytes" in str(raised.value)


def test_an_idx_file_exactly_its_header_long_reads_as_empty(tmp_path):
    """No examples is a valid file (header sizes exact, no label to check)."""
    path = tmp_path / "labels.gz"
    write_idx(path, 0x801, np.zeros((0,), np.uint8))
    labels = data._read_idx_labels(str(path))
    assert labels.shape == (0,) and labels.dtype == np.int32
    write_idx(path, 0x803, np.zeros((0, 28, 28), np.uint8))
    assert data._read_idx_images(str(path)).shape == (0, 28, 28)


def test_images_of_another_size_and_labels_beyond_nine_are_named(tmp_path):
    images = tmp_path / "images.gz"
    write_idx(images, 0x803, np.zeros((2, 28, 27), np.uint8))
    with pytest.raises(data.DataUnavailableError, match=r"images of shape \(28, 27\), expected \(28, 28\)"):
        data._read_idx_images(str(images))
    labels = tmp_path / "labels.gz"
    write_idx(labels, 0x801, np.array([3, 10, 9], np.uint8))
    with pytest.raises(data.DataUnavailableError, match="holds label 10, expected labels in 0..9"):
        data._read_idx_labels(str(labels))
    write_idx(labels, 0x801, np.array([0, 9, 9], np.uint8))
    np.testing.assert_array_equal(data._read_idx_labels(str(labels)), [0, 9, 9])


def test_a_split_with_more_images_than_labels_is_refused_naming_both_counts(tmp_path):
    write_fashion_mnist(tmp_path, num_train=4, num_test=3)
    write_idx(tmp_path / "t10k-labels-idx1-ubyte.gz", 0x801, np.zeros((2,), np.uint8))
    with pytest.raises(data.DataUnavailableError) as raised:
        data.load_dataset("fashion_mnist", data_dir=str(tmp_path))
    message = str(raised.value)
    assert message.startswith(
        "t10k-images-idx3-ubyte.gz holds 3 images but t10k-labels-idx1-ubyte.gz holds 2"
    )
    assert f"(in {tmp_path})" in message
    assert message.endswith("Reinstall them with `apt-get install --reinstall dataset-fashion-mnist`.")


def test_fashion_mnists_default_folder_is_the_debian_packages(monkeypatch):
    """`load_dataset('fashion_mnist')` without a folder reads /usr/share/datasets/fashion-mnist."""
    seen = []
    monkeypatch.setattr(data, "_load_fashion_mnist", lambda data_dir: seen.append(data_dir) or "loaded")
    assert data.load_dataset("fashion_mnist") == "loaded"
    assert data.load_dataset("fashion_mnist", data_dir="/elsewhere") == "loaded"
    assert seen == ["/usr/share/datasets/fashion-mnist", "/elsewhere"]


def test_only_tfdss_unprepared_warning_is_silenced_and_only_inside_the_block(caplog):
    """Fails if the filter drops other absl messages, keeps TFDS's, or outlives the block."""
    logger = logging.getLogger("absl")
    unprepared = ("Variant folder %s has no %s", "/tfds/cifar10/3.0.2", "dataset_info.json")
    with caplog.at_level(logging.WARNING, logger="absl"):
        with data._without_tfds_unprepared_warnings():
            logger.warning(*unprepared)
            logger.warning("Variant folder of another kind")
        logger.warning(*unprepared)
    assert [record.getMessage() for record in caplog.records] == [
        "Variant folder of another kind",
        "Variant folder /tfds/cifar10/3.0.2 has no dataset_info.json",
    ]


def test_mean_and_std_of_images_that_never_reach_white_are_those_of_their_pixels():
    """The histogram has 256 bins whatever the brightest pixel; fails if it stops at the brightest."""
    pixels = np.array([[[0, 10], [20, 100]], [[100, 100], [3, 0]]], np.uint8)
    mean, std = data._pixel_mean_std(pixels)
    assert mean == pytest.approx((pixels / 255).mean(), rel=1e-12)
    assert std == pytest.approx((pixels / 255).std(), rel=1e-12)


CIFAR10_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-binary.tar.gz"


def test_tfds_is_told_the_manual_folder_the_advice_names_and_not_to_try_prepared_copies_on_gcs(
    tmp_path, needs_tensorflow_datasets
):
    """Fails if the download configuration is dropped, loses its manual folder, or lets TFDS try GCS
    (offline, some TFDS versions block for minutes there)."""
    builder = _PreparingBuilder(tmp_path, prepared=True)
    manual_dir = str(tmp_path / "elsewhere" / "manual")
    data._prepare_cifar10(builder, manual_dir)
    [config] = builder.configs
    assert os.fspath(config.manual_dir) == manual_dir
    assert config.try_download_gcs is False


def test_with_nothing_to_prepare_from_the_cifar10_host_is_probed_and_why_it_failed_is_said(
    tmp_path, monkeypatch, needs_tensorflow_datasets
):
    """Fails if another URL is probed, or the probe's reason is lost from the advice."""
    probed = []
    monkeypatch.setattr(
        data, "_unreachable_reason", lambda url: probed.append(url) or "cannot reach HOST: WHY"
    )
    builder = _PreparingBuilder(tmp_path, prepared=False)
    manual_dir = str(tmp_path / "downloads" / "manual")
    with pytest.raises(data.DataUnavailableError) as raised:
        data._prepare_cifar10(builder, manual_dir)
    assert probed == [CIFAR10_URL]
    assert str(raised.value) == data._cifar10_unavailable_message(
        builder, manual_dir, "cannot reach HOST: WHY"
    )
    assert builder.configs == []  # TFDS's own download, which retries for minutes offline, never starts


def test_a_download_that_fails_is_reported_by_its_error_type_and_first_line(
    tmp_path, needs_tensorflow_datasets
):
    """TFDS fails downloads with many exception types; the advice names the one raised and its first line.

    Fails if the reason, the builder or the manual folder given to the advice changes, or the
    error is not chained.
    """
    failure = ConnectionResetError("Connection reset by peer\nwhile reading the archive")
    builder = _PreparingBuilder(tmp_path, prepared=True, failure=failure)
    manual_dir = str(tmp_path / "downloads" / "manual")
    with pytest.raises(data.DataUnavailableError) as raised:
        data._prepare_cifar10(builder, manual_dir)
    assert str(raised.value) == data._cifar10_unavailable_message(
        builder, manual_dir, "ConnectionResetError: Connection reset by peer"
    )
    assert raised.value.__cause__ is failure


@pytest.mark.parametrize("where", ["placed by hand", "left in the download cache"])
def test_an_archive_with_another_checksum_is_named_where_it_is_with_the_ways_forward(
    tmp_path, offline, needs_tensorflow_datasets, where
):
    """A placed archive is named by its path; a downloaded one (TFDS keeps it under another name)
    as "The downloaded archive". Fails if either is named as the other or the advice changes."""
    import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top

    manual_dir = tmp_path / "downloads" / "manual"
    manual_dir.mkdir(parents=True)
    archive = manual_dir / "cifar-10-binary.tar.gz"
    if where == "placed by hand":
        archive.write_bytes(b"")
        checked = str(archive)
    else:
        (tmp_path / "downloads" / "cs.toronto.edu_kriz_cifar-10-binaryXYZ.tar.gz").write_bytes(b"")
        checked = "The downloaded archive"
    failure = tfds.download.download_manager.NonMatchingChecksumError(CIFAR10_URL)
    builder = _PreparingBuilder(tmp_path, prepared=False, failure=failure)
    with pytest.raises(data.DataUnavailableError) as raised:
        data._prepare_cifar10(builder, str(manual_dir))
    assert str(raised.value).splitlines() == [
        (
            f"{checked} is not the CIFAR-10 archive TFDS expects: its size or checksum differs from the ones"
            f" TFDS registered for {CIFAR10_URL} (an interrupted download, or another file)."
        ),
        "Ways forward:",
        f"  1. Download {CIFAR10_URL} again, replace the file, and rerun.",
        "  2. Delete the file and run with network access; TFDS downloads it.",
        "  3. Pass `--data synthetic` for timing or offline runs.",
    ]
    assert raised.value.__cause__ is failure


@pytest.mark.parametrize("dataset", ["cifar10", "fashion_mnist"])
def test_a_folder_that_may_be_read_but_not_written_is_refused_for_cifar10_only(
    tmp_path, monkeypatch, dataset
):
    """TFDS prepares CIFAR-10 in its folder, so that one must be writable; Fashion-MNIST's is only read.

    Fails if CIFAR-10's loader stops asking for write access (TFDS would then fail on its own,
    later, in its own words) or Fashion-MNIST's starts to.
    """
    if dataset == "cifar10":
        pytest.importorskip("tensorflow_datasets", reason="preparing CIFAR-10 needs the experiments group")
    else:
        write_fashion_mnist(tmp_path)
    monkeypatch.setattr(os, "access", lambda path, mode, effective_ids: not mode & os.W_OK)
    if dataset == "fashion_mnist":
        assert data.load_dataset(dataset, data_dir=str(tmp_path)).train_images.shape == (4, 32, 32, 3)
        return
    with pytest.raises(data.DataUnavailableError) as raised:
        data.load_dataset(dataset, data_dir=str(tmp_path))
    assert str(raised.value).startswith(
        f"No permission to read and write the CIFAR-10 data folder {tmp_path};"
    )
