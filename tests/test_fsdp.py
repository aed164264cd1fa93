"""Sharded training with mixed-precision communication (`jaxamp.fsdp`).

The settings, their parsing and their errors are checked here, on this
process's devices. What the programs communicate and compute is checked on
8 virtual CPU devices, in two fresh processes (a device count is fixed when
JAX starts): `python -m experiments.measure communication-bytes` reads the collectives of one
train step of a small GPT-like model per setting, and
`tests/fsdp_parity_run.py` compares sharded with unsharded training. Both
start in the background as soon as the tests are collected
(tests/fresh_processes.py).
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fresh_processes import FreshProcess, xla_flags
from jax.sharding import AxisType, Mesh, PartitionSpec

import jaxamp
from jaxamp.diagnostics import Collective, collective_totals, collectives
from jaxamp.fsdp import is_narrower, shard_dimension

RTOL = 1e-5


def one_device_mesh(axis="data"):
    return Mesh(np.array(jax.devices()[:1]), (axis,))


# --- the policy value -------------------------------------------------------


def test_from_policy_gathers_in_the_compute_dtype_and_sums_in_the_param_dtype():
    communication = jaxamp.fsdp.CommunicationPolicy.from_policy("mixed_bf16")
    assert (communication.gather_dtype, communication.reduce_dtype) == (jnp.bfloat16, jnp.float32)
    assert str(communication) == "gather=bfloat16,reduce=float32"
    assert jaxamp.fsdp.get_communication_policy(str(communication)) == communication
    assert hash(communication) == hash(jaxamp.fsdp.get_communication_policy("g=bf16,r=f32"))

    default = jaxamp.fsdp.CommunicationPolicy()
    assert default == jaxamp.fsdp.get_communication_policy(None) == jaxamp.fsdp.get_communication_policy("param")
    assert default.gather_dtype_for(jnp.float32) == default.reduce_dtype_for(jnp.float32) == jnp.float32
    assert default.reduce_dtype_for(jnp.bfloat16) == jnp.bfloat16
    narrow = jaxamp.fsdp.get_communication_policy("gather=bf16, reduce=bf16, allow_narrow_reduce")
    assert narrow.allow_narrow_reduce and jaxamp.fsdp.get_communication_policy(str(narrow)) == narrow


def test_a_narrower_reduce_dtype_is_fewer_bits_or_another_format_of_as_many():
    assert is_narrower(jnp.bfloat16, jnp.float32) and is_narrower(jnp.float16, jnp.float32)
    assert is_narrower(jnp.bfloat16, jnp.float16) and is_narrower(jnp.float16, jnp.bfloat16)
    assert not is_narrower(jnp.float32, jnp.float32) and not is_narrower(jnp.float32, jnp.bfloat16)


@pytest.mark.parametrize(
    "make, error, words",
    [
        (lambda: jaxamp.fsdp.CommunicationPolicy(reduce_dtype=jnp.int32), ValueError, ["reduce_dtype", "int32", "bf16"]),
        (lambda: jaxamp.fsdp.CommunicationPolicy(gather_dtype="int8"), ValueError, ["'int8'", "bfloat16", "param"]),
        (lambda: jaxamp.fsdp.CommunicationPolicy(allow_narrow_reduce="yes"), TypeError, ["'yes'", "True or False"]),
        (lambda: jaxamp.fsdp.get_communication_policy("gather=bf16,scatter=f32"), ValueError,
         ["'scatter'", "gather, g, reduce, r", "'gather=bf16,reduce=f32'"]),
        (lambda: jaxamp.fsdp.get_communication_policy(3), TypeError, ["int", "gather=bf16,reduce=f32"]),
        (lambda: jaxamp.fsdp.fsdp_loss(lambda p: 0.0, one_device_mesh(), axis="model"), ValueError,
         ["'model'", "('data',)", "axis="]),
        (lambda: jaxamp.fsdp.fsdp_shardings({}, "data"), TypeError, ["jax.sharding.Mesh", "str"]),
    ],
)  # fmt: skip
def test_bad_settings_name_the_value_and_the_choices(make, error, words):
    with pytest.raises(error) as raised:
        make()
    assert all(word in str(raised.value) for word in words), str(raised.value)


# --- the layout -------------------------------------------------------------


def test_each_leaf_splits_along_its_largest_divisible_dimension_or_is_replicated():
    assert shard_dimension((64, 256), 8) == 1
    assert shard_dimension((256, 64), 8) == 0
    assert shard_dimension((64, 64), 8) == 0  # the first of equals
    assert shard_dimension((3, 16), 8) == 1
    assert shard_dimension((3,), 8) is None and shard_dimension((), 8) is None
    mesh = one_device_mesh()
    state = {"kernel": jnp.zeros((4, 6)), "step": jnp.zeros([], jnp.int32)}
    shardings = jaxamp.fsdp.fsdp_shardings(state, mesh)
    assert shardings["kernel"].spec == PartitionSpec(None, "data")  # every size divides by 1
    assert shardings["step"].spec == PartitionSpec()


# --- the loss on one device ---------------------------------------------------


def quadratic_loss(params, inputs):
    return jnp.mean((inputs @ params["kernel"] + params["bias"]) ** 2)


QUADRATIC_PARAMS = {"kernel": jnp.arange(6.0).reshape(3, 2) / 6, "bias": jnp.ones(2)}
QUADRATIC_INPUTS = jnp.arange(12.0).reshape(4, 3) / 12


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
def test_on_one_device_the_sharded_loss_and_gradients_are_the_plain_ones(axis_type):
    """Explicit mesh axes type arrays by their sharding: fsdp_loss places its inputs itself."""
    mesh = Mesh(np.array(jax.devices()[:1]), ("data",), axis_types=(axis_type,))
    sharded = jaxamp.fsdp.fsdp_loss(quadratic_loss, mesh, "gather=bf16,reduce=f32")
    loss, grads = jax.jit(jax.value_and_grad(sharded))(QUADRATIC_PARAMS, QUADRATIC_INPUTS)
    rounded = jax.tree.map(lambda leaf: leaf.astype(jnp.bfloat16), QUADRATIC_PARAMS)
    expected_loss, expected_grads = jax.value_and_grad(quadratic_loss)(rounded, QUADRATIC_INPUTS)
    assert loss == pytest.approx(float(expected_loss), rel=1e-2)
    assert {leaf.dtype for leaf in jax.tree.leaves(grads)} == {jnp.dtype(jnp.float32)}
    for grad, expected in zip(jax.tree.leaves(grads), jax.tree.leaves(expected_grads)):
        np.testing.assert_allclose(grad, np.asarray(expected, np.float32), rtol=2e-2)


def test_a_reduce_dtype_narrower_than_a_param_is_refused_unless_asked():
    """Fails if the default let float32 gradients be summed in bfloat16 silently."""
    narrow = jaxamp.fsdp.fsdp_loss(quadratic_loss, one_device_mesh(), "gather=bf16,reduce=bf16")
    with pytest.raises(ValueError) as raised:
        jax.jit(jax.grad(narrow))(QUADRATIC_PARAMS, QUADRATIC_INPUTS)
    message = str(raised.value)
    for words in ("['bias']", "float32", "bfloat16", "allow_narrow_reduce=True", "reduce_dtype=None"):
        assert words in message, message

    allowed = jaxamp.fsdp.fsdp_loss(
        quadratic_loss, one_device_mesh(), "gather=bf16,reduce=bf16,allow_narrow_reduce"
    )
    grads = jax.jit(jax.grad(allowed))(QUADRATIC_PARAMS, QUADRATIC_INPUTS)
    assert {leaf.dtype for leaf in jax.tree.leaves(grads)} == {jnp.dtype(jnp.float32)}

    bfloat16_params = jax.tree.map(lambda leaf: leaf.astype(jnp.bfloat16), QUADRATIC_PARAMS)
    same_width = jaxamp.fsdp.fsdp_loss(quadratic_loss, one_device_mesh(), "reduce=bf16")
    assert jax.jit(jax.grad(same_width))(bfloat16_params, QUADRATIC_INPUTS)["bias"].dtype == jnp.bfloat16


def test_a_loss_that_is_not_a_scalar_or_an_aux_that_is_not_a_float_is_refused():
    vector = jaxamp.fsdp.fsdp_loss(lambda params, inputs: inputs @ params["kernel"], one_device_mesh())
    with pytest.raises(TypeError, match=r"scalar loss; got shape \(4, 2\)"):
        jax.jit(vector)(QUADRATIC_PARAMS, QUADRATIC_INPUTS)
    counting = jaxamp.fsdp.fsdp_loss(
        lambda params, inputs: (quadratic_loss(params, inputs), {"count": jnp.sum(inputs > 0)}),
        one_device_mesh(),
        has_aux=True,
    )
    with pytest.raises(TypeError, match=r"aux leaf \['count'\] is int32"):
        jax.jit(counting)(QUADRATIC_PARAMS, QUADRATIC_INPUTS)


# --- the collectives reader ---------------------------------------------------

_HLO = """HloModule example, entry_computation_layout={()->f32[]}

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %sum = f32[] add(%a, %b)
}

