"""Mixed precision for `flax.linen` models, from the outside.

`PolicyModule` adds to `jaxamp.autocast` what only a Flax model has:

1. **Init.** The wrapped model creates its variables as it is; each param
   is then cast to the param dtype of the layer that owns it (a float16
   policy gets float16 params, custom ``self.param`` ones included).
2. **Apply.** ``apply`` (with any ``method=``) runs through `jaxamp.autocast`
   under the model's policy: every matmul and convolution of every layer,
   custom layers included, runs in the compute dtype, the numerically
   sensitive operations in float32, and the outputs come back in the output
   dtype. The gradients arrive in the param dtype.
3. **Layers with a policy of their own.** A method interceptor
   (``nn.intercept_methods``) sees each call of each submodule; where the
   class asks for another policy than its caller's (``overrides``, the
   normalization layers: `jaxamp._flax.layers`), the call is traced in a
   policy scope, which autocast reads. The interceptor changes nothing
   else: no field, no input, no output.

The wrapper shares its scope with the wrapped model (``nn.share_scope``), so
the variables keep exactly the wrapped model's structure and names.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from collections.abc import Iterator
from typing import Any

from flax import linen as nn

from jaxamp._autocast.arguments import LeafOrigin
from jaxamp._autocast.scope import policy_scope
from jaxamp._autocast.transform import make_autocast, model_outputs
from jaxamp._flax.layers import (
    ModulePolicies,
    cast_by_owner,
    cast_inputs_at_entry,
    as_dtype,
    declared_dtype_dropped,
    declares_float32,
    scope_of,
)
from jaxamp._policy import Policy


@dataclasses.dataclass(frozen=True)
class _ActiveCall:
    """What the interceptor needs to know about the call in progress.

    Attributes:
        module_policies: the model's policy and overrides.
        policy: the policy of the module whose method is running.
        owners: while the variables are created, module path -> the policy
            that module runs under; None otherwise.
        declared: ``id`` of each module called -> the compute dtype it
            declares, read before the call drops it.
    """

    module_policies: ModulePolicies
    policy: Policy
    owners: dict[tuple[str, ...], Policy] | None = None
    declared: dict[int, Any] = dataclasses.field(default_factory=dict)


_ACTIVE_CALL: contextvars.ContextVar[_ActiveCall | None] = contextvars.ContextVar(
    "jaxamp_active_call", default=None
)


@contextlib.contextmanager
def _active_call(active: _ActiveCall):
    token = _ACTIVE_CALL.set(active)
    try:
        yield
    finally:
        _ACTIVE_CALL.reset(token)


def _read_dtype(module: nn.Module) -> Any:
    """``module.dtype`` as declared, or None, read with the interceptor passing through: reading an
    attribute can run one of the module's methods (``nnx.bridge.ToLinen.__getattr__`` does), which
    the interceptor would otherwise enter again to read the same attribute."""
    with _active_call(None):
        return getattr(module, "dtype", None)


def _holders(module: nn.Module) -> Iterator[nn.Module]:
    """The modules above `module` inside the policy's wrapper, nearest first."""
    holder = module.parent
    while isinstance(holder, nn.Module) and not isinstance(holder, PolicyModule):
        yield holder
        holder = holder.parent


def _declared(active: _ActiveCall, module: nn.Module) -> Any:
    """The compute dtype `module` declares, as first read in this call (before it was dropped)."""
    if id(module) not in active.declared:
        active.declared[id(module)] = as_dtype(_read_dtype(module))
    return active.declared[id(module)]


def _scope_interceptor(next_fun, args, kwargs, context):
    """Traces a module method in the policy scope of its class, where that differs from its caller's."""
    active = _ACTIVE_CALL.get()
    module = context.module
    if active is None or module.scope is None or context.method_name == "setup":
        return next_fun(*args, **kwargs)
    value = _read_dtype(module)
    declared = active.declared.setdefault(id(module), as_dtype(value))
    parent = module.parent
    root = not isinstance(parent, nn.Module) or isinstance(parent, PolicyModule)
    drops = active.module_policies.drops_declared_dtypes()
    holders_declared = (_declared(active, holder) for holder in _holders(module))
    float32_layer = drops and declares_float32(type(module), declared, holders_declared, root=root)
    policy = active.module_policies.policy_for(type(module), active.policy, float32_layer=float32_layer)
    if active.owners is not None:
        active.owners[tuple(module.scope.path)] = policy
    scope = policy_scope(scope_of(policy)) if policy != active.policy else contextlib.nullcontext()
    with (
        _active_call(dataclasses.replace(active, policy=policy)),
        scope,
        declared_dtype_dropped(module, drops and not float32_layer, value),
    ):
        return next_fun(*args, **kwargs)


