"""Mixed precision for `flax.linen` models, from the outside.

Casting a linen model's inputs is not enough: layers promote, so a float16
input meeting a float32 kernel computes in float32. `PolicyModule` therefore
works at three points, none of which needs the model's code to change:

1. **Every module call.** A method interceptor (``nn.intercept_methods``)
   sees each call of each submodule. It sets the module's ``dtype`` field (if
   it has one) to the compute dtype of the policy that module runs under and
   its ``param_dtype`` field to the param dtype, casts the call's floating
   inputs to that compute dtype, and, for modules under an override policy
   (normalization layers by default), casts their outputs to that policy's
   output dtype.
2. **Every param read.** For `apply`, each param is wrapped in a Flax
   ``AxisMetadata`` box whose ``unbox`` (what ``self.param`` returns) casts
   it to the compute dtype of the module reading it. Custom layers that do
   ``x @ self.param(...)`` therefore compute in half precision too.
   Gradients flow back through the cast, so they arrive in the param dtype.
3. **Init.** Params that a layer created in another dtype (a custom
   ``self.param`` with a float32 initializer under a float16 policy) are cast
   to the param dtype of the module that owns them.

The wrapper shares its scope with the wrapped model (``nn.share_scope``), so
the variables keep exactly the wrapped model's structure and names.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Any

import jax
import numpy as np
from flax import linen as nn
from flax import struct
from flax.core import meta

from jaxamp.module_policy import ModulePolicies, is_floating_dtype_field

# The ModulePolicies of the innermost PolicyModule being called.
_ACTIVE_POLICIES: contextvars.ContextVar[ModulePolicies | None] = contextvars.ContextVar(
    "jaxamp_active_policies", default=None
)
# The dtype in which params are read by the module being called.
_PARAM_READ_DTYPE: contextvars.ContextVar[np.dtype | None] = contextvars.ContextVar(
    "jaxamp_param_read_dtype", default=None
)
# During PolicyModule.init: module path -> param dtype of that module.
_INIT_PARAM_DTYPES: contextvars.ContextVar[dict[tuple[str, ...], np.dtype] | None] = contextvars.ContextVar(
    "jaxamp_init_param_dtypes", default=None
)


@contextlib.contextmanager
def _context_value(variable: contextvars.ContextVar, value: Any):
    token = variable.set(value)
    try:
        yield
    finally:
        variable.reset(token)


class CastOnRead(struct.PyTreeNode, meta.AxisMetadata):
    """A param box that casts its value to the reading module's compute dtype.

    Flax's ``self.param`` unboxes ``AxisMetadata`` before returning a param;
    this box's ``unbox`` casts floating values to the compute dtype of the
    module whose method is running. Outside a `PolicyModule` call it returns
    the value unchanged.
    """

    value: Any

    def unbox(self) -> Any:
        dtype = _PARAM_READ_DTYPE.get()
        value = self.value
        if (
            dtype is not None
            and isinstance(value, jax.Array)
            and np.issubdtype(value.dtype, np.floating)
            and value.dtype != dtype
        ):
            return value.astype(dtype)
        return value

    def replace_boxed(self, val: Any) -> CastOnRead:
        return self.replace(value=val)

    def add_axis(self, index: int, params: dict[Any, Any]) -> CastOnRead:
        return self

    def remove_axis(self, index: int, params: dict[Any, Any]) -> CastOnRead:
        return self


def _box_params(tree: Any) -> Any:
    return jax.tree.map(CastOnRead, tree)


def _unbox_params(tree: Any) -> Any:
    return jax.tree.map(
        lambda leaf: leaf.value if isinstance(leaf, CastOnRead) else leaf,
        tree,
        is_leaf=lambda leaf: isinstance(leaf, CastOnRead),
    )


def _set_dtype_fields(module: nn.Module, policy) -> None:
    """Points a bound module's ``dtype``/``param_dtype`` fields at `policy`.

    Linen modules are frozen dataclasses, but the instance here is the bound
    clone that Flax made for this ``init``/``apply`` call, never the user's
    module, so changing it in place affects this call alone.
    """
    field_names = {field.name for field in dataclasses.fields(module)}
    for field_name, dtype in (("dtype", policy.compute_dtype), ("param_dtype", policy.param_dtype)):
        if field_name in field_names:
            current = getattr(module, field_name)
            if current != dtype and is_floating_dtype_field(current):
                object.__setattr__(module, field_name, dtype)


def _policy_interceptor(next_fun, args, kwargs, context):
    """Runs one module method under the policy of that module's class."""
    module_policies = _ACTIVE_POLICIES.get()
    if module_policies is None or context.module.scope is None:
        return next_fun(*args, **kwargs)
    module = context.module
    policy = module_policies.for_module(module)
    _set_dtype_fields(module, policy)
    init_param_dtypes = _INIT_PARAM_DTYPES.get()
    if init_param_dtypes is not None:
        init_param_dtypes[tuple(module.scope.path)] = policy.param_dtype
    args, kwargs = policy.cast_to_compute((args, kwargs))
    with _context_value(_PARAM_READ_DTYPE, policy.compute_dtype):
        outputs = next_fun(*args, **kwargs)
    if module_policies.is_overridden(module) and context.method_name != "setup":
        outputs = policy.cast_to_output(outputs)
    return outputs


