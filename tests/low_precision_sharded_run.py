"""`low_precision_optimizer` on 8 virtual CPU devices with FSDP shardings against one device; prints JSON.

Run by tests/test_low_precision_optimizer.py in a fresh process (the device
count is fixed when JAX starts): ``python tests/low_precision_sharded_run.py``.
For stochastic rounding and Kahan, five Adam steps of a small MLP with
bfloat16 params and moments run through `jaxamp.TrainState`, once on one
device and once with the state placed by `jaxamp.fsdp.fsdp_shardings` and the
loss by `jaxamp.fsdp.fsdp_loss`. It reports how the buffers are sharded and
how far the sharded params are from the unsharded ones. With the moments in
8 bits (int8, float8_e4m3fn), it reports where each block's codes and scale
lie, and whether five steps of the sharded state match one device.
"""

import functools
import json
import os
import pathlib
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

import jaxamp
import jaxamp.fsdp
from jaxamp._optimizer.quantized import QuantizedArray

# Every matmul in float32 on both sides: the runs then differ only in the order of cross-device sums.
jax.config.update("jax_default_matmul_precision", "highest")

INPUTS = jax.random.normal(jax.random.key(1), (32, 16))
TARGETS = jnp.sin(INPUTS @ jnp.linspace(-1.0, 1.0, 16 * 8).reshape(16, 8))


def loss_fn(params, inputs, targets):
    params = jax.tree.map(lambda p: p.astype(jnp.float32), params)
    hidden = jnp.tanh(inputs @ params["w1"] + params["b1"])
    return jnp.mean((hidden @ params["w2"] - targets) ** 2)


def initial_params(inputs=16, hidden=64, outputs=8):
    """The bfloat16 params of a one-hidden-layer MLP (the loss's, by default)."""
    keys = jax.random.split(jax.random.key(0), 2)
    params = {
        "w1": 0.3 * jax.random.normal(keys[0], (inputs, hidden)),
        "b1": jnp.zeros((hidden,)),
        "w2": 0.3 * jax.random.normal(keys[1], (hidden, outputs)),
    }
    return jax.tree.map(lambda p: p.astype(jnp.bfloat16), params)


def train(state, step_loss, steps=5, out_shardings=None):
    """`steps` jitted steps; with `out_shardings` (an FSDP loop's placement) the state keeps it."""

    @functools.partial(jax.jit, out_shardings=out_shardings)
    def train_step(state):
        grads = jax.grad(step_loss)(state.params, INPUTS, TARGETS)
        return state.apply_gradients(grads=grads)

    for _ in range(steps):
        state = train_step(state)
    return state


def elementwise_loss(params, inputs, targets):
    """A loss whose gradient needs no sum across devices: sharded and unsharded gradients agree bit for bit."""
    del inputs, targets
    return sum(jnp.sum(jnp.sin(3.0 * p.astype(jnp.float32)) ** 2) for p in jax.tree.leaves(params))


def bit_identical(state, other) -> bool:
    """Whether two train states hold the same params and optimizer state, bit for bit."""
    return all(
        np.asarray(a).tobytes() == np.asarray(b).tobytes()
        for a, b in zip(
            jax.tree.leaves((state.params, state.opt_state)),
            jax.tree.leaves((other.params, other.opt_state)),
            strict=True,
        )
    )


def flat(params):
    return np.concatenate([np.asarray(leaf, np.float32).ravel() for leaf in jax.tree.leaves(params)])


