"""Which policy each layer of a Flax model runs under: the rules both routes share.

`jaxamp._flax.linen` and `jaxamp._flax.nnx` apply these rules to linen and
NNX models; `jaxamp._flax.apply.apply_policy` chooses between them. Neither
route imports the other, and this module imports neither.

A model runs under one policy, which `jaxamp.autocast` applies op by op,
except where a layer's class says otherwise, the way Haiku's ``set_policy``
works by class:

* a layer whose class (or a base class) is in `overrides` runs under that
  policy, and so do the layers it calls, unless they have an override of
  their own;
* a normalization layer computes in float32 (means and variances lose too
  much in float16) and hands its result back in the compute dtype of the
  policy it was called under;
* a layer that declares float32 as its compute dtype (``dtype=jnp.float32``)
  where the layer holding it declares another or none is a deliberate
  float32 layer (a router, a logits head): it computes in float32 and hands
  its result on in float32, as if overridden to ``"float32"``;
* every other layer runs under the policy of the layer that called it.

Under a policy with a half compute dtype, every other compute dtype a layer
declares is dropped: the layer computes as if written without one. A model
zoo's ``dtype=float32`` default, which the model root declares and threads
through its layers, would otherwise cast every activation to float32 and
cost the half precision its memory; the root's own declaration is always
such a default. An override of the layer's class decides before either.

Where a layer's policy differs from its caller's, its calls are traced in a
policy scope (`scope_of`, `jaxamp._autocast.scope.policy_scope`): autocast
runs the operations inside under the layer's compute dtype and FP8 setting
and casts what leaves the scope to the layer's output dtype.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen, nnx

from jaxamp._autocast.scope import ScopePolicy
from jaxamp._policy import Policy, PolicySpec, get_policy, is_floating_array

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
    """The policy of a normalization layer called under `policy`.

    Params stay in the param dtype, the statistics and the normalization
    itself are computed in float32, and the result goes back to the caller's
    compute dtype, so the next layer gets what it expects.
    """
    return Policy(policy.param_dtype, jnp.float32, policy.compute_dtype)


def cast_inputs_at_entry(policy: Policy, tree: Any) -> Any:
    """A model's floating inputs as the model is traced under `policy`.

    Cast to the compute dtype only where the params are in it too (the
    ``float16`` and ``bfloat16`` policies), so the model is traced as it
    would run all in that dtype. Under a mixed policy the model is traced
    with its inputs as given and its float32 params, as written, and the
    rules decide per operation: a float16 input meeting float32 params would
    be a mix the model never sees, whose loops (a ``fori_loop`` whose carry
    starts from the input) change their carry's dtype.

    NNX objects among the inputs (``nnx.Rngs``, modules, variables) are
    handed on as they are: mapping over them would rebuild them as copies
    whose updates (an RNG count, a module's state) would be lost.
    """
    if policy.param_dtype != policy.compute_dtype:
        return tree

    def is_nnx(leaf) -> bool:
        return isinstance(leaf, (nnx.Pytree, nnx.Variable))

    def cast(leaf):
        return leaf if is_nnx(leaf) else policy.cast_to_compute(leaf)

    return jax.tree.map(cast, tree, is_leaf=is_nnx)


def scope_of(policy: Policy) -> ScopePolicy:
    """The policy scope in which a layer running under `policy` is traced."""
    return ScopePolicy(policy.compute_dtype, policy.matmul_format, policy.output_dtype)


@dataclasses.dataclass(frozen=True)
class ModulePolicies:
    """The policy of a model and the per-class overrides.

    Attributes:
        policy: the model's policy.
        overrides: the user's ``(module class, policy)`` pairs, looked up in
            order with ``isinstance`` semantics; the first match wins.
    """

    policy: Policy
    overrides: tuple[tuple[type, Policy], ...]

    @classmethod
    def create(cls, policy: PolicySpec, overrides: Mapping[type, PolicySpec] | None = None) -> ModulePolicies:
        """Validates and resolves `policy` and `overrides`."""
        policy = get_policy(policy)
        if overrides is None:
            overrides = {}
        if not isinstance(overrides, Mapping):
            raise TypeError(
                "overrides must map module classes to policies, e.g. "
                f"{{nn.Dense: 'float32'}}; got {type(overrides).__name__}."
            )
        user_overrides = []
        for module_class, spec in overrides.items():
            if not (isinstance(module_class, type) and issubclass(module_class, (linen.Module, nnx.Module))):
                raise TypeError(
                    "overrides keys must be Flax module classes (e.g. nn.Dense, "
                    f"nn.BatchNorm); got {module_class!r}."
                )
            user_overrides.append((module_class, get_policy(spec)))
        return cls(policy, tuple(user_overrides))

    def policy_for(self, module_class: type, caller_policy: Policy, *, float32_layer: bool = False) -> Policy:
        """The policy of a `module_class` layer called under `caller_policy`.

        Args:
            module_class: the layer's class.
            caller_policy: the policy of the layer that called (or holds) it.
            float32_layer: whether the layer declares float32 deliberately
                (`declares_float32`).
        """
        override = _user_override(self, module_class)
        if override is not None:
            return override
        if issubclass(module_class, NORMALIZATION_LAYERS):
            return normalization_policy(caller_policy)
        if float32_layer:
            return Policy(caller_policy.param_dtype, jnp.float32, jnp.float32)
        return caller_policy

    def drops_declared_dtypes(self) -> bool:
        """Whether the layers' declared compute dtypes give way to the policy's (a half compute dtype)."""
        return jnp.finfo(self.policy.compute_dtype).bits < 32


def declared_dtype(module: Any) -> Any:
    """The compute dtype `module` declares (its ``dtype`` field), or None."""
    return as_dtype(getattr(module, "dtype", None))


def as_dtype(value: Any) -> Any:
    """`value`, a declared ``dtype`` field, as a dtype; None where it names none."""
    try:
        return None if value is None else jnp.dtype(value)
    except TypeError:
        return None


def declares_float32(module_class: type, declared: Any, holders_declared: Iterable[Any], *, root: bool) -> bool:
    """Whether a layer declares float32 deliberately: not the model root, not a normalization layer,
    and the nearest layer above it that declares a dtype declares another, or none above does.

    Args:
        module_class: the layer's class.
        declared: the compute dtype the layer declares, or None.
        holders_declared: the dtypes the layers above it declare, nearest first, None for one
            that declares none (a block or list between a model's ``dtype`` and its layers);
            read lazily, only as far as the nearest declared one, and only for a float32 layer.
        root: whether the layer is the model itself.
    """
    if root or issubclass(module_class, NORMALIZATION_LAYERS) or declared != jnp.float32:
        return False
    nearest = next((dtype for dtype in holders_declared if dtype is not None), None)
    return nearest != jnp.float32


@contextlib.contextmanager
def declared_dtype_dropped(module: Any, drop: bool, original: Any) -> Iterator[None]:
    """Inside, `module` declares no compute dtype (``dtype=None``) if `drop`; restored after to
    `original`, its ``dtype`` as read before."""
    dropped = False
    if drop and original is not None:
        try:
            object.__setattr__(module, "dtype", None)
            dropped = True
        except (AttributeError, TypeError):  # a dtype that is a property: left as it is
            pass
    try:
        yield
    finally:
        if dropped:
            object.__setattr__(module, "dtype", original)


@functools.lru_cache(maxsize=1024)
def _user_override(module_policies: ModulePolicies, module_class: type) -> Policy | None:
    # Called for every module call while tracing; the answer depends only on
    # the (hashable) policies and the class.
    for overridden_class, policy in module_policies.overrides:
        if issubclass(module_class, overridden_class):
            return policy
    return None


def cast_by_owner(tree: Any, owner_dtypes: Mapping[tuple, Any], default_dtype: Any) -> Any:
    """Casts each floating leaf to the dtype of the deepest module that owns it.

    Args:
        tree: variables keyed by module path (a linen ``params`` collection, an
            NNX ``State``).
        owner_dtypes: module path (a tuple of names and indices) -> dtype.
        default_dtype: the dtype of leaves that no listed module owns.
    """

    def cast(path, leaf):
        if not is_floating_array(leaf):
            return leaf
        names = tuple(key.key for key in path if isinstance(key, jax.tree_util.DictKey))
        dtype = default_dtype
        for depth in range(len(names), -1, -1):
            if names[:depth] in owner_dtypes:
                dtype = owner_dtypes[names[:depth]]
                break
        return leaf if leaf.dtype == dtype else leaf.astype(dtype)

    return jax.tree_util.tree_map_with_path(cast, tree)
