"""The precision reports read each operand's own dtype, for every kind of heavy op.

A report that takes one operand's dtype for both (the left one, say) calls a
float16 x float32 matmul all-half and overstates the half-precision share;
one that reads the output's dtype misses a float32 accumulation. Each
scenario here mixes the operand dtypes in both orders, so a report that
reads either operand alone, or the result, fails one of the two.
"""

import jax
import jax.numpy as jnp
import pytest

import jaxamp

ORDERS = [("f16", "f32"), ("f32", "f16"), ("bf16", "f32"), ("f32", "bf16")]
NUMPY_NAMES = {"f16": "float16", "bf16": "bfloat16", "f32": "float32"}


def hlo_module(entry_body: str, parameters: str) -> str:
    return f"HloModule m\n\nENTRY %main ({parameters}) -> f32[4,4] {{\n{entry_body}\n}}\n"


def dot_hlo(lhs: str, rhs: str) -> str:
    return hlo_module(
        f"""  %a = {lhs}[4,3]{{1,0}} parameter(0)
  %b = {rhs}[3,4]{{1,0}} parameter(1)
  ROOT %d = f32[4,4]{{1,0}} dot(%a, %b), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}""",
        f"a: {lhs}[4,3], b: {rhs}[3,4]",
    )


def convolution_hlo(lhs: str, rhs: str) -> str:
    return hlo_module(
        f"""  %x = {lhs}[1,6,6,2]{{3,2,1,0}} parameter(0)
  %w = {rhs}[3,3,2,4]{{3,2,1,0}} parameter(1)
  ROOT %y = f32[1,4,4,4]{{3,2,1,0}} convolution(%x, %w), window={{size=3x3}}, dim_labels=b01f_01io->b01f""",
        f"x: {lhs}[1,6,6,2], w: {rhs}[3,3,2,4]",
    )


def cublas_hlo(lhs: str, rhs: str) -> str:
    return hlo_module(
        f"""  %a = {lhs}[4,3]{{1,0}} parameter(0)
  %b = {rhs}[3,4]{{1,0}} parameter(1)
  %gemm = (f32[4,4]{{1,0}}, s8[1024]{{0}}) custom-call(%a, %b), custom_call_target="__cublas$gemm", backend_config={{"gemm_backend_config":{{"dot_dimension_numbers":{{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"]}}}}}}
  ROOT %c = f32[4,4]{{1,0}} get-tuple-element(%gemm), index=0""",
        f"a: {lhs}[4,3], b: {rhs}[3,4]",
    )


def cudnn_hlo(lhs: str, rhs: str) -> str:
    return hlo_module(
        f"""  %x = {lhs}[1,6,6,2]{{3,2,1,0}} parameter(0)
  %w = {rhs}[4,3,3,2]{{3,2,1,0}} parameter(1)
  %conv = (f32[1,4,4,4]{{3,2,1,0}}, u8[0]{{0}}) custom-call(%x, %w), window={{size=3x3}}, dim_labels=b01f_o01i->b01f, custom_call_target="__cudnn$convForward"
  ROOT %y = f32[1,4,4,4]{{3,2,1,0}} get-tuple-element(%conv), index=0""",
        f"x: {lhs}[1,6,6,2], w: {rhs}[4,3,3,2]",
    )


@pytest.mark.parametrize("make_hlo", [dot_hlo, convolution_hlo, cublas_hlo, cudnn_hlo])
@pytest.mark.parametrize("lhs, rhs", ORDERS)
def test_a_mixed_dtype_heavy_op_of_compiled_hlo_reports_each_operands_own_dtype(make_hlo, lhs, rhs):
    """Fails if `hlo_report._heavy_op` gives both operands the left (or right) one's dtype."""
    (op,) = jaxamp.diagnostics.hlo_precision_report(make_hlo(lhs, rhs)).ops
    assert op.operand_dtypes == (NUMPY_NAMES[lhs], NUMPY_NAMES[rhs])
    assert op.output_dtype == "float32"
    # The wider operand decides: a half x float32 op is not half precision.
    assert op.compute_dtype == "float32"


