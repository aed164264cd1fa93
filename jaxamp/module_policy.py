"""Which policy each layer of a model runs under, and `apply_policy`.

A model runs under one policy, except for the layers that must not: by default
normalization layers compute in float32 (their mean and variance lose too much
in float16), and `overrides` maps further module classes to policies of their
own, the way Haiku's ``set_policy`` does by class.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
from flax import linen, nnx

from jaxamp.policy import Policy, PolicySpec, get_policy

NORMALIZATION_LAYERS: tuple[type, ...] = (
    linen.BatchNorm,
    linen.LayerNorm,
    linen.GroupNorm,
    linen.RMSNorm,
    linen.InstanceNorm,
    nnx.BatchNorm,
    nnx.LayerNorm,
    nnx.GroupNorm,
    nnx.RMSNorm,
    nnx.InstanceNorm,
)
"""Layers that compute in float32 unless `overrides` says otherwise."""


def normalization_policy(policy: Policy) -> Policy:
    """The default policy of a normalization layer inside a model under `policy`.

    Params stay in the model's param dtype, the statistics and the
    normalization itself are computed in float32, and the result goes back to
    the model's compute dtype, so the next layer gets what it expects.
    """
    return Policy(policy.param_dtype, jnp.float32, policy.compute_dtype)


@dataclasses.dataclass(frozen=True)
class ModulePolicies:
    """The policy of a model and of the module classes that differ from it.

    Attributes:
        policy: the model's policy.
        overrides: ``(module class, policy)`` pairs, looked up in order with
            ``isinstance`` semantics; the first match wins. The user's
            overrides come first, then the float32 default of normalization
            layers.
    """

    policy: Policy
    overrides: tuple[tuple[type, Policy], ...]

    @classmethod
    def create(cls, policy: PolicySpec, overrides: Mapping[type, PolicySpec] | None = None) -> ModulePolicies:
        """Validates `overrides` and adds the normalization default."""
        policy = get_policy(policy)
        if overrides is None:
            overrides = {}
        if not isinstance(overrides, Mapping):
            raise TypeError(
                "overrides must map module classes to policies, e.g. "
                "{nn.Dense: 'float32'}; got "
                f"{type(overrides).__name__}."
            )
        user_overrides = []
        for module_class, spec in overrides.items():
            if not (isinstance(module_class, type) and issubclass(module_class, (linen.Module, nnx.Module))):
                raise TypeError(
                    "overrides keys must be Flax module classes (e.g. nn.Dense, "
                    f"nn.BatchNorm); got {module_class!r}."
                )
            user_overrides.append((module_class, get_policy(spec)))
        norm_policy = normalization_policy(policy)
        defaults = [(layer, norm_policy) for layer in NORMALIZATION_LAYERS]
        return cls(policy, tuple(user_overrides + defaults))

    def for_module(self, module: Any) -> Policy:
        """Returns the policy that `module` (an instance) runs under."""
        return self.lookup(type(module))[0]

    def is_overridden(self, module: Any) -> bool:
        """Whether `module` runs under an override rather than the model's policy.

        Overridden layers cast their outputs to their policy's output dtype;
        the model's own layers hand on their outputs in the compute dtype.
        """
        return self.lookup(type(module))[1]

    def lookup(self, module_class: type) -> tuple[Policy, bool]:
        """Returns ``(policy, is_overridden)`` for instances of `module_class`."""
        return _lookup(self, module_class)


@functools.lru_cache(maxsize=1024)
def _lookup(module_policies: ModulePolicies, module_class: type) -> tuple[Policy, bool]:
    # Called for every module call while tracing; the answer depends only on
    # the (hashable) policies and the class.
    for overridden_class, policy in module_policies.overrides:
        if issubclass(module_class, overridden_class):
            return policy, True
    return module_policies.policy, False


def is_floating_dtype_field(value: Any) -> bool:
    """Whether a module's ``dtype``-like field may be set to a float dtype.

    ``None`` (infer) and floating dtypes may; an integer or any other value
    means the field is not a compute dtype, and it is left alone.
    """
    if value is None:
        return True
    try:
        return jnp.issubdtype(jnp.dtype(value), jnp.floating)
    except TypeError:
        return False


def apply_policy(module: Any, policy: PolicySpec, *, overrides: Mapping[type, PolicySpec] | None = None):
    """Makes a Flax model mixed precision without editing its code.

    The returned model creates every param in ``param_dtype``, runs its
    arithmetic (Dense, Conv, Einsum, attention, and any custom layer that reads
    params) in ``compute_dtype`` with inputs and params cast, and returns its
    outputs in ``output_dtype``. Layers that carry their own ``dtype`` field
    (often set to float32 and passed down by published models) compute in the
    policy's compute dtype all the same. Normalization layers compute in
    float32 and keep their statistics in float32; `overrides` changes the
    policy of any module class.

    The variables have exactly the structure and names of the original
    model's, so checkpoints and pretrained weights move between policies
    unchanged.

    Example:
        >>> model = jaxamp.apply_policy(ResNet18(), "mixed_float16")
        >>> variables = model.init(rng, images, train=False)   # float32 params
        >>> logits = model.apply(variables, images, train=False)  # float16 math, float32 logits

    Args:
        module: a ``flax.linen.Module`` or a ``flax.nnx.Module``.
        policy: anything `jaxamp.get_policy` accepts.
        overrides: maps module classes to the policy (or policy spec) they run
            under instead, e.g. ``{nn.Dense: "float32"}``.

    Returns:
        For linen, a `jaxamp.linen_policy.PolicyModule` wrapping `module`; for
        NNX, a copy of `module` (the original is untouched) with its state
        cast to ``param_dtype`` and its calls running under the policy.

    Raises:
        TypeError: `module` is not a Flax module, or `overrides` is malformed.
        ValueError: the policy spec is not valid.
    """
    module_policies = ModulePolicies.create(policy, overrides)
    if isinstance(module, linen.Module):
        from jaxamp.linen_policy import PolicyModule

        return PolicyModule(module=module, module_policies=module_policies)
    if isinstance(module, nnx.Module):
        from jaxamp.nnx_policy import apply_nnx_policy

        return apply_nnx_policy(module, module_policies)
    raise TypeError(
        "apply_policy needs a flax.linen.Module or a flax.nnx.Module; got "
        f"{type(module).__name__}. For a plain function, cast with "
        "policy.cast_to_compute(...) / policy.cast_to_output(...)."
    )
