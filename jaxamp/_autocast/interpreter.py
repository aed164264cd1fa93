"""The jaxpr interpreter at the heart of `jaxamp.autocast`.

A function is traced to a jaxpr once, its floating arguments in the compute
dtype (`jaxamp._autocast.transform.trace_dtypes`), and a second time with
its arguments as given, whose literals replace those the half trace rounded
(`jaxamp._autocast.reference`). The half jaxpr is then evaluated again
equation by equation on the arguments as the caller gave them: each
equation's rule (`rules` for first-order primitives, `higher_order` for
those carrying jaxprs) sees the current input values, whose dtypes may
differ from the traced ones, and the lineage of each (`lineage`), and
decides which dtypes the primitive runs in. Tracing that evaluation gives
the rewritten jaxpr, which `RewriteCache` keeps per input shapes and dtypes.
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

from jaxamp._autocast.context import Rewrite, Rule, RulesFor, carries_jaxpr, cast, is_floating
from jaxamp._autocast.lineage import (
    ACTIVATION,
    ISLAND,
    STATISTIC,
    Kind,
    Lineage,
    after_convert,
    after_float32,
    cast_constant,
    constant,
    follow,
    join,
    cast_by_the_half_trace,
    keeps_a_statistic,
    of_input,
    reduction_inputs,
    wider,
)
from jaxamp._autocast.reference import Recovered, recovered
from jaxamp._autocast.rules import float32_rule, restore_rule
from jaxamp._autocast.scope import (
    canonical_name_stack,
    equation_context,
    in_float32_scope,
    inside_extent,
    scope_policies,
)
from jaxamp._autocast.sites import INLINED_CALLS, SITE_PRIMITIVES, Naming, count_sites
from jaxamp._probe import SLOTS, Client, Hooks, open_client, opened


@dataclasses.dataclass(frozen=True)
class BodyReport:
    """What an evaluated body tells the equation that holds it, per output: the policy scopes it
    was made in (so it leaves them where an equation outside reads it) and its lineage."""

    scopes: tuple
    lineages: tuple


# While a higher-order equation's rule runs: the reports of the bodies it evaluates.
_BODY_REPORTS: contextvars.ContextVar[list | None] = contextvars.ContextVar("jaxamp_body_reports", default=None)
# While a rule runs: the lineages of its equation's operands (`operand_lineages`).
_OPERANDS: contextvars.ContextVar[tuple] = contextvars.ContextVar("jaxamp_operands", default=())


@dataclasses.dataclass(frozen=True)
class _Sites:
    """The client whose rows a rewrite takes, its hooks and the naming of its sites (`jaxamp._probe`)."""

    client: Client
    hooks: Hooks
    naming: Naming


# While a rewrite with a probe's client is traced (None in the bodies that keep their amaxes).
_SITES: contextvars.ContextVar[_Sites | None] = contextvars.ContextVar("jaxamp_sites", default=None)


@contextlib.contextmanager
def _set(variable: contextvars.ContextVar, value: Any):
    token = variable.set(value)
    try:
        yield value
    finally:
        variable.reset(token)


def inlining() -> Naming | None:
    """Where a rewrite with a probe's client is traced: the naming of its sites (the jit rule
    inlines nested calls there, so their sites are watched); else None."""
    sites = _SITES.get()
    return None if sites is None else sites.naming


def operand_lineages() -> tuple:
    """The lineages of the operands of the equation whose rule runs now (for the bodies it rewrites)."""
    return _OPERANDS.get()


def _in_island(equation) -> bool:
    """Whether `equation` lies in a float32 island: `float32_scope`, or a policy scope that computes
    and hands its values on in float32 (a layer class overridden to float32)."""
    if in_float32_scope(equation):
        return True
    scopes = scope_policies(equation)
    return bool(scopes) and scopes[-1][1].compute_dtype == np.float32 and scopes[-1][1].exit_dtype == np.float32


def _lineages_after(context: Rewrite, role: str | None, equation, lineages: list, reports: list | None) -> list:
    """The lineage of each output of an equation that no `follow` ran."""
    count = len(equation.outvars)
    if role in ("float32", "widened"):
        return [after_float32(equation, lineages)] * count
    if role == "convert":
        new_dtype, from_dtype = equation.params["new_dtype"], equation.invars[0].aval.dtype
        return [after_convert(lineages[0], new_dtype, from_dtype, context.compute_dtype)]
    if role == "pass_through":
        return list(lineages[:count])
    if reports:
        matching = [report.lineages for report in reports if len(report.lineages) == count]
        if matching:
            return [join(per_output) for per_output in zip(*matching)]
    return [ACTIVATION] * count


def interpret(
    context: Rewrite,
    jaxpr: Jaxpr,
    consts: Sequence[Any],
    args: Sequence[Any],
    lineages: Sequence[Lineage | None] | None = None,
    unrounded_outputs: list | None = None,
) -> list:
    """Evaluates `jaxpr` on `args`, each equation through its rule, each value with its lineage.

    Literals are read as the program wrote them (`Rewrite.literal`), as NumPy
    values, so a rule can cast them without creating a traced constant.
    An argument's lineage is given (a body's, by the equation that holds it)
    or read from its dtype against its traced one (`lineage.of_input`);
    constants are CONSTANT. Per equation:

    ```text
    rule = float32 if the equation feeds only a float32 reduction (lineage.reduction_inputs)
           else the rule of its innermost policy scope (Rewrite.scoped)
    follow ops:  lineage.follow (computes, rounds once per chain, gives the result's lineage)
    the half trace's cast of a statistic back to half: skipped (lineage.keeps_a_statistic)
    in a float32 island, a cast to half the program did not write: skipped (lineage.cast_by_the_half_trace)
    JAX's cast of a Python number (weakly typed): read as written (lineage.cast_constant)
    float32 ops read a rounded chain's unrounded value
    other ops:   the rule; outputs' lineages from its role or, for a body, from the body's report
    in a float32 island (_in_island): every floating output is ISLAND
    ```

    A floating value made inside a policy scope is cast to the scope's exit
    dtype where an equation outside that scope reads it (scope by scope,
    innermost first); the jaxpr's outputs and the equations inside the
    scope read it as it was made. A body reports its outputs' scopes and
    lineages to the equation that holds it (`BodyReport`), whose outputs
    then leave those scopes and take those lineages.

    Where a probe's client is open (`jaxamp._probe`: the overflow record,
    FP8 delayed scaling), each matmul and convolution is a site
    (`jaxamp._autocast.sites`), and the client's hooks tap it where they
    tap; bodies other than nested ``jit`` calls (which the jit rule inlines)
    are rewritten with the client closed.
    """
    sites = _SITES.get()
    env: dict[Any, Any] = {}
    lineage: dict[Any, Lineage] = {}
    for variable, value in zip(jaxpr.constvars, consts, strict=True):
        env[variable], lineage[variable] = value, constant(value)
    given = [None] * len(args) if lineages is None else lineages
    for variable, value, known in zip(jaxpr.invars, args, given, strict=True):
        env[variable] = value
        lineage[variable] = known or of_input(value, variable.aval.dtype, context.compute_dtype)
    widened = reduction_inputs(context, jaxpr)
    islands = wider(np.float32, context.compute_dtype)  # float32 stands out only where the compute is half
    unrounded: dict[Any, Any] = {}
    exits: dict[Any, tuple] = {}  # variable -> the policy scopes it was made in
    for equation in jaxpr.eqns:
        scoped = context.scoped(equation)
        invals, in_lineages = [], []
        for position, atom in enumerate(equation.invars):
            if isinstance(atom, Literal):
                invals.append(value := context.literal(equation, position))
                in_lineages.append(constant(value))
            else:
                invals.append(env[atom])
                in_lineages.append(lineage.get(atom, ACTIVATION))
        with equation_context(equation):
            if exits:
                invals, in_lineages = _leave_scopes(equation, invals, in_lineages, exits)
            site = sites is not None and sites.hooks.taps and equation.primitive.name in SITE_PRIMITIVES
            if site:
                invals = sites.hooks.tap_operands(invals)
            rule = float32_rule if id(equation) in widened else scoped.rule_for(equation)
            role = getattr(rule, "role", None)
            reports: list | None = None
            if role == "convert" and keeps_a_statistic(scoped, equation, invals[0], in_lineages[0]):
                outvals, out_lineages = invals, [STATISTIC]
            elif role == "convert" and cast_by_the_half_trace(scoped, equation, invals[0]):
                outvals, out_lineages = invals, in_lineages[:1]
            elif role == "convert" and in_lineages[0].kind is Kind.CONSTANT and equation.invars[0].aval.weak_type:
                new_dtype = equation.params["new_dtype"]
                outvals, out_lineages = [cast_constant(invals[0], new_dtype, in_lineages[0])], in_lineages[:1]
            elif role == "follow":
                variables = [None if isinstance(atom, Literal) else atom for atom in equation.invars]
                outvals, wide, result = follow(
                    scoped, equation, invals, in_lineages, [unrounded.get(variable) for variable in variables]
                )
                if wide is not None:
                    unrounded.update(zip(equation.outvars, wide))
                out_lineages = [result] * len(outvals)
            else:
                if role == "float32":
                    invals = [
                        value if isinstance(atom, Literal) else unrounded.get(atom, value)
                        for atom, value in zip(equation.invars, invals)
                    ]
                elif carries_jaxpr(equation):
                    reports = []
                with (
                    _set(_BODY_REPORTS, reports),
                    _set(_OPERANDS, tuple(in_lineages)),
                    _closed_in_body(sites, equation),
                ):
                    outvals = rule(scoped, equation, invals)
                out_lineages = _lineages_after(scoped, role, equation, in_lineages, reports)
            if site:
                outvals = [sites.hooks.record(sites.naming.site(equation), outvals[0]), *outvals[1:]]
        if islands and _in_island(equation):
            out_lineages = [ISLAND] * len(outvals)
        for variable, value, made in zip(equation.outvars, outvals, out_lineages, strict=True):
            env[variable], lineage[variable] = value, made
        scopes = scope_policies(equation)
        if reports:
            for variable, inner in zip(equation.outvars, _scopes_of_outputs(equation, reports)):
                if scopes or inner:
                    exits[variable] = scopes + inner
        elif scopes:
            exits.update((variable, scopes) for variable in equation.outvars)
    outer = _BODY_REPORTS.get()
    if outer is not None:
        outer.append(
            BodyReport(
                tuple(() if isinstance(atom, Literal) else exits.get(atom, ()) for atom in jaxpr.outvars),
                tuple(
                    constant(atom.val) if isinstance(atom, Literal) else lineage.get(atom, ACTIVATION)
                    for atom in jaxpr.outvars
                ),
            )
        )
    if unrounded_outputs is not None:
        unrounded_outputs[:] = [None if isinstance(atom, Literal) else unrounded.get(atom) for atom in jaxpr.outvars]
    return [
        np.asarray(atom.val, dtype=atom.aval.dtype) if isinstance(atom, Literal) else env[atom]
        for atom in jaxpr.outvars
    ]


@contextlib.contextmanager
def _closed_in_body(sites: _Sites | None, equation):
    """The client closed inside the bodies of `equation`, unless it is a nested call the jit rule
    inlines: a body's amaxes cannot leave it."""
    if sites is None or equation.primitive.name in INLINED_CALLS or not carries_jaxpr(equation):
        yield
        return
    with sites.client.closed(), _set(_SITES, None):
        yield


