"""Mixed precision for `flax.linen` models, from the outside.

Casting a linen model's inputs is not enough: layers promote, so a float16
input meeting a float32 kernel computes in float32. `PolicyModule` therefore
works at three points, none of which needs the model's code to change:

1. **Every module call.** A method interceptor (``nn.intercept_methods``)
   sees each call of each submodule and works out the policy that module runs
   under (see `jaxamp.layer_policies`). It sets the module's ``dtype`` field
   (if it has one) to that policy's compute dtype and its ``param_dtype``
   field to the param dtype, and casts the call's floating inputs to the
   compute dtype (recurrent cells excepted). Where the call crosses into
   another policy (a normalization layer, an overridden class), it casts the
   outputs to the callee's output dtype.
2. **Apply.** Before the wrapped model runs, each param is cast to the
   compute dtype of the module that owns it, so custom layers that compute
   with ``self.param(...)`` or ``self.variables`` directly run in half
   precision too. Which module runs under which policy is found by tracing
   the call once abstractly (``jax.eval_shape``, cached per call signature:
   shapes, dtypes, static arguments). The casts are differentiable:
   gradients arrive in the param dtype.
3. **Init.** The wrapped model creates its variables as it is; each param
   is then cast to the param dtype of the module that owns it (a float16
   policy gets float16 params, custom ``self.param`` ones included).

The wrapper shares its scope with the wrapped model (``nn.share_scope``), so
the variables keep exactly the wrapped model's structure and names.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import dataclasses
import functools
from typing import Any

import jax
import numpy as np
from flax import linen as nn

from jaxamp.layer_policies import RECURRENT_CELLS, ModulePolicies, cast_by_owner, is_floating_dtype_field
from jaxamp.policy import Policy, is_floating_array


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


def _call_signature(variables, args: tuple, kwargs: dict) -> tuple | None:
    """What decides which layers a call visits, as a hashable key (or None).

    Array shapes and dtypes, the params' structure and the non-array
    arguments count; Python floats count by type only (they scale values, they
    rarely choose layers), so a changing scalar does not trace anew each call.
    """

    def describe(leaf):
        if isinstance(leaf, (jax.Array, np.ndarray)):
            return (np.shape(leaf), str(leaf.dtype))
        if isinstance(leaf, float):
            return float
        return leaf

    leaves = tuple(describe(leaf) for leaf in jax.tree.leaves((args, kwargs)))
    try:
        hash(leaves)
    except TypeError:
        return None
    return (jax.tree.structure(variables.get("params")), jax.tree.structure((args, kwargs)), leaves)


_CACHE_SIZE = 32


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

    def _run(self, target, *args, **kwargs):
        """Calls `target` (a method name, or a function of the wrapped model) under the policy."""
        policy = self.module_policies.policy
        args, kwargs = policy.cast_to_compute((args, kwargs))
        call = (
            getattr(self.module, target)
            if isinstance(target, str)
            else functools.partial(target, self.module)
        )
        with contextlib.ExitStack() as stack:
            if _ACTIVE_CALL.get() is None:
                stack.enter_context(nn.intercept_methods(_policy_interceptor))
            stack.enter_context(_context_value(_ACTIVE_CALL, _ActiveCall(self.module_policies, policy)))
            outputs = call(*args, **kwargs)
        return policy.cast_to_output(outputs)

    def _run_method(self, *args, jaxamp_method, **kwargs):
        return self._run(jaxamp_method, *args, **kwargs)

    def _wrapper_kwargs(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """Adapts ``init``/``apply`` keyword arguments to the wrapper.

        ``method=`` (a method name, or any function taking the wrapped model
        first, as Flax allows) is sent inside the policy, and
        ``capture_intermediates`` skips the wrapper itself, which shares the
        model's scope and would otherwise add a second root entry.
        """
        kwargs = dict(kwargs)
        method = kwargs.pop("method", None)
        if isinstance(method, str) and not callable(getattr(self.module, method, None)):
            raise AttributeError(  # noqa: TRY004 (a missing attribute, as getattr would raise)
                f"{type(self.module).__name__} has no method {method!r} to apply."
            )
        if method is not None and not (isinstance(method, str) or callable(method)):
            raise TypeError(f"method must be a method name or a function; got {method!r}.")
        if method is not None:
            kwargs.update(method=PolicyModule._run_method, jaxamp_method=method)
        capture = kwargs.get("capture_intermediates", False)
        if capture:
            wanted = capture if callable(capture) else (lambda module, name: name == "__call__")
            kwargs["capture_intermediates"] = lambda module, name: (
                not isinstance(module, PolicyModule) and wanted(module, name)
            )
        return kwargs

    def init(self, rngs, *args, **kwargs):
        """Like ``nn.Module.init``; params come out in their layers' param dtypes."""
        return self._init_variables(rngs, args, kwargs)

    def init_with_output(self, rngs, *args, **kwargs):
        """Like ``nn.Module.init_with_output``; the outputs are computed under the policy."""
        variables = self._init_variables(rngs, args, kwargs)
        rng_dict = rngs if isinstance(rngs, dict) else {"params": rngs}
        apply_kwargs = {key: value for key, value in kwargs.items() if key != "mutable"}
        outputs, _ = self.apply(variables, *args, rngs=rng_dict, mutable=True, **apply_kwargs)
        return outputs, variables

    def _init_variables(self, rngs, args, kwargs):
        """The wrapped model's own variables, params cast to each owner's param dtype.

        The variables are created by the wrapped model as it is (float32
        params, no casting), so that creating them never depends on a cast;
        which layer owns which param is then found by tracing the policy's
        call abstractly.
        """
        variables = self.module.init(rngs, *args, **kwargs)
        if "params" not in variables:
            return variables
        rng_dict = rngs if isinstance(rngs, dict) else {"params": rngs}
        apply_kwargs = {key: value for key, value in kwargs.items() if key != "mutable"}
        policies = self._policies_by_path(
            variables, args, {"rngs": rng_dict, "mutable": True, **apply_kwargs}
        )
        param_dtypes = {path: policy.param_dtype for path, policy in policies.items()}
        return {
            **variables,
            "params": cast_by_owner(variables["params"], param_dtypes, self.policy.param_dtype),
        }

    def apply(self, variables, *args, **kwargs):
        """Like ``nn.Module.apply``, with each param cast to its layer's compute dtype."""
        if "params" in variables:
            policies = self._policies_by_path(variables, args, kwargs)
            compute_dtypes = {path: policy.compute_dtype for path, policy in policies.items()}
            params = cast_by_owner(variables["params"], compute_dtypes, self.policy.compute_dtype)
            variables = {**variables, "params": params}
        return super().apply(variables, *args, **self._wrapper_kwargs(kwargs))

    def _policies_by_path(self, variables, args, kwargs) -> dict[tuple[str, ...], Policy]:
        """Module path -> the policy it runs under, from one abstract trace of the call.

        The trace sees the params already in the compute dtype, as the real
        call will, so a model that only works with cast params (a scan over
        layers that read params directly) traces too. Results are cached per
        call signature (see `_call_signature`).
        """
        cache = self.__dict__.setdefault("_jaxamp_policies_by_path", collections.OrderedDict())
        key = _call_signature(variables, args, kwargs)
        if key is not None and key in cache:
            cache.move_to_end(key)
            return cache[key]
        compute_dtype = self.policy.compute_dtype

        def abstract(collection, leaf):
            dtype = compute_dtype if collection == "params" and is_floating_array(leaf) else leaf.dtype
            return jax.ShapeDtypeStruct(np.shape(leaf), dtype)

        abstract_variables = {
            collection: jax.tree.map(functools.partial(abstract, collection), tree)
            for collection, tree in variables.items()
        }
        recorded: dict[tuple[str, ...], Policy] = {}
        with _context_value(_RECORDED_POLICIES, recorded):
            jax.eval_shape(
                lambda variables: super(PolicyModule, self).apply(
                    variables, *args, **self._wrapper_kwargs(kwargs)
                ),
                abstract_variables,
            )
        if key is not None:
            cache[key] = recorded
            if len(cache) > _CACHE_SIZE:
                cache.popitem(last=False)
        return recorded
