"""Mixed precision for `flax.nnx` models, from the outside.

NNX modules are Python objects holding their state, so the policy is applied
to a copy of the model, once:

* each module's policy is worked out from the root down (see
  `jaxamp.layer_policies`), its ``dtype`` / ``param_dtype`` attributes (if it
  has them) are set to that policy's compute / param dtype, and every
  ``nnx.Param`` is cast to the param dtype of the module that owns it;
* each module's class is swapped for a subclass whose ``__call__`` casts the
  floating inputs to the module's compute dtype (recurrent cells excepted)
  and, at a policy boundary, the outputs to the module's output dtype;
* the top-level model's ``__call__`` runs on a view of the model whose params
  are cast to the compute dtype of the module that owns them (``nnx.split``,
  cast, ``nnx.merge``: no Param is mutated, so the model also works inside
  plain ``jax.jit``), writes back any state the call changed (batch
  statistics, RNG counts), and casts its outputs to the output dtype.

Params therefore stay in the param dtype and gradients arrive in it. A
module's policy is decided by where it is stored (its path from the root),
not by who calls it: a module shared between two places takes the policy of
the first path NNX lists.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
from flax import nnx

from jaxamp.layer_policies import RECURRENT_CELLS, ModulePolicies, cast_by_owner, is_floating_dtype_field
from jaxamp.policy import Policy


def _cast_call_arguments(policy: Policy, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Casts the floating arrays among a call's arguments to the compute dtype.

    NNX objects passed along (``nnx.Rngs``, modules, variables) are handed on
    as they are: mapping over them would rebuild them as copies whose updates
    (an RNG count, a module's state) would be lost.
    """

    def cast(leaf):
        return leaf if isinstance(leaf, (nnx.Pytree, nnx.Variable)) else policy.cast_to_compute(leaf)

    return jax.tree.map(
        cast, (args, kwargs), is_leaf=lambda leaf: isinstance(leaf, (nnx.Pytree, nnx.Variable))
    )


def _defines_call(module_class: type) -> bool:
    # getattr(cls, "__call__") would find the metaclass's __call__ on any class.
    return any("__call__" in vars(klass) for klass in module_class.__mro__ if klass is not object)


def _policies_by_path(
    modules: dict[tuple, nnx.Module], module_policies: ModulePolicies
) -> dict[tuple, tuple[Policy, Policy]]:
    """Each module's ``(policy, holder's policy)``, inherited from the module that holds it.

    The holder is the module at the longest proper prefix of the path; the
    root's holder policy is the model's own policy.
    """
    policies: dict[tuple, tuple[Policy, Policy]] = {}
    for path in sorted(modules, key=len):
        holder = next(
            (path[:depth] for depth in range(len(path) - 1, -1, -1) if path[:depth] in policies), None
        )
        holder_policy = module_policies.policy if holder is None else policies[holder][0]
        policies[path] = (module_policies.policy_for(type(modules[path]), holder_policy), holder_policy)
    return policies


@functools.lru_cache(maxsize=1024)
def _layer_class(module_class: type, policy: Policy, output_policy: Policy | None) -> type:
    """A subclass of `module_class` whose calls run under `policy`."""
    casts_inputs = not issubclass(module_class, RECURRENT_CELLS)

    def __call__(self, *args, **kwargs):
        if casts_inputs:
            args, kwargs = _cast_call_arguments(policy, args, kwargs)
        outputs = module_class.__call__(self, *args, **kwargs)
        return outputs if output_policy is None else output_policy.cast_to_output(outputs)

    layer_class = _subclass(module_class, __call__)
    layer_class.jaxamp_layer = True
    return layer_class


def _root_class(
    module_class: type, module_policies: ModulePolicies, compute_dtypes: dict[tuple, Any]
) -> type:
    """A subclass of the top-level model's class that casts params per call."""
    policy = module_policies.policy

    def __call__(self, *args, **kwargs):
        graphdef, params, state = nnx.split(self, nnx.Param, ...)
        compute_view = nnx.merge(graphdef, cast_by_owner(params, compute_dtypes, policy.compute_dtype), state)
        args, kwargs = _cast_call_arguments(policy, args, kwargs)
        outputs = module_class.__call__(compute_view, *args, **kwargs)
        new_state = nnx.state(compute_view, nnx.Not(nnx.Param))
        # Write back only when the call changed something (batch statistics, RNG
        # counts, sown values), so that a call that changes nothing (inference)
        # mutates no Variable and works inside plain jax.jit.
        old_leaves, new_leaves = jax.tree.leaves(state), jax.tree.leaves(new_state)
        changed = jax.tree.structure(new_state) != jax.tree.structure(state) or any(
            new is not old for new, old in zip(new_leaves, old_leaves, strict=True)
        )
        if changed:
            nnx.update(self, new_state)
        return policy.cast_to_output(outputs)

    root_class = _subclass(module_class, __call__)
    root_class.jaxamp_policies = module_policies
    return root_class


def _subclass(module_class: type, call) -> type:
    return type(module_class)(
        module_class.__name__,
        (module_class,),
        {"__call__": call, "__module__": module_class.__module__, "__qualname__": module_class.__qualname__},
    )


def apply_nnx_policy(module: nnx.Module, module_policies: ModulePolicies) -> nnx.Module:
    """Returns a copy of `module` that runs under `module_policies`.

    See this file's docstring; `jaxamp.apply_policy` is the public entry point.
    """
    model = nnx.clone(module)
    modules = dict(nnx.iter_modules(model))
    for path, submodule in modules.items():
        if getattr(type(submodule), "jaxamp_layer", False) or isinstance(
            getattr(type(submodule), "jaxamp_policies", None), ModulePolicies
        ):
            where = f"submodule at {'.'.join(map(str, path))}" if path else "module"
            raise ValueError(
                f"This NNX {where} already runs under a jaxamp policy; apply_policy to the original model, "
                "and give any part its own policy with overrides."
            )
    policies = _policies_by_path(modules, module_policies)

    for path, submodule in modules.items():
        policy = policies[path][0]
        for attribute, dtype in (("dtype", policy.compute_dtype), ("param_dtype", policy.param_dtype)):
            if hasattr(submodule, attribute) and is_floating_dtype_field(getattr(submodule, attribute)):
                setattr(submodule, attribute, dtype)

    param_dtypes = {path: policy.param_dtype for path, (policy, _) in policies.items()}
    nnx.update(
        model, cast_by_owner(nnx.state(model, nnx.Param), param_dtypes, module_policies.policy.param_dtype)
    )

    for path, submodule in modules.items():
        if path == () or not _defines_call(type(submodule)):
            continue
        policy, holder_policy = policies[path]
        output_policy = policy if policy != holder_policy else None
        submodule.__class__ = _layer_class(type(submodule), policy, output_policy)

    if not _defines_call(type(model)):
        raise TypeError(
            f"apply_policy needs an NNX model with a __call__ method; {type(model).__name__} has none."
        )
    compute_dtypes = {path: policy.compute_dtype for path, (policy, _) in policies.items()}
    model.__class__ = _root_class(type(model), module_policies, compute_dtypes)
    return model
