"""Training a Flax NNX model through a loss scale: the whole-step skip where the model holds its state.

One job: an NNX step whose gradients are not finite changes nothing but the
loss scale and its skip counters, as a `jaxamp.TrainState` step does. An NNX
model keeps its state in itself and ``nnx.Optimizer`` counts its own steps,
so two pieces do it:

* `value_and_grad`, `variables_before` and `keep_if_skipped`, which
  `jaxamp.scaled_value_and_grad` runs for an argument that is an NNX module:
  its params are differentiated as by ``nnx.value_and_grad`` (``nnx.Param``,
  so a model holding RNG streams or integer counters differentiates), and the
  variables the loss function changed (batch statistics, RNG counts) are put
  back where the step is skipped;
* `NNXOptimizer`, ``nnx.Optimizer`` around `jaxamp.loss_scaling`, whose
  ``update`` keeps ``step`` where the step is skipped. ``nnx.Optimizer.update``
  adds one to ``step`` on every call (flax 0.12: ``self.step[...] += 1``),
  whatever its optax transformation did, so a plain ``nnx.Optimizer`` around
  `jaxamp.loss_scaling` counts skipped steps in ``step`` while Adam's own count,
  inside the optax state, does not. Optax's schedules read that inner count;
  ``step`` is what a training loop reads (for logging, checkpoints, or a
  schedule of its own).

The algorithm of one step::

    before = the values of every variable of the model
    (loss, aux), scaled_grads = nnx.value_and_grad(scaled loss)(model)   # writes what it changed
    grads = unscale(scaled_grads); grads_finite = all_finite(grads)
    where not grads_finite: every variable the call changed takes its value from before
    optimizer.update(model, grads, grads_finite=grads_finite)
        # loss_scaling: params and optax state kept, the scale adjusted
        # and step kept where not grads_finite
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxamp._finite import all_finite
from jaxamp._scaling.half_params import require_float32_update
from jaxamp._scaling.loss_scale import LossScale, loss_scale_for_model
from jaxamp._scaling.loss_scaling import loss_scale_of, loss_scaling, require_skip_counting, scaling_state_of
from jaxamp._scaling.nonfinite import NonFiniteGradients


def _is_nnx_node(value: Any) -> bool:
    """Whether `value` is an NNX module (or another NNX graph node that holds variables)."""
    return isinstance(value, nnx.Pytree)


def value_and_grad(fun: Callable, *, argnums: int | Sequence[int], has_aux: bool) -> Callable:
    """``jax.value_and_grad(fun, ...)``, or ``nnx.value_and_grad`` where an argument is an NNX module.

    Chosen per call, from the arguments: ``nnx.value_and_grad`` differentiates
    a module's ``nnx.Param`` variables (not its RNG keys and counts, which
    ``jax.value_and_grad`` refuses as integers), returns their gradients as an
    ``nnx.State``, and writes back into the module what `fun` changed in it.
    """

    def call(*args, **kwargs):
        transform = nnx.value_and_grad if any(map(_is_nnx_node, args)) else jax.value_and_grad
        return transform(fun, argnums=argnums, has_aux=has_aux)(*args, **kwargs)

    return call


def _variables(node: Any) -> dict[tuple, nnx.Variable]:
    """The variables of an NNX node by path: live, they see what a call changes."""
    return dict(nnx.to_flat_state(nnx.state(node)))


def variables_before(args: Sequence[Any]) -> list[dict[tuple, jax.Array] | None]:
    """The value of every variable of each NNX module among `args` (None for other arguments)."""
    return [
        {path: variable[...] for path, variable in _variables(arg).items()} if _is_nnx_node(arg) else None
        for arg in args
    ]


def keep_if_skipped(
    args: Sequence[Any], before: list[dict[tuple, jax.Array] | None], grads_finite: jax.Array
) -> None:
    """Where `grads_finite` is false, puts back each variable's value `before` the call.

    A variable made by the call (a sown value) stays as the call left it; RNG
    keys do not change within a call and are left alone. Selects with
    ``jnp.where``: no branch, no host sync.
    """
    for arg, values in zip(args, before, strict=True):
        if values is None:
            continue
        for path, variable in _variables(arg).items():
            old = values.get(path)
            if old is None or jax.dtypes.issubdtype(old.dtype, jax.dtypes.prng_key):
                continue
            variable[...] = jnp.where(grads_finite, variable[...], old)


def _values(tree: Any) -> Any:
    """`tree` with each NNX variable replaced by its value."""
    return jax.tree.map(lambda variable: variable[...], tree, is_leaf=lambda node: isinstance(node, nnx.Variable))


class NNXOptimizer(nnx.Optimizer):
    """``flax.nnx.Optimizer`` with loss scaling: a skipped step changes only the loss scale.

    Its optax transformation is ``jaxamp.loss_scaling(tx, loss_scale)``, so a
    step whose gradients are not finite leaves the params and the optimizer
    state (Adam's moments and count) as they were and adjusts the scale; and
    ``step`` counts the applied steps alone (``nnx.Optimizer`` counts every
    call). With `jaxamp.scaled_value_and_grad`, which puts back what the loss
    function changed in the model (batch statistics, RNG counts), a skipped
    step leaves the model and the optimizer as they were.

    Examples:
        >>> model = jaxamp.apply_policy(Model(nnx.Rngs(0)), "mixed_float16")
        >>> optimizer = jaxamp.NNXOptimizer(model, optax.adam(1e-3), jaxamp.DynamicLossScale())
        >>> @nnx.jit
        ... def train_step(model, optimizer, x, y):
        ...     loss, grads, grads_finite = jaxamp.scaled_value_and_grad(
        ...         lambda model: loss_fn(model(x), y), optimizer.loss_scale)(model)
        ...     optimizer.update(model, grads, grads_finite=grads_finite)
        ...     return loss

    Args:
        model: the NNX model whose ``wrt`` variables the optimizer updates.
        tx: the optax optimizer.
        loss_scale: a jaxamp loss scale. When None, the one the model's dtypes
            need: `jaxamp.default_loss_scale` of the policy of a model made by
            `jaxamp.apply_policy` (so `DynamicLossScale()` for float16
            computation); for another model, `DynamicLossScale()` where a
            param is float16, else `NoOpLossScale()`.
        wrt: which variables it updates (default ``nnx.Param``), as for
            ``nnx.Optimizer`` and ``nnx.grad``.
        **kwargs: passed on to ``nnx.Optimizer``.

    Attributes:
        step: the steps applied (``nnx.Optimizer``'s counter); a skipped step
            does not count, so ``step + skipped_steps`` is every call.
        loss_scale: the loss scale for the next step, with its skip counters.
        skipped_steps: the steps skipped because their gradients were not finite.
        nonfinite_grads: which gradient leaves were not finite in the last
            skipped step (``jaxamp.diagnostics.nonfinite_grads_of(optimizer)``
            reads it).

    Raises:
        TypeError: `loss_scale` does not count skipped steps (a jmp loss scale).
        ValueError: a param is float16 or bfloat16 and `tx` would compute its
            update in that dtype: wrap it in `jaxamp.low_precision_optimizer`.
    """

    def __init__(
        self,
        model: Any,
        tx: Any,
        loss_scale: LossScale | None = None,
        *,
        wrt: Any = nnx.Param,
        **kwargs: Any,
    ):
        if loss_scale is None:
            loss_scale = loss_scale_for_model(model, nnx.state(model, wrt))
        require_skip_counting(loss_scale, "jaxamp.NNXOptimizer")
        super().__init__(model, loss_scaling(tx, loss_scale), wrt=wrt, **kwargs)
        require_float32_update(nnx.state(model, wrt), self.opt_state, "jaxamp.NNXOptimizer")

    @property
    def loss_scale(self) -> LossScale:
        """The loss scale for the next step (with its skip counters), as arrays."""
        return _values(loss_scale_of(self.opt_state))

    @property
    def nonfinite_grads(self) -> NonFiniteGradients:
        """Which gradient leaves were not finite in the last skipped step, as arrays
        (`jaxamp.diagnostics.NonFiniteGradients`; ``.summary()`` names them)."""
        return _values(scaling_state_of(self.opt_state, "NNXOptimizer.nonfinite_grads").nonfinite_grads)

    @property
    def skipped_steps(self) -> jax.Array:
        """The steps skipped because their gradients were not finite: the loss scale's counter."""
        return self.loss_scale.skipped_steps

    def update(self, model: Any, grads: Any, /, *, grads_finite: jax.Array | None = None, **kwargs: Any):
        """Applies `grads` to `model` where `grads_finite`, else skips the step; see the class.

        Args:
            model: the model the optimizer was made for.
            grads: unscaled gradients (`jaxamp.scaled_value_and_grad`'s).
            grads_finite: a scalar bool; computed from `grads` when None.
            **kwargs: passed on to the optax transformation.

        Returns:
            The updates applied: negative zeros where the step was skipped.
        """
        if grads_finite is None:
            grads_finite = all_finite(nnx.state(grads, self.wrt))
        step = self.step[...]
        updates = super().update(model, grads, grads_finite=grads_finite, **kwargs)
        self.step[...] = jnp.where(grads_finite, self.step[...], step)
        return updates