def _cast_params_to_owner_dtype(params: Any, param_dtypes: dict[tuple[str, ...], np.dtype], default):
    """Casts each param to the param dtype of the deepest module that owns it."""

    def cast(path, leaf):
        if not (isinstance(leaf, jax.Array) and np.issubdtype(leaf.dtype, np.floating)):
            return leaf
        names = tuple(str(key.key) for key in path if isinstance(key, jax.tree_util.DictKey))
        dtype = default
        for depth in range(len(names), -1, -1):
            if names[:depth] in param_dtypes:
                dtype = param_dtypes[names[:depth]]
                break
        return leaf if leaf.dtype == dtype else leaf.astype(dtype)

    return jax.tree_util.tree_map_with_path(cast, params)


class PolicyModule(nn.Module):
    """A linen module that runs `module` under a precision policy.

    Made by `jaxamp.apply_policy`; see that function and this file's docstring
    for what it does. ``init`` and ``apply`` take the same arguments as the
    wrapped module's, ``method=`` included, and return variables of the same
    structure.

    Attributes:
        module: the wrapped model.
        module_policies: the model's policy and the per-class overrides.
    """

    module: nn.Module
    module_policies: ModulePolicies

    @property
    def policy(self):
        """The model's `jaxamp.Policy`."""
        return self.module_policies.policy

    def setup(self):
        nn.share_scope(self, self.module)

    def __call__(self, *args, **kwargs):
        return self._run("__call__", *args, **kwargs)

    def _run(self, method_name: str, *args, **kwargs):
        policy = self.module_policies.policy
        args, kwargs = policy.cast_to_compute((args, kwargs))
        outer = _ACTIVE_POLICIES.get()
        with contextlib.ExitStack() as stack:
            if outer is None:
                stack.enter_context(nn.intercept_methods(_policy_interceptor))
            stack.enter_context(_context_value(_ACTIVE_POLICIES, self.module_policies))
            stack.enter_context(_context_value(_PARAM_READ_DTYPE, policy.compute_dtype))
            outputs = getattr(self.module, method_name)(*args, **kwargs)
        return policy.cast_to_output(outputs)

    def _run_method(self, *args, jaxamp_method_name: str, **kwargs):
        return self._run(jaxamp_method_name, *args, **kwargs)

    def _route_method(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """Sends ``method=`` (a name or function of the wrapped model) inside."""
        method = kwargs.pop("method", None)
        if method is None:
            return kwargs
        name = method if isinstance(method, str) else getattr(method, "__name__", None)
        if not name or not callable(getattr(self.module, name, None)):
            raise AttributeError(f"{type(self.module).__name__} has no method {method!r} to apply.")
        return {**kwargs, "method": PolicyModule._run_method, "jaxamp_method_name": name}

    def init_with_output(self, rngs, *args, **kwargs):
        """Like ``nn.Module.init_with_output``; params come out in param dtypes."""
        param_dtypes: dict[tuple[str, ...], np.dtype] = {}
        with _context_value(_INIT_PARAM_DTYPES, param_dtypes):
            outputs, variables = super().init_with_output(rngs, *args, **self._route_method(kwargs))
        if "params" in variables:
            params = _cast_params_to_owner_dtype(
                variables["params"], param_dtypes, self.module_policies.policy.param_dtype
            )
            variables = {**variables, "params": params}
        return outputs, variables

    def apply(self, variables, *args, **kwargs):
        """Like ``nn.Module.apply``, with params read in each layer's compute dtype."""
        if "params" in variables:
            variables = {**variables, "params": _box_params(variables["params"])}
        mutable = kwargs.get("mutable", False)
        result = super().apply(variables, *args, **self._route_method(kwargs))
        if mutable is False:
            return result
        outputs, updated = result
        return outputs, _unbox_params(updated)
