"""Tests for `experiments.data`: loading, normalization, augmentation, batching.

Nothing here touches the network. The CIFAR-10 tests run the real TFDS
`cifar10` builder on a tiny archive written by the test, placed where a user
without network would place the real one; the network itself is switched off
(name resolution fails) so any attempt to download fails at once.
"""

import gzip
import hashlib
import io
import os
import sys
import tarfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import data

CIFAR10_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-binary.tar.gz"
CIFAR10_LABEL_NAMES = [
    "airplane",
    "automobile",
    "bird",
    "cat",
    "deer",
    "dog",
    "frog",
    "horse",
    "ship",
    "truck",
]
FASHION_MNIST_FILES = (
    "train-images-idx3-ubyte.gz",
    "train-labels-idx1-ubyte.gz",
    "t10k-images-idx3-ubyte.gz",
    "t10k-labels-idx1-ubyte.gz",
)


# ---------------------------------------------------------------------------
# Fixtures and file writers.
# ---------------------------------------------------------------------------


def random_examples(rng, count):
    images = rng.integers(0, 256, (count, 32, 32, 3), dtype=np.uint8)
    labels = rng.integers(0, 10, (count,), dtype=np.int32)
    return images, labels


def cifar_records(images, labels):
    """CIFAR-10 binary records: a label byte, then 3072 pixel bytes in CHW."""
    return b"".join(
        bytes([label]) + image.transpose(2, 0, 1).tobytes() for image, label in zip(images, labels)
    )


def write_cifar10_archive(path, train_per_file=2, num_test=3, seed=0):
    """Writes a tiny `cifar-10-binary.tar.gz` with the real layout.

    Returns:
      ((train_images, train_labels), (test_images, test_labels)) it holds, with
      HWC images, in file order.
    """
    rng = np.random.default_rng(seed)
    members = {}
    train_parts = []
    for batch in range(1, 6):
        images, labels = random_examples(rng, train_per_file)
        members[f"data_batch_{batch}.bin"] = cifar_records(images, labels)
        train_parts.append((images, labels))
    test = random_examples(rng, num_test)
    members["test_batch.bin"] = cifar_records(*test)
    label_names = "\n".join(CIFAR10_LABEL_NAMES) + "\n\n"
    members["batches.meta.txt"] = label_names.encode()

    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w:gz") as archive:
        for name, content in members.items():
            info = tarfile.TarInfo(f"cifar-10-batches-bin/{name}")
            info.size = len(content)
            archive.addfile(info, io.BytesIO(content))
    train = (
        np.concatenate([images for images, _ in train_parts]),
        np.concatenate([labels for _, labels in train_parts]),
    )
    return train, test


def cifar10_url_info(archive_path):
    """The size and sha256 of `archive_path`, as TFDS records them."""
    import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top

    content = archive_path.read_bytes()
    return tfds.download.checksums.UrlInfo(
        size=len(content),
        checksum=hashlib.sha256(content).hexdigest(),
        filename=archive_path.name,
    )


def register_cifar10_checksum(monkeypatch, archive_path):
    """Makes TFDS expect `archive_path`'s checksum for the CIFAR-10 URL.

    TFDS validates a manually placed archive against the checksum registered
    for its URL; this swaps the registered one for the fake archive's, for this
    test only. Everything else (finding the archive in the manual dir,
    validating it, extracting it, the builder's `_split_generators` and
    `_generate_examples`, writing and reading the prepared dataset) is TFDS's
    real code.
    """
    import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top

    url_info = cifar10_url_info(archive_path)
    monkeypatch.setattr(tfds.builder_cls("cifar10"), "url_infos", {CIFAR10_URL: url_info})
    return url_info


def sorted_examples(images, labels):
    """(label, pixel bytes) pairs in a canonical order: TFDS shuffles on write."""
    return sorted(zip(labels.tolist(), (image.tobytes() for image in images)))


def write_idx(path, magic, array):
    header = np.array([magic, *array.shape], dtype=">u4").tobytes()
    with gzip.open(path, "wb") as f:
        f.write(header + np.ascontiguousarray(array, dtype=np.uint8).tobytes())


