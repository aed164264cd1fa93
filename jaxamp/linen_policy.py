"""Mixed precision for `flax.linen` models, from the outside.

Casting a linen model's inputs is not enough: layers promote, so a float16
input meeting a float32 kernel computes in float32. `PolicyModule` therefore
works at three points, none of which needs the model's code to change:

1. **Every module call.** A method interceptor (``nn.intercept_methods``)
   sees each call of each submodule and works out the policy that module runs
   under (see `jaxamp.module_policy`). It sets the module's ``dtype`` field
   (if it has one) to that policy's compute dtype and its ``param_dtype``
   field to the param dtype, and casts the call's floating inputs to the
   compute dtype (recurrent cells excepted). Where the call crosses into
   another policy (a normalization layer, an overridden class), it casts the
   outputs to the callee's output dtype.
2. **Apply.** Before the wrapped model runs, each param is cast to the
   compute dtype of the module that owns it, so custom layers that compute
   with ``self.param(...)`` or ``self.variables`` directly run in half
   precision too. Which module runs under which policy is found by tracing
   the call once abstractly (``jax.eval_shape``, cached per params structure
   and static arguments). The casts are differentiable: gradients arrive in
   the param dtype.
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

from jaxamp.module_policy import RECURRENT_CELLS, ModulePolicies, cast_by_owner, is_floating_dtype_field
from jaxamp.policy import Policy


@dataclasses.dataclass(frozen=True)
class _ActiveCall:
    """What the interceptor needs to know about the call in progress."""

    module_policies: ModulePolicies
    policy: Policy  # the policy of the module whose method is running


_ACTIVE_CALL: contextvars.ContextVar[_ActiveCall | None] = contextvars.ContextVar(
    "jaxamp_active_call", default=None
)
# While recording: module path -> the policy that module ran under.
_RECORDED_POLICIES: contextvars.ContextVar[dict[tuple[str, ...], Policy] | None] = contextvars.ContextVar(
    "jaxamp_recorded_policies", default=None
)


@contextlib.contextmanager
def _context_value(variable: contextvars.ContextVar, value: Any):
    token = variable.set(value)
    try:
        yield
    finally:
        variable.reset(token)


def _set_dtype_fields(module: nn.Module, policy: Policy) -> None:
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
    """Runs one module method under the policy of that module."""
    active = _ACTIVE_CALL.get()
    module = context.module
    if active is None or module.scope is None:
        return next_fun(*args, **kwargs)
    policy = active.module_policies.policy_for(type(module), active.policy)
    _set_dtype_fields(module, policy)
    recorded = _RECORDED_POLICIES.get()
    if recorded is not None:
        recorded[tuple(module.scope.path)] = policy
    is_setup = context.method_name == "setup"
    if not (is_setup or isinstance(module, RECURRENT_CELLS)):
        args, kwargs = policy.cast_to_compute((args, kwargs))
    crosses_boundary = policy != active.policy and not is_setup
    with _context_value(_ACTIVE_CALL, dataclasses.replace(active, policy=policy)):
        outputs = next_fun(*args, **kwargs)
    if crosses_boundary:
        outputs = policy.cast_to_output(outputs)
    return outputs


def _static_signature(args: tuple, kwargs: dict) -> tuple | None:
    """The hashable non-array arguments of a call, or None if some are not hashable."""
    leaves = [
        leaf for leaf in jax.tree.leaves((args, kwargs)) if not isinstance(leaf, (jax.Array, np.ndarray))
    ]
    try:
        hash(tuple(leaves))
    except TypeError:
        return None
    return (jax.tree.structure((args, kwargs)), tuple(leaves))


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
    def policy(self) -> Policy:
        """The model's `jaxamp.Policy`."""
        return self.module_policies.policy

    def setup(self):
        nn.share_scope(self, self.module)

    def __call__(self, *args, **kwargs):
        return self._run("__call__", *args, **kwargs)

    def _run(self, method_name: str, *args, **kwargs):
        policy = self.module_policies.policy
        args, kwargs = policy.cast_to_compute((args, kwargs))
        with contextlib.ExitStack() as stack:
            if _ACTIVE_CALL.get() is None:
                stack.enter_context(nn.intercept_methods(_policy_interceptor))
            stack.enter_context(_context_value(_ACTIVE_CALL, _ActiveCall(self.module_policies, policy)))
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
        recorded: dict[tuple[str, ...], Policy] = {}
        with _context_value(_RECORDED_POLICIES, recorded):
            outputs, variables = super().init_with_output(rngs, *args, **self._route_method(kwargs))
        if "params" in variables:
            param_dtypes = {path: policy.param_dtype for path, policy in recorded.items()}
            params = cast_by_owner(variables["params"], param_dtypes, self.policy.param_dtype)
            variables = {**variables, "params": params}
        return outputs, variables

    def apply(self, variables, *args, **kwargs):
        """Like ``nn.Module.apply``, with each param cast to its layer's compute dtype."""
        kwargs = self._route_method(kwargs)
        if "params" in variables:
            compute_dtypes = self._compute_dtypes_by_path(variables, args, kwargs)
            params = cast_by_owner(variables["params"], compute_dtypes, self.policy.compute_dtype)
            variables = {**variables, "params": params}
        return super().apply(variables, *args, **kwargs)

    def _compute_dtypes_by_path(self, variables, args, kwargs) -> dict[tuple[str, ...], np.dtype]:
        """Module path -> compute dtype, found by tracing the call abstractly once."""
        cache = self.__dict__.setdefault("_jaxamp_compute_dtypes", {})
        signature = _static_signature(args, kwargs)
        key = None if signature is None else (jax.tree.structure(variables["params"]), signature)
        if key is not None and key in cache:
            return cache[key]
        recorded: dict[tuple[str, ...], Policy] = {}
        with _context_value(_RECORDED_POLICIES, recorded):
            abstract_variables = jax.tree.map(
                lambda leaf: jax.ShapeDtypeStruct(np.shape(leaf), leaf.dtype), variables
            )
            jax.eval_shape(
                lambda variables: super(PolicyModule, self).apply(variables, *args, **kwargs),
                abstract_variables,
            )
        compute_dtypes = {path: policy.compute_dtype for path, policy in recorded.items()}
        if key is not None:
            cache[key] = compute_dtypes
        return compute_dtypes
