"""Random programs for the differential fuzzer of `jaxamp.autocast` (tests/test_autocast_fuzz.py).

A program is a list of statements over six arguments, rendered as Python
source and run with ``exec``, so the program a failure prints is the program
that ran::

    def program(x, w1, w2, pos, keep, pad):
        v1 = x @ w1
        v2 = jax.jit(lambda a, c0: jnp.clip(a, 0.0, c0))(pos, 4095.0)
        return v1, v2

The arguments (`inputs`): ``x`` (4, 8) in [-2, 2]; ``w1``, ``w2`` (8, 8)
weights; ``pos`` (4, 8) integer-valued positions around 256, 2048 and 4096;
``keep`` (4, 8), kept in float32 (``float32_argnames``); ``pad`` (4, 8) a
boolean mask whose last row is all False.

While it draws a program the generator runs each statement in float32 and
keeps, per value, the float32 result (the reference), a bound on how far
`autocast`'s value may lie from it, and the value's lineage as the oracle
models it (`Lineage`). A statement whose float32 result is not finite, whose
half-precision value would overflow under the promised rules (an activation
past a quarter of the dtype's largest value, a matmul operand past
`MATMUL_OPERAND`),
or which shows a feature the caller excludes (`KNOWN_ENGINE_GAPS` in the
test module), is dropped; so every program is finite in float32 and has no
overflow that correct half arithmetic would make. Choices lean towards
chains (an op reads the value just made) and towards values of different
lineages meeting, where the rules decide something.

The bound is a first-order running error analysis done in float64 on the
reference values, element by element (`_bound`). It is sound for correct
half arithmetic under the rules of ``docs/guides/autocast-rules.md``: an
activation's op may read each operand and each constant rounded to the
compute dtype and round its result (``eps * |v| + smallest_subnormal``
each); a float32 op rounds like float32 (``2 * eps32 * |v|``); errors of the
operands propagate through each op's own derivative (a product scales them
by the other factor, a softmax by ``exp`` of the logits' errors, a one-hot
index by the integers its operand's interval spans). The error of the
float32 reference itself is inside the float32 terms. Values that the rules
keep in float32 (arguments, constants, what follows from them alone,
reductions and the exp family, a ``float32_scope`` and what it decides) have
float32 bounds, and an integer-valued result of exact inputs has bound 0: a
one-hot index must be equal. Where the rules let a value be half (a matmul's
result, what an activation decides, a ``custom_jvp``'s output cast back to
the dtype it was traced in), its bound has half roundings.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import strategies as st

import jaxamp

ARGUMENTS = ("x", "w1", "w2", "pos", "keep", "pad")
FLOAT32_ARGNAMES = ("keep",)
ROWS, FEATURES = 4, 8

# Constants of every magnitude: beyond float16's range, below its resolution, its subnormals,
# integers that float16 (past 2048) and bfloat16 (past 256) cannot hold, and plain ones.
CONSTANTS = (
    2.0, 0.5, 1.0001, 3.0, 257.0, 2049.0, 4095.0, 65504.0, 7e4, 1e5, 1e9, -1e9,
    1e-8, 1e-12, 3e-6, 1e-7, -4095.0, -2049.0, 3.4e38, 1e-30, 4095, 2049, 257, -3,
    1.4901161282665498e-07,  # 2.5 float16 subnormal units and a hair: through float32 it rounds to a tie
)  # fmt: skip
FILLS = (-1e9, -1e4, -7e4, 0.0, -65504.0, -3.4e38, 4095.0)  # where and additive-mask fills
CLIP_BOUNDS = (
    (0, 4095), (0.0, 4095.0), (0, 257), (0.0, 257.0), (0, 2049), (-4095.0, 4095.0), (1e-8, 1e9), (-1e9, 0.5),
    (-2.0, 2.0),
)  # fmt: skip
INDEX_BOUNDS = (4095, 257, 2049, 255, 2047)  # one_hot over [0, bound]
EPSILONS = (1e-5, 1e-6, 1e-12, 1.0, 1e-8)  # log(|a| + eps), layer norm's eps
THRESHOLDS = (100.0, 2049.0, 257.0, 4095.0, 0.5)  # lax.cond predicates and masks, on exact values
POSITIONS = (0.0, 1.0, 255.0, 256.0, 257.0, 1000.0, 2047.0, 2048.0, 2049.0, 4094.0, 4095.0, 4096.0, 4097.0,
             5000.0, -7.0)  # fmt: skip
MATMUL_OPERAND = {"float16": 64.0, "bfloat16": 1e4}  # largest |operand| a generated matmul reads

# Arrays the programs close over (constants as arrays, not literals): float32 fills (not weak-typed,
# so the half trace promotes to float32 where they meet a half value) and a mask whose second row is
# all False.
CLOSED_OVER_SOURCE = """\
ZEROS = jnp.zeros((4, 8))
RAMP = jnp.arange(32.0).reshape(4, 8) * 1000.0 + 1.0
TINY = jnp.full((4, 8), 1e-8, jnp.float32)
HUGE = jnp.full((4, 8), -1e9, jnp.float32)
MASK = jnp.array([[True] * 8, [False] * 8, [True, False] * 4, [False] * 7 + [True]])
"""
CLOSED_FILLS = ("ZEROS", "RAMP", "TINY", "HUGE")


def inputs(seed: int) -> dict[str, np.ndarray]:
    """The arguments of every program, from `seed`."""
    rng = np.random.default_rng(seed)
    pad = rng.random((ROWS, FEATURES)) < 0.7
    pad[:, 0] = True
    pad[-1] = False  # a fully masked row
    return {
        "x": rng.uniform(-2, 2, (ROWS, FEATURES)).astype(np.float32),
        "w1": (rng.normal(0, 1, (FEATURES, FEATURES)) / math.sqrt(FEATURES)).astype(np.float32),
        "w2": (rng.normal(0, 1, (FEATURES, FEATURES)) / math.sqrt(FEATURES)).astype(np.float32),
        "pos": rng.choice(np.asarray(POSITIONS, np.float32), (ROWS, FEATURES)),
        "keep": rng.uniform(-2, 2, (ROWS, FEATURES)).astype(np.float32),
        "pad": pad,
    }


def closed_over() -> dict[str, Any]:
    """The names a program's source may use besides its arguments."""
    namespace: dict[str, Any] = {"jax": jax, "jnp": jnp, "lax": jax.lax, "np": np, "jaxamp": jaxamp}
    exec(CLOSED_OVER_SOURCE, namespace)  # noqa: S102
    return namespace


