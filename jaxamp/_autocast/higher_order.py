"""Rules for primitives that carry jaxprs: their bodies are rewritten by the same rules.

Each rule rewrites the body with the interpreter, the operands' lineages
passed in, and binds the same primitive again with every other param kept,
or calls the public API that builds it where its params change between JAX
releases (``scan``, ``cond``). A loop's carry is pinned to its traced dtype
(float32 under float32 rules), so its types are fixed points; a ``cond``'s
outputs take the widest dtype its branches give. A custom derivative
keeps the user's rule and rewrites it too (`custom_jvp_rule`,
`custom_vjp_rule`), so its arithmetic runs in half precision as well; a
``custom_vjp`` takes its inputs and gives its outputs in the traced dtypes,
so the user's rules see the dtypes they were written for. Linear solves run
in float32 (`linear_solve_rule`); kernels, user rules and annotations that
carry bodies (``pallas_call``, ``custom_vmap``, ``custom_partitioning``, ...)
run as traced.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import ClosedJaxpr, jaxpr_as_fun

from jaxamp._autocast.context import Rewrite, Rule, bind, cast, is_floating, traced_dtypes
from jaxamp._autocast.interpreter import (
    RewriteCache,
    abstract,
    inlining,
    interpret,
    lift_consts,
    operand_lineages,
    rewrite_body,
    rewrite_jaxpr,
    with_dtype,
)
from jaxamp._autocast.lineage import ACTIVATION, Kind, Lineage
from jaxamp._autocast.rules import restore_rule, unsupported


def jit_rule(context: Rewrite, equation, invals: Sequence[Any]) -> list:
    """A nested ``jit``: the same primitive and params around the rewritten body.

    In a rewrite with a probe's client (`jaxamp._probe`: the overflow record,
    FP8 delayed scaling) the body is inlined instead, so that its matmuls are
    sites too.
    """
    body_param = "jaxpr" if "jaxpr" in equation.params else "call_jaxpr"
    naming = inlining()
    if naming is not None:
        closed = equation.params[body_param]
        with naming.inlined(equation):
            return interpret(context, closed.jaxpr, closed.consts, invals, operand_lineages())
    avals = [abstract(value) for value in invals]
    body = rewrite_jaxpr(context, equation.params[body_param], avals, lineages=operand_lineages())
    return bind(equation, invals, **{body_param: body})


def remat_rule(context: Rewrite, equation, invals: Sequence[Any]) -> list:
    """``jax.checkpoint``: rewritten body, ``policy``/``prevent_cse``/``differentiated`` kept."""
    body = ClosedJaxpr(equation.params["jaxpr"], ())
    avals = [abstract(value) for value in invals]
    rewritten, consts = lift_consts(rewrite_jaxpr(context, body, avals, lineages=operand_lineages()))
    return bind(equation, [*consts, *invals], jaxpr=rewritten)


def _scan_counts(params: dict) -> tuple[int, int]:
    """How many of a ``scan``'s operands are constants and how many the carry.

    Before JAX 0.12 the params say so (``num_consts``, ``num_carry``); from
    0.12 they hold the operands' flat tree structure (``ft_in``).
    """
    if "num_consts" in params:
        return params["num_consts"], params["num_carry"]
    consts_tree, carry_tree, _ = params["ft_in"].unpack()
    return len(consts_tree), len(carry_tree)


def _pinned_dtypes(context: Rewrite, atoms: Sequence[Any]) -> list:
    """The dtypes a loop's carry is pinned to: as traced, widened to float32 where the rules are
    float32's (a `float32_scope`, a float32 policy scope, a linear solve)."""
    dtypes = traced_dtypes(atoms)
    if context.compute_dtype != np.float32:
        return dtypes
    return [jnp.promote_types(jnp.float32, dtype) if is_floating(dtype) else dtype for dtype in dtypes]


