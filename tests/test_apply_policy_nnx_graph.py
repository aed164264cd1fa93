"""`apply_policy` on an NNX model: which modules and methods it changes, and how they read.

Each test was written against a mutant of `jaxamp/_flax/nnx.py` that
passed the rest of the suite (docs/dev/fault-classes.md): a module's policy
taken from the wrong holder when its holder is not its parent path (a list
of layers) or when only the holder's class is overridden; private methods
rewritten too; a method the model calls on itself sent through autocast a
second time; the policy classes showing jaxamp's module and name instead of
the user's; the refusal of a model already under a policy not naming where.
"""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import jaxamp
from tests.test_autocast_rule_classes import all_equations

F16, BF16, F32 = jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)
X = jnp.ones((2, 4))


def matmul_operand_dtypes(fun, *args):
    """The operand dtypes of every dot_general `fun` traces to, nested programs included."""
    jaxpr = jax.make_jaxpr(fun)(*args).jaxpr
    return [
        tuple(jnp.dtype(var.aval.dtype) for var in eqn.invars)
        for eqn in all_equations(jaxpr)
        if eqn.primitive.name == "dot_general"
    ]


class Block(nnx.Module):
    """A layer of its own, a list of layers held as data (no module at ``layers``), and an nnx.List."""

    def __init__(self, rngs):
        self.dense = nnx.Linear(4, 4, rngs=rngs)
        self.layers = nnx.data([nnx.Linear(4, 4, rngs=rngs)])
        self.stack = nnx.List([nnx.Linear(4, 4, rngs=rngs)])

    def __call__(self, x):
        return self.stack[0](self.layers[0](self.dense(x)))


class Model(nnx.Module):
    def __init__(self, rngs):
        self.block = Block(rngs)
        self.head = nnx.Linear(4, 4, rngs=rngs)

    def __call__(self, x):
        return self.head(self.block(x))


def kernel_dtypes(model):
    """Each linear layer's kernel dtype, by the layer's path."""
    return {
        ".".join(map(str, path)): jnp.dtype(module.kernel[...].dtype)
        for path, module in nnx.iter_modules(model)
        if isinstance(module, nnx.Linear)
    }


@pytest.mark.parametrize(
    "overrides, block, head",
    [
        # (param dtype, compute dtype) of the block's three layers and of the head
        ({Block: "bfloat16"}, (BF16, BF16), (F32, F16)),  # the holder's class overridden, not its layers'
        ({Model: "bfloat16"}, (BF16, BF16), (BF16, BF16)),  # the root's own class: every layer inherits it
    ],
    ids=["holder overridden", "root overridden"],
)
def test_every_layer_takes_the_policy_of_the_module_that_holds_it_also_through_a_list(overrides, block, head):
    """Fails if a layer whose holder is two path steps up (``block.layers.0``: ``block.layers`` is a
    plain list, not a module) or one step up (``block.dense``) takes the model's policy instead, or
    if the root's overridden class gives its params (and no more) the override: its layers then
    computed in float16 on bfloat16 params."""
    model = jaxamp.apply_policy(Model(nnx.Rngs(0)), "mixed_float16", overrides=overrides)

    assert kernel_dtypes(model) == {
        "block.dense": block[0],
        "block.layers.0": block[0],
        "block.stack.0": block[0],
        "head": head[0],
    }
    assert matmul_operand_dtypes(model, X) == [(block[1], block[1])] * 3 + [(head[1], head[1])]
    assert model(X).dtype == F32  # the model's own output dtype, as for linen


class WithHelpers(nnx.Module):
    """A public method, a private one, and a ``__call__`` that calls the public one on itself."""

    def __init__(self, rngs, seen):
        self.dense = nnx.Linear(4, 4, rngs=rngs)
        self.head = nnx.Linear(4, 4, rngs=rngs)
        self.seen = nnx.static(seen)

    def __call__(self, x):
        features = self.features(x)
        self.seen.append(features.dtype)
        return self.head(features)

    def features(self, x):
        return self.dense(x)

    def _features(self, x):
        return self.dense(x)


def test_public_methods_run_through_autocast_and_private_ones_run_as_written():
    """Fails if private methods (``_features``) are rewritten too: only ``__call__`` and public
    methods are (the module docstring's contract)."""
    model = jaxamp.apply_policy(WithHelpers(nnx.Rngs(0), []), "mixed_float16")

    assert matmul_operand_dtypes(model.features, X) == [(F16, F16)]
    assert model.features(X).dtype == F32
    assert matmul_operand_dtypes(model._features, X) == [(F32, F32)]  # pylint: disable=protected-access