# --- lineage and precision ---------------------------------------------------------------------


class Lineage(enum.Enum):
    """How the oracle models a value (a coarse copy of ``jaxamp/_autocast/lineage.py``'s kinds)."""

    FLOAT32 = "float32"  # an argument, a constant, a reduction, the exp family, and what follows them alone
    ACTIVATION = "activation"  # a matmul's result and what follows it: may be half
    ISLAND = "island"  # made in a float32 scope or from `keep`, and what it decides: float32


@dataclasses.dataclass(frozen=True)
class Precision:
    """The rounding an op may do: relative `unit` per rounding, absolute `tiny` near zero."""

    unit: float
    tiny: float
    half: bool

    def rounding(self, value: np.ndarray) -> np.ndarray:
        return self.unit * np.abs(value) + self.tiny


FLOAT32 = Precision(2 * float(np.finfo(np.float32).eps), float(np.finfo(np.float32).tiny), half=False)


def half_precision(dtype: Any) -> Precision:
    """An op of `dtype`: its eps per rounding (twice the unit roundoff), its smallest subnormal
    (float16's survive on a CPU, which computes half in float32; bfloat16's flush like float32's)."""
    info = jnp.finfo(dtype)
    return Precision(float(info.eps), max(float(info.smallest_subnormal), FLOAT32.tiny), half=True)


def fits(value: Any, dtype: Any) -> bool:
    """Whether `dtype` holds every finite value of `value`: none past its largest, none nonzero
    below its smallest subnormal (the rule of ``lineage.Lineage.fits``)."""
    magnitudes = np.abs(np.asarray(value, np.float64))
    nonzero = magnitudes[(magnitudes > 0) & np.isfinite(magnitudes)]
    info = jnp.finfo(dtype)
    if nonzero.size == 0:
        return True
    return nonzero.max() <= float(info.max) and nonzero.min() >= float(info.smallest_subnormal)


# --- operations ---------------------------------------------------------------------------------

# Operand kinds: "f" a (4, 8) float, "r" a (4, 1) row statistic, "x" either, "m" a (4, 8) bool mask,
# "e" a float whose bound is 0 (exact: a mask may be computed from it), "w" a weight argument.
# Constant slots: "c" CONSTANTS, "l" FILLS, "b" a CLIP_BOUNDS pair, "i" INDEX_BOUNDS, "p" EPSILONS,
# "t" THRESHOLDS, "C" a closed-over fill, "k" a tril offset.
# Kinds of op: "follow" (follows its inputs' lineage), "matmul", "float32" (runs in float32, gives a
# float32 value), "mask", "index" (an integer-valued float32 result).


@dataclasses.dataclass(frozen=True)
class Op:
    name: str
    operands: str
    consts: str
    template: str  # {0}, {1}: operands; {c0}, {c1}: constants
    kind: str
    out: str  # "f", "r", "m", "o" (a one-hot, an output only) or "same" (the kind of operand 0)
    exact: bool = False  # integer-valued exact operands give an exact result


