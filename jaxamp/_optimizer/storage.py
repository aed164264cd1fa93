"""The optimizer's storage as a value of its own, and a precision name read as a policy and a storage.

One job: a `jaxamp.Policy` names dtypes (of the params, the computation, the
outputs, the matmuls). How `jaxamp.low_precision_optimizer` stores the params
and the optimizer's state, its update rounding, the state's dtype or 8-bit
format and the block size, is an `OptimizerStorage`. One name, as a
command-line flag or a config file gives it, may say both: `split_precision`
reads ``"bfloat16_int8"`` as the ``"bfloat16"`` policy and 8-bit state, and
`optimizer_for_policy` builds the optimizer such a name asks for.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxamp._optimizer.low_precision import (
    ROUNDINGS,
    _check_block_size,
    _Quantized,
    _state_storage,
    low_precision_optimizer,
)
from jaxamp._policy import DEFAULT_BLOCK_SIZE, Policy, PolicySpec, get_policy, reading_a_precision_name


@dataclasses.dataclass(frozen=True)
class OptimizerStorage:
    """How `jaxamp.low_precision_optimizer` stores params and state: its storage arguments as one value.

    Immutable and hashable, checked when made (a rounding that does not
    exist, a format that is neither floating nor 8-bit, a block size that is
    not a power of two raise here). A precision name that says it
    (``"bfloat16_kahan"``, ``"bfloat16_int8"``, ``"p=bf16,update=kahan,state=int8"``)
    gives it through `jaxamp.split_precision`.

    Examples:
        >>> storage = jaxamp.OptimizerStorage(rounding="kahan", state_dtype="int8")
        >>> str(storage)
        'update=kahan,state=int8'
        >>> tx = storage.optimizer(optax.adamw(1e-3), param_dtype=jnp.bfloat16, key=0)

    Attributes:
        rounding: how each update lands on the params: ``"nearest"``,
            ``"stochastic"`` or ``"kahan"``.
        state_dtype: how the inner optimizer's floating state leaves are
            stored: None (in the params' dtype), a floating dtype
            (``jnp.float32``), or an 8-bit format, ``"int8"`` or
            ``"float8_e4m3fn"`` (also ``"float8"``, ``jnp.int8``).
        block_size: elements per scale of an 8-bit state leaf, a power of
            two (256), or None for one scale per leaf.
    """

    rounding: str = "stochastic"
    state_dtype: Any = None
    block_size: int | None = DEFAULT_BLOCK_SIZE

    def __post_init__(self):
        if self.rounding not in ROUNDINGS:
            raise ValueError(
                f"OptimizerStorage rounding must be one of {', '.join(map(repr, ROUNDINGS))}; "
                f"got {self.rounding!r}."
            )
        _check_block_size(self.block_size, "OptimizerStorage block_size")
        if self.state_dtype is not None:
            storage = _state_storage(self.state_dtype, "state_dtype", self.block_size)
            canonical = storage.format if isinstance(storage, _Quantized) else storage
            object.__setattr__(self, "state_dtype", canonical)

    @property
    def is_8_bit(self) -> bool:
        """Whether the state is stored in an 8-bit format with a scale per block."""
        return isinstance(self.state_dtype, str)

    def optimizer(
        self, inner: optax.GradientTransformation, *, param_dtype: Any = jnp.bfloat16, key: Any = None
    ) -> optax.GradientTransformationExtraArgs:
        """``low_precision_optimizer(inner, ...)`` with this storage, for params of `param_dtype`.

        Args:
            inner: any optax optimizer.
            param_dtype: the params' dtype (None: each param's own; the state
                is then bfloat16 where `state_dtype` is None).
            key: the PRNG key or int seed of stochastic rounding.
        """
        state_dtype = self.state_dtype
        if state_dtype is None:
            state_dtype = jnp.bfloat16 if param_dtype is None else param_dtype
        return low_precision_optimizer(
            inner,
            param_dtype=param_dtype,
            state_dtype=state_dtype,
            rounding=self.rounding,
            key=key,
            block_size=self.block_size,
        )

    def __str__(self) -> str:
        text = f"update={self.rounding}"
        if self.state_dtype is not None:
            text += f",state={self.state_dtype if self.is_8_bit else np.dtype(self.state_dtype).name}"
        if self.is_8_bit and self.block_size != DEFAULT_BLOCK_SIZE:
            text += f",block={self.block_size or 'tensor'}"
        return text


def split_precision(spec: PolicySpec) -> tuple[Policy, OptimizerStorage | None]:
    """A precision name read as the model's policy (its dtypes) and the optimizer's storage.

    The names and grammar keys that say how the optimizer stores params and
    state (``bfloat16_kahan``, ``bfloat16_int8``, ``update=``, ``state=``,
    ``block=``: see `jaxamp.get_policy`) give an `OptimizerStorage`; the rest
    of the name gives the `jaxamp.Policy`. A name with float16 or bfloat16
    params and no storage of its own (``"float16"``, ``"bfloat16"``) gives
    the storage half params need, the update computed in float32 and landed
    to nearest as optax lands it, the state in float32 for float16 params
    (float16 cannot hold Adam's ``eps`` nor a small second moment) and in
    bfloat16 for bfloat16 ones. Float32 params give None: the optimizer as
    it is.

    Examples:
        >>> policy, storage = jaxamp.split_precision("bfloat16_int8")
        >>> str(policy), str(storage)
        ('params=bfloat16,compute=bfloat16,output=bfloat16', 'update=stochastic,state=int8')
        >>> jaxamp.split_precision("mixed_bf16")[1] is None
        True

    Args:
        spec: anything `jaxamp.get_policy` reads.

    Returns:
        The policy, with dtypes alone, and the storage or None.

    Raises:
        ValueError: `spec` names no policy (the message of `jaxamp.get_policy`),
            or its storage is refused by `OptimizerStorage`.
    """
    with reading_a_precision_name():
        named = get_policy(spec)
    policy = Policy(named.param_dtype, named.compute_dtype, named.output_dtype, named.matmul_dtype)
    if named.update_rounding is not None:
        return policy, OptimizerStorage(named.update_rounding, named.state_format, named.state_block_size)
    if named.param_dtype == jnp.float16:
        return policy, OptimizerStorage("nearest", jnp.float32)
    if named.param_dtype == jnp.bfloat16:
        return policy, OptimizerStorage("nearest")
    return policy, None


def optimizer_for_policy(
    inner: optax.GradientTransformation, policy: PolicySpec, *, key: jax.Array | int | None = None
) -> optax.GradientTransformation:
    """The optimizer a precision name asks for: `inner`, or `inner` in `jaxamp.low_precision_optimizer`.

    Reads `policy` with `jaxamp.split_precision` and returns:

    ```python
    policy, storage = split_precision(policy)
    inner if storage is None else storage.optimizer(inner, param_dtype=policy.param_dtype, key=key)
    ```

    so a name with float32 params and no storage (``"mixed_bf16"``) keeps
    `inner` as optax applies it; ``"bfloat16_kahan"`` and ``"bfloat16_int8"``
    store the params in bfloat16 and the state in bfloat16 or 8 bits, each
    update landed by the rounding named; ``"float16"`` and ``"bfloat16"``
    compute the update in float32 (see `jaxamp.split_precision`).

    Examples:
        >>> tx = optimizer_for_policy(optax.adamw(1e-3), "bfloat16_kahan", key=0)  # Kahan around AdamW
        >>> sgd = optax.sgd(0.1)
        >>> optimizer_for_policy(sgd, "mixed_bf16") is sgd
        True

    Args:
        inner: any optax optimizer.
        policy: a precision name, or anything `jaxamp.get_policy` reads.
        key: the PRNG key or int seed of stochastic rounding (see
            `low_precision_optimizer`).

    Returns:
        `inner`, or the `low_precision_optimizer` around it.
    """
    policy, storage = split_precision(policy)
    if storage is None:
        return inner
    return storage.optimizer(inner, param_dtype=policy.param_dtype, key=key)

