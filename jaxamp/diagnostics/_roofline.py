"""The roofline kernel by kernel: a bound on a compiled program's time on a known GPU.

The global roofline bounds a whole step by ``max(FLOPs / peak, bytes /
bandwidth)``: as if every kernel could overlap its arithmetic with every
other kernel's memory traffic. Kernels run one after another, each limited
by its own arithmetic or its own traffic, so the sum of their bounds is the
tighter bound (and never below the global one)::

    for each kernel k of the optimized program (loops unrolled):
        compute_s[k] = sum over its matmuls and convolutions of
                       FLOPs / peak rate of their operands' dtype
        memory_s[k]  = bytes k reads and writes / memory bandwidth
        bound_s[k]   = max(compute_s[k], memory_s[k])
    per_kernel_s = sum of bound_s[k]
    global_s     = max(sum of compute_s[k], sum of memory_s[k])

A kernel is a top-level instruction of the entry computation (a fusion, a
library call), as `jaxamp.diagnostics.bytes_accessed` counts them: it reads
its operands and writes its result once. A ``while`` body's kernels count
once per known iteration, a ``conditional`` its heavier branch. A kernel's
FLOPs are those of the matmuls and convolutions in it
(`jaxamp.diagnostics.heavy_ops`), FP8 ones at the FP8 peak (FP4 ones, NVFP4's, at
the FP4 peak), float16 and
bfloat16 at the half peak, float32 at the TF32 peak (or the float32 peak,
``float32_peak="float32"``, for a program run at matmul precision
"highest"). Element-wise arithmetic is not counted: the kernels that do it
are bound by their traffic. Nor is the arithmetic inside cuDNN's fused
attention calls (their bytes are). A bound on paper, not a measurement.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Mapping

from jaxamp._gpu_specs import GPU_TARGETS, GpuSpec, gpu_spec
from jaxamp.diagnostics import _hlo_report as hlo_report

_HALF = ("float16", "bfloat16")


@dataclasses.dataclass(frozen=True)
class KernelBound:
    """One kernel of a compiled program, bounded on a GPU.

    Attributes:
        name: the HLO instruction's name.
        kind: its opcode (``fusion``, ``copy``) or custom call target
            (``__cublas$lt$matmul$f8``, ``__cudnn$blockScaledDot``).
        runs: how many times it runs (the trip counts of enclosing loops).
        bytes: bytes it reads and writes, all runs.
        flops: matmul and convolution FLOPs, all runs, by the peak rate
            they run at (a key of `GpuSpec.peak_flops`).
        compute_s: seconds its FLOPs take at those peaks.
        memory_s: seconds its bytes take at the memory bandwidth.
        op_name: the JAX name stack of its metadata (for a fusion, the
            op XLA named it after), empty if none.
    """

    name: str
    kind: str
    runs: int
    bytes: int
    flops: Mapping[str, int]
    compute_s: float
    memory_s: float
    op_name: str = ""

    @property
    def bound_s(self) -> float:
        """``max(compute_s, memory_s)``: the kernel's bound."""
        return max(self.compute_s, self.memory_s)


@dataclasses.dataclass(frozen=True)
class KernelRoofline:
    """The kernels of one compiled program and their bounds on one GPU.

    Attributes:
        target: the GPU's description (``NVIDIA H200``).
        kernels: every kernel that moves data, in program order.
    """

    target: str
    kernels: tuple[KernelBound, ...]

    @property
    def per_kernel_s(self) -> float:
        """The sum of the kernels' bounds."""
        return sum(kernel.bound_s for kernel in self.kernels)

    @property
    def compute_s(self) -> float:
        """The matmul and convolution FLOPs at their peaks, all kernels."""
        return sum(kernel.compute_s for kernel in self.kernels)

    @property
    def memory_s(self) -> float:
        """All kernels' bytes at the memory bandwidth."""
        return sum(kernel.memory_s for kernel in self.kernels)

    @property
    def global_s(self) -> float:
        """``max(compute_s, memory_s)``: the whole program as one kernel."""
        return max(self.compute_s, self.memory_s)

    def by_kind(self) -> dict[str, float]:
        """Seconds of the per-kernel bound by kernel kind, largest first."""
        totals: dict[str, float] = collections.Counter()
        for kernel in self.kernels:
            totals[kernel.kind] += kernel.bound_s
        return dict(sorted(totals.items(), key=lambda item: -item[1]))


def _peak_key(dtype: str, float32_peak: str) -> str:
    if dtype.startswith(("float8_", "float4_")) or dtype in _HALF:
        return dtype
    return float32_peak


