"""CIFAR-10 where TensorFlow is not installed: read straight from its binary archive.

TFDS needs TensorFlow to extract the archive, to encode its images while
preparing it and to read the TFRecord files it writes (measured in a virtual
environment without TensorFlow: the extraction fails with "No module named
'tensorflow'"). TensorFlow is an optional dependency group, so without it
`experiments.data` reads the archive itself, importing neither TensorFlow nor
TFDS: placed by hand, left in TFDS's download cache, or downloaded. Each test
here hides TensorFlow from the process (an import of it fails, as where it is
not installed); nothing is downloaded from outside: the download is served
from this machine.
"""

import functools
import hashlib
import http.server
import os
import sys
import threading

import numpy as np
import pytest
from test_data import CIFAR10_URL, register_cifar10_checksum, write_cifar10_archive

from experiments import data

tfds = pytest.importorskip(
    "tensorflow_datasets", reason="CIFAR-10's checksum is TFDS's: the experiments group"
)


@pytest.fixture
def without_tensorflow(monkeypatch):
    """An import of TensorFlow fails, as where it is not installed."""
    monkeypatch.setitem(sys.modules, "tensorflow", None)
    assert not data.tensorflow_installed()


def register_checksum(monkeypatch, archive_path):
    """Makes `archive_path`'s size and SHA-256 the ones expected, for this test only."""
    content = archive_path.read_bytes()
    monkeypatch.setattr(data, "_CIFAR10_SIZE", len(content))
    monkeypatch.setattr(data, "_CIFAR10_SHA256", hashlib.sha256(content).hexdigest())


def test_the_archive_is_checked_against_the_size_and_checksum_tfds_registered():
    tfds = pytest.importorskip("tensorflow_datasets", reason="TFDS comes with the experiments group")
    registered = tfds.builder_cls("cifar10").url_infos[CIFAR10_URL]
    assert (data._CIFAR10_SIZE, data._CIFAR10_SHA256) == (int(registered.size), registered.checksum)


def in_file_order(split):
    images, labels = split
    return labels.tolist(), images.tobytes()


def files_under(folder):
    return sorted(os.path.relpath(os.path.join(root, name), folder) for root, _, names in os.walk(folder)
                  for name in names)  # fmt: skip


def test_a_placed_archive_is_read_exactly_in_file_order_and_nothing_is_prepared(
    tmp_path, monkeypatch, offline, without_tensorflow
):
    """Fails where TFDS is asked to prepare the archive (without TensorFlow it cannot), or where the
    channels, the record layout or the split files are read wrong."""
    archive = tmp_path / "downloads" / "manual" / "cifar-10-binary.tar.gz"
    train, test = write_cifar10_archive(archive, train_per_file=3, num_test=4)
    register_checksum(monkeypatch, archive)

    dataset = data.load_dataset("cifar10", data_dir=str(tmp_path))

    assert dataset.train_images.shape == (15, 32, 32, 3) and dataset.test_images.shape == (4, 32, 32, 3)
    assert dataset.train_images.dtype == dataset.test_images.dtype == np.uint8
    assert dataset.train_labels.dtype == dataset.test_labels.dtype == np.int32
    assert in_file_order((dataset.train_images, dataset.train_labels)) == in_file_order(train)
    assert in_file_order((dataset.test_images, dataset.test_labels)) == in_file_order(test)
    assert (dataset.name, dataset.num_classes) == ("cifar10", 10)
    assert dataset.mean == pytest.approx((0.4914, 0.4822, 0.4465))
    assert files_under(tmp_path) == ["downloads/manual/cifar-10-binary.tar.gz"]


def test_an_archive_an_earlier_run_left_in_the_download_cache_is_read(
    tmp_path, monkeypatch, offline, without_tensorflow
):
    cached = tmp_path / "downloads" / "cs.toronto.edu_kriz_cifar-10-binaryXYZ.tar.gz"
    _, test = write_cifar10_archive(cached)
    (tmp_path / "downloads" / "cs.toronto.edu_kriz_cifar-10-binaryXYZ.tar.gz.INFO").write_text("{}")
    register_checksum(monkeypatch, cached)

    dataset = data.load_dataset("cifar10", data_dir=str(tmp_path))

    assert in_file_order((dataset.test_images, dataset.test_labels)) == in_file_order(test)


def test_an_archive_of_another_checksum_is_refused_naming_it_with_the_ways_forward(
    tmp_path, offline, without_tensorflow
):
    """Not registered: the fake archive is checked against the real one's size and checksum."""
    archive = tmp_path / "downloads" / "manual" / "cifar-10-binary.tar.gz"
    write_cifar10_archive(archive)

    with pytest.raises(data.DataUnavailableError) as raised:
        data.load_dataset("cifar10", data_dir=str(tmp_path))

    assert str(raised.value).splitlines() == [
        (
            f"{archive} is not the CIFAR-10 archive this project expects: its size or checksum differs from"
            f" the ones TFDS registered for {CIFAR10_URL} (an interrupted download, or another file)."
        ),
        "Ways forward:",
        f"  1. Download {CIFAR10_URL} again, replace the file, and rerun.",
        "  2. Delete the file and run with network access; it is downloaded.",
        "  3. Pass `--data synthetic` for timing or offline runs.",
    ]


