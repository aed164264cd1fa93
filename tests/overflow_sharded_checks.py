"""Overflow attribution over 8 virtual CPU devices, run by test_overflow_attribution.py.

A device count is fixed when JAX starts, so this runs as its own process
(``XLA_FLAGS=--xla_force_host_platform_device_count=8``) and prints one JSON
line of findings. The 4-layer float16 MLP of the test, one example per
device; only device 3's example carries the loss term whose float16
cotangent overflows in layer 3. Under ``jax.jit`` with the batch sharded,
and under ``jax.shard_map`` with the gradients averaged over the devices,
the attribution must be global: layers 1-3's leaves named once each, and
layer 3's backward pass.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxamp
from tests.overflow_mlp import MODEL, SCALE, WIDTH, init_params, new_state

DEVICES = 8
TERM = jnp.zeros(DEVICES).at[3].set(4.0)  # only device 3's example overflows


def loss_fn(params, x, y, term):
    out, layer_3 = MODEL(params, x)
    return jnp.mean((out - y) ** 2) + jnp.sum(term[:, None] * layer_3)


def jit_step(state, x, y, term):
    _, grads, finite, record = jaxamp.scaled_value_and_grad(loss_fn, state.loss_scale, record_overflow=True)(
        state.params, x, y, term
    )
    return state.apply_gradients(grads=grads, grads_finite=finite), record


def shard_map_step(mesh):
    def per_device(params, x, y, term):
        _, grads, _, record = jaxamp.scaled_value_and_grad(
            loss_fn, jaxamp.StaticLossScale(SCALE), record_overflow=True
        )(params, x, y, term)
        grads = jax.lax.pmean(grads, "d")
        record = jax.tree.map(lambda amax: jax.lax.pmax(amax, "d"), record)
        return grads, record

    return jax.shard_map(
        per_device, mesh=mesh, in_specs=(P(), P("d"), P("d"), P("d")), out_specs=(P(), P()), check_vma=False
    )


def finding(state, record) -> dict:
    first = record.first_overflow()
    return {
        "skipped": int(state.skipped_steps),
        "nonfinite_paths": state.nonfinite_grads.nonfinite_paths(),
        "first_overflow": None if first is None else [first.site.name, first.pass_],
    }


def main() -> None:
    assert jax.device_count() == DEVICES, jax.devices()
    mesh = Mesh(jax.devices(), ("d",))
    batch = NamedSharding(mesh, P("d"))
    x = jax.device_put(jax.random.normal(jax.random.key(1), (DEVICES, WIDTH)), batch)
    y = jax.device_put(jnp.zeros((DEVICES, WIDTH)), batch)
    term = jax.device_put(TERM, batch)
    params = init_params(jax.random.key(0))
    findings = {}

    state, record = jax.jit(jit_step)(new_state(params), x, y, term)
    findings["jit"] = finding(state, record)

    grads, record = jax.jit(shard_map_step(mesh))(params, x, y, term)
    state = new_state(params).apply_gradients(grads=grads)
    findings["shard_map"] = finding(state, record)
    print(json.dumps(findings))


if __name__ == "__main__":
    main()