def _scopes_of_outputs(equation, reports: list[BodyReport]) -> list[tuple]:
    """Per output of `equation`, the policy scopes its bodies made it in, as extents of this jaxpr.

    Only the bodies with one output per output of the equation count (a
    ``scan`` body's carries and stacked outputs, a ``cond`` branch; not a
    ``while`` loop's predicate or a custom rule's tangents). A body's
    extents are relative to the equation's own name stack, which prefixes
    them here.
    """
    prefix = canonical_name_stack(str(equation.source_info.name_stack))
    per_output: list[tuple] = [() for _ in equation.outvars]
    for report in reports:
        if len(report.scopes) != len(equation.outvars):
            continue
        for index, scopes in enumerate(report.scopes):
            composed = tuple((f"{prefix}/{extent}" if prefix else extent, scope) for extent, scope in scopes)
            per_output[index] += tuple(scope for scope in composed if scope not in per_output[index])
    return per_output


def _leave_scopes(equation, invals: list, lineages: list, exits: dict[Any, tuple]) -> tuple[list, list]:
    """`equation`'s inputs, each cast to the exit dtype of the policy scopes it leaves; a value the
    exit narrows is an activation from there on."""
    name_stack = str(equation.source_info.name_stack)
    leaving, leaving_lineages = [], []
    for atom, value, made in zip(equation.invars, invals, lineages):
        scopes = () if isinstance(atom, Literal) else exits.get(atom, ())
        for extent, scope in reversed(scopes):
            if inside_extent(name_stack, extent):
                break
            if is_floating(value.dtype) and value.dtype != scope.exit_dtype:
                narrowed = wider(value.dtype, scope.exit_dtype)
                value = cast(value, scope.exit_dtype)
                made = ACTIVATION if narrowed else made
        leaving.append(value)
        leaving_lineages.append(made)
    return leaving, leaving_lineages


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


