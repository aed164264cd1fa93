"""Low-precision master weights and optimizer state around any optax optimizer.

`low_precision_optimizer(inner, ...)` keeps the params (the master weights)
and the optimizer's state in bfloat16, half the bytes of float32, while the
inner optimizer computes in float32. What decides whether such a run trains
like float32 is how each step's float32 result is rounded back:

* ``"nearest"``: round to nearest, as ``optax.apply_updates`` does on
  bfloat16 params. An update below half a bfloat16 ulp of its param (0.2%
  to 0.4% of it) is lost, every step.
* ``"stochastic"``: round up or down at random, up with the probability
  that makes the expected value the float32 sum. Small updates survive on
  average; the PRNG key lives in the state, so runs are deterministic.
* ``"kahan"``: round to nearest, and keep what rounding lost in a
  compensation buffer (one more param-sized bfloat16 tree) that is added to
  the next step's update (Kahan summation).

The wrapper returns ordinary optax updates, in the param dtype, chosen so
that ``optax.apply_updates(params, updates)`` lands exactly on the rounded
result: `jaxamp.TrainState`, `jaxamp.loss_scaling` and any hand-written loop
apply them unchanged.

Examples:
    >>> params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), params)
    >>> tx = jaxamp.low_precision_optimizer(optax.adamw(1e-3), rounding="kahan")
    >>> opt_state = tx.init(params)
    >>> updates, opt_state = tx.update(grads, opt_state, params)
    >>> params = optax.apply_updates(params, updates)

`jaxamp.OptimizerStorage` holds the storage arguments as one value;
`jaxamp.optimizer_for_policy` builds the optimizer a precision name asks for
(``"bfloat16_kahan"``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxamp._policy import (
    DEFAULT_BLOCK_SIZE,
    STATE_FORMATS,
    UPDATE_ROUNDINGS,
    canonical_state_format,
    is_floating_array,
)
from jaxamp import _draws as draws
from jaxamp._optimizer.quantized import (
    MIN_QUANTIZED_SIZE,
    QuantizedArray,
    block_scales,
    dequantize,
    explicit_sharding,
    quantize,
)

ROUNDINGS = UPDATE_ROUNDINGS

StateDtype = Any  # a dtype, a Mapping[str, dtype] or a Callable[[KeyPath, leaf], dtype | None]


class LowPrecisionState(NamedTuple):
    """The optimizer state of `low_precision_optimizer`.

    Attributes:
        inner_state: the inner optimizer's state; each floating leaf stored in
            the dtype `state_dtype` gave it.
        compensation: with ``rounding="kahan"``, a tree like the params, in
            their dtypes: what rounding lost from each param, added back on
            the next step. None with the other roundings.
        key: the raw PRNG key data (uint32) for the next step's stochastic
            rounding; split once per step.
    """

    inner_state: optax.OptState
    compensation: Any
    key: jax.Array

    # The protocol `jaxamp.TrainState.create` and `jaxamp.NNXOptimizer` read (`jaxamp._scaling.half_params`):
    # a state that says so computes its update in float32, so it may update float16 or bfloat16 params.
    computes_update_in_float32 = True


def stochastic_round(value: jax.Array, dtype: Any, key: jax.Array) -> jax.Array:
    """Rounds `value` to `dtype` up or down at random, unbiased.

    For any target floating dtype (bfloat16, float16):

    ```text
    nearest = round_to_nearest(value, dtype)
    other   = the neighbour of nearest on value's side   # nextafter
    p_other = |value - nearest| / |other - nearest|      # in [0, 1/2]
    return other with probability p_other, else nearest
    ```

    so the expected result is `value` itself. A value already representable,
    an infinity or a NaN is returned as rounded to nearest.

    The arithmetic runs in float32, so what holds below float32's smallest
    normal (2**-126, about 1.2e-38) depends on the backend. float16's
    subnormals (6e-8 to 6e-5) are float32 normals and round stochastically
    everywhere. bfloat16's subnormals lie below 2**-126, where XLA's CPU
    backend flushes float32 arithmetic to zero: there a value computed that
    small is already 0, and one passed in rounds to nearest.

    The uniform draws are `jaxamp._draws`' hash of each element's index,
    seeded by `key`.

    Args:
        value: the array to round (computed in float32).
        dtype: the dtype to round to.
        key: a PRNG key (typed or raw) for the uniform draw.

    Returns:
        An array of `dtype` and `value`'s shape.
    """
    value = jnp.asarray(value, jnp.float32)
    return round_with_draws(value, dtype, draws.bits(draws.seed_of(key), 0, value.shape))


def round_with_draws(value: jax.Array, dtype: Any, random_bits: jax.Array) -> jax.Array:
    """`stochastic_round` of `value` (float32) to `dtype` with the given uint32 draws, one per element.

    To bfloat16, whose values are float32's with the low 16 bits cleared, the
    rounding is on the bits: a uniform 16-bit number added to the low half
    carries into the high half with probability ``low half / 2**16``, which
    is the value's position between its two bfloat16 neighbours (infinities
    and NaNs stay what they are, and float32's subnormals round as the rest).
    A few integer operations per element, against ``nextafter``'s dozen.
    """
    value = jnp.asarray(value, jnp.float32)
    if jnp.dtype(dtype) == jnp.bfloat16:
        dithered = jax.lax.bitcast_convert_type(value, jnp.uint32) + (random_bits >> 16)
        rounded = jax.lax.bitcast_convert_type(dithered & np.uint32(0xFFFF0000), jnp.float32)
        return jnp.where(jnp.isfinite(value), rounded, value).astype(jnp.bfloat16)
    nearest = value.astype(dtype)
    nearest32 = nearest.astype(jnp.float32)
    toward = jnp.where(nearest32 < value, jnp.inf, -jnp.inf).astype(dtype)
    other = jnp.nextafter(nearest, toward)
    gap = other.astype(jnp.float32) - nearest32
    p_other = (value - nearest32) / gap  # NaN for infinities: the comparison below is False
    return jnp.where(draws.uniform_of(random_bits) < p_other, other, nearest)


def _floating_dtype(value: Any, setting: str) -> np.dtype:
    try:
        dtype = jnp.dtype(value)
    except TypeError:
        dtype = None
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(
            f"low_precision_optimizer's {setting} must be a floating dtype such as jnp.bfloat16, "
            f"jnp.float16 or jnp.float32; got {value!r}."
        )
    return dtype


def _is_dtype_like(value: Any) -> bool:
    """Whether `value` names a dtype: jnp.bfloat16 and np.float32 are callable too, yet dtypes."""
    try:
        jnp.dtype(value)
    except TypeError:
        return False
    return True


def _field_names(path) -> list[str]:
    """The state's field names along `path` (optax states are named tuples), outermost first."""
    return [entry.name for entry in path if isinstance(entry, jax.tree_util.GetAttrKey)]