@pytest.mark.parametrize("make_hlo", [dot_hlo, convolution_hlo, cublas_hlo, cudnn_hlo])
@pytest.mark.parametrize("lhs, rhs", ORDERS)
def test_a_mixed_dtype_op_counts_nothing_as_half_precision(make_hlo, lhs, rhs):
    report = jaxamp.diagnostics.hlo_precision_report(make_hlo(lhs, rhs))
    assert report.fraction(NUMPY_NAMES["f16"]) == 0.0
    assert report.fraction(NUMPY_NAMES["bf16"]) == 0.0
    assert report.fraction(jnp.float32) == 1.0


@pytest.mark.parametrize("make_hlo", [dot_hlo, convolution_hlo, cublas_hlo, cudnn_hlo])
def test_a_half_op_with_a_float32_result_is_still_half_precision(make_hlo):
    """The operands, not the result, decide: a report reading the output dtype fails here."""
    (op,) = jaxamp.diagnostics.hlo_precision_report(make_hlo("f16", "f16")).ops
    assert op.operand_dtypes == ("float16", "float16")
    assert op.output_dtype == "float32"
    assert op.compute_dtype == "float16"


@pytest.mark.parametrize(
    "lhs_dtype, rhs_dtype",
    [(jnp.float16, jnp.float32), (jnp.float32, jnp.float16), (jnp.bfloat16, jnp.float32)],
)
def test_the_traced_report_reads_each_operand_of_a_mixed_dot(lhs_dtype, rhs_dtype):
    """`lax.dot_general` of mixed operands: the traced report names both dtypes in order."""

    def mixed_dot(a, b):
        return jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)

    args = (jax.ShapeDtypeStruct((4, 3), lhs_dtype), jax.ShapeDtypeStruct((3, 4), rhs_dtype))
    (op,) = jaxamp.precision_report(mixed_dot, *args).ops
    assert op.operand_dtypes == (jnp.dtype(lhs_dtype).name, jnp.dtype(rhs_dtype).name)
    assert op.compute_dtype == "float32"
    assert op.flops == 2 * 4 * 4 * 3


