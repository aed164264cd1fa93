"""Precision policies: which dtype params, computation and outputs use.

A `Policy` is a small immutable value with three dtypes. It casts pytrees and
nothing else; applying it to a Flax model is the job of `jaxamp.apply_policy`.

Policies are usually named by a string, so that they fit a command-line flag or
a config file. `get_policy` accepts short names (``"mixed"``, ``"bf16"``) and
jmp's grammar (``"params=float32,compute=float16,output=float32"``), with one
key of jaxamp's own: ``matmul=float8`` runs the eligible matrix
multiplications in FP8 under `jaxamp.autocast` (``"mixed_float8"``), and
``matmul=mxfp8`` or ``matmul=nvfp4`` in Blackwell's block-scaled formats
(``"mixed_mxfp8"``, ``"mixed_nvfp4"``).

A name may also say how the optimizer stores params and state
(``"bfloat16_kahan"``, ``"bfloat16_int8"``, the keys ``update=``, ``state=``,
``block=``): that part is a `jaxamp.OptimizerStorage`, which
`jaxamp.split_precision` reads beside the policy. A `Policy` made with it
still works and warns (its storage fields are deprecated).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import warnings
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import jmp
import numpy as np

from jaxamp._unknown_name import unknown_name

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

# The one FP8 matmul dtype a policy names: float8_e4m3fn operands forward,
# float8_e5m2 for the incoming cotangent backward (the "hybrid" format of
# TransformerEngine); the policy stores the forward dtype.
_MATMUL_DTYPE_ALIASES: dict[str, Any] = {
    "f8": jnp.float8_e4m3fn,
    "fp8": jnp.float8_e4m3fn,
    "float8": jnp.float8_e4m3fn,
    "float8_e4m3fn": jnp.float8_e4m3fn,
}

# The block-scaled formats a policy names by their own names (jaxamp.fp8.block_scaled_dot_general):
# MXFP8 (E4M3 values, an E8M0 scale per 32) and NVFP4 (E2M1 values, an E4M3 scale per 16, a tensor scale).
BLOCK_SCALED_FORMATS = ("mxfp8", "nvfp4")

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

# Named policies whose eligible matmuls run in FP8: (params, compute, output).
_NAMED_FP8_POLICIES: dict[str, tuple[Any, Any, Any, Any]] = {
    "mixed_float8": (_F32, _BF16, _F32, jnp.float8_e4m3fn),
    "mixed_fp8": (_F32, _BF16, _F32, jnp.float8_e4m3fn),
    "mixed_mxfp8": (_F32, _BF16, _F32, "mxfp8"),
    "mixed_nvfp4": (_F32, _BF16, _F32, "nvfp4"),
}

# How an update lands on the params (`jaxamp.low_precision_optimizer`): named
# policies keep params and optimizer state in bfloat16 and say the rounding.
UPDATE_ROUNDINGS = ("nearest", "stochastic", "kahan")

_NAMED_UPDATE_POLICIES: dict[str, str] = {
    f"{prefix}_{rounding}": rounding for prefix in ("bfloat16", "bf16") for rounding in UPDATE_ROUNDINGS
}

# 8-bit optimizer state (`jaxamp.low_precision_optimizer`'s state_dtype, stored by
# jaxamp._optimizer.quantized): the formats, the spellings each is accepted by, and the block size.
STATE_FORMATS = ("int8", "float8_e4m3fn")
STATE_FORMAT_ALIASES = {
    "int8": "int8",
    "float8_e4m3fn": "float8_e4m3fn",
    "float8": "float8_e4m3fn",
    "fp8": "float8_e4m3fn",
    "f8": "float8_e4m3fn",
}
DEFAULT_BLOCK_SIZE = 256


def canonical_state_format(value: Any) -> str | None:
    """The 8-bit state format `value` names (a name of `STATE_FORMAT_ALIASES`, any case, ``jnp.int8``,
    ``jnp.float8_e4m3fn``), or None where it names none."""
    if isinstance(value, str):
        return STATE_FORMAT_ALIASES.get(value.strip().lower())
    try:
        dtype = jnp.dtype(value)
    except TypeError:
        return None
    return dtype.name if dtype.name in STATE_FORMATS else None


# Named policies with 8-bit optimizer state are
# bfloat16_stochastic with the state in that format, in blocks of 256 or one block per leaf.
_NAMED_STATE_POLICIES: dict[str, tuple[str, int | None]] = {
    f"{prefix}_{suffix}": setting
    for prefix in ("bfloat16", "bf16")
    for suffix, setting in (
        ("int8", ("int8", DEFAULT_BLOCK_SIZE)),
        ("fp8", ("float8_e4m3fn", DEFAULT_BLOCK_SIZE)),
        ("int8_per_tensor", ("int8", None)),
    )
}

# The names a mistyped one is answered with, grouped; the aliases are left to get_policy's docstring.
_POLICY_CHOICES = """\
  half compute:  mixed_float16 (mixed), mixed_bfloat16, mixed_float8, mixed_mxfp8, mixed_nvfp4
  one dtype:     float32, float16, bfloat16, half (float16; bfloat16 on TPU)
  bf16 params:   bfloat16_kahan, bfloat16_stochastic, bfloat16_nearest, bfloat16_int8, bfloat16_fp8
  or a spec:     'p=f32,c=f16,o=f32'; help(jaxamp.get_policy) lists every alias and key"""

_GRAMMAR_KEYS = {
    "p": "param_dtype",
    "params": "param_dtype",
    "c": "compute_dtype",
    "compute": "compute_dtype",
    "o": "output_dtype",
    "output": "output_dtype",
    "m": "matmul_dtype",
    "matmul": "matmul_dtype",
    "u": "update_rounding",
    "update": "update_rounding",
    "s": "state_format",
    "state": "state_format",
    "b": "state_block_size",
    "block": "state_block_size",
}


# The grammar's keys that take one of a few words: field -> (what it is, the words, what they do, the default).
_GRAMMAR_CHOICES = {
    "matmul_dtype": (
        "matmul dtype", (*_MATMUL_DTYPE_ALIASES, *BLOCK_SCALED_FORMATS),
        "FP8 matmuls under jaxamp.autocast: per-tensor FP8, or the block-scaled mxfp8 and nvfp4",
        "matmuls in the compute dtype",
    ),
    "update_rounding": (
        "update rounding", UPDATE_ROUNDINGS, "how jaxamp.low_precision_optimizer lands each update on the params",
        "the optimizer's own update",
    ),
    "state_format": (
        "optimizer state format", tuple(STATE_FORMAT_ALIASES),
        "8-bit state with a scale per block, jaxamp.low_precision_optimizer", "the state in the param dtype",
    ),
}  # fmt: skip


DTYPE_NAMES = (*sorted(_DTYPE_ALIASES), "half")
"""The dtype names every jaxamp setting accepts (``half``: jmp's half dtype,
bfloat16 on TPU and float16 elsewhere)."""


def parse_dtype(value: Any, what: str) -> np.dtype:
    """The floating dtype `value` names: the one dtype parser of policies and communication dtypes.

    Args:
        value: a floating dtype (``jnp.float16``, ``np.dtype("float32")``) or
            one of `DTYPE_NAMES`, case-insensitive. NumPy's own strings are
            not read: NumPy takes ``"f16"`` for a 16-byte float.
        what: what the value is for, to start the error message
            (``"Policy compute_dtype"``).

    Raises:
        ValueError: `value` names no floating dtype (a non-floating dtype,
            an unknown name, None, any other object); the message names the
            value and the choices.
    """
    canonical = None
    if isinstance(value, str):
        key = value.strip().lower()
        if key == "half":
            return jnp.dtype(jmp.half_dtype())
        if key in _DTYPE_ALIASES:
            return jnp.dtype(_DTYPE_ALIASES[key])
    elif value is not None:  # jnp.dtype(None) is float64: a missing dtype must not pass as one
        try:
            canonical = jnp.dtype(value)
        except TypeError:
            pass
    if canonical is not None and jnp.issubdtype(canonical, jnp.floating):
        return canonical
    got = canonical.name if canonical is not None else repr(value)
    raise ValueError(
        f"{what} must be a floating dtype, such as jnp.float32, jnp.float16 or jnp.bfloat16, or one of "
        f"the names {', '.join(DTYPE_NAMES)}; got {got}."
    )


def _canonical_matmul_dtype(dtype: Any) -> np.dtype | str | None:
    """None (matmuls in the compute dtype), float8_e4m3fn (FP8 matmuls), or a block-scaled format's name."""
    if dtype is None:
        return None
    key = dtype.strip().lower() if isinstance(dtype, str) else None
    if key is not None and key in _MATMUL_DTYPE_ALIASES:
        return jnp.dtype(_MATMUL_DTYPE_ALIASES[key])
    if key is not None and key in BLOCK_SCALED_FORMATS:
        return key
    if key is None:
        try:
            canonical = jnp.dtype(dtype)
        except TypeError:
            canonical = None
        if canonical == jnp.dtype(jnp.float8_e4m3fn):
            return canonical
    raise ValueError(
        f"Policy matmul_dtype must be None (matmuls in the compute dtype), FP8 "
        f"({', '.join(_MATMUL_DTYPE_ALIASES)}, or jnp.float8_e4m3fn), or a block-scaled format "
        f"({', '.join(BLOCK_SCALED_FORMATS)}, for Blackwell GPUs); got {dtype!r}. "
        "FP8 matmuls take float8_e4m3fn operands forward and a float8_e5m2 cotangent "
        "backward; the policy names them by the forward dtype."
    )


