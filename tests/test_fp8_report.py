"""Proof that FP8 ran: the compiled report's FP8 rows and `jaxamp.diagnostics.check_fp8`.

Two kinds of tests. Parsing tests read HLO text as XLA prints it (cut from
programs compiled for an H200 with jax 0.10.2's CUDA plugin) and run
anywhere. Compiled tests build small FP8 programs with plain ``lax``
(operands ``float8_e4m3fn``/``float8_e5m2``, the ``ANY_F8_ANY_F8_F32``
dot algorithm, a ``custom_vjp`` for the backward GEMMs), compile them for
an H200 without a GPU and skip without the CUDA plugin.
"""

import warnings

import jax
import jax.numpy as jnp
import pytest
from jax import lax

import jaxamp
from experiments.measure import fp8_scaling_cost
from jaxamp.diagnostics import _hlo_report as hlo_report

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
FP8_PRESET = lax.DotAlgorithmPreset.ANY_F8_ANY_F8_F32

# A forward FP8 GEMM as XLA for an H200 prints it: a (32, 64) x (64, 48)
# product of e4m3 operands with two per-tensor scales, its op_name under the
# jaxamp_fp8 scope and its source location in the header tables.
FP8_GEMM_HLO = """\
HloModule jit_loss, is_scheduled=true, entry_computation_layout={(f8e4m3fn[32,64]{1,0}, f8e4m3fn[64,48]{1,0}, f32[])->f32[32,48]{1,0}}

FileNames
1 "/home/user/model.py"

FunctionNames
1 "dense"

FileLocations
1 {file_name_id=1 function_name_id=1 line=12 end_line=12 column=15 end_column=103}

StackFrames
1 {file_location_id=1 parent_frame_id=1}


ENTRY %main.7 (x.1: f8e4m3fn[32,64], w.1: f8e4m3fn[64,48], s.1: f32[]) -> f32[32,48] {
  %x.1 = f8e4m3fn[32,64]{1,0} parameter(0), metadata={op_name="x"}
  %w.1 = f8e4m3fn[64,48]{1,0} parameter(1), metadata={op_name="w"}
  %s.1 = f32[] parameter(2), metadata={op_name="s"}
  %constant_21_0 = f32[] constant(1), metadata={op_name="jit(loss)/jvp(jaxamp_fp8)/dot_general" stack_frame_id=1}
  %cublas-gemm.3 = (f32[32,48]{1,0}, s8[4194304]{0}) custom-call(%x.1, %w.1, %s.1, %constant_21_0), custom_call_target="__cublas$lt$matmul$f8", metadata={op_name="jit(loss)/jvp(jaxamp_fp8)/dot_general" scheduling_name="cublas-gemm.3" stack_frame_id=1}, backend_config={"operation_queue_id":"0","gemm_backend_config":{"selected_algorithm":"0","alpha_real":1,"beta":0,"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]},"alpha_imag":0,"precision_config":{"operand_precision":["DEFAULT","DEFAULT"],"algorithm":"ALG_DOT_ANY_F8_ANY_F8_F32"},"epilogue":"DEFAULT","lhs_stride":"2048","rhs_stride":"3072","grad_x":false,"grad_y":false,"damax_output":false,"autotune_workspace_size":"4194304","scale_mode":1},"force_earliest_schedule":false,"reification_cost":[],"device_type":"DEVICE_TYPE_INVALID"}
  ROOT %get-tuple-element.3 = f32[32,48]{1,0} get-tuple-element(%cublas-gemm.3), index=0, metadata={op_name="jit(loss)/jvp(jaxamp_fp8)/dot_general" scheduling_name="get-tuple-element.3" stack_frame_id=1}
}
"""