@pytest.mark.parametrize(
    "make_hlo, flops",
    [
        (dot_hlo, 2 * 4 * 4 * 3),  # 2 * M * N * K
        (cublas_hlo, 2 * 4 * 4 * 3),
        (convolution_hlo, 2 * (1 * 4 * 4 * 4) * (3 * 3 * 2)),  # 2 * outputs * window * input features
        (cudnn_hlo, 2 * (4 * 3 * 3 * 2) * (1 * 4 * 4 * 4) // 4),  # 2 * size(w) * size(y) / features(y)
    ],
)
def test_each_heavy_op_kind_counts_its_flops_with_more_than_one_input_feature(make_hlo, flops):
    """Two input features, so a count that divides by them (or ignores them) is off."""
    (op,) = jaxamp.diagnostics.hlo_precision_report(make_hlo("f16", "f16")).ops
    assert op.flops == flops


OUTER_PRODUCT_IN_AN_UNCOUNTED_LOOP = """HloModule m

%body (s: (s32[], f32[4])) -> (s32[], f32[4]) {
  %s = (s32[], f32[4]{0}) parameter(0)
  %i = s32[] get-tuple-element(%s), index=0
  %x = f32[4]{0} get-tuple-element(%s), index=1
  %outer = f32[4,4]{1,0} dot(%x, %x)
  %y = f32[4]{0} get-tuple-element(%s), index=1
  ROOT %t = (s32[], f32[4]{0}) tuple(%i, %y)
}

%cond (s: (s32[], f32[4])) -> pred[] {
  %s = (s32[], f32[4]{0}) parameter(0)
  ROOT %p = pred[] constant(true)
}

ENTRY %main (x: f32[4]) -> (s32[], f32[4]) {
  %x = f32[4]{0} parameter(0)
  %zero = s32[] constant(0)
  %init = (s32[], f32[4]{0}) tuple(%zero, %x)
  ROOT %loop = (s32[], f32[4]{0}) while(%init), condition=%cond, body=%body
}
"""


def test_a_loop_without_a_known_trip_count_counts_its_body_once_and_an_outer_product_has_no_contraction():
    """XLA prints no ``known_trip_count`` for a data-dependent loop, no contracting dims for an outer product."""
    (op,) = jaxamp.diagnostics.hlo_precision_report(OUTER_PRODUCT_IN_AN_UNCOUNTED_LOOP).ops
    assert (op.primitive, op.flops) == ("dot", 2 * 4 * 4)


TRAFFIC_HLO = """HloModule m

%body (s: (s32[], f32[4])) -> (s32[], f32[4]) {
  %s = (s32[], f32[4]{0}) parameter(0)
  %i = s32[] get-tuple-element(%s), index=0
  %x = f32[4]{0} get-tuple-element(%s), index=1
  %y = f32[4]{0} add(%x, %x)
  ROOT %t = (s32[], f32[4]{0}) tuple(%i, %y)
}

%cond (s: (s32[], f32[4])) -> pred[] {
  %s = (s32[], f32[4]{0}) parameter(0)
  ROOT %p = pred[] constant(true)
}

%small (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  ROOT %n = f32[4]{0} negate(%p)
}

%large (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  %a = f32[4]{0} exponential(%p)
  ROOT %b = f32[4]{0} multiply(%a, %p)
}

%callee (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  ROOT %c = f32[4]{0} sqrt(%p)
}

%fused (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  %e = f32[4]{0} exponential(%p)
  ROOT %l = f32[4]{0} log(%e)
}

ENTRY %main (x: f32[4]) -> f32[2,2] {
  %x = f32[4]{0} parameter(0)
  %zero = s32[] constant(0)
  %init = (s32[], f32[4]{0}) tuple(%zero, %x)
  %loop = (s32[], f32[4]{0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %unknown = (s32[], f32[4]{0}) while(%init), condition=%cond, body=%body
  %y = f32[4]{0} get-tuple-element(%loop), index=1
  %pred = pred[] constant(true)
  %branch = f32[4]{0} conditional(%pred, %y, %y), true_computation=%small, false_computation=%large
  %called = f32[4]{0} call(%branch), to_apply=%callee
  %fusion = f32[4]{0} fusion(%called), kind=kLoop, calls=%fused
  %bc = f32[2,2]{1,0} bitcast(%fusion)
  ROOT %out = f32[2,2]{1,0} add(%bc, %bc)
}
"""


def test_bytes_accessed_follows_loops_branches_and_calls_but_not_into_fusions():
    """Each term is one rule of `bytes_accessed`; a rule broken changes the total."""
    vector = 4 * 4  # bytes of an f32[4]
    expected = {
        "known loop: 3 x the body's add (2 reads, 1 write)": 3 * 3 * vector,
        "unknown loop: the body once": 3 * vector,
        "conditional: the larger branch (exp 2, multiply 3)": 5 * vector,
        "call: the callee's sqrt": 2 * vector,
        "fusion: one kernel, its operand and result only": 2 * vector,
        "add at the root": 3 * vector,
        "parameters, constants, tuples, get-tuple-element, bitcast": 0,
    }
    assert jaxamp.diagnostics._hlo_report.bytes_accessed(TRAFFIC_HLO) == sum(expected.values())


def test_bytes_accessed_counts_bytes_by_element_type():
    hlo = """HloModule m

ENTRY %main (a: f16[8], b: bf16[8], c: s8[8], d: f64[8]) -> pred[8] {
  %a = f16[8]{0} parameter(0)
  %b = bf16[8]{0} parameter(1)
  %c = s8[8]{0} parameter(2)
  %d = f64[8]{0} parameter(3)
  %ab = f32[8]{0} add(%a, %b)
  ROOT %cd = pred[8]{0} compare(%c, %d), direction=LT
}
"""
    assert jaxamp.diagnostics._hlo_report.bytes_accessed(hlo) == (8 * 2 + 8 * 2 + 8 * 4) + (8 * 1 + 8 * 8 + 8 * 1)


BRANCHES_HLO = """HloModule m

%one_big (p: f32[16,16]) -> f32[16,16] {
  %p = f32[16,16]{1,0} parameter(0)
  ROOT %d = f32[16,16]{1,0} dot(%p, %p), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%two_small (p: f32[16,16]) -> f32[2,2] {
  %p = f32[16,16]{1,0} parameter(0)
  %s = f32[2,2]{1,0} slice(%p), slice={[0:2], [0:2]}
  %d1 = f32[2,2]{1,0} dot(%s, %s), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %d2 = f32[2,2]{1,0} dot(%d1, %s), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (x: f32[16,16], a: f16[2,3,4], b: f16[3,4,5]) -> f32[2,5] {
  %x = f32[16,16]{1,0} parameter(0)
  %a = f16[2,3,4]{2,1,0} parameter(1)
  %b = f16[3,4,5]{2,1,0} parameter(2)
  %p = pred[] constant(true)
  %branch = f32[16,16]{1,0} conditional(%p, %x, %x), true_computation=%two_small, false_computation=%one_big
  ROOT %after = f32[2,5]{1,0} dot(%a, %b), lhs_contracting_dims={1,2}, rhs_contracting_dims={0,1}
}
"""


def test_a_conditional_counts_its_branch_with_most_flops_not_most_ops_and_the_walk_goes_on_after_it():
    report = jaxamp.diagnostics.hlo_precision_report(BRANCHES_HLO)
    assert [(op.operand_dtypes, op.flops) for op in report.ops] == [
        (("float32", "float32"), 2 * 16 * 16 * 16),  # the one big dot, not the two small ones
        (("float16", "float16"), 2 * (2 * 5) * (3 * 4)),  # after the conditional; contracts two axes
    ]


def test_a_cublas_call_contracting_two_axes_counts_both():
    hlo = hlo_module(
        """  %a = f16[2,3,4]{2,1,0} parameter(0)
  %b = f16[3,4,5]{2,1,0} parameter(1)
  %gemm = (f16[2,5]{1,0}, s8[1024]{0}) custom-call(%a, %b), custom_call_target="__cublas$lt$matmul", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1","2"],"rhs_contracting_dimensions":["0","1"]}}}
  ROOT %c = f16[2,5]{1,0} get-tuple-element(%gemm), index=0""",
        "a: f16[2,3,4], b: f16[3,4,5]",
    )
    (op,) = jaxamp.diagnostics.hlo_precision_report(hlo).ops
    assert op.flops == 2 * (2 * 5) * (3 * 4)


@pytest.mark.parametrize("make_hlo", [dot_hlo, convolution_hlo, cublas_hlo, cudnn_hlo])
def test_flops_are_integers(make_hlo):
    (op,) = jaxamp.diagnostics.hlo_precision_report(make_hlo("f16", "f16")).ops
    assert isinstance(op.flops, int)


@pytest.mark.parametrize(
    "make_hlo, remove, named",
    [
        (convolution_hlo, ", dim_labels=b01f_01io->b01f", "dim_labels"),
        (cudnn_hlo, ", dim_labels=b01f_o01i->b01f", "dim_labels"),
        (cublas_hlo, '"lhs_contracting_dimensions":["1"],', "dot_dimension_numbers"),
    ],
)
def test_a_heavy_op_missing_the_attribute_its_flops_need_is_refused_naming_it(make_hlo, remove, named):
    hlo = make_hlo("f16", "f16")
    assert remove in hlo
    with pytest.raises(ValueError, match=rf"without {named} in HLO: '"):
        jaxamp.diagnostics.hlo_precision_report(hlo.replace(remove, ""))


# XLA's own text (``Compiled.as_text()``) prints each operand with its shape,
# tuples in parentheses, dynamic dimensions with a bound (``<=8``), and a
# ``lax.switch`` as a conditional with a list of branch computations.
AS_PRINTED_BY_XLA = """HloModule m

%fused (p: (s32[], f32[4])) -> (f32[4], f32[<=8,4]) {
  %p = (s32[], f32[4]{0}) parameter(0)
  %x = f32[4]{0} get-tuple-element(%p), index=1
  %y = f32[<=8,4]{1,0} broadcast(%x), dimensions={1}
  ROOT %t = (f32[4]{0}, f32[<=8,4]{1,0}) tuple(%x, %y)
}

%b0 (p: f32[8,4]) -> f32[8,8] {
  %p = f32[8,4]{1,0} parameter(0)
  ROOT %d = f32[8,8]{1,0} dot(f32[8,4]{1,0} %p, f32[8,4]{1,0} %p), lhs_contracting_dims={1}, rhs_contracting_dims={1}
}

%b1 (p: f32[8,4]) -> f32[8,8] {
  %p = f32[8,4]{1,0} parameter(0)
  ROOT %z = f32[8,8]{1,0} broadcast(f32[] %p), dimensions={}
}

%b2 (p: f32[8,4]) -> f32[8,8] {
  %p = f32[8,4]{1,0} parameter(0)
  %d1 = f32[8,8]{1,0} dot(f32[8,4]{1,0} %p, f32[8,4]{1,0} %p), lhs_contracting_dims={1}, rhs_contracting_dims={1}
  ROOT %d2 = f32[8,8]{1,0} dot(f32[8,8]{1,0} %d1, f32[8,8]{1,0} %d1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (i: s32[], x: f32[4], m: f32[8,4]) -> f32[8,8] {
  %i = s32[] parameter(0)
  %x = f32[4]{0} parameter(1)
  %m = f32[8,4]{1,0} parameter(2)
  %init = (s32[], f32[4]{0}) tuple(s32[] %i, f32[4]{0} %x)
  %fusion = (f32[4]{0}, f32[<=8,4]{1,0}) fusion((s32[], f32[4]{0}) %init), kind=kLoop, calls=%fused
  ROOT %switch = f32[8,8]{1,0} conditional(s32[] %i, f32[8,4]{1,0} %m, f32[8,4]{1,0} %m, f32[8,4]{1,0} %m), branch_computations={%b2, %b1, %b0}
}
"""


def test_text_as_xla_prints_it_operand_shapes_tuples_bounded_dims_and_a_switch():
    report = jaxamp.diagnostics.hlo_precision_report(AS_PRINTED_BY_XLA)
    # The switch's heaviest branch (b2) is named first in the branch list.
    assert [op.flops for op in report.ops] == [2 * 8 * 8 * 4, 2 * 8 * 8 * 8]
    traffic = jaxamp.diagnostics._hlo_report.bytes_accessed(AS_PRINTED_BY_XLA)
    fusion = (4 * 4 + 8 * 4 * 4) + (4 + 4 * 4)  # both results (bound 8), the tuple operand's two parts
    # The switch: its largest branch only, two dots (each writes 8x8, reads its two operands).
    switch = (8 * 8 * 4 + 2 * 8 * 4 * 4) + (8 * 8 * 4 + 2 * 8 * 8 * 4)
    assert traffic == fusion + switch


def test_the_entry_computation_is_found_wherever_it_stands_in_the_text():
    """XLA prints ENTRY last; a module with it first is read the same."""
    entry_first = """HloModule m

ENTRY %main (p: f32[4,4]) -> f32[4,4] {
  %p = f32[4,4]{1,0} parameter(0)
  ROOT %c = f32[4,4]{1,0} call(f32[4,4]{1,0} %p), to_apply=%callee
}

%callee (p: f32[4,4]) -> f32[4,4] {
  %p = f32[4,4]{1,0} parameter(0)
  ROOT %d = f32[4,4]{1,0} dot(f32[4,4]{1,0} %p, f32[4,4]{1,0} %p), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}
"""
    (op,) = jaxamp.diagnostics.hlo_precision_report(entry_first).ops
    assert op.flops == 2 * 4 * 4 * 4


def test_the_compiled_report_passes_keyword_arguments_as_static_values():
    """``transpose=True`` changes which matmul is compiled: the report must see the keyword."""

    def matmul(x, transpose=False):
        return (x.T if transpose else x) @ jnp.ones((3, 5), x.dtype)

    x = jnp.ones((3, 3), jnp.float32)
    plain = jaxamp.precision_report(matmul, x, compiled=True)
    transposed = jaxamp.precision_report(matmul, x, compiled=True, transpose=True)
    assert [op.flops for op in transposed.ops] == [op.flops for op in plain.ops] == [2 * 3 * 5 * 3]
    y = jnp.ones((4, 3), jnp.float32)
    with pytest.raises(TypeError):
        jaxamp.precision_report(matmul, y, compiled=True, transpose=True)  # (3, 4) @ (3, 5)


# --- FP8 values followed through a program before optimization -----------------------------------------

# A lowered program (before optimization) where FP8 reaches a matmul by each
# route `hlo_report.fp8_fed_matmuls` follows, beside matmuls it must not mark:
# a dequantized value passed as the second argument of a called computation
# (only the matmul reading that parameter is fed), a convolution whose kernel
# is a dequantized FP8 value, and a conditional branch that receives FP8
# values and dequantizes them itself.
FP8_BY_EVERY_ROUTE = """\
HloModule jit_g

%inner.1 (plain.1: bf16[4,4], fed.1: bf16[4,4]) -> bf16[4,4] {
  %plain.1 = bf16[4,4]{1,0} parameter(0)
  %fed.1 = bf16[4,4]{1,0} parameter(1)
  %dot.1 = bf16[4,4]{1,0} dot(%plain.1, %plain.1), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(g)/jit(inner)/plain"}
  ROOT %dot.2 = bf16[4,4]{1,0} dot(%plain.1, %fed.1), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(g)/jit(inner)/fed"}
}

%branch.1 (q.2: f8e4m3fn[4,4]) -> bf16[4,4] {
  %q.2 = f8e4m3fn[4,4]{1,0} parameter(0)
  %wide.2 = bf16[4,4]{1,0} convert(%q.2)
  ROOT %dot.3 = bf16[4,4]{1,0} dot(%wide.2, %wide.2), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(g)/cond/branch_1_fun/dot_general"}
}

%branch.0 (q.3: f8e4m3fn[4,4]) -> bf16[4,4] {
  %q.3 = f8e4m3fn[4,4]{1,0} parameter(0)
  ROOT %zero.3 = bf16[4,4]{1,0} constant({...})
}

ENTRY %main.3 (x.1: bf16[4,4], q.1: f8e4m3fn[4,4], image.1: bf16[1,6,6,2], kernel.1: f8e5m2[3,3,2,4], i.1: s32[]) -> bf16[1,4,4,4] {
  %x.1 = bf16[4,4]{1,0} parameter(0)
  %q.1 = f8e4m3fn[4,4]{1,0} parameter(1)
  %image.1 = bf16[1,6,6,2]{3,2,1,0} parameter(2)
  %kernel.1 = f8e5m2[3,3,2,4]{3,2,1,0} parameter(3)
  %i.1 = s32[] parameter(4)
  %deq.1 = bf16[4,4]{1,0} convert(%q.1)
  %call.1 = bf16[4,4]{1,0} call(%x.1, %deq.1), to_apply=%inner.1
  %switch.1 = bf16[4,4]{1,0} conditional(%i.1, %q.1, %q.1), branch_computations={%branch.0, %branch.1}
  %wide.1 = bf16[3,3,2,4]{3,2,1,0} convert(%kernel.1)
  ROOT %conv.1 = bf16[1,4,4,4]{3,2,1,0} convolution(%image.1, %wide.1), window={size=3x3}, dim_labels=b01f_01io->b01f, metadata={op_name="jit(g)/conv_general_dilated"}
}
"""


def test_fp8_values_are_followed_into_a_called_computations_parameter_a_branch_and_a_convolution():
    """Each FP8-fed matmul and convolution is found, and only those.

    Fails if the parameters of a called computation were not marked from the
    call's arguments, or marked from the wrong argument (the matmul of
    ``plain.1`` alone would be found); if convolutions were not looked at; or
    if computations reached other than by a ``call`` (a branch, a loop body)
    were never read.
    """
    assert jaxamp.diagnostics._hlo_report.fp8_fed_matmuls(FP8_BY_EVERY_ROUTE) == {
        ("jit(g)/jit(inner)/fed", ""),
        ("jit(g)/cond/branch_1_fun/dot_general", ""),
        ("jit(g)/conv_general_dilated", ""),
    }


# Dots with metadata missing in parts: none at all, an op_name only, a
# stack_frame_id the tables do not list (2), a frame whose location names
# an unknown file and no line or column (3), a frame whose location is not
# listed (4), a frame without a location (5); and one complete (1).
METADATA_MISSING_IN_PARTS = """\
HloModule m

FileNames
1 "/home/user/f.py"

FunctionNames
1 "f"

FileLocations
1 {file_name_id=1 function_name_id=1 line=5 end_line=5 column=9 end_column=20}
2 {file_name_id=7 function_name_id=1}

StackFrames
1 {file_location_id=1 parent_frame_id=1}
3 {file_location_id=2 parent_frame_id=1}
4 {file_location_id=9 parent_frame_id=1}
5 {parent_frame_id=1}

ENTRY %main (a: f16[4,4]) -> f16[4,4] {
  %a = f16[4,4]{1,0} parameter(0)
  %bare = f16[4,4]{1,0} dot(%a, %a), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %named = f16[4,4]{1,0} dot(%bare, %a), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(f)/dot_general"}
  %lost = f16[4,4]{1,0} dot(%named, %a), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(f)/lost" stack_frame_id=2}
  %found = f16[4,4]{1,0} dot(%lost, %a), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(f)/found" stack_frame_id=1}
  %partial = f16[4,4]{1,0} dot(%found, %a), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(f)/partial" stack_frame_id=3}
  %nowhere = f16[4,4]{1,0} dot(%partial, %a), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(f)/nowhere" stack_frame_id=4}
  ROOT %unplaced = f16[4,4]{1,0} dot(%nowhere, %a), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(f)/unplaced" stack_frame_id=5}
}
"""


def test_an_op_without_an_op_name_or_a_resolvable_source_reports_them_empty():
    """``op_name`` and ``source`` are empty strings where the HLO does not give them, never another value.

    Fails if a missing op_name, a missing stack_frame_id or a frame absent
    from the tables gave anything but ``""`` (None, a placeholder), which
    would also make ops without metadata match each other or nothing; a
    location with an unknown file and no line or column reads ``?:0:0``.
    """
    ops = jaxamp.diagnostics._hlo_report.heavy_ops(METADATA_MISSING_IN_PARTS)
    assert [(op.op_name, op.source) for op in ops] == [
        ("", ""),
        ("jit(f)/dot_general", ""),
        ("jit(f)/lost", ""),
        ("jit(f)/found", "/home/user/f.py:5:9"),
        ("jit(f)/partial", "?:0:0"),
        ("jit(f)/nowhere", ""),
        ("jit(f)/unplaced", ""),
    ]


# A conditional inside a loop body that runs 3 times: branch 0 one 4x4x4
# dot (128 FLOPs), branch 1 two of them (256 FLOPs, the heavier).
A_CONDITIONAL_IN_A_COUNTED_LOOP = """\
HloModule m

%light (p: f16[4,4]) -> f16[4,4] {
  %p = f16[4,4]{1,0} parameter(0)
  ROOT %d = f16[4,4]{1,0} dot(%p, %p), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%heavy (p: f16[4,4]) -> f16[4,4] {
  %p = f16[4,4]{1,0} parameter(0)
  %d1 = f16[4,4]{1,0} dot(%p, %p), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %d2 = f16[4,4]{1,0} dot(%d1, %p), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%body (s: (s32[], f16[4,4])) -> (s32[], f16[4,4]) {
  %s = (s32[], f16[4,4]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%s), index=0
  %x = f16[4,4]{1,0} get-tuple-element(%s), index=1
  %y = f16[4,4]{1,0} conditional(%i, %x, %x), branch_computations={%light, %heavy}
  ROOT %t = (s32[], f16[4,4]{1,0}) tuple(%i, %y)
}

%cond (s: (s32[], f16[4,4])) -> pred[] {
  %s = (s32[], f16[4,4]{1,0}) parameter(0)
  ROOT %p = pred[] constant(true)
}

ENTRY %main (x: f16[4,4]) -> (s32[], f16[4,4]) {
  %x = f16[4,4]{1,0} parameter(0)
  %zero = s32[] constant(0)
  %init = (s32[], f16[4,4]{1,0}) tuple(%zero, %x)
  ROOT %loop = (s32[], f16[4,4]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
}
"""


def test_a_conditional_inside_a_counted_loop_counts_its_heavier_branch_times_the_trip_count():
    """The walk below the entry keeps choosing branches by FLOPs and multiplying by the loop's count.

    Fails if the walk into called computations lost the branch weight (a
    conditional below the entry could not be weighed) or the loop's count
    for the branches (each branch op would count once, not 3 times).
    """
    ops = jaxamp.diagnostics._hlo_report.heavy_ops(A_CONDITIONAL_IN_A_COUNTED_LOOP)
    assert [op.flops for op in ops] == [3 * 2 * 4 * 4 * 4, 3 * 2 * 4 * 4 * 4]
    assert jaxamp.diagnostics.hlo_precision_report(A_CONDITIONAL_IN_A_COUNTED_LOOP).fraction("float16") == 1.0


def test_the_entry_is_the_computation_marked_entry_not_the_last_one_read():
    """ENTRY first, then a callee it calls twice: two matmuls, not the callee's one.

    XLA prints ENTRY last, so a parser that took the last computation for
    the entry would pass on XLA's text; here it would count one matmul.
    """
    entry_first = """HloModule m

ENTRY %main (p: f32[4,4]) -> f32[4,4] {
  %p = f32[4,4]{1,0} parameter(0)
  %c1 = f32[4,4]{1,0} call(f32[4,4]{1,0} %p), to_apply=%callee
  ROOT %c2 = f32[4,4]{1,0} call(f32[4,4]{1,0} %c1), to_apply=%callee
}

%callee (p: f32[4,4]) -> f32[4,4] {
  %p = f32[4,4]{1,0} parameter(0)
  ROOT %d = f32[4,4]{1,0} dot(f32[4,4]{1,0} %p, f32[4,4]{1,0} %p), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}
"""
    assert [op.flops for op in jaxamp.diagnostics._hlo_report.heavy_ops(entry_first)] == [2 * 4 * 4 * 4] * 2


# --- Text that is not a whole HLO module -----------------------------------------------------------------


@pytest.mark.parametrize(
    "read", [jaxamp.diagnostics.hlo_precision_report, jaxamp.diagnostics._hlo_report.heavy_ops, jaxamp.diagnostics._hlo_report.bytes_accessed]
)
def test_the_lowered_programs_stablehlo_text_is_refused_saying_what_is_missing_and_which_text_to_pass(read):
    """``Lowered.as_text()`` (StableHLO, no ENTRY computation) instead of the compiled module's text.

    The message must open with what is wrong and end with the call that
    gives the right text. Fails if either sentence is garbled, prefixed or
    suffixed (``"XX..."``, ``"...as_text().XX"``) or changes case; a match on
    a key word alone would pass all of these.
    """
    x = jnp.ones((4, 4), jnp.float16)
    stablehlo_text = jax.jit(jnp.matmul).lower(x, x).as_text()
    assert "ENTRY" not in stablehlo_text
    with pytest.raises(ValueError) as refused:
        read(stablehlo_text)
    message = str(refused.value)
    assert message.startswith("No ENTRY computation found in the HLO text; pass the text of a whole module")
    assert message.endswith("e.g. jax.jit(f).lower(*args).compile().as_text().")


def test_text_cut_off_inside_an_operand_list_is_refused_showing_the_unclosed_text():
    """A module cut off mid-instruction (a truncated dump): the error shows what was left open.

    Fails if the message drops the text (``ValueError(None)``) or shows an
    empty slice of it instead of the operands from the open parenthesis on.
    """
    whole = dot_hlo("f16", "f16")
    cut = whole[: whole.index("dot(%a, %b") + len("dot(%a, %b")]
    with pytest.raises(ValueError, match=r"^Unbalanced parentheses in HLO text: '\(%a, %b'$"):
        jaxamp.diagnostics.hlo_precision_report(cut)


def test_a_nested_loops_matmul_counts_once_per_iteration_of_both_loops():
    """A 4x3 nested fori_loop runs its matmul 12 times: the inner loop's trip count is multiplied by
    the outer's. A walk that dropped the outer count reported 3 (4x too low), one that dropped both 1.
    Compiled on this machine, so the loops are XLA's own while loops with known trip counts."""

    def nested(outer_trips, inner_trips):
        def run(x, w):
            def outer(_, x):
                return jax.lax.fori_loop(0, inner_trips, lambda _, x: jnp.tanh(x @ w), x)

            return jax.lax.fori_loop(0, outer_trips, outer, x)

        return jax.jit(run).lower(jnp.ones((8, 16)), jnp.ones((16, 16))).compile().as_text()

    hlo = nested(4, 3)
    assert hlo.count('"known_trip_count":{"n":"4"}') == 1 and hlo.count('"known_trip_count":{"n":"3"}') == 1
    assert sum(op.flops for op in jaxamp.diagnostics.heavy_ops(hlo)) == 12 * 2 * 8 * 16 * 16
    # The traffic of the inner loop counts 4 times too: more than 3 times that of the outer loop run once.
    assert jaxamp.diagnostics.bytes_accessed(hlo) > 3 * jaxamp.diagnostics.bytes_accessed(nested(1, 3))