def _kernel_flops(module: hlo_report.HloModule, instruction, shapes) -> dict[str, int]:
    """The matmul and convolution FLOPs of one kernel (one run), by operand dtype."""
    ops = hlo_report._heavy_ops_of(module, instruction, shapes, 1)  # pylint: disable=protected-access
    found = list(ops)
    if not found:  # a fusion: the dots and convolutions of the computations it calls
        for name in hlo_report._called_computations(instruction):  # pylint: disable=protected-access
            if name in module.computations:
                heavy = functools.partial(hlo_report._heavy_ops_of, module)  # pylint: disable=protected-access
                found += hlo_report.walk(module, heavy, weight=lambda op: op.flops, computation=name)
    totals: dict[str, int] = collections.Counter()
    for op in found:
        totals[max(op.operand_dtypes, key=_dtype_width)] += op.flops
    return dict(totals)


def _dtype_width(dtype: str) -> float:
    if dtype.startswith("float4_"):
        return 0.5
    return 1 if dtype.startswith("float8_") else {"float16": 2, "bfloat16": 2, "float64": 8}.get(dtype, 4)


def kernel_roofline(hlo_text: str, target: str | GpuSpec, *, float32_peak: str = "tf32") -> KernelRoofline:
    """Each kernel of an optimized program bounded on `target` (see the module docstring).

    Examples:
        >>> roofline = jaxamp.diagnostics.kernel_roofline(compiled.as_text(), "h200")
        >>> roofline.per_kernel_s >= roofline.global_s
        True

    Args:
        hlo_text: the optimized module's text (``Compiled.as_text()``).
        target: a name of `GPU_TARGETS` or a `GpuSpec`.
        float32_peak: the peak of float32 matmuls: ``tf32`` (JAX's default
            precision on GPUs) or ``float32`` (precision "highest").

    Returns:
        A `KernelRoofline`.

    Raises:
        ValueError: an unknown target or `float32_peak`, or FP8 matmuls on a
            GPU without FP8 peaks.
    """
    spec = gpu_spec(target) if isinstance(target, str) else target
    if float32_peak not in ("tf32", "float32"):
        raise ValueError(f"float32_peak={float32_peak!r}; choose 'tf32' or 'float32'.")
    module = hlo_report.HloModule.parse(hlo_text)
    kernels: list[KernelBound] = []
    _collect(module, module.entry, 1, spec, float32_peak, kernels)
    return KernelRoofline(spec.description, tuple(kernels))


def _collect(module, computation: str, runs: int, spec: GpuSpec, float32_peak: str, kernels: list) -> None:
    """Appends the kernels of `computation` (run `runs` times) to `kernels`, as `bytes_accessed` walks them."""
    shapes = module.shapes_of(computation)
    for instruction in module.computations[computation]:
        called = [
            name
            for name in hlo_report._called_computations(instruction)  # pylint: disable=protected-access
            if name in module.computations
        ]
        if instruction.opcode == "while":
            trips = runs * hlo_report._trip_count(instruction)  # pylint: disable=protected-access
            for name in called:
                _collect(module, name, trips, spec, float32_peak, kernels)
        elif instruction.opcode == "conditional":
            branches = []
            for name in called:
                branches.append([])
                _collect(module, name, runs, spec, float32_peak, branches[-1])
            kernels.extend(max(branches, key=lambda found: sum(k.bound_s for k in found), default=[]))
        elif instruction.opcode == "call":
            for name in called:
                _collect(module, name, runs, spec, float32_peak, kernels)
        elif instruction.opcode not in hlo_report._NO_TRAFFIC_OPCODES:  # pylint: disable=protected-access
            kernels.append(_bound(module, instruction, shapes, runs, spec, float32_peak))


def _bound(module, instruction, shapes, runs: int, spec: GpuSpec, float32_peak: str) -> KernelBound:
    results = instruction.shapes[:1] if instruction.opcode == "custom-call" else instruction.shapes
    operands = (shape for name in instruction.operands for shape in shapes.get(name, ()))
    moved = runs * sum(shape.num_bytes for shape in (*results, *operands))
    flops: dict[str, int] = collections.Counter()
    for dtype, count in _kernel_flops(module, instruction, shapes).items():
        flops[_peak_key(dtype, float32_peak)] += runs * count
    missing = [key for key in flops if key not in spec.peak_flops]
    if missing:
        raise ValueError(
            f"{spec.description} has no peak rate for {', '.join(missing)} matmuls (kernel "
            f"{instruction.name}); bound the program on a GPU that has one "
            f"({', '.join(name for name, other in GPU_TARGETS.items() if set(missing) <= set(other.peak_flops))})."
        )
    kind = hlo_report._custom_call_target(instruction.attributes) or instruction.opcode  # pylint: disable=protected-access
    return KernelBound(
        name=instruction.name,
        kind=kind,
        runs=runs,
        bytes=moved,
        flops=dict(flops),
        compute_s=sum(count / spec.peak_flops[key] for key, count in flops.items()),
        memory_s=moved / spec.memory_bandwidth,
        op_name=hlo_report.metadata_key(instruction, module)[0],
    )