# A forward FP8 convolution as XLA for an H200 prints it: cuDNN's graph call
# on an e4m3 NHWC input (8, 16, 16, 32) and an e4m3 3x3 kernel to 64 features.
FP8_CONV_HLO = """\
HloModule jit_conv, is_scheduled=true

ENTRY %main (x.1: f8e4m3fn[8,16,16,32], w.1: f8e4m3fn[64,3,3,32], sx: bf16[], sw: bf16[]) -> bf16[8,16,16,64] {
  %x.1 = f8e4m3fn[8,16,16,32]{3,2,1,0} parameter(0)
  %w.1 = f8e4m3fn[64,3,3,32]{3,2,1,0} parameter(1)
  %sx = bf16[] parameter(2)
  %sw = bf16[] parameter(3)
  %cudnn-conv.2 = (bf16[8,16,16,64]{3,2,1,0}, u8[0]{0}) custom-call(%x.1, %w.1, %sx, %sw), window={size=3x3 pad=1_1x1_1}, dim_labels=b01f_o01i->b01f, custom_call_target="__cudnn$convForwardGraph", metadata={op_name="jit(conv)/jaxamp_fp8/conv_general_dilated" scheduling_name="cudnn-conv.2" stack_frame_id=4}, backend_config={"operation_queue_id":"0","cudnn_conv_backend_config":{"activation_mode":"kNone","conv_result_scale":1,"side_input_scale":0,"serialized_graph":"4294967309:[bf16]conv();4294967311:[bf16]scale(4294967309);4294967313:[bf16]scale(4294967311);"}}
  ROOT %r = bf16[8,16,16,64]{3,2,1,0} get-tuple-element(%cudnn-conv.2), index=0
}
"""


def test_an_fp8_cublaslt_call_counts_as_fp8_with_its_flops_op_name_and_source():
    """Fails if the f8 element types lose their numpy names (the call would
    count as 'f8e4m3fn', not FP8), if the scale operands were taken for data,
    or if the header tables were not read (empty source)."""
    report = jaxamp.diagnostics.hlo_precision_report(FP8_GEMM_HLO)
    (op,) = report.ops
    assert op.primitive == "__cublas$lt$matmul$f8"
    assert op.operand_dtypes == ("float8_e4m3fn", "float8_e4m3fn")
    assert op.flops == 2 * 32 * 48 * 64
    assert op.op_name == "jit(loss)/jvp(jaxamp_fp8)/dot_general"
    assert op.source == "/home/user/model.py:12:15"
    assert (op.is_fp8, op.direction, op.fp8_status) == (True, "forward", "fp8")
    assert report.fp8_rows() == (
        jaxamp._report.Fp8Row(
            "fp8", "forward", ("float8_e4m3fn", "float8_e4m3fn"), "__cublas$lt$matmul$f8", "", 1, op.flops
        ),
    )
    assert report.fp8_fraction() == 1.0
    assert "fp8                forward  e4m3fn x e4m3fn     __cublas$lt$matmul$f8" in str(report)


def test_an_fp8_cudnn_graph_convolution_counts_its_forward_flops_as_fp8():
    """Fails if the graph call were not recognized as a convolution (no op) or
    costed as a backward one (other FLOPs)."""
    (op,) = jaxamp.diagnostics.hlo_precision_report(FP8_CONV_HLO).ops
    assert op.primitive == "__cudnn$convForwardGraph"
    assert op.is_fp8
    assert op.flops == 2 * (8 * 16 * 16 * 64) * (3 * 3 * 32)


@pytest.mark.parametrize(
    "op_name, requested, reason",
    [
        ("jit(step)/jaxamp_fp8/dot_general", True, None),
        ("jit(step)/transpose(jvp(jaxamp_fp8))/dot_general", True, None),
        ("jit(step)/jaxamp_fp8_fallback_batch_dims/dot_general", False, "batch_dims"),
        (
            "jit(step)/transpose(jvp(jaxamp_fp8_fallback_shape_not_multiple_of_16))/dot_general",
            False,
            "shape_not_multiple_of_16",
        ),
        (
            "jit(step)/jaxamp_fp8/jaxamp_fp8_fallback_conv_backward/conv_general_dilated",
            False,
            "conv_backward",
        ),
        ("jit(step)/my_jaxamp_fp8_layer/dot_general", False, None),
        ("jit(step)/not_jaxamp_fp8/dot_general", False, None),
        ("jit(step)/dot_general", False, None),
    ],
)
def test_the_named_scopes_say_requested_or_fallback_with_the_innermost_deciding(op_name, requested, reason):
    """Fails if a scope were matched inside another name (not_jaxamp_fp8) or
    the outer scope won over an inner fallback."""
    assert jaxamp._report.fp8_scope(op_name) == (requested, reason)


