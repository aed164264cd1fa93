"""What per-tensor current scaling costs an FP8 GEMM, compiled for an H200 without a GPU.

An FP8 matmul with current scaling computes each operand's scale from that
operand now::

    amax_x = max(|x|)                      # a reduction: reads all of x
    x_fp8  = convert(clip(x / (amax_x / 448)), float8_e4m3fn)   # reads x again
    ...                                    # the same for w (and, backward, for
                                           # the cotangent g in float8_e5m2)
    y = (x_fp8 @ w_fp8 in bfloat16) * scale_x * scale_w     # one cuBLASLt FP8 GEMM

The amax reduction must finish before the quantize can start, so it is a
kernel of its own that reads the whole bfloat16 tensor once more. Delayed
scaling (the scale from an amax history carried in the train state) lets
the quantize kernel use last step's scale and emit this step's amax as a
side output: it saves exactly those amax passes, no more. This measurement
counts them.

It compiles the function for an H200 target without a GPU
(`jaxamp.diagnostics.gpu_target_device`) at a transformer's GEMM shapes and sorts the
optimized program's kernels (the entry computation's instructions that move
data, each reading its operands and writing its result once, as
`jaxamp.diagnostics.bytes_accessed` counts them) into:

* ``gemm``: the cuBLAS/cuBLASLt calls (bytes: FP8 operands in, result out);
* ``amax``: kernels that hold a ``reduce`` by ``maximum`` and write only
  its result (the amax passes);
* ``quantize``: kernels that write FP8 (scale, clip, convert; cuBLASLt's FP8
  GEMM takes both operands K-major, so a transpose rides along);
* ``other``: everything else (a split-K GEMM's sum, output casts, the
  scalar arithmetic of the scales, and a producer kernel that computes the
  amax on the side: XLA fuses the reduction into the kernel that writes
  the activation, as one multi-output fusion).

Each class gets a time on paper at the GPU's peak rates from
`jaxamp.diagnostics.GPU_TARGETS`: the GEMM ``max(FLOPs / peak FP8 FLOP/s, bytes /
bandwidth)``, the others ``bytes / bandwidth``. Beside them, the same pass in bfloat16 on paper (each GEMM ``max(FLOPs /
peak bfloat16 FLOP/s, bfloat16 operands and result / bandwidth)``, no
casts), and the FP8 pass's kernels over it: with current scaling (all
kernels) and with delayed scaling (all but the amax passes). A bound, not a
measurement:
real kernels reach a fraction of either peak, and small elementwise kernels
a smaller fraction than GEMMs.

Three passes per shape: ``forward`` (y = f(x, w): one GEMM, amax of x and
w), ``train`` (y and the vector-Jacobian product with a cotangent g given
as an input: three GEMMs, amax of x, w and g, the forward's and backward's
quantizations as the function writes them), and ``gelu-fwd`` (y = f(gelu(h),
w): the activation made by a kernel, as in a transformer's MLP, so that its
amax can ride in that kernel; the bfloat16 side then includes the GELU
kernel's own read of h and write of x).

The function measured defaults to `current_scaling_dot_general`, written
here with plain ``lax`` as the reference pattern; ``--function
module:name`` (for instance ``jaxamp:fp8_dot_general``) measures any
function with ``lax.dot_general``'s signature the same way, and `measure`
takes one from Python. Needs the CUDA PJRT plugin. Writes fp8_scaling_cost.txt.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

import jaxamp
from experiments.measure.gpu_target import compile_for, target_device
from jaxamp.diagnostics import _hlo_report as hlo_report  # the HLO reader's own types: no public names for them

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
MATMUL = (((1,), (0,)), ((), ()))
FP8_PRESET = lax.DotAlgorithmPreset.ANY_F8_ANY_F8_F32

# (name, tokens, in features, out features): GPT-2 124M (d_model 768, MLP
# 3072) at batch * sequence = 8192 tokens, and a 5B-parameter model's MLP
# (d_model 4096, MLP 16384) for scale.
SHAPES = (
    ("gpt2-124m attention qkv", 8192, 768, 2304),
    ("gpt2-124m attention out", 8192, 768, 768),
    ("gpt2-124m mlp up", 8192, 768, 3072),
    ("gpt2-124m mlp down", 8192, 3072, 768),
    ("5b mlp up", 8192, 4096, 16384),
)


def _quantize(x, dtype):
    """Per-tensor current scaling: (x / scale saturated into `dtype`, scale)."""
    largest = jnp.finfo(dtype).max.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x)).astype(jnp.float32)
    scale = jnp.where(amax > 0, amax / largest, 1.0)
    return jnp.clip(x.astype(jnp.float32) / scale, -largest, largest).astype(dtype), scale


def _fp8_matmul(a, b, contracting, scale):
    """An FP8 GEMM whose bfloat16 result XLA writes from cuBLASLt directly.

    Asking for a bfloat16 result (float32 accumulation stays: the preset
    says so) with the scale multiplied in lets XLA fuse both into the call;
    a float32 result cast afterwards costs a kernel that reads 4 and writes
    2 bytes per output element. The scale is rounded to bfloat16 (a
    relative error of at most 2**-9 on the whole product, far below FP8's
    own 2**-4).
    """
    with jax.named_scope("jaxamp_fp8"):
        product = lax.dot_general(
            a, b, (contracting, ((), ())), precision=FP8_PRESET, preferred_element_type=jnp.bfloat16
        )
    return product * scale.astype(jnp.bfloat16)


@jax.custom_vjp
def _current_scaling_matmul(x, w):
    return _forward(x, w)[0]


def _forward(x, w):
    (xq, x_scale), (wq, w_scale) = _quantize(x, E4M3), _quantize(w, E4M3)
    y = _fp8_matmul(xq, wq, ((1,), (0,)), x_scale * w_scale)
    return y.astype(x.dtype), (x, w)


def _backward(residuals, g):
    x, w = residuals
    (gq, g_scale), (xq, x_scale), (wq, w_scale) = _quantize(g, E5M2), _quantize(x, E4M3), _quantize(w, E4M3)
    dx = _fp8_matmul(gq, wq, ((1,), (1,)), g_scale * w_scale)
    dw = _fp8_matmul(xq, gq, ((0,), (0,)), x_scale * g_scale)
    return dx.astype(x.dtype), dw.astype(w.dtype)


_current_scaling_matmul.defvjp(_forward, _backward)


def current_scaling_dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None):
    """``lax.dot_general`` of a matrix product in FP8 with per-tensor current scaling.

    Forward: e4m3 operands; backward (a custom VJP): the cotangent in e5m2,
    so each of the three GEMMs is an FP8 GEMM. Only ``x @ w`` of 2-D
    operands: the reference pattern, not a general implementation.
    """
    del precision, preferred_element_type  # the FP8 preset and float32 accumulation are fixed
    if dimension_numbers != MATMUL or lhs.ndim != 2 or rhs.ndim != 2:
        raise ValueError(
            f"current_scaling_dot_general computes x @ w of 2-D operands only, got shapes {lhs.shape}, "
            f"{rhs.shape} and dimension_numbers={dimension_numbers}; pass {MATMUL}."
        )
    return _current_scaling_matmul(lhs, rhs)


@dataclasses.dataclass(frozen=True)
class Cost:
    """Bytes moved and GEMM FLOPs of one compiled program, by kernel class."""

    gemm_bytes: int
    amax_bytes: int
    quantize_bytes: int
    other_bytes: int
    gemm_flops: int
    fp8_share: float
    amax_kernels: int


def _called(module: hlo_report.HloModule, instruction: hlo_report.Instruction) -> list[str]:
    names = hlo_report._called_computations(instruction)  # pylint: disable=protected-access
    return [name for name in names if name in module.computations]


def _is_max_reduce(module: hlo_report.HloModule, instruction: hlo_report.Instruction) -> bool:
    """A ``reduce`` whose combiner returns a ``maximum`` (an amax), or a kernel holding one."""
    if instruction.opcode == "reduce":
        return any(module.computations[name][-1].opcode == "maximum" for name in _called(module, instruction))
    return any(
        _is_max_reduce(module, inner)
        for name in _called(module, instruction)
        for inner in module.computations[name]
    )


def cost(compiled_text: str) -> Cost:
    """Sorts the entry computation's kernels of an optimized program by class."""
    module = hlo_report.HloModule.parse(compiled_text)
    shapes = module.shapes_of(module.entry)
    totals = {"gemm": 0, "amax": 0, "quantize": 0, "other": 0}
    amax_kernels = 0
    for instruction in module.computations[module.entry]:
        if instruction.opcode in hlo_report._NO_TRAFFIC_OPCODES:  # pylint: disable=protected-access
            continue
        is_call = instruction.opcode == "custom-call"
        results = instruction.shapes[:1] if is_call else instruction.shapes  # not the workspace
        operands = (shape for name in instruction.operands for shape in shapes.get(name, ()))
        moved = sum(shape.num_bytes for shape in (*results, *operands))
        if is_call and "__cublas$" in instruction.attributes:
            totals["gemm"] += moved
        elif _is_max_reduce(module, instruction) and len(instruction.shapes) == 1:
            totals["amax"] += moved
            amax_kernels += 1
        elif any(shape.dtype.startswith("float8_") for shape in instruction.shapes):
            totals["quantize"] += moved
        else:
            totals["other"] += moved
    report = jaxamp.diagnostics.hlo_precision_report(compiled_text)
    return Cost(
        totals["gemm"],
        totals["amax"],
        totals["quantize"],
        totals["other"],
        sum(op.flops for op in report.ops),
        report.fp8_fraction(),
        amax_kernels,
    )