def main():
    mesh = Mesh(np.array(jax.devices()), ("data",))
    results = {"devices": len(jax.devices())}
    for rounding in ("stochastic", "kahan"):
        tx = jaxamp.low_precision_optimizer(optax.adam(1e-2), rounding=rounding, key=3)
        state = jaxamp.TrainState.create(apply_fn=None, params=initial_params(), tx=tx)
        sharded_state = jax.device_put(state, jaxamp.fsdp.fsdp_shardings(state, mesh))

        # 1. The optimizer alone: the same gradients on both sides, so any difference is the wrapper's.
        one_device = train(state, elementwise_loss)
        sharded = train(sharded_state, elementwise_loss)
        param_specs = [str(leaf.sharding.spec) for leaf in jax.tree.leaves(sharded.params)]
        adam = sharded.opt_state.inner_state[0]
        buffers = {"mu": adam.mu, "nu": adam.nu}
        if rounding == "kahan":
            buffers["compensation"] = sharded.opt_state.compensation
        results[rounding] = {
            "param_specs": param_specs,
            "buffers_sharded_like_params": {
                name: [str(leaf.sharding.spec) for leaf in jax.tree.leaves(tree)] == param_specs
                for name, tree in buffers.items()
            },
            "buffer_dtypes": {
                name: sorted({str(leaf.dtype) for leaf in jax.tree.leaves(tree)})
                for name, tree in buffers.items()
            },
            "state_bit_identical": bit_identical(one_device, sharded),
            "params_changed": float(np.mean(flat(one_device.params) != flat(initial_params()))),
        }

        # 2. A small MLP through jaxamp.fsdp.fsdp_loss: the gradients' sums run in another order, and
        # Adam's first steps (about lr * sign(g)) turn a near-zero gradient's flipped sign into a
        # full step; float32 Adam, sharded against unsharded, shows the scale of that.
        mlp_one = train(state, loss_fn)
        mlp_sharded = train(sharded_state, jaxamp.fsdp.fsdp_loss(loss_fn, mesh))
        results[rounding]["mlp_params_max_relative_difference"] = float(
            np.max(np.abs(flat(mlp_one.params) - flat(mlp_sharded.params)))
            / np.max(np.abs(flat(mlp_one.params)))
        )
        results[rounding]["mlp_loss_after"] = [
            float(loss_fn(s.params, INPUTS, TARGETS)) for s in (mlp_one, mlp_sharded)
        ]
    # optax.adam on the same bfloat16 params, without the wrapper, and on float32 params.
    for name, dtype in (("bfloat16", jnp.bfloat16), ("float32", jnp.float32)):
        params = jax.tree.map(lambda p, dtype=dtype: p.astype(dtype), initial_params())
        # TrainState.create refuses plain optax on bfloat16 params, the baseline here: made around float32 ones.
        adam = optax.adam(1e-2)
        float32_params = jax.tree.map(lambda p: p.astype(jnp.float32), params)
        state = jaxamp.TrainState.create(apply_fn=None, params=float32_params, tx=adam)
        state = state.replace(params=params, opt_state=adam.init(params))
        mlp_one = train(state, loss_fn)
        sharded_state = jax.device_put(state, jaxamp.fsdp.fsdp_shardings(state, mesh))
        mlp_sharded = train(sharded_state, jaxamp.fsdp.fsdp_loss(loss_fn, mesh))
        results[f"optax_adam_{name}_mlp_params_max_relative_difference"] = float(
            np.max(np.abs(flat(mlp_one.params) - flat(mlp_sharded.params)))
            / np.max(np.abs(flat(mlp_one.params)))
        )
    results["loss_before"] = float(loss_fn(initial_params(), INPUTS, TARGETS))
    results["two_axis_mesh_quantized_specs"] = two_axis_mesh_quantized_specs()
    for state_format in ("int8", "float8_e4m3fn"):
        results[state_format] = quantized_state_run(mesh, state_format)
        results[f"{state_format}_per_tensor"] = quantized_state_run(mesh, state_format, block_size=None)
        results[f"{state_format}_explicit"] = explicit_mesh_run(state_format)
    print(json.dumps(results))


def quantized_params():
    """Two kernels of 16,384 elements (64 blocks of 256: 8 a device) and a bias too small to quantize."""
    return initial_params(inputs=64, hidden=256, outputs=64)