@pytest.mark.parametrize(
    "op_name, direction",
    [
        ("jit(step)/jvp(jaxamp_fp8)/dot_general", "forward"),
        ("jit(step)/transpose(jvp(jaxamp_fp8))/dot_general", "backward"),
        ("jit(step)/dot_general", "forward"),
    ],
)
def test_ops_of_a_transposed_computation_count_as_backward(op_name, direction):
    assert jaxamp._report.OpRecord("dot", ("bfloat16",) * 2, "float32", 1, op_name).direction == direction


# A program before optimization (Lowered.compiler_ir("hlo")): a dot fed
# through a dequantizing jitted function, a dot fed a scaled dequantized
# value, a plain dot, and a dot fed a dequantized value plus a residual.
LOWERED_HLO = """\
HloModule jit_f

FileNames
1 "/home/user/f.py"

FunctionNames
1 "f"

FileLocations
1 {file_name_id=1 function_name_id=1 line=5 end_line=5 column=9 end_column=20}
2 {file_name_id=1 function_name_id=1 line=6 end_line=6 column=9 end_column=20}
3 {file_name_id=1 function_name_id=1 line=7 end_line=7 column=9 end_column=20}
4 {file_name_id=1 function_name_id=1 line=8 end_line=8 column=9 end_column=20}

StackFrames
1 {file_location_id=1 parent_frame_id=1}
2 {file_location_id=2 parent_frame_id=2}
3 {file_location_id=3 parent_frame_id=3}
4 {file_location_id=4 parent_frame_id=4}


%deq.1 (Arg_0.1: bf16[4,4]) -> bf16[4,4] {
  %Arg_0.1 = bf16[4,4]{1,0} parameter(0)
  %convert.2 = f8e4m3fn[4,4]{1,0} convert(%Arg_0.1), metadata={op_name="convert_element_type"}
  ROOT %convert.3 = bf16[4,4]{1,0} convert(%convert.2), metadata={op_name="convert_element_type"}
}

ENTRY %main.2 (x.1: bf16[4,4], q.1: f8e5m2[4,4], s.1: bf16[]) -> bf16[4,4] {
  %x.1 = bf16[4,4]{1,0} parameter(0), metadata={op_name="x"}
  %q.1 = f8e5m2[4,4]{1,0} parameter(1), metadata={op_name="q"}
  %s.1 = bf16[] parameter(2), metadata={op_name="s"}
  %jit_deq_.1 = bf16[4,4]{1,0} call(%x.1), to_apply=%deq.1, metadata={op_name="jit(f)/jit(deq)"}
  %dot.1 = bf16[4,4]{1,0} dot(%jit_deq_.1, %x.1), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(f)/dot_general" stack_frame_id=1}
  %wide.1 = bf16[4,4]{1,0} convert(%q.1)
  %scale.1 = bf16[4,4]{1,0} broadcast(%s.1), dimensions={}
  %scaled.1 = bf16[4,4]{1,0} multiply(%wide.1, %scale.1)
  %dot.2 = bf16[4,4]{1,0} dot(%x.1, %scaled.1), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(f)/dot_general" stack_frame_id=2}
  %dot.3 = bf16[4,4]{1,0} dot(%x.1, %x.1), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(f)/dot_general" stack_frame_id=3}
  %residual.1 = bf16[4,4]{1,0} add(%scaled.1, %x.1)
  ROOT %dot.4 = bf16[4,4]{1,0} dot(%residual.1, %x.1), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(f)/dot_general" stack_frame_id=4}
}
"""


