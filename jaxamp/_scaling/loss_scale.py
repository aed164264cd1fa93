"""Loss scales: keep small float16 gradients from flushing to zero.

Backpropagation in float16 loses every gradient below about 6e-8 (the smallest
float16 subnormal). Multiplying the loss by a scale ``S`` before
differentiation multiplies every gradient by ``S`` too, lifting them into
float16's range; dividing the gradients by ``S`` afterwards (in float32)
restores their true values.

Three loss scales share jmp's protocol, so calling code needs no ``if``:

* ``loss_scale``: the current scale, a scalar float32 array;
* ``scale(tree)`` / ``unscale(tree)``: multiply / divide floating leaves;
* ``adjust(grads_finite)``: the loss scale for the next step.

jaxamp's three loss scales also own the one definition of a skipped step (see
`CountsSkippedSteps`): ``adjust(False)`` is called once for each step whose
update is skipped, and counts it in ``skipped_steps`` and
``consecutive_skipped_steps``. `jaxamp.TrainState`, `jaxamp.loss_scaling`
and `jaxamp.OverflowGuard` read these two counters and keep none of their
own.

All of them are immutable pytrees. Every field survives ``tree_flatten`` /
``tree_unflatten``, ``jax.jit`` in and out, ``jax.tree.map`` and
``jax.jit(f).lower(loss_scale)``: counters and scales are array leaves,
settings (period, factor, bounds) are static metadata.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Protocol, TypeVar, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import serialization

from jaxamp._policy import get_policy, is_floating_array, policy_of

T = TypeVar("T")

_FLOAT32_MAX = float(np.finfo(np.float32).max)


@runtime_checkable
class LossScale(Protocol):
    """The protocol every loss scale follows (jmp's, with a float32 scale)."""

    @property
    def loss_scale(self) -> jax.Array: ...

    def scale(self, tree: T) -> T: ...

    def unscale(self, tree: T) -> T: ...

    def adjust(self, grads_finite: jax.Array) -> LossScale: ...


def _register_pytree(cls):
    """Registers a frozen dataclass as a pytree of its `_data_fields`, and with `flax.serialization`.

    Unflattening sets the fields directly instead of calling ``__init__``:
    JAX unflattens with placeholder leaves (``object()``, tracers,
    ShapeDtypeStructs) that the constructor's conversion and validation must
    never see. jmp 0.0.4's ``__post_init__`` breaks ``jit(f).lower`` exactly
    this way, and its ``tree_flatten`` drops ``min_loss_scale``; here every
    dataclass field is either a data leaf or static metadata.

    `flax.serialization` (``to_bytes``, ``to_state_dict``, and so a whole
    `jaxamp.TrainState`) sees the data fields as a dict, as it sees a
    `flax.struct` dataclass; restoring fills a target's data fields the same
    way, keeping its settings.
    """
    data_fields = cls._data_fields
    meta_fields = tuple(field.name for field in dataclasses.fields(cls) if field.name not in data_fields)

    def flatten_with_keys(obj):
        children = tuple((jax.tree_util.GetAttrKey(name), getattr(obj, name)) for name in data_fields)
        return children, tuple(getattr(obj, name) for name in meta_fields)

    def flatten(obj):
        return tuple(getattr(obj, name) for name in data_fields), tuple(
            getattr(obj, name) for name in meta_fields
        )

    def unflatten(meta, children):
        obj = object.__new__(cls)
        for name, value in zip(meta_fields, meta):
            object.__setattr__(obj, name, value)
        for name, value in zip(data_fields, children):
            object.__setattr__(obj, name, value)
        return obj

    def to_state_dict(obj):
        return {name: serialization.to_state_dict(getattr(obj, name)) for name in data_fields}

    def from_state_dict(target, state):
        unknown = sorted(set(state) - set(data_fields))
        missing = sorted(set(data_fields) - set(state))
        if unknown or missing:
            raise ValueError(
                f"Cannot restore a {cls.__name__} at {serialization.current_path()} from a state dict with "
                f"fields {', '.join(sorted(state)) or 'none'}: it has {', '.join(data_fields)}."
            )
        children = tuple(
            serialization.from_state_dict(getattr(target, name), state[name], name=name)
            for name in data_fields
        )
        return unflatten(tuple(getattr(target, name) for name in meta_fields), children)

    jax.tree_util.register_pytree_with_keys(cls, flatten_with_keys, unflatten, flatten)
    serialization.register_serialization_state(cls, to_state_dict, from_state_dict)
    return cls


def _is_concrete(value: Any) -> bool:
    return not isinstance(value, jax.core.Tracer)


def _map_floating(tree: T, operation) -> T:
    """Applies `operation` to the floating leaves of `tree`, keeping their dtype.

    `operation` combines a leaf with the float32 scale, so the result is formed
    in float32 and rounded once to the leaf's dtype; other leaves pass through.
    """
    return jax.tree.map(
        lambda leaf: operation(leaf).astype(leaf.dtype) if is_floating_array(leaf) else leaf, tree
    )


class _ScalesByItsLossScale:
    """`scale` and `unscale` for the loss scales that hold a `loss_scale` array.

    Each floating leaf is multiplied or divided by the float32 scale in
    float32 and rounded once to the leaf's own dtype. Neither the scale nor
    its reciprocal is ever rounded to the leaf's dtype first: in float16 a
    scale of 2**16 is inf and the reciprocal of 2**25 is 0, and either would
    zero every unscaled gradient.
    """

    loss_scale: jax.Array

    def scale(self, tree: T) -> T:
        """Multiplies every floating leaf of `tree` by the loss scale."""
        return _map_floating(tree, lambda leaf: leaf * self.loss_scale)

    def unscale(self, tree: T) -> T:
        """Divides every floating leaf of `tree` by the loss scale."""
        return _map_floating(tree, lambda leaf: leaf / self.loss_scale)


def _validated_scale(value: Any, name: str) -> jax.Array:
    scale = jnp.asarray(value, jnp.float32)
    if scale.shape != ():
        raise ValueError(f"{name} must be a scalar; got shape {scale.shape}.")
    if _is_concrete(scale):
        number = float(scale)
        if not (np.isfinite(number) and number > 0):
            raise ValueError(f"{name} must be a positive finite number; got {value!r}.")
    return scale


def _validated_count(value: Any, name: str) -> jax.Array:
    count = jnp.asarray(value, jnp.int32)
    if count.shape != ():
        raise ValueError(f"{name} must be a scalar; got shape {count.shape}.")
    if _is_concrete(count) and int(count) < 0:
        raise ValueError(f"{name} must be >= 0; got {value!r}.")
    return count


def _validated_flag(grads_finite: Any) -> jax.Array:
    grads_finite = jnp.asarray(grads_finite, jnp.bool_)
    if grads_finite.shape != ():
        raise ValueError(
            f"grads_finite must be a scalar bool; got shape {grads_finite.shape}. "
            "Reduce it with jaxamp.all_finite(grads)."
        )
    return grads_finite


@dataclasses.dataclass(frozen=True)
class CountsSkippedSteps:
    """The skip counters every jaxamp loss scale holds: the one definition of a skipped step.

    A step is *skipped* when its gradients are not all finite: the caller
    leaves params, optimizer state and every other field as they were, and
    calls ``adjust(False)`` on the loss scale, once. So the loss scale, which
    every step passes through exactly once with its finiteness flag, is where
    the counts live:

    ```python
    if grads_finite:
        consecutive_skipped_steps = 0
    else:
        skipped_steps += 1               # saturates at 2**31 - 1
        consecutive_skipped_steps += 1
    ```

    `jaxamp.TrainState.skipped_steps` and `jaxamp.OverflowGuard` read these
    counters from the loss scale, and `jaxamp.loss_scaling` keeps the loss
    scale in its optimizer state; none of them counts on its own, so no two
    views can disagree. A checkpoint that saves the loss scale saves the
    counts with it, and restoring it restores them together with the scale
    (there is no second copy to fall out of step).

    Attributes:
        skipped_steps: keyword-only state: steps skipped in all (int32).
        consecutive_skipped_steps: keyword-only state: steps skipped in a row
            up to now (int32; 0 after a finite step).
    """

    skipped_steps: jax.Array = dataclasses.field(default=0, kw_only=True)
    consecutive_skipped_steps: jax.Array = dataclasses.field(default=0, kw_only=True)

    def _validate_skip_counts(self) -> None:
        for name in ("skipped_steps", "consecutive_skipped_steps"):
            object.__setattr__(self, name, _validated_count(getattr(self, name), name))

    def _skip_counts_after(self, grads_finite: jax.Array) -> dict[str, jax.Array]:
        """The two counters after a step with flag `grads_finite` (a scalar bool array)."""
        return {
            "skipped_steps": jnp.where(
                grads_finite, self.skipped_steps, optax.safe_increment(self.skipped_steps)
            ),
            "consecutive_skipped_steps": jnp.where(
                grads_finite,
                jnp.zeros([], jnp.int32),
                optax.safe_increment(self.consecutive_skipped_steps),
            ),
        }

    def _replace_state(self, **leaves: jax.Array):
        # Bypasses __post_init__: the new leaves are traced inside jit.
        children = tuple(leaves[name] for name in self._data_fields)
        treedef = jax.tree.structure(self)
        return jax.tree.unflatten(treedef, children)


@_register_pytree
@dataclasses.dataclass(frozen=True)
class NoOpLossScale(CountsSkippedSteps):
    """A loss scale that does not scale: for float32 and bfloat16 training.

    bfloat16 has float32's exponent range, so its gradients do not underflow
    and need no scaling. Passing a `NoOpLossScale` where a loss scale is
    expected keeps the training code free of ``if``\\ s. A NaN still skips a
    step, so `adjust` counts skipped steps as every loss scale does (see
    `CountsSkippedSteps`); nothing else changes.

    Args:
        skipped_steps: keyword-only state: steps skipped in all.
        consecutive_skipped_steps: keyword-only state: steps skipped in a row.
    """

    _data_fields: ClassVar[tuple[str, ...]] = ("skipped_steps", "consecutive_skipped_steps")

    def __post_init__(self):
        self._validate_skip_counts()

    @property
    def loss_scale(self) -> jax.Array:
        """The scale, always 1.0 (a scalar float32 array)."""
        return jnp.ones([], jnp.float32)

    def scale(self, tree: T) -> T:
        """Returns `tree` unchanged."""
        return tree

    def unscale(self, tree: T) -> T:
        """Returns `tree` unchanged."""
        return tree

    def adjust(self, grads_finite: jax.Array) -> NoOpLossScale:
        """Returns the same (no) scale, with this step counted if it was skipped.

        Args:
            grads_finite: scalar bool, whether this step's gradients were all
                finite (see `jaxamp.all_finite`).
        """
        return self._replace_state(**self._skip_counts_after(_validated_flag(grads_finite)))


@_register_pytree
@dataclasses.dataclass(frozen=True)
class StaticLossScale(CountsSkippedSteps, _ScalesByItsLossScale):
    """Scales the loss by a fixed constant.

    The scale never changes; `adjust` counts skipped steps as every loss
    scale does (see `CountsSkippedSteps`).

    Args:
        loss_scale: the constant, a positive finite number (stored as a scalar
            float32 array).
        skipped_steps: keyword-only state: steps skipped in all.
        consecutive_skipped_steps: keyword-only state: steps skipped in a row.
    """

    loss_scale: jax.Array
    _data_fields: ClassVar[tuple[str, ...]] = ("loss_scale", "skipped_steps", "consecutive_skipped_steps")

    def __post_init__(self):
        object.__setattr__(self, "loss_scale", _validated_scale(self.loss_scale, "loss_scale"))
        self._validate_skip_counts()

    def adjust(self, grads_finite: jax.Array) -> StaticLossScale:
        """Returns the same scale, with this step counted if it was skipped.

        Args:
            grads_finite: scalar bool, whether this step's gradients were all
                finite (see `jaxamp.all_finite`).
        """
        return self._replace_state(
            loss_scale=self.loss_scale, **self._skip_counts_after(_validated_flag(grads_finite))
        )


@_register_pytree
@dataclasses.dataclass(frozen=True)
class DynamicLossScale(CountsSkippedSteps, _ScalesByItsLossScale):
    """A loss scale that backs off on overflow and grows while steps are clean.

    This is the algorithm of ``torch.amp.GradScaler`` and of jmp, with
    Megatron/DeepSpeed-style hysteresis and counters a caller can log. Each
    training step calls ``adjust(grads_finite)`` once:

    ```python
    if grads_finite:
        counter += 1
        if counter == period:       # `period` clean steps in a row
            loss_scale = min(loss_scale * factor, max_loss_scale)
            counter = 0
            overflows_until_backoff = hysteresis
        consecutive_skipped_steps = 0
    else:                           # the step is skipped by the caller
        counter = 0
        overflows_until_backoff -= 1
        if overflows_until_backoff <= 0:
            loss_scale = max(loss_scale / factor, min_loss_scale)
        skipped_steps += 1          # as every loss scale counts them
        consecutive_skipped_steps += 1   # (CountsSkippedSteps)
    ```

    With ``hysteresis=1`` (the default) every overflow halves the scale, as in
    torch and jmp. With ``hysteresis=N`` the first ``N - 1`` overflows since
    the last growth leave the scale alone (those steps are still skipped), as
    in Megatron-LM. The scale stays within ``[min_loss_scale,
    max_loss_scale]``, so it is never inf or NaN.

    Everything is traced code (``jnp.where``): no Python branching on values
    and no host sync, so it runs inside ``jax.jit`` without retracing.

    Examples:
        >>> loss_scale = DynamicLossScale(2.0**15)
        >>> scaled_loss = loss_scale.scale(loss)
        >>> grads = loss_scale.unscale(jax.grad(...))
        >>> loss_scale = loss_scale.adjust(jaxamp.all_finite(grads))

    Args:
        loss_scale: the initial scale (any float dtype; stored as float32).
        period: clean steps in a row after which the scale grows.
        factor: growth and back-off factor (> 1).
        min_loss_scale: lower bound of the scale.
        max_loss_scale: upper bound of the scale (finite).
        hysteresis: the overflow (counted since the last growth) on which the
            scale backs off; ``hysteresis - 1`` overflows are tolerated
            (Megatron-LM's and DeepSpeed's meaning; 1 backs off at once).
        counter: keyword-only state: clean steps since the last change.
        overflows_until_backoff: keyword-only hysteresis state; defaults to `hysteresis`.
        skipped_steps: keyword-only state: total overflowed (skipped) steps
            (see `CountsSkippedSteps`).
        consecutive_skipped_steps: keyword-only state: overflowed steps in a
            row up to now.
    """

    loss_scale: jax.Array = 2.0**15
    period: int = 2000
    factor: float = 2
    min_loss_scale: float = 1
    max_loss_scale: float = 2.0**24
    hysteresis: int = 1
    # State: keyword-only, so positional arguments follow the settings above.
    counter: jax.Array = dataclasses.field(default=0, kw_only=True)
    overflows_until_backoff: jax.Array | None = dataclasses.field(default=None, kw_only=True)

    _data_fields: ClassVar[tuple[str, ...]] = (
        "loss_scale",
        "counter",
        "overflows_until_backoff",
        "skipped_steps",
        "consecutive_skipped_steps",
    )

    def __post_init__(self):
        settings = {}
        for name in ("period", "hysteresis"):
            value = getattr(self, name)
            if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"DynamicLossScale {name} must be an integer >= 1; got {value!r}.")
            settings[name] = int(value)
        for name in ("factor", "min_loss_scale", "max_loss_scale"):
            value = getattr(self, name)
            try:
                number = float(value)
            except (TypeError, jax.errors.ConcretizationTypeError):
                raise TypeError(
                    f"DynamicLossScale {name} is a static setting and must be a "
                    f"concrete number; got {value!r}."
                ) from None
            if not (np.isfinite(number) and number > 0):
                raise ValueError(f"DynamicLossScale {name} must be a positive finite number; got {value!r}.")
            settings[name] = number
        if settings["factor"] <= 1:
            raise ValueError(f"DynamicLossScale factor must be > 1; got {self.factor!r}.")
        if settings["min_loss_scale"] > settings["max_loss_scale"]:
            raise ValueError(
                f"DynamicLossScale min_loss_scale ({self.min_loss_scale!r}) must not "
                f"exceed max_loss_scale ({self.max_loss_scale!r})."
            )
        if settings["max_loss_scale"] > _FLOAT32_MAX:
            raise ValueError("DynamicLossScale max_loss_scale must fit in float32.")
        for name, value in settings.items():
            object.__setattr__(self, name, value)

        loss_scale = _validated_scale(self.loss_scale, "loss_scale")
        if _is_concrete(loss_scale) and not (
            settings["min_loss_scale"] <= float(loss_scale) <= settings["max_loss_scale"]
        ):
            raise ValueError(
                f"DynamicLossScale loss_scale ({float(loss_scale)}) must lie within "
                f"[min_loss_scale, max_loss_scale] = [{settings['min_loss_scale']}, "
                f"{settings['max_loss_scale']}]."
            )
        object.__setattr__(self, "loss_scale", loss_scale)
        overflows = self.overflows_until_backoff
        if overflows is None:
            overflows = settings["hysteresis"]
        object.__setattr__(
            self, "overflows_until_backoff", _validated_count(overflows, "overflows_until_backoff")
        )
        object.__setattr__(self, "counter", _validated_count(self.counter, "counter"))
        self._validate_skip_counts()

    def adjust(self, grads_finite: jax.Array) -> DynamicLossScale:
        """Returns the loss scale for the next step (see the class docstring).

        Args:
            grads_finite: scalar bool, whether this step's gradients were all
                finite (see `jaxamp.all_finite`).
        """
        grads_finite = _validated_flag(grads_finite)
        overflowed = jnp.logical_not(grads_finite)
        zero = jnp.zeros([], jnp.int32)

        clean_steps = self.counter + 1
        grows = grads_finite & (clean_steps >= self.period)
        overflows_left = self.overflows_until_backoff - 1
        backs_off = overflowed & (overflows_left <= 0)

        grown = jnp.minimum(self.loss_scale * self.factor, self.max_loss_scale)
        shrunk = jnp.maximum(self.loss_scale / self.factor, self.min_loss_scale)
        loss_scale = jnp.where(grows, grown, jnp.where(backs_off, shrunk, self.loss_scale))

        return self._replace_state(
            loss_scale=loss_scale.astype(jnp.float32),
            counter=jnp.where(grads_finite & ~grows, clean_steps, zero),
            overflows_until_backoff=jnp.where(
                grows,
                jnp.int32(self.hysteresis),
                jnp.where(overflowed, jnp.maximum(overflows_left, zero), self.overflows_until_backoff),
            ),
            **self._skip_counts_after(grads_finite),
        )