def write_fashion_mnist(directory, num_train=4, num_test=3, seed=0):
    """Writes tiny Fashion-MNIST IDX files; returns (images, labels) per split."""
    rng = np.random.default_rng(seed)
    splits = {}
    for prefix, count in (("train", num_train), ("t10k", num_test)):
        images = rng.integers(0, 256, (count, 28, 28), dtype=np.uint8)
        labels = rng.integers(0, 10, (count,), dtype=np.uint8)
        write_idx(directory / f"{prefix}-images-idx3-ubyte.gz", 0x803, images)
        write_idx(directory / f"{prefix}-labels-idx1-ubyte.gz", 0x801, labels)
        splits[prefix] = (images, labels)
    return splits["train"], splits["t10k"]


# ---------------------------------------------------------------------------
# CIFAR-10 through TFDS, offline.
# ---------------------------------------------------------------------------


def test_cifar10_archive_placed_by_hand_is_prepared_offline_and_read_exactly(
    tmp_path, monkeypatch, offline, needs_tensorflow
):
    manual_archive = tmp_path / "downloads" / "manual" / "cifar-10-binary.tar.gz"
    (train_images, train_labels), (test_images, test_labels) = write_cifar10_archive(manual_archive)
    register_cifar10_checksum(monkeypatch, manual_archive)

    dataset = data.load_dataset("cifar10", data_dir=str(tmp_path))

    assert dataset.name == "cifar10"
    assert dataset.num_classes == 10
    assert dataset.train_images.shape == (10, 32, 32, 3)
    assert dataset.test_images.shape == (3, 32, 32, 3)
    assert dataset.train_images.dtype == dataset.test_images.dtype == np.uint8
    assert dataset.train_labels.dtype == dataset.test_labels.dtype == np.int32
    assert sorted_examples(dataset.train_images, dataset.train_labels) == (
        sorted_examples(train_images, train_labels)
    )
    assert sorted_examples(dataset.test_images, dataset.test_labels) == (
        sorted_examples(test_images, test_labels)
    )
    assert dataset.mean == pytest.approx((0.4914, 0.4822, 0.4465))
    assert dataset.std == pytest.approx((0.2470, 0.2435, 0.2616))

    # Once prepared, the archive is no longer needed, still without network.
    manual_archive.unlink()
    reloaded = data.load_dataset("cifar10", data_dir=str(tmp_path))
    assert sorted_examples(reloaded.test_images, reloaded.test_labels) == (
        sorted_examples(test_images, test_labels)
    )


def test_cifar10_archive_left_in_the_download_cache_is_prepared_offline(
    tmp_path, monkeypatch, offline, needs_tensorflow
):
    # What an earlier run leaves when it downloads the archive and then stops
    # before preparing: the file under its TFDS cache name, with an INFO file.
    import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top

    resource = tfds.download.resource
    staged_archive = tmp_path / "staging" / "cifar-10-binary.tar.gz"
    _, (test_images, test_labels) = write_cifar10_archive(staged_archive)
    url_info = register_cifar10_checksum(monkeypatch, staged_archive)
    cache_name = resource.get_dl_fname(CIFAR10_URL, url_info.checksum)
    cached_archive = tmp_path / "downloads" / cache_name
    cached_archive.parent.mkdir()
    staged_archive.rename(cached_archive)
    resource.write_info_file(
        url=CIFAR10_URL,
        path=cached_archive,
        dataset_name="cifar10",
        original_fname=staged_archive.name,
        url_info=url_info,
    )

    dataset = data.load_dataset("cifar10", data_dir=str(tmp_path))

    assert sorted_examples(dataset.test_images, dataset.test_labels) == (
        sorted_examples(test_images, test_labels)
    )


