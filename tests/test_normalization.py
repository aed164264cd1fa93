"""Every normalization layer, linen and NNX, runs in float32 under a mixed policy.

Each scenario puts one normalization layer between two bias-free dense layers
and traces the mixed-precision model. Per class it asserts:

* the dtype the layer reads its params (scale, bias) in: float32;
* the dtype it computes in: every floating operation between the two matmuls
  (the statistics, their reductions and the normalization itself) is float32,
  apart from the casts in and out;
* that it hands its result back in the compute dtype: the second matmul reads
  float16 or bfloat16.

Removing a class from `jaxamp.NORMALIZATION_LAYERS` makes it run under the
compute policy: its params are read in half precision and the normalization
is computed in half precision, which these tests see.
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxamp

F32 = np.dtype(jnp.float32)
FEATURES = 4
INPUTS = jax.random.normal(jax.random.key(0), (2, 3, FEATURES))
HALF_POLICIES = {"mixed_float16": np.dtype(jnp.float16), "mixed_bfloat16": np.dtype(jnp.bfloat16)}

LINEN_NORMS = {
    "BatchNorm": lambda: nn.BatchNorm(use_running_average=False),
    "LayerNorm": nn.LayerNorm,
    "GroupNorm": lambda: nn.GroupNorm(num_groups=2),
    "RMSNorm": nn.RMSNorm,
    "InstanceNorm": nn.InstanceNorm,
}
NNX_NORMS = {
    "BatchNorm": lambda rngs: nnx.BatchNorm(FEATURES, use_running_average=False, rngs=rngs),
    "LayerNorm": lambda rngs: nnx.LayerNorm(FEATURES, rngs=rngs),
    "GroupNorm": lambda rngs: nnx.GroupNorm(FEATURES, num_groups=2, rngs=rngs),
    "RMSNorm": lambda rngs: nnx.RMSNorm(FEATURES, rngs=rngs),
    "InstanceNorm": lambda rngs: nnx.InstanceNorm(FEATURES, rngs=rngs),
}


def test_every_normalization_class_is_in_the_float32_list():
    expected = {getattr(nn, name) for name in LINEN_NORMS} | {getattr(nnx, name) for name in NNX_NORMS}
    assert set(jaxamp.NORMALIZATION_LAYERS) == expected


# --- reading a jaxpr ----------------------------------------------------------------


def flat_equations(jaxpr):
    """The equations of `jaxpr` in program order, nested jaxprs inlined."""
    equations = []
    for equation in jaxpr.eqns:
        nested = [
            value.jaxpr if isinstance(value, jax.extend.core.ClosedJaxpr) else value
            for value in equation.params.values()
            if isinstance(value, (jax.extend.core.ClosedJaxpr, jax.extend.core.Jaxpr))
        ]
        if nested:
            for sub in nested:
                equations.extend(flat_equations(sub))
        else:
            equations.append(equation)
    return equations


def is_floating(aval):
    return jnp.issubdtype(aval.dtype, jnp.floating)


def normalization_compute_dtypes(jaxpr):
    """Dtypes of the floating ops between the first and the last matmul, casts aside."""
    equations = flat_equations(jaxpr)
    matmuls = [index for index, equation in enumerate(equations) if equation.primitive.name == "dot_general"]
    assert len(matmuls) == 2, "the scenario has exactly two matmuls around the normalization"
    between = equations[matmuls[0] + 1 : matmuls[1]]
    return {
        np.dtype(outvar.aval.dtype)
        for equation in between
        if equation.primitive.name != "convert_element_type"
        for outvar in equation.outvars
        if is_floating(outvar.aval)
    }


def reduction_dtypes(jaxpr):
    """Dtypes the statistics are summed in (every reduction in the program)."""
    return {
        np.dtype(equation.invars[0].aval.dtype)
        for equation in flat_equations(jaxpr)
        if equation.primitive.name in ("reduce_sum", "reduce_max", "cumsum")
    }


def second_matmul_operand_dtypes(jaxpr):
    matmuls = [equation for equation in flat_equations(jaxpr) if equation.primitive.name == "dot_general"]
    return {np.dtype(var.aval.dtype) for var in matmuls[-1].invars}


def param_reads(fun, params, *args):
    """{'path/to/param': dtypes it is read in} for each leaf of `params`.

    `fun(params, *args)` is traced; a param converted first is read in the
    dtype it is converted to, one used directly in its own dtype.
    """
    jaxpr = jax.make_jaxpr(fun)(params, *args).jaxpr
    paths = [path for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    reads = {}
    for path, invar in zip(paths, jaxpr.invars, strict=False):
        uses = set()
        for equation in jaxpr.eqns:
            if any(operand is invar for operand in equation.invars):
                converts = equation.primitive.name == "convert_element_type"
                uses.add(np.dtype(equation.params["new_dtype"]) if converts else np.dtype(invar.aval.dtype))
        reads["/".join(str(getattr(key, "key", key)) for key in path)] = uses
    return reads, jaxpr


# --- linen ----------------------------------------------------------------------------


class LinenSandwich(nn.Module):
    """Dense, the normalization under test, Dense: no dtype anywhere."""

    norm: str

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(FEATURES, use_bias=False, name="before")(x)
        x = LINEN_NORMS[self.norm]()(x)
        return nn.Dense(2, use_bias=False, name="after")(x)


@functools.cache
def linen_trace(norm, policy):
    model = jaxamp.apply_policy(LinenSandwich(norm), policy)
    variables = jax.eval_shape(model.init, jax.random.key(0), INPUTS)
    apply = functools.partial(model.apply, mutable=["batch_stats"])
    reads, jaxpr = param_reads(apply, variables, INPUTS)
    norm_reads = {
        name.rsplit("/", 1)[1]: dtypes for name, dtypes in reads.items() if name.startswith(f"params/{norm}_0/")
    }
    return variables["params"], norm_reads, jaxpr


# --- NNX ----------------------------------------------------------------------------------


class NnxSandwich(nnx.Module):
    def __init__(self, norm, *, rngs):
        self.before = nnx.Linear(FEATURES, FEATURES, use_bias=False, rngs=rngs)
        self.norm = NNX_NORMS[norm](rngs)
        self.after = nnx.Linear(FEATURES, 2, use_bias=False, rngs=rngs)

    def __call__(self, x):
        return self.after(self.norm(self.before(x)))


@functools.cache
def nnx_trace(norm, policy):
    model = jaxamp.apply_policy(NnxSandwich(norm, rngs=nnx.Rngs(0)), policy)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def call(params, rest, x):
        return nnx.merge(graphdef, params, rest)(x)

    reads, jaxpr = param_reads(call, params, rest, INPUTS)
    norm_reads = {
        name.split("/")[1]: dtypes for name, dtypes in reads.items() if name.startswith("norm/")
    }
    return params, norm_reads, jaxpr


# --- the scenario, per framework, class and policy ------------------------------------------

TRACES = {"linen": linen_trace, "nnx": nnx_trace}


@pytest.mark.parametrize("policy", sorted(HALF_POLICIES))
@pytest.mark.parametrize("norm", sorted(LINEN_NORMS))
@pytest.mark.parametrize("framework", sorted(TRACES))
def test_normalization_reads_params_and_computes_in_float32_and_hands_on_half(framework, norm, policy):
    params, norm_reads, jaxpr = TRACES[framework](norm, policy)
    expected_params = {"scale", "bias"} if norm != "RMSNorm" else {"scale"}
    assert norm_reads == {name: {F32} for name in expected_params}
    assert {leaf.dtype for leaf in jax.tree.leaves(params)} == {F32}
    assert normalization_compute_dtypes(jaxpr) == {F32}
    assert reduction_dtypes(jaxpr) == {F32}
    assert second_matmul_operand_dtypes(jaxpr) == {HALF_POLICIES[policy]}