def _is_floating(leaf) -> bool:
    return jnp.issubdtype(getattr(leaf, "dtype", np.dtype(object)), jnp.floating)


@dataclasses.dataclass(frozen=True)
class _Quantized:
    """How a state leaf is stored in 8 bits: its format and block size (None: one block)."""

    format: str
    block_size: int | None


def _state_storage(value: Any, setting: str, block_size: int | None) -> np.dtype | _Quantized:
    """A state leaf's storage that `value` names: a floating dtype, or an 8-bit format with a scale per block."""
    state_format = canonical_state_format(value)
    if state_format is not None:
        return _Quantized(state_format, block_size)
    try:
        dtype = None if value is None else jnp.dtype(value)
    except TypeError:
        dtype = None
    if dtype is not None and jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize > 1:
        return dtype
    raise ValueError(
        f"low_precision_optimizer's {setting} must be a floating dtype such as jnp.bfloat16, jnp.float16 or "
        f"jnp.float32 (stored as is), or an 8-bit format with a scale per block of block_size elements: "
        f"{', '.join(map(repr, STATE_FORMATS))} (or jnp.int8, jnp.float8_e4m3fn); got "
        f"{dtype.name if dtype is not None else repr(value)}."
    )


def _check_block_size(block_size: Any, setting: str) -> None:
    """Raises unless `block_size` is None or a power of two: every leaf stored in 8 bits has at least
    `MIN_QUANTIZED_SIZE` (4096, a power of two) elements, and arrays' sizes are multiples of powers of two."""
    if block_size is None or (
        isinstance(block_size, int) and not isinstance(block_size, bool) and block_size > 0
        and block_size & (block_size - 1) == 0
    ):
        return
    raise ValueError(
        f"{setting} must be a power of two (elements per scale of an 8-bit state leaf, which must divide "
        f"the leaf's size; {DEFAULT_BLOCK_SIZE} by default, bitsandbytes uses 2048) or None (one scale per "
        f"leaf); got {block_size!r}."
    )