def _programs(dot_general: Callable) -> dict[str, Callable]:
    def forward(x, w):
        return dot_general(x, w, MATMUL)

    def train(x, w, g):
        y, vjp = jax.vjp(forward, x, w)
        return y, vjp(g)

    def gelu_forward(h, w):
        return forward(jax.nn.gelu(h), w)

    return {"forward": forward, "train": train, "gelu-fwd": gelu_forward}


def measure(
    dot_general: Callable = current_scaling_dot_general, *, target: str = "h200", shapes=SHAPES
) -> list[dict]:
    """Compiles `dot_general`'s forward and train programs at each shape and costs them.

    Args:
        dot_general: a function with ``lax.dot_general``'s signature that
            computes in FP8 (`current_scaling_dot_general` by default).
        target: a name of `jaxamp.diagnostics.GPU_TARGETS` with FP8 peaks.
        shapes: ``(name, tokens, in_features, out_features)`` tuples.

    Returns:
        One dict per shape and pass: the `Cost` fields and times on paper (s).
    """
    spec = jaxamp.diagnostics.GPU_TARGETS[target]
    if "float8_e4m3fn" not in spec.peak_flops:
        raise ValueError(
            f"target {target!r} has no FP8 tensor cores in jaxamp.diagnostics.GPU_TARGETS; choose one of "
            f"{', '.join(name for name, s in jaxamp.diagnostics.GPU_TARGETS.items() if 'float8_e4m3fn' in s.peak_flops)}."
        )
    device = target_device(target)
    rows = []
    for name, tokens, features_in, features_out in shapes:
        x = jax.ShapeDtypeStruct((tokens, features_in), jnp.bfloat16)
        w = jax.ShapeDtypeStruct((features_in, features_out), jnp.bfloat16)
        g = jax.ShapeDtypeStruct((tokens, features_out), jnp.bfloat16)
        for mode, program in _programs(dot_general).items():
            measured = cost(compile_for(program, (x, w, g) if mode == "train" else (x, w), device).text)
            print(f"  {name} {mode}: compiled", flush=True)
            gemm_s = max(
                measured.gemm_flops / spec.peak_flops["float8_e4m3fn"],
                measured.gemm_bytes / spec.memory_bandwidth,
            )
            # The pass in bfloat16: one GEMM forward, three (y, dx, dw) in training, each
            # reading its two operands and writing its result once.
            gemms = 3 if mode == "train" else 1
            bf16_s = gemms * max(
                2 * tokens * features_in * features_out / spec.peak_flops["bfloat16"],
                2
                * (tokens * features_in + features_in * features_out + tokens * features_out)
                / spec.memory_bandwidth,
            )
            if mode == "gelu-fwd":  # the GELU kernel: read h, write x, in bfloat16
                bf16_s += 4 * tokens * features_in / spec.memory_bandwidth
            rows.append(
                {
                    "shape": name,
                    "gemm": f"{tokens}x{features_in}x{features_out}",
                    "mode": mode,
                    **dataclasses.asdict(measured),
                    "gemm_s": gemm_s,
                    "amax_s": measured.amax_bytes / spec.memory_bandwidth,
                    "quantize_s": measured.quantize_bytes / spec.memory_bandwidth,
                    "other_s": measured.other_bytes / spec.memory_bandwidth,
                    "bf16_s": bf16_s,
                }
            )
    return rows


