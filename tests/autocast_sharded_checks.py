"""Checks of `jaxamp.autocast` over 8 virtual CPU devices, run by test_autocast_sharded.py.

A device count is fixed when JAX starts, so this runs as its own process
(``XLA_FLAGS=--xla_force_host_platform_device_count=8``) and prints one JSON
line of findings, which the test asserts on.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jaxamp

W = jax.random.normal(jax.random.key(0), (6, 6)) / 2
X = jax.random.normal(jax.random.key(1), (16, 6))


def loss(w, x):
    return jnp.tanh(jnp.tanh(x @ w) @ w).sum()


def looped_loss(w, x):
    """A body with a scan, a cond and a checkpoint, each rewritten inside the shard_map."""
    h, _ = jax.lax.scan(lambda h, _: (jnp.tanh(h @ w), None), x, None, length=3)
    h = jax.lax.cond(h.sum() > 0, lambda h: h @ w, lambda h: -(h @ w), h)
    return jax.checkpoint(lambda h: jnp.tanh(h @ w))(h).sum()


def local_grads(w, x):
    """Per-shard float32 gradients, summed over the devices: a data-parallel step."""
    return jax.lax.psum(jax.grad(loss)(w, x), "d")


def equations(fun, *args):
    """Every equation of fun's program, those of nested jaxprs after the one holding them."""

    def visit(jaxpr):
        for equation in jaxpr.eqns:
            yield equation
            for value in equation.params.values():
                inner = getattr(value, "jaxpr", value)
                if hasattr(inner, "eqns"):
                    yield from visit(inner)

    yield from visit(jax.make_jaxpr(fun)(*args).jaxpr)


def psum_operands(fun, *args) -> list[str]:
    """``primitive:dtype`` of every operand of a psum (any kind) in fun's program."""
    return [
        f"{equation.primitive.name}:{atom.aval.dtype}"
        for equation in equations(fun, *args)
        if "psum" in equation.primitive.name  # psum, or psum_invariant from a transpose
        for atom in equation.invars
    ]


def shard_map_params(fun, *args) -> list[dict]:
    return [
        {key: repr(value) for key, value in equation.params.items() if key != "jaxpr"}
        for equation in equations(fun, *args)
        if equation.primitive.name == "shard_map"
    ]


def finding(fun, reference, *args) -> dict:
    got = fun(*args)
    return {
        "max_abs_error": float(jnp.max(jnp.abs(got - reference))),
        "reference_scale": float(jnp.max(jnp.abs(reference))),
        "dtype": str(got.dtype),
        "half_matmul_share": jaxamp.precision_report(fun, *args).fraction(jnp.float16),
        "psum_operands": psum_operands(fun, *args),
    }


def main() -> None:
    assert jax.device_count() == 8, jax.devices()
    mesh = Mesh(np.array(jax.devices()), ("d",))
    specs = {"mesh": mesh, "in_specs": (P(), P("d")), "out_specs": P()}
    reference = jax.grad(loss)(W, X)  # one device, float32
    # Without varying-axes types, each device's gradient is its own and the
    # program sums them with an explicit psum (as pmap does).
    explicit = jax.shard_map(local_grads, check_vma=False, **specs)
    # With them (the default), JAX sums the replicated weight's gradient itself:
    # the transpose of the pvary it inserted is a psum.
    implicit = jax.shard_map(jax.grad(loss), **specs)
    pmapped = jax.pmap(local_grads, axis_name="d", in_axes=(None, 0))
    x_per_device = X.reshape(8, 2, 6)
    # Each device takes its own branch of the cond: the float32 sharded run is the reference.
    looped = jax.shard_map(jax.grad(looped_loss), **specs)
    looped_reference = looped(W, X)  # run once: eager shard_map runs cost seconds each
    findings = {
        "jax": jax.__version__,
        "float32 explicit psum": finding(explicit, reference, W, X),
        "float32 implicit psum": finding(implicit, reference, W, X),
        "autocast(shard_map) explicit psum": finding(jaxamp.autocast(explicit), reference, W, X),
        "autocast(shard_map) implicit psum": finding(jaxamp.autocast(implicit), reference, W, X),
        "shard_map(autocast) explicit psum": finding(
            jax.shard_map(jaxamp.autocast(local_grads), check_vma=False, **specs), reference, W, X
        ),
        "shard_map(autocast) implicit psum": finding(
            jax.shard_map(jaxamp.autocast(jax.grad(loss)), **specs), reference, W, X
        ),
        "jit(autocast(shard_map))": finding(jax.jit(jaxamp.autocast(implicit)), reference, W, X),
        "float32 scan, cond, checkpoint": finding(looped, looped_reference, W, X),
        "autocast(shard_map) scan, cond, checkpoint": finding(
            jaxamp.autocast(looped), looped_reference, W, X
        ),
        "autocast(pmap)": finding(
            lambda w, x: jaxamp.autocast(pmapped)(w, x)[0], reference, W, x_per_device
        ),
        "params": {
            name: {
                "traced": shard_map_params(fun, W, X),
                "rewritten": shard_map_params(jaxamp.autocast(fun), W, X),
            }
            for name, fun in (("explicit", explicit), ("implicit", implicit))
        },
    }
    print(json.dumps(findings))


if __name__ == "__main__":
    main()