def test_an_archive_without_its_test_file_is_refused_naming_the_archive_and_the_file(
    tmp_path, monkeypatch, offline, without_tensorflow
):
    """An archive with the registered checksum whose content is not CIFAR-10's (the checksum
    registered for it here): one message, not a KeyError from tarfile."""
    import tarfile  # pylint: disable=import-outside-toplevel

    full = tmp_path / "full.tar.gz"
    write_cifar10_archive(full)
    archive = tmp_path / "downloads" / "manual" / "cifar-10-binary.tar.gz"
    archive.parent.mkdir(parents=True)
    with tarfile.open(full) as source, tarfile.open(archive, "w:gz") as target:
        for member in source.getmembers():
            if not member.name.endswith("test_batch.bin"):
                target.addfile(member, source.extractfile(member))
    register_checksum(monkeypatch, archive)

    with pytest.raises(data.DataUnavailableError) as raised:
        data.load_dataset("cifar10", data_dir=str(tmp_path))

    assert str(raised.value).startswith(f"{archive} cannot be read as CIFAR-10's archive (KeyError: ")
    assert "test_batch.bin" in str(raised.value) and "--data synthetic" in str(raised.value)


def test_offline_with_no_archive_it_fails_at_once_with_the_three_ways_forward_and_creates_nothing(
    tmp_path, offline, without_tensorflow
):
    manual_dir = tmp_path / "downloads" / "manual"

    with pytest.raises(data.DataUnavailableError) as raised:
        data.load_dataset("cifar10", data_dir=str(tmp_path))

    lines = str(raised.value).splitlines()
    assert lines[0].startswith(f"CIFAR-10 is not in {manual_dir} and could not be downloaded (cannot reach ")
    archive = manual_dir / "cifar-10-binary.tar.gz"
    assert lines[1:] == [
        "Ways forward:",
        (
            f"  1. Run once with network access; CIFAR-10's archive (162 MiB) is downloaded to {archive}"
            " and read from there."
        ),
        (
            f"  2. Download {CIFAR10_URL} elsewhere, place cifar-10-binary.tar.gz in {manual_dir}, and"
            " rerun (its checksum is checked)."
        ),
        "  3. Pass `--data synthetic` for timing or offline runs (random images; accuracy means nothing).",
    ]
    assert files_under(tmp_path) == []


@pytest.fixture
def local_server(tmp_path, monkeypatch):
    """Serves the files of a folder on this machine; the CIFAR-10 URL is pointed at it."""
    served = tmp_path / "served"
    served.mkdir()
    for name in list(os.environ):
        if name.lower().endswith("_proxy"):
            monkeypatch.delenv(name)
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(served))
    handler.log_message = lambda *args: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{server.server_address[1]}/cifar-10-binary.tar.gz"
    monkeypatch.setattr(data, "_CIFAR10_URL", url)
    yield served, url
    server.shutdown()
    server.server_close()


def test_with_no_archive_it_is_downloaded_into_the_manual_folder_and_read(
    tmp_path, monkeypatch, local_server, without_tensorflow, capsys
):
    served, url = local_server
    train, test = write_cifar10_archive(served / "cifar-10-binary.tar.gz")
    register_checksum(monkeypatch, served / "cifar-10-binary.tar.gz")
    data_dir = tmp_path / "tensorflow_datasets"

    dataset = data.load_dataset("cifar10", data_dir=str(data_dir))

    archive = data_dir / "downloads" / "manual" / "cifar-10-binary.tar.gz"
    assert archive.read_bytes() == (served / "cifar-10-binary.tar.gz").read_bytes()
    assert files_under(data_dir) == ["downloads/manual/cifar-10-binary.tar.gz"]  # no .part left
    assert in_file_order((dataset.train_images, dataset.train_labels)) == in_file_order(train)
    assert in_file_order((dataset.test_images, dataset.test_labels)) == in_file_order(test)
    assert f"Downloading {url} (162 MiB) to {archive}" in capsys.readouterr().err


@pytest.mark.usefixtures("local_server")  # serving nothing: a 404
def test_a_download_that_fails_names_the_error_and_leaves_no_partial_file(tmp_path, without_tensorflow):
    data_dir = tmp_path / "tensorflow_datasets"

    with pytest.raises(data.DataUnavailableError) as raised:
        data.load_dataset("cifar10", data_dir=str(data_dir))

    manual_dir = data_dir / "downloads" / "manual"
    assert str(raised.value).startswith(
        f"CIFAR-10 is not in {manual_dir} and could not be downloaded (HTTPError: HTTP Error 404"
    )
    assert files_under(data_dir) == []


def test_a_set_tfds_prepared_with_tensorflow_and_no_archive_names_the_group_to_install(
    tmp_path, monkeypatch, offline, needs_tensorflow
):
    """TFDS's TFRecord files need TensorFlow to read; the advice names the group that has it."""
    archive = tmp_path / "downloads" / "manual" / "cifar-10-binary.tar.gz"
    write_cifar10_archive(archive)
    register_cifar10_checksum(monkeypatch, archive)
    data.load_dataset("cifar10", data_dir=str(tmp_path))  # prepared, with TensorFlow
    archive.unlink()
    monkeypatch.setitem(sys.modules, "tensorflow", None)

    with pytest.raises(data.DataUnavailableError) as raised:
        data.load_dataset("cifar10", data_dir=str(tmp_path))

    lines = str(raised.value).splitlines()
    assert lines[0] == (
        f"CIFAR-10 is prepared in the TFDS data dir {tmp_path} as TFRecord files, which only TensorFlow "
        "reads, and TensorFlow is not installed."
    )
    assert lines[2] == "  1. Install it (pip >= 25.1): pip install --group tensorflow"