OPS = (
    Op("matmul", "fw", "", "{0} @ {1}", "matmul", "f"),
    Op("add_c", "x", "c", "{0} + {c0}", "follow", "same", exact=True),
    Op("mul_c", "x", "c", "{0} * {c0}", "follow", "same", exact=True),
    Op("sub_from_c", "x", "c", "{c0} - {0}", "follow", "same", exact=True),
    Op("div_c", "x", "c", "{0} / {c0}", "follow", "same"),
    Op("add", "xx", "", "{0} + {1}", "follow", "broadcast", exact=True),
    Op("sub", "xx", "", "{0} - {1}", "follow", "broadcast", exact=True),
    Op("mul", "xx", "", "{0} * {1}", "follow", "broadcast", exact=True),
    Op("minimum", "xx", "", "jnp.minimum({0}, {1})", "follow", "broadcast", exact=True),
    Op("minimum_c", "x", "c", "jnp.minimum({0}, {c0})", "follow", "same", exact=True),
    Op("maximum_c", "x", "c", "jnp.maximum({0}, {c0})", "follow", "same", exact=True),
    Op("clip", "x", "b", "jnp.clip({0}, {c0}, {c1})", "follow", "same", exact=True),
    Op("where_fill", "mf", "l", "jnp.where({0}, {1}, {c0})", "follow", "f", exact=True),
    Op("where_fill_first", "mf", "l", "jnp.where({0}, {c0}, {1})", "follow", "f", exact=True),
    Op("where", "mff", "", "jnp.where({0}, {1}, {2})", "follow", "f", exact=True),
    Op("where_closed", "mf", "C", "jnp.where({0}, {1}, {c0})", "follow", "f", exact=True),
    Op("select_full", "mf", "l", "lax.select({0}, {1}, jnp.full_like({1}, {c0}))", "follow", "f", exact=True),
    Op("additive_mask", "mf", "l", "{1} + jnp.where({0}, 0.0, {c0})", "follow", "f", exact=True),
    Op("neg", "x", "", "-{0}", "follow", "same", exact=True),
    Op("abs", "x", "", "jnp.abs({0})", "follow", "same", exact=True),
    Op("tanh", "x", "", "jnp.tanh({0})", "follow", "same"),
    Op("relu", "x", "", "jax.nn.relu({0})", "follow", "same", exact=True),
    Op("relu6", "x", "", "jax.nn.relu6({0})", "follow", "same", exact=True),
    Op("gelu", "f", "", "jax.nn.gelu({0})", "follow", "f"),
    Op("layer_norm", "f", "p",
       "({0} - jnp.mean({0}, -1, keepdims=True)) * lax.rsqrt(jnp.var({0}, -1, keepdims=True) + {c0})",
       "follow", "f"),
    Op("exp", "x", "", "jnp.exp({0})", "float32", "same"),
    Op("log", "x", "p", "jnp.log(jnp.abs({0}) + {c0})", "float32", "same"),
    Op("softmax", "f", "", "jax.nn.softmax({0}, axis=-1)", "float32", "f"),
    Op("log_softmax", "f", "", "jax.nn.log_softmax({0}, axis=-1)", "float32", "f"),
    Op("sum", "f", "", "jnp.sum({0}, -1, keepdims=True)", "float32", "r", exact=True),
    Op("mean", "f", "", "jnp.mean({0}, -1, keepdims=True)", "float32", "r"),
    Op("max", "f", "", "jnp.max({0}, -1, keepdims=True)", "float32", "r", exact=True),
    Op("var", "f", "", "jnp.var({0}, -1, keepdims=True)", "float32", "r"),
    Op("norm", "f", "", "jnp.linalg.norm({0}, axis=-1, keepdims=True)", "float32", "r"),
    Op("trunc", "x", "", "{0}.astype(jnp.int32).astype(jnp.float32)", "index", "same"),
    Op("one_hot_index", "f", "i",
       "jnp.sum(jax.nn.one_hot(jnp.clip({0}, 0, {c0}).astype(jnp.int32), {c0} + 1)"
       " * jnp.arange({c0} + 1), -1)", "index", "f"),
    Op("one_hot", "f", "i", "jax.nn.one_hot(jnp.clip({0}, 0, {c0}).astype(jnp.int32), {c0} + 1)",
       "index", "o"),
    Op("closed_mask", "", "", "MASK", "mask", "m"),
    Op("tril_mask", "", "k", "jnp.tril(jnp.ones((4, 8), bool), {c0})", "mask", "m"),
    Op("greater", "e", "t", "{0} > {c0}", "mask", "m"),
    Op("and_mask", "mm", "", "{0} & {1}", "mask", "m"),
    Op("not_mask", "m", "", "~{0}", "mask", "m"),
)  # fmt: skip
OPS_BY_NAME = {op.name: op for op in OPS}
# The generator draws a group, then an op of it (hypothesis favours the first choices of a list).
GROUPS = (
    ("matmul",),
    ("add", "mul", "sub", "minimum"),
    ("where_fill", "additive_mask", "where_fill_first", "where_closed", "select_full", "where"),
    ("add_c", "mul_c", "sub_from_c", "div_c"),
    ("clip", "minimum_c", "maximum_c"),
    ("softmax", "log_softmax", "layer_norm", "exp", "log"),
    ("one_hot_index", "one_hot", "trunc"),
    ("tril_mask", "closed_mask", "greater", "and_mask", "not_mask"),
    ("sum", "mean", "max", "var", "norm"),
    ("relu", "gelu", "tanh", "relu6", "abs", "neg"),
)
assert sorted(name for group in GROUPS for name in group) == sorted(OPS_BY_NAME)

# Ops that are (or, in some JAX release, may be) a jax.custom_jvp: autocast casts an output that is
# not an island to its traced dtype.
CUSTOM_JVP_OPS = frozenset(("relu", "relu6", "softmax", "log_softmax"))


@dataclasses.dataclass(frozen=True)
class Statement:
    """``name = op(operands, consts)``, wrapped.

    Wrappers: "plain"; "jit" (operands as arguments, constants closed over);
    "jit_args" (constants as arguments too: a Python number entering a nested
    jit); "scope" (`jaxamp.float32_scope`); "cond" (``lax.cond`` on an exact
    predicate, the other branch returning operand 0); "cond_scope" (the true
    branch in a float32 scope); "custom_jvp" and "custom_jvp_args" (a
    ``jax.custom_jvp`` whose rule is its body's own JVP); "loop" (a Python
    loop applying the op to its own result once per constant: one line of
    source traced twice, with two literals).
    """

    name: str
    op: str
    operands: tuple[str, ...]
    consts: tuple[Any, ...]
    wrapper: str = "plain"
    threshold: float = 100.0  # the cond's predicate: pos[0, 0] > threshold

    def source(self) -> list[str]:
        op = OPS_BY_NAME[self.op]
        if self.wrapper == "plain":
            return [f"{self.name} = {_expression(op, self.operands, self.consts)}"]
        if self.wrapper == "scope":
            expression = _expression(op, self.operands, self.consts)
            return ["with jaxamp.float32_scope():", f"    {self.name} = {expression}"]
        if self.wrapper == "loop":
            return [
                f"{self.name} = {self.operands[0]}",
                f"for c in ({', '.join(map(_literal, self.consts))}):",
                f"    {self.name} = {_expression(op, [self.name], ['c'])}",
            ]
        params = [chr(ord("a") + index) for index in range(len(self.operands))]
        passed = self.wrapper.endswith("_args")  # the constants as arguments too
        const_params = [f"c{index}" for index in range(len(self.consts))] if passed else []
        body = _expression(op, params, const_params or self.consts)
        signature = ", ".join(params + const_params)
        call = ", ".join([*self.operands, *(map(_literal, self.consts) if passed else ())])
        if self.wrapper.startswith("jit"):
            return [f"{self.name} = jax.jit(lambda {signature}: {body})({call})"]
        if self.wrapper.startswith("custom_jvp"):
            return [
                f"def {self.name}_body({signature}):",
                f"    return {body}",
                f"{self.name}_fn = jax.custom_jvp({self.name}_body)",
                f"{self.name}_fn.defjvp(lambda primals, tangents: "
                f"jax.jvp({self.name}_body, primals, tangents))",
                f"{self.name} = {self.name}_fn({call})",
            ]
        true_body = [f"    return {body}"]
        if self.wrapper == "cond_scope":
            true_body = ["    with jaxamp.float32_scope():", f"        return {body}"]
        return [
            f"def {self.name}_true({signature}):",
            *true_body,
            f"def {self.name}_false({signature}):",
            "    return a",
            f"{self.name} = lax.cond(pos[0, 0] > {_literal(self.threshold)}, {self.name}_true, "
            f"{self.name}_false, {call})",
        ]


