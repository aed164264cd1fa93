"""Tests for `jaxamp.precision_report`: counts, FLOPs, fractions, text."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxamp


def abstract(shape, dtype=jnp.float32):
    return jax.ShapeDtypeStruct(shape, dtype)


def linen_report(module, input_shape, dtype=jnp.float32):
    inputs = abstract(input_shape, dtype)
    variables = jax.eval_shape(module.init, jax.random.key(0), inputs)
    return jaxamp.precision_report(module.apply, variables, inputs)


@pytest.mark.parametrize(
    "input_shape, features, flops",
    [
        ((4, 6), 5, 2 * 4 * 5 * 6),  # 2 * M * N * K
        ((2, 3, 6), 5, 2 * (2 * 3) * 5 * 6),  # leading dims multiply M
        ((1, 1), 1, 2),
    ],
)
def test_a_dense_layer_is_one_matmul_of_2_m_n_k_flops(input_shape, features, flops):
    report = linen_report(nn.Dense(features), input_shape)
    assert len(report.ops) == 1
    (op,) = report.ops
    assert (op.primitive, op.operand_dtypes, op.output_dtype, op.flops) == (
        "dot_general",
        ("float32", "float32"),
        "float32",
        flops,
    )
    assert report.count_by_dtype() == {"float32": 1}
    assert report.flops_by_dtype() == {"float32": flops}


@pytest.mark.parametrize(
    "conv, input_shape, output_positions, window",
    [
        (nn.Conv(4, (3, 3), padding="SAME"), (2, 8, 8, 3), 2 * 8 * 8, 3 * 3 * 3),
        (nn.Conv(4, (3, 3), padding="VALID"), (2, 8, 8, 3), 2 * 6 * 6, 3 * 3 * 3),
        (nn.Conv(4, (3, 3), strides=2), (2, 8, 8, 3), 2 * 4 * 4, 3 * 3 * 3),
        (nn.Conv(6, (3, 3), feature_group_count=2), (2, 8, 8, 4), 2 * 8 * 8, 3 * 3 * 2),
        (nn.Conv(6, (3, 3), feature_group_count=6), (2, 8, 8, 6), 2 * 8 * 8, 3 * 3 * 1),
        (nn.Conv(5, (3,)), (2, 7, 2), 2 * 7, 3 * 2),
    ],
    ids=["same", "valid", "strided", "grouped", "depthwise", "1d"],
)
def test_a_conv_costs_2_flops_per_output_element_per_kernel_tap(conv, input_shape, output_positions, window):
    report = linen_report(conv, input_shape)
    (op,) = report.ops
    assert op.primitive == "conv_general_dilated"
    assert op.flops == 2 * output_positions * conv.features * window


def test_einsum_with_a_batch_dimension_counts_each_batch():
    report = jaxamp.precision_report(
        functools.partial(jnp.einsum, "bij,bjk->bik"), abstract((2, 3, 4)), abstract((2, 4, 5))
    )
    assert [op.flops for op in report.ops] == [2 * 2 * 3 * 5 * 4]


def two_matmuls(x16, w16, x32, w32):
    return jnp.sum(x16 @ w16) + jnp.sum(x32 @ w32)


def test_fraction_weights_each_dtype_by_flops_not_by_op_count():
    report = jaxamp.precision_report(
        two_matmuls,
        abstract((4, 8), jnp.float16),
        abstract((8, 8), jnp.float16),
        abstract((4, 2)),
        abstract((2, 2)),
    )
    half_flops, full_flops = 2 * 4 * 8 * 8, 2 * 4 * 2 * 2
    assert report.count_by_dtype() == {"float16": 1, "float32": 1}
    assert report.flops_by_dtype() == {"float16": half_flops, "float32": full_flops}
    assert report.fraction(jnp.float16) == pytest.approx(half_flops / (half_flops + full_flops))
    assert report.fraction("float32") == pytest.approx(full_flops / (half_flops + full_flops))
    assert report.fraction(jnp.bfloat16) == 0.0


def test_ops_inside_jit_cond_remat_scan_and_custom_vjp_are_found():
    @jax.custom_vjp
    def custom(x, w):
        return x @ w

    custom.defvjp(lambda x, w: (x @ w, (x, w)), lambda res, g: (g @ res[1].T, res[0].T @ g))

    def nested(x, w):
        y = jax.jit(lambda a: a @ w)(x)
        y = jax.lax.cond(True, lambda a: a @ w, lambda a: a, y)
        y = jax.checkpoint(lambda a: a @ w)(y)
        y, _ = jax.lax.scan(lambda carry, _: (carry @ w, None), y, length=3)
        return custom(y, w)

    report = jaxamp.precision_report(nested, abstract((2, 4), jnp.bfloat16), abstract((4, 4), jnp.bfloat16))
    assert report.count_by_dtype() == {"bfloat16": 5}
    assert report.fraction(jnp.bfloat16) == 1.0


def test_a_function_without_matmuls_reports_nothing():
    report = jaxamp.precision_report(lambda x: jnp.tanh(x) * 2, abstract((3,)))
    assert report.ops == ()
    assert report.count_by_dtype() == {} and report.flops_by_dtype() == {}
    assert report.fraction(jnp.float32) == 0.0
    assert str(report).split() == ["dtype", "ops", "GFLOPs", "share"]


def test_str_is_a_table_of_ops_gflops_and_share_per_dtype():
    report = jaxamp.precision_report(
        two_matmuls,
        abstract((1000, 1000), jnp.float16),
        abstract((1000, 1000), jnp.float16),
        abstract((1000, 1000)),
        abstract((1000, 3000)),
    )
    header, first, second = str(report).splitlines()
    assert header.split() == ["dtype", "ops", "GFLOPs", "share"]
    # Rows come largest share first: float32 has 6 GFLOPs, float16 2.
    assert first.split() == ["float32", "1", "6.0000", "75.0%"]
    assert second.split() == ["float16", "1", "2.0000", "25.0%"]


def test_keyword_arguments_stay_static_python_values():
    def maybe_transposed(x, w, *, transpose):
        return x @ (w.T if transpose else w)  # would fail on a traced flag

    report = jaxamp.precision_report(maybe_transposed, np.ones((2, 3)), np.ones((4, 3)), transpose=True)
    assert [op.flops for op in report.ops] == [2 * 2 * 4 * 3]


def test_nothing_is_computed_only_traced():
    calls = []

    def fun(x):
        calls.append(type(x))
        return x @ x

    jaxamp.precision_report(fun, jnp.ones((3, 3)))
    assert len(calls) == 1 and issubclass(calls[0], jax.core.Tracer)


# --- loops and branches: what one call computes --------------------------------------


def matmul_flops(m, k, n):
    return 2 * m * k * n


def test_a_scan_body_counts_its_flops_once_per_iteration():
    def three_steps(x, w):
        y, _ = jax.lax.scan(lambda carry, _: (carry @ w, None), x, length=3)
        return y

    report = jaxamp.precision_report(three_steps, abstract((2, 4)), abstract((4, 4)))
    (op,) = report.ops
    assert op.flops == 3 * matmul_flops(2, 4, 4)
    assert report.flops_by_dtype() == {"float32": 3 * matmul_flops(2, 4, 4)}


def test_nested_scans_multiply_their_lengths():
    def outer(x, w):
        def inner(carry, _):
            carry, _ = jax.lax.scan(lambda c, _: (c @ w, None), carry, length=3)
            return carry, None

        y, _ = jax.lax.scan(inner, x, length=2)
        return y

    report = jaxamp.precision_report(outer, abstract((2, 4)), abstract((4, 4)))
    assert [op.flops for op in report.ops] == [2 * 3 * matmul_flops(2, 4, 4)]


def test_a_fori_loop_with_a_static_trip_count_is_a_scan_and_counts_every_iteration():
    def five_steps(x, w):
        return jax.lax.fori_loop(0, 5, lambda _, carry: carry @ w, x)

    report = jaxamp.precision_report(five_steps, abstract((2, 4)), abstract((4, 4)))
    assert [op.flops for op in report.ops] == [5 * matmul_flops(2, 4, 4)]


def test_a_while_loop_body_counts_once_since_its_trip_count_is_unknown():
    def until_large(x, w):
        return jax.lax.while_loop(lambda carry: jnp.sum(carry) < 100.0, lambda carry: carry @ w, x)

    report = jaxamp.precision_report(until_large, abstract((2, 4)), abstract((4, 4)))
    assert [op.flops for op in report.ops] == [matmul_flops(2, 4, 4)]


def test_a_cond_with_one_matmul_per_branch_counts_one_not_both():
    def either(pred, x, w):
        return jax.lax.cond(pred, lambda a: a @ w, lambda a: (2 * a) @ w, x)

    report = jaxamp.precision_report(either, abstract((), jnp.bool_), abstract((4, 8)), abstract((8, 8)))
    assert matmul_flops(4, 8, 8) == 512
    assert [op.flops for op in report.ops] == [512]
    assert report.flops_by_dtype() == {"float32": 512}


@pytest.mark.parametrize("heavy_branch", [0, 1], ids=["false_branch_heavier", "true_branch_heavier"])
def test_a_cond_counts_the_branch_with_the_most_flops_whichever_it_is(heavy_branch):
    def light(x16, x32, w32):
        return jnp.broadcast_to(jnp.sum(x16 @ x16.T).astype(jnp.float32), (4, 8))

    def heavy(x16, x32, w32):
        return (x32 @ w32) @ w32

    def either(pred, x16, x32, w32):
        branches = [light, heavy] if heavy_branch == 1 else [heavy, light]
        return jax.lax.cond(pred, branches[1], branches[0], x16, x32, w32)

    report = jaxamp.precision_report(
        either,
        abstract((), jnp.bool_),
        abstract((4, 2), jnp.float16),
        abstract((4, 8)),
        abstract((8, 8)),
    )
    # The heavy branch's two float32 matmuls, not the light one's float16 matmul.
    assert report.count_by_dtype() == {"float32": 2}
    assert report.flops_by_dtype() == {"float32": 2 * matmul_flops(4, 8, 8)}


def test_a_switch_counts_its_heaviest_branch_and_a_scan_multiplies_it():
    def body(carry, index):
        branches = [
            lambda a: a,
            lambda a: a @ carry_weights(a),
            lambda a: (a @ carry_weights(a)) @ carry_weights(a),
        ]
        return jax.lax.switch(index, branches, carry), None

    def carry_weights(a):
        return jnp.eye(a.shape[-1], dtype=a.dtype)

    def loop(x, indices):
        y, _ = jax.lax.scan(body, x, indices)
        return y

    report = jaxamp.precision_report(loop, abstract((2, 4), jnp.bfloat16), abstract((6,), jnp.int32))
    assert [op.flops for op in report.ops] == [6 * matmul_flops(2, 4, 4)] * 2
    assert report.count_by_dtype() == {"bfloat16": 2}


# --- Compiled mode: what XLA runs (jaxamp.diagnostics._hlo_report) -------------------------


class _ConvNet(nn.Module):
    """Two convolutions and a dense head: enough to see every heavy op kind."""

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(8, (3, 3))(x))
        x = nn.relu(nn.Conv(8, (3, 3), strides=2)(x))
        return nn.Dense(4)(x.mean(axis=(1, 2)))


def _gradient_of_mixed_convnet(policy="mixed_float16"):
    model = jaxamp.apply_policy(_ConvNet(), policy)
    images = abstract((2, 8, 8, 3))
    variables = jax.eval_shape(model.init, jax.random.key(0), images)

    def loss(variables, images):
        return model.apply(variables, images).astype(jnp.float32).sum()

    return jax.grad(loss), (variables, images)


def test_on_cpu_the_compiled_report_shows_half_precision_convolutions_run_in_float32():
    gradient, args = _gradient_of_mixed_convnet()
    traced = jaxamp.precision_report(gradient, *args)
    compiled = jaxamp.precision_report(gradient, *args, compiled=True)
    assert jax.default_backend() == "cpu"
    assert traced.fraction(jnp.float16) == 1.0
    convolutions = [op for op in compiled.ops if op.primitive == "convolution"]
    # forward 2, input gradient 1 (the images need none), kernel gradient 2
    assert len(convolutions) == 5
    assert {op.compute_dtype for op in convolutions} == {"float32"}
    assert compiled.fraction(jnp.float16) < 0.5


HAND_WRITTEN_GPU_HLO = """HloModule jit_step, entry_computation_layout={(f16[8,16,16,32]{3,2,1,0})->f16[8,8]{1,0}}

