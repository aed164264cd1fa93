"""Tests for `jaxamp.diagnostics.kernel_roofline`: a compiled program's bound, summed kernel by kernel.

Hand-built HLO in the form XLA prints for a GPU, so that every figure is
computed here from the datasheet peaks, with no GPU and no plugin.
"""

import pytest

import jaxamp
from jaxamp.diagnostics import _hlo_report as hlo_report

H200 = jaxamp.diagnostics.GPU_TARGETS["h200"]
N = 4096
MATRIX_BYTES = N * N * 2  # one bfloat16 [4096, 4096]

_GEMM_CONFIG = (
    'backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],'
    '"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]}}}'
)

# Two kernels: a cuBLAS GEMM of two [4096, 4096] bfloat16 matrices (compute-bound on an H200) and
# a fusion adding a bias matrix to its result (memory-bound).
TWO_KERNELS = f"""\
HloModule jit_layer, is_scheduled=true

%fused_add (p0: bf16[4096,4096], p1: bf16[4096,4096]) -> bf16[4096,4096] {{
  %p0 = bf16[4096,4096]{{1,0}} parameter(0)
  %p1 = bf16[4096,4096]{{1,0}} parameter(1)
  ROOT %add.1 = bf16[4096,4096]{{1,0}} add(%p0, %p1)
}}

ENTRY %main (x: bf16[4096,4096], w: bf16[4096,4096], b: bf16[4096,4096]) -> bf16[4096,4096] {{
  %x = bf16[4096,4096]{{1,0}} parameter(0)
  %w = bf16[4096,4096]{{1,0}} parameter(1)
  %b = bf16[4096,4096]{{1,0}} parameter(2)
  %gemm = (bf16[4096,4096]{{1,0}}, s8[4194304]{{0}}) custom-call(%x, %w), custom_call_target="__cublas$gemm", metadata={{op_name="jit(layer)/dot_general"}}, {_GEMM_CONFIG}
  %y = bf16[4096,4096]{{1,0}} get-tuple-element(%gemm), index=0
  ROOT %out = bf16[4096,4096]{{1,0}} fusion(%y, %b), kind=kLoop, calls=%fused_add, metadata={{op_name="jit(layer)/add"}}
}}
"""

# The same two kernels in the body of a loop that runs 3 times (a lax.scan over 3 layers).
LOOP_OF_THREE = f"""\
HloModule jit_scan, is_scheduled=true

%fused_add (p0: bf16[4096,4096], p1: bf16[4096,4096]) -> bf16[4096,4096] {{
  %p0 = bf16[4096,4096]{{1,0}} parameter(0)
  %p1 = bf16[4096,4096]{{1,0}} parameter(1)
  ROOT %add.1 = bf16[4096,4096]{{1,0}} add(%p0, %p1)
}}

%body (carry: (bf16[4096,4096], bf16[4096,4096])) -> (bf16[4096,4096], bf16[4096,4096]) {{
  %carry = (bf16[4096,4096]{{1,0}}, bf16[4096,4096]{{1,0}}) parameter(0)
  %x = bf16[4096,4096]{{1,0}} get-tuple-element(%carry), index=0
  %w = bf16[4096,4096]{{1,0}} get-tuple-element(%carry), index=1
  %gemm = (bf16[4096,4096]{{1,0}}, s8[4194304]{{0}}) custom-call(%x, %w), custom_call_target="__cublas$gemm", {_GEMM_CONFIG}
  %y = bf16[4096,4096]{{1,0}} get-tuple-element(%gemm), index=0
  %out = bf16[4096,4096]{{1,0}} fusion(%y, %w), kind=kLoop, calls=%fused_add
  ROOT %next = (bf16[4096,4096]{{1,0}}, bf16[4096,4096]{{1,0}}) tuple(%out, %w)
}}

%condition (carry: (bf16[4096,4096], bf16[4096,4096])) -> pred[] {{
  %carry = (bf16[4096,4096]{{1,0}}, bf16[4096,4096]{{1,0}}) parameter(0)
  ROOT %go = pred[] constant(true)
}}

ENTRY %main (x: bf16[4096,4096], w: bf16[4096,4096]) -> (bf16[4096,4096], bf16[4096,4096]) {{
  %x = bf16[4096,4096]{{1,0}} parameter(0)
  %w = bf16[4096,4096]{{1,0}} parameter(1)
  %init = (bf16[4096,4096]{{1,0}}, bf16[4096,4096]{{1,0}}) tuple(%x, %w)
  ROOT %loop = (bf16[4096,4096]{{1,0}}, bf16[4096,4096]{{1,0}}) while(%init), condition=%condition, body=%body, backend_config={{"known_trip_count":{{"n":"3"}}}}
}}
"""