def with_dtype(aval: Any, dtype: Any, *, weak_type: bool = False) -> Any:
    """`aval` (a ``ShapeDtypeStruct``, or a value's type inside ``shard_map``) with `dtype`, weakly
    typed if asked (a Python number the program passed on)."""
    if isinstance(aval, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(aval.shape, dtype, weak_type=weak_type)
    return aval.update(dtype=dtype, weak_type=weak_type)


def _aval_key(aval: Any) -> tuple:
    return (tuple(aval.shape), str(aval.dtype), _manual_axes(aval))


def rewrite_body(
    context: Rewrite,
    closed: ClosedJaxpr,
    in_avals: Sequence[jax.ShapeDtypeStruct],
    out_dtypes: Sequence[Any] | None = None,
    lineages: Sequence[Lineage] | None = None,
    *,
    keep_islands: bool = False,
) -> tuple[ClosedJaxpr, BodyReport]:
    """`closed` evaluated under the rules, traced for inputs of `in_avals`, and its report.

    Args:
        context: the rewrite.
        closed: the traced jaxpr.
        in_avals: shapes and current dtypes of its inputs.
        out_dtypes: per output, the dtype to cast it to, or None to keep the
            dtype the rules gave it (``None`` for all: keep every one).
        lineages: per input, its lineage (None: read from its dtype).
        keep_islands: leave an ISLAND output in its width rather than cast it.
    """
    pins = (
        None if out_dtypes is None else tuple(None if dtype is None else str(dtype) for dtype in out_dtypes)
    )
    given = None if lineages is None else tuple(lineages)
    key = (closed, tuple(_aval_key(aval) for aval in in_avals), pins, given, keep_islands)
    if key not in context.memo:

        def evaluate(*args):
            outvals = interpret(context, closed.jaxpr, closed.consts, args, given)
            if out_dtypes is None:
                return outvals
            made = reports[-1].lineages
            return [
                value
                if dtype is None or (keep_islands and lineage.kind is Kind.ISLAND and wider(value.dtype, dtype))
                else cast(value, dtype)
                for value, dtype, lineage in zip(outvals, out_dtypes, made)
            ]

        with _set(_BODY_REPORTS, []) as reports:
            rewritten = jax.make_jaxpr(evaluate)(*in_avals)
        # The body's own report only: the bodies inside it reported to their own equations.
        context.memo[key] = (rewritten, tuple(reports))
    rewritten, reports = context.memo[key]
    outer = _BODY_REPORTS.get()
    if outer is not None:
        outer.extend(reports)
    return rewritten, reports[-1]


def rewrite_jaxpr(
    context: Rewrite,
    closed: ClosedJaxpr,
    in_avals: Sequence[jax.ShapeDtypeStruct],
    out_dtypes: Sequence[Any] | None = None,
    lineages: Sequence[Lineage] | None = None,
) -> ClosedJaxpr:
    """`rewrite_body` without its report."""
    return rewrite_body(context, closed, in_avals, out_dtypes, lineages)[0]


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
    # With a probe's client: the rewrite's rows (one per site), the matmuls it does not
    # watch, and what its client's hooks recorded.
    rows: int = 0
    unrecorded: int = 0
    recorded: Any = None


AS_REWRITTEN = object()
"""An output dtype that says: the dtype the rules gave the output (`RewriteCache.call`)."""


def _outputs(context: Rewrite, traced: ClosedJaxpr, args: Sequence[Any], out_dtypes: Sequence[Any]) -> list:
    """`traced` evaluated on `args`, each output cast to its dtype (`AS_REWRITTEN`: left as the rules
    gave it), unless it is an ISLAND wider than it. An output rounded by the op that made it and
    handed back wider is handed back unrounded: ``x + y`` of a float32 ``x`` and a float16 ``y``,
    returned in float32, is float32's sum."""
    unrounded: list = []
    with _set(_BODY_REPORTS, []) as reports:
        outvals = interpret(context, traced.jaxpr, traced.consts, args, unrounded_outputs=unrounded)
    results = []
    for value, dtype, lineage, wide in zip(outvals, out_dtypes, reports[-1].lineages, unrounded, strict=True):
        if dtype is AS_REWRITTEN or (lineage.kind is Kind.ISLAND and wider(value.dtype, dtype)):
            results.append(value)
        elif wide is not None and wider(dtype, value.dtype):
            results.append(cast(wide, dtype))
        else:
            results.append(cast(value, dtype))
    return results


def _as_given(fun: Callable[..., Any], leaves: Sequence[Any]) -> Any:
    """``fun(*leaves)``: where both traces of a rewrite enter the function (`recovered_literals`
    pairs the frames inside it)."""
    return fun(*leaves)


def _reference(fun: Callable[..., Any], avals: Sequence[Any], traced: Sequence[Any]) -> Jaxpr:
    """`fun` traced for its arguments as given (`jaxamp._autocast.reference`).

    A function that refuses them (a kernel for half inputs only, such as
    cuDNN's attention) is traced with bfloat16 where it was traced in float16:
    bfloat16 holds what float16 loses (``1e-12``, ``-1e9``) to within its
    rounding. Where it refuses that too, an empty program: nothing is recovered.
    """
    attempts = [avals]
    if any(aval.dtype == jnp.float16 for aval in traced):
        attempts.append(
            [with_dtype(given, jnp.bfloat16) if aval.dtype == jnp.float16 else given for given, aval in zip(avals, traced)]
        )
    for in_avals in attempts:
        try:
            return jax.make_jaxpr(lambda *leaves: jax.tree.leaves(fun(*leaves)))(*in_avals).jaxpr
        except Exception:  # noqa: BLE001, S112 (the half trace succeeded, and it is the one that runs)
            continue
    return jax.make_jaxpr(lambda: None)().jaxpr


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

    The rewrite is kept per (`static_key`, shapes, dtypes, the probe client's
    key), so a second call neither traces nor rewrites again and the jitted
    parts inside it hit JAX's compile cache; one that closed over another
    transformation's tracers is not kept. Outputs that were no arrays when
    traced (a Python number, None) are returned as they were.
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
    ) -> Any:
        """``fun(*leaves)`` with dtypes changed per primitive.

        Args:
            fun: a function of array leaves returning a pytree of arrays.
            leaves: the arrays.
            static_key: everything besides the leaves' shapes and dtypes that
                decides what `fun` traces to, hashable; ``None`` to trace every call.
            trace_dtypes: per leaf, the dtype `fun` is traced with, or None for
                its own (all its own if omitted); the rewrite takes the leaves as they are.
            output_dtypes: called while tracing on `fun`'s outputs; per array
                leaf, the dtype it is returned in, None for its traced dtype, or
                `AS_REWRITTEN` for the dtype the rules gave it.
        """
        avals = [abstract(leaf) for leaf in leaves]
        if trace_dtypes is None:
            trace_dtypes = (None,) * len(leaves)
        trace_key = tuple(None if dtype is None else str(dtype) for dtype in trace_dtypes)
        client = open_client()
        client_key = None if client is None else (type(client), client.key(leaves))
        key = (
            None
            if static_key is None
            else (static_key, tuple(_aval_key(aval) for aval in avals), trace_key, client_key)
        )
        try:
            entry = None if key is None else self._entries.get(key)
        except TypeError:  # an unhashable static argument
            key, entry = None, None
        if entry is None:
            trace_avals = [
                aval if dtype is None else with_dtype(aval, dtype) for aval, dtype in zip(avals, trace_dtypes)
            ]
            entry, cacheable = self._build(fun, avals, trace_avals, output_dtypes, client, client_key)
            if key is not None and cacheable:
                self._entries[key] = entry
                if len(self._entries) > self._max_entries:
                    self._entries.popitem(last=False)
        else:
            self._entries.move_to_end(key)
        blocks = [] if client is None else client.take(entry.rows)
        results = jaxpr_as_fun(entry.rewritten)(*blocks, *leaves)
        count = entry.out_tree.num_leaves - len(entry.static_outputs)
        if client is not None:
            client.finish(results[count:], entry.recorded, entry.unrecorded)
        outvals, statics = iter(results[:count]), dict(entry.static_outputs)
        return jax.tree.unflatten(
            entry.out_tree,
            [statics[index] if index in statics else next(outvals) for index in range(entry.out_tree.num_leaves)],
        )

    def _build(self, fun, avals, trace_avals, output_dtypes, client, client_key) -> tuple[_Entry, bool]:
        """The rewrite of a call: with a probe's client, its blocks of rows are leading inputs (one
        row per site, `jaxamp._autocast.sites`) and its hooks' extra outputs come last."""
        self.traces += 1
        out_tree, static_outputs, pinned = None, [], []

        def array_outputs(*leaves):
            nonlocal out_tree
            outputs = _as_given(fun, leaves)
            flat, out_tree = jax.tree.flatten(outputs)
            static_outputs[:] = [(i, leaf) for i, leaf in enumerate(flat) if not _is_traced_array(leaf)]
            arrays = [leaf for leaf in flat if _is_traced_array(leaf)]
            pinned[:] = [None] * len(arrays) if output_dtypes is None else list(output_dtypes(outputs))
            return arrays

        # A rewrite of its own, even when started inside another's rule (a custom derivative's):
        # its outputs report to no enclosing equation, and autocast calls traced inside are part of it.
        with (
            _set(_BODY_REPORTS, None),
            opened(None),
            client.closed() if client is not None else contextlib.nullcontext(),
        ):
            traced = _trace(array_outputs, trace_avals, avals)
            written = Recovered({}, None)
            if any(aval.dtype != given.dtype for aval, given in zip(traced.in_avals, avals)):
                reference = _reference(lambda *leaves: _as_given(fun, leaves), avals, traced.in_avals)
                if reference.eqns:  # else the reference was refused: every cast is taken as written
                    written = recovered(traced.jaxpr, reference, _as_given.__code__)
            context = Rewrite(
                self._compute_dtype,
                self._rules,
                as_traced=restore_rule,
                rules_for=self._rules_for,
                fp8_matmuls=self._fp8_matmuls,
                literals=written.literals,
                written_casts=written.written_casts,
            )
            out_dtypes = [
                aval.dtype if dtype is None else dtype
                for aval, dtype in zip(traced.out_avals, pinned, strict=True)
            ]
            rows, unrecorded = count_sites(traced.jaxpr) if client is not None else (0, 0)
            recorded = [None]

            def evaluate(*inputs):
                if client is None:
                    return _outputs(context, traced, inputs, out_dtypes)
                blocks, args = inputs[: client.blocks], inputs[client.blocks :]
                hooks_of_call = client.rewriting(blocks, args, client_key[1])
                with hooks_of_call as hooks, _set(_SITES, _Sites(client, hooks, Naming())):
                    outvals = _outputs(context, traced, args, out_dtypes)
                recorded[0] = hooks.recorded()
                return [*outvals, *hooks.outputs()]

            block = jax.ShapeDtypeStruct((rows, SLOTS), jnp.float32)
            rewritten = jax.make_jaxpr(evaluate)(*[block] * (client.blocks if client else 0), *avals)
        cacheable = not any(isinstance(const, jax.core.Tracer) for const in traced.consts)
        return _Entry(rewritten, out_tree, tuple(static_outputs), rows, unrecorded, recorded[0]), cacheable