def test_dots_fed_fp8_through_a_dequantize_are_found_in_the_program_before_optimization():
    """Fails if the FP8 value were not followed into the called computation and
    back out (line 5), through the scale multiply (line 6), or if an add were
    taken for a dequantize (line 8) or a plain dot marked (line 7)."""
    assert hlo_report.fp8_fed_matmuls(LOWERED_HLO) == {
        ("jit(f)/dot_general", "/home/user/f.py:5:9"),
        ("jit(f)/dot_general", "/home/user/f.py:6:9"),
    }


def test_check_fp8_refuses_a_traced_report_and_says_how_to_make_a_compiled_one():
    traced = jaxamp.precision_report(jnp.matmul, jnp.ones((4, 4)), jnp.ones((4, 4)))
    with pytest.raises(ValueError, match=r"compiled=True"):
        jaxamp.diagnostics.check_fp8(traced)


def _scoped_bf16_dot_hlo(scope):
    """FP8_GEMM_HLO's GEMM as a plain bfloat16 cuBLASLt call under `scope`."""
    return (
        FP8_GEMM_HLO.replace("f8e4m3fn", "bf16")
        .replace("__cublas$lt$matmul$f8", "__cublas$lt$matmul")
        .replace("jvp(jaxamp_fp8)", f"jvp({scope})")
    )


def test_a_requested_fp8_gemm_that_ran_in_bfloat16_warns_or_raises_and_is_listed():
    """Fails if check_fp8 ignored the jaxamp_fp8 scope on a bfloat16 GEMM."""
    report = jaxamp.diagnostics.hlo_precision_report(_scoped_bf16_dot_hlo("jaxamp_fp8"))
    with pytest.warns(
        jaxamp.diagnostics.Fp8NotUsedWarning,
        match=r"jit\(loss\)/jvp\(jaxamp_fp8\)/dot_general at /home/user/model.py:12:15",
    ):
        missed = jaxamp.diagnostics.check_fp8(report)
    assert missed == report.ops
    assert [(row.status, row.operand_dtypes) for row in report.fp8_rows()] == [
        ("requested, not fp8", ("bfloat16", "bfloat16"))
    ]
    with pytest.raises(jaxamp.diagnostics.Fp8NotUsedWarning):
        jaxamp.diagnostics.check_fp8(report, raise_error=True)


