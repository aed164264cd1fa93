"""FP8 only where it pays: the cost model, the target that decides, and the autocast rule on an H200.

The model's tests need nothing; the compiled ones compile for an H200
without a GPU and skip without the CUDA plugin.
"""

import jax
import jax.numpy as jnp
import pytest

import jaxamp
from jaxamp.fp8 import _payoff as fp8_payoff

# torchao's float8 tensorwise training crossovers (H100, measured): M, K, N and its speed-up over bfloat16.
TORCHAO_SLOWER = (1024, 2048, 1024)  # 0.80x
TORCHAO_FASTER = (4096, 8192, 16384)  # 1.39x


def _needs_plugin():
    if not jaxamp.diagnostics.cuda_plugin_available():
        pytest.skip("needs the CUDA PJRT plugin (pip install 'jax-mixed-precision[gpu-aot]')")


@pytest.mark.parametrize("target", ["h100", "h200", "b200"])
def test_the_model_agrees_with_torchaos_published_crossovers(target):
    """Fails if the quantization passes were left out (FP8 would pay at 1024,
    2048, 1024: its GEMMs alone are 2x faster) or weighed so heavily that FP8
    never pays."""
    slower = jaxamp.diagnostics.fp8_matmul_cost(*TORCHAO_SLOWER, target)
    faster = jaxamp.diagnostics.fp8_matmul_cost(*TORCHAO_FASTER, target)
    assert not slower.pays and slower.speedup < 1
    assert faster.pays and faster.speedup > 1.3


def test_the_h200_figures_on_paper():
    """The model's numbers at the two crossovers on an H200, by hand:
    1024x2048x1024: bfloat16 3 GEMMs of 4.34 us each (compute-bound) = 13.02 us;
    FP8 3 x 2.17 us + 33.55 MB of quantization traffic (6.99 us) = 13.50 us."""
    slower = jaxamp.diagnostics.fp8_matmul_cost(*TORCHAO_SLOWER, "h200")
    m, k, n = TORCHAO_SLOWER
    gemm = 2 * m * k * n
    assert slower.compute_dtype_s == pytest.approx(3 * gemm / 989.4e12)
    quantization = 6 * m * k + 7 * k * n + 6 * m * n
    assert slower.fp8_s == pytest.approx(3 * gemm / 1978.9e12 + quantization / 4.8e12)
    assert round(slower.speedup, 2) == 0.96
    assert round(jaxamp.diagnostics.fp8_matmul_cost(*TORCHAO_FASTER, "h200").speedup, 2) == 1.68


def test_float32_operands_cost_their_casts_on_both_sides():
    """float32 operands: bfloat16 pays a cast (read 4, write 2 bytes), FP8 reads 4 bytes twice."""
    bf16 = jaxamp.diagnostics.fp8_matmul_cost(8192, 768, 768, "h200")
    f32 = jaxamp.diagnostics.fp8_matmul_cost(8192, 768, 768, "h200", operand_bytes=(4, 4))
    assert f32.compute_dtype_s > bf16.compute_dtype_s and f32.fp8_s > bf16.fp8_s


def test_bad_targets_and_sizes_are_refused_with_the_choices():
    with pytest.raises(ValueError, match=r"'b300'.*v100, a100, h100, h200, b200"):
        jaxamp.diagnostics.fp8_matmul_cost(1024, 1024, 1024, "b300")
    with pytest.raises(ValueError, match=r"A100.*no FP8 tensor cores.*h100, h200, b200"):
        jaxamp.diagnostics.fp8_matmul_cost(1024, 1024, 1024, "a100")
    with pytest.raises(ValueError, match=r"positive sizes; got m, k, n = 0, 16, 16"):
        jaxamp.diagnostics.fp8_matmul_cost(0, 16, 16, "h200")
    with (
        pytest.raises(ValueError, match=r"'h300'.*b200.*Or 'everywhere'"),
        jaxamp.diagnostics.fp8_target("h300"),
    ):
        pass
    with (
        pytest.raises(ValueError, match=r"fp8_target\('v100'\).*no FP8 tensor cores.*'everywhere'"),
        jaxamp.diagnostics.fp8_target("v100"),
    ):
        pass


