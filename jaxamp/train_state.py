"""A Flax train state that skips steps whose gradients overflowed."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import struct
from flax.training import train_state

from jaxamp.finite import all_finite, select_tree
from jaxamp.loss_scale import LossScale, NoOpLossScale

# Fields that apply_gradients itself manages; callers cannot pass them as updates.
_MANAGED_FIELDS = frozenset({"step", "params", "opt_state", "loss_scale", "skipped_steps", "apply_fn", "tx"})


class TrainState(train_state.TrainState):
    """`flax.training.train_state.TrainState` with loss scaling and skipped steps.

    Compared with Flax's own state (and with the Flax ImageNet example, which
    updates ``batch_stats`` and ``step`` even on overflowed steps), an
    overflowed step here changes nothing but the loss scale and the skip
    counter.

    Examples:
        >>> state = jaxamp.TrainState.create(
        ...     apply_fn=model.apply, params=variables["params"], tx=optax.sgd(0.1),
        ...     loss_scale=jaxamp.DynamicLossScale(), batch_stats=variables["batch_stats"])
        >>> (loss, new_stats), grads, grads_finite = jaxamp.scaled_value_and_grad(
        ...     loss_fn, state.loss_scale, has_aux=True)(state.params)
        >>> state = state.apply_gradients(
        ...     grads=grads, grads_finite=grads_finite, batch_stats=new_stats)

    Attributes:
        loss_scale: the loss scale (a pytree; `NoOpLossScale` by default).
        batch_stats: the model's mutable state (e.g. BatchNorm statistics), or
            None.
        skipped_steps: number of steps skipped because gradients were not
            finite (int32).
    """

    loss_scale: Any = struct.field(default_factory=NoOpLossScale)
    batch_stats: Any = None
    skipped_steps: jax.Array = struct.field(default_factory=lambda: jnp.zeros([], jnp.int32))

    @classmethod
    def create(
        cls,
        *,
        apply_fn,
        params,
        tx: optax.GradientTransformation | optax.MultiSteps,
        loss_scale: LossScale | None = None,
        batch_stats: Any = None,
        **kwargs,
    ) -> TrainState:
        """Creates a state whose optimizer state is initialized from `params`.

        The step and counters start as int32 arrays (not Python ints), so the
        first call of a jitted step compiles for the same types as every later
        call and nothing retraces.

        Args:
            apply_fn: usually ``model.apply``.
            params: the parameters (in the policy's param dtype).
            tx: the optax optimizer (a GradientTransformation, MultiSteps, ...).
            loss_scale: a loss scale; `NoOpLossScale()` when None.
            batch_stats: the model's mutable state, if any.
            **kwargs: further fields of subclasses.
        """
        # Duck-typed like Flax: optax.MultiSteps has init/update but is no
        # GradientTransformation instance.
        if not (callable(getattr(tx, "init", None)) and callable(getattr(tx, "update", None))):
            raise TypeError(
                f"TrainState.create needs tx to be an optax optimizer (with init and update); got {tx!r}."
            )
        return cls(
            step=jnp.zeros([], jnp.int32),
            apply_fn=apply_fn,
            params=params,
            tx=tx,
            opt_state=tx.init(params),
            loss_scale=NoOpLossScale() if loss_scale is None else loss_scale,
            batch_stats=batch_stats,
            skipped_steps=jnp.zeros([], jnp.int32),
            **kwargs,
        )

    def apply_gradients(self, *, grads, grads_finite: jax.Array | None = None, **updates) -> TrainState:
        """Applies the optax update if the gradients are finite, else skips it.

        Where `grads_finite` is true: params and optimizer state take the
        optax update, every field in `updates` (``batch_stats=new_stats``, say)
        takes its new value, and ``step`` increments. Where it is false, all of
        those stay bit-identical and ``skipped_steps`` increments instead. In
        both cases the loss scale is adjusted (grown or backed off).

        Both outcomes are computed and one is selected with ``jnp.where``, which
        XLA fuses with the optimizer update: no branch, no host sync, no
        retrace.

        Args:
            grads: gradients with the structure of ``params``, already unscaled.
            grads_finite: scalar bool; computed with `jaxamp.all_finite` when
                None.
            **updates: other fields to update only on a finite step.

        Returns:
            The new state.
        """
        bad_fields = sorted(set(updates) & _MANAGED_FIELDS)
        if bad_fields:
            raise TypeError(
                f"apply_gradients manages {', '.join(bad_fields)} itself; pass only "
                "other fields (e.g. batch_stats=...) as updates."
            )
        unknown_fields = sorted(set(updates) - set(self.__dataclass_fields__))
        if unknown_fields:
            raise TypeError(
                f"TrainState has no field {', '.join(unknown_fields)}; fields that "
                "can be updated: "
                f"{', '.join(sorted(set(self.__dataclass_fields__) - _MANAGED_FIELDS))}."
            )
        for name, new_value in updates.items():
            old_value = getattr(self, name)
            if jax.tree.structure(old_value) != jax.tree.structure(new_value):
                raise ValueError(
                    f"apply_gradients got {name} with a structure different from the "
                    f"state's: {jax.tree.structure(new_value)} vs "
                    f"{jax.tree.structure(old_value)}. Create the state with "
                    f"{name}= its initial value."
                )
        if grads_finite is None:
            grads_finite = all_finite(grads)

        param_updates, new_opt_state = self.tx.update(grads, self.opt_state, self.params)
        new_params = optax.apply_updates(self.params, param_updates)
        stepped = {
            "step": self.step + 1,
            "params": new_params,
            "opt_state": new_opt_state,
            **updates,
        }
        kept = {name: getattr(self, name) for name in stepped}
        selected = select_tree(grads_finite, stepped, kept)
        return self.replace(
            **selected,
            loss_scale=self.loss_scale.adjust(grads_finite),
            skipped_steps=jnp.where(
                grads_finite, self.skipped_steps, optax.safe_increment(self.skipped_steps)
            ),
        )
