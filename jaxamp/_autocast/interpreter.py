"""The jaxpr interpreter at the heart of `jaxamp.autocast`.

A function is traced to a jaxpr once, its floating arguments in the compute
dtype (`jaxamp._autocast.transform.trace_dtypes`), and the jaxpr is
evaluated again equation by equation on the arguments as the caller gave
them: each equation's rule
(`jaxamp._autocast.rules` for first-order primitives,
`jaxamp._autocast.higher_order` for those carrying jaxprs) sees the current
input values, whose dtypes may differ from the traced ones, and decides
which dtypes the primitive runs in. Tracing that evaluation gives the
rewritten jaxpr, which `RewriteCache` keeps per input shapes and dtypes.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import dataclasses
import warnings
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal, Primitive, jaxpr_as_fun

from jaxamp._autocast.context import Rewrite, Rule, RulesFor, carries_jaxpr
from jaxamp._autocast.recorder import (
    INLINED_CALLS,
    SITE_PRIMITIVES,
    Recorder,
    active_recorder,
    count_sites,
    differentiated_leaves,
    recording,
)
from jaxamp._autocast.reduction_inputs import reduction_inputs
from jaxamp._autocast.rules import cast, float32_rule, follow, follow_rule, is_floating, restore_rule
from jaxamp._autocast.scope import canonical_name_stack, equation_context, inside_extent, scope_policies
from jaxamp._scaling.overflow import PROBE_SLOTS, OverflowRecord, OverflowSession, no_session
from jaxamp.fp8._sites import SLOTS as FP8_SLOTS
from jaxamp.fp8._sites import Fp8Sites, current_fp8_sites, fp8_sites

# While a higher-order equation's rule runs: the policy scopes in which each
# output of each body it evaluates was made (one tuple per body), so that the
# equation's outputs leave those scopes where an equation outside reads them.
_BODY_OUTPUT_SCOPES: contextvars.ContextVar[list | None] = contextvars.ContextVar(
    "jaxamp_body_output_scopes", default=None
)


@contextlib.contextmanager
def _collecting_body_scopes(reports: list | None):
    token = _BODY_OUTPUT_SCOPES.set(reports)
    try:
        yield reports
    finally:
        _BODY_OUTPUT_SCOPES.reset(token)


def interpret(context: Rewrite, jaxpr: Jaxpr, consts: Sequence[Any], args: Sequence[Any]) -> list:
    """Evaluates `jaxpr` on `args`, each equation through its rule.

    Literals are read as NumPy values of their traced dtype, so a rule can
    cast them without creating a traced constant. Equations that feed only
    float32 reductions run in float32
    (`jaxamp._autocast.reduction_inputs`). For the follow rule
    (`jaxamp._autocast.rules.follow`) it keeps two tables: the literal
    each broadcast of a literal holds (weak, as the literal is), and the
    unrounded result of each broadcasting op that rounded its result to
    its full-size operands' half dtype, for the next such op to compute
    from, so a normalization's ``(h - mean) * inv + bias`` is rounded once,
    and for float32 ops to read (the square of ``h - mean`` in a variance
    is that of the float32 difference, as before the rounding). It also
    follows the statistics (`_derives_a_statistic`), which a cast to the
    half compute dtype leaves in float32 (`_keeps_a_statistic_float32`).

    Each equation runs under the rewrite of its innermost policy scope
    (`Rewrite.scoped`). A floating value made inside a policy scope is cast
    to the scope's exit dtype where an equation outside that scope reads it
    (scope by scope, innermost first); the jaxpr's outputs and the
    equations inside the scope read it as it was made. A body's outputs
    carry the scopes they were made in out to the equation that holds the
    body (a block that ends in a normalization, under ``jax.checkpoint``),
    whose outputs then leave those scopes in the same way.

    In a recording rewrite (`jaxamp._autocast.recorder`), each matmul
    and convolution is a site: its operands are tapped for the backward
    pass and its output's amax recorded; bodies other than nested ``jit``
    calls (which the jit rule inlines) are rewritten without recording.
    Under FP8 delayed scaling (`jaxamp.fp8._sites`) the same bodies run
    without it: their FP8 matmuls use current scaling.
    """
    recorder = active_recorder()
    env: dict[Any, Any] = {}

    def read(atom):
        if isinstance(atom, Literal):
            return np.asarray(atom.val, dtype=atom.aval.dtype)
        return env[atom]

    for variable, value in zip(jaxpr.constvars, consts, strict=True):
        env[variable] = value
    for variable, value in zip(jaxpr.invars, args, strict=True):
        env[variable] = value
    widened = reduction_inputs(context, jaxpr)
    unrounded: dict[Any, Any] = {}
    fills: dict[Any, Literal] = {}
    exits: dict[Any, tuple] = {}  # variable -> the policy scopes it was made in
    statistics: set = set()
    constants: set = set()
    for equation in jaxpr.eqns:
        scoped = context.scoped(equation)
        invals = [read(atom) for atom in equation.invars]
        if _derives_a_statistic(equation, statistics, constants):
            statistics.update(equation.outvars)
        with equation_context(equation):
            if exits:
                invals = _leave_scopes(equation, invals, exits)
            site = recorder is not None and equation.primitive.name in SITE_PRIMITIVES
            if site:
                invals = recorder.tap_operands(invals)
            rule = float32_rule if id(equation) in widened else scoped.rule_for(equation)
            body_scopes: list | None = None
            if _keeps_a_statistic_float32(scoped, equation, invals, statistics):
                outvals = invals
            elif rule is follow_rule:
                variables = [None if isinstance(atom, Literal) else atom for atom in equation.invars]
                outvals, wide = follow(
                    scoped,
                    equation,
                    invals,
                    [unrounded.get(variable) for variable in variables],
                    [fills.get(variable) for variable in variables],
                )
                if wide is not None:
                    unrounded.update(zip(equation.outvars, wide))
                if _is_fill(equation):
                    fills[equation.outvars[0]] = equation.invars[0]
            else:
                if rule is float32_rule:
                    invals = [
                        value if isinstance(atom, Literal) else unrounded.get(atom, value)
                        for atom, value in zip(equation.invars, invals)
                    ]
                elif carries_jaxpr(equation):
                    body_scopes = []
                with (
                    _collecting_body_scopes(body_scopes),
                    _recording_in_body(recorder, equation),
                    _fp8_sites_in_body(equation),
                ):
                    outvals = rule(scoped, equation, invals)
            if site:
                outvals = [recorder.record(equation, outvals[0]), *outvals[1:]]
        for variable, value in zip(equation.outvars, outvals, strict=True):
            env[variable] = value
        scopes = scope_policies(equation)
        if body_scopes:
            for variable, inner in zip(equation.outvars, _scopes_of_outputs(equation, body_scopes)):
                if scopes or inner:
                    exits[variable] = scopes + inner
        elif scopes:
            exits.update((variable, scopes) for variable in equation.outvars)
    reports = _BODY_OUTPUT_SCOPES.get()
    if reports is not None:
        reports.append(
            tuple(() if isinstance(atom, Literal) else exits.get(atom, ()) for atom in jaxpr.outvars)
        )
    return [read(atom) for atom in jaxpr.outvars]


def _recording_in_body(recorder: Recorder | None, equation) -> contextlib.AbstractContextManager:
    """No recording inside the bodies of `equation` unless it is a nested call the jit rule inlines."""
    if recorder is None or equation.primitive.name in INLINED_CALLS or not carries_jaxpr(equation):
        return contextlib.nullcontext()
    return recording(None)


def _fp8_sites_in_body(equation) -> contextlib.AbstractContextManager:
    """No FP8 delayed scaling inside the bodies of `equation` unless it is a nested call the jit
    rule inlines: a body's amaxes cannot leave it."""
    if current_fp8_sites() is None or equation.primitive.name in INLINED_CALLS or not carries_jaxpr(equation):
        return contextlib.nullcontext()
    return fp8_sites(None)