def _literal(value: Any) -> str:
    """The shortest source that reads back as `value` (``-1e9``, ``4095.0``, ``3e-06``)."""
    if isinstance(value, str) or isinstance(value, (int, np.integer)):
        return str(value)
    value = float(value)
    for digits in range(1, 18):
        text = f"{value:.{digits}g}"
        if float(text) == value:
            break
    if "e" in text:
        mantissa, exponent = text.split("e")
        return f"{mantissa}e{int(exponent)}"
    return text if "." in text or "inf" in text or "nan" in text else f"{text}.0"


def _expression(op: Op, operands: Sequence[str], consts: Sequence[Any]) -> str:
    fields = {f"c{index}": _literal(value) for index, value in enumerate(consts)}
    return op.template.format(*operands, **fields)


@dataclasses.dataclass(frozen=True)
class Program:
    """A drawn program; ``repr`` is its source, to paste into a test."""

    seed: int
    statements: tuple[Statement, ...]
    outputs: tuple[str, ...]
    # What the generator measured (not part of the program's identity):
    reference: dict = dataclasses.field(compare=False, repr=False, default_factory=dict)
    bounds: dict = dataclasses.field(compare=False, repr=False, default_factory=dict)
    features: frozenset = dataclasses.field(compare=False, repr=False, default=frozenset())

    def source(self) -> str:
        lines = [f"def program({', '.join(ARGUMENTS)}):"]
        lines += ["    " + line for statement in self.statements for line in statement.source()]
        lines.append(f"    return ({', '.join(self.outputs)},)")
        return "\n".join(lines)

    def function(self) -> Callable[..., tuple]:
        namespace = closed_over()
        exec(self.source(), namespace)  # noqa: S102
        return namespace["program"]

    def __repr__(self) -> str:
        return f"# inputs(seed={self.seed})\n{self.source()}"

    def _repr_pretty_(self, printer, cycle) -> None:  # hypothesis prints a drawn value this way
        del cycle
        printer.text(repr(self))


# --- the error bound of each op (float64, elementwise) -------------------------------------------


@dataclasses.dataclass
class Known:
    """A value as the generator knows it: its float32 reference, the bound on autocast's distance
    from it, its lineage, and its kind ("f", "r", "m", "o")."""

    value: np.ndarray
    bound: np.ndarray
    lineage: Lineage
    kind: str
    built: bool = False  # a mask computed inside the function from constants alone (jnp.tril)
    traced32: bool = False  # float32 in the half trace too (`keep`, a closed-over array, a one-hot)


def _softmax_terms(values, bounds, precision):
    """A softmax's probabilities ``p`` and how far the log of each may move: for logits moved by at
    most ``d``, ``d_i + log(sum_j p_j exp(d_j))`` (computed stably, without a cap)."""
    shifted = values - values.max(-1, keepdims=True)
    d = bounds + bounds.max(-1, keepdims=True) + precision.rounding(shifted)
    log_p = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    terms = log_p + d
    top = terms.max(-1, keepdims=True)
    return np.exp(log_p), d + top + np.log(np.exp(terms - top).sum(-1, keepdims=True))


def _variance_bound(values, bounds, precision):
    mean = values.mean(-1, keepdims=True)
    deviation = values - mean
    deviation_bound = bounds + bounds.mean(-1, keepdims=True) + precision.rounding(deviation)
    deviation_bound = deviation_bound + FLOAT32.unit * FEATURES * np.abs(values).mean(-1, keepdims=True)
    squares = 2 * np.abs(deviation) * deviation_bound + deviation_bound**2 + precision.rounding(deviation**2)
    return deviation, deviation_bound, squares.mean(-1, keepdims=True)


def _index_spread(values, bounds, upper=None):
    """How far the integer index of ``clip(v, 0, upper).astype(int)`` (or ``v.astype(int)``) may
    move for ``v`` anywhere in ``values +- bounds``; an index past `upper` counts as its distance
    from the true index (``one_hot`` of it is all zeros)."""
    low, high = values - bounds, values + bounds
    if upper is not None:
        low, high = np.clip(low, 0, upper + 1), np.clip(high, 0, upper + 1)  # rounding may pass upper
        values = np.clip(values, 0, upper)
    index, lowest, highest = np.trunc(values), np.trunc(low), np.trunc(high)
    spread = np.maximum(np.abs(highest - index), np.abs(lowest - index))
    if upper is not None:
        spread = np.where(highest > upper, np.maximum(spread, index), spread)
    return spread