def test_the_target_is_the_blocks_inside_it_and_nothing_on_a_cpu_outside():
    assert fp8_payoff.current_fp8_target() is None  # the CPU: FP8 everywhere
    with jaxamp.diagnostics.fp8_target("h200"):
        assert fp8_payoff.current_fp8_target() is jaxamp.diagnostics.GPU_TARGETS["h200"]
        with jaxamp.diagnostics.fp8_target("everywhere"):
            assert fp8_payoff.current_fp8_target() is None and fp8_payoff.target_was_set()
        assert fp8_payoff.current_fp8_target().description == "NVIDIA H200"
    assert fp8_payoff.current_fp8_target() is None and not fp8_payoff.target_was_set()


class _FakeDevice:
    def __init__(self, platform, device_kind):
        self.platform, self.device_kind = platform, device_kind


@pytest.mark.parametrize(
    "platform, device_kind, target",
    [("gpu", "NVIDIA H200", "h200"), ("gpu", "NVIDIA B200", "b200"), ("gpu", "NVIDIA A100-SXM4-80GB", None),
     ("gpu", "NVIDIA GeForce RTX 4090", None), ("tpu", "TPU v5 lite", None)],
)  # fmt: skip
def test_outside_a_block_the_target_is_the_default_devices_gpu_if_it_has_fp8(
    monkeypatch, platform, device_kind, target
):
    """On an H200 or a B200 the device decides; a GPU without FP8 peaks, one jaxamp does not
    know, or no GPU leaves FP8 everywhere. Fails if the device were not read."""
    monkeypatch.setattr(jax, "devices", lambda *args: [_FakeDevice(platform, device_kind)])
    expected = jaxamp.diagnostics.GPU_TARGETS[target] if target else None
    assert fp8_payoff.current_fp8_target() is expected


def _loss(x, w):
    return jnp.sum(jnp.square((x @ w).astype(jnp.float32)))


def _traced_fp8_ops(m, k, n):
    x, w = jnp.zeros((m, k), jnp.bfloat16), jnp.zeros((k, n), jnp.bfloat16)
    grad = jax.grad(jaxamp.autocast(_loss, "mixed_float8"), argnums=(0, 1))
    return sum(op.is_fp8 for op in jaxamp.precision_report(grad, x, w).ops)


def test_on_a_cpu_every_eligible_matmul_stays_fp8_and_a_target_decides_by_shape():
    """Traced on the CPU: a 64x64x64 matmul runs its three GEMMs in FP8 (FP8's
    numerics stay tested here); inside fp8_target("h200") it is too small to pay
    and none is FP8. Fails if the default judged by a GPU on a CPU, or if the
    target were ignored."""
    assert _traced_fp8_ops(64, 64, 64) == 3
    with jaxamp.diagnostics.fp8_target("h200"):
        assert _traced_fp8_ops(64, 64, 64) == 0
        assert _traced_fp8_ops(4096, 4096, 4096) == 3


def test_one_autocast_function_decides_again_under_another_target():
    """The rewrite is cached per signature; the target is part of that key, so a
    function first traced on the CPU (FP8) is not reused inside fp8_target("h200")."""
    fun = jax.grad(jaxamp.autocast(_loss, "mixed_float8"), argnums=(0, 1))
    x, w = jnp.zeros((64, 64), jnp.bfloat16), jnp.zeros((64, 64), jnp.bfloat16)

    def fp8_ops():
        return sum(op.is_fp8 for op in jaxamp.precision_report(fun, x, w).ops)

    assert fp8_ops() == 3
    with jaxamp.diagnostics.fp8_target("h200"):
        assert fp8_ops() == 0
    assert fp8_ops() == 3


def _h200_report(m, k, n, target=None):
    device = jaxamp.diagnostics.gpu_target_device("h200")
    args = jaxamp.diagnostics.on_device(
        (jax.ShapeDtypeStruct((m, k), jnp.bfloat16), jax.ShapeDtypeStruct((k, n), jnp.bfloat16)), device
    )
    step = jax.value_and_grad(jaxamp.autocast(_loss, "mixed_float8"), argnums=(0, 1))
    if target is None:
        return jaxamp.precision_report(step, *args, compiled=True)
    with jaxamp.diagnostics.fp8_target(target):
        return jaxamp.precision_report(step, *args, compiled=True)