_STATISTICS = frozenset(("reduce_sum", "reduce_prod", "reduce_max", "reduce_min"))


def _derives_a_statistic(equation, statistics: set, constants: set) -> bool:
    """Whether `equation` gives a statistic: a reduction, or a first-order op of statistics.

    ``mean(h * h)`` and its ``rsqrt(... + eps)``, a variance, a loss's mean
    are statistics; ``x - mean`` (an activation read) and a matmul are not.
    Constants (made of literals and integers alone: a count, ``ddof``) join
    a statistic without changing what it is; `constants` collects them.
    """
    floating_outputs = all(is_floating(variable.aval.dtype) for variable in equation.outvars)
    if equation.primitive.name in _STATISTICS:
        return floating_outputs
    if carries_jaxpr(equation) or equation.primitive.name in ("dot_general", "conv_general_dilated"):
        return False
    operands = [
        atom
        for atom in equation.invars
        if not isinstance(atom, Literal) and is_floating(atom.aval.dtype) and atom not in constants
    ]
    if not operands:
        constants.update(equation.outvars)
        return False
    return floating_outputs and all(atom in statistics for atom in operands)


def _keeps_a_statistic_float32(context: Rewrite, equation, invals: Sequence[Any], statistics: set) -> bool:
    """Whether `equation` is a cast of a float32 statistic to the half compute dtype, which is skipped.

    Traced in the compute dtype, a program computes its statistics in
    float32 only where it upcasts them itself, and rounds them back:
    ``jnp.mean`` of a half value does. Kept in float32, a mean of squares
    past 65504 stays finite under float16 and a loss keeps its digits, as
    the float32 reductions of a float32 program do; the value is rounded
    where an operation that runs in half reads it.
    """
    if equation.primitive.name != "convert_element_type" or equation.invars[0] not in statistics:
        return False
    (value,) = invals
    new_dtype = equation.params["new_dtype"]
    return (
        new_dtype == context.compute_dtype
        and jnp.finfo(new_dtype).bits < 32
        and is_floating(value.dtype)
        and jnp.finfo(value.dtype).bits > jnp.finfo(new_dtype).bits
    )