%body (state: (s32[], f32[64])) -> (s32[], f32[64]) {
  %state = (s32[], f32[64]) parameter(0)
  %grad = f32[64] get-tuple-element(%state), index=1
  %summed = f32[8] reduce-scatter(%grad), replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}, to_apply=%add
  ROOT %next = (s32[], f32[64]) tuple(%state)
}

%condition (state: (s32[], f32[64])) -> pred[] {
  %state = (s32[], f32[64]) parameter(0)
  ROOT %go = pred[] constant(true)
}

ENTRY %main (w: bf16[8,4], b: bf16[2], g: f32[64]) -> f32[] {
  %w = bf16[8,4] parameter(0)
  %b = bf16[2] parameter(1)
  %g = f32[64] parameter(2)
  %start = ((bf16[8,4], bf16[2]), (bf16[64,4], bf16[16])) all-gather-start(%w, %b), dimensions={0}
  %done = (bf16[64,4], bf16[16]) all-gather-done(%start)
  %reduced = f32[64] all-reduce-start(%g), to_apply=%add
  %init = (s32[], f32[64]) tuple(%g, %g)
  %loop = (s32[], f32[64]) while(%init), condition=%condition, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  ROOT %out = f32[] constant(0)
}
"""


def test_collectives_are_read_from_combined_async_and_looped_instructions():
    assert collectives(_HLO) == [
        Collective("all-gather", "bfloat16", 64, 512),
        Collective("all-gather", "bfloat16", 4, 32),
        Collective("all-reduce", "float32", 256, 256),
        Collective("reduce-scatter", "float32", 256, 32, count=3),
    ]
    totals = {(total.kind, total.dtype): total for total in collective_totals(_HLO)}
    assert [key[0] for key in totals] == ["all-gather", "reduce-scatter", "all-reduce"]
    assert totals["all-gather", "bfloat16"].result_bytes == 544
    assert totals["reduce-scatter", "float32"].operand_bytes == 768


# --- 8 virtual CPU devices -------------------------------------------------------


# Each command asks JAX for the 8 devices itself, with the suite's XLA_FLAGS and nothing else inherited.
COMMUNICATION = FreshProcess(
    "communication_report", "-m", "experiments.measure", "communication-bytes", "--depth", "1", "--out", "{dir}/out",
    env={"XLA_FLAGS": xla_flags()},
)  # fmt: skip
PARITY = FreshProcess("parity", "tests/fsdp_parity_run.py", env={"XLA_FLAGS": xla_flags()})


def finished(fresh_process):
    process = fresh_process.result()
    assert process.returncode == 0, process.stderr[-4000:]
    return process.stdout


@pytest.fixture(scope="module")
def communication_report():
    stdout = finished(COMMUNICATION)
    assert "| fsdp_loss gather=bf16,reduce=f32 | partitioned | bfloat16" in stdout
    with open(f"{COMMUNICATION.directory}/out/communication_bytes.json", encoding="utf-8") as report:
        return json.load(report)["cpu"]


def totals_of(report, setting, stage):
    row = next(row for row in report["rows"] if row["setting"] == setting)
    totals = {}
    for total in row["stages"][stage]:
        totals.setdefault(total["kind"], {})[total["dtype"]] = total
    return totals


def test_bfloat16_gathers_move_half_the_bytes_and_gradients_are_summed_in_float32(communication_report):
    """Read from the partitioned program: the collectives every backend receives.

    Fails if the gather cast moved after the all-gather (float32 bytes), if
    gradients were summed in bfloat16 by default, or if a parameter were
    gathered twice or not at all.
    """
    sharded_floats = communication_report["sharded_param_count"]
    full = totals_of(communication_report, "fsdp_loss gather=param,reduce=param", "partitioned")
    mixed = totals_of(communication_report, "fsdp_loss gather=bf16,reduce=f32", "partitioned")
    narrow = totals_of(communication_report, "fsdp_loss gather=bf16,reduce=bf16", "partitioned")

    assert set(full["all-gather"]) == {"float32"}
    assert full["all-gather"]["float32"]["result_bytes"] == 4 * sharded_floats
    assert set(mixed["all-gather"]) == set(narrow["all-gather"]) == {"bfloat16"}
    assert mixed["all-gather"]["bfloat16"]["result_bytes"] == 2 * sharded_floats
    half = mixed["all-gather"]["bfloat16"]["result_bytes"]
    assert 2 * half == full["all-gather"]["float32"]["result_bytes"]

    assert set(full["reduce-scatter"]) == set(mixed["reduce-scatter"]) == {"float32"}
    assert mixed["reduce-scatter"]["float32"]["operand_bytes"] == 4 * sharded_floats
    assert set(narrow["reduce-scatter"]) == {"bfloat16"}  # asked for, with allow_narrow_reduce
    assert narrow["reduce-scatter"]["bfloat16"]["operand_bytes"] == 2 * sharded_floats
    for totals in (full, mixed, narrow):
        # What remains all-reduced is the loss and the finite flag, not gradients.
        assert sum(total["operand_bytes"] for total in totals["all-reduce"].values()) < 64


def test_plain_jit_with_shardings_sums_full_gradients_where_fsdp_loss_scatters_them(communication_report):
    """Today's XLA, recorded: plain ``jit`` all-reduces every gradient in full.

    The partitioned plain program sums the bfloat16 gradients of the
    bfloat16 compute copies in bfloat16 (JAX issue 27496); the CPU
    executable widens those sums to float32 afterwards, as it does every
    bfloat16 collective, while fsdp_loss's programs keep their shape: one
    reduce-scatter of each gradient.
    """
    sharded_floats = communication_report["sharded_param_count"]
    plain = totals_of(communication_report, "jit + shardings", "partitioned")
    assert "reduce-scatter" not in plain
    assert plain["all-reduce"]["bfloat16"]["operand_bytes"] >= 2 * sharded_floats * 0.9

    for setting in ("fsdp_loss gather=param,reduce=param", "fsdp_loss gather=bf16,reduce=f32"):
        compiled = totals_of(communication_report, setting, "compiled cpu")
        assert compiled["reduce-scatter"]["float32"]["operand_bytes"] == 4 * sharded_floats
        assert compiled["all-gather"]["float32"]["result_bytes"] == 4 * sharded_floats


@pytest.fixture(scope="module")
def parity():
    return json.loads(finished(PARITY).strip().splitlines()[-1])


def test_sharded_training_on_eight_devices_equals_one_device(parity):
    """Loss, aux, gradients and three Adam steps in float32, within 1e-5.

    Fails if a gradient were summed twice (8x) or not averaged (a device's
    share of the loss), or a replicated parameter's sum went missing.
    """
    assert parity["param_specs"]["['Dense_1']['bias']"] == "P()"  # 3 outputs: replicated
    assert parity["param_specs"]["['Dense_0']['kernel']"] == "P(None, 'data')"
    for key in ("loss", "accuracy", "grads", "train_losses", "train_params", "train_opt_state"):
        assert parity[key] < RTOL, (key, parity[key])
    assert parity["grad_specs_match_params"]


def test_a_replicated_parameter_is_summed_in_the_reduce_dtype(parity):
    """Dense_1's bias (3 floats, no dimension divides by 8) is all-reduced, not gathered."""
    assert ["float32", 12] in parity["replicated_sums_default"]
    assert ["bfloat16", 6] in parity["replicated_sums_narrow"]
    assert ["float32", 12] not in parity["replicated_sums_narrow"]


def test_autocast_composes_inside_and_an_indivisible_batch_is_named(parity):
    assert parity["autocast_bf16_loss"] < 1e-2
    assert parity["autocast_bf16_grad_dtypes"] == ["float32"]
    message = parity["indivisible_batch_error"]
    assert "Batch argument 'images', of shape (12, 32)" in message
    assert "multiple of 8" in message