def _is_single_setting(state_dtype: StateDtype) -> bool:
    """Whether `state_dtype` is one dtype or format for every leaf (not a mapping, not a callable)."""
    return not isinstance(state_dtype, Mapping) and not (
        callable(state_dtype) and not _is_dtype_like(state_dtype)
    )


def _storages(state_dtype: StateDtype, reference_state, block_size: int | None) -> list:
    """For each leaf of the inner state, in flattening order: None (kept as the inner optimizer makes it),
    the dtype it is stored in, or the `_Quantized` storage of an 8-bit format.

    A leaf asked for an 8-bit format that has fewer than `MIN_QUANTIZED_SIZE`
    elements keeps its dtype (a scalar, a bias: its state costs nothing).
    """

    def choose(path, leaf):
        if not _is_floating(leaf):
            return None
        if isinstance(state_dtype, Mapping):
            chosen = next(
                (state_dtype[name] for name in reversed(_field_names(path)) if name in state_dtype), None
            )
        elif not _is_single_setting(state_dtype):
            chosen = state_dtype(path, leaf)
        else:
            chosen = state_dtype if np.ndim(leaf) > 0 else None
        where = f"state_dtype (at {jax.tree_util.keystr(path)})"
        storage = None if chosen is None else _state_storage(chosen, where, block_size)
        if isinstance(storage, _Quantized):
            if np.size(leaf) < MIN_QUANTIZED_SIZE:
                return None
            if block_size is not None and np.size(leaf) % block_size:
                raise ValueError(
                    f"low_precision_optimizer's block_size {block_size} does not divide the state leaf at "
                    f"{jax.tree_util.keystr(path)} (shape {np.shape(leaf)}, {np.size(leaf)} elements), which "
                    f"is stored in {storage.format} in blocks of block_size elements. Choose a block_size that "
                    f"divides it (the largest power of two that does: {_largest_power_of_two(np.size(leaf))}), "
                    "block_size=None for one scale per leaf, or keep that field in a floating dtype (a mapping "
                    "or callable state_dtype)."
                )
        return storage

    return [choose(path, leaf) for path, leaf in jax.tree_util.tree_flatten_with_path(reference_state)[0]]


def _largest_power_of_two(size: int) -> int:
    return size & -size


def _check_quantized_somewhere(state_dtype: StateDtype, reference_state, storages: list) -> None:
    """Raises if an 8-bit format was asked for and no leaf of the inner state can take it."""
    asked = (
        [canonical_state_format(value) for value in state_dtype.values()]
        if isinstance(state_dtype, Mapping)
        else [canonical_state_format(state_dtype)]
        if _is_single_setting(state_dtype)
        else []
    )
    if not any(asked) or any(isinstance(storage, _Quantized) for storage in storages):
        return
    leaves = jax.tree_util.tree_flatten_with_path(reference_state)[0]
    floating = [
        f"{jax.tree_util.keystr(path)} {np.shape(leaf)}" for path, leaf in leaves if _is_floating(leaf)
    ]
    if not floating:
        raise ValueError(
            f"low_precision_optimizer's state_dtype asks for 8-bit state ({next(filter(None, asked))}), but the "
            "inner optimizer's state has no floating leaf to store in it (an optimizer without momentum or "
            "moments, such as optax.sgd without momentum, keeps only counters). Leave state_dtype at its default."
        )
    raise ValueError(
        f"low_precision_optimizer's state_dtype asks for 8-bit state ({next(filter(None, asked))}), but no "
        f"floating leaf of the inner optimizer's state it applies to has {MIN_QUANTIZED_SIZE} elements or more "
        f"(smaller leaves keep their dtype; the floating leaves are {', '.join(floating[:6])}"
        f"{', ...' if len(floating) > 6 else ''}). Leave state_dtype at a floating dtype for so small a model."
    )