def scan_rule(context: Rewrite, equation, invals: Sequence[Any]) -> list:
    """``lax.scan`` with its carry pinned to the traced dtypes.

    Rebuilt with ``lax.scan`` (length, direction and unrolling kept), which
    closes over the constants; the primitive's params describe its operands
    differently in each JAX release.
    """
    num_consts, num_carry = _scan_counts(equation.params)
    consts = invals[:num_consts]
    carry_dtypes = _pinned_dtypes(context, equation.invars[num_consts : num_consts + num_carry])
    init = [
        cast(value, dtype) for value, dtype in zip(invals[num_consts : num_consts + num_carry], carry_dtypes)
    ]
    xs = invals[num_consts + num_carry :]
    body_avals = [
        *(abstract(value) for value in (*consts, *init)),
        *(abstract(value, drop_leading_axis=True) for value in xs),
    ]
    num_ys = len(equation.outvars) - num_carry
    operands = operand_lineages()
    lineages = [*operands[:num_consts], *([ACTIVATION] * num_carry), *operands[num_consts + num_carry :]]
    pins = [*carry_dtypes, *([None] * num_ys)]
    body = jaxpr_as_fun(rewrite_jaxpr(context, equation.params["jaxpr"], body_avals, pins, lineages))

    def step(carry, x):
        outvals = body(*consts, *carry, *x)
        return outvals[:num_carry], outvals[num_carry:]

    carry, ys = lax.scan(
        step,
        init,
        xs,
        length=equation.params["length"],
        reverse=equation.params["reverse"],
        unroll=equation.params["unroll"],
    )
    return [*carry, *ys]


def while_rule(context: Rewrite, equation, invals: Sequence[Any]) -> list:
    """``lax.while_loop`` (and ``fori_loop``) with its carry pinned to the traced dtypes."""
    cond_nconsts, body_nconsts = equation.params["cond_nconsts"], equation.params["body_nconsts"]
    cond_consts = invals[:cond_nconsts]
    body_consts = invals[cond_nconsts : cond_nconsts + body_nconsts]
    carry_dtypes = _pinned_dtypes(context, equation.invars[cond_nconsts + body_nconsts :])
    init = [cast(value, dtype) for value, dtype in zip(invals[cond_nconsts + body_nconsts :], carry_dtypes)]
    carry_avals = [abstract(value) for value in init]
    operands, carry = operand_lineages(), [ACTIVATION] * len(init)
    cond = rewrite_jaxpr(
        context,
        equation.params["cond_jaxpr"],
        [*(abstract(value) for value in cond_consts), *carry_avals],
        lineages=[*operands[:cond_nconsts], *carry],
    )
    body = rewrite_jaxpr(
        context,
        equation.params["body_jaxpr"],
        [*(abstract(value) for value in body_consts), *carry_avals],
        carry_dtypes,
        [*operands[cond_nconsts : cond_nconsts + body_nconsts], *carry],
    )
    cond_jaxpr, new_cond_consts = lift_consts(cond)
    body_jaxpr, new_body_consts = lift_consts(body)
    return bind(
        equation,
        [*new_cond_consts, *cond_consts, *new_body_consts, *body_consts, *init],
        cond_jaxpr=ClosedJaxpr(cond_jaxpr, ()),
        cond_nconsts=len(new_cond_consts) + cond_nconsts,
        body_jaxpr=ClosedJaxpr(body_jaxpr, ()),
        body_nconsts=len(new_body_consts) + body_nconsts,
    )


def cond_rule(context: Rewrite, equation, invals: Sequence[Any]) -> list:
    """``lax.cond`` / ``lax.switch``: rewritten branches, outputs unified to the widest dtype.

    Rebuilt with ``lax.switch``, which hoists the constants the rewrite
    created into operands shared by every branch.
    """
    index, *operands = invals
    avals = [abstract(value) for value in operands]
    lineages = operand_lineages()[1:]
    branches = equation.params["branches"]
    first_pass = [rewrite_jaxpr(context, branch, avals, lineages=lineages) for branch in branches]
    out_dtypes = [
        jnp.result_type(*(branch.out_avals[position].dtype for branch in first_pass))
        for position in range(len(equation.outvars))
    ]
    unified = [rewrite_jaxpr(context, branch, avals, out_dtypes, lineages) for branch in branches]
    return list(lax.switch(index, [jaxpr_as_fun(branch) for branch in unified], *operands))