@contextlib.contextmanager
def _layer_scopes(active: _ActiveCall):
    """Runs the module calls inside with `_scope_interceptor`, once per model."""
    with contextlib.ExitStack() as stack:
        if _ACTIVE_CALL.get() is None:
            stack.enter_context(nn.intercept_methods(_scope_interceptor))
        stack.enter_context(_active_call(active))
        yield


@functools.lru_cache(maxsize=64)
def _intermediates_of_the_model(capture):
    """A ``capture_intermediates`` filter that skips the wrapper, which shares the model's scope."""
    wanted = capture if callable(capture) else _default_capture

    def filter_fn(module, method_name):
        return not isinstance(module, PolicyModule) and wanted(module, method_name)

    return filter_fn


def _default_capture(module, method_name):
    return method_name == "__call__"


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
    def jaxamp_policy(self) -> Policy:
        """The model's `jaxamp.Policy`, under the name every model of `jaxamp.apply_policy` answers
        to (`jaxamp._policy.policy_of`)."""
        return self.module_policies.policy

    def setup(self):
        nn.share_scope(self, self.module)

    def __call__(self, *args, **kwargs):
        return self._run("__call__", *args, **kwargs)

    def _run(self, target, *args, **kwargs):
        """Calls `target` (a method name, or a function of the wrapped model) under the policy.

        Inside another model under a policy, this one's policy is a policy
        scope of its own, as an override would be.
        """
        active = _ACTIVE_CALL.get()
        if active is None:
            raise TypeError(
                f"This apply_policy model ({type(self.module).__name__}) was called as a layer of a model "
                "that runs under no policy, which would leave it in the traced dtypes. Apply the policy to "
                "the outermost model, and give this part a policy of its own with "
                f"overrides={{{type(self.module).__name__}: policy}}."
            )
        policy = self.module_policies.policy
        args, kwargs = cast_inputs_at_entry(policy, (args, kwargs))
        call = (
            getattr(self.module, target)
            if isinstance(target, str)
            else functools.partial(target, self.module)
        )
        own = dataclasses.replace(active, module_policies=self.module_policies, policy=policy)
        scope = policy_scope(scope_of(policy)) if policy != active.policy else contextlib.nullcontext()
        with _active_call(own), scope:
            outputs = call(*args, **kwargs)
        return model_outputs(policy.cast_to_output(outputs))

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
            kwargs["capture_intermediates"] = _intermediates_of_the_model(capture)
        if isinstance(kwargs.get("mutable"), list):
            # A list is unhashable, so autocast would trace every call again.
            kwargs["mutable"] = tuple(kwargs["mutable"])
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
        params, no casting); the interceptor notes which policy each module
        runs under on the way, and each param is then cast to the param
        dtype of the deepest module that owns it.
        """
        owners: dict[tuple[str, ...], Policy] = {}
        with _layer_scopes(_ActiveCall(self.module_policies, self.jaxamp_policy, owners)):
            variables = self.module.init(rngs, *args, **kwargs)
        if "params" not in variables:
            return variables
        param_dtypes = {path: policy.param_dtype for path, policy in owners.items()}
        return {
            **variables,
            "params": cast_by_owner(variables["params"], param_dtypes, self.jaxamp_policy.param_dtype),
        }

    def apply(self, variables, *args, **kwargs):
        """Like ``nn.Module.apply``, through `jaxamp.autocast` under the model's policy."""
        return self._autocast_apply(variables, *args, **self._wrapper_kwargs(kwargs))

    @property
    def _autocast_apply(self):
        # One autocast (and so one cache of rewritten programs) per wrapper;
        # linen modules are frozen, so it is kept beside their fields.
        cached = self.__dict__.get("_jaxamp_autocast_apply")
        if cached is None:

            def apply(variables, *args, **kwargs):
                with _layer_scopes(_ActiveCall(self.module_policies, self.jaxamp_policy)):
                    return nn.Module.apply(self, variables, *args, **kwargs)

            cached = self.__dict__["_jaxamp_autocast_apply"] = make_autocast(
                apply, self.jaxamp_policy, traced_in_compute=_params_and_inputs, outputs_as_rewritten=True
            )
        return cached


def _params_and_inputs(origin: LeafOrigin) -> bool:
    """Whether a floating leaf of ``apply(variables, *inputs)`` is traced in the compute dtype.

    The params and the model's inputs are; the other collections (batch
    statistics, a cache) keep their dtypes, as their updates need.
    """
    where, *rest = origin.path  # in (fun, args, kwargs); args[0] is the variables
    if where.idx == 1 and rest and rest[0].idx == 0:
        return len(rest) > 1 and getattr(rest[1], "key", None) == "params"
    return True
