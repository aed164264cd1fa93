"""Mixed precision for `flax.nnx` models, from the outside.

NNX modules are Python objects holding their state, so the policy is applied
to a copy of the model, once:

* each module's policy is worked out from the root down (see
  `jaxamp._flax.layers`) and every ``nnx.Param`` is cast to the param
  dtype of the module that owns it;
* the model's methods (``__call__`` and every public method its classes
  define) run through `jaxamp.autocast` under the model's policy: the model
  is an argument of the rewritten call, so the state the call changes
  (batch statistics, RNG counts, sown values) is written back, and the
  outputs come back in the output dtype;
* a submodule whose class asks for another policy than its holder's
  (``overrides``, the normalization layers) runs its methods in that
  policy's scope (`jaxamp._autocast.scope.policy_scope`), which autocast
  reads;
* every submodule's methods (but those of ``nnx.List`` and ``nnx.Dict``)
  run inside ``jax.named_scope``s of its path in the model
  (``blocks/0/attn``), as linen's module scopes name a linen layer, so the
  overflow record names its matmuls by that path. A submodule called from
  the model's method, or from a module above it, is named by its path from
  there; one called from elsewhere in the model by its whole path, under
  the caller's.

All of this is done by giving the copy (and its layers) a subclass of its
own class that adds only this, so the copy stays the same NNX graph: the
same state, names and paths, through ``nnx.split``/``nnx.merge``,
``nnx.jit`` and ``nnx.Optimizer``. Params stay in the param dtype and
gradients arrive in it. A module's policy is decided by where it is stored
(its path from the root), not by who calls it: a module shared between two
places takes the policy of the first path NNX lists.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
from collections.abc import Callable, Iterator

import jax
from flax import nnx

from jaxamp._autocast.scope import ScopePolicy, policy_scope
from jaxamp._autocast.transform import make_autocast, model_outputs
from jaxamp._flax.layers import (
    ModulePolicies,
    cast_by_owner,
    cast_inputs_at_entry,
    declared_dtype,
    declares_float32,
    scope_of,
)
from jaxamp._policy import Policy

# Whether a root method is running: the methods it calls on the model run
# inside its rewrite, not through autocast again.
_IN_MODEL_CALL: contextvars.ContextVar[bool] = contextvars.ContextVar("jaxamp_in_model_call", default=False)

# NNX's containers of modules (``nnx.List``, ``nnx.Dict``): they compute nothing, so they need no name.
_CONTAINERS = tuple(getattr(nnx, name) for name in ("List", "Dict") if hasattr(nnx, name))

# While a root method runs: each module of the model's path (by id; a shared module's first path),
# and the path of the module whose method runs now, which the name stack already holds.
_MODULE_PATHS: contextvars.ContextVar[dict[int, tuple] | None] = contextvars.ContextVar(
    "jaxamp_module_paths", default=None
)
_RUNNING_PATH: contextvars.ContextVar[tuple] = contextvars.ContextVar("jaxamp_running_path", default=())


def _model_methods(module_class: type) -> dict[str, Callable]:
    """``__call__`` and the public methods that `module_class` and its bases (not NNX's own) define."""
    nnx_classes = set(nnx.Module.__mro__)
    names = {
        name
        for klass in module_class.__mro__
        if klass not in nnx_classes
        for name in vars(klass)
        if name == "__call__" or not name.startswith("_")
    }
    methods = {}
    for name in sorted(names):
        method = inspect.getattr_static(module_class, name)
        if inspect.isfunction(method):
            methods[name] = method
    return methods


def _policies_by_path(
    modules: dict[tuple, nnx.Module], module_policies: ModulePolicies
) -> dict[tuple, tuple[Policy, Policy, bool]]:
    """Each module's ``(policy, holder's policy, whether it declares float32 deliberately)``.

    A module inherits its policy from the module that holds it: the module at
    the longest proper prefix of its path; the root's holder policy is the
    model's own policy.
    """
    policies: dict[tuple, tuple[Policy, Policy, bool]] = {}
    drops = module_policies.drops_declared_dtypes()
    for path in sorted(modules, key=len):
        holder = next(
            (path[:depth] for depth in range(len(path) - 1, -1, -1) if path[:depth] in policies), None
        )
        holder_policy = module_policies.policy if holder is None else policies[holder][0]
        module = modules[path]
        holders = (modules[path[:depth]] for depth in range(len(path) - 1, -1, -1) if path[:depth] in modules)
        float32_layer = drops and declares_float32(
            type(module), declared_dtype(module), map(declared_dtype, holders), root=holder is None
        )
        policy = module_policies.policy_for(type(module), holder_policy, float32_layer=float32_layer)
        policies[path] = (policy, holder_policy, float32_layer)
    return policies


def _subclass(module_class: type, methods: dict[str, Callable], **attributes) -> type:
    namespace = {**methods, **attributes}
    namespace.update(__module__=module_class.__module__, __qualname__=module_class.__qualname__)
    return type(module_class)(module_class.__name__, (module_class,), namespace)


@contextlib.contextmanager
def _layers_named_in(model: nnx.Module) -> Iterator[None]:
    """While a root method of `model` runs: its layers' methods are named by their paths in it."""
    paths: dict[int, tuple] = {}
    for path, module in nnx.iter_modules(model):
        paths.setdefault(id(module), path)
    tokens = (_MODULE_PATHS.set(paths), _RUNNING_PATH.set(()))
    try:
        yield
    finally:
        for token in reversed(tokens):
            token.var.reset(token)


@contextlib.contextmanager
def _named_by_path(module: nnx.Module) -> Iterator[None]:
    """Runs a method of `module` inside a ``jax.named_scope`` per component of its path in the model,
    from the path of the module running now (the whole path where it does not start with that)."""
    paths = _MODULE_PATHS.get()
    path = None if paths is None else paths.get(id(module))
    running = _RUNNING_PATH.get()
    if path is None or path == running:
        yield
        return
    relative = path[len(running) :] if path[: len(running)] == running else path
    token = _RUNNING_PATH.set(path)
    try:
        with contextlib.ExitStack() as scopes:
            for name in relative:
                scopes.enter_context(jax.named_scope(str(name)))
            yield
    finally:
        _RUNNING_PATH.reset(token)


@functools.lru_cache(maxsize=1024)
def _layer_class(module_class: type, scope: ScopePolicy | None) -> type:
    """A subclass of `module_class` whose methods are named by the layer's path and, given a `scope`,
    traced in that policy scope."""

    def named(method):
        @functools.wraps(method)
        def layer_method(self, *args, **kwargs):
            with _named_by_path(self), (contextlib.nullcontext() if scope is None else policy_scope(scope)):
                return method(self, *args, **kwargs)

        return layer_method

    methods = {name: named(method) for name, method in _model_methods(module_class).items()}
    return _subclass(module_class, methods, jaxamp_scope=scope)


def _run_method(method: Callable, policy: Policy, model: nnx.Module, *args, **kwargs):
    """``method(model, ...)``, its inputs cast at entry, its outputs in the output dtype."""
    args, kwargs = cast_inputs_at_entry(policy, (args, kwargs))
    token = _IN_MODEL_CALL.set(True)
    try:
        with _layers_named_in(model):
            outputs = method(model, *args, **kwargs)
    finally:
        _IN_MODEL_CALL.reset(token)
    return model_outputs(policy.cast_to_output(outputs))


@functools.lru_cache(maxsize=256)
def _root_class(module_class: type, module_policies: ModulePolicies) -> type:
    """A subclass of the top-level model's class whose methods run through `jaxamp.autocast`.

    One autocast (and so one cache of rewritten programs) per method, shared
    by the models of this class under these policies.
    """
    policy = module_policies.policy

    def through_autocast(method):
        rewritten = make_autocast(
            functools.partial(_run_method, method, policy), policy, outputs_as_rewritten=True
        )

        @functools.wraps(method)
        def model_method(self, *args, **kwargs):
            if _IN_MODEL_CALL.get():
                return method(self, *args, **kwargs)
            return rewritten(self, *args, **kwargs)

        return model_method

    methods = {name: through_autocast(method) for name, method in _model_methods(module_class).items()}
    return _subclass(
        module_class, methods, jaxamp_policies=module_policies, jaxamp_policy=module_policies.policy
    )


def _already_under_a_policy(module: nnx.Module) -> bool:
    module_class = type(module)
    return isinstance(getattr(module_class, "jaxamp_policies", None), ModulePolicies) or isinstance(
        getattr(module_class, "jaxamp_scope", None), ScopePolicy
    )


def apply_nnx_policy(module: nnx.Module, module_policies: ModulePolicies) -> nnx.Module:
    """Returns a copy of `module` that runs under `module_policies`.

    See this file's docstring; `jaxamp.apply_policy` is the public entry point.
    """
    model = nnx.clone(module)
    modules = dict(nnx.iter_modules(model))
    for path, submodule in modules.items():
        if _already_under_a_policy(submodule):
            where = f"submodule at {'.'.join(map(str, path))}" if path else "module"
            raise ValueError(
                f"This NNX {where} already runs under a jaxamp policy; apply_policy to the original model, "
                "and give any part its own policy with overrides."
            )
    if "__call__" not in _model_methods(type(model)):
        raise TypeError(
            f"apply_policy needs an NNX model with a __call__ method; {type(model).__name__} has none."
        )
    policies = _policies_by_path(modules, module_policies)

    param_dtypes = {path: policy.param_dtype for path, (policy, _, _) in policies.items()}
    nnx.update(
        model, cast_by_owner(nnx.state(model, nnx.Param), param_dtypes, module_policies.policy.param_dtype)
    )
    for path, submodule in modules.items():
        policy, holder_policy, float32_layer = policies[path]
        if module_policies.drops_declared_dtypes() and not float32_layer and declared_dtype(submodule) is not None:
            with contextlib.suppress(AttributeError, TypeError):  # a dtype that is a property stays
                submodule.dtype = None
        scope = scope_of(policy) if policy != holder_policy else None  # the root's too, when overridden
        if scope is not None or (path and not isinstance(submodule, _CONTAINERS)):
            submodule.__class__ = _layer_class(type(submodule), scope)
    model.__class__ = _root_class(type(model), module_policies)
    return model
