"""Precision policies: which dtype params, computation and outputs use.

A `Policy` is a small immutable value with three dtypes. It casts pytrees and
nothing else; applying it to a Flax model is the job of `jaxamp.apply_policy`.

Policies are usually named by a string, so that they fit a command-line flag or
a config file. `get_policy` accepts short names (``"mixed"``, ``"bf16"``) and
jmp's grammar (``"params=float32,compute=float16,output=float32"``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import jmp
import numpy as np

T = TypeVar("T")

# Dtype aliases of jmp's grammar, plus the "fp" spellings people type.
_DTYPE_ALIASES: dict[str, Any] = {
    "f32": jnp.float32,
    "fp32": jnp.float32,
    "float32": jnp.float32,
    "full": jnp.float32,
    "f16": jnp.float16,
    "fp16": jnp.float16,
    "float16": jnp.float16,
    "bf16": jnp.bfloat16,
    "bfloat16": jnp.bfloat16,
    "f64": jnp.float64,
    "float64": jnp.float64,
}

_F32, _F16, _BF16 = jnp.float32, jnp.float16, jnp.bfloat16

# Named policies: (params, compute, output).
_NAMED_POLICIES: dict[str, tuple[Any, Any, Any]] = {
    "float32": (_F32, _F32, _F32),
    "fp32": (_F32, _F32, _F32),
    "full": (_F32, _F32, _F32),
    "mixed": (_F32, _F16, _F32),
    "mixed_float16": (_F32, _F16, _F32),
    "mixed_fp16": (_F32, _F16, _F32),
    "mixed_bfloat16": (_F32, _BF16, _F32),
    "mixed_bf16": (_F32, _BF16, _F32),
    "float16": (_F16, _F16, _F16),
    "fp16": (_F16, _F16, _F16),
    "bfloat16": (_BF16, _BF16, _BF16),
    "bf16": (_BF16, _BF16, _BF16),
}

_GRAMMAR_KEYS = {
    "p": "param_dtype",
    "params": "param_dtype",
    "c": "compute_dtype",
    "compute": "compute_dtype",
    "o": "output_dtype",
    "output": "output_dtype",
}


def _canonical_dtype(dtype: Any, field_name: str) -> np.dtype:
    if dtype is None:
        # jnp.dtype(None) is float64: a missing dtype must not pass as one.
        raise TypeError(
            f"Policy {field_name} must be a floating dtype such as jnp.float32, "
            "jnp.float16 or jnp.bfloat16; got None."
        )
    if isinstance(dtype, str):
        # NumPy would read "f16" as a 16-byte float; take jmp's aliases instead.
        key = dtype.strip().lower()
        if key == "half":
            return jnp.dtype(jmp.half_dtype())
        if key not in _DTYPE_ALIASES:
            raise TypeError(
                f"Policy {field_name} must be a floating dtype; {dtype!r} is not one of "
                f"{', '.join(sorted(_DTYPE_ALIASES))}, half (or pass a dtype such as jnp.float16)."
            )
        return jnp.dtype(_DTYPE_ALIASES[key])
    try:
        canonical = jnp.dtype(dtype)
    except TypeError as error:
        raise TypeError(
            f"Policy {field_name} must be a floating dtype such as jnp.float32, "
            f"jnp.float16 or jnp.bfloat16; got {dtype!r}."
        ) from error
    if not jnp.issubdtype(canonical, jnp.floating):
        raise TypeError(
            f"Policy {field_name} must be a floating dtype such as jnp.float32, "
            f"jnp.float16 or jnp.bfloat16; got {canonical.name}."
        )
    return canonical


def is_floating_array(leaf: Any) -> bool:
    """Whether `leaf` is a floating-point JAX array, NumPy array or NumPy scalar."""
    return isinstance(leaf, (jax.Array, np.ndarray, np.generic)) and jnp.issubdtype(leaf.dtype, jnp.floating)


def _cast_floating(tree: T, dtype: np.dtype) -> T:
    """Casts every floating-point array leaf of `tree` to `dtype`.

    JAX arrays (tracers included), NumPy arrays and NumPy scalars are cast and
    keep their kind; integer and bool arrays and non-array leaves (Python
    numbers, strings, None) are returned untouched.
    """

    def cast_leaf(leaf):
        if is_floating_array(leaf) and leaf.dtype != dtype:
            return leaf.astype(dtype)
        return leaf

    return jax.tree.map(cast_leaf, tree)


@dataclasses.dataclass(frozen=True)
class Policy:
    """The dtypes of parameters, of computation and of outputs.

    Immutable and hashable, so it can be a static argument of `jax.jit` or a
    field of a Flax module. ``str(policy)`` gives a string that `get_policy`
    parses back into an equal policy.

    Example:
        >>> policy = Policy(jnp.float32, jnp.float16, jnp.float32)
        >>> str(policy)
        'params=float32,compute=float16,output=float32'
        >>> policy.cast_to_compute({"x": jnp.ones(2), "step": 3})["x"].dtype
        dtype('float16')

    Attributes:
        param_dtype: dtype in which parameters are stored and updated.
        compute_dtype: dtype of the arithmetic (matmuls, convolutions).
        output_dtype: dtype of what the model returns.
    """

    param_dtype: np.dtype
    compute_dtype: np.dtype
    output_dtype: np.dtype

    def __post_init__(self):
        for field in dataclasses.fields(self):
            object.__setattr__(self, field.name, _canonical_dtype(getattr(self, field.name), field.name))

    def cast_to_param(self, tree: T) -> T:
        """Casts the floating-point array leaves of `tree` to `param_dtype`."""
        return _cast_floating(tree, self.param_dtype)

    def cast_to_compute(self, tree: T) -> T:
        """Casts the floating-point array leaves of `tree` to `compute_dtype`."""
        return _cast_floating(tree, self.compute_dtype)

    def cast_to_output(self, tree: T) -> T:
        """Casts the floating-point array leaves of `tree` to `output_dtype`."""
        return _cast_floating(tree, self.output_dtype)

    def with_output_dtype(self, dtype: Any) -> Policy:
        """Returns a copy of this policy whose outputs are in `dtype`."""
        return dataclasses.replace(self, output_dtype=dtype)

    @property
    def is_mixed(self) -> bool:
        """Whether computation runs in a lower precision than the params."""
        return jnp.finfo(self.compute_dtype).bits < jnp.finfo(self.param_dtype).bits

    def to_jmp(self) -> jmp.Policy:
        """Returns the equivalent `jmp.Policy`."""
        return jmp.Policy(self.param_dtype, self.compute_dtype, self.output_dtype)

    def __str__(self) -> str:
        return (
            f"params={self.param_dtype.name},compute={self.compute_dtype.name},"
            f"output={self.output_dtype.name}"
        )


PolicySpec = Policy | jmp.Policy | str


def _parse_dtype(token: str, spec: str) -> Any:
    if token == "half":
        return jmp.half_dtype()
    try:
        return _DTYPE_ALIASES[token]
    except KeyError:
        raise ValueError(
            f"Unknown dtype {token!r} in precision policy {spec!r}. Valid dtypes: "
            f"{', '.join(sorted(_DTYPE_ALIASES))}, half."
        ) from None


def _parse_grammar(normalized: str, spec: str) -> Policy:
    """Parses jmp's ``key=dtype,...`` grammar with jmp's defaults.

    Params default to float32, compute follows params and output follows
    compute (so ``"c=f16"`` is params float32, compute and output float16).
    """
    dtypes: dict[str, Any] = {}
    for part in normalized.split(","):
        key, separator, value = part.partition("=")
        if not separator or not key or not value:
            raise ValueError(
                f"Malformed part {part!r} in precision policy {spec!r}: expected "
                "key=dtype, e.g. 'params=float32,compute=float16,output=float32'."
            )
        if key not in _GRAMMAR_KEYS:
            raise ValueError(
                f"Unknown key {key!r} in precision policy {spec!r}. Valid keys: {', '.join(_GRAMMAR_KEYS)}."
            )
        dtypes[_GRAMMAR_KEYS[key]] = _parse_dtype(value, spec)
    param_dtype = dtypes.get("param_dtype", jnp.float32)
    compute_dtype = dtypes.get("compute_dtype", param_dtype)
    output_dtype = dtypes.get("output_dtype", compute_dtype)
    return Policy(param_dtype, compute_dtype, output_dtype)


def get_policy(spec: PolicySpec) -> Policy:
    """Returns the `Policy` that `spec` names.

    Args:
        spec: a `Policy` (returned as is), a `jmp.Policy` (converted), or a
            string, case-insensitive with spaces ignored:

            * a name: ``float32``/``fp32``/``full`` (all float32);
              ``mixed``/``mixed_float16``/``mixed_fp16`` (params float32,
              compute float16, output float32); ``mixed_bfloat16``/
              ``mixed_bf16`` (params float32, compute bfloat16, output
              float32); ``float16``/``fp16`` and ``bfloat16``/``bf16`` (all
              three in that dtype);
            * a single dtype alias such as ``f16`` or ``half`` (all three);
            * jmp's grammar, e.g. ``params=float32,compute=float16,output=float32``
              with keys ``p``/``params``, ``c``/``compute``, ``o``/``output``
              and dtype aliases ``f32``/``float32``/``full``, ``f16``/
              ``float16``, ``bf16``/``bfloat16`` and ``half`` (bfloat16 on TPU,
              float16 elsewhere). Missing keys take jmp's defaults.

    Returns:
        The policy.

    Raises:
        ValueError: the string names no policy; the message names the bad token
            and lists the valid names.
        TypeError: `spec` is neither a policy nor a string.
    """
    if isinstance(spec, Policy):
        return spec
    if isinstance(spec, jmp.Policy):
        return Policy(spec.param_dtype, spec.compute_dtype, spec.output_dtype)
    if not isinstance(spec, str):
        raise TypeError(
            "A precision policy must be a jaxamp.Policy, a jmp.Policy or a string "
            f"such as 'mixed_float16'; got {type(spec).__name__}: {spec!r}."
        )
    normalized = "".join(spec.split()).lower()
    if "=" in normalized:
        return _parse_grammar(normalized, spec)
    if normalized in _NAMED_POLICIES:
        return Policy(*_NAMED_POLICIES[normalized])
    if normalized in _DTYPE_ALIASES or normalized == "half":
        dtype = _parse_dtype(normalized, spec)
        return Policy(dtype, dtype, dtype)
    raise ValueError(
        f"Unknown precision policy {spec!r}. Valid names: "
        f"{', '.join(_NAMED_POLICIES)}; a dtype alias "
        f"({', '.join(sorted(_DTYPE_ALIASES))}, half); or jmp's grammar such as "
        "'params=float32,compute=float16,output=float32'."
    )