def test_a_fallback_under_its_scope_is_a_row_with_its_reason_and_no_warning():
    """Fails if a fallback scope (which contains 'jaxamp_fp8') counted as an FP8 request."""
    report = jaxamp.diagnostics.hlo_precision_report(_scoped_bf16_dot_hlo("jaxamp_fp8_fallback_shape_not_multiple_of_16"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert jaxamp.diagnostics.check_fp8(report) == ()
    (row,) = report.fp8_rows()
    assert (row.status, row.reason, row.direction) == ("fallback", "shape_not_multiple_of_16", "forward")
    assert str(report).endswith("100.0%  kept in bfloat16: shape not multiple of 16")


# ---- compiled for an H200 (needs the CUDA plugin) -------------------------------------------------


def _h200():
    if not jaxamp.diagnostics.cuda_plugin_available():
        pytest.skip("needs the CUDA PJRT plugin (pip install 'jax-mixed-precision[gpu-aot]')")
    return jaxamp.diagnostics.gpu_target_device("h200")


def _quantize(x, dtype):
    """Per-tensor current scaling: x / scale in `dtype`, and the scale."""
    scale = jnp.max(jnp.abs(x)).astype(jnp.float32) / jnp.finfo(dtype).max.astype(jnp.float32)
    return (x.astype(jnp.float32) / scale).astype(dtype), scale


def _fp8_matmul(a, b, contracting):
    with jax.named_scope("jaxamp_fp8"):
        return lax.dot_general(
            a, b, (contracting, ((), ())), precision=FP8_PRESET, preferred_element_type=jnp.float32
        )


@jax.custom_vjp
def fp8_dense(x, w):
    """x @ w with three FP8 GEMMs: e4m3 forward, the e5m2 cotangent backward."""
    return _fp8_dense_forward(x, w)[0]


def _fp8_dense_forward(x, w):
    (xq, x_scale), (wq, w_scale) = _quantize(x, E4M3), _quantize(w, E4M3)
    y = _fp8_matmul(xq, wq, ((1,), (0,))) * (x_scale * w_scale)
    return y.astype(jnp.bfloat16), (x, w)


def _fp8_dense_backward(residuals, g):
    x, w = residuals
    (gq, g_scale), (xq, x_scale), (wq, w_scale) = _quantize(g, E5M2), _quantize(x, E4M3), _quantize(w, E4M3)
    dx = _fp8_matmul(gq, wq, ((1,), (1,))) * (g_scale * w_scale)
    dw = _fp8_matmul(xq, gq, ((0,), (0,))) * (x_scale * g_scale)
    return dx.astype(x.dtype), dw.astype(w.dtype)


fp8_dense.defvjp(_fp8_dense_forward, _fp8_dense_backward)


def test_compiled_for_an_h200_the_three_gemms_of_an_fp8_dense_layer_run_in_fp8_and_nothing_warns():
    """A true FP8 dot_general with the f8 preset: one forward GEMM (e4m3 x e4m3)
    and two backward GEMMs (with the e5m2 cotangent), all cuBLASLt FP8.
    Fails if the backward were not told apart (all 'forward'), if a GEMM lost
    its scope through XLA's rewrite (no FP8 row), or if check_fp8 warned on
    real FP8 (its negative control: the trap test below)."""
    m, k, n = 32, 64, 48
    step = jax.value_and_grad(lambda x, w: fp8_dense(x, w).astype(jnp.float32).sum(), argnums=(0, 1))
    args = jaxamp.diagnostics.on_device(
        (jax.ShapeDtypeStruct((m, k), jnp.bfloat16), jax.ShapeDtypeStruct((k, n), jnp.bfloat16)), _h200()
    )
    report = jaxamp.precision_report(step, *args, compiled=True)
    gemm = 2 * m * k * n
    rows = {
        (row.status, row.direction, row.operand_dtypes, row.primitive): (row.ops, row.flops)
        for row in report.fp8_rows()
    }
    assert rows == {
        ("fp8", "forward", ("float8_e4m3fn", "float8_e4m3fn"), "__cublas$lt$matmul$f8"): (1, gemm),
        ("fp8", "backward", ("float8_e5m2", "float8_e4m3fn"), "__cublas$lt$matmul$f8"): (1, gemm),
        ("fp8", "backward", ("float8_e4m3fn", "float8_e5m2"), "__cublas$lt$matmul$f8"): (1, gemm),
    }
    assert report.fp8_fraction("forward") == report.fp8_fraction("backward") == 1.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert jaxamp.diagnostics.check_fp8(report) == ()


def quantize_dequantize_matmul(x, w):
    """The classic bfloat16 QDQ pattern: round x and w through FP8, multiply in bfloat16."""
    return x.astype(E4M3).astype(jnp.bfloat16) @ w.astype(E4M3).astype(jnp.bfloat16)


def test_compiled_for_an_h200_the_quantize_dequantize_trap_runs_bfloat16_and_is_warned():
    """XLA's default flags fold the FP8 round trip: a bfloat16 GEMM, no FP8 call.
    No named scope marks it; the program before optimization does. Fails if the
    lowered program were not read (nothing requested, no warning)."""
    args = jaxamp.diagnostics.on_device(
        (jax.ShapeDtypeStruct((32, 64), jnp.bfloat16), jax.ShapeDtypeStruct((64, 48), jnp.bfloat16)), _h200()
    )
    report = jaxamp.precision_report(quantize_dequantize_matmul, *args, compiled=True)
    assert report.fp8_fraction() == 0.0
    assert [(row.status, row.operand_dtypes) for row in report.fp8_rows()] == [
        ("requested, not fp8", ("bfloat16", "bfloat16"))
    ]
    with pytest.warns(jaxamp.diagnostics.Fp8NotUsedWarning, match="quantize-dequantize"):
        (missed,) = jaxamp.diagnostics.check_fp8(report)
    assert missed.source.endswith(
        "test_fp8_report.py:" + str(quantize_dequantize_matmul.__code__.co_firstlineno + 2) + ":11"
    )


def test_compiled_for_an_h200_fallbacks_keep_their_scope_and_reason_through_fusion():
    """Hand-written fallbacks under jaxamp's scope names: a (24, 40) matmul
    (not a multiple of 16) and a batched einsum. Fails if XLA's fusion dropped
    the op_name (rows without reason) or if a fallback were warned as missed FP8."""

    def program(x, w, q, k):
        with jax.named_scope("jaxamp_fp8_fallback_shape_not_multiple_of_16"):
            y = jnp.tanh(x @ w)
        with jax.named_scope("jaxamp_fp8_fallback_batch_dims"):
            scores = jnp.einsum("bqd,bkd->bqk", q, k)
        return y.sum() + scores.sum()

    shapes = [(24, 40), (40, 24), (2, 16, 32), (2, 16, 32)]
    args = jaxamp.diagnostics.on_device([jax.ShapeDtypeStruct(shape, jnp.bfloat16) for shape in shapes], _h200())
    report = jaxamp.precision_report(program, *args, compiled=True)
    rows = {(row.status, row.reason): row.flops for row in report.fp8_rows()}
    assert rows == {
        ("fallback", "shape_not_multiple_of_16"): 2 * 24 * 40 * 24,
        ("fallback", "batch_dims"): 2 * 2 * 16 * 16 * 32,
    }
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert jaxamp.diagnostics.check_fp8(report) == ()


def test_compiled_for_an_h200_a_forward_convolution_of_scaled_fp8_operands_runs_in_cudnn_fp8():
    """XLA rewrites a forward conv of convert(f8) * scale operands into cuDNN's
    FP8 graph call. Fails if the graph call were not counted as a convolution
    (no op) or its f8 operands were misread (a 'requested, not fp8' row)."""

    def conv(x, w, x_scale, w_scale):
        x = x.astype(jnp.bfloat16) * x_scale.astype(jnp.bfloat16)
        w = w.astype(jnp.bfloat16) * w_scale.astype(jnp.bfloat16)
        with jax.named_scope("jaxamp_fp8"):
            return lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))

    shapes = [((2, 8, 8, 16), E4M3), ((3, 3, 16, 32), E4M3), ((), jnp.float32), ((), jnp.float32)]
    args = jaxamp.diagnostics.on_device([jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in shapes], _h200())
    report = jaxamp.precision_report(conv, *args, compiled=True)
    (row,) = report.fp8_rows()
    assert (row.status, row.direction, row.primitive) == ("fp8", "forward", "__cudnn$convForwardGraph")
    assert row.flops == 2 * (2 * 8 * 8 * 32) * (3 * 3 * 16)