def _body_as_function(context: Rewrite, body: ClosedJaxpr, out_dtypes: Sequence[Any]):
    """The rewritten body of a custom-derivative call, outputs in their traced dtypes."""

    def evaluate(*args):
        outvals = interpret(context, body.jaxpr, body.consts, args)
        return [cast(value, dtype) for value, dtype in zip(outvals, out_dtypes)]

    return evaluate


def _float0_zeros(value_or_aval) -> np.ndarray:
    """The zero tangent of a non-floating value (JAX's ``float0``)."""
    return np.zeros(np.shape(value_or_aval), dtype=jax.dtypes.float0)


def _narrowed(rewritten: Any, traced: Any) -> Any:
    """`rewritten` where it is a floating dtype narrower than `traced`, else `traced`."""
    narrower = is_floating(rewritten) and is_floating(traced) and rewritten != traced
    return rewritten if narrower and jnp.promote_types(rewritten, traced) == traced else traced


def _kept_wide(context: Rewrite, lineage: Lineage, traced: Any) -> bool:
    """Whether a custom_jvp's output keeps the width its body gave it: made in a float32 island or
    called in one, or holding magnitudes its traced dtype cannot (a fill of ``-3.4e38``)."""
    unheld = is_floating(traced) and not lineage.fits(traced)
    return lineage.kind is Kind.ISLAND or context.in_float32_island or unheld


def custom_jvp_rule(context: Rewrite, equation, invals: Sequence[Any]) -> list:
    """``jax.custom_jvp``: rewritten primal, rule = the rewritten JVP of the original.

    The algorithm::

        body = the call's jaxpr rewritten for the current input dtypes and lineages
        per output: dtype = the body's if an island, called in one, holding what the traced
                         dtype cannot, or narrower than traced; else the traced one
        primal(inputs) = body(inputs), outputs cast to their dtypes
        jvp(primals, tangents) = JAX's JVP of the original call (the user's rule),
            traced for the traced dtypes and rewritten for the current ones

    So ``jax.nn.relu`` of a float16 activation gives a float16 output and
    cotangent, as without the custom derivative, ``jax.nn.softmax`` (a body
    computed in float32) its traced dtype, and either of a float32 island
    (or called in one) or holding a fill half cannot hold float32.
    """
    in_dtypes, traced_out_dtypes = traced_dtypes(equation.invars), traced_dtypes(equation.outvars)
    differentiable_in = [is_floating(dtype) for dtype in in_dtypes]
    differentiable_out = [is_floating(dtype) for dtype in traced_out_dtypes]
    body = equation.params["call_jaxpr"]
    avals = [abstract(value) for value in invals]
    rewritten_body, report = rewrite_body(context, body, avals, lineages=operand_lineages())
    out_dtypes = [
        aval.dtype if _kept_wide(context, lineage, traced) else _narrowed(aval.dtype, traced)
        for aval, traced, lineage in zip(rewritten_body.out_avals, traced_out_dtypes, report.lineages)
    ]
    tangent_dtypes = [dtype for dtype, keep in zip(out_dtypes, differentiable_out) if keep]
    primal_lineages = operand_lineages()
    rule_lineages = [*primal_lineages, *(made for made, keep in zip(primal_lineages, differentiable_in) if keep)]

    def original(*primals):
        return bind(equation, primals)

    def evaluate(*args):
        return [cast(value, dtype) for value, dtype in zip(jaxpr_as_fun(rewritten_body)(*args), out_dtypes)]

    autocast_call = jax.custom_jvp(evaluate)

    def autocast_jvp(primals, tangents):
        float_tangents = [tangent for tangent, keep in zip(tangents, differentiable_in) if keep]

        def user_jvp(*leaves):
            primal_leaves, tangent_leaves = leaves[: len(primals)], iter(leaves[len(primals) :])
            all_tangents = [
                next(tangent_leaves) if keep else _float0_zeros(primal)
                for primal, keep in zip(primal_leaves, differentiable_in)
            ]
            outs, out_tangents = jax.jvp(original, tuple(primal_leaves), tuple(all_tangents))
            return [*outs, *(tangent for tangent, keep in zip(out_tangents, differentiable_out) if keep)]

        leaves = [*primals, *float_tangents]
        traced_in = [atom.aval for atom in equation.invars]
        traced_leaves = [*traced_in, *(aval for aval, keep in zip(traced_in, differentiable_in) if keep)]
        traced_avals = [
            with_dtype(abstract(leaf), traced.dtype, weak_type=traced.weak_type)
            for leaf, traced in zip(leaves, traced_leaves)
        ]
        rule = jax.make_jaxpr(user_jvp)(*traced_avals)
        rewritten_rule = rewrite_jaxpr(
            context, rule, [abstract(leaf) for leaf in leaves], [*out_dtypes, *tangent_dtypes], rule_lineages
        )
        results = jaxpr_as_fun(rewritten_rule)(*leaves)
        outs, float_out_tangents = results[: len(out_dtypes)], iter(results[len(out_dtypes) :])
        out_tangents = [
            next(float_out_tangents) if keep else _float0_zeros(out)
            for out, keep in zip(outs, differentiable_out)
        ]
        return outs, out_tangents

    autocast_call.defjvp(autocast_jvp)
    return list(autocast_call(*invals))


