"""Fault injection: injected inf/NaN gradients are skipped and never reach the state."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import data as data_lib
from experiments import train
from experiments.fault_injection import inject_nonfinite


def test_injection_hits_about_its_rate_of_steps_with_inf_or_nan_and_is_seeded():
    grads = {"w": jnp.ones(3), "count": jnp.ones(3, jnp.int32)}
    outcomes = [inject_nonfinite(grads, jax.random.key(step), 0.25) for step in range(400)]
    injected = np.array([bool(flag) for _, flag in outcomes])

    assert 0.18 < injected.mean() < 0.32
    for (poisoned, flag) in outcomes[:40]:
        assert bool(jnp.all(jnp.isfinite(poisoned["w"]))) != bool(flag)
        np.testing.assert_array_equal(poisoned["count"], grads["count"])  # integers untouched
    kinds = {bool(jnp.isnan(poisoned["w"][0])) for poisoned, flag in outcomes if flag}
    assert kinds == {True, False}  # both NaN and inf
    again = [bool(inject_nonfinite(grads, jax.random.key(step), 0.25)[1]) for step in range(400)]
    assert again == injected.tolist()


def test_a_zero_rate_leaves_the_gradients_alone():
    grads = {"w": jnp.ones(3)}
    poisoned, injected = inject_nonfinite(grads, jax.random.key(0), 0.0)
    assert poisoned is grads and not bool(injected)


def injected_run(precision):
    config = train.TrainConfig(
        model="resnet_tiny", precision=precision, batch_size=8, eval_batch_size=8, epochs=2,
        inject_nonfinite=0.3, progress=False,
    )  # fmt: skip
    dataset = data_lib.synthetic_dataset(num_train=64, num_test=8, seed=0)
    return train.train_and_evaluate(config, dataset, log=lambda line: None)["epochs"]


@pytest.mark.parametrize("precision", ["fp32", "mixed_bf16"])
def test_without_a_loss_scale_to_overflow_exactly_the_injected_steps_are_skipped(precision):
    epochs = injected_run(precision)
    assert epochs[-1]["injected_nonfinite"] > 0
    for record in epochs:
        assert record["skipped_steps"] == record["injected_nonfinite"]
        assert record["state_finite"]


def test_under_float16_injected_steps_are_skipped_back_off_the_scale_and_never_reach_the_state():
    epochs = injected_run("mixed")
    assert epochs[-1]["injected_nonfinite"] > 0
    for record in epochs:
        assert record["skipped_steps"] >= record["injected_nonfinite"]
        assert record["state_finite"]
    assert epochs[-1]["loss_scale"] < 2.0**15
