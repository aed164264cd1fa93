"""`--data tfds:NAME[:FEATURE]`: a TFDS text data set prepared beforehand, read as bytes.

The data sets here are tiny builders that the tests prepare into a temporary
TFDS data dir (ArrayRecord files, no network, no TensorFlow). Their classes
are not registered with TFDS, so the experiment finds them the way it finds a
data set prepared on another machine and copied over: by name, from the
files in ``--data-dir``.
"""

import sys

import numpy as np
import pytest

tfds = pytest.importorskip("tensorflow_datasets", reason="the TFDS data option needs tensorflow-datasets")

from experiments.lm import __main__ as lm_cli
from experiments.lm import config as config_lib
from experiments.lm import data as data_lib


def article(index):
    return f"article {index}: caf\u00e9 " * 4  # non-ASCII: two bytes per \u00e9


class LmTestArticles(tfds.core.GeneratorBasedBuilder, skip_registration=True):
    """Two text features (``text``, ``title``) and a number, in ``train`` and ``test``."""

    VERSION = tfds.core.Version("1.0.0")

    def _info(self):
        features = {"text": tfds.features.Text(), "title": tfds.features.Text(), "id": np.int64}
        return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict(features))

    def _split_generators(self, dl_manager):
        del dl_manager  # nothing to download
        return {"train": self._generate_examples(0, 40), "test": self._generate_examples(40, 46)}

    def _generate_examples(self, first, last):
        for index in range(first, last):
            yield index, {"text": article(index), "title": f"title {index}", "id": index}


class LmTestStory(tfds.core.GeneratorBasedBuilder, skip_registration=True):
    """One text feature and only a ``train`` split, of 100 lines."""

    VERSION = tfds.core.Version("1.0.0")

    def _info(self):
        features = tfds.features.FeaturesDict({"line": tfds.features.Text()})
        return tfds.core.DatasetInfo(builder=self, features=features)

    def _split_generators(self, dl_manager):
        del dl_manager
        return {"train": self._generate_examples()}

    def _generate_examples(self):
        for index in range(100):
            yield index, {"line": f"line {index} of the story"}


@pytest.fixture(scope="module")
def tfds_dir(tmp_path_factory):
    """A TFDS data dir holding both tiny data sets, prepared once for the module."""
    data_dir = str(tmp_path_factory.mktemp("tensorflow_datasets"))
    for builder_class in (LmTestArticles, LmTestStory):
        builder_class(data_dir=data_dir, file_format="array_record").download_and_prepare()
    return data_dir


def test_the_data_flag_parses_a_name_a_version_and_a_feature():
    parse = data_lib.parse_source
    assert parse("stdlib") == "stdlib"
    assert parse("tfds:tiny_shakespeare") == data_lib.TfdsSource("tiny_shakespeare")
    assert parse("tfds:lm1b:text") == data_lib.TfdsSource("lm1b", "text")
    assert parse("tfds:tiny_shakespeare:1.0.0") == data_lib.TfdsSource("tiny_shakespeare:1.0.0")
    assert parse("tfds:wiki/en:2.0.0:title") == data_lib.TfdsSource("wiki/en:2.0.0", "title")
    for bad in ("tfds:", "tfds:lm1b:", "wikipedia", "TFDS:lm1b"):
        with pytest.raises(
            ValueError, match=f"--data {bad!r} is invalid: expected stdlib, synthetic, or tfds"
        ):
            parse(bad)


def test_a_prepared_data_set_is_read_as_bytes_and_each_process_reads_only_its_share(tfds_dir):
    """Fails if examples are lost, doubled or shared between processes, if the held-out split is
    not the test split, or if the text is not UTF-8 bytes."""
    corpus = data_lib.load_corpus("tfds:lm_test_articles:text", tfds_dir)
    assert corpus.vocab_size == 256 and corpus.train.dtype == np.uint8
    train_text = bytes(corpus.train).decode()
    articles = train_text.split("\n")
    assert sorted(articles) == sorted(article(index) for index in range(40))
    assert sorted(bytes(corpus.held_out).decode().split("\n")) == sorted(article(i) for i in range(40, 46))
    assert corpus.train.size == len(train_text.encode()) > len(train_text)  # é is two bytes
    assert "train[0:40]" in corpus.description and "test[0:6]" in corpus.description

    shares = [
        data_lib.load_corpus("tfds:lm_test_articles:text", tfds_dir, process_index=index, process_count=2)
        for index in range(2)
    ]
    assert ["train[0:20]" in shares[0].description, "train[20:40]" in shares[1].description] == [True, True]
    assert bytes(shares[0].train) + b"\n" + bytes(shares[1].train) == bytes(corpus.train)
    assert bytes(shares[0].held_out) + b"\n" + bytes(shares[1].held_out) == bytes(corpus.held_out)


