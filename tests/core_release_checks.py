"""A fresh process's view of the core: a JAX that lost primitives, a primitive with no rule, the environment.

Run by tests/test_release_proof_core.py (as a `FreshProcess`): each check
needs an interpreter in which jaxamp was not imported yet. Prints one JSON
object with what it saw.
"""

import json
import os
import sys
import warnings

import jax
import jax.numpy as jnp
import optax
from jax._src.interpreters import ad, mlir
from jax.extend.core import Primitive

# JAX itself sets variables on import (TF_CPP_MIN_LOG_LEVEL); jaxamp's import must add none.
ENVIRONMENT_BEFORE = dict(os.environ)

# JAX drops primitives between releases (0.11.1 removed psum_start and
# pbroadcast_start): drop several the rules table names, async collective
# halves and a decomposition, from every table the registry reads.
DROPPED = ("psum_done", "all_gather_done", "ppermute_start", "geqp3")
tables = [mlir._lowerings, *mlir._platform_specific_lowerings.values(), ad.primitive_jvps,
          ad.primitive_transposes]  # fmt: skip
for table in tables:
    for primitive in [primitive for primitive in table if primitive.name in DROPPED]:
        del table[primitive]

import jaxamp
from jaxamp._autocast.table import rules_table

result = {"environment_unchanged_by_import": dict(os.environ) == ENVIRONMENT_BEFORE}
result["dropped_with_rule"] = sorted(p.name for p in rules_table() if p.name in DROPPED)

# A float16 MLP with dynamic loss scaling, through autocast.
key_w1, key_w2, key_x = jax.random.split(jax.random.key(0), 3)
params = {"w1": jax.random.normal(key_w1, (16, 32)) / 4, "w2": jax.random.normal(key_w2, (32, 1)) / 6}
x = jax.random.normal(key_x, (8, 16))
y = jnp.sin(x.sum(axis=1, keepdims=True))


def mlp(params, x):
    return jnp.tanh(x @ params["w1"]) @ params["w2"]


def loss_fn(params, x, y):
    return jnp.mean((jaxamp.autocast(mlp, "mixed_float16")(params, x) - y) ** 2)


optimizer = optax.adam(1e-2)


@jax.jit
def train_step(params, opt_state, loss_scale):
    loss, grads, grads_finite = jaxamp.scaled_value_and_grad(loss_fn, loss_scale)(params, x, y)
    updates, new_opt_state = optimizer.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    params, opt_state = jaxamp.select_tree(grads_finite, (new_params, new_opt_state), (params, opt_state))
    return params, opt_state, loss_scale.adjust(grads_finite), loss


opt_state, loss_scale, losses = optimizer.init(params), jaxamp.DynamicLossScale(), []
for _ in range(30):
    params, opt_state, loss_scale, loss = train_step(params, opt_state, loss_scale)
    losses.append(float(loss))
result["losses"] = losses
result["matmul_dtypes"] = sorted(jaxamp.precision_report(loss_fn, params, x, y).flops_by_dtype())
result["loss_scale"] = float(loss_scale.loss_scale)

# A primitive of the user's own, which no rule names: run as traced, named in one warning.
double_p = Primitive("user_double")
double_p.def_impl(lambda value: value * 2)
double_p.def_abstract_eval(lambda aval: aval)
mlir.register_lowering(double_p, mlir.lower_fun(lambda value: value * 2, multiple_results=False))


def uses_double(w, x):
    return double_p.bind(x @ w)


with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    outputs = []
    for rows in (2, 3, 4):  # three signatures: three traces and rewrites
        outputs.append(jaxamp.autocast(uses_double)(jnp.ones((4, 4)), jnp.ones((rows, 4))))
    jax.jit(jaxamp.autocast(uses_double))(jnp.ones((4, 4)), jnp.ones((5, 4)))
result["no_rule_warnings"] = [
    str(warning.message) for warning in caught if issubclass(warning.category, jaxamp.NoAutocastRuleWarning)
]
result["user_primitive_values"] = [float(output[0, 0]) for output in outputs]
result["user_primitive_dtype"] = str(outputs[0].dtype)
traced_report = jaxamp.precision_report(jaxamp.autocast(uses_double), jnp.ones((4, 4)), jnp.ones((2, 4)))
compiled_report = jaxamp.precision_report(
    jaxamp.autocast(uses_double), jnp.ones((4, 4)), jnp.ones((2, 4)), compiled=True
)
result["traced_report"] = str(traced_report)
result["without_rule"] = [list(traced_report.without_rule), list(compiled_report.without_rule)]

result["environment_unchanged_after_autocast"] = dict(os.environ) == ENVIRONMENT_BEFORE
try:
    from jaxamp.diagnostics import gpu_target_device
except ImportError:  # before the diagnostics layer
    gpu_target_device = jaxamp.diagnostics.gpu_target_device
try:
    gpu_target_device("h200")
    result["gpu_target"] = "compiled-for"
except RuntimeError as error:  # no CUDA plugin installed
    result["gpu_target"] = f"unavailable: {error}"
result["environment_unchanged_after_gpu_target"] = dict(os.environ) == ENVIRONMENT_BEFORE
json.dump(result, sys.stdout)
print()
