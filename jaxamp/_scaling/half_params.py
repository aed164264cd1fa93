"""Half params and their optimizer: refused where the update would be computed in half.

One job: `require_float32_update`, which `jaxamp.TrainState.create` and
`jaxamp.NNXOptimizer` call. It reads the optimizer's state by a protocol (a
state class with ``computes_update_in_float32 = True``, as
`jaxamp.low_precision_optimizer`'s has), so the loss scaling and train
state do not import the optimizer.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxamp._policy import is_floating_array


def _computes_in_float32(node) -> bool:
    return getattr(type(node), "computes_update_in_float32", False) is True


def _holds_a_float32_update(opt_state) -> bool:
    """Whether a state that computes its update in float32 (`jaxamp.low_precision_optimizer`'s) is
    anywhere in `opt_state` (inside a chain, MultiSteps, `jaxamp.loss_scaling`)."""
    return any(map(_computes_in_float32, jax.tree.leaves(opt_state, is_leaf=_computes_in_float32)))


def _is_variable(node) -> bool:
    return isinstance(node, nnx.Variable)


def _value(node):
    return node.get_value() if _is_variable(node) else node


def require_float32_update(params, opt_state, where: str) -> None:
    """Refuses float16 or bfloat16 params whose optimizer computes its update in their dtype.

    An optax optimizer computes its update and keeps its state in the params'
    dtype. In float16 Adam's ``eps=1e-8`` is 0 and a squared gradient below
    6e-8 is 0, so the first applied step writes NaN params; in bfloat16 an
    update below half an ulp of its param is lost. `low_precision_optimizer`
    computes in float32; an optimizer state that holds its state anywhere
    passes.

    Args:
        params: the params (a pytree, an ``nnx.State``).
        opt_state: the optimizer's state for them.
        where: who checks, to start the message (``"TrainState.create"``).

    Raises:
        ValueError: a floating param is float16 or bfloat16 and `opt_state`
            holds no `low_precision_optimizer` state.
    """
    half = [
        (path, _value(leaf).dtype)
        for path, leaf in jax.tree_util.tree_flatten_with_path(params, is_leaf=_is_variable)[0]
        if is_floating_array(_value(leaf)) and _value(leaf).dtype in (jnp.float16, jnp.bfloat16)
    ]
    if not half or _holds_a_float32_update(opt_state):
        return
    path, dtype = half[0]
    at = f"the param at {jax.tree_util.keystr(path) or 'the root'} is {dtype.name}"
    if dtype == jnp.float16:
        raise ValueError(
            f"{where}: {at}, and the optimizer would compute its update and keep its state in float16, where "
            "Adam's eps=1e-8 is 0 and a squared gradient below 6e-8 is 0 (the first applied step writes NaN "
            "params). Compute it in float32: tx=jaxamp.low_precision_optimizer(tx, param_dtype=jnp.float16, "
            "state_dtype=jnp.float32), or keep the params in float32 (a mixed policy: 'mixed_float16')."
        )
    raise ValueError(
        f"{where}: {at}, and the optimizer would compute its update and keep its state in bfloat16, where an "
        "update below half an ulp of its param (0.2% to 0.4% of it) is lost. Compute it in float32: "
        "tx=jaxamp.low_precision_optimizer(tx) (bfloat16 state, updates rounded stochastically), or keep the "
        "params in float32 (a mixed policy: 'mixed_bfloat16')."
    )