def test_the_scaling_cost_measurements_amax_passes_read_each_bfloat16_operand_once():
    """`experiments.measure.fp8_scaling_cost`'s sorting of kernels, on its reference pattern:
    the amax kernels read x and w (plus their few partial maxima), the GEMM
    reads the FP8 operands and writes bfloat16. Fails if the split-K sum or a
    producer were counted as an amax pass, or the GEMM's workspace as bytes."""
    device = _h200()
    m, k, n = 1024, 256, 512
    x, w = jax.ShapeDtypeStruct((m, k), jnp.bfloat16), jax.ShapeDtypeStruct((k, n), jnp.bfloat16)
    forward = fp8_scaling_cost._programs(fp8_scaling_cost.current_scaling_dot_general)["forward"]
    cost = fp8_scaling_cost.cost(
        jax.jit(forward).lower(*jaxamp.diagnostics.on_device((x, w), device)).compile().as_text()
    )
    operands = 2 * (m * k + k * n)
    assert operands <= cost.amax_bytes <= 1.05 * operands
    assert cost.gemm_bytes == m * k + k * n + 2 * m * n + 2 * 4  # FP8 in, bfloat16 out, two f32 scales
    assert cost.gemm_flops == 2 * m * k * n
    assert cost.fp8_share == 1.0


