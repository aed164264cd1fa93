"""Collective dtypes and bytes per training step, per FSDP communication setting, on 8 devices.

One training step (loss, gradients, Adam update through `jaxamp.TrainState`)
of a small GPT-like model (token embedding, pre-norm causal self-attention,
GELU MLP, tied output embedding) under the ``mixed_bf16`` policy, with
params and optimizer state sharded over 8 devices (`jaxamp.fsdp.fsdp_shardings`)
and the batch split over the same axis, compiled for each setting:

* ``jit + shardings``: the step as users write it today, plain ``jax.jit``
  over the sharded arrays; XLA's partitioner places the collectives;
* ``fsdp_loss`` with ``CommunicationPolicy()`` (each parameter's own
  dtype, float32 both ways), with ``from_policy("mixed_bf16")``
  (bfloat16 gathers, float32 sums: the policy's default) and with
  ``gather=bf16,reduce=bf16,allow_narrow_reduce`` (bfloat16 sums), and
  with FP8 weight gathers, ``from_policy("mixed_bf16",
  gather_dtype="float8_e4m3fn")``: the matmul weights (every leaf of two or
  more dimensions, embeddings included) gathered in float8_e4m3fn with one
  global scale each, from one float32 all-reduce (``pmax``) of their amaxes,
  the vectors in bfloat16.

For each, the collectives of the program as XLA's SPMD partitioner leaves
it (what every backend receives) and of the CPU executable (XLA on CPU
widens bfloat16 collectives to float32), and with ``--gpu NAME`` of the
program compiled for 8 such GPUs without one (the CUDA PJRT plugin
needed). Bytes are per device and per step: for an all-gather what it
receives (the gathered parameters), for a reduce-scatter or all-reduce what
it hands in (the gradients to sum). The last lines compare the FP8 gathers
with the bfloat16 ones: all-gather bytes received plus the amax all-reduce.

The 8 devices are virtual CPU devices, asked of JAX before its CPU backend
starts. Writes communication_bytes.txt (the tables) and
communication_bytes.json (the numbers).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import jaxamp
from experiments.flags import positive_int
from experiments.measure.gpu_target import target_device
from jaxamp.diagnostics import collective_totals, compile_with_partitioned_hlo
from jaxamp.fsdp import fp8_gather_eligible, shard_dimension

DEVICES = 8
AXIS = "data"
POLICY = "mixed_bf16"
SETTINGS = {
    "jit + shardings": None,
    "fsdp_loss gather=param,reduce=param": jaxamp.fsdp.CommunicationPolicy(),
    "fsdp_loss gather=bf16,reduce=f32": jaxamp.fsdp.CommunicationPolicy.from_policy(POLICY),
    "fsdp_loss gather=bf16,reduce=bf16": jaxamp.fsdp.CommunicationPolicy(
        gather_dtype="bf16", reduce_dtype="bf16", allow_narrow_reduce=True
    ),
    "fsdp_loss gather=fp8,reduce=f32": jaxamp.fsdp.CommunicationPolicy.from_policy(
        POLICY, gather_dtype="float8_e4m3fn"
    ),
}
BF16_GATHERS, FP8_GATHERS = "fsdp_loss gather=bf16,reduce=f32", "fsdp_loss gather=fp8,reduce=f32"


class Block(nn.Module):
    """Pre-norm decoder block: causal self-attention and a GELU MLP."""

    width: int
    heads: int

    @nn.compact
    def __call__(self, x):
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2], jnp.int32))
        x = x + nn.SelfAttention(num_heads=self.heads, use_bias=False)(nn.LayerNorm()(x), mask=mask)
        hidden = nn.gelu(nn.Dense(4 * self.width)(nn.LayerNorm()(x)))
        return x + nn.Dense(self.width)(hidden)


class TinyGPT(nn.Module):
    """Token embedding, decoder blocks, final norm, tied output embedding."""

    vocab: int = 256
    width: int = 64
    depth: int = 2
    heads: int = 4
    context: int = 32

    @nn.compact
    def __call__(self, tokens):
        embed = nn.Embed(self.vocab, self.width)
        position = self.param("position", nn.initializers.normal(0.02), (self.context, self.width))
        x = embed(tokens) + position[: tokens.shape[1]]
        for _ in range(self.depth):
            x = Block(self.width, self.heads)(x)
        return embed.attend(nn.LayerNorm()(x))


def make_step(model, communication, mesh):
    """A train step: next-token loss, gradients, Adam update."""

    def loss_fn(params, tokens):
        logits = model.apply({"params": params}, tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    if communication is not None:
        loss_fn = jaxamp.fsdp.fsdp_loss(loss_fn, mesh, communication, axis=AXIS)

    def train_step(state, tokens):
        loss, grads, grads_finite = jaxamp.scaled_value_and_grad(loss_fn, state.loss_scale)(
            state.params, tokens
        )
        return state.apply_gradients(grads=grads, grads_finite=grads_finite), loss

    return train_step


def abstract_inputs(model, mesh, batch_size, context):
    """The sharded state and batch as ShapeDtypeStructs on `mesh`."""
    tokens = jnp.zeros((batch_size, context + 1), jnp.int32)
    params = jax.eval_shape(lambda: model.init(jax.random.key(0), tokens[:, :-1])["params"])
    state = jax.eval_shape(
        lambda params: jaxamp.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-3)),
        params,
    )
    shardings = jaxamp.fsdp.fsdp_shardings(state, mesh, axis=AXIS)
    state = jax.tree.map(
        lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding),
        state,
        shardings,
    )
    batch_sharding = NamedSharding(mesh, PartitionSpec(AXIS))
    tokens = jax.ShapeDtypeStruct(tokens.shape, tokens.dtype, sharding=batch_sharding)
    return state, tokens


def totals_as_dicts(hlo_text):
    return [vars(total) for total in collective_totals(hlo_text)]


def measure(mesh, batch_size, *, depth=2, cpu_stages=True, settings=None):
    """Collectives per setting (of `SETTINGS`, or `settings`) and HLO stage, as JSON-ready dicts."""
    # Programs served by a persistent compilation cache are not compiled, so XLA
    # would write no partitioned module to read.
    jax.config.update("jax_enable_compilation_cache", False)
    gpt = TinyGPT(depth=depth)
    model = jaxamp.apply_policy(gpt, POLICY)
    state, tokens = abstract_inputs(model, mesh, batch_size, gpt.context)
    param_count = sum(int(np.prod(leaf.shape)) for leaf in jax.tree.leaves(state.params))
    sharded_param_count = sum(
        int(np.prod(leaf.shape))
        for leaf in jax.tree.leaves(state.params)
        if shard_dimension(leaf.shape, mesh.shape[AXIS]) is not None
    )
    fp8_param_count = sum(
        int(np.prod(leaf.shape))
        for path, leaf in jax.tree_util.tree_leaves_with_path(state.params)
        if fp8_gather_eligible(
            path, leaf.shape, leaf.dtype, shard_dimension(leaf.shape, mesh.shape[AXIS]) is not None
        )
    )
    fp8_weight_count = sum(
        fp8_gather_eligible(
            path, leaf.shape, leaf.dtype, shard_dimension(leaf.shape, mesh.shape[AXIS]) is not None
        )
        for path, leaf in jax.tree_util.tree_leaves_with_path(state.params)
    )
    rows = []
    for setting, communication in (SETTINGS if settings is None else settings).items():
        lowered = jax.jit(make_step(model, communication, mesh)).lower(state, tokens)
        stages = {}
        if cpu_stages:
            compiled, partitioned = compile_with_partitioned_hlo(lowered)
            stages["partitioned"] = totals_as_dicts(partitioned)
            stages["compiled cpu"] = totals_as_dicts(compiled.as_text())
        else:
            stages["compiled"] = totals_as_dicts(lowered.compile().as_text())
        rows.append({"setting": setting, "communication": str(communication), "stages": stages})
    return {
        "param_count": param_count,
        "sharded_param_count": sharded_param_count,
        "fp8_param_count": fp8_param_count,
        "fp8_weight_count": fp8_weight_count,
        "devices": mesh.size,
        "batch_size": batch_size,
        "rows": rows,
    }


def _cell(totals, kinds):
    parts = [
        f"{total['dtype']} {total['operand_bytes' if total['kind'] != 'all-gather' else 'result_bytes']:,}"
        for total in totals
        if total["kind"] in kinds
    ]
    return " + ".join(parts) or "-"


def format_table(report, title):
    header = (
        "| setting | HLO | all-gather (bytes received) | reduce-scatter (bytes sent) "
        "| all-reduce (bytes sent) |"
    )
    lines = [
        (
            f"{title}: {report['param_count']:,} parameters (float32), {report['devices']} devices, "
            f"batch {report['batch_size']}, policy {POLICY}; bytes per device per step"
        ),
        "",
        header,
        "|---|---|---|---|---|",
    ]
    for row in report["rows"]:
        for stage, totals in row["stages"].items():
            lines.append(
                f"| {row['setting']} | {stage} | {_cell(totals, {'all-gather'})} | "
                f"{_cell(totals, {'reduce-scatter'})} | {_cell(totals, {'all-reduce'})} |"
            )
    return "\n".join(lines)


def gathered_bytes(report, setting, stage):
    """All-gather bytes received plus the float32 all-reduces beyond the bfloat16-gather program's.

    The extra all-reduce of FP8 gathers is the amax vector (one float32 per
    FP8 weight); the loss and finite-flag all-reduces are in both programs.
    """

    def totals(name):
        row = next(row for row in report["rows"] if row["setting"] == name)
        return row["stages"][stage]

    def summed(name, kind, dtype=None):
        return sum(
            total["result_bytes" if kind == "all-gather" else "operand_bytes"]
            for total in totals(name)
            if total["kind"] == kind and dtype in (None, total["dtype"])
        )

    amax = summed(setting, "all-reduce", "float32") - summed(BF16_GATHERS, "all-reduce", "float32")
    return summed(setting, "all-gather") + amax, amax


def format_ratio(report):
    """The FP8 gathers' bytes against the bfloat16 gathers', per HLO stage."""
    if not any(row["setting"] == FP8_GATHERS for row in report["rows"]):
        return ""
    lines = [
        (
            f"FP8 gathers: {report['fp8_weight_count']} weights ({report['fp8_param_count']:,} of "
            f"{report['sharded_param_count']:,} sharded parameters) in float8_e4m3fn, the rest in bfloat16; "
            "bytes received by the all-gathers plus the amax all-reduce, per device per step:"
        )
    ]
    stages = next(row for row in report["rows"] if row["setting"] == FP8_GATHERS)["stages"]
    for stage in stages:
        fp8, amax = gathered_bytes(report, FP8_GATHERS, stage)
        bf16, _ = gathered_bytes(report, BF16_GATHERS, stage)
        lines.append(
            f"- {stage}: FP8 {fp8:,} (amax all-reduce {amax:,}) against bfloat16 {bf16:,}: "
            f"{fp8 / bf16:.3f}x (target at most 0.55x: {'met' if fp8 <= 0.55 * bf16 else 'missed'})"
        )
    return "\n".join(lines)


def gpu_mesh(name):
    from jax.experimental import topologies  # pylint: disable=import-outside-toplevel

    topology = topologies.get_topology_desc(
        platform="cuda",
        target_config=jaxamp.diagnostics.gpu_spec(name).target_config(),
        topology=f"1x1x{DEVICES}",
    )
    return Mesh(np.array(topology.devices), (AXIS,))


def add_arguments(parser) -> None:
    parser.add_argument("--batch-size", type=positive_int, default=8, help="sequences per step")
    parser.add_argument("--depth", type=positive_int, default=2, help="decoder blocks of the model")
    parser.add_argument(
        "--gpu", help="also compile for 8 GPUs of this name (e.g. h200) without one (default: none)"
    )


def run(args, out) -> None:
    jax.config.update("jax_num_cpu_devices", DEVICES)  # before the CPU backend starts
    if jax.device_count("cpu") < DEVICES:
        raise SystemExit(f"error: needs {DEVICES} CPU devices, JAX has {jax.device_count('cpu')}.")
    reports = {
        "cpu": measure(
            Mesh(np.array(jax.devices("cpu")[:DEVICES]), (AXIS,)), args.batch_size, depth=args.depth
        )
    }
    out.print(format_table(reports["cpu"], f"{DEVICES} virtual CPU devices"))
    out.print()
    out.print(format_ratio(reports["cpu"]))
    if args.gpu:
        target_device(args.gpu)  # the CUDA plugin missing: what to install, in one line
        reports[args.gpu] = measure(gpu_mesh(args.gpu), args.batch_size, depth=args.depth, cpu_stages=False)
        out.print()
        out.print(format_table(reports[args.gpu], f"{DEVICES} x {args.gpu} (compiled without a GPU)"))
        out.print()
        out.print(format_ratio(reports[args.gpu]))
    out.save_printed("communication_bytes.txt")
    out.write_json("communication_bytes.json", reports)
