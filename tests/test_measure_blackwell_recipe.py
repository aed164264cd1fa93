"""``python -m experiments.measure blackwell-recipe``: NVFP4's tools at the wgrad GEMM, on a model's tensors.

The measurement's pieces on tiny inputs: the tensors it reads from a model
are the ones its weight gradients are made of, each row runs the recipe it
names, the accumulated error is of the sums, not of one step, and a run
reads a new batch each step.
"""

import argparse
import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from experiments.lm import data as data_lib
from experiments.lm.config import GPTSize
from experiments.measure import blackwell_recipe
from experiments.measure.run_folder import RunFolder


class EmbedAndTwoDense(nn.Module):
    """Tokens -> logits through a Dense and a DenseGeneral, the layer kinds the measurement reads."""

    @nn.compact
    def __call__(self, tokens):
        hidden = nn.gelu(nn.Dense(32, name="up")(nn.Embed(16, 32, name="embed")(tokens)))
        return nn.DenseGeneral(16, name="down")(hidden)


def test_each_layers_input_and_cotangent_make_the_models_own_kernel_gradient():
    model = EmbedAndTwoDense()
    windows = jax.random.randint(jax.random.key(0), (2, 9), 0, 16)
    params = model.init(jax.random.key(1), windows[:, :-1])["params"]

    tensors = blackwell_recipe.layer_tensors(model, params, windows)

    def loss(params):
        logits = model.apply({"params": params}, windows[:, :-1])
        return blackwell_recipe.token_losses(logits, windows[:, 1:]).mean()

    expected = jax.grad(loss)(params)
    assert sorted(tensors) == ["down", "up"]
    for name, (x, w, g) in tensors.items():
        assert x.shape[0] == g.shape[0] == 16 and w.shape == (x.shape[1], g.shape[1])
        np.testing.assert_array_equal(w, params[name]["kernel"])
        np.testing.assert_allclose(x.T @ g, expected[name]["kernel"], rtol=1e-5, atol=1e-8)


def tensors_of_two_layers():
    keys = iter(jax.random.split(jax.random.key(3), 6))

    def normal(*shape):
        return jax.random.normal(next(keys), shape)

    return {
        "a": (normal(64, 32), normal(32, 48), normal(64, 48)),
        "b": (normal(64, 48), normal(48, 16), normal(64, 16) * 1e-3),
    }


def test_each_row_runs_the_recipe_it_names():
    tensors = tensors_of_two_layers()
    rows = blackwell_recipe.methods(tensors)
    gradients = {label: np.asarray(compiled(tensors)) for label, compiled in rows.items()}
    reference = gradients["float32"]

    np.testing.assert_allclose(reference[: 32 * 48], np.ravel(tensors["a"][0].T @ tensors["a"][2]), rtol=1e-5)
    labels = [label for label, _ in (*blackwell_recipe.RECIPES, *blackwell_recipe.GRADIENT_ONLY)]
    # Every quantized row is its own computation: no two alike, none float32's.
    for index, label in enumerate(labels):
        assert not np.array_equal(gradients[label], reference), label
        for other in labels[index + 1 :]:
            assert not np.array_equal(gradients[label], gradients[other]), (label, other)
    # Each within NVFP4's error of float32's, and bfloat16's far closer.
    def error(label):
        return np.linalg.norm(gradients[label] - reference) / np.linalg.norm(reference)

    assert error("bfloat16") < 0.01
    for label in labels:
        assert 0.005 < error(label) < 0.3, (label, error(label))


def test_the_bfloat16_row_rounds_both_operands_to_bfloat16():
    x, w, g = tensors_of_two_layers()["a"]
    x_half, g_half = (operand.astype(jnp.bfloat16).astype(jnp.float32) for operand in (x, g))

    np.testing.assert_allclose(
        blackwell_recipe.bfloat16_gradient(x, w, g),
        jnp.dot(x_half.T, g_half, precision=jax.lax.Precision.HIGHEST),
        rtol=1e-5,
        atol=1e-5,
    )


def test_the_accumulated_error_is_of_the_sums_an_unbiased_error_averaging_out_and_a_bias_staying():
    reference = jnp.ones(1000)
    noise = jax.random.normal(jax.random.key(4), (16, 1000))
    tracker = blackwell_recipe.ErrorTracker()
    for step in range(16):
        tracker.add({"float32": reference, "unbiased": reference + noise[step], "biased": reference + 0.5})

    one_step_norms = jnp.linalg.norm(noise, axis=1) / np.sqrt(1000)
    np.testing.assert_allclose(tracker.one_step["unbiased"], one_step_norms, rtol=1e-5)
    assert tracker.one_step["biased"] == tracker.accumulated["biased"] == [0.5] * 16
    np.testing.assert_allclose(
        tracker.accumulated["unbiased"][-1], jnp.linalg.norm(noise.sum(0)) / (16 * np.sqrt(1000)), rtol=1e-5
    )
    assert tracker.accumulated["unbiased"][-1] < 0.3 * tracker.accumulated["unbiased"][0]
    assert "float32" not in tracker.one_step