def _bound(op: Op, operands: list[Known], consts, out: np.ndarray, precision: Precision, dtype) -> np.ndarray:
    """The error bound of `op`'s result, before its own rounding (see the module docstring)."""
    values = [known.value for known in operands]
    bounds = [known.bound for known in operands]
    if precision.half:  # an activation's op may read each operand rounded to half
        bounds = [bound + precision.rounding(value) if known.kind != "m" else bound
                  for bound, value, known in zip(bounds, values, operands)]  # fmt: skip
    const_bounds = [precision.rounding(c) if precision.half and not isinstance(c, str) else 0.0
                    for c in consts]  # fmt: skip
    name = op.name
    if name == "matmul":
        a, w = values
        ea, ew = bounds
        products = np.abs(a) @ np.abs(w)
        spread = (np.abs(a) + ea) @ (np.abs(w) + ew) - products
        return spread + (FEATURES + 2) * precision.unit * products + FEATURES * precision.tiny
    if name in ("add_c", "sub_from_c"):
        return bounds[0] + const_bounds[0]
    if name == "mul_c":
        c, ec = abs(consts[0]), const_bounds[0]
        return c * bounds[0] + np.abs(values[0]) * ec + bounds[0] * ec
    if name == "div_c":
        c, ec = abs(consts[0]), const_bounds[0]
        return ((np.abs(values[0]) + bounds[0]) * ec + c * bounds[0]) / (c * (c - ec))
    if name in ("add", "sub"):
        return bounds[0] + bounds[1]
    if name == "mul":
        return np.abs(values[1]) * bounds[0] + np.abs(values[0]) * bounds[1] + bounds[0] * bounds[1]
    if name == "minimum":
        return np.maximum(bounds[0], bounds[1])
    if name in ("minimum_c", "maximum_c"):
        return np.maximum(bounds[0], const_bounds[0])
    if name == "clip":
        return np.maximum(bounds[0], max(const_bounds))
    if name in ("where_fill", "select_full"):
        return np.where(values[0], bounds[1], const_bounds[0])
    if name == "where_fill_first":
        return np.where(values[0], const_bounds[0], bounds[1])
    if name == "where":
        return np.where(values[0], bounds[1], bounds[2])
    if name == "where_closed":
        fill = closed_fill(consts[0])
        fill_bound = precision.rounding(fill) if precision.half else 0.0
        return np.where(values[0], bounds[1], fill_bound)
    if name == "additive_mask":
        return bounds[1] + np.where(values[0], 0.0, const_bounds[0])
    if name in ("neg", "abs", "relu", "relu6", "tanh"):
        return bounds[0]
    if name == "gelu":
        # x * 0.5 * (1 + tanh(0.798 * (x + 0.044715 * x**3))): the tanh's argument rounded twice, the
        # tanh, the sum and the product once each; gelu's slope is at most 1.13.
        x = np.abs(values[0])
        cubic = x + 0.044715 * x**3
        inner = 0.8 * precision.rounding(cubic) + precision.rounding(0.8 * cubic)
        return 1.13 * bounds[0] + 2 * x * (0.5 * inner + 1.5 * precision.unit + precision.tiny)
    if name == "layer_norm":
        deviation, deviation_bound, variance_bound = _variance_bound(values[0], bounds[0], precision)
        denominator = (deviation**2).mean(-1, keepdims=True) + consts[0]
        with np.errstate(divide="ignore", invalid="ignore"):
            low = denominator - variance_bound
            rsqrt_bound = np.where(low > 0, 0.5 * variance_bound * np.abs(low) ** -1.5, np.inf)
        scale = denominator**-0.5
        return np.abs(deviation) * rsqrt_bound + scale * deviation_bound + deviation_bound * rsqrt_bound
    if name == "exp":
        return np.exp(values[0]) * np.expm1(bounds[0])
    if name == "log":
        inner = np.abs(values[0]) + consts[0]
        inner_bound = bounds[0] + FLOAT32.rounding(inner)
        if precision.half and fits(consts[0], dtype):
            inner_bound = inner_bound + precision.rounding(inner)
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(inner_bound < inner / 2, -np.log1p(-inner_bound / inner), np.inf)
    if name == "softmax":
        p, moved = _softmax_terms(values[0], bounds[0], precision)
        return p * np.expm1(moved)
    if name == "log_softmax":
        return _softmax_terms(values[0], bounds[0], precision)[1]
    if name in ("sum", "mean"):  # with the float32 sums' own rounding, in any order
        rounding = FEATURES * FLOAT32.rounding(values[0]).sum(-1, keepdims=True)
        total = bounds[0].sum(-1, keepdims=True) + rounding
        return total if name == "sum" else total / FEATURES
    if name == "max":
        return bounds[0].max(-1, keepdims=True)
    if name == "var":
        return _variance_bound(values[0], bounds[0], precision)[2]
    if name == "norm":
        squares = 2 * np.abs(values[0]) * bounds[0] + bounds[0] ** 2 + precision.rounding(values[0] ** 2)
        total = (values[0] ** 2).sum(-1, keepdims=True)
        squares = squares.sum(-1, keepdims=True) + FEATURES * FLOAT32.unit * total
        with np.errstate(divide="ignore", invalid="ignore"):
            relative = np.where(total > 0, squares / np.sqrt(total), np.inf)
            return np.minimum(np.sqrt(squares), relative)
    if name == "trunc":
        return _index_spread(values[0], bounds[0])
    if name in ("one_hot_index", "one_hot"):
        upper = consts[0]
        clipped_bound = bounds[0] + (precision.rounding(float(upper)) if precision.half else 0.0)
        spread = _index_spread(values[0], clipped_bound, upper)
        if name == "one_hot_index":
            return spread
        return np.broadcast_to((spread > 0)[..., None], out.shape) * 1.0  # a row may move
    raise AssertionError(f"no bound for {name}")


@functools.cache
def closed_fill(name: str) -> np.ndarray:
    """A closed-over fill's values."""
    return np.asarray(closed_over()[name], np.float64)


def _is_integral(value: Any) -> bool:
    value = np.asarray(value, np.float64)
    return bool(np.all((value == np.trunc(value)) & (np.abs(value) < 2.0**24)))


# --- the generator -----------------------------------------------------------------------------


def _lineage(op: Op, operands: list[Known], consts, scoped: bool, dtype) -> tuple[Lineage, bool]:
    """The lineage the promised rules give the result, and whether a float32 value half cannot hold
    met an activation there (the rule of issue 47: keep float32, as torch's promotion does)."""
    if scoped:
        return Lineage.ISLAND, False
    if op.kind == "matmul":
        return Lineage.ACTIVATION, False
    if op.kind in ("float32", "index"):
        return Lineage.FLOAT32, False
    floating = [known for known in operands if known.kind != "m"]
    if any(known.lineage is Lineage.ISLAND for known in floating):
        return Lineage.ISLAND, False
    if not any(known.lineage is Lineage.ACTIVATION for known in floating):
        return Lineage.FLOAT32, False
    constants = [closed_fill(c) if isinstance(c, str) else c for c in consts]
    if op.name == "layer_norm":
        constants = []  # its eps meets a float32 variance, not the activation
    if not all(fits(c, dtype) for c in constants):
        return Lineage.FLOAT32, False  # a constant half cannot hold widens the op
    unheld = any(known.lineage is Lineage.FLOAT32 and not fits(known.value, dtype) for known in floating)
    return (Lineage.FLOAT32, True) if unheld else (Lineage.ACTIVATION, False)


