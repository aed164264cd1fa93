"""`autocast`: a precision policy for any JAX function, as a jaxpr transformation."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import difflib
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.extend.core import Primitive

from jaxamp._autocast.arguments import LeafOrigin, split_call
from jaxamp._autocast.context import Rule
from jaxamp._autocast.fp8_rules import fp8_decision_key, fp8_rules
from jaxamp._autocast.interpreter import AS_REWRITTEN, RewriteCache
from jaxamp._autocast.primitives import find
from jaxamp._autocast.rules import RULES_BY_NAME, follow_rule, is_floating, widened_rule
from jaxamp._autocast.table import higher_order_rules, resolve, rules_table
from jaxamp._policy import Policy, PolicySpec, get_policy


def _primitive_named(name: str, table: Mapping[Primitive, Rule]) -> Primitive:
    """The primitive an override names: in the rules table, or registered with JAX."""
    known = {primitive.name: primitive for primitive in table}
    if name in known:
        return known[name]
    registered = find(name)
    if len(registered) == 1:
        return registered[0]
    close = difflib.get_close_matches(name, list(known), n=3, cutoff=0.6)
    hint = f" Did you mean {' or '.join(repr(match) for match in close)}?" if close else ""
    raise ValueError(
        f"autocast overrides name the primitive {name!r}, which JAX does not have.{hint} Use JAX's own "
        "name (the primitive's `name`, e.g. jax.lax.scatter_add_p.name == 'scatter-add'), or the "
        "primitive object itself as the key (e.g. {jax.lax.exp_p: 'follow'}), which a primitive of "
        "your own without a lowering needs."
    )


def _resolve_rules(
    overrides: Mapping[str | Primitive, str] | None, policy: Policy, fp8_observer: Callable | None = None
) -> dict[Primitive, Rule]:
    rules = rules_table()
    if policy.fp8_matmuls:
        rules.update(resolve(fp8_rules(fp8_observer, policy.matmul_format)))
    if overrides is None:
        return rules
    if not isinstance(overrides, Mapping):
        raise TypeError(
            "autocast overrides must map primitive names to rule names (or primitive objects to rule "
            "names), e.g. "
            f"{{'exp': 'follow'}}; got {type(overrides).__name__}."
        )
    carries_jaxpr = higher_order_rules()
    for key, rule_name in overrides.items():
        if isinstance(key, Primitive):
            primitive = key
        elif isinstance(key, str):
            primitive = _primitive_named(key, rules)
        else:
            raise TypeError(f"autocast overrides keys must be primitives or their names (str); got {key!r}.")
        if rule_name not in RULES_BY_NAME:
            raise ValueError(
                f"Unknown autocast rule {rule_name!r} for primitive {primitive.name!r}. "
                f"Valid rules: {', '.join(RULES_BY_NAME)}."
            )
        if primitive in carries_jaxpr and rule_name != "restore":
            raise ValueError(
                f"{primitive.name!r} carries a jaxpr; its only override is 'restore' (run it as "
                f"traced), not {rule_name!r}."
            )
        rules[primitive] = RULES_BY_NAME[rule_name]
    return rules


def autocast(
    fun: Callable[..., Any] | None = None,
    policy: PolicySpec = "mixed_float16",
    *,
    overrides: Mapping[str | Primitive, str] | None = None,
    float32_argnums: int | Sequence[int] = (),
    float32_argnames: str | Sequence[str] = (),
) -> Callable[..., Any]:
    """Runs any JAX function with its heavy math in half precision, like ``torch.autocast``.

    ``autocast(fun)`` has ``fun``'s signature. Each call traces ``fun`` with
    its floating arguments in the policy's compute dtype, so what ``fun``
    decides while traced (a fused attention kernel, a Pallas call) sees half
    precision, and once more as given, to read its constants as written. The
    half program is then run on the arguments as given, by one rule:

    * matmuls and convolutions run in the compute dtype; the exp/log family,
      roots, special functions and every reduction in float32; scatters,
      collectives, random bits, callbacks and kernels as traced;
    * every other op follows its inputs: activations and float32 islands
      (code under `jaxamp.float32_scope`, a layer class `jaxamp.apply_policy`
      runs in float32) decide its dtype; params' float32 originals, float32
      results and constants are read in their width without deciding it,
      unless the result dtype cannot hold a constant (``-1e9`` in float16).

    The lineage of each value is in ``jaxamp/_autocast/lineage.py``. Nested
    ``jit``, ``checkpoint``, ``scan``, ``while_loop``, ``cond``,
    ``custom_jvp``, ``custom_vjp`` and ``shard_map`` bodies are rewritten
    by the same rule. The rewritten program takes the arguments as given,
    so gradients come in their dtypes; outputs traced in the compute dtype
    come back in the arguments' dtype. It composes with ``jax.jit``,
    ``jax.grad``, ``jax.vmap`` and ``jax.jvp`` on either side, and is cached
    per argument shapes, dtypes and static arguments. NNX modules passed in
    are split (their ``nnx.Param``s traced in the compute dtype) and their
    changed state written back. A policy with FP8 matmuls
    (``"mixed_float8"``) runs each eligible ``dot_general`` as
    `jaxamp.fp8_dot_general`, the others under a named fallback
    (`jaxamp.diagnostics.FP8_FALLBACK_REASONS`).

    Examples:
        >>> @jaxamp.autocast
        ... def loss_fn(params, x, y):
        ...     return optax.softmax_cross_entropy(mlp(params, x), y).mean()
        >>> loss, grads = jax.value_and_grad(loss_fn)(params, x, y)  # float16 matmuls, float32 grads

    Args:
        fun: any function of arrays (plain JAX, an Equinox module, a Haiku or
            Flax ``apply``, an NNX module). Omit it to get a decorator.
        policy: anything `jaxamp.get_policy` accepts; its compute dtype is
            the half dtype.
        overrides: primitive (the object, e.g. ``jax.lax.tanh_p``, or JAX's
            name for it, ``"tanh"``) -> rule, to change a primitive's rule:
            ``"compute"`` (compute dtype), ``"float32"``, ``"follow"`` (the
            widest input) or ``"restore"`` (as traced), e.g.
            ``{"tanh": "float32"}``. A primitive that carries a jaxpr
            accepts only ``"restore"``.
        float32_argnums: positional arguments traced in their own dtypes
            rather than the compute dtype (state that must stay float32, or
            code written for float32 only), as ``jax.jit``'s
            ``static_argnums`` name arguments.
        float32_argnames: the same, for arguments passed by keyword.

    Returns:
        The function under the policy. Its ``rewrites.traces`` counts how
        many times it traced and rewrote `fun`.

    Raises:
        ValueError: the policy or an override names no valid choice, or an
            override names a primitive JAX does not have.
        TypeError: ``float32_argnums`` or ``float32_argnames`` are not ints
            or strings.
        NotImplementedError: (when called) `fun` uses a higher-order
            primitive autocast has no rule for; the message names it.
    """
    if fun is None:
        return functools.partial(
            autocast,
            policy=policy,
            overrides=overrides,
            float32_argnums=float32_argnums,
            float32_argnames=float32_argnames,
        )
    if not callable(fun):
        raise TypeError(f"autocast needs a function to transform; got {type(fun).__name__}: {fun!r}.")
    kept = KeptArguments.create(float32_argnums, float32_argnames)
    return make_autocast(fun, get_policy(policy), overrides, traced_in_compute=kept.traced_in_compute)


def autocast_with_fp8_observer(
    fun: Callable[..., Any], policy: Policy, observer: Callable
) -> Callable[..., Any]:
    """`autocast` whose FP8 quantizations report their counts to `observer` (for
    `jaxamp.diagnostics.fp8_quantization_stats`; the rewritten program gains host callbacks)."""
    return make_autocast(fun, policy, fp8_observer=observer)


def _as_tuple(value: Any, kind: type, name: str) -> tuple:
    if isinstance(value, kind):
        values = (value,)
    elif isinstance(value, Sequence) and not isinstance(value, str):
        values = tuple(value)
    else:
        values = (value,)
    if not all(isinstance(item, kind) and not isinstance(item, bool) for item in values):
        raise TypeError(
            f"autocast's {name} must be {kind.__name__}s (or one {kind.__name__}); got {value!r}."
        )
    return values


@dataclasses.dataclass(frozen=True)
class KeptArguments:
    """The arguments `autocast` traces in their own dtypes (``float32_argnums``/``float32_argnames``)."""

    argnums: tuple[int, ...] = ()
    argnames: tuple[str, ...] = ()

    @classmethod
    def create(cls, argnums: int | Sequence[int], argnames: str | Sequence[str]) -> KeptArguments:
        return cls(_as_tuple(argnums, int, "float32_argnums"), _as_tuple(argnames, str, "float32_argnames"))

    def traced_in_compute(self, origin: LeafOrigin) -> bool:
        """Whether a floating leaf is traced in the compute dtype: unless it lies in a kept argument.

        A leaf's path starts at ``(fun, args, kwargs)``; NNX state other than
        ``nnx.Param`` (batch statistics, RNG state, counters) keeps its dtype.
        """
        if origin.variable_type is not None and not issubclass(origin.variable_type, nnx.Param):
            return False
        where, *rest = origin.path
        if where.idx == 1 and rest and rest[0].idx in self.argnums:
            return False
        return not (where.idx == 2 and rest and rest[0].key in self.argnames)


def trace_dtypes(
    policy: Policy, leaves: Sequence[Any], origins: Sequence[LeafOrigin], traced_in_compute: Callable
) -> tuple:
    """Per leaf, the dtype the function is traced with: the compute dtype for the floating leaves
    wider than it (under a half compute dtype), unless `traced_in_compute` keeps them; else None."""
    compute = np.dtype(policy.compute_dtype)
    if jnp.finfo(compute).bits >= 32:
        return (None,) * len(leaves)
    return tuple(
        compute
        if is_floating(leaf.dtype)
        and leaf.dtype != compute
        and jnp.promote_types(leaf.dtype, compute) == leaf.dtype
        and traced_in_compute(origin)
        else None
        for leaf, origin in zip(leaves, origins, strict=True)
    )


def make_autocast(
    fun: Callable[..., Any],
    policy: Policy,
    overrides: Mapping[str | Primitive, str] | None = None,
    fp8_observer: Callable | None = None,
    *,
    traced_in_compute: Callable[[LeafOrigin], bool] = KeptArguments().traced_in_compute,
    outputs_as_rewritten: bool = False,
) -> Callable[..., Any]:
    """`autocast` with the choices `apply_policy` makes differently.

    Args:
        traced_in_compute: whether a floating leaf (by its `LeafOrigin`) is
            traced in the compute dtype.
        outputs_as_rewritten: return `fun`'s outputs in the dtypes the rules
            give them (sown and captured values as each layer made them: a
            convolution's in the compute dtype, a float32 island's in
            float32), those passed to `model_outputs` in their traced dtypes
            (a Flax model's outputs, cast to the output dtype), instead of
            widening those traced in the compute dtype to the dtype of the
            arguments.
    """

    def rules_for(compute_dtype, fp8_matmuls: str | bool | None) -> dict[Primitive, Rule]:
        """The rules of a policy scope (`jaxamp._autocast.scope.policy_scope`).

        In a float32 scope (a normalization layer, an override to float32)
        the ops that follow their inputs run in float32 instead, whatever
        dtype their inputs have, as a Flax layer with ``dtype=float32`` does.
        """
        matmul_dtype = fp8_matmuls or None  # the scope's matmul format
        scope_policy = Policy(policy.param_dtype, compute_dtype, policy.output_dtype, matmul_dtype)
        rules = _resolve_rules(overrides, scope_policy, fp8_observer)
        if compute_dtype == np.float32:
            rules = {
                primitive: widened_rule if rule is follow_rule else rule for primitive, rule in rules.items()
            }
        return rules

    rewrites = RewriteCache(
        policy.compute_dtype,
        _resolve_rules(overrides, policy, fp8_observer),
        rules_for=functools.cache(rules_for),
        fp8_matmuls=policy.matmul_format,
    )

    def autocast_fun(*args, **kwargs):
        call = split_call(fun, args, kwargs)
        narrowed = trace_dtypes(policy, call.leaves, call.origins, traced_in_compute)
        widest = [leaf.dtype for leaf, dtype in zip(call.leaves, narrowed) if dtype is not None]
        widened = jnp.result_type(*widest) if widest else None

        def output_dtypes(result) -> list:
            outputs, module_states, attribute_changes = result
            if outputs_as_rewritten:
                pins = [None if id(leaf) in cast_by_the_model else AS_REWRITTEN for leaf in _arrays(outputs)]
            elif widened is None:
                pins = [None] * len(_arrays(outputs))
            else:
                pins = [widened if leaf.dtype == policy.compute_dtype else None for leaf in _arrays(outputs)]
            changed = [None] * len(_arrays(attribute_changes))
            return [*pins, *call.state_output_dtypes(module_states), *changed]

        static_key = call.static_key
        if policy.fp8_matmuls and static_key is not None:
            static_key = (static_key, fp8_decision_key())
        cast_by_the_model: set[int] = set()
        with _set_model_outputs(cast_by_the_model):
            outputs, module_states, attribute_changes = rewrites.call(
                call.run,
                call.leaves,
                static_key,
                trace_dtypes=narrowed,
                output_dtypes=output_dtypes,
            )
        call.write_back(module_states, attribute_changes)
        return outputs

    # updated=(): a module's attributes are not copied onto the function.
    autocast_fun = functools.wraps(fun, updated=())(autocast_fun)
    autocast_fun.rewrites = rewrites
    return autocast_fun


# While `make_autocast`'s function traces: the ids of the outputs the model cast to its output dtype.
_MODEL_OUTPUTS: contextvars.ContextVar[set | None] = contextvars.ContextVar("jaxamp_model_outputs", default=None)


@contextlib.contextmanager
def _set_model_outputs(ids: set):
    token = _MODEL_OUTPUTS.set(ids)
    try:
        yield
    finally:
        _MODEL_OUTPUTS.reset(token)


def model_outputs(tree: Any) -> Any:
    """`tree`, noted as the outputs a model cast to its output dtype itself (`jaxamp.apply_policy`'s
    wrappers): ``outputs_as_rewritten`` returns them in the dtypes they were traced in (where the
    trace needed no cast, the rules would leave them in the compute dtype)."""
    noted = _MODEL_OUTPUTS.get()
    if noted is not None:
        noted.update(id(leaf) for leaf in jax.tree.leaves(tree))
    return tree


def _arrays(tree: Any) -> list:
    return [leaf for leaf in jax.tree.leaves(tree) if isinstance(leaf, (jax.Array, np.ndarray, np.generic))]
