"""A skipped step, said where users look: the experiments' report lines and results JSON.

Each run trains in float16 under a static loss scale of 1e9, so every step's
backward pass overflows (the loss's cotangent, 1e9 times the gradient of the
mean, is beyond float16's 65504) and is skipped. With ``--record-overflow``
the line names the op that overflowed first and the pass; without it, only
the gradient leaves.
"""

from __future__ import annotations

import pytest

from experiments import data as data_lib
from experiments import train
from experiments.checkpointing import Checkpointer, signature
from experiments.lm import config as lm_config
from experiments.lm import train as lm_train

OVERFLOWING = {"precision": "mixed", "loss_scale": "static:1e9", "max_consecutive_skips": 0}


def cifar_run(tmp_path=None, **settings):
    config = train.TrainConfig(
        model="resnet_tiny", batch_size=8, eval_batch_size=8, epochs=1, steps_per_epoch=2, progress=False,
        checkpoint_dir=None if tmp_path is None else str(tmp_path / "checkpoints"), **OVERFLOWING, **settings,
    )  # fmt: skip
    lines = []
    dataset = data_lib.synthetic_dataset(num_train=32, num_test=8, seed=0)
    results = train.train_and_evaluate(config, dataset, log=lines.append)
    return config, dataset, results, lines


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_cifar_names_the_first_overflow_and_the_leaves_of_the_last_skipped_step(grad_accum):
    _, _, results, lines = cifar_run(record_overflow=True, grad_accum=grad_accum)
    epoch = results["epochs"][-1]
    assert epoch["skipped_steps"] == 2
    line = epoch["last_skipped_step"]
    assert line.startswith(
        "2 steps skipped since the last report; the last: step 2 skipped: backward overflow"
    )
    assert "first in Dense_0 at resnet.py:" in line, "the classifier's matmul gets the loss's cotangent first"
    assert "(dot_general, float16, amax inf; the dtype's max is 65504); non-finite grads in" in line
    assert f"  {line}" in lines


def test_without_record_overflow_the_line_names_only_the_leaves():
    _, _, results, _ = cifar_run()
    line = results["epochs"][-1]["last_skipped_step"]
    assert "step 2 skipped: non-finite grads in" in line and "overflow first" not in line


def test_a_checkpoint_of_a_run_that_records_overflow_restores_its_record(tmp_path):
    config, dataset, results, _ = cifar_run(tmp_path, record_overflow=True)
    precision = train.resolve_precision(config.precision)
    template = train.with_overflow_record(
        train.create_train_state(config, precision, dataset.num_classes, steps_per_epoch=2),
        train.make_train_step(config, dataset),
        train.put_on_device(dataset, config.eval_batch_size),
        config.batch_size,
    )
    restored, _, _ = Checkpointer(
        str(tmp_path / "checkpoints"), signature(config, 1), resume=True
    ).restore_latest(template)
    first = restored.overflow_record.first_overflow()
    assert (first.site.name, first.pass_) == ("Dense_0", "backward")
    assert f"skipped: {first}" in results["epochs"][-1]["last_skipped_step"]


def test_the_language_model_names_the_first_overflow_at_each_evaluation():
    config = lm_config.LMConfig(
        model="tiny", context=16, batch_size=4, steps=2, eval_every=1, eval_batches=1, data="synthetic",
        progress=False, precision="mixed", loss_scale="static:1e9", record_overflow=True,
    )  # fmt: skip
    lines = []
    results = lm_train.train_and_evaluate(config, log=lines.append)
    after_steps = results["evaluations"][1:]
    assert [entry["skipped_steps"] for entry in after_steps] == [1, 2]
    for entry in after_steps:
        assert "skipped: backward overflow first in " in entry["last_skipped_step"]
        assert "(dot_general, float16, amax inf" in entry["last_skipped_step"]
        assert f"  {entry['last_skipped_step']}" in lines