def _precision(lineage: Lineage, dtype) -> Precision:
    return half_precision(dtype) if lineage is Lineage.ACTIVATION else FLOAT32


# The jitted library function each op calls, where its constants enter a nested jit.
_LIBRARY_CALLS = {
    "where": "jnp.where", "where_fill": "jnp.where", "where_fill_first": "jnp.where",
    "where_closed": "jnp.where", "additive_mask": "jnp.where",
    "clip": "jnp.clip", "one_hot": "jnp.clip", "one_hot_index": "jnp.clip",
}  # fmt: skip


def features(statement: Statement, operands: list[Known], unheld: bool, earlier: frozenset) -> frozenset[str]:
    """What a statement exercises, by the names `KNOWN_ENGINE_GAPS` uses; `earlier`: the features
    of the statements before it."""
    found = set()
    op = OPS_BY_NAME[statement.op]
    scoped = statement.wrapper in ("scope", "cond_scope")
    floating = [known for known in operands if known.kind not in ("m", "w")]
    library = _LIBRARY_CALLS.get(op.name)
    if library and (op.name == "where_closed" or any(known.traced32 for known in floating)):
        found.add(f"fact: {library} called on a value traced in float32")
    if (
        library
        and statement.consts
        and not all(known.traced32 for known in floating)
        and f"fact: {library} called on a value traced in float32" in earlier
    ):
        found.add("constant_after_the_same_call_traced_in_float32")
    integer_into_jit = op.name in ("clip", "one_hot", "one_hot_index") or statement.wrapper.endswith("_args")
    if integer_into_jit and any(isinstance(c, int) for c in statement.consts) and any(
        known.lineage is not Lineage.ACTIVATION and not known.traced32 for known in floating
    ):
        found.add("integer_constant_into_nested_jit")
    if unheld:
        found.add("float32_value_half_cannot_hold_meets_activation")
    if scoped and op.name in ("sum", "mean", "var", "norm", "softmax", "log_softmax", "layer_norm"):
        found.add("reduction_in_float32_scope")
    if op.name in ("relu", "relu6") and scoped and not all(known.traced32 for known in floating):
        found.add("relu_in_float32_scope")
    if op.name == "additive_mask" and operands[0].built:
        found.add("additive_mask_built_inside")
    if op.name == "additive_mask" and scoped:
        found.add("additive_mask_in_float32_scope")
    return frozenset(found)


@dataclasses.dataclass(frozen=True)
class Limits:
    """What a generated program may hold: a dropped statement otherwise."""

    dtype: Any
    excluded: frozenset = frozenset()

    @property
    def largest_activation(self) -> float:
        return float(jnp.finfo(self.dtype).max) / 4

    @property
    def matmul_operand(self) -> float:
        return MATMUL_OPERAND[np.dtype(self.dtype).name]


def _join(*lineages: Lineage) -> Lineage:
    """The lineage of a value that is one of `lineages` (a cond's branches): an island if either is."""
    for candidate in (Lineage.ISLAND, Lineage.ACTIVATION):
        if candidate in lineages:
            return candidate
    return Lineage.FLOAT32


def evaluate(statement: Statement, namespace: dict, known: dict[str, Known], limits: Limits,
             earlier: frozenset = frozenset()):  # fmt: skip
    """Runs `statement` in float32 in `namespace`; its `Known` and features, or None to drop it."""
    if statement.wrapper == "loop":  # each turn as a statement of its own
        found, current = set(), statement.operands[0]
        for const in statement.consts:
            turn = dataclasses.replace(statement, operands=(current,), consts=(const,), wrapper="plain")
            evaluated = evaluate(turn, namespace, known, limits, earlier | found)
            if evaluated is None:
                return None
            known = {**known, statement.name: evaluated[0]}
            found |= evaluated[1]
            current = statement.name
        return known[statement.name], frozenset(found)
    op = OPS_BY_NAME[statement.op]
    operands = [known[name] for name in statement.operands]
    floating = [value for name, value in zip(statement.operands, operands) if name not in ("w1", "w2")]
    scoped = statement.wrapper in ("scope", "cond_scope")
    lineage, unheld = _lineage(op, floating, statement.consts, scoped, limits.dtype)
    found = set(features(statement, floating, unheld, earlier))
    try:
        out = _execute(statement, namespace)
    except (TypeError, ValueError):
        return None
    value = np.asarray(out, bool if out.dtype == bool else np.float64)
    if op.out == "m":
        built = op.name == "tril_mask" or any(known.built for known in operands)
        mask = Known(value, np.zeros(value.shape), Lineage.FLOAT32, "m", built)
        return None if found & limits.excluded else (mask, frozenset(found))
    kind = _kind(op, floating)
    taken = not statement.wrapper.startswith("cond") or float(namespace["pos"][0, 0]) > statement.threshold
    if taken:
        precision = FLOAT32 if scoped else half_precision(limits.dtype) if op.kind == "matmul" else (
            _precision(lineage, limits.dtype))
        if op.kind == "matmul" and not scoped and any(
            np.abs(known.value).max() > limits.matmul_operand for known in floating
        ):
            return None
        if op.name == "trunc" and np.abs(floating[0].value).max() > 2.0**30:
            return None
        internal = precision  # float32 ops and indices read an activation through ops that may round
        if op.kind in ("float32", "index") and not scoped and any(
            known.lineage is Lineage.ACTIVATION for known in floating
        ):
            internal = half_precision(limits.dtype)
        with np.errstate(all="ignore"):  # an infinite or NaN bound is read as no bound
            bound = _bound(op, operands, statement.consts, value, internal, limits.dtype)
        exact = (op.exact or op.kind == "index") and not internal.half
        if exact and _all_integral(floating, statement.consts, value):
            bound = np.zeros(value.shape)
        elif op.kind != "index":
            bound = bound + precision.rounding(value) + FLOAT32.rounding(value)
    else:
        bound = floating[0].bound
    if statement.wrapper.startswith("cond"):
        lineage = _join(lineage, floating[0].lineage)
        if lineage is Lineage.ACTIVATION:  # the branches may meet in half
            bound = bound + half_precision(limits.dtype).rounding(value)
    traced32 = op.kind == "index" or op.name == "where_closed" or any(known.traced32 for known in floating)
    custom_jvp = op.name in CUSTOM_JVP_OPS or statement.wrapper.startswith("custom_jvp")
    if custom_jvp and lineage is not Lineage.ISLAND and not traced32:
        # A custom_jvp's output is cast to the dtype it was traced in: a half value from then on,
        # which computes in half what follows from it (an activation, as the oracle models it).
        if fits(value, limits.dtype):
            bound = bound + half_precision(limits.dtype).rounding(value)
            lineage = Lineage.ACTIVATION
        else:
            found.add("float32_value_half_cannot_hold_leaves_a_custom_jvp")
    if not _in_range(value, lineage, limits) or found & limits.excluded:
        return None
    if statement.wrapper.startswith("cond") and traced32 != floating[0].traced32:
        return None  # the half trace's branches would differ in dtype
    bound = np.broadcast_to(np.where(np.isnan(bound), np.inf, bound), value.shape)
    return Known(value, bound, lineage, kind, traced32=traced32), frozenset(found)