def test_cifar10_missing_offline_fails_fast_with_the_three_ways_forward(
    tmp_path, offline, needs_tensorflow_datasets
):
    start = time.monotonic()
    with pytest.raises(data.DataUnavailableError) as raised:
        data.load_dataset("cifar10", data_dir=str(tmp_path))
    elapsed = time.monotonic() - start

    # TFDS alone would retry the download with backoff for about 200 s.
    assert elapsed < 20
    message = str(raised.value)
    manual_dir = os.path.join(str(tmp_path), "downloads", "manual")
    assert str(tmp_path) in message
    assert manual_dir in message
    assert "cifar-10-binary.tar.gz" in message
    assert "network" in message
    assert "--data synthetic" in message
    assert not os.path.exists(os.path.join(manual_dir, "cifar-10-binary.tar.gz"))


def test_cifar10_archive_with_wrong_checksum_is_rejected_with_advice(
    tmp_path, offline, needs_tensorflow_datasets
):
    # Not registered: TFDS checks the fake archive against the real checksum.
    manual_archive = tmp_path / "downloads" / "manual" / "cifar-10-binary.tar.gz"
    write_cifar10_archive(manual_archive)

    with pytest.raises(data.DataUnavailableError) as raised:
        data.load_dataset("cifar10", data_dir=str(tmp_path))

    message = str(raised.value)
    assert str(manual_archive) in message
    assert "checksum" in message
    assert "--data synthetic" in message


# ---------------------------------------------------------------------------
# Fashion-MNIST from IDX files.
# ---------------------------------------------------------------------------


def test_fashion_mnist_is_padded_to_32_and_replicated_to_rgb(tmp_path):
    (train_images, train_labels), (test_images, test_labels) = write_fashion_mnist(tmp_path)

    dataset = data.load_dataset("fashion_mnist", data_dir=str(tmp_path))

    assert dataset.name == "fashion_mnist"
    assert dataset.num_classes == 10
    assert dataset.train_images.shape == (4, 32, 32, 3)
    assert dataset.test_images.shape == (3, 32, 32, 3)
    assert dataset.train_images.dtype == np.uint8
    assert dataset.train_labels.dtype == np.int32
    np.testing.assert_array_equal(dataset.train_labels, train_labels)
    np.testing.assert_array_equal(dataset.test_labels, test_labels)
    for channel in range(3):
        np.testing.assert_array_equal(dataset.train_images[:, 2:30, 2:30, channel], train_images)
        np.testing.assert_array_equal(dataset.test_images[:, 2:30, 2:30, channel], test_images)
    border = np.ones((32, 32), bool)
    border[2:30, 2:30] = False
    assert not dataset.train_images[:, border].any()
    # Mean and std are those of the converted training pixels, padding included.
    pixels = dataset.train_images.astype(np.float64) / 255
    assert dataset.mean == pytest.approx((pixels.mean(),) * 3)
    assert dataset.std == pytest.approx((pixels.std(),) * 3)


def test_fashion_mnist_missing_files_name_directory_files_and_package(tmp_path):
    with pytest.raises(data.DataUnavailableError) as raised:
        data.load_dataset("fashion_mnist", data_dir=str(tmp_path))

    message = str(raised.value)
    assert str(tmp_path) in message
    for name in FASHION_MNIST_FILES:
        assert name in message
    assert "apt-get install dataset-fashion-mnist" in message
    assert "--data-dir" in message
    # The advice, verbatim: what is expected, what is missing, and every way forward.
    assert message.splitlines() == [
        (
            f"Fashion-MNIST not found in {tmp_path}: expected the IDX files {', '.join(FASHION_MNIST_FILES)};"
            " none is there."
        ),
        "Ways forward:",
        "  1. `apt-get install dataset-fashion-mnist`, which puts them in /usr/share/datasets/fashion-mnist.",
        "  2. Pass `--data-dir DIR` naming a directory that holds the four original IDX .gz files.",
        "  3. Pass `--data synthetic` for timing or offline runs.",
    ]


def test_fashion_mnist_file_with_wrong_magic_number_is_named(tmp_path):
    write_fashion_mnist(tmp_path)
    bad_file = tmp_path / "train-labels-idx1-ubyte.gz"
    write_idx(bad_file, 0x803, np.zeros((4, 28, 28), np.uint8))

    with pytest.raises(data.DataUnavailableError, match="magic number") as raised:
        data.load_dataset("fashion_mnist", data_dir=str(tmp_path))
    message = str(raised.value)
    assert str(bad_file) in message
    # The number the file starts with (an images file's) and the one a labels file must.
    assert "starts with magic number 0x00000803, expected 0x00000801" in message
    assert message.endswith("Reinstall it.")


