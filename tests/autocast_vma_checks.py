"""`jaxamp.autocast` around and inside ``jax.shard_map(..., check_vma=True)``; run by test_autocast_vma.py.

A device count is fixed when JAX starts, so this runs as its own process
(``XLA_FLAGS=--xla_force_host_platform_device_count=8``) and prints one JSON
line of findings, which the test asserts on. Every program is a
data-parallel computation over a mesh axis ``"d"`` of 8 devices with JAX's
varying-axes types on (``check_vma=True``, the default), and each has an
unsharded float32 twin on one device that gives the same result.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jaxamp
from tests.autocast_sharded_checks import psum_operands

AXIS = "d"
W = jax.random.normal(jax.random.key(0), (6, 6)) / 2
X = jax.random.normal(jax.random.key(1), (16, 6))


def loss(w, x):
    return (0.5 * jnp.tanh(jnp.tanh(x @ w) @ w)).sum()


def scanned_loss(w, x):
    """Three layers under ``lax.scan``, the weight a constant of the loop."""
    h, _ = jax.lax.scan(lambda h, _: (jnp.tanh(h @ w) + 0.25, None), x, None, length=3)
    return h.sum()


# name -> (per-device body, unsharded float32 twin). The per-device body sees
# the replicated weight (invariant over "d") and its slice of the batch
# (varying over "d").
PROGRAMS = {
    "matmul": (
        lambda w, x: jax.lax.psum(jnp.tanh(x @ w).sum(0), AXIS),
        lambda w, x: jnp.tanh(x @ w).sum(0),
    ),
    # A literal (weakly typed float32 in the trace) meets a varying float16 value.
    "literal times a varying value": (
        lambda w, x: jax.lax.psum((0.5 * jnp.tanh(x @ w) + 1.0).sum(0), AXIS),
        lambda w, x: (0.5 * jnp.tanh(x @ w) + 1.0).sum(0),
    ),
    # The program sums per-device gradients itself: the weight is made
    # varying first, so each device's gradient is its own.
    "psum of the gradients": (
        lambda w, x: jax.lax.psum(jax.grad(loss)(jax.lax.pcast(w, AXIS, to="varying"), x), AXIS),
        jax.grad(loss),
    ),
    # JAX sums them: the transpose of the cast to varying it inserted where
    # the replicated weight meets the batch.
    "grad inside": (jax.grad(loss), jax.grad(loss)),
    "scan inside": (jax.grad(scanned_loss), jax.grad(scanned_loss)),
}


def check_vma_params(fun, *args) -> list:
    """The ``check_vma`` param of every shard_map in fun's program."""
    return [
        equation.params["check_vma"]
        for equation in jax.make_jaxpr(fun)(*args).jaxpr.eqns
        if equation.primitive.name == "shard_map"
    ]


def run(fun, reference) -> dict:
    """Runs `fun` on (W, X); the error is relative to the largest |reference|."""
    try:
        got = fun(W, X)
    except Exception as error:  # noqa: BLE001 - a failure is a finding, reported by the test
        return {"error": f"{type(error).__name__}: {str(error).splitlines()[0]}"}
    return {
        "relative_error": float(jnp.max(jnp.abs(got - reference)) / jnp.max(jnp.abs(reference))),
        "dtype": str(got.dtype),
        "half_matmul_share": jaxamp.precision_report(fun, W, X).fraction(jnp.float16),
        "psum_operands": psum_operands(fun, W, X),
        "check_vma": check_vma_params(fun, W, X),
    }


def main() -> None:
    assert jax.device_count() == 8, jax.devices()
    mesh = Mesh(np.array(jax.devices()), (AXIS,))
    specs = {"mesh": mesh, "in_specs": (P(), P(AXIS)), "out_specs": P(), "check_vma": True}
    findings = {"jax": jax.__version__}
    for name, (body, twin) in PROGRAMS.items():
        reference = twin(W, X)  # one device, float32
        sharded = jax.shard_map(body, **specs)
        findings[name] = {
            "float32": run(sharded, reference),
            "autocast(shard_map(f))": run(jaxamp.autocast(sharded), reference),
            "shard_map(autocast(f))": run(jax.shard_map(jaxamp.autocast(body), **specs), reference),
        }
    print(json.dumps(findings))


if __name__ == "__main__":
    main()