def default_loss_scale(policy: Any) -> NoOpLossScale | DynamicLossScale:
    """Returns the loss scale a policy needs.

    float16 computation gets a `DynamicLossScale` (float16 gradients
    underflow); float32 and bfloat16 (which has float32's exponent range) get
    a `NoOpLossScale`.

    Args:
        policy: anything `jaxamp.get_policy` accepts.
    """
    if get_policy(policy).compute_dtype == jnp.float16:
        return DynamicLossScale()
    return NoOpLossScale()


def loss_scale_for_model(model: Any, params: Any) -> NoOpLossScale | DynamicLossScale:
    """The loss scale of a train state or optimizer made without one: what the model's dtypes need.

    * a model made by `jaxamp.apply_policy` (or its bound ``apply``):
      `default_loss_scale` of its policy, so `DynamicLossScale()` for float16
      computation;
    * any other model: `DynamicLossScale()` where a leaf of `params` is
      float16, else `NoOpLossScale()`. A model whose float32 params are
      computed in float16 by `jaxamp.autocast` is not recognised: pass
      ``loss_scale=jaxamp.default_loss_scale(policy)``.

    Args:
        model: the model, or a linen model's ``apply``.
        params: the params the optimizer updates.
    """
    policy = policy_of(model)
    if policy is not None:
        return default_loss_scale(policy)
    # By dtype alone, so that abstract params (jax.eval_shape's) are read too.
    float16_leaf = any(getattr(leaf, "dtype", None) == jnp.float16 for leaf in jax.tree.leaves(params))
    return DynamicLossScale() if float16_leaf else NoOpLossScale()