def test_fashion_mnist_truncated_file_is_named(tmp_path):
    write_fashion_mnist(tmp_path)
    bad_file = tmp_path / "t10k-images-idx3-ubyte.gz"
    with gzip.open(bad_file, "rb") as f:
        content = f.read()
    with gzip.open(bad_file, "wb") as f:
        f.write(content[:-100])

    with pytest.raises(data.DataUnavailableError, match="truncated") as raised:
        data.load_dataset("fashion_mnist", data_dir=str(tmp_path))
    assert str(bad_file) in str(raised.value)
    assert str(raised.value).endswith("the file is truncated or damaged. Reinstall it.")


@pytest.mark.skipif(
    not all(os.path.exists(os.path.join(data.FASHION_MNIST_DIR, name)) for name in FASHION_MNIST_FILES),
    reason="dataset-fashion-mnist is not installed",
)
def test_fashion_mnist_from_the_debian_package():
    dataset = data.load_dataset("fashion_mnist")

    assert dataset.train_images.shape == (60_000, 32, 32, 3)
    assert dataset.test_images.shape == (10_000, 32, 32, 3)
    assert dataset.train_labels.shape == (60_000,)
    assert dataset.test_labels.shape == (10_000,)
    assert set(np.unique(dataset.train_labels)) == set(range(10))
    assert set(np.unique(dataset.test_labels)) == set(range(10))
    # The well-known 28x28 mean (0.2860), diluted by the black padding.
    assert dataset.mean[0] == pytest.approx(0.2860 * 28**2 / 32**2, abs=1e-3)
    assert 0.2 < dataset.std[0] < 0.4


# ---------------------------------------------------------------------------
# Synthetic data and argument checking.
# ---------------------------------------------------------------------------


def test_synthetic_source_matches_the_real_split_sizes():
    dataset = data.load_dataset("cifar10", source="synthetic", seed=1)

    assert dataset.name == "synthetic"
    assert dataset.train_images.shape == (50_000, 32, 32, 3)
    assert dataset.test_images.shape == (10_000, 32, 32, 3)
    assert dataset.train_images.dtype == np.uint8
    assert dataset.train_labels.dtype == np.int32
    assert dataset.num_classes == 10
    # The constant mean and std describe the random pixels.
    pixels = dataset.test_images[:1000].astype(np.float64) / 255
    assert dataset.mean == pytest.approx(pixels.mean(axis=(0, 1, 2)), abs=0.01)
    assert dataset.std == pytest.approx(pixels.std(axis=(0, 1, 2)), abs=0.01)


def test_synthetic_data_is_determined_by_its_seed():
    first = data.synthetic_dataset(8, 4, num_classes=3, seed=5)
    again = data.synthetic_dataset(8, 4, num_classes=3, seed=5)
    other = data.synthetic_dataset(8, 4, num_classes=3, seed=6)

    np.testing.assert_array_equal(first.train_images, again.train_images)
    np.testing.assert_array_equal(first.test_labels, again.test_labels)
    assert not np.array_equal(first.train_images, other.train_images)
    assert set(first.train_labels.tolist()) <= {0, 1, 2}


@pytest.mark.parametrize(
    "kwargs, bad_value, choices",
    [
        (
            {"dataset": "cifar100"},
            "cifar100",
            "cifar10, fashion_mnist, synthetic",
        ),
        ({"source": "disk"}, "disk", "tfds, synthetic"),
    ],
)
def test_unknown_dataset_or_source_names_value_and_choices(kwargs, bad_value, choices):
    with pytest.raises(ValueError) as raised:
        data.load_dataset(**kwargs)

    assert repr(bad_value) in str(raised.value)
    assert choices in str(raised.value)


# ---------------------------------------------------------------------------
# Device-side transforms.
# ---------------------------------------------------------------------------