def table(rows: list[dict], target: str, function_name: str) -> str:
    """The rows as a text table, with totals and the figures the decision needs."""
    spec = jaxamp.diagnostics.GPU_TARGETS[target]
    peaks = f"{spec.peak_flops['float8_e4m3fn'] / 1e12:.0f} TFLOP/s FP8 and {spec.memory_bandwidth / 1e12:.1f} TB/s"
    header = (
        f"{'shape':<24} {'M x K x N':<17} {'pass':<8} {'fp8':>5} {'GEMM MB':>8} {'amax MB':>8} {'quant MB':>9} "
        f"{'other MB':>9} {'GEMM us':>8} {'amax us':>8} {'quant us':>9} {'other us':>9} {'amax/GEMM':>10} "
        f"{'bf16 us':>8} {'current/bf16':>13} {'delayed/bf16':>13}"
    )
    title = f"FP8 GEMM with per-tensor current scaling, compiled for {spec.description}"
    lines = [
        f"{title} (no GPU; times on paper at {peaks})",
        f"function: {function_name}; jax {jax.__version__}; {datetime.date.today().isoformat()}",
        "",
        header,
    ]
    for row in rows:
        lines.append(
            f"{row['shape']:<24} {row['gemm']:<17} {row['mode']:<8} {row['fp8_share']:>5.0%} "
            f"{row['gemm_bytes'] / 1e6:>8.1f} {row['amax_bytes'] / 1e6:>8.1f} {row['quantize_bytes'] / 1e6:>9.1f} "
            f"{row['other_bytes'] / 1e6:>9.1f} {row['gemm_s'] * 1e6:>8.1f} {row['amax_s'] * 1e6:>8.1f} "
            f"{row['quantize_s'] * 1e6:>9.1f} {row['other_s'] * 1e6:>9.1f} "
            f"{row['amax_s'] / row['gemm_s']:>10.1%} {row['bf16_s'] * 1e6:>8.1f} "
            f"{_fp8_s(row, delayed=False) / row['bf16_s']:>12.2f}x {_fp8_s(row, delayed=True) / row['bf16_s']:>12.2f}x"
        )
    lines.append("")
    for mode in ("forward", "train", "gelu-fwd"):
        chosen = [row for row in rows if row["mode"] == mode and row["shape"].startswith("gpt2")]
        if not chosen:
            continue
        gemm_s, amax_s, quantize_s, other_s, bf16_s = (
            sum(row[key] for row in chosen) for key in ("gemm_s", "amax_s", "quantize_s", "other_s", "bf16_s")
        )
        everything = gemm_s + amax_s + quantize_s + other_s
        lines.append(
            f"GPT-2 124M, one layer's four projections, {mode}: GEMMs {gemm_s * 1e6:.1f} us, amax passes "
            f"{amax_s * 1e6:.1f} us ({amax_s / gemm_s:.1%} of the GEMMs' time, {amax_s / everything:.1%} of all "
            f"{everything * 1e6:.1f} us), quantize {quantize_s * 1e6:.1f} us, other {other_s * 1e6:.1f} us; "
            f"bfloat16 {bf16_s * 1e6:.1f} us; FP8 / bfloat16: current scaling {everything / bf16_s:.2f}x, "
            f"delayed scaling {(everything - amax_s) / bf16_s:.2f}x"
        )
    return "\n".join(lines) + "\n"


