"""Where FP8 pays: one matmul's training pass in FP8 against its compute dtype, on paper.

An FP8 matmul with per-tensor current scaling (`jaxamp.fp8_dot_general`)
halves its GEMMs' time at the FP8 peak but adds kernels of its own: each
operand's amax (a read of the whole tensor), its quantization (another
read, FP8 written in the two layouts cuBLASLt's FP8 GEMMs take: both
operands K-major), and a transpose of the weight's FP8 copy. Small GEMMs
lose: their time was memory-bound or short, and the passes cost more than
the halved arithmetic saves. `fp8_matmul_cost` sums the kernels of one
matmul's training pass (forward and both gradients), each at
``max(FLOPs / peak, bytes / bandwidth)``, the way
`jaxamp.diagnostics.kernel_roofline` bounds a compiled program; for
``x[M, K] @ w[K, N]`` with operands of ``bx`` and ``bw`` bytes per element
and the result and its cotangent in the compute dtype (2 bytes)::

    gemm(peak, bytes) = max(2 M K N / peak, bytes / bandwidth)
    compute dtype:  casts of wider operands ((b + 2) bytes per element)
                    + gemm(half, 2 MK + 2 KN + 2 MN)          y  = x @ w
                    + gemm(half, 2 MN + 2 KN + bx MK)         dx = g @ w.T
                    + gemm(half, 2 MK + 2 MN + bw KN)         dw = x.T @ g
    FP8:            quantization: ((2 bx + 2) MK + (2 bw + 3) KN + 6 MN) / bandwidth
                    + gemm(fp8, MK + KN + 2 MN)
                    + gemm(fp8, MN + KN + bx MK)
                    + gemm(fp8, MK + MN + bw KN)

The byte counts are those of the kernels XLA compiles `fp8_dot_general`'s
training pass to for an H200 (``tests/test_fp8_payoff.py`` checks them
against the compiled programs' `kernel_roofline`); split-K GEMMs, which XLA
picks for some shapes without autotuning, are left out on both sides.

The block-scaled formats (``matmul_format="mxfp8"`` or ``"nvfp4"``,
`jaxamp.fp8.block_scaled_dot_general`, Blackwell GPUs only) have GEMMs at
the FP8 peak (MXFP8) or the FP4 peak (NVFP4), which read ``v`` bytes per
value (1 or 0.5) and one scale byte per block of ``s`` (32 or 16), and
quantization passes whose bytes per element were fitted, for bfloat16
tensors, to the kernels XLA compiles the training pass to for a B200
(``tests/test_fp8_block_scaled.py`` checks them against a compiled
program; each wider byte of an input adds the reads of it: 3 per element
of ``x``, 3 (MXFP8) or 2 (NVFP4, 2D blocks) of ``w``)::

    gemm_bytes(a, b, out)  = (v + 1/s) (a + b) + 2 out
    block-scaled:   gemm(peak, gemm_bytes(MK, KN, MN))           y  = x @ w
                    + gemm(peak, gemm_bytes(MN, KN, MK))         dx = g @ w.T
                    + gemm(peak, gemm_bytes(MK, MN, KN))         dw = x.T @ g
                    + quantization / bandwidth
    MXFP8 quantization:  (3 bx + 3.5) MK + (3 bw + 2.7) KN + 9.9 MN
    NVFP4 quantization:  (3 bx + 8.1) MK + (2 bw + 2) KN + 30.2 MN
                         + 4 (MN + MK + KN)      # the tensor scales' multiply
                                                 # of each result, a pass where
                                                 # no consumer fuses it

NVFP4's third line is conservative: in a model, XLA fuses that multiply
into the next elementwise op where there is one.

Under ``mixed_float8``, `jaxamp.autocast` runs an eligible matmul in FP8
only where FP8 is faster on paper for its shape on the target GPU, and
keeps the others in the compute dtype (fallback reason
``too_small_to_pay``). The target is the GPU of `fp8_target` around the
trace, else the default device's if it is a GPU jaxamp knows
(`spec_for_device_kind`); elsewhere (a CPU, or a GPU without FP8 peaks in
its `GpuSpec`) every eligible matmul runs in FP8, so FP8 numerics stay
testable on a CPU. ``fp8_target("everywhere")`` forces FP8 at every
eligible matmul. How the rule compares with torchao's measured crossovers
is in the FP8 guide (docs/guides/fp8.md).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator, Sequence

import jax

from jaxamp._gpu_specs import GPU_TARGETS, GpuSpec, gpu_spec, spec_for_device_kind

EVERYWHERE = "everywhere"
"""``fp8_target(EVERYWHERE)``: every eligible matmul in FP8, whatever it costs."""

_FROM_DEVICE = object()
_TARGET: contextvars.ContextVar = contextvars.ContextVar("jaxamp_fp8_target", default=_FROM_DEVICE)
_FP8 = "float8_e4m3fn"
_FP4 = "float4_e2m1fn"
MATMUL_FORMATS = ("float8", "mxfp8", "nvfp4")
"""The formats `fp8_matmul_cost` prices: per-tensor FP8, and the block-scaled MXFP8 and NVFP4."""

# Block-scaled GEMMs: (peak key, bytes per value, elements per scale byte), and the quantization
# passes' bytes per element of x, w and g at 16-bit inputs, with the reads of x and w (module docstring).
_BLOCK_GEMMS = {"mxfp8": (_FP8, 1.0, 32), "nvfp4": (_FP4, 0.5, 16)}
_BLOCK_QUANTIZATION = {"mxfp8": ((3, 3.5), (3, 2.7), 9.9), "nvfp4": ((3, 8.1), (2, 2.0), 30.2)}
_BLACKWELL = (10, 0)


@dataclasses.dataclass(frozen=True)
class Fp8MatmulCost:
    """One matmul's training pass on paper, in FP8 and in its compute dtype.

    Attributes:
        m: the product's rows.
        k: its contracted size.
        n: its columns.
        target: the GPU's description.
        fp8_s: FP8 GEMMs plus the quantization passes, seconds.
        compute_dtype_s: the same three GEMMs in the compute dtype, seconds.
    """

    m: int
    k: int
    n: int
    target: str
    fp8_s: float
    compute_dtype_s: float

    @property
    def speedup(self) -> float:
        """``compute_dtype_s / fp8_s``: above 1 where FP8 pays."""
        return self.compute_dtype_s / self.fp8_s

    @property
    def pays(self) -> bool:
        """Whether FP8 is faster on paper."""
        return self.fp8_s < self.compute_dtype_s


def _spec(target: str | GpuSpec) -> GpuSpec:
    return gpu_spec(target) if isinstance(target, str) else target


def runs_block_scaled(spec: GpuSpec) -> bool:
    """Whether `spec`'s GPU has block-scaled tensor cores (MXFP8 and NVFP4): Blackwell, with FP8 and FP4 peaks."""
    return tuple(spec.compute_capability) >= _BLACKWELL and {_FP8, _FP4} <= set(spec.peak_flops)