def test_a_method_the_model_calls_on_itself_runs_inside_the_one_rewrite_and_hands_on_half():
    """Fails if ``self.features`` inside ``__call__`` goes through autocast again: its result would
    come back cast to the output dtype (float32) and the head would read float32."""
    seen = []
    model = jaxamp.apply_policy(WithHelpers(nnx.Rngs(0), seen), "mixed_float16")

    outputs = model(X)

    assert seen == [F16, F32]  # traced inside the model's rewrite, then as given for the literals
    assert outputs.dtype == F32
    assert matmul_operand_dtypes(model, X) == [(F16, F16), (F16, F16)]


def test_the_policy_model_and_its_scoped_layers_read_as_the_users_classes():
    """Fails if the classes apply_policy makes show jaxamp's module, or the class's bare name for its
    qualified one (a class defined in a function), in reprs, errors and pickles."""

    class LocalBlock(Block):
        pass

    class LocalModel(nnx.Module):
        def __init__(self, rngs):
            self.block = LocalBlock(rngs)

        def __call__(self, x):
            return self.block(x)

    model = jaxamp.apply_policy(LocalModel(nnx.Rngs(0)), "mixed_float16", overrides={LocalBlock: "float32"})

    for made, original in ((type(model), LocalModel), (type(model.block), LocalBlock)):
        assert made is not original and issubclass(made, original)
        assert (made.__name__, made.__qualname__, made.__module__) == (
            original.__name__,
            original.__qualname__,
            original.__module__,
        )
    assert type(model).__qualname__.endswith("<locals>.LocalModel")
    # Every layer gets a class of its own (its methods name their ops by its path); NNX's containers not.
    assert type(model.block.dense) is not nnx.Linear and issubclass(type(model.block.dense), nnx.Linear)
    assert type(model.block.dense).__qualname__ == "Linear" and type(model.block.stack) is nnx.List


class Holder(nnx.Module):
    def __init__(self, part):
        self.inner = part

    def __call__(self, x):
        return self.inner(x)


class Outer(nnx.Module):
    def __init__(self, part):
        self.block = Holder(part)

    def __call__(self, x):
        return self.block(x)


ALREADY = "already runs under a jaxamp policy; apply_policy to the original model, and give any part its own "


@pytest.mark.parametrize(
    "make, where",
    [
        (lambda policied: policied, "module"),
        (lambda policied: Outer(policied), "submodule at block.inner"),
    ],
    ids=["the model", "a part two levels down"],
)
def test_a_model_or_part_already_under_a_policy_is_refused_naming_where_it_is(make, where):
    policied = jaxamp.apply_policy(Block(nnx.Rngs(0)), "mixed_float16")

    with pytest.raises(ValueError) as raised:
        jaxamp.apply_policy(make(policied), "mixed_bfloat16")

    assert str(raised.value) == f"This NNX {where} {ALREADY}policy with overrides."


def test_a_model_without_call_is_refused_naming_its_class():
    class Encoder(nnx.Module):
        def __init__(self, rngs):
            self.dense = nnx.Linear(4, 4, rngs=rngs)

        def encode(self, x):
            return self.dense(x)

    with pytest.raises(TypeError) as raised:
        jaxamp.apply_policy(Encoder(nnx.Rngs(0)), "mixed_float16")

    assert str(raised.value) == "apply_policy needs an NNX model with a __call__ method; Encoder has none."


class WithStatistic(nnx.Module):
    """A layer beside a float32 statistic of the module's own (not a normalization layer's)."""

    def __init__(self, rngs):
        self.dense = nnx.Linear(4, 4, rngs=rngs)
        self.mean = nnx.BatchStat(jnp.zeros((4,)))

    def __call__(self, x):
        return self.dense(x) - self.mean[...]


def test_only_params_take_the_param_dtype_and_the_modules_other_state_keeps_its_own():
    """Fails if every floating variable is cast by its owner's policy: under ``bfloat16`` the
    module's float32 running statistic would become bfloat16."""
    model = jaxamp.apply_policy(WithStatistic(nnx.Rngs(0)), "bfloat16")

    assert kernel_dtypes(model) == {"dense": BF16}
    assert model.mean[...].dtype == F32
