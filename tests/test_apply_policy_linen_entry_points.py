"""`apply_policy` on a linen model: every entry point Flax offers works under the policy.

Written against mutants of `jaxamp/_flax/linen.py` that passed the rest of
the suite (docs/dev/fault-classes.md): ``init_with_output`` had no test at
all, a method named by ``method=`` lost its keyword arguments, a ``method=``
that is no method was refused with no test of its errors, and a
``capture_intermediates`` filter could be replaced by Flax's default.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxamp

F16, F32 = jnp.dtype(jnp.float16), jnp.dtype(jnp.float32)
X = jnp.linspace(-1.0, 1.0, 8 * 4, dtype=jnp.float32).reshape(8, 4)


class Net(nn.Module):
    @nn.compact
    def __call__(self, x, train=False):
        x = nn.Dense(8, name="hidden")(x)
        x = nn.BatchNorm(use_running_average=not train, name="norm")(x)
        x = nn.Dropout(0.5, deterministic=not train)(nn.relu(x))
        return nn.Dense(4, name="head")(x)

    def encode(self, x, scale=1.0):
        return scale * self.__call__(x)


def dtypes(tree):
    return jax.tree.map(lambda leaf: jnp.dtype(leaf.dtype), tree)


KEY, DROPOUT_KEY = jax.random.key(0), jax.random.key(1)


@pytest.mark.parametrize(
    "rngs, apply_rngs",
    [
        (KEY, {"params": KEY}),
        ({"params": KEY, "dropout": DROPOUT_KEY}, {"params": KEY, "dropout": DROPOUT_KEY}),
    ],
    ids=["a key", "a dict of keys"],
)
@pytest.mark.parametrize("policy, output_dtype", [("mixed_float16", F32), ("float16", F16)])
def test_init_with_output_gives_the_policys_params_and_the_outputs_apply_gives(
    rngs, apply_rngs, policy, output_dtype
):
    """In training mode, with dropout and a mutable collection named. Fails if ``init_with_output``
    returns the wrapped model's own (float32) params, computes its outputs outside the policy, or
    loses on the way its keys (a single key is the ``params`` stream, as in Flax), its keyword
    arguments (``train``) or its ``mutable``."""
    model = jaxamp.apply_policy(Net(), policy)

    outputs, variables = model.init_with_output(rngs, X, train=True, mutable=["params", "batch_stats"])

    param_dtype = jaxamp.get_policy(policy).param_dtype
    assert set(jax.tree.leaves(dtypes(variables["params"]))) == {param_dtype}
    assert set(jax.tree.leaves(dtypes(variables["batch_stats"]))) == {F32}
    expected, _ = model.apply(variables, X, train=True, rngs=apply_rngs, mutable=["batch_stats"])
    assert outputs.dtype == output_dtype
    np.testing.assert_array_equal(outputs, expected)
    assert np.count_nonzero(outputs == 0) < outputs.size  # dropout kept some units


def test_a_method_named_by_method_gets_its_keyword_arguments():
    """Fails if ``apply(..., method="encode", scale=...)`` drops ``scale`` on its way to the method."""
    model = jaxamp.apply_policy(Net(), "mixed_float16")
    variables = model.init(jax.random.key(0), X)

    once = model.apply(variables, X, method="encode")
    doubled = model.apply(variables, X, method="encode", scale=2.0)

    assert once.dtype == doubled.dtype == F32
    np.testing.assert_array_equal(doubled, 2.0 * once)


def test_a_method_that_is_not_one_is_refused_with_the_models_name():
    """``method=`` naming nothing callable, or neither a name nor a function: the errors, matched whole.

    Fails if a missing name reaches Flax (whose error does not say it was the ``method=`` given) or
    the messages lose the model's class or the value given.
    """
    model = jaxamp.apply_policy(Net(), "mixed_float16")
    variables = model.init(jax.random.key(0), X)
    with pytest.raises(AttributeError) as raised:
        model.apply(variables, X, method="decode")
    assert str(raised.value) == "Net has no method 'decode' to apply."
    with pytest.raises(TypeError) as raised:
        model.apply(variables, X, method=3)
    assert str(raised.value) == "method must be a method name or a function; got 3."


def test_a_capture_filter_picks_the_same_intermediates_as_on_the_plain_model():
    """``capture_intermediates=`` given a filter: only the layers it picks are captured, in float16.

    Fails if the filter is replaced by Flax's default (every method's output captured).
    """
    model = jaxamp.apply_policy(Net(), "mixed_float16")
    variables = model.init(jax.random.key(0), X)

    def only_dense(module, method_name):
        return isinstance(module, nn.Dense)

    _, state = model.apply(variables, X, capture_intermediates=only_dense, mutable=["intermediates"])
    _, plain = Net().apply(variables, X, capture_intermediates=only_dense, mutable=["intermediates"])
    assert jax.tree.structure(state) == jax.tree.structure(plain)
    assert set(state["intermediates"]) == {"hidden", "head"}
    assert set(jax.tree.leaves(dtypes(state))) == {F16}