def _all_integral(floating: list[Known], consts, value) -> bool:
    """Whether the operands are exact and integer-valued, and so are the constants and the result."""
    return (
        all(not np.any(known.bound) and _is_integral(known.value) for known in floating)
        and all(_is_integral(c) for c in consts if not isinstance(c, str))
        and _is_integral(value)
    )


def _in_range(value: np.ndarray, lineage: Lineage, limits: Limits) -> bool:
    """Finite in float32, and no overflow of half that the rules allow (an activation past
    `Limits.largest_activation`)."""
    if not np.all(np.isfinite(value)) or np.abs(value).max(initial=0.0) > 3.4e38:
        return False
    return lineage is not Lineage.ACTIVATION or np.abs(value).max(initial=0.0) <= limits.largest_activation


def _kind(op: Op, operands: list[Known]) -> str:
    if op.out == "same":
        return operands[0].kind
    if op.out == "broadcast":
        return "f" if any(known.kind == "f" for known in operands) else "r"
    return op.out


def _execute(statement: Statement, namespace: dict):
    """The statement run op by op in float32 (``jax.disable_jit``: each primitive compiles once per
    shape, where a new nested ``jit`` would compile every time)."""
    with jax.disable_jit():
        exec("\n".join(statement.source()), namespace)  # noqa: S102
    return namespace[statement.name]


def _candidates(known: dict[str, Known], kind: str) -> list[str]:
    """The values an operand of `kind` may be, newest first (hypothesis favours the first: chains)."""
    if kind == "x":
        names = [name for name, value in known.items() if value.kind in ("f", "r")]
    elif kind == "e":
        names = [name for name, value in known.items() if value.kind == "f" and not np.any(value.bound)]
    else:
        names = [name for name, value in known.items() if value.kind == kind]
    return names[::-1]


_CONSTANT_POOLS = {
    "c": CONSTANTS, "l": FILLS, "b": CLIP_BOUNDS, "i": INDEX_BOUNDS, "p": EPSILONS, "t": THRESHOLDS,
    "C": CLOSED_FILLS, "k": (-1, 0, 3),
}  # fmt: skip


class Builder:
    """Statements added one by one, each run in float32 as it is added (`evaluate`)."""

    def __init__(self, seed: int, dtype: Any, excluded: frozenset = frozenset()):
        self.seed = seed
        self.limits = Limits(np.dtype(dtype), frozenset(excluded))
        arguments = inputs(seed)
        self.namespace = closed_over()
        self.namespace.update({name: jnp.asarray(value) for name, value in arguments.items()})
        self.known = {
            name: Known(arguments[name].astype(np.float64), np.zeros(arguments[name].shape), lineage, kind)
            for name, lineage, kind in (
                ("w1", Lineage.FLOAT32, "w"), ("w2", Lineage.FLOAT32, "w"), ("keep", Lineage.ISLAND, "f"),
                ("pos", Lineage.FLOAT32, "f"), ("x", Lineage.FLOAT32, "f"),
            )
        }  # fmt: skip
        self.known["keep"].traced32 = True
        self.known["pad"] = Known(arguments["pad"], np.zeros(arguments["pad"].shape), Lineage.FLOAT32, "m")
        self.statements: list[Statement] = []
        self.features: set[str] = set()

    def add(self, statement: Statement) -> bool:
        """Adds `statement` unless `evaluate` drops it; whether it was added."""
        evaluated = evaluate(statement, self.namespace, self.known, self.limits, frozenset(self.features))
        if evaluated is None:
            return False
        self.known[statement.name], found = evaluated
        self.statements.append(statement)
        self.features |= found
        return True

    def returnable(self) -> list[str]:
        """The values made that the program may return (its masks are not)."""
        return [statement.name for statement in self.statements if self.known[statement.name].kind != "m"]

    def program(self, outputs: Sequence[str]) -> Program:
        return Program(
            self.seed,
            tuple(self.statements),
            tuple(outputs),
            reference={name: self.known[name].value for name in outputs},
            bounds={name: self.known[name].bound for name in outputs},
            features=frozenset(self.features),
        )


def build(seed: int, statements: Sequence[Statement], outputs: Sequence[str], dtype: Any) -> Program:
    """The program of `statements` (none may be dropped), with its reference and bounds."""
    builder = Builder(seed, dtype)
    for statement in statements:
        if not builder.add(statement):
            raise ValueError(f"the generator would drop {statement} (not finite, or half would overflow)")
    return builder.program(outputs)