def test_compiled_for_an_h200_the_published_crossovers_go_the_published_way_and_the_report_says_why():
    """The default mixed_float8 policy, compiled for an H200 (the target comes from
    the device the arguments are on): at 1024, 2048, 1024 (torchao: 0.80x) all
    three GEMMs stay bfloat16, each row saying "kept in bfloat16: too small to
    pay"; at 4096, 8192, 16384 (torchao: 1.39x) all three are cuBLASLt FP8 GEMMs,
    each row saying "pays on paper". Fails without the shape rule (the small one
    would be FP8) or if the report lost the reason."""
    _needs_plugin()
    m, k, n = TORCHAO_SLOWER
    small = _h200_report(m, k, n)
    assert {(row.status, row.reason, row.operand_dtypes) for row in small.fp8_rows()} == {
        ("fallback", "too_small_to_pay", ("bfloat16", "bfloat16"))
    }
    assert sum(row.flops for row in small.fp8_rows()) == 3 * 2 * m * k * n
    assert all(row.why == "kept in bfloat16: too small to pay" for row in small.fp8_rows())
    assert "kept in bfloat16: too small to pay" in str(small)
    assert small.fp8_fraction() == 0.0

    m, k, n = TORCHAO_FASTER
    large = _h200_report(m, k, n)
    assert {(row.status, row.reason, row.primitive) for row in large.fp8_rows()} == {
        ("fp8", "pays", "__cublas$lt$matmul$f8")
    }
    assert large.fp8_fraction() == 1.0 and sum(row.ops for row in large.fp8_rows()) == 3
    assert all(row.why == "pays on paper" for row in large.fp8_rows())
    assert str(large).count("pays on paper") == len(large.fp8_rows())


def test_compiled_for_an_h200_fp8_everywhere_forces_the_small_gemms_into_fp8():
    _needs_plugin()
    report = _h200_report(*TORCHAO_SLOWER, target="everywhere")
    assert report.fp8_fraction() == 1.0
    assert {(row.status, row.reason) for row in report.fp8_rows()} == {("fp8", "")}


@pytest.mark.parametrize("shape", [TORCHAO_SLOWER, TORCHAO_FASTER])
def test_the_model_is_the_compiled_programs_kernel_roofline(shape):
    """The cost model's byte counts against the kernels XLA compiles for an H200:
    at 4096, 8192, 16384 the same to 0.1% (bfloat16 and FP8); at 1024, 2048,
    1024, where XLA splits the forward GEMM's K in two without autotuning (one
    more kernel on both sides), within 20%, and on the same side of 1."""
    _needs_plugin()
    m, k, n = shape
    device = jaxamp.diagnostics.gpu_target_device("h200")
    args = jaxamp.diagnostics.on_device(
        (
            jax.ShapeDtypeStruct((m, k), jnp.bfloat16),
            jax.ShapeDtypeStruct((k, n), jnp.bfloat16),
            jax.ShapeDtypeStruct((m, n), jnp.bfloat16),
        ),
        device,
    )

    def train(dot):
        def program(x, w, g):
            y, vjp = jax.vjp(lambda x, w: dot(x, w, (((1,), (0,)), ((), ()))), x, w)
            return y, vjp(g)

        text = jax.jit(program).lower(*args).compile().as_text()
        return jaxamp.diagnostics.kernel_roofline(text, "h200").per_kernel_s

    bf16_s = train(lambda x, w, dims: jax.lax.dot_general(x, w, dims, preferred_element_type=jnp.bfloat16))
    fp8_s = train(jaxamp.fp8_dot_general)
    cost = jaxamp.diagnostics.fp8_matmul_cost(m, k, n, "h200")
    tolerance = 1e-3 if shape == TORCHAO_FASTER else 0.2
    assert cost.compute_dtype_s == pytest.approx(bf16_s, rel=tolerance)
    assert cost.fp8_s == pytest.approx(fp8_s, rel=tolerance)
    assert (bf16_s / fp8_s > 1) == cost.pays
