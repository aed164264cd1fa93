"""`autocast`: a precision policy for any JAX function, as a jaxpr transformation."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

from jaxamp.jaxpr_policy.arguments import split_call
from jaxamp.jaxpr_policy.higher_order import HIGHER_ORDER_RULES
from jaxamp.jaxpr_policy.interpreter import RewriteCache
from jaxamp.jaxpr_policy.rules import FIRST_ORDER_RULES, RULES_BY_NAME, Rule
from jaxamp.policy import PolicySpec, get_policy


def _resolve_rules(overrides: Mapping[str, str] | None) -> dict[str, Rule]:
    rules = {**FIRST_ORDER_RULES, **HIGHER_ORDER_RULES}
    if overrides is None:
        return rules
    if not isinstance(overrides, Mapping):
        raise TypeError(
            "autocast overrides must map primitive names to rule names, e.g. "
            f"{{'exp': 'follow'}}; got {type(overrides).__name__}."
        )
    for primitive_name, rule_name in overrides.items():
        if not isinstance(primitive_name, str):
            raise TypeError(f"autocast overrides keys must be primitive names (str); got {primitive_name!r}.")
        if rule_name not in RULES_BY_NAME:
            raise ValueError(
                f"Unknown autocast rule {rule_name!r} for primitive {primitive_name!r}. "
                f"Valid rules: {', '.join(RULES_BY_NAME)}."
            )
        if primitive_name in HIGHER_ORDER_RULES and rule_name != "restore":
            raise ValueError(
                f"{primitive_name!r} carries a jaxpr; its only override is 'restore' (run it as "
                f"traced), not {rule_name!r}."
            )
        rules[primitive_name] = RULES_BY_NAME[rule_name]
    return rules


def autocast(
    fun: Callable[..., Any] | None = None,
    policy: PolicySpec = "mixed_float16",
    *,
    overrides: Mapping[str, str] | None = None,
) -> Callable[..., Any]:
    """Runs any JAX function with its heavy math in half precision, like ``torch.autocast``.

    ``autocast(fun)`` has ``fun``'s signature. Each call traces ``fun`` to a
    jaxpr (array arguments abstract, every other argument static) and
    evaluates the jaxpr again with dtypes changed per primitive:

    * matrix multiplications and convolutions run in the policy's compute
      dtype, forward and backward;
    * numerically sensitive operations (exp/log family, roots and powers,
      special functions, every reduction) run in float32;
    * elementwise and structural operations follow their inputs; scalar
      literals are weak unless the half dtype cannot hold them; an
      elementwise chain whose results go only to a float32 reduction (the
      ``h * h`` of a norm) runs in float32;
    * everything else runs in the dtypes it was traced with;
    * nested ``jit``, ``checkpoint``, ``scan``, ``while_loop``, ``cond``,
      ``custom_jvp`` and ``custom_vjp`` bodies are rewritten recursively.

    The outputs come back in exactly the dtypes ``fun`` returns, so
    ``jax.grad`` of it gives gradients in the dtypes of the arguments. It
    composes with ``jax.jit``, ``jax.grad``, ``jax.vmap`` and ``jax.jvp`` on
    either side. The rewritten jaxpr is cached per argument shapes, dtypes
    and static arguments, so an eager call traces once. NNX modules passed as
    arguments (or as `fun`) are split and their changed state written back.
    Code under `jaxamp.float32_scope` keeps its traced dtypes.

    The policy's compute dtype is what matters here: params stay as the
    caller holds them and outputs come back as `fun` returns them.

    Example:
        >>> @jaxamp.autocast
        ... def loss_fn(params, x, y):
        ...     return optax.softmax_cross_entropy(mlp(params, x), y).mean()
        >>> loss, grads = jax.value_and_grad(loss_fn)(params, x, y)  # float16 matmuls, float32 grads

    Args:
        fun: any function of arrays (plain JAX, an Equinox module, a Haiku or
            Flax ``apply``, an NNX module). Omit it to get a decorator.
        policy: anything `jaxamp.get_policy` accepts; its compute dtype is
            the half dtype.
        overrides: primitive name -> rule, to change a primitive's rule:
            ``"compute"`` (compute dtype), ``"float32"``, ``"follow"`` (the
            widest input) or ``"restore"`` (as traced), e.g.
            ``{"tanh": "float32"}``. A primitive that carries a jaxpr and has
            no rule (``shard_map``) accepts ``"restore"``.

    Returns:
        The function under the policy. Its ``rewrites.traces`` counts how
        many times it traced and rewrote `fun`.

    Raises:
        ValueError: the policy or an override names no valid choice.
        NotImplementedError: (when called) `fun` uses a higher-order
            primitive autocast has no rule for; the message names it.
    """
    if fun is None:
        return functools.partial(autocast, policy=policy, overrides=overrides)
    if not callable(fun):
        raise TypeError(f"autocast needs a function to transform; got {type(fun).__name__}: {fun!r}.")
    compute_dtype = get_policy(policy).compute_dtype
    rewrites = RewriteCache(compute_dtype, _resolve_rules(overrides))

    def autocast_fun(*args, **kwargs):
        call = split_call(fun, args, kwargs)
        outputs, module_states = rewrites.call(call.run, call.leaves, call.static_key)
        call.write_back(module_states)
        return outputs

    # updated=(): a module's attributes are not copied onto the function.
    autocast_fun = functools.wraps(fun, updated=())(autocast_fun)
    autocast_fun.rewrites = rewrites
    return autocast_fun