%body (state: (s32[], f16[8,8])) -> (s32[], f16[8,8]) {
  %state = (s32[], f16[8,8]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%state), index=0
  %x = f16[8,8]{1,0} get-tuple-element(%state), index=1
  %gemm = (f16[8,8]{1,0}, s8[4194304]{0}) custom-call(%x, %x), custom_call_target="__cublas$lt$matmul", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"]}}}
  %y = f16[8,8]{1,0} get-tuple-element(%gemm), index=0
  ROOT %next = (s32[], f16[8,8]{1,0}) tuple(%i, %y)
}

%cond (state: (s32[], f16[8,8])) -> pred[] {
  %state = (s32[], f16[8,8]{1,0}) parameter(0)
  ROOT %less = pred[] constant(true)
}

%small (p: f32[4,4]) -> f32[4,4] {
  %p = f32[4,4]{1,0} parameter(0)
  ROOT %d = f32[4,4]{1,0} dot(%p, %p), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%large (p: f32[4,4]) -> f32[4,4] {
  %p = f32[4,4]{1,0} parameter(0)
  %d1 = f32[4,4]{1,0} dot(%p, %p), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %d2 = f32[4,4]{1,0} dot(%d1, %p), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (x: f16[8,16,16,32]) -> f16[8,8] {
  %x = f16[8,16,16,32]{3,2,1,0} parameter(0)
  %w = f16[64,3,3,32]{3,2,1,0} constant({...})
  %fwd = (f16[8,8,8,64]{3,2,1,0}, u8[0]{0}) custom-call(%x, %w), window={size=3x3 stride=2x2 pad=1_1x1_1}, dim_labels=b01f_o01i->b01f, custom_call_target="__cudnn$convForward"
  %y = f16[8,8,8,64]{3,2,1,0} get-tuple-element(%fwd), index=0
  %dw = (f16[64,3,3,32]{3,2,1,0}, u8[0]{0}) custom-call(%x, %y), window={size=3x3 stride=2x2 pad=1_1x1_1}, dim_labels=b01f_o01i->b01f, custom_call_target="__cudnn$convBackwardFilter"
  %dx = (f16[8,16,16,32]{3,2,1,0}, u8[0]{0}) custom-call(%y, %w), window={size=3x3 stride=2x2 pad=1_1x1_1}, dim_labels=b01f_o01i->b01f, custom_call_target="__cudnn$convBackwardInput"
  %m = f16[8,8]{1,0} constant({...})
  %init = (s32[], f16[8,8]{1,0}) tuple(%m, %m)
  %loop = (s32[], f16[8,8]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"5"}}
  %small_input = f32[4,4]{1,0} constant({...})
  %p = pred[] constant(true)
  %branch = f32[4,4]{1,0} conditional(%p, %small_input, %small_input), true_computation=%small, false_computation=%large
  ROOT %out = f16[8,8]{1,0} get-tuple-element(%loop), index=1
}
"""


def test_cudnn_calls_count_the_forward_convolutions_flops_in_each_direction():
    report = jaxamp.diagnostics.hlo_precision_report(HAND_WRITTEN_GPU_HLO)
    forward_flops = 2 * (8 * 8 * 8) * (64 * 3 * 3 * 32)  # 2 * output pixels * kernel size
    by_primitive = {op.primitive: op for op in report.ops}
    for direction in ("convForward", "convBackwardFilter", "convBackwardInput"):
        op = by_primitive[f"__cudnn${direction}"]
        assert (op.operand_dtypes, op.flops) == (("float16", "float16"), forward_flops)


def test_a_loop_body_counts_once_per_known_iteration_and_a_conditional_its_largest_branch():
    report = jaxamp.diagnostics.hlo_precision_report(HAND_WRITTEN_GPU_HLO)
    (gemm,) = [op for op in report.ops if op.primitive == "__cublas$lt$matmul"]
    assert gemm.flops == 5 * 2 * 8 * 8 * 8
    branch_dots = [op for op in report.ops if op.primitive == "dot"]
    assert [op.flops for op in branch_dots] == [2 * 4 * 4 * 4] * 2  # the larger branch's two dots


def test_bytes_accessed_counts_each_kernels_reads_and_writes_but_no_workspace():
    traffic = jaxamp.diagnostics._hlo_report.bytes_accessed(
        """HloModule m

ENTRY %main (a: f32[4,4]) -> f32[4,4] {
  %a = f32[4,4]{1,0} parameter(0)
  %gemm = (f32[4,4]{1,0}, s8[4194304]{0}) custom-call(%a, %a), custom_call_target="__cublas$gemm"
  %c = f32[4,4]{1,0} get-tuple-element(%gemm), index=0
  ROOT %sum = f32[4,4]{1,0} add(%c, %a)
}
"""
    )
    assert traffic == (3 + 3) * 4 * 4 * 4  # gemm: 2 reads + 1 write; add: 2 reads + 1 write


def test_hlo_text_without_an_entry_computation_is_refused_with_the_next_step():
    with pytest.raises(ValueError, match=r"compile\(\)\.as_text\(\)"):
        jaxamp.diagnostics.hlo_precision_report("%not_a_module = f32[] constant(0)")


@pytest.mark.parametrize("policy, half", [("mixed_float16", "float16"), ("mixed_bfloat16", "bfloat16")])
def test_compiled_for_an_h200_without_a_gpu_every_convolution_and_matmul_runs_in_half(policy, half):
    if not jaxamp.diagnostics._gpu_targets.cuda_plugin_available():
        pytest.skip("needs the CUDA PJRT plugin (pip install 'jax-mixed-precision[gpu-aot]')")
    gradient, args = _gradient_of_mixed_convnet(policy)
    report = jaxamp.precision_report(
        gradient, *jaxamp.diagnostics.on_device(args, jaxamp.diagnostics.gpu_target_device("h200")), compiled=True
    )
    cudnn_calls = [op for op in report.ops if op.primitive.startswith("__cudnn$conv")]
    assert len(cudnn_calls) == 5
    assert report.fraction(half) == 1.0
    assert report.count_by_dtype() == {half: len(report.ops)}