@st.composite
def programs(draw, dtype: Any, excluded: frozenset = frozenset(), max_statements: int = 8) -> Program:
    """A program (with its reference, bounds and features) for autocast under `dtype`, without the
    features in `excluded`."""
    builder = Builder(draw(st.integers(0, 255)), dtype, excluded)
    for index in range(draw(st.integers(1, max_statements))):
        if index == 0 and not draw(st.booleans()):
            op = OPS_BY_NAME["matmul"]  # most programs start from an activation
        else:
            op = OPS_BY_NAME[draw(st.sampled_from(draw(st.sampled_from(GROUPS))))]
        operands = []
        for kind in op.operands:
            choices = _candidates(builder.known, kind)
            if not choices:
                break
            newest = builder.statements[-1].name if builder.statements else None
            floating = [builder.known[name] for name in operands if builder.known[name].kind in ("f", "r")]
            if newest in choices and kind in "xfe" and not floating and not draw(st.booleans()):
                operands.append(newest)  # a chain: the value just made, as often as any other
                continue
            if floating:  # a second operand: where lineages meet, first
                choices.sort(key=lambda name: builder.known[name].lineage is floating[0].lineage)
            operands.append(draw(st.sampled_from(choices)))
        else:
            consts = []
            for slot in op.consts:
                drawn = draw(st.sampled_from(_CONSTANT_POOLS[slot]))
                consts.extend(drawn if isinstance(drawn, tuple) else (drawn,))
            wrappers = _wrappers(op, builder.known, operands)
            wrapper = "plain" if not draw(st.booleans()) else draw(st.sampled_from(wrappers))
            if wrapper == "loop":
                consts.append(draw(st.sampled_from(_CONSTANT_POOLS[op.consts])))
            threshold = draw(st.sampled_from(THRESHOLDS)) if wrapper.startswith("cond") else 100.0
            name = f"v{index + 1}"
            builder.add(Statement(name, op.name, tuple(operands), tuple(consts), wrapper, threshold))
    made = builder.returnable()
    if not made:
        return draw(st.nothing())
    extra = draw(st.lists(st.sampled_from(made), max_size=2, unique=True))
    return builder.program(tuple(dict.fromkeys([*extra, made[-1]])))


def _wrappers(op: Op, known: dict[str, Known], operands: list[str]) -> tuple[str, ...]:
    """The wrappers a statement of `op` may take: a cond's other branch returns operand 0, so its
    result must be of operand 0's kind."""
    if op.kind == "mask":
        return ("plain",)
    wrappers = ["plain", "jit", "custom_jvp"]
    if op.consts and op.kind != "index":
        wrappers += ["jit_args", "custom_jvp_args"]
    wrappers.append("scope")
    floating = [known[name] for name in operands if name not in ("w1", "w2")]
    if len(op.operands) == 1 and op.consts in ("c", "l", "p") and _kind(op, floating) == floating[0].kind:
        wrappers.append("loop")
    if op.out != "o" and floating and floating[0].kind != "m" and _kind(op, floating) == floating[0].kind:
        wrappers += ["cond", "cond_scope"]
    return tuple(wrappers)


# --- the oracle --------------------------------------------------------------------------------


def _call(program: Program, *arguments):
    return program.function()(*arguments)


@functools.cache
def _autocast_call(policy: str) -> Callable[..., tuple]:
    """One autocast wrapper per policy, the program a static argument (applying autocast resolves
    its rules tables, which costs more than a small program's rewrite)."""
    return jaxamp.autocast(_call, policy, float32_argnums=1 + ARGUMENTS.index("keep"))


def run_autocast(program: Program, policy: str) -> tuple:
    """The program's outputs under ``jaxamp.autocast(program, policy)``, `keep` kept in float32,
    compiled as one program (its nested ``jit`` calls inlined, so one compilation)."""
    arguments = [jnp.asarray(value) for value in inputs(program.seed).values()]
    return jax.jit(lambda *arguments: _autocast_call(policy)(program, *arguments))(*arguments)


def run_float32(program: Program) -> tuple:
    """The program's outputs in float32, compiled as one program as `run_autocast` compiles it."""
    arguments = [jnp.asarray(value) for value in inputs(program.seed).values()]
    return jax.jit(program.function())(*arguments)


def mismatches(program: Program, outputs: Sequence[Any]) -> list[str]:
    """Each output of autocast's run that breaks the oracle: not finite where float32 is, or farther
    from the float32 reference than its bound; one line per output, naming its worst element.

    Float32 is finite where the reference (run op by op as the program was drawn) is and so is the
    program compiled in float32 (`run_float32`, run only where autocast is not finite): XLA may
    contract a product into a subtraction there (``x * 1e9 - max(x * 1e9)``), whose one rounding
    less can take an ``exp`` past float32's range."""
    values = [np.asarray(output, np.float64) for output in outputs]
    compiled = None
    if any(not np.all(np.isfinite(value)) for value in values):
        compiled = [np.asarray(output, np.float64) for output in run_float32(program)]
    found = []
    for index, (name, got) in enumerate(zip(program.outputs, values, strict=True)):
        reference, bound = program.reference[name], program.bounds[name]
        if got.shape != reference.shape:
            found.append(f"{name}: shape {got.shape}, float32 gives {reference.shape}")
            continue
        finite = np.isfinite(got)
        with np.errstate(invalid="ignore"):
            excess = np.where(finite, np.abs(got - reference) - bound, np.inf)
        broken = excess > 0 if compiled is None else np.where(finite, excess > 0, np.isfinite(compiled[index]))
        if np.any(broken):
            worst = np.unravel_index(np.argmax(np.where(broken, excess, -np.inf)), excess.shape)
            found.append(
                f"{name}{list(worst)}: autocast {got[worst]!r}, float32 {reference[worst]!r}, "
                f"bound {bound[worst]:.3g} ({int(np.sum(broken))} of {broken.size} elements)"
            )
    return found
