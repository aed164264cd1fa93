"""A Flax train state that skips steps whose gradients overflowed.

A thin Flax layer over `jaxamp.loss_scaling`: the optimizer state and the loss
scale go through the wrapper's ``update``; the train state adds the fields
Flax users expect (``step``, ``batch_stats``, a subclass's own) and skips them
with the params in one select.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import struct
from flax.training import train_state

from jaxamp._finite import all_finite, select_tree
from jaxamp._scaling.half_params import require_float32_update
from jaxamp._scaling.loss_scale import LossScale, NoOpLossScale, loss_scale_for_model
from jaxamp._scaling.loss_scaling import LossScalingState, loss_scaling, require_skip_counting
from jaxamp._scaling.nonfinite import NonFiniteGradients
from jaxamp._scaling.overflow import OverflowRecord

# Fields that apply_gradients itself manages; callers cannot pass them as updates.
_MANAGED_FIELDS = frozenset(
    {
        "step",
        "params",
        "opt_state",
        "loss_scale",
        "nonfinite_grads",
        "overflow_record",
        "skipped_steps",
        "apply_fn",
        "tx",
    }
)


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
        step: steps whose update was applied (int32); a skipped step does not
            count.
        loss_scale: the loss scale (a pytree; `create` chooses the one the
            model's dtypes need when none is given). It holds the skip
            counters.
        batch_stats: the model's mutable state (e.g. BatchNorm statistics), or
            None.
        nonfinite_grads: which gradient leaves were not finite in the last
            skipped step, and its index
            (`jaxamp.diagnostics.NonFiniteGradients`: ``.summary()`` on the
            host names them); None in a state built without `create`.
        overflow_record: the `jaxamp.diagnostics.OverflowRecord` of the last
            skipped step (each matmul's and convolution's amax, forward and
            backward: ``.summary()`` names the first overflow), kept when the
            step passes ``overflow_record=`` to `apply_gradients`; None until
            then. All zeros until a step is skipped.
        skipped_steps: steps skipped because their gradients were not finite
            (int32): read from ``loss_scale.skipped_steps``, not stored twice.
    """

    loss_scale: Any = struct.field(default_factory=NoOpLossScale)
    batch_stats: Any = None
    nonfinite_grads: NonFiniteGradients | None = None
    overflow_record: OverflowRecord | None = None

    @property
    def skipped_steps(self) -> jax.Array:
        """Steps skipped because their gradients were not finite (int32).

        The loss scale's own counter (every jaxamp loss scale counts its
        skipped steps), so it cannot disagree with
        ``loss_scale.skipped_steps`` or with what `jaxamp.OverflowGuard`
        reads, and a checkpoint of the loss scale restores it: ``step +
        skipped_steps`` is every step taken.
        """
        return self.loss_scale.skipped_steps

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
                With float16 or bfloat16 params it must compute in float32:
                `jaxamp.low_precision_optimizer` around it (or anywhere in
                it), which `jaxamp.optimizer_for_policy` gives for a policy
                with half params.
            loss_scale: a jaxamp loss scale. When None, the one the model's
                dtypes need (`jaxamp.default_loss_scale` of the policy of an
                `apply_policy` model's ``apply``, so `DynamicLossScale()` for
                float16 computation; for another ``apply_fn``,
                `DynamicLossScale()` where a param is float16, else
                `NoOpLossScale()`).
            batch_stats: the model's mutable state, if any.
            **kwargs: further fields of subclasses.

        Raises:
            TypeError: `tx` is no optax optimizer, or `loss_scale` counts no
                skipped steps (a jmp loss scale).
            ValueError: a param is float16 or bfloat16 and `tx` would compute
                its update in that dtype (no `jaxamp.low_precision_optimizer`
                in it); the message gives the wrapper's arguments.
        """
        # Duck-typed like Flax: optax.MultiSteps has init/update but is no
        # GradientTransformation instance.
        if not (callable(getattr(tx, "init", None)) and callable(getattr(tx, "update", None))):
            raise TypeError(
                f"TrainState.create needs tx to be an optax optimizer (with init and update); got {tx!r}."
            )
        loss_scale = loss_scale_for_model(apply_fn, params) if loss_scale is None else loss_scale
        require_skip_counting(loss_scale, "TrainState.create")
        opt_state = tx.init(params)
        require_float32_update(params, opt_state, "TrainState.create")
        return cls(
            step=jnp.zeros([], jnp.int32),
            apply_fn=apply_fn,
            params=params,
            tx=tx,
            opt_state=opt_state,
            loss_scale=loss_scale,
            batch_stats=batch_stats,
            nonfinite_grads=NonFiniteGradients.for_params(params),
            **kwargs,
        )

    def apply_gradients(
        self,
        *,
        grads,
        grads_finite: jax.Array | None = None,
        overflow_record: OverflowRecord | None = None,
        **updates,
    ) -> TrainState:
        """Applies the optax update if the gradients are finite, else skips it.

        Where `grads_finite` is true: params and optimizer state take the
        optax update, every field in `updates` (``batch_stats=new_stats``, say)
        takes its new value, and ``step`` increments. Where it is false, all of
        those stay bit-identical, the loss scale counts the skipped step
        (``skipped_steps``) and ``nonfinite_grads`` records which gradient
        leaves were not finite, and ``overflow_record`` (when given) keeps the
        step's record. In both cases the loss scale is adjusted (grown or
        backed off). In steps:

        ```python
        param_updates, (loss_scale, opt_state) = loss_scaling(tx, loss_scale).update(
            grads, LossScalingState(loss_scale, opt_state), params,
            grads_finite=grads_finite)       # skips opt_state, adjusts the scale
        if grads_finite:
            step, params = step + 1, params + param_updates
            fields = updates                 # batch_stats=..., a subclass's own
        else:                                # step, params and fields stay as they were
            kept_record = overflow_record    # when given
        ```

        Both outcomes are computed and one is selected with ``jnp.where``, which
        XLA fuses with the optimizer update: no branch, no host sync, no
        retrace.

        Args:
            grads: gradients with the structure of ``params``, already unscaled.
            grads_finite: scalar bool; computed with `jaxamp.all_finite` when
                None.
            overflow_record: this step's `jaxamp.diagnostics.OverflowRecord`
                (from ``jaxamp.scaled_value_and_grad(..., record_overflow=True)``),
                kept in ``state.overflow_record`` if the step is skipped. The
                first call on a state without one starts it from
                ``overflow_record.cleared()``, so that call's jitted step
                returns a state of a new structure (one retrace); start from
                `with_overflow_record_of` to avoid it.
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

        param_updates, scaling_state = loss_scaling(self.tx, self.loss_scale).update(
            grads,
            LossScalingState(self.loss_scale, self.opt_state, self.nonfinite_grads),
            self.params,
            grads_finite=grads_finite,
        )
        stepped = {
            "step": self.step + 1,
            "params": optax.apply_updates(self.params, param_updates),
            **updates,
        }
        kept = {name: getattr(self, name) for name in stepped}
        return self.replace(
            **select_tree(grads_finite, stepped, kept),
            opt_state=scaling_state.inner_state,
            loss_scale=scaling_state.loss_scale,
            nonfinite_grads=scaling_state.nonfinite_grads,
            overflow_record=self._kept_record(overflow_record, grads_finite),
        )

    def with_overflow_record_of(self, step, *args, **kwargs) -> TrainState:
        """This state, holding a cleared overflow record of the sites `step` records.

        `step` is the train step that passes its record to `apply_gradients`
        (``overflow_record=``): ``step(state, *args, **kwargs)`` returns the
        new state, or a tuple whose first element is it. The step is traced
        once, abstractly (`jax.eval_shape`: nothing runs); the record of its
        output state, all amaxes zero, is this state's. From it on, the state
        keeps one structure, so a jitted step traces once and a step compiled
        ahead of time (or a checkpoint restored into the state) takes every
        later state.
        """
        stepped = jax.eval_shape(step, self, *args, **kwargs)
        stepped_state = stepped[0] if isinstance(stepped, tuple) else stepped
        if getattr(stepped_state, "overflow_record", None) is None:
            raise ValueError(
                "with_overflow_record_of: the step keeps no overflow record; pass the record of "
                "jaxamp.scaled_value_and_grad(..., record_overflow=True) to "
                "state.apply_gradients(overflow_record=...) in the step."
            )
        return self.replace(overflow_record=stepped_state.overflow_record.cleared())

    def _kept_record(self, record: OverflowRecord | None, grads_finite: jax.Array) -> OverflowRecord | None:
        """The state's record after a step: this step's if it was skipped, else the one kept before."""
        if record is None:
            return self.overflow_record
        if not isinstance(record, OverflowRecord):
            raise TypeError(
                "apply_gradients(overflow_record=...) takes the jaxamp.diagnostics.OverflowRecord that "
                f"jaxamp.scaled_value_and_grad(..., record_overflow=True) returns; got {type(record).__name__}."
            )
        kept = record.cleared() if self.overflow_record is None else self.overflow_record
        kept.check_same_sites(record, "apply_gradients(overflow_record=...)")
        return select_tree(grads_finite, kept, record)