def _scopes_of_outputs(equation, body_scopes: list[tuple]) -> list[tuple]:
    """Per output of `equation`, the policy scopes its bodies made it in, as extents of this jaxpr.

    Only the bodies with one output per output of the equation count (a
    ``scan`` body's carries and stacked outputs, a ``cond`` branch; not a
    ``while`` loop's predicate or a custom rule's tangents). A body's
    extents are relative to the equation's own name stack, which prefixes
    them here.
    """
    prefix = canonical_name_stack(str(equation.source_info.name_stack))
    per_output: list[tuple] = [() for _ in equation.outvars]
    for report in body_scopes:
        if len(report) != len(equation.outvars):
            continue
        for index, scopes in enumerate(report):
            composed = tuple((f"{prefix}/{extent}" if prefix else extent, scope) for extent, scope in scopes)
            per_output[index] += tuple(scope for scope in composed if scope not in per_output[index])
    return per_output


def _leave_scopes(equation, invals: list, exits: dict[Any, tuple]) -> list:
    """`equation`'s inputs, each cast to the exit dtype of the policy scopes it leaves."""
    name_stack = str(equation.source_info.name_stack)
    leaving = []
    for atom, value in zip(equation.invars, invals):
        scopes = () if isinstance(atom, Literal) else exits.get(atom, ())
        for extent, scope in reversed(scopes):
            if inside_extent(name_stack, extent):
                break
            if is_floating(value.dtype) and value.dtype != scope.exit_dtype:
                value = cast(value, scope.exit_dtype)
        leaving.append(value)
    return leaving


def _is_fill(equation) -> bool:
    """Whether `equation` broadcasts a floating literal to a shape (``jnp.full``, ``zeros_like``)."""
    return (
        equation.primitive.name == "broadcast_in_dim"
        and len(equation.invars) == 1
        and isinstance(equation.invars[0], Literal)
        and jnp.issubdtype(equation.invars[0].aval.dtype, jnp.floating)
    )


