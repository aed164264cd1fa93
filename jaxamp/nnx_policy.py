"""Mixed precision for `flax.nnx` models, from the outside.

NNX modules are Python objects holding their state, so the policy is applied
to a copy of the model:

* every ``nnx.Param`` is cast to the param dtype of the module that owns it;
* every module's ``dtype`` / ``param_dtype`` attributes (if it has them) are
  set to the compute / param dtype of the policy it runs under;
* every module's class is swapped for a subclass whose ``__call__`` casts the
  floating inputs to that compute dtype, reads the module's own params in
  that dtype for the duration of the call (so custom layers that use
  ``self.w.value`` directly compute in half precision too), and casts the
  outputs of the top-level model (and of overridden layers) to their policy's
  output dtype.

Params are restored to their stored values when the call returns, so the
model's state stays in the param dtype and gradients arrive in it.
"""

from __future__ import annotations

import contextlib
import functools

import jax
import numpy as np
from flax import nnx

from jaxamp.module_policy import ModulePolicies, is_floating_dtype_field


def _owner_path(path: tuple, module_paths: set[tuple]) -> tuple:
    for depth in range(len(path) - 1, -1, -1):
        if path[:depth] in module_paths:
            return path[:depth]
    return ()


@contextlib.contextmanager
def _own_params_read_as(module: nnx.Module, dtype: np.dtype):
    """Temporarily holds the module's own floating params in `dtype`."""
    stored = {}
    for name, variable in vars(module).items():
        if isinstance(variable, nnx.Param):
            value = variable.get_value()
            if (
                isinstance(value, jax.Array)
                and np.issubdtype(value.dtype, np.floating)
                and value.dtype != dtype
            ):
                stored[name] = value
                variable.set_value(value.astype(dtype))
    try:
        yield
    finally:
        for name, value in stored.items():
            getattr(module, name).set_value(value)


@functools.cache
def _policy_class(module_class: type, module_policies: ModulePolicies, is_root: bool) -> type:
    """A subclass of `module_class` whose calls run under `module_policies`."""
    policy, is_overridden = module_policies.lookup(module_class)
    cast_outputs = is_root or is_overridden
    output_policy = module_policies.policy if is_root else policy

    def __call__(self, *args, **kwargs):
        args, kwargs = policy.cast_to_compute((args, kwargs))
        with _own_params_read_as(self, policy.compute_dtype):
            outputs = module_class.__call__(self, *args, **kwargs)
        return output_policy.cast_to_output(outputs) if cast_outputs else outputs

    return type(module_class)(
        module_class.__name__,
        (module_class,),
        {
            "__call__": __call__,
            "__module__": module_class.__module__,
            "__qualname__": module_class.__qualname__,
            "jaxamp_policies": module_policies,
        },
    )


def _defines_call(module_class: type) -> bool:
    # getattr(cls, "__call__") would find the metaclass's __call__ on any class.
    return any("__call__" in vars(klass) for klass in module_class.__mro__ if klass is not object)


def apply_nnx_policy(module: nnx.Module, module_policies: ModulePolicies) -> nnx.Module:
    """Returns a copy of `module` that runs under `module_policies`.

    See this file's docstring; `jaxamp.apply_policy` is the public entry point.
    """
    if isinstance(type(module).__dict__.get("jaxamp_policies"), ModulePolicies):
        raise ValueError(
            "This NNX module already runs under a jaxamp policy; apply_policy to the original module instead."
        )
    model = nnx.clone(module)
    modules = dict(nnx.iter_modules(model))
    for path, submodule in modules.items():
        policy = module_policies.for_module(submodule)
        for attribute, dtype in (("dtype", policy.compute_dtype), ("param_dtype", policy.param_dtype)):
            if hasattr(submodule, attribute) and is_floating_dtype_field(getattr(submodule, attribute)):
                setattr(submodule, attribute, dtype)

    module_paths = set(modules)
    for path, node in list(nnx.iter_graph(model)):
        if isinstance(node, nnx.Param):
            owner = modules[_owner_path(tuple(path), module_paths)]
            value = node.get_value()
            param_dtype = module_policies.for_module(owner).param_dtype
            if isinstance(value, jax.Array) and np.issubdtype(value.dtype, np.floating):
                node.set_value(value.astype(param_dtype))

    for path, submodule in modules.items():
        if _defines_call(type(submodule)):
            submodule.__class__ = _policy_class(type(submodule), module_policies, path == ())
    return model