def test_three_processes_read_every_example_of_splits_of_95_and_5_exactly_once(tfds_dir):
    """The story's 100 lines are 95 for training and 5 held out, neither a multiple of 3: the
    three processes' shares (31, 32, 32 and 1, 2, 2 lines, by `tfds_share`) hold every line of
    each split once. Fails if neighbouring shares overlap at a boundary rounded up (a line read
    by two processes) or leave a gap (a line read by none)."""
    shares = [
        data_lib.load_corpus("tfds:lm_test_story", tfds_dir, process_index=index, process_count=3)
        for index in range(3)
    ]
    lines = {
        role: [bytes(getattr(share, role)).decode().split("\n") for share in shares]
        for role in ("train", "held_out")
    }
    assert [len(part) for part in lines["train"]] == [31, 32, 32]
    assert [len(part) for part in lines["held_out"]] == [1, 2, 2]
    whole = data_lib.load_corpus("tfds:lm_test_story", tfds_dir)
    read = {role: [line for part in parts for line in part] for role, parts in lines.items()}
    for role in ("train", "held_out"):
        assert read[role] == bytes(getattr(whole, role)).decode().split("\n"), role  # in file order
    every_line = read["train"] + read["held_out"]
    assert sorted(every_line) == sorted(f"line {index} of the story" for index in range(100))
    assert "process 2 of 3's share: train[63:95]" in shares[2].description


def test_without_a_held_out_split_the_last_five_percent_of_train_is_held_out(tfds_dir):
    corpus = data_lib.load_corpus("tfds:lm_test_story", tfds_dir)  # its only text feature: line
    train, held_out = (bytes(tokens).decode().split("\n") for tokens in (corpus.train, corpus.held_out))
    assert len(train) == 95 and len(held_out) == 5 and not set(train) & set(held_out)
    assert "train[0:95]" in corpus.description and "train[95:100]" in corpus.description


@pytest.mark.parametrize(
    "data, data_dir, message",
    [
        ("tfds:lm_test_articles", "prepared", "has text features text, title"),
        ("tfds:lm_test_articles:body", "prepared", "'body' is not a feature of the data set"),
        ("tfds:lm_test_articles:id", "prepared", "'id' is not a text feature"),
        ("tfds:lm_test_articles", "empty", "none is prepared under that name"),
        ("tfds:lm_test_story", "empty", "none is prepared under that name"),
    ],
)
def test_a_missing_data_set_or_feature_exits_1_with_one_message(
    data, data_dir, message, tfds_dir, tmp_path, capsys
):
    """Before anything compiles: the message names what is wrong and what to do."""
    folder = tfds_dir if data_dir == "prepared" else str(tmp_path / "empty")
    argv = ["--model", "tiny", "--data", data, "--data-dir", folder, "--out-dir", str(tmp_path / "out")]
    assert lm_cli.main([*argv, "--no-progress"]) == 1
    error = capsys.readouterr().err
    assert message in error and "Traceback" not in error and len(error.strip().splitlines()) == 1


def test_a_registered_data_set_that_is_not_prepared_says_how_to_prepare_it(tmp_path, capsys):
    """tiny_shakespeare is registered with TFDS; nothing is downloaded, the message says how."""
    argv = ["--data", "tfds:tiny_shakespeare", "--data-dir", str(tmp_path), "--out-dir", str(tmp_path / "o")]
    assert lm_cli.main(argv) == 1
    error = capsys.readouterr().err
    assert "tfds:tiny_shakespeare: the data set is not prepared in the TFDS data dir" in error
    assert "tfds build tiny_shakespeare --data_dir DIR" in error and "never downloads" in error
    assert not (tmp_path / "downloads").exists()


def test_a_tfrecord_data_set_without_tensorflow_exits_1_naming_the_group_and_the_array_record_way(
    tmp_path, capsys, monkeypatch, needs_tensorflow
):
    """TFRecord files need TensorFlow, an optional group; ArrayRecord ones are read without it."""
    data_dir = str(tmp_path / "tensorflow_datasets")
    LmTestStory(data_dir=data_dir, file_format="tfrecord").download_and_prepare()
    capsys.readouterr()  # TFDS's progress bars
    # An import of TensorFlow fails, as where it is not installed.
    monkeypatch.setitem(sys.modules, "tensorflow", None)
    argv = ["--model", "tiny", "--data", "tfds:lm_test_story", "--data-dir", data_dir,
            "--out-dir", str(tmp_path / "o")]  # fmt: skip

    assert lm_cli.main([*argv, "--no-progress"]) == 1

    error = capsys.readouterr().err
    assert "--data tfds:lm_test_story: the data set is prepared in " in error
    assert "as TFRecord files, which only TensorFlow reads" in error
    assert "pip install --group tensorflow" in error
    assert "tfds build lm_test_story --file_format=array_record --data_dir DIR" in error
    assert "Traceback" not in error and len(error.strip().splitlines()) == 1


def test_the_vocabulary_of_a_tfds_data_set_is_bytes():
    config = config_lib.LMConfig(data="tfds:lm1b", vocab_size=300)
    with pytest.raises(
        config_lib.ConfigError, match="--vocab-size 300 is invalid: expected 256 .* tfds:lm1b"
    ):
        config_lib.validate(config)