def _fp8_s(row: dict, delayed: bool) -> float:
    """The FP8 pass's kernels on paper; delayed scaling drops the amax passes."""
    return row["gemm_s"] + row["quantize_s"] + row["other_s"] + (0.0 if delayed else row["amax_s"])


def _function(spec: str) -> str:
    """An argparse type: ``module:name``."""
    if not spec.partition(":")[2]:
        raise argparse.ArgumentTypeError(
            f"write it as module:name, e.g. jaxamp:fp8_dot_general; got {spec!r}"
        )
    return spec


def _fp8_target(name: str) -> str:
    fp8_targets = [
        target
        for target, spec in jaxamp.diagnostics.GPU_TARGETS.items()
        if "float8_e4m3fn" in spec.peak_flops
    ]
    if name not in fp8_targets:
        raise argparse.ArgumentTypeError(
            f"choose a GPU with FP8 tensor cores: {', '.join(fp8_targets)}; got {name!r}"
        )
    return name


def add_arguments(parser) -> None:
    parser.add_argument("--target", type=_fp8_target, default="h200", help="the GPU to compile for")
    parser.add_argument(
        "--function",
        type=_function,
        help="module:name of a function with lax.dot_general's signature to measure instead of the reference "
        "current-scaling pattern, e.g. jaxamp:fp8_dot_general (default: the reference pattern)",
    )
    parser.add_argument("--quick", action="store_true", help="only the first shape (a check that it runs)")


def run(args, out) -> None:
    function_name = args.function or f"{__name__}:current_scaling_dot_general"
    module_name, _, attribute = function_name.partition(":")
    function = getattr(importlib.import_module(module_name), attribute)
    shapes = SHAPES[:1] if args.quick else SHAPES
    text = table(measure(function, target=args.target, shapes=shapes), args.target, function_name)
    out.print(text.rstrip())
    out.write("fp8_scaling_cost.txt", text)