def custom_vjp_rule(context: Rewrite, equation, invals: Sequence[Any]) -> list:
    """``jax.custom_vjp``: rewritten primal, forward and backward."""
    in_dtypes, out_dtypes = traced_dtypes(equation.invars), traced_dtypes(equation.outvars)
    differentiable_in = [is_floating(dtype) for dtype in in_dtypes]
    differentiable_out = [is_floating(dtype) for dtype in out_dtypes]
    outvar_avals = [atom.aval for atom in equation.outvars]
    scopes = {"rules_for": context.rules_for, "fp8_matmuls": context.fp8_matmuls}
    forward_rewrites = RewriteCache(context.compute_dtype, context.rules, **scopes)
    backward_rewrites = RewriteCache(context.compute_dtype, context.rules, **scopes)
    body = equation.params["call_jaxpr"] if "call_jaxpr" in equation.params else equation.params["fun_jaxpr"]

    def original(*primals):
        return bind(equation, primals)

    autocast_call = jax.custom_vjp(_body_as_function(context, body, out_dtypes))

    def forward(*primals):
        # jax.vjp's pullback is a pytree whose leaves are the user's residuals.
        return forward_rewrites.call(lambda *leaves: jax.vjp(original, *leaves), primals, static_key=())

    def backward(pullback, cotangents):
        float_cotangents = [ct for ct, keep in zip(cotangents, differentiable_out) if keep]
        residuals, pullback_tree = jax.tree.flatten(pullback)

        def user_backward(*leaves):
            user_pullback = jax.tree.unflatten(pullback_tree, leaves[: len(residuals)])
            given = iter(leaves[len(residuals) :])
            all_cotangents = [
                next(given) if keep else _float0_zeros(aval)
                for aval, keep in zip(outvar_avals, differentiable_out)
            ]
            input_cotangents = user_pullback(all_cotangents)
            return [ct for ct, keep in zip(input_cotangents, differentiable_in) if keep]

        float_input_cotangents = iter(
            backward_rewrites.call(user_backward, [*residuals, *float_cotangents], static_key=pullback_tree)
        )
        return tuple(next(float_input_cotangents) if keep else None for keep in differentiable_in)

    autocast_call.defvjp(forward, backward)
    return list(autocast_call(*(cast(value, dtype) for value, dtype in zip(invals, in_dtypes))))


def shard_map_rule(context: Rewrite, equation, invals: Sequence[Any]) -> list:
    """``jax.shard_map`` (and ``jax.pmap``, which JAX stages as one): rewritten per-shard body.

    Rebuilt with ``jax.shard_map`` and the equation's mesh, in and out specs,
    manual axes and ``check_vma``, so the body is interpreted where its axis
    names are bound: a ``psum`` inside it needs the mesh's axes, and its
    values carry their varying-axes types. Collectives in the body keep the
    dtypes the program gave them (`restore_rule`).
    """
    params = equation.params
    body = params["jaxpr"]

    def per_shard(*args):
        return tuple(interpret(context, body, (), args))

    sharded = jax.shard_map(
        per_shard,
        mesh=params["mesh"],
        in_specs=tuple(params["in_specs"]),
        out_specs=tuple(params["out_specs"]),
        axis_names=params["newly_manual_axes"],
        check_vma=params["check_vma"],
    )
    return list(sharded(*invals))