def _canonical_update_rounding(rounding: Any) -> str | None:
    """None (the optimizer's own update) or one of `UPDATE_ROUNDINGS`."""
    if rounding is None:
        return None
    key = rounding.strip().lower() if isinstance(rounding, str) else None
    if key in UPDATE_ROUNDINGS:
        return key
    raise ValueError(
        f"Policy update_rounding must be None (the optimizer's update as optax applies it) or one of "
        f"{', '.join(UPDATE_ROUNDINGS)} (how jaxamp.low_precision_optimizer lands each update on the "
        f"params); got {rounding!r}."
    )


def _canonical_state_format(state_format: Any) -> str | None:
    """None (the optimizer state in the param dtype) or one of the 8-bit formats."""
    if state_format is None:
        return None
    canonical = canonical_state_format(state_format)
    if canonical is None:
        raise ValueError(
            f"Policy state_format must be None (optimizer state in the param dtype) or an 8-bit format with a "
            f"scale per block: {', '.join(STATE_FORMAT_ALIASES)} (int8: the dynamic code; the others: "
            f"float8_e4m3fn); got {state_format!r}."
        )
    return canonical


def _canonical_block_size(block_size: Any) -> int | None:
    """A positive number of elements per scale, or None (one scale per leaf)."""
    if block_size is None or (isinstance(block_size, int) and not isinstance(block_size, bool) and block_size > 0):
        return block_size
    raise ValueError(
        f"Policy state_block_size must be a positive integer (elements per scale of the 8-bit optimizer state; "
        f"{DEFAULT_BLOCK_SIZE} by default) or None (one scale per leaf); got {block_size!r}."
    )