def test_normalize_maps_pixels_to_standardized_float32():
    images = jnp.array([[[[0, 255, 51]]]], dtype=jnp.uint8)
    mean, std = (0.5, 0.25, 0.2), (0.5, 0.25, 0.1)

    normalized = jax.jit(data.normalize)(images, mean, std)

    assert normalized.dtype == jnp.float32
    assert normalized.shape == (1, 1, 1, 3)
    np.testing.assert_allclose(normalized[0, 0, 0], [-1.0, 3.0, 0.0], atol=1e-6)


def find_crop(padded, output):
    """(dy, dx, flipped) such that `output` is that crop of `padded`, or None."""
    height, width, _ = output.shape
    windows = np.lib.stride_tricks.sliding_window_view(
        padded, (height, width), axis=(0, 1)
    )  # [9, 9, C, H, W]
    windows = np.moveaxis(windows, 2, -1)  # [9, 9, H, W, C]
    for flipped, candidate in ((False, output), (True, output[:, ::-1])):
        matches = np.argwhere(np.all(windows == candidate, axis=(2, 3, 4)))
        if len(matches):
            dy, dx = matches[0]
            return int(dy), int(dx), flipped
    return None


def test_augment_crops_each_image_from_its_own_padding_and_flips_half():
    images = jax.random.randint(jax.random.key(0), (256, 32, 32, 3), 0, 256, dtype=jnp.int32).astype(
        jnp.uint8
    )

    augmented = jax.jit(data.augment)(jax.random.key(1), images)

    assert augmented.shape == images.shape
    assert augmented.dtype == jnp.uint8
    padded = np.pad(np.asarray(images), ((0, 0), (4, 4), (4, 4), (0, 0)))
    crops = [find_crop(p, a) for p, a in zip(padded, np.asarray(augmented))]
    # Output i comes from input i, so labels indexed alongside stay aligned.
    assert None not in crops
    offsets_y = {dy for dy, _, _ in crops}
    offsets_x = {dx for _, dx, _ in crops}
    assert offsets_y == offsets_x == set(range(9))
    flip_fraction = np.mean([flipped for _, _, flipped in crops])
    assert 0.35 < flip_fraction < 0.65


def test_augment_depends_on_its_key():
    images = jnp.arange(8 * 32 * 32 * 3, dtype=jnp.int32).reshape(8, 32, 32, 3)
    images = (images % 251).astype(jnp.uint8)
    augment = jax.jit(data.augment)

    first = augment(jax.random.key(0), images)

    np.testing.assert_array_equal(first, augment(jax.random.key(0), images))
    assert not np.array_equal(first, augment(jax.random.key(1), images))


def test_epoch_batches_are_a_permutation_without_the_remainder():
    batches_fn = jax.jit(data.epoch_batches, static_argnums=(1, 2))

    batches = batches_fn(jax.random.key(0), 103, 10)

    assert batches.shape == (10, 10)
    assert batches.dtype == jnp.int32
    indices = np.asarray(batches).ravel()
    assert len(set(indices.tolist())) == 100
    assert indices.min() >= 0 and indices.max() < 103
    assert not np.array_equal(indices, np.sort(indices))
    other_epoch = batches_fn(jax.random.key(1), 103, 10)
    assert not np.array_equal(batches, other_epoch)


@pytest.mark.parametrize("batch_size", [0, 104])
def test_epoch_batches_rejects_impossible_batch_size(batch_size):
    with pytest.raises(ValueError, match=f"batch_size={batch_size}"):
        data.epoch_batches(jax.random.key(0), 103, batch_size)


def test_cifar10_without_tensorflow_datasets_says_how_to_get_it(monkeypatch, needs_tensorflow):
    monkeypatch.setitem(sys.modules, "tensorflow_datasets", None)  # makes the import fail

    with pytest.raises(data.DataUnavailableError, match="pip install -e . --group experiments") as error:
        data.load_dataset("cifar10", "tfds")
    assert "--data synthetic" in str(error.value)
    assert str(error.value).splitlines()[1:] == [
        "Ways forward:",
        "  1. Install the experiments' dependencies (pip >= 25.1): pip install -e . --group experiments",
        "  2. Pass `--data synthetic` for timing or offline runs.",
    ]