def blocks_whole_on_each_device(quantized) -> bool:
    """Whether every device holds whole blocks (all of a block's codes) and exactly those blocks' scales.

    A block is `block_size` consecutive elements of the flattened leaf; a device's codes are rows
    ``[start, stop)`` of its first dimension, so elements ``[start, stop) * row`` of the flattened leaf.
    """
    row = int(np.prod(quantized.shape[1:]))
    scales_rows = {shard.device: shard.index[0] for shard in quantized.scales.addressable_shards}
    for shard in quantized.codes.addressable_shards:
        rows = range(*shard.index[0].indices(quantized.shape[0]))
        first, end = rows.start * row, rows.stop * row
        blocks = range(*scales_rows[shard.device].indices(quantized.scales.shape[0]))
        whole = first % quantized.block_size == 0 and end % quantized.block_size == 0
        if not (whole and all(index == slice(None) for index in shard.index[1:])):
            return False
        if (blocks.start, blocks.stop) != (first // quantized.block_size, end // quantized.block_size):
            return False
    return True


def quantized_state_run(mesh, state_format, block_size=256):
    """Five Adam steps with the moments in `state_format` (blocks of `block_size`, or one scale per leaf),
    one device against the state placed by fsdp_shardings."""
    tx = jaxamp.low_precision_optimizer(optax.adam(1e-2), state_dtype=state_format, key=3, block_size=block_size)
    state = jaxamp.TrainState.create(apply_fn=None, params=quantized_params(), tx=tx)
    shardings = jaxamp.fsdp.fsdp_shardings(state, mesh)
    one_device = train(state, elementwise_loss)
    sharded = train(jax.device_put(state, shardings), elementwise_loss, out_shardings=shardings)
    quantized = [
        leaf
        for leaf in jax.tree.leaves(sharded.opt_state, is_leaf=lambda x: isinstance(x, QuantizedArray))
        if isinstance(leaf, QuantizedArray)
    ]
    return {
        "quantized_leaves": len(quantized),
        "codes_specs": sorted({str(q.codes.sharding.spec) for q in quantized}),
        "scales_specs": sorted({str(q.scales.sharding.spec) for q in quantized}),
        "rows_per_device": sorted({q.codes.addressable_shards[0].data.shape[0] for q in quantized}),
        "blocks_whole_on_each_device": all(blocks_whole_on_each_device(q) for q in quantized),
        "state_bit_identical": bit_identical(one_device, sharded),
        "params_changed": float(np.mean(flat(one_device.params) != flat(quantized_params()))),
    }


def two_axis_mesh_quantized_specs():
    """fsdp_shardings of an 8-bit leaf of 4 x 1024 in 16 blocks over the 4-device ``data`` axis of a
    (4, 2) mesh: whole blocks for the axis's 4 devices (not for all 8), so codes and scales split."""
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
    leaf = QuantizedArray(
        jax.ShapeDtypeStruct((4, 1024), jnp.int8), jax.ShapeDtypeStruct((16,), jnp.float32), "int8"
    )
    shardings = jaxamp.fsdp.fsdp_shardings(leaf, mesh, axis="data")
    return [str(shardings.codes.spec), str(shardings.scales.spec)]


def explicit_mesh_run(state_format):
    """The same five steps on a mesh of explicit axes, where each array's type carries its sharding and
    a reshape must say how it splits; then the state of a kernel sharded along its second dimension
    (each shard holding parts of every block), and of one with fewer rows than devices."""
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
    tx = jaxamp.low_precision_optimizer(optax.adam(1e-2), state_dtype=state_format, key=3)
    state = jaxamp.TrainState.create(apply_fn=None, params=quantized_params(), tx=tx)
    one_device = train(state, elementwise_loss)

    def by_columns(shape):
        return {"kernel": jax.device_put(jnp.zeros(shape, jnp.bfloat16), NamedSharding(mesh, PartitionSpec(None, "data")))}

    with jax.set_mesh(mesh):
        shardings = jaxamp.fsdp.fsdp_shardings(state, mesh)
        sharded = train(jax.device_put(state, shardings), elementwise_loss, out_shardings=shardings)
        column_state = jax.jit(tx.init)(by_columns((64, 256)))
        try:
            jax.jit(tx.init)(by_columns((4, 4096)))
            refused = None
        except ValueError as error:
            refused = str(error)
    quantized = [
        leaf
        for leaf in jax.tree.leaves(sharded.opt_state, is_leaf=lambda x: isinstance(x, QuantizedArray))
        if isinstance(leaf, QuantizedArray)
    ]
    column_moment = column_state.inner_state[0].mu["kernel"]
    two_axes = jax.make_mesh((2, 4), ("x", "y"), axis_types=(AxisType.Explicit,) * 2)
    mixed = jax.make_mesh((2, 4), ("e", "a"), axis_types=(AxisType.Explicit, AxisType.Auto))
    placements = {  # name: (mesh, kernel shape, its placement, block size)
        "one_block_by_rows": (mesh, (64, 256), PartitionSpec("data", None), None),
        "two_axes_one_on_each_dimension": (two_axes, (64, 256), PartitionSpec("x", "y"), 256),
        "explicit_and_auto_axes_by_columns": (mixed, (64, 256), PartitionSpec(None, "e"), 256),
        "explicit_and_auto_axes_two_rows": (mixed, (2, 2048), PartitionSpec("e", None), 256),
    }
    return {
        **{name: two_steps_against_one_device(state_format, *placement) for name, placement in placements.items()},
        "block_split_by_a_shard_refused": refusal(state_format, mesh, (8, 640)),
        "compiled_without_set_mesh": {
            name: compiled_without_set_mesh(state_format, mesh, placement, block_size)
            for name, placement, block_size in [
                ("by_columns", PartitionSpec(None, "data"), 256),
                ("one_block_by_rows", PartitionSpec("data", None), None),
            ]
        },
        "quantized_leaves": len(quantized),
        "codes_specs": sorted({str(q.codes.sharding.spec) for q in quantized}),
        "scales_specs": sorted({str(q.scales.sharding.spec) for q in quantized}),
        "blocks_whole_on_each_device": all(blocks_whole_on_each_device(q) for q in quantized),
        "state_bit_identical": bit_identical(one_device, sharded),
        "column_sharded_codes_spec": str(column_moment.codes.sharding.spec),
        "column_sharded_blocks_whole": blocks_whole_on_each_device(column_moment),
        "too_few_rows_refused": refused,
    }


def two_steps_against_one_device(state_format, mesh, shape, placement, block_size):
    """Two Adam steps of one kernel with 8-bit moments in `block_size` blocks, placed on `mesh` (under
    `jax.set_mesh`) against one device: where the codes and scales lie, and whether all matches."""
    tx = jaxamp.low_precision_optimizer(optax.adam(1e-2), state_dtype=state_format, key=3, block_size=block_size)
    params = {"kernel": (0.3 * jax.random.normal(jax.random.key(2), shape)).astype(jnp.bfloat16)}

    def step(params, opt_state):
        grads = jax.tree.map(lambda p: jnp.cos(p.astype(jnp.float32)).astype(p.dtype), params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    def two_steps(params):
        state = (params, jax.jit(tx.init)(params))
        for _ in range(2):
            state = jax.jit(step)(*state)
        return state

    one_device = two_steps(params)
    with jax.set_mesh(mesh):
        sharded = two_steps(jax.tree.map(lambda p: jax.device_put(p, NamedSharding(mesh, placement)), params))
    moment = sharded[1].inner_state[0].mu["kernel"]
    return {
        "codes_spec": str(moment.codes.sharding.spec),
        "scales_spec": str(moment.scales.sharding.spec),
        "bit_identical": all(
            np.asarray(a).tobytes() == np.asarray(b).tobytes()
            for a, b in zip(jax.tree.leaves(one_device), jax.tree.leaves(sharded), strict=True)
        ),
    }


def compiled_without_set_mesh(state_format, mesh, placement, block_size):
    """The codes' and scales' layouts of the update of a 64 x 256 kernel's 8-bit moments, lowered and
    compiled ahead of time from abstract arrays on `mesh` (explicit axes, as `jax.make_mesh` makes by
    default) outside `jax.set_mesh`, as a program is compiled to be read (its collectives, its memory)."""
    tx = jaxamp.low_precision_optimizer(
        optax.adam(1e-2), state_dtype=state_format, key=3, block_size=block_size
    )
    kernel = jax.ShapeDtypeStruct((64, 256), jnp.bfloat16, sharding=NamedSharding(mesh, placement))
    params = {"kernel": kernel}
    with jax.set_mesh(mesh):
        state = jax.eval_shape(tx.init, params)

    def update(params, opt_state, grads):
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    compiled = jax.jit(update).lower(params, state, params).compile()
    moment = compiled.output_shardings[1].inner_state[0].mu["kernel"]
    return [str(moment.codes.spec), str(moment.scales.spec)]


def refusal(state_format, mesh, shape):
    """The message `tx.init` raises for a kernel of `shape` placed by rows on `mesh`, or None."""
    tx = jaxamp.low_precision_optimizer(optax.adam(1e-2), state_dtype=state_format, key=3)
    with jax.set_mesh(mesh):
        kernel = jax.device_put(jnp.zeros(shape, jnp.bfloat16), NamedSharding(mesh, PartitionSpec("data", None)))
        try:
            jax.jit(tx.init)({"kernel": kernel})
        except ValueError as error:
            return str(error)
    return None


if __name__ == "__main__":
    main()