def parse_fields(spec: str, keys: dict[str, str], *, kind: str, example: str, flags: tuple[str, ...] = ()) -> dict:
    """The one ``key=dtype,...`` grammar, of precision and communication policies alike.

    `spec` is read case-insensitively with spaces ignored and split at
    commas; each part is ``key=dtype`` with a key of `keys` (mapped to its
    field name), or a bare flag of `flags` (mapped to True).

    Args:
        spec: the string as the user wrote it.
        keys: key spelling -> field name (``"c"`` -> ``"compute_dtype"``).
        kind: what `spec` is, for messages (``"precision policy"``).
        example: a valid string, for messages.
        flags: the bare tokens accepted.

    Returns:
        field name -> the value's string (or True for a flag).

    Raises:
        ValueError: a part is not ``key=dtype`` or a flag, or its key is
            unknown; the message names the part and the valid keys.
    """
    fields: dict[str, Any] = {}
    for part in "".join(spec.split()).lower().split(","):
        if part in flags:
            fields[part] = True
            continue
        key, separator, value = part.partition("=")
        if not separator or not key or not value:
            forms = ", ".join(["key=dtype", *flags])
            raise ValueError(f"Malformed part {part!r} in {kind} {spec!r}: expected {forms}, e.g. {example!r}.")
        if key not in keys:
            raise ValueError(
                f"Unknown key {key!r} in {kind} {spec!r}. Valid keys: {', '.join(keys)}; e.g. {example!r}."
            )
        fields[keys[key]] = value
    return fields