def linear_solve_rule(context: Rewrite, equation, invals: Sequence[Any]) -> list:
    """``lax.custom_linear_solve`` (``jnp.linalg.solve``/``inv``, ``cg``, ``gmres``) in float32.

    Its jaxprs (matvec, solve, transpose solve) are rewritten under float32
    rules for float32 operands: a solve is only as accurate as its matvec,
    and an iterative solver whose matvec rounds to float16 (relative error
    about 1e-3) stalls there and never meets its tolerance. A solve is a
    small part of a model's FLOPs, so nothing is lost by keeping it whole.
    """
    float32 = context.under(np.dtype(np.float32), fp8_matmuls=None)
    operands = [
        cast(value, jnp.promote_types(jnp.float32, value.dtype)) if is_floating(value.dtype) else value
        for value in invals
    ]
    jaxprs, const_lengths = equation.params["jaxprs"], equation.params["const_lengths"]
    num_consts = sum(const_lengths)
    right_hand_side = [abstract(value) for value in operands[num_consts:]]
    rewritten, start = [], 0
    for jaxpr, length in zip(jaxprs, const_lengths):
        consts = [abstract(value) for value in operands[start : start + length]]
        start += length
        if jaxpr is None:
            rewritten.append(None)
            continue
        out_dtypes = [aval.dtype for aval in right_hand_side]
        rewritten.append(rewrite_jaxpr(float32, jaxpr, [*consts, *right_hand_side], out_dtypes))
    return bind(equation, operands, jaxprs=type(jaxprs)(*rewritten))


_NO_PROGRAM = "JAX uses it only while it linearizes a function, and removes it before a program is staged"

HIGHER_ORDER_RULES: dict[str, Rule] = {
    # Rewritten: the body runs under the rules.
    "jit": jit_rule,
    "closed_call": jit_rule,  # eval_jaxpr from JAX 0.12
    "eval_jaxpr": jit_rule,
    "remat2": remat_rule,
    "scan": scan_rule,
    "while": while_rule,
    "cond": cond_rule,
    "custom_jvp_call": custom_jvp_rule,
    "custom_vjp_call": custom_vjp_rule,
    "shard_map": shard_map_rule,
    # Run as traced, in the dtypes the program gave them.
    "custom_linear_solve": linear_solve_rule,
    "remat_opt": restore_rule,  # a checkpoint after partial evaluation
    "custom_vmap_call": restore_rule,  # jax.custom_batching: the user's own rule
    "linear_call": restore_rule,  # a user-given transpose
    "custom_partitioning": restore_rule,  # user sharding rules, per dtype
    "composite": restore_rule,  # lax.composite: a named op, decomposed as traced
    "cudnn_fusion": restore_rule,  # a kernel for its dtypes
    "run_state": restore_rule,  # stateful code over references
    "call_hi_primitive": restore_rule,
    # JAX 0.10's call of an open jaxpr, staged by no public API (gone
    # from 0.11.1; an alias of eval_jaxpr in 0.12).
    "call": restore_rule,
    # Never in a traced program.
    "custom_lin": unsupported(_NO_PROGRAM),
    # Pallas kernels and their scopes, written for their dtypes
    "pallas_call": restore_rule, "core_map": restore_rule, "run_scoped": restore_rule,
    "mpmd_map": restore_rule, "custom_fusion": restore_rule, "fusible": restore_rule,
    # jax.experimental.compute_on, fused, scheduling groups: placement and
    # scheduling annotations around a body, which runs as traced
    "compute_on": restore_rule, "fused_call": restore_rule, "xla_metadata_call": restore_rule,
    # jax.experimental.overlap.program_order (from JAX 0.11.2): its body's order kept
    "program_order": restore_rule,
}  # fmt: skip
"""Primitive name -> rule, for the primitives that carry jaxprs (keyed by name,
as `jaxamp._autocast.rules.FIRST_ORDER_RULES` is)."""