def _lowered_qdq_dot_hlo(line):
    """A program before optimization: x rounded through FP8 into a backward dot at model.py:`line`."""
    return f"""\
HloModule jit_loss

FileNames
1 "/home/user/model.py"

FunctionNames
1 "dense"

FileLocations
1 {{file_name_id=1 function_name_id=1 line={line} end_line={line} column=15 end_column=103}}

StackFrames
1 {{file_location_id=1 parent_frame_id=1}}


ENTRY %main (x.1: bf16[32,64], w.1: bf16[64,48]) -> bf16[32,48] {{
  %x.1 = bf16[32,64]{{1,0}} parameter(0)
  %w.1 = bf16[64,48]{{1,0}} parameter(1)
  %q.1 = f8e4m3fn[32,64]{{1,0}} convert(%x.1)
  %dq.1 = bf16[32,64]{{1,0}} convert(%q.1)
  ROOT %dot.1 = bf16[32,48]{{1,0}} dot(%dq.1, %w.1), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}, metadata={{op_name="jit(loss)/transpose(jvp(dense))/dot_general" stack_frame_id=1}}
}}
"""


@pytest.mark.parametrize("line, requested", [(12, True), (13, False)])
def test_a_dot_that_xla_renamed_after_a_transpose_is_still_matched_to_its_fp8_request(line, requested):
    """XLA gives a dot it merges with a following transpose (common in backward
    passes) the transpose's op_name. Matching by name stack and source finds it
    anyway (line 12); a dot at another source line is not matched (line 13).
    Fails if ops were matched by their whole op_name."""
    compiled = _scoped_bf16_dot_hlo("jaxamp_fp8").replace(
        "jit(loss)/jvp(jaxamp_fp8)/dot_general", "jit(loss)/transpose(jvp(dense))/transpose"
    )
    (op,) = jaxamp.diagnostics.hlo_precision_report(compiled, _lowered_qdq_dot_hlo(line)).ops
    assert (op.fp8_requested, op.direction) == (requested, "backward")


def test_compiled_for_an_h200_autocast_mixed_float8_proves_every_gemm_of_an_mlp_gradient_ran_in_fp8():
    """The library end to end: `autocast(loss, "mixed_float8")` under `jax.grad`,
    compiled for an H200, read back by `precision_report` and `check_fp8`.
    Two layers' forward GEMMs (e4m3 x e4m3), both weight gradients and the
    hidden activation's gradient (e4m3 with the e5m2 cotangent): five
    cuBLASLt FP8 calls, all of the matmul FLOPs, and no warning. Fails if
    autocast's FP8 scope stopped reaching the compiled program (no FP8 rows)
    or if any GEMM ran wider (check_fp8 raises). Such small GEMMs would stay
    bfloat16 on an H200 (too small to pay): FP8 is forced everywhere."""

    def loss(params, x):
        hidden = jax.nn.gelu(x @ params["w1"])
        return jnp.mean((hidden @ params["w2"]) ** 2)

    m, k, h, n = 32, 64, 128, 32
    params = {"w1": jax.ShapeDtypeStruct((k, h), jnp.float32), "w2": jax.ShapeDtypeStruct((h, n), jnp.float32)}
    args = jaxamp.diagnostics.on_device((params, jax.ShapeDtypeStruct((m, k), jnp.float32)), _h200())
    with jaxamp.diagnostics.fp8_target("everywhere"):
        report = jaxamp.precision_report(jax.grad(jaxamp.autocast(loss, "mixed_float8")), *args, compiled=True)
    rows = {(row.status, row.direction, row.operand_dtypes): row.flops for row in report.fp8_rows()}
    assert rows == {
        ("fp8", "forward", ("float8_e4m3fn", "float8_e4m3fn")): 2 * m * k * h + 2 * m * h * n,
        ("fp8", "backward", ("float8_e4m3fn", "float8_e5m2")): 2 * h * m * n + 2 * k * m * h,
        ("fp8", "backward", ("float8_e5m2", "float8_e4m3fn")): 2 * m * n * h,
    }
    assert {row.primitive for row in report.fp8_rows()} == {"__cublas$lt$matmul$f8"}
    assert jaxamp.diagnostics.check_fp8(report, raise_error=True) == ()