def _store(leaf32: jax.Array, storage, stream: jax.Array | None, scales: tuple | None = None):
    """`leaf32` as stored: as is, rounded to its dtype (stochastically with a stream's seed from
    `draws.streams` for its draws, else to nearest), or quantized (with its `block_scales` computed
    apart, when given)."""
    if storage is None or (not isinstance(storage, _Quantized) and leaf32.dtype == storage):
        return leaf32
    random_bits = None if stream is None else draws.stream_bits(stream, leaf32.shape)
    if isinstance(storage, _Quantized):
        uniform = None if random_bits is None else draws.uniform_of(random_bits)
        return quantize(leaf32, storage.format, storage.block_size, None, scales=scales, draws=uniform)
    return leaf32.astype(storage) if random_bits is None else round_with_draws(leaf32, storage, random_bits)


def _load(stored, storage, reference, layout=None, *, by_lookup: bool = False) -> jax.Array:
    """A stored leaf read back in the dtype the inner optimizer made it in (an 8-bit leaf's codes decoded
    by a table lookup when `by_lookup`: see `dequantize`), and in `layout` (a sharding) when given."""
    if not isinstance(storage, _Quantized):
        return stored.astype(reference.dtype)
    value = dequantize(stored, by_lookup=by_lookup)
    # Under a mesh of explicit axes, the codes lie by whole blocks (`quantize`); the inner optimizer
    # meets the value with the gradients, laid out like the params, as its own state is.
    if layout is not None and explicit_sharding(value) is not None:
        value = jax.sharding.reshard(value, layout)
    return value.astype(reference.dtype)


def _explicit_layouts(inner, params32, storages) -> list:
    """Each leaf of `inner`'s state as `inner.init(params32)` lays it out, where that is on a mesh of
    explicit axes and the leaf is 8-bit (`jax.eval_shape` drops the layout on a mesh that also has
    automatic axes); None elsewhere. The traced initial state is unused otherwise (XLA removes it)."""
    if not any(isinstance(storage, _Quantized) for storage in storages) or not any(
        explicit_sharding(leaf) is not None for leaf in jax.tree.leaves(params32) if is_floating_array(leaf)
    ):
        return [None] * len(storages)
    return [
        explicit_sharding(leaf) if isinstance(storage, _Quantized) else None
        for leaf, storage in zip(jax.tree.leaves(inner.init(params32)), storages, strict=True)
    ]


def _is_variable(node) -> bool:
    return isinstance(node, nnx.Variable)


def _value(node):
    return node.get_value() if _is_variable(node) else node


def _stored_tree(state32, stored_leaves: list):
    """`stored_leaves` (one per leaf of `state32`, in its flattening order) in `state32`'s tree.

    A leaf stored as a `QuantizedArray` where `state32` holds it in an NNX
    ``Variable`` (the state of an optimizer of an NNX model: optax maps the
    model's ``nnx.Param``s into its moments) takes the Variable inside: its
    codes and its scales each in a Variable of that kind. NNX holds arrays in
    Variables and reads any other pytree as a node of its graph, so the state
    ``nnx.Optimizer`` wraps at ``init`` then has the tree of the pure state
    each ``update`` returns. The scales' Variable drops the sharding
    annotation, which names the dimensions of the codes.
    """
    units, unit_tree = jax.tree.flatten(state32, is_leaf=_is_variable)
    stored_units, position = [], 0
    for unit in units:
        count = len(jax.tree.leaves(unit))
        stored = stored_leaves[position : position + count]
        position += count
        if _is_variable(unit) and count == 1 and isinstance(stored[0], QuantizedArray):
            metadata = {
                name: value
                for name, value in unit.get_metadata().items()
                if name not in ("out_sharding", "sharding", "sharding_names", "optimizer_sharding")
            }
            stored_units.append(
                dataclasses.replace(
                    stored[0],
                    codes=unit.replace(stored[0].codes),
                    scales=type(unit).from_metadata(stored[0].scales, metadata),
                )
            )
        else:
            stored_units.append(jax.tree.structure(unit).unflatten(stored))
    return unit_tree.unflatten(stored_units)