def _manual_axes(aval: Any) -> tuple:
    """Over which mesh axes a value inside ``shard_map`` varies (or is reduced); () outside."""
    axes = getattr(aval, "manual_axis_type", None)
    if axes is None:
        return ()
    kinds = ("varying", "unreduced", "reduced")
    return tuple(tuple(sorted(map(str, getattr(axes, kind, ())))) for kind in kinds)


def abstract(value: Any, *, drop_leading_axis: bool = False) -> Any:
    """The shape and dtype of `value` (of one slice along axis 0 if asked).

    Inside ``shard_map`` a value's type also says over which mesh axes it
    varies (``jax.typeof(x).manual_axis_type``); a body traced without it
    would miss the ``pvary`` that JAX inserts where a replicated operand
    meets a per-device one, so such a value keeps its full type.
    """
    if isinstance(value, jax.core.Tracer):  # only a traced value can vary over mesh axes
        aval = jax.typeof(value)
        if any(_manual_axes(aval)):
            return aval.update(shape=aval.shape[1:]) if drop_leading_axis else aval
    shape = np.shape(value)[1:] if drop_leading_axis else np.shape(value)
    return jax.ShapeDtypeStruct(shape, value.dtype)


def with_dtype(aval: Any, dtype: Any) -> Any:
    """`aval` (a ``ShapeDtypeStruct``, or a value's type inside ``shard_map``) with `dtype`."""
    if isinstance(aval, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(aval.shape, dtype)
    return aval.update(dtype=dtype)


def _aval_key(aval: Any) -> tuple:
    return (tuple(aval.shape), str(aval.dtype), _manual_axes(aval))


def rewrite_jaxpr(
    context: Rewrite,
    closed: ClosedJaxpr,
    in_avals: Sequence[jax.ShapeDtypeStruct],
    out_dtypes: Sequence[Any] | None = None,
) -> ClosedJaxpr:
    """`closed` evaluated under the rules, traced for inputs of `in_avals`.

    Args:
        context: the rewrite.
        closed: the traced jaxpr.
        in_avals: shapes and current dtypes of its inputs.
        out_dtypes: per output, the dtype to cast it to, or None to keep the
            dtype the rules gave it (``None`` for all: keep every one).
    """
    pins = (
        None if out_dtypes is None else tuple(None if dtype is None else str(dtype) for dtype in out_dtypes)
    )
    key = (closed, tuple(_aval_key(aval) for aval in in_avals), pins)
    if key not in context.memo:

        def evaluate(*args):
            outvals = interpret(context, closed.jaxpr, closed.consts, args)
            if out_dtypes is None:
                return outvals
            return [
                value if dtype is None else cast(value, dtype) for value, dtype in zip(outvals, out_dtypes)
            ]

        with _collecting_body_scopes([]) as reports:
            rewritten = jax.make_jaxpr(evaluate)(*in_avals)
        # The body's own report only: the bodies inside it reported to their
        # own equations.
        context.memo[key] = (rewritten, tuple(reports))
    rewritten, reports = context.memo[key]
    outer = _BODY_OUTPUT_SCOPES.get()
    if outer is not None:
        outer.extend(reports)
    return rewritten


# From JAX 0.12 a Jaxpr holds its constants and ClosedJaxpr is another name for it.
_JAXPR_HOLDS_CONSTS = ClosedJaxpr is Jaxpr


def lift_consts(closed: ClosedJaxpr) -> tuple[Jaxpr, list]:
    """`closed` as a jaxpr without constants, which become its leading inputs.

    For primitives whose body must be constant-free (``remat``, ``scan``,
    ``while``): the constants are passed as extra leading operands.
    """
    jaxpr = closed.jaxpr
    if not jaxpr.constvars:
        return jaxpr, []
    # The debug info stays: JAX drops its argument names, which no longer fit.
    updates = {"constvars": [], "invars": [*jaxpr.constvars, *jaxpr.invars]}
    if _JAXPR_HOLDS_CONSTS:
        updates["consts"] = []
    return jaxpr.replace(**updates), list(closed.consts)


@dataclasses.dataclass(frozen=True)
class _Entry:
    rewritten: ClosedJaxpr
    out_tree: Any
    # Outputs that were no arrays when traced (a Python int, None, a string),
    # by position among the output leaves, returned as they were.
    static_outputs: tuple[tuple[int, Any], ...] = ()
    # A recording rewrite's sites, its probe's rows and the matmuls it does not watch.
    sites: tuple = ()
    sites_size: int = 0
    unrecorded: int = 0
    # Under FP8 delayed scaling: the rows of amaxes and probe it takes (`jaxamp.fp8._sites`).
    fp8_rows: int = 0


def _is_traced_array(leaf: Any) -> bool:
    return isinstance(leaf, (jax.Array, np.ndarray, np.generic))


class HalfTraceRefusedWarning(UserWarning):
    """A function refused its arguments in the compute dtype, so `jaxamp.autocast` traced it as given."""


def _trace(fun: Callable[..., Any], trace_avals: Sequence[Any], avals: Sequence[Any]) -> ClosedJaxpr:
    """`fun` traced for `trace_avals`, or for `avals` (the arguments as given) if it refuses them.

    Some functions refuse half-precision inputs while traced (on JAX 0.12
    ``jnp.linalg.solve``'s LU decomposition refuses float16). They are
    traced as given instead, with a warning that names the error and the
    way to say so (``float32_argnums``); if that fails too, the first
    error is raised.
    """
    try:
        return jax.make_jaxpr(fun)(*trace_avals)
    except (TypeError, ValueError, NotImplementedError) as error:
        if all(traced.dtype == given.dtype for traced, given in zip(trace_avals, avals)):
            raise
        try:
            traced = jax.make_jaxpr(fun)(*avals)
        except Exception:  # noqa: BLE001 (the half trace's error is the one to report)
            raise error from None
        first_line = str(error).splitlines()[0][:200] if str(error) else type(error).__name__
        warnings.warn(
            f"jaxamp.autocast traced this function with its arguments as given, since traced in the "
            f"compute dtype it raised {type(error).__name__}: {first_line} Kernels and dtype checks in it "
            "see float32. To trace those arguments as given without this warning, pass "
            "float32_argnums (or float32_argnames) to autocast.",
            HalfTraceRefusedWarning,
            stacklevel=5,
        )
        return traced


class RewriteCache:
    """Traces, rewrites and evaluates functions, keeping each rewrite for reuse.

    `call` traces ``fun(*leaves)`` for the leaves' shapes and dtypes, rewrites
    the jaxpr (outputs cast back to the dtypes `fun` returns) and evaluates
    it; outputs that were no arrays when traced (a Python number, None) are
    returned as they were. The rewritten jaxpr is kept per (`static_key`, shapes, dtypes), so a
    second call with the same signature neither traces nor rewrites again,
    and the jitted parts inside it (the same jaxpr objects) hit JAX's compile
    cache. A trace that closed over another transformation's tracers is not
    kept: those tracers die with that transformation.
    """

    def __init__(
        self,
        compute_dtype: np.dtype,
        rules: Mapping[Primitive, Rule],
        max_entries: int = 64,
        *,
        rules_for: RulesFor | None = None,
        fp8_matmuls: bool = False,
    ):
        self._compute_dtype = compute_dtype
        self._rules = rules
        self._rules_for = rules_for
        self._fp8_matmuls = fp8_matmuls
        self._max_entries = max_entries
        self._entries: collections.OrderedDict = collections.OrderedDict()
        self.traces = 0

    def call(
        self,
        fun: Callable[..., Any],
        leaves: Sequence[Any],
        static_key: Hashable | None,
        *,
        trace_dtypes: Sequence[Any] | None = None,
        output_dtypes: Callable[[Any], Sequence[Any]] | None = None,
        session: OverflowSession | None = None,
    ) -> Any:
        """``fun(*leaves)`` with dtypes changed per primitive.

        Args:
            fun: a function of array leaves returning a pytree of arrays.
            leaves: the arrays.
            static_key: everything besides the leaves' shapes and dtypes that
                decides what `fun` traces to, hashable; ``None`` to trace
                every call.
            trace_dtypes: per leaf, the dtype `fun` is traced with, or None
                for the leaf's own (all its own if omitted). The rewritten
                program still takes the leaves as they are: the rules see
                their values, whatever dtype they were traced with.
            output_dtypes: called while tracing on `fun`'s outputs; per array
                leaf of them (in ``jax.tree.flatten`` order), the dtype it is
                returned in, or None for the dtype it was traced with (the
                default for every output).
            session: an overflow session (`jaxamp._autocast.recorder`):
                the rewrite records its sites, takes its probe rows from the
                session and adds its `OverflowRecord` to it.
        """
        avals = [abstract(leaf) for leaf in leaves]
        if trace_dtypes is None:
            trace_dtypes = (None,) * len(leaves)
        trace_key = tuple(None if dtype is None else str(dtype) for dtype in trace_dtypes)
        differentiated = None if session is None else differentiated_leaves(leaves)
        sites = current_fp8_sites()
        scaling = None if sites is None else ("current" if sites.current_scaling else "delayed")
        if scaling is not None and differentiated is not None:
            raise NotImplementedError(
                "jaxamp.autocast cannot record overflows (record_overflow) and run FP8 delayed scaling "
                "(jaxamp.fp8.delayed_scaling) in one call; record the overflows in a run without delayed scaling."
            )
        key = (
            None
            if static_key is None
            else (static_key, tuple(_aval_key(aval) for aval in avals), trace_key, differentiated, scaling)
        )
        try:
            entry = None if key is None else self._entries.get(key)
        except TypeError:  # an unhashable static argument
            key, entry = None, None
        if entry is None:
            trace_avals = [
                aval if dtype is None else with_dtype(aval, dtype) for aval, dtype in zip(avals, trace_dtypes)
            ]
            entry, cacheable = self._build(fun, avals, trace_avals, output_dtypes, differentiated, scaling)
            if key is not None and cacheable:
                self._entries[key] = entry
                if len(self._entries) > self._max_entries:
                    self._entries.popitem(last=False)
        else:
            self._entries.move_to_end(key)
        if differentiated is not None:
            probe = session.take(entry.sites_size)
            *results, forward_amax = jaxpr_as_fun(entry.rewritten)(probe, *leaves)
            session.records.append(
                OverflowRecord(forward_amax, jnp.zeros_like(forward_amax), entry.sites, entry.unrecorded)
            )
            outvals = iter(results)
        elif scaling is not None:
            amax, probe = sites.take(entry.fp8_rows)
            amax = jnp.zeros_like(probe) if amax is None else amax
            outvals = iter(jaxpr_as_fun(entry.rewritten)(amax, probe, *leaves))
        else:
            outvals = iter(jaxpr_as_fun(entry.rewritten)(*leaves))
        statics = dict(entry.static_outputs)
        num_outputs = entry.out_tree.num_leaves
        return jax.tree.unflatten(
            entry.out_tree,
            [statics[index] if index in statics else next(outvals) for index in range(num_outputs)],
        )

    def _build(
        self,
        fun,
        avals,
        trace_avals,
        output_dtypes,
        differentiated: tuple[bool, ...] | None,
        scaling: str | None = None,
    ) -> tuple[_Entry, bool]:
        self.traces += 1
        out_tree, static_outputs, pinned = None, [], []

        def array_outputs(*leaves):
            nonlocal out_tree
            outputs = fun(*leaves)
            flat, out_tree = jax.tree.flatten(outputs)
            static_outputs[:] = [(i, leaf) for i, leaf in enumerate(flat) if not _is_traced_array(leaf)]
            arrays = [leaf for leaf in flat if _is_traced_array(leaf)]
            pinned[:] = [None] * len(arrays) if output_dtypes is None else list(output_dtypes(outputs))
            return arrays

        # A rewrite of its own, even when started inside another's rule (a
        # custom derivative's): its outputs report to no enclosing equation.
        # Nor does it record for an overflow session: autocast calls traced
        # inside this one are part of this rewrite.
        with _collecting_body_scopes(None), no_session(), recording(None), fp8_sites(None):
            traced = _trace(array_outputs, trace_avals, avals)
            context = Rewrite(
                self._compute_dtype,
                self._rules,
                as_traced=restore_rule,
                rules_for=self._rules_for,
                fp8_matmuls=self._fp8_matmuls,
            )
            out_dtypes = [
                aval.dtype if dtype is None else dtype
                for aval, dtype in zip(traced.out_avals, pinned, strict=True)
            ]
            if differentiated is not None:
                return self._build_recording(
                    context, traced, avals, out_dtypes, out_tree, static_outputs, differentiated
                )
            if scaling is not None:
                return self._build_delayed(
                    context, traced, avals, out_dtypes, out_tree, static_outputs, scaling
                )
            rewritten = rewrite_jaxpr(context, traced, avals, out_dtypes)
        cacheable = not any(isinstance(const, jax.core.Tracer) for const in traced.consts)
        return _Entry(rewritten, out_tree, tuple(static_outputs)), cacheable

    def _build_delayed(
        self, context, traced, avals, out_dtypes, out_tree, static_outputs, scaling: str
    ) -> tuple[_Entry, bool]:
        """The rewrite of `traced` under FP8 delayed scaling: inputs ``(amax, probe, *leaves)``,
        one row of each per matmul and convolution it could run in FP8 (`jaxamp.fp8._sites`);
        the ``amax`` input is unused under current scaling (``scaling == "current"``)."""
        rows, _ = count_sites(traced.jaxpr)

        def evaluate(amax, probe, *args):
            with fp8_sites(Fp8Sites(None if scaling == "current" else amax, probe)):
                outvals = interpret(context, traced.jaxpr, traced.consts, args)
            return [cast(value, dtype) for value, dtype in zip(outvals, out_dtypes, strict=True)]

        rows_aval = jax.ShapeDtypeStruct((rows, FP8_SLOTS), jnp.float32)
        rewritten = jax.make_jaxpr(evaluate)(rows_aval, rows_aval, *avals)
        entry = _Entry(rewritten, out_tree, tuple(static_outputs), fp8_rows=rows)
        return entry, not any(isinstance(const, jax.core.Tracer) for const in traced.consts)

    def _build_recording(
        self, context, traced, avals, out_dtypes, out_tree, static_outputs, differentiated
    ) -> tuple[_Entry, bool]:
        """The rewrite of `traced` with its sites recorded: inputs ``(probe, *leaves)``, outputs
        ``(*outputs, forward_amax)`` (`jaxamp._autocast.recorder`); the leaves nobody
        differentiates are not tapped."""
        sites_size, unrecorded = count_sites(traced.jaxpr)
        recorded: list = []

        def evaluate(probe, *args):
            recorder = Recorder(
                probe, [arg for arg, grad in zip(args, differentiated, strict=True) if not grad]
            )
            with recording(recorder):
                outvals = interpret(context, traced.jaxpr, traced.consts, args)
            recorded[:] = recorder.sites
            outvals = [cast(value, dtype) for value, dtype in zip(outvals, out_dtypes, strict=True)]
            return [*outvals, recorder.forward_amax()]

        probe_aval = jax.ShapeDtypeStruct((sites_size, PROBE_SLOTS), jnp.float32)
        rewritten = jax.make_jaxpr(evaluate)(probe_aval, *avals)
        entry = _Entry(
            rewritten,
            out_tree,
            tuple(static_outputs),
            sites=tuple(recorded),
            sites_size=sites_size,
            unrecorded=unrecorded,
        )
        return entry, not any(isinstance(const, jax.core.Tracer) for const in traced.consts)