def fp8_matmul_cost(
    m: int,
    k: int,
    n: int,
    target: str | GpuSpec,
    *,
    operand_bytes: Sequence[int] = (2, 2),
    compute_dtype: str = "bfloat16",
    matmul_format: str = "float8",
) -> Fp8MatmulCost:
    """The training pass of ``x[m, k] @ w[k, n]`` on `target`, in FP8 and in the compute dtype.

    The model is the module docstring's.

    Examples:
        >>> jaxamp.diagnostics.fp8_matmul_cost(1024, 2048, 1024, "h200").pays
        False
        >>> round(jaxamp.diagnostics.fp8_matmul_cost(4096, 8192, 16384, "h200").speedup, 2)
        1.68

    Args:
        m: the product's rows (the lhs free dims).
        k: its contracted size.
        n: its columns (the rhs free dims).
        target: a name of `GPU_TARGETS` (or a `GpuSpec`) with FP8 peaks.
        operand_bytes: bytes per element of ``x`` and ``w`` as they reach
            the matmul (4 for float32 params read as such).
        compute_dtype: ``bfloat16`` or ``float16``: the result's dtype and
            the GEMMs' rate without FP8.
        matmul_format: ``float8`` (per-tensor FP8, `jaxamp.fp8_dot_general`),
            ``mxfp8`` or ``nvfp4`` (`jaxamp.fp8.block_scaled_dot_general`).

    Raises:
        ValueError: an unknown target or format, a target without FP8
            peaks (or, for a block-scaled format, one before Blackwell), or
            a size below 1.
    """
    spec = _spec(target)
    if matmul_format not in MATMUL_FORMATS:
        raise ValueError(f"Unknown matmul_format {matmul_format!r}; choose one of {', '.join(MATMUL_FORMATS)}.")
    if matmul_format != "float8" and not runs_block_scaled(spec):
        raise ValueError(
            f"{spec.description} has no block-scaled tensor cores ({matmul_format} needs a Blackwell GPU, "
            f"compute capability 10.0, with FP4 and FP8 peaks in its GpuSpec); judge it on one that has: "
            f"{', '.join(name for name, other in GPU_TARGETS.items() if runs_block_scaled(other))}."
        )
    if _FP8 not in spec.peak_flops:
        with_fp8 = [name for name, other in GPU_TARGETS.items() if _FP8 in other.peak_flops]
        raise ValueError(
            f"{spec.description} has no FP8 tensor cores in its GpuSpec; judge FP8 on one that has: "
            f"{', '.join(with_fp8)}."
        )
    if min(m, k, n) < 1:
        raise ValueError(f"fp8_matmul_cost needs positive sizes; got m, k, n = {m}, {k}, {n}.")
    bx, bw = operand_bytes
    mk, kn, mn = m * k, k * n, m * n
    flops = 2 * m * k * n
    bandwidth = spec.memory_bandwidth

    def gemm(peak: float, moved: float) -> float:
        return max(flops / peak, moved / bandwidth)

    half, fp8 = spec.peak_flops[compute_dtype], spec.peak_flops[_FP8]
    casts = sum((size + 2) * elements for size, elements in ((bx, mk), (bw, kn)) if size != 2)
    compute_dtype_s = (
        casts / bandwidth
        + gemm(half, 2 * mk + 2 * kn + 2 * mn)
        + gemm(half, 2 * mn + 2 * kn + bx * mk)
        + gemm(half, 2 * mk + 2 * mn + bw * kn)
    )
    if matmul_format != "float8":
        peak_key, value_bytes, block = _BLOCK_GEMMS[matmul_format]
        ((x_reads, x_rest), (w_reads, w_rest), g_bytes) = _BLOCK_QUANTIZATION[matmul_format]

        def gemm_bytes(a: int, b: int, out: int) -> float:
            return (value_bytes + 1 / block) * (a + b) + 2 * out

        quantization = (x_reads * bx + x_rest) * mk + (w_reads * bw + w_rest) * kn + g_bytes * mn
        if matmul_format == "nvfp4":
            quantization += 4 * (mn + mk + kn)
        peak = spec.peak_flops[peak_key]
        block_s = (
            quantization / bandwidth
            + gemm(peak, gemm_bytes(mk, kn, mn))
            + gemm(peak, gemm_bytes(mn, kn, mk))
            + gemm(peak, gemm_bytes(mk, mn, kn))
        )
        return Fp8MatmulCost(m, k, n, spec.description, block_s, compute_dtype_s)
    quantization = (2 * bx + 2) * mk + (2 * bw + 3) * kn + 6 * mn
    fp8_s = (
        quantization / bandwidth
        + gemm(fp8, mk + kn + 2 * mn)
        + gemm(fp8, mn + kn + bx * mk)
        + gemm(fp8, mk + mn + bw * kn)
    )
    return Fp8MatmulCost(m, k, n, spec.description, fp8_s, compute_dtype_s)


