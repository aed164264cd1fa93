"""`apply_policy`: a precision policy for a Flax model, linen or NNX.

The dispatch above the two Flax routes: `jaxamp.linen_policy` wraps a linen
model, `jaxamp.nnx_policy` converts a copy of an NNX model, and both follow
the per-layer rules of `jaxamp.layer_policies`. Any other JAX function (an
Equinox or Haiku model, plain JAX) goes through `jaxamp.autocast` instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flax import linen, nnx

from jaxamp.layer_policies import ModulePolicies
from jaxamp.linen_policy import PolicyModule
from jaxamp.nnx_policy import apply_nnx_policy
from jaxamp.policy import PolicySpec


def apply_policy(module: Any, policy: PolicySpec, *, overrides: Mapping[type, PolicySpec] | None = None):
    """Makes a Flax model mixed precision without editing its code.

    The returned model creates every param in ``param_dtype``, runs its
    arithmetic (Dense, Conv, Einsum, attention, and any custom layer that reads
    params) in ``compute_dtype`` with inputs and params cast, and returns its
    outputs in ``output_dtype``. Layers that carry their own ``dtype`` field
    (often set to float32 and passed down by published models) compute in the
    policy's compute dtype all the same. Normalization layers compute in
    float32 and keep their statistics in float32; `overrides` changes the
    policy of any module class and of the layers it calls.

    The variables have exactly the structure and names of the original
    model's, so checkpoints and pretrained weights move between policies
    unchanged.

    Examples:
        >>> model = jaxamp.apply_policy(ResNet18(), "mixed_float16")
        >>> variables = model.init(rng, images, train=False)   # float32 params
        >>> logits = model.apply(variables, images, train=False)  # float16 math, float32 logits

    Args:
        module: a ``flax.linen.Module`` or a ``flax.nnx.Module``.
        policy: anything `jaxamp.get_policy` accepts.
        overrides: maps module classes to the policy (or policy spec) they,
            and the layers they call, run under instead, e.g.
            ``{nn.Dense: "float32"}`` or ``{MyHead: "float32"}``.

    Returns:
        For linen, a `jaxamp.linen_policy.PolicyModule` wrapping `module`; for
        NNX, a copy of `module` (the original is untouched) with its state
        cast to ``param_dtype`` and its calls running under the policy.
        Wrap the outermost model: params are cast for computation when the
        wrapper's own ``apply`` (or NNX ``__call__``) runs.

    Raises:
        TypeError: `module` is not a Flax module, or `overrides` is malformed.
        ValueError: the policy spec is not valid.
    """
    module_policies = ModulePolicies.create(policy, overrides)
    if isinstance(module, linen.Module):
        return PolicyModule(module=module, module_policies=module_policies)
    if isinstance(module, nnx.Module):
        return apply_nnx_policy(module, module_policies)
    raise TypeError(
        "apply_policy needs a flax.linen.Module or a flax.nnx.Module; got "
        f"{type(module).__name__}. For any other JAX function (Equinox, Haiku, "
        "plain JAX), use jaxamp.autocast(fun, policy)."
    )