def policy_of(model: Any) -> Policy | None:
    """The policy `jaxamp.apply_policy` gave `model`, or None for a model it did not make.

    `model` may also be a linen model's bound ``apply`` (a train state's ``apply_fn``).
    Every model `jaxamp.apply_policy` makes answers ``jaxamp_policy`` with its policy.
    """
    owner = getattr(model, "__self__", model)
    policy = getattr(owner, "jaxamp_policy", None)
    return policy if isinstance(policy, Policy) else None


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


# Set while jaxamp.split_precision reads a name's optimizer storage, the one use of a Policy's storage fields
# that is not deprecated.
_READING_A_PRECISION_NAME = contextvars.ContextVar("_READING_A_PRECISION_NAME", default=False)


@contextlib.contextmanager
def reading_a_precision_name():
    """While active, a `Policy` made with the optimizer's storage does not warn (`jaxamp.split_precision`)."""
    token = _READING_A_PRECISION_NAME.set(True)
    try:
        yield
    finally:
        _READING_A_PRECISION_NAME.reset(token)


@dataclasses.dataclass(frozen=True)
class Policy:
    """The dtypes of parameters, of computation and of outputs.

    Immutable and hashable, so it can be a static argument of `jax.jit` or a
    field of a Flax module. ``str(policy)`` gives a string that `get_policy`
    parses back into an equal policy.

    A fourth, optional field, `matmul_dtype`, asks `jaxamp.autocast` to run
    the eligible matrix multiplications in FP8 (``get_policy("mixed_float8")``,
    see `jaxamp.fp8_dot_general`) or in a block-scaled format
    (``"mixed_mxfp8"``, ``"mixed_nvfp4"``, see
    `jaxamp.fp8.block_scaled_dot_general`); every other operation follows
    the three dtypes as usual.

    Examples:
        >>> policy = Policy(jnp.float32, jnp.float16, jnp.float32)
        >>> str(policy)
        'params=float32,compute=float16,output=float32'
        >>> policy.cast_to_compute({"x": jnp.ones(2), "step": 3})["x"].dtype
        dtype('float16')

    Attributes:
        param_dtype: dtype in which parameters are stored and updated.
        compute_dtype: dtype of the arithmetic (matmuls, convolutions).
        output_dtype: dtype of what the model returns.
        matmul_dtype: None (matmuls in ``compute_dtype``), or
            ``float8_e4m3fn``: under `jaxamp.autocast`, every eligible
            ``dot_general`` runs as `jaxamp.fp8_dot_general` (operands
            float8_e4m3fn, cotangent float8_e5m2, result in ``compute_dtype``).
            Accepts the strings ``float8``, ``fp8``, ``f8``. Or the name
            of a block-scaled format, ``mxfp8`` or ``nvfp4``: every eligible
            ``dot_general`` runs as `jaxamp.fp8.block_scaled_dot_general`
            in that format.
        update_rounding: deprecated: the optimizer's storage is a
            `jaxamp.OptimizerStorage` (read from a name by
            `jaxamp.split_precision`), not part of a policy. None, or
            ``nearest``, ``stochastic`` or ``kahan``: how the optimizer lands
            each update on the params. A policy made with it warns.
        state_format: deprecated, as `update_rounding`: None, or an 8-bit
            format of the optimizer's state, ``int8`` or ``float8_e4m3fn``.
        state_block_size: deprecated, as `update_rounding`: elements per scale
            of the 8-bit state (256), or None for one scale per leaf.
    """

    param_dtype: np.dtype
    compute_dtype: np.dtype
    output_dtype: np.dtype
    matmul_dtype: np.dtype | str | None = None
    update_rounding: str | None = None
    state_format: str | None = None
    state_block_size: int | None = DEFAULT_BLOCK_SIZE

    def __post_init__(self):
        for name in ("param_dtype", "compute_dtype", "output_dtype"):
            object.__setattr__(self, name, parse_dtype(getattr(self, name), f"Policy {name}"))
        object.__setattr__(self, "matmul_dtype", _canonical_matmul_dtype(self.matmul_dtype))
        object.__setattr__(self, "update_rounding", _canonical_update_rounding(self.update_rounding))
        object.__setattr__(self, "state_format", _canonical_state_format(self.state_format))
        object.__setattr__(self, "state_block_size", _canonical_block_size(self.state_block_size))
        if self.update_rounding is not None and not _READING_A_PRECISION_NAME.get():
            warnings.warn(
                f"A Policy names dtypes alone; the optimizer's storage in policy {str(self)!r} "
                "(update_rounding, state_format, state_block_size) is deprecated there. For a name that says both, "
                "jaxamp.split_precision(name) gives (policy, jaxamp.OptimizerStorage), and "
                "jaxamp.optimizer_for_policy(tx, name) the optimizer; or pass the storage to "
                "jaxamp.low_precision_optimizer(tx, rounding=..., state_dtype=..., block_size=...).",
                DeprecationWarning,
                stacklevel=3,
            )
        if self.state_format is not None and self.update_rounding is None:
            raise ValueError(
                f"Policy state_format {self.state_format!r} needs an update rounding: the 8-bit state is kept "
                "by jaxamp.low_precision_optimizer, which a policy without one does not use. Add "
                "update_rounding='stochastic' (',update=stochastic' in the grammar), or name "
                "'bfloat16_int8' or 'bfloat16_fp8'."
            )

    @property
    def fp8_matmuls(self) -> bool:
        """Whether `jaxamp.autocast` runs the eligible matmuls in FP8 (per-tensor or block-scaled)."""
        return self.matmul_dtype is not None

    @property
    def matmul_format(self) -> str | None:
        """``float8`` (per-tensor FP8), ``mxfp8``, ``nvfp4``, or None (matmuls in the compute dtype)."""
        if self.matmul_dtype is None:
            return None
        return self.matmul_dtype if isinstance(self.matmul_dtype, str) else "float8"

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
        """Returns the equivalent `jmp.Policy` (jmp has neither FP8 matmuls nor update roundings: both are dropped)."""
        return jmp.Policy(self.param_dtype, self.compute_dtype, self.output_dtype)

    def __str__(self) -> str:
        text = (
            f"params={self.param_dtype.name},compute={self.compute_dtype.name},"
            f"output={self.output_dtype.name}"
        )
        text += f",matmul={self.matmul_format}" if self.fp8_matmuls else ""
        text += f",update={self.update_rounding}" if self.update_rounding else ""
        if self.state_format is not None:
            text += f",state={self.state_format}"
            if self.state_block_size != DEFAULT_BLOCK_SIZE:
                text += f",block={self.state_block_size or 'tensor'}"
        return text