GEMM_S = 2 * N**3 / H200.peak_flops["bfloat16"]  # 138.9 us of arithmetic; its 3 matrices take 21.0 us
ADD_S = 3 * MATRIX_BYTES / H200.memory_bandwidth  # 21.0 us of traffic; no matmul FLOPs


def test_the_bound_of_two_kernels_is_the_sum_of_their_maxima_not_the_max_of_their_sums():
    """The GEMM is bound by its arithmetic (138.9 us), the add by its traffic
    (21.0 us): 159.9 us in all, where the global roofline, which lets the add's
    traffic hide under the GEMM's arithmetic, says 138.9 us. Fails if a kernel's
    bound were not its own max (a sum of compute plus memory, or the global max),
    or if the GEMM's FLOPs were not found or ran at another peak."""
    roofline = jaxamp.diagnostics.kernel_roofline(TWO_KERNELS, "h200")
    gemm, add = roofline.kernels
    assert (gemm.kind, add.kind) == ("__cublas$gemm", "fusion")
    assert gemm.flops == {"bfloat16": 2 * N**3} and add.flops == {}
    assert gemm.bytes == add.bytes == 3 * MATRIX_BYTES  # the GEMM's workspace is not traffic
    assert gemm.bound_s == pytest.approx(GEMM_S) and add.bound_s == pytest.approx(ADD_S)
    assert roofline.per_kernel_s == pytest.approx(GEMM_S + ADD_S)
    assert roofline.per_kernel_s == pytest.approx(159.88e-6, rel=1e-3)
    assert roofline.global_s == pytest.approx(max(GEMM_S, 2 * ADD_S)) == pytest.approx(138.91e-6, rel=1e-3)
    assert roofline.target == "NVIDIA H200"
    assert (gemm.op_name, add.op_name) == ("jit(layer)/dot_general", "jit(layer)/add")


def test_a_loop_body_counts_once_per_known_iteration_and_traffic_matches_bytes_accessed():
    """Fails if the walk did not enter the while body or ignored its trip count,
    or if the kernels' bytes drifted from `bytes_accessed`'s estimate."""
    roofline = jaxamp.diagnostics.kernel_roofline(LOOP_OF_THREE, "h200")
    assert [kernel.runs for kernel in roofline.kernels] == [3, 3]
    assert roofline.per_kernel_s == pytest.approx(3 * (GEMM_S + ADD_S))
    for text in (TWO_KERNELS, LOOP_OF_THREE):
        kernels = jaxamp.diagnostics.kernel_roofline(text, "h200").kernels
        assert sum(kernel.bytes for kernel in kernels) == hlo_report.bytes_accessed(text)


@pytest.mark.parametrize("target", sorted(jaxamp.diagnostics.GPU_TARGETS))
def test_every_target_bounds_the_gemm_at_its_own_peak(target):
    spec = jaxamp.diagnostics.GPU_TARGETS[target]
    gemm, add = jaxamp.diagnostics.kernel_roofline(TWO_KERNELS, target).kernels
    assert gemm.compute_s == pytest.approx(2 * N**3 / spec.peak_flops["bfloat16"])
    assert add.memory_s == pytest.approx(3 * MATRIX_BYTES / spec.memory_bandwidth)


def test_bad_targets_and_peaks_are_refused_with_the_choices():
    with pytest.raises(ValueError, match=r"'b300'.*v100, a100, h100, h200, b200"):
        jaxamp.diagnostics.kernel_roofline(TWO_KERNELS, "b300")
    with pytest.raises(ValueError, match=r"float32_peak='fp64'; choose 'tf32' or 'float32'"):
        jaxamp.diagnostics.kernel_roofline(TWO_KERNELS, "h200", float32_peak="fp64")
    fp8 = TWO_KERNELS.replace("%x = bf16", "%x = f8e4m3fn").replace("%w = bf16", "%w = f8e4m3fn")
    with pytest.raises(ValueError, match=r"A100.*no peak rate for float8_e4m3fn.*h100, h200, b200"):
        jaxamp.diagnostics.kernel_roofline(fp8, "a100")