def _stored_leaves(reference, stored_state) -> list:
    """The stored leaves of `stored_state`, one per leaf of the inner state `reference` (an 8-bit leaf as
    one `QuantizedArray` of arrays, unwrapped from the Variables `_stored_tree` put it in)."""
    units, unit_tree = jax.tree.flatten(reference, is_leaf=_is_variable)
    leaves = []
    for stored in unit_tree.flatten_up_to(stored_state):
        if isinstance(stored, QuantizedArray):
            leaves.append(
                dataclasses.replace(stored, codes=_value(stored.codes), scales=_value(stored.scales))
            )
        else:
            leaves.extend(jax.tree.leaves(stored))
    return leaves


def _check_field_names(state_dtype: Mapping, reference_state) -> None:
    fields = {
        name
        for path, _ in jax.tree_util.tree_flatten_with_path(reference_state)[0]
        for name in _field_names(path)
    }
    unknown = sorted(set(state_dtype) - fields)
    if unknown:
        raise ValueError(
            f"low_precision_optimizer's state_dtype names {', '.join(map(repr, unknown))}, which the inner "
            f"optimizer's state has no field called; its fields are {', '.join(map(repr, sorted(fields)))}."
        )


def _raw_key_and_impl(key: Any) -> tuple[jax.Array, Any]:
    """The raw uint32 data of `key` (a typed PRNG key, its raw data or an int seed) and its implementation.

    The state keeps the raw data (a plain array that checkpoints and shards
    like any other); ``update`` wraps it again with the implementation kept
    here, so a key of another implementation than the default (``"rbg"``)
    stays that implementation.
    """
    seed = (
        jax.random.key(0 if key is None else key) if isinstance(key, (int, type(None))) else jnp.asarray(key)
    )
    typed = jnp.issubdtype(seed.dtype, jax.dtypes.prng_key)
    raw_key, impl = (jax.random.key_data(seed), jax.random.key_impl(seed)) if typed else (seed, None)
    try:
        if raw_key.dtype != jnp.uint32:
            raise TypeError(raw_key.dtype)
        if jax.random.wrap_key_data(raw_key, impl=impl).shape != ():
            raise TypeError(raw_key.shape)
    except TypeError:
        raise ValueError(
            f"low_precision_optimizer's key must be a PRNG key (jax.random.key(0), of any implementation), the "
            f"raw uint32 data of a key of the default implementation, or an int seed; got {key!r}."
        ) from None
    return raw_key, impl