def test_the_table_gives_each_checkpoint_of_the_accumulated_error():
    assert blackwell_recipe.checkpoints(64) == [1, 4, 16, 64]
    assert blackwell_recipe.checkpoints(20) == [1, 4, 16, 20]
    assert blackwell_recipe.checkpoints(1) == [1]
    results = {
        "model": "tiny", "seed": 0, "context": 64, "batches": 5, "layers": 8,
        "one_step": {"bfloat16": 0.001, "nvfp4 (full recipe)": 0.04},
        "accumulated": {
            "bfloat16": [0.001, 0.002, 0.003, 0.004, 0.005],
            "nvfp4 (full recipe)": [0.04, 0.03, 0.02, 0.015, 0.0125],
        },
    }  # fmt: skip

    text = blackwell_recipe.report(results, "python -m experiments.measure blackwell-recipe --batches 5")

    columns = ["weight gradient by", "one step", *(f"accumulated, {n} steps" for n in (1, 4, 5))]
    assert "| " + " | ".join(columns) + " |" in text
    assert "| nvfp4 (full recipe) | 0.0400 | 0.0400 | 0.0150 | 0.0125 |" in text
    assert "| bfloat16 | 0.0010 | 0.0010 | 0.0040 | 0.0050 |" in text


def relative_error(value, reference):
    return np.linalg.norm(value - reference) / np.linalg.norm(reference)


def test_a_run_reads_a_new_batch_each_step_and_reports_the_mean_one_step_error(monkeypatch, tmp_path):
    """A one-block model and only the float32 and bfloat16 rows: the whole loop in a few seconds."""
    corpus = data_lib.synthetic_corpus(vocab_size=16)
    monkeypatch.setattr(blackwell_recipe.data_lib, "load_stdlib_corpus", lambda: corpus)
    one_block = GPTSize(num_layers=1, d_model=32, num_heads=2, context=16)
    monkeypatch.setitem(blackwell_recipe.model_lib.SIZES, "tiny", one_block)
    monkeypatch.setattr(blackwell_recipe, "RECIPES", ())
    monkeypatch.setattr(blackwell_recipe, "GRADIENT_ONLY", ())
    monkeypatch.setattr(blackwell_recipe, "plot", lambda path, results: None)
    out = RunFolder(str(tmp_path), "python -m experiments.measure blackwell-recipe --model tiny --batches 3")

    blackwell_recipe.run(argparse.Namespace(model="tiny", batches=3, seed=2), out)

    results = json.loads((tmp_path / "recipe.json").read_text())
    # The same errors by hand: batch n is the corpus's batch at (seed 2, step n).
    model = blackwell_recipe.model_lib.create_model("tiny", 16, "xla")
    params = model.init(jax.random.key(2), jnp.zeros((1, 16), jnp.int32))["params"]
    sums = {"float32": 0.0, "bfloat16": 0.0}
    one_step, accumulated = [], []
    for step in range(3):
        offsets = data_lib.batch_offsets(len(corpus.train), blackwell_recipe.BATCH, 16, 2, step)
        windows = jnp.asarray(data_lib.batch_rows(corpus.train, offsets, 16, slice(None)))
        tensors = blackwell_recipe.layer_tensors(model, params, windows)
        gradients = {
            "float32": blackwell_recipe.weight_gradients(tensors, blackwell_recipe.float32_gradient),
            "bfloat16": blackwell_recipe.weight_gradients(tensors, blackwell_recipe.bfloat16_gradient),
        }
        sums = {label: sums[label] + gradients[label] for label in sums}
        one_step.append(relative_error(gradients["bfloat16"], gradients["float32"]))
        accumulated.append(relative_error(sums["bfloat16"], sums["float32"]))
    assert len(set(one_step)) == 3  # three batches, three errors: a mean is not any one of them
    np.testing.assert_allclose(results["one_step"]["bfloat16"], np.mean(one_step), rtol=1e-4)
    np.testing.assert_allclose(results["accumulated"]["bfloat16"], accumulated, rtol=1e-4)