@contextlib.contextmanager
def fp8_target(target: str | GpuSpec) -> Iterator[None]:
    """The GPU that decides, inside the block, which matmuls of ``mixed_float8`` run in FP8.

    Read when `jaxamp.autocast` (or `jaxamp.apply_policy`) traces a
    function: put the block around the first call, the ``jax.jit(...).lower``
    or the `jaxamp.precision_report`. The target is part of the key under
    which an autocast function keeps its rewrite, so the same function
    decides again under another target (a ``jax.jit`` around it keeps its
    own compiled program: lower it again inside the block).

    Examples:
        >>> with jaxamp.diagnostics.fp8_target("h200"):
        ...     compiled = jax.jit(step).lower(*args).compile()
        >>> with jaxamp.diagnostics.fp8_target("everywhere"):   # FP8 at every eligible matmul
        ...     loss = jaxamp.autocast(loss_fn, "mixed_float8")(params, batch)

    Args:
        target: a name of `GPU_TARGETS` or a `GpuSpec` with FP8 peaks (each
            eligible matmul in FP8 only where `fp8_matmul_cost` says it
            pays), or ``"everywhere"`` (every eligible matmul in FP8).

    Raises:
        ValueError: an unknown name, or a GPU without FP8 tensor cores.
    """
    if isinstance(target, str) and target.strip().lower() == EVERYWHERE:
        value = EVERYWHERE
    else:
        try:
            value = _spec(target)
        except ValueError as error:
            raise ValueError(f"{error} Or 'everywhere' for FP8 at every eligible matmul.") from None
        if _FP8 not in value.peak_flops:
            with_fp8 = [name for name, other in GPU_TARGETS.items() if _FP8 in other.peak_flops]
            raise ValueError(
                f"fp8_target({target!r}): {value.description} has no FP8 tensor cores; choose one of "
                f"{', '.join(with_fp8)}, or 'everywhere'."
            )
    token = _TARGET.set(value)
    try:
        yield
    finally:
        _TARGET.reset(token)


def target_was_set() -> bool:
    """Whether an `fp8_target` block is active."""
    return _TARGET.get() is not _FROM_DEVICE


def current_fp8_target() -> GpuSpec | None:
    """The GPU that decides FP8 now, or None for FP8 at every eligible matmul.

    `fp8_target`'s, else the default device's where it is a GPU with FP8
    peaks that jaxamp knows, else None.
    """
    value = _TARGET.get()
    if value is EVERYWHERE:
        return None
    if value is not _FROM_DEVICE:
        return value
    device = jax.devices()[0]
    spec = spec_for_device_kind(device.device_kind) if device.platform == "gpu" else None
    return spec if spec is not None and _FP8 in spec.peak_flops else None