PolicySpec = Policy | jmp.Policy | str


def _parse_grammar(spec: str) -> Policy:
    """Parses jmp's ``key=dtype,...`` grammar with jmp's defaults.

    Params default to float32, compute follows params and output follows
    compute (so ``"c=f16"`` is params float32, compute and output float16).
    """
    example = "params=float32,compute=float16,output=float32"
    fields = parse_fields(spec, _GRAMMAR_KEYS, kind="precision policy", example=example)
    dtypes = {
        name: parse_dtype(value, f"The {name.removesuffix('_dtype')} dtype {value!r} of precision policy {spec!r}")
        for name, value in fields.items()
        if name not in (*_GRAMMAR_CHOICES, "state_block_size")
    }
    for name, (what, valid, purpose, left_out) in _GRAMMAR_CHOICES.items():
        value = fields.get(name)
        if value is not None and value not in valid:
            raise ValueError(
                f"Unknown {what} {value!r} in precision policy {spec!r}. Valid: {', '.join(valid)} ({purpose}); "
                f"leave the key out for {left_out}."
            )
    matmul, update, state = (fields.get(name) for name in _GRAMMAR_CHOICES)
    block = fields.get("state_block_size")
    if block is not None and not (block == "tensor" or (block.isdigit() and int(block) > 0)):
        raise ValueError(
            f"Unknown block size {block!r} in precision policy {spec!r}. Valid: a positive integer (elements "
            f"per scale of the 8-bit optimizer state, {DEFAULT_BLOCK_SIZE} by default) or 'tensor' (one scale "
            "per leaf)."
        )
    if block is not None and state is None:
        raise ValueError(
            f"Precision policy {spec!r} gives a block size but no optimizer state format: add ',state=int8' "
            "or ',state=float8' (the block size is that of the 8-bit state)."
        )
    if state is not None and update is None:
        raise ValueError(
            f"Precision policy {spec!r} names an optimizer state format without an update rounding: add "
            "',update=stochastic' (the 8-bit state is kept by jaxamp.low_precision_optimizer, which lands "
            "each update by that rounding)."
        )
    block_size = DEFAULT_BLOCK_SIZE if block is None else None if block == "tensor" else int(block)
    param_dtype = dtypes.get("param_dtype", jnp.float32)
    compute_dtype = dtypes.get("compute_dtype", param_dtype)
    output_dtype = dtypes.get("output_dtype", compute_dtype)
    return Policy(param_dtype, compute_dtype, output_dtype, matmul, update, state, block_size)


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
              three in that dtype); ``mixed_float8``/``mixed_fp8`` (as
              ``mixed_bfloat16``, plus the eligible matmuls in FP8 under
              `jaxamp.autocast`); ``mixed_mxfp8`` and ``mixed_nvfp4`` (as
              ``mixed_bfloat16``, plus the eligible matmuls in MXFP8 or
              NVFP4, Blackwell's block-scaled formats);
              ``bfloat16_nearest``/``bf16_nearest``,
              ``bfloat16_stochastic``/``bf16_stochastic`` and
              ``bfloat16_kahan``/``bf16_kahan`` (all three dtypes bfloat16,
              params and optimizer state too, updates landed by that rounding
              of `jaxamp.low_precision_optimizer`); ``bfloat16_int8``/
              ``bf16_int8`` and ``bfloat16_fp8``/``bf16_fp8``
              (``bfloat16_stochastic`` with the optimizer state in 8 bits,
              int8's dynamic code or float8_e4m3fn, a scale per 256
              elements), ``bfloat16_int8_per_tensor``/``bf16_int8_per_tensor``
              (int8 with one scale per leaf, for comparison);
            * a single dtype alias such as ``f16`` or ``half`` (all three);
            * jmp's grammar, e.g. ``params=float32,compute=float16,output=float32``
              with keys ``p``/``params``, ``c``/``compute``, ``o``/``output``
              and dtype aliases ``f32``/``float32``/``full``, ``f16``/
              ``float16``, ``bf16``/``bfloat16`` and ``half`` (bfloat16 on TPU,
              float16 elsewhere). Missing keys take jmp's defaults. One key
              jmp does not have: ``m``/``matmul`` with ``float8``/``fp8``/
              ``f8`` (FP8 matmuls; e.g. ``p=f32,c=bf16,o=f32,matmul=float8``),
              ``mxfp8`` or ``nvfp4`` (block-scaled matmuls);
              and ``u``/``update`` with ``nearest``/``stochastic``/``kahan``
              (the update rounding; e.g. ``p=bf16,update=kahan``), with
              ``s``/``state`` ``int8``/``float8`` (8-bit optimizer state)
              and ``b``/``block`` a number of elements or ``tensor``
              (e.g. ``p=bf16,update=kahan,state=int8,block=2048``).

    Returns:
        The policy.

    Raises:
        ValueError: the string names no policy; the message names the bad token,
            the nearest valid name and the valid names, grouped.
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
        return _parse_grammar(spec)
    if normalized in _NAMED_POLICIES:
        return Policy(*_NAMED_POLICIES[normalized])
    if normalized in _NAMED_FP8_POLICIES:
        return Policy(*_NAMED_FP8_POLICIES[normalized])
    if normalized in _NAMED_UPDATE_POLICIES:
        return Policy(_BF16, _BF16, _BF16, update_rounding=_NAMED_UPDATE_POLICIES[normalized])
    if normalized in _NAMED_STATE_POLICIES:
        state_format, block_size = _NAMED_STATE_POLICIES[normalized]
        return Policy(_BF16, _BF16, _BF16, None, "stochastic", state_format, block_size)
    if normalized in DTYPE_NAMES:
        dtype = parse_dtype(normalized, "A policy's dtype")
        return Policy(dtype, dtype, dtype)
    every_name = (*_NAMED_POLICIES, *_NAMED_FP8_POLICIES, *_NAMED_UPDATE_POLICIES, *_NAMED_STATE_POLICIES,
                  *DTYPE_NAMES)  # fmt: skip
    raise ValueError(unknown_name("precision policy", spec, every_name, _POLICY_CHOICES))
