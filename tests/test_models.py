"""Tests for the CIFAR model zoo in `experiments.models`.

The big models are only traced with `jax.eval_shape` (no compilation), so the
whole file runs in seconds on a CPU; only `resnet_tiny` is compiled and run.
"""

import functools
import pathlib

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import traverse_util

from experiments import models

IMAGES = jax.ShapeDtypeStruct((2, 32, 32, 3), jnp.float32)

# Trainable parameters (BatchNorm scale and bias, not running statistics) of
# the PyTorch CIFAR reference with 10 classes. ResNet152 is sometimes quoted
# as 58,164,298: that is torchvision's ImageNet network, whose 7x7 stem has
# 7,680 more weights than the 3x3 CIFAR stem.
EXPECTED_PARAM_COUNTS = {
    "resnet18": 11_173_962,
    "resnet34": 21_282_122,
    "resnet50": 23_520_842,
    "resnet101": 42_512_970,
    "resnet152": 58_156_618,
    "mobilenetv2": 2_296_922,
    "resnet_tiny": 78_042,
}


@functools.cache
def abstract_variables(name):
    """Shapes of the variables of model `name`, traced but never compiled."""
    model = models.create_model(name)
    init = functools.partial(model.init, train=False)
    return jax.eval_shape(init, jax.random.key(0), IMAGES)


def count(tree):
    return sum(leaf.size for leaf in jax.tree.leaves(tree))


def test_every_model_has_an_expected_param_count():
    assert set(EXPECTED_PARAM_COUNTS) == set(models.MODELS)


@pytest.mark.parametrize("name", sorted(models.MODELS))
def test_param_count_matches_the_pytorch_reference(name):
    params = abstract_variables(name)["params"]
    assert count(params) == EXPECTED_PARAM_COUNTS[name]


@pytest.mark.parametrize("name", sorted(models.MODELS))
def test_every_batch_norm_keeps_running_statistics(name):
    variables = abstract_variables(name)
    params = traverse_util.flatten_dict(variables["params"])
    stats = traverse_util.flatten_dict(variables["batch_stats"])
    norm_scales = {path[:-1]: leaf.shape for path, leaf in params.items() if path[-1] == "scale"}
    running_means = {path[:-1]: leaf.shape for path, leaf in stats.items() if path[-1] == "mean"}
    assert norm_scales
    assert running_means == norm_scales


@pytest.mark.parametrize("name", sorted(models.MODELS))
def test_eval_forward_gives_float32_logits(name):
    model = models.create_model(name)
    apply = functools.partial(model.apply, train=False)
    logits = jax.eval_shape(apply, abstract_variables(name), IMAGES)
    assert logits.shape == (2, 10)
    assert logits.dtype == jnp.float32


@pytest.mark.parametrize("name", sorted(models.MODELS))
def test_train_forward_updates_batch_stats_and_gives_float32_logits(name):
    model = models.create_model(name)
    variables = abstract_variables(name)
    apply = functools.partial(model.apply, train=True, mutable=["batch_stats"])
    logits, updates = jax.eval_shape(apply, variables, IMAGES)
    assert logits.shape == (2, 10)
    assert logits.dtype == jnp.float32
    assert jax.tree.structure(updates["batch_stats"]) == jax.tree.structure(variables["batch_stats"])


@pytest.mark.parametrize("name", sorted(models.MODELS))
def test_create_model_sizes_the_head_for_num_classes(name):
    model = models.create_model(name, num_classes=100)

    def init_and_apply(rng, images):
        variables = model.init(rng, images, train=False)
        return model.apply(variables, images, train=False)

    logits = jax.eval_shape(init_and_apply, jax.random.key(0), IMAGES)
    assert logits.shape == (2, 100)


def test_create_model_rejects_an_unknown_name_and_lists_the_choices():
    with pytest.raises(ValueError, match="'resnet19'") as error:
        models.create_model("resnet19")
    for name in models.MODELS:
        assert name in str(error.value)


@pytest.mark.parametrize(
    "source",
    sorted(pathlib.Path(models.__file__).parent.glob("*.py")),
    ids=lambda path: path.name,
)
def test_model_source_has_no_precision_plumbing(source):
    # Precision is jaxamp.apply_policy's job; a model that pins its own would
    # silently opt out of the policy.
    text = source.read_text().lower()
    for word in ("dtype", "float32", "float16", "bfloat16"):
        assert word not in text, f"{source.name} mentions {word!r}"


def test_resnet_tiny_trains_one_step_with_finite_loss_and_grads():
    model = models.create_model("resnet_tiny")
    images = jax.random.normal(jax.random.key(1), (2, 32, 32, 3))
    labels = jnp.array([3, 7])
    variables = model.init(jax.random.key(0), images, train=False)

    @jax.jit
    def loss_and_grads(params, batch_stats):
        def loss_fn(params):
            logits, updates = model.apply(
                {"params": params, "batch_stats": batch_stats},
                images,
                train=True,
                mutable=["batch_stats"],
            )
            loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
            return loss.mean(), updates["batch_stats"]

        return jax.value_and_grad(loss_fn, has_aux=True)(params)

    (loss, new_batch_stats), grads = loss_and_grads(variables["params"], variables["batch_stats"])

    assert jnp.isfinite(loss)
    assert jax.tree.structure(grads) == jax.tree.structure(variables["params"])
    assert all(jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads))
    # A training step moves the running mean away from its zero init.
    old_mean = variables["batch_stats"]["bn_init"]["mean"]
    assert not jnp.allclose(new_batch_stats["bn_init"]["mean"], old_mean)