def low_precision_optimizer(
    inner: optax.GradientTransformation,
    *,
    param_dtype: Any = jnp.bfloat16,
    state_dtype: StateDtype = jnp.bfloat16,
    rounding: str = "stochastic",
    key: jax.Array | int | None = None,
    block_size: int | None = DEFAULT_BLOCK_SIZE,
) -> optax.GradientTransformationExtraArgs:
    """Wraps an optax optimizer to keep params and state in a low precision, computing in float32.

    ``update(grads, state, params)`` computes, leaf by leaf:

    ```text
    step_key, params_key, state_key = split(key, 3);  key = step_key
    inner_state32 = inner_state read back to the dtypes inner.init makes (float32)
    updates32, inner_state32 = inner.update(float32(grads), inner_state32, float32(params))
    for each param p (of dtype param_dtype) and its update u:
        if rounding == "nearest":    new_p = round_to_nearest(p + u)
        if rounding == "stochastic": new_p = stochastic_round(p + u, params_key)
        if rounding == "kahan":      exact = p + u + compensation
                                     new_p = round_to_nearest(exact)
                                     compensation = stochastic_round(exact - new_p, params_key)
        update = new_p - p                                            # in param_dtype
    inner_state = each floating leaf stochastic_round(leaf32, its storage dtype, state_key),
                  or quantize(leaf32, its 8-bit format, block_size, state_key)
    ```

    and returns ``update`` for ``optax.apply_updates``. ``new_p - p`` is exact
    in the param dtype whenever ``new_p`` is within a factor two of ``p``
    (Sterbenz's lemma), so the params land bit for bit on ``new_p``; a step
    that more than doubles a param or flips its sign lands within half an ulp
    of it, and Kahan's buffer, computed from where the param really landed,
    carries even that difference forward.

    State leaves, and Kahan's buffer, are rounded stochastically whatever the
    `rounding`, because both are sums of small steps in a dtype too short to
    hold each step: an exponential moving average such as Adam's ``nu``
    (``b2 = 0.999``) changes by 0.1% a step, below half a bfloat16 ulp, and
    rounded to nearest could never decay; a bfloat16 buffer rounded to
    nearest loses a biased share of each small update (10,000 additions of
    1e-4 to 1.0 end at 2.03125 instead of 2.0, against 2.0 with the buffer
    rounded stochastically).

    With an 8-bit ``state_dtype`` (``"int8"`` or ``jnp.float8_e4m3fn``), each
    floating state leaf of at least 4096 elements is stored as one byte per
    element and a float32 scale per block of `block_size` elements: about a
    quarter of float32's bytes (4.03 bytes per parameter for bfloat16 params
    and Adam's two moments). Reading it back, ``update`` dequantizes it to
    float32 before the inner optimizer's update, and requantizes the result:

    ```text
    blocks = leaf32 cut into blocks of block_size consecutive elements (flattened)
    scale  = max(|block|), negative where the block has a negative element
    codes  = stochastic_round(block / max(|block|), the format's code, state_key)
    ```

    A block with no negative element (every block of a second moment, Adam's
    ``nu``, whatever the optimizer calls it) gets a code of its own, and none
    of its positive elements rounds to zero, so that ``m / sqrt(v)`` cannot
    explode: int8 uses the unsigned dynamic code (one more bit of fraction
    and one more decade: values from 1e-7 to 1 of the block's largest),
    float8_e4m3fn stores the square root (ratios down to 2e-11). A block
    with negatives uses the signed dynamic code (1e-6 to 1) or e4m3 itself.
    The codes are in `jaxamp`'s private ``_quantized_state`` module.

    Composition: put `jaxamp.loss_scaling` outside this wrapper (or pass it as
    ``tx`` to `jaxamp.TrainState`), so that a step with non-finite gradients
    keeps the params, every state leaf, the compensation buffer and the key
    bit-identical. ``optax.MultiSteps`` and any ``chain`` go inside. The
    Kahan buffer is shaped like the params and the moments too, so
    `jaxamp.fsdp.fsdp_shardings` of the state splits them alike; it splits an
    8-bit leaf by whole blocks, with each block's scale on the device that
    holds its codes.

    Args:
        inner: the optax optimizer (any `GradientTransformation`,
            ``optax.MultiSteps``); its math runs in float32.
        param_dtype: the dtype every floating param must be stored in
            (bfloat16 by default); None accepts each param's own dtype, e.g.
            float32 normalization scales beside bfloat16 kernels.
        state_dtype: the dtype to store the inner state's floating leaves in:
            one dtype for every floating array but scalars (a scalar costs
            nothing, and rounding one, an injected learning rate say, would
            change the schedule); a mapping from field names of optax's state
            named tuples to dtypes (``{"mu": jnp.bfloat16, "nu": jnp.float32}``;
            the innermost named field of a leaf's path decides, unnamed leaves
            keep their dtype); or a callable ``(path, leaf) -> dtype or None``.
            Where a dtype goes, an 8-bit format may: ``"int8"`` (or
            ``jnp.int8``: the dynamic code) or ``jnp.float8_e4m3fn`` (or
            ``"float8"``), stored with a scale per block (see above; a leaf
            smaller than 4096 elements keeps its float32 state).
        rounding: ``"nearest"``, ``"stochastic"`` or ``"kahan"``: how each
            step's float32 result lands on the params.
        key: a PRNG key of any implementation (``jax.random.key(0,
            impl="rbg")``), the raw uint32 data of a default-implementation
            key, or an int seed, for stochastic rounding; 0 when None.
        block_size: elements per scale of an 8-bit state leaf, a power of
            two (256, as torchao; bitsandbytes uses 2048): it must divide the
            size of every leaf stored in 8 bits. None gives each leaf one
            scale.

    Returns:
        An optax `GradientTransformationExtraArgs` whose state is a
        `LowPrecisionState`; extra arguments of ``update`` go to `inner`.

    Raises:
        ValueError: here, when the optimizer is built: an unknown
            `rounding`, a `param_dtype` that is not floating, a `state_dtype`
            (or a value of a mapping) that is neither a floating dtype nor an
            8-bit format, a `block_size` that is not a power of two, a `key`
            that is no PRNG key. At ``init``, where the inner optimizer's
            state is first known (it is made from the params): a mapping
            naming no field of that state, a dtype a callable `state_dtype`
            returns, a `block_size` that does not divide a leaf stored in 8
            bits, an 8-bit state for an optimizer with no floating state leaf
            of 4096 elements; and a param not in `param_dtype`. At
            ``update``: a call without params.
    """
    if not (callable(getattr(inner, "init", None)) and callable(getattr(inner, "update", None))):
        raise TypeError(
            f"low_precision_optimizer needs inner to be an optax optimizer (with init and update); got {inner!r}."
        )
    if rounding not in ROUNDINGS:
        raise ValueError(
            f"low_precision_optimizer's rounding must be one of {', '.join(map(repr, ROUNDINGS))}; got {rounding!r}."
        )
    param_dtype = None if param_dtype is None else _floating_dtype(param_dtype, "param_dtype")
    _check_block_size(block_size, "low_precision_optimizer's block_size")
    if _is_single_setting(state_dtype):
        _state_storage(state_dtype, "state_dtype", block_size)
    elif isinstance(state_dtype, Mapping):
        for name, value in state_dtype.items():
            _state_storage(value, f"state_dtype[{name!r}]", block_size)
    raw_key, key_impl = _raw_key_and_impl(key)
    inner = optax.with_extra_args_support(inner)

    def checked_float32_params(params):
        leaves_with_paths = jax.tree_util.tree_flatten_with_path(params)[0]
        for path, leaf in leaves_with_paths:
            if param_dtype is not None and is_floating_array(leaf) and leaf.dtype != param_dtype:
                raise ValueError(
                    f"low_precision_optimizer expects params in {param_dtype.name}; the param at "
                    f"{jax.tree_util.keystr(path) or 'the root'} is {leaf.dtype.name}. Cast them first "
                    f"(params = jax.tree.map(lambda p: p.astype(jnp.{param_dtype.name}), params)), or "
                    "pass param_dtype=None to keep each param's own dtype."
                )
        return jax.tree.map(
            lambda leaf: leaf.astype(jnp.float32) if is_floating_array(leaf) else leaf, params
        )

    def land(param, update32, compensation, stream):
        """The update that lands `param` on its rounded float32 sum, and Kahan's new buffer (or None)."""
        param32 = param.astype(jnp.float32)
        exact = param32 + jnp.asarray(update32, jnp.float32)
        if rounding == "kahan":
            exact = exact + compensation.astype(jnp.float32)
        random_bits = draws.stream_bits(stream, param.shape) if rounding != "nearest" else None
        if rounding == "stochastic":
            new_param = round_with_draws(exact, param.dtype, random_bits)
        else:
            new_param = exact.astype(param.dtype)
        update = (new_param.astype(jnp.float32) - param32).astype(param.dtype)
        if rounding != "kahan":
            return update, None
        # optax.apply_updates puts the param at p + update in its dtype: new_param whenever
        # new_param - p was exact, else within half an ulp of it. The buffer keeps what was lost.
        landed = (param32 + update.astype(jnp.float32)).astype(param.dtype)
        return update, round_with_draws(exact - landed.astype(jnp.float32), param.dtype, random_bits)

    def init(params) -> LowPrecisionState:
        params32 = checked_float32_params(params)
        inner_state32 = inner.init(params32)
        if isinstance(state_dtype, Mapping):
            _check_field_names(state_dtype, inner_state32)
        leaves = jax.tree.leaves(inner_state32)
        storages = _storages(state_dtype, inner_state32, block_size)
        _check_quantized_somewhere(state_dtype, inner_state32, storages)
        return LowPrecisionState(
            inner_state=_stored_tree(
                inner_state32,
                [_store(leaf, storage, None) for leaf, storage in zip(leaves, storages, strict=True)],
            ),
            compensation=jax.tree.map(jnp.zeros_like, params) if rounding == "kahan" else None,
            key=raw_key,
        )  # fmt: skip

    def update(grads, state: LowPrecisionState, params=None, **extra_args):
        if params is None:
            raise ValueError(
                "low_precision_optimizer's update needs the params (tx.update(grads, state, params)): "
                "the updates it returns are chosen to land on them."
            )
        params32 = checked_float32_params(params)
        grads32 = jax.tree.map(
            lambda grad: grad.astype(jnp.float32) if is_floating_array(grad) else grad, grads
        )
        reference = jax.eval_shape(inner.init, params32)
        references, reference_tree = jax.tree.flatten(reference)
        storages = _storages(state_dtype, reference, block_size)
        layouts = _explicit_layouts(inner, params32, storages)

        def inner_update(stored_state, by_lookup=False):
            """The inner optimizer's update and new state, in float32, from the stored state."""
            inner_state32 = reference_tree.unflatten([
                _load(stored, storage, ref, layout, by_lookup=by_lookup)
                for stored, storage, ref, layout in zip(
                    _stored_leaves(reference, stored_state), storages, references, layouts
                )
            ])  # fmt: skip
            return inner.update(grads32, inner_state32, params32, **extra_args)

        # An 8-bit leaf's codes need its block scales, the largest magnitudes of its new value, and XLA's
        # GPU does not fuse a reduction with the elementwise kernel that consumes it: from one computation
        # of the new state, it would write the state out in float32 and read it back. The scales come from
        # a computation of their own instead, ahead of the one that writes the codes and params, which
        # reads the stored state through a barrier with the scales: XLA can neither merge the two nor fuse
        # the params' update into the scales' reductions (it would then write the new state in float32).
        # Each reads the gradients and codes once; the gradients and params stay shared, so that what
        # depends on them alone (a global norm for clipping) is computed once.
        if any(isinstance(storage, _Quantized) for storage in storages):
            scales = [
                block_scales(leaf, storage.block_size) if isinstance(storage, _Quantized) else None
                for leaf, storage in zip(
                    jax.tree.leaves(inner_update(state.inner_state, by_lookup=True)[1]),
                    storages,
                    strict=True,
                )
            ]
            stored_state, scales = jax.lax.optimization_barrier((state.inner_state, scales))
        else:
            stored_state, scales = state.inner_state, [None] * len(storages)
        updates32, new_inner_state32 = inner_update(stored_state)

        step_key, params_key, state_key = jax.random.split(
            jax.random.wrap_key_data(state.key, impl=key_impl), 3
        )
        # Both seeds from one threefry (the words two calls give): each call compiles a loop of its own.
        # Each seed then as two scalar words behind a barrier: XLA's GPU merges kernels that share an
        # array operand (sibling multi-output fusion), a seed's two words included, and a kernel merged
        # over many leaves stops recomputing the new state where it is needed and writes it out in float32.
        params_seed, state_seed = jax.vmap(draws.seed_of)(jnp.stack([params_key, state_key]))
        params_seed, state_seed = jax.lax.optimization_barrier((tuple(params_seed), tuple(state_seed)))
        param_leaves, param_tree = jax.tree.flatten(params)
        compensations = (
            param_tree.flatten_up_to(state.compensation)
            if rounding == "kahan"
            else [None] * len(param_leaves)
        )
        landed = [
            land(param, update, compensation, stream) if is_floating_array(param) else (update, compensation)
            for param, update, compensation, stream in zip(
                param_leaves,
                param_tree.flatten_up_to(updates32),
                compensations,
                draws.streams(params_seed, len(param_leaves)),
                strict=True,
            )
        ]

        state_leaves = jax.tree.leaves(new_inner_state32)
        stored_leaves = [
            _store(leaf, storage, stream, leaf_scales)
            for leaf, storage, leaf_scales, stream in zip(
                state_leaves, storages, scales, draws.streams(state_seed, len(state_leaves)), strict=True
            )
        ]
        return param_tree.unflatten([update for update, _ in landed]), LowPrecisionState(
            inner_state=_stored_tree(new_inner_state32, stored_leaves),
            compensation=param_tree.unflatten([buffer for _, buffer in landed])
            if rounding == "kahan"
            else None,
            key=jax.random.key_data(step_key),
        )

    return optax.GradientTransformationExtraArgs(init, update)
