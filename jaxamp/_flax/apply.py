"""`apply_policy`: a precision policy for a Flax model, linen or NNX.

`jaxamp.autocast` with what only a Flax model has: params created in their
layer's param dtype and a policy per module class. `jaxamp._flax.linen`
wraps a linen model, `jaxamp._flax.nnx` converts a copy of an NNX model,
and both take each class's policy from `jaxamp._flax.layers`. Any other
JAX function (an Equinox or Haiku model, plain JAX) takes `jaxamp.autocast`
itself.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flax import linen, nnx

from jaxamp._flax.layers import ModulePolicies
from jaxamp._flax.linen import PolicyModule
from jaxamp._flax.nnx import apply_nnx_policy
from jaxamp._policy import PolicySpec


def apply_policy(module: Any, policy: PolicySpec, *, overrides: Mapping[type, PolicySpec] | None = None):
    """Makes a Flax model mixed precision without editing its code.

    The returned model creates every param in ``param_dtype`` and runs its
    calls through `jaxamp.autocast` under the policy: every matmul and
    convolution (Dense, Conv, Einsum, attention, any custom layer) in
    ``compute_dtype``, or in FP8 under a policy such as ``"mixed_float8"``;
    reductions, the exp/log family and roots in float32, whatever class they
    are in (a model's own RMSNorm included); outputs in ``output_dtype``.
    Layers that carry their own ``dtype`` field (often set to float32 and
    passed down by published models) compute in the policy's compute dtype
    all the same. Normalization layers (`jaxamp.NORMALIZATION_LAYERS`)
    compute in float32, keep their statistics in float32 and hand their
    result back in the caller's compute dtype; `overrides` changes the
    policy of any module class and of the layers it calls. Both are policy
    scopes around the layer's calls, which autocast reads.

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
        For linen, a linen module (``PolicyModule``) wrapping `module`
        (its ``apply``, with any ``method=``, runs through autocast); for
        NNX, a copy of `module` (the original is untouched) with its params
        cast to ``param_dtype`` and its ``__call__`` and public methods
        running through autocast (a submodule called directly,
        ``model.encoder(x)``, runs outside the policy). Wrap the outermost
        model: a linen model under a policy inside another keeps its own
        policy, one inside a plain linen model raises ``TypeError``.

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
