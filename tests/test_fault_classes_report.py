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
    (op,) = jaxamp.hlo_precision_report(make_hlo(lhs, rhs)).ops
    assert op.operand_dtypes == (NUMPY_NAMES[lhs], NUMPY_NAMES[rhs])
    assert op.output_dtype == "float32"
    # The wider operand decides: a half x float32 op is not half precision.
    assert op.compute_dtype == "float32"


@pytest.mark.parametrize("make_hlo", [dot_hlo, convolution_hlo, cublas_hlo, cudnn_hlo])
@pytest.mark.parametrize("lhs, rhs", ORDERS)
def test_a_mixed_dtype_op_counts_nothing_as_half_precision(make_hlo, lhs, rhs):
    report = jaxamp.hlo_precision_report(make_hlo(lhs, rhs))
    assert report.fraction(NUMPY_NAMES["f16"]) == 0.0
    assert report.fraction(NUMPY_NAMES["bf16"]) == 0.0
    assert report.fraction(jnp.float32) == 1.0


@pytest.mark.parametrize("make_hlo", [dot_hlo, convolution_hlo, cublas_hlo, cudnn_hlo])
def test_a_half_op_with_a_float32_result_is_still_half_precision(make_hlo):
    """The operands, not the result, decide: a report reading the output dtype fails here."""
    (op,) = jaxamp.hlo_precision_report(make_hlo("f16", "f16")).ops
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
