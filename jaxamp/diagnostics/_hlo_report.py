"""What XLA really runs: matmuls and convolutions of optimized HLO, by dtype.

A jaxpr says what a program asks for; the compiled, optimized HLO module
(``jax.jit(f).lower(*args).compile().as_text()``) says what the backend
executes. XLA on CPU, for instance, converts half-precision convolutions to
float32, while XLA for an NVIDIA GPU turns them into cuDNN custom calls in
float16. This module reads that text and lists each heavy operation:

* ``dot`` and ``convolution`` instructions, wherever they sit (also inside
  fusions: a Triton or oneDNN/YNN GEMM fusion holds its ``dot``);
* cuDNN convolution custom calls (``__cudnn$convForward``,
  ``__cudnn$convBackwardInput``, ``__cudnn$convBackwardFilter``,
  ``__cudnn$convBiasActivationForward``, the FP8 ``__cudnn$convForwardGraph``)
  and cuBLAS GEMM custom calls (``__cublas$gemm``, ``__cublas$lt$matmul``,
  the FP8 ``__cublas$lt$matmul$f8``), and cuDNN's block-scaled GEMM
  (``__cudnn$blockScaledDot``, MXFP8 and NVFP4 on Blackwell GPUs).

Each counts by the dtype of its operands (the widest of the two, as in the
traced report) and its FLOPs, and carries its metadata: the JAX name stack
it was traced under (``op_name``) and its Python source location (the
module's ``StackFrames`` tables). XLA keeps both when it rewrites a ``dot``
into a cuBLAS call or a GEMM fusion, which is how FP8 is proved: a
``__cublas$lt$matmul$f8`` or ``__cudnn$convForwardGraph`` call on FP8
operands ran in FP8, and its op_name says whether it was traced under
jaxamp's ``jaxamp_fp8`` scope and in a backward pass
(`jaxamp._report.fp8_scope`, `jaxamp._report.is_backward`). `fp8_fed_matmuls` reads the program before optimization
for matmuls fed FP8 values through a dequantize. The walk starts at the entry computation and
follows every called computation, so an operation runs as often as it is
called: a ``while`` body with a known trip count (as ``lax.scan`` compiles
to) counts that many times, with an unknown one once; a ``conditional``
counts its branch with the most FLOPs (an honest upper bound: one branch
runs).

The parser relies only on the documented textual HLO form (instructions
``%name = shape opcode(operands), attribute=value, ...``); nothing here uses
a private JAX or XLA API.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import re
from collections.abc import Callable, Iterable, Iterator
from typing import Any

# HLO element types that have a numpy name; others keep their HLO name.
_NUMPY_NAMES = {
    "f16": "float16",
    "bf16": "bfloat16",
    "f32": "float32",
    "f64": "float64",
    "s8": "int8",
    "u8": "uint8",
    "s16": "int16",
    "u16": "uint16",
    "s32": "int32",
    "u32": "uint32",
    "s64": "int64",
    "u64": "uint64",
    "pred": "bool",
    "f8e4m3fn": "float8_e4m3fn",
    "f8e5m2": "float8_e5m2",
    "f8e4m3": "float8_e4m3",
    "f8e3m4": "float8_e3m4",
    "f8e4m3fnuz": "float8_e4m3fnuz",
    "f8e5m2fnuz": "float8_e5m2fnuz",
    "f8e4m3b11fnuz": "float8_e4m3b11fnuz",
    "f8e8m0fnu": "float8_e8m0fnu",
    "f4e2m1fn": "float4_e2m1fn",
}
_BYTES_PER_ELEMENT = {
    "pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1, "f8e3m4": 1,
    "f8e4m3fnuz": 1, "f8e5m2fnuz": 1, "f8e4m3b11fnuz": 1, "f8e8m0fnu": 1,
    "f16": 2, "bf16": 2, "s16": 2, "u16": 2,
    "f32": 4, "s32": 4, "u32": 4,
    "f64": 8, "s64": 8, "u64": 8, "c64": 8, "c128": 16,
}  # fmt: skip
_HALF_BYTE_TYPES = frozenset({"f4e2m1fn"})
# Instructions that move no data of their own (views, bookkeeping) or whose
# traffic is counted inside the computations they call.
_NO_TRAFFIC_OPCODES = frozenset(
    {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all",
     "while", "call", "conditional", "partition-id", "replica-id"}
)  # fmt: skip

_COMPUTATION_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_ARRAY_SHAPE = re.compile(r"^(\w+)\[([^\]]*)\]")
_OPCODE = re.compile(r"^([a-z][a-z0-9\-]*)\(")
_CALLED = re.compile(r"\b(?:calls|to_apply|body|condition|true_computation|false_computation)=%?([\w.\-]+)")
_CALLED_LIST = re.compile(r"\b(?:branch_computations|called_computations)=\{([^}]*)\}")
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
_OP_NAME = re.compile(r'\bop_name="([^"]*)"')
_STACK_FRAME_ID = re.compile(r"\bstack_frame_id=(\d+)")
# The header tables that resolve an instruction's stack_frame_id to a source
# location, as XLA prints them above the computations.
_TABLE_ROW = re.compile(r"^(\d+)\s+(.*)$")
_TABLE_FIELD = re.compile(r"(\w+)=(\d+)")

# The cuBLASLt and cuDNN calls that compute in FP8 on Hopper and later GPUs (and in MXFP8 or NVFP4 on Blackwell).
FP8_TARGETS = ("__cublas$lt$matmul$f8", "__cudnn$convForwardGraph", "__cudnn$blockScaledDot")
# cuDNN's block-scaled GEMM: (values [B, M, K], values [B, N, K], scales, scales) -> [B, M, N].
BLOCK_SCALED_DOT = "__cudnn$blockScaledDot"
# jaxamp traces every FP8 matmul under this named scope, and every matmul that
# looked eligible but fell back to bfloat16 under FP8_FALLBACK_SCOPE + reason.


@dataclasses.dataclass(frozen=True)
class ArrayShape:
    """One array shape of HLO text: element type (HLO name) and dimensions."""

    element_type: str
    dims: tuple[int, ...]

    @property
    def dtype(self) -> str:
        """The numpy name of the element type (``float16``, ...)."""
        return _NUMPY_NAMES.get(self.element_type, self.element_type)

    @property
    def num_bytes(self) -> int:
        if self.element_type in _HALF_BYTE_TYPES:  # two values per byte
            return (math.prod(self.dims) + 1) // 2
        return math.prod(self.dims) * _BYTES_PER_ELEMENT.get(self.element_type, 4)


@dataclasses.dataclass(frozen=True)
class Instruction:
    """One HLO instruction.

    Attributes:
        name: its name, without ``%``.
        shapes: its result: one shape, or the elements of a tuple result.
        opcode: ``dot``, ``convolution``, ``custom-call``, ``fusion``, ...
        operands: names of its operands.
        attributes: the text after the operand list.
        parameter_number: a ``parameter(n)`` instruction's ``n``; None for
            other instructions.
    """

    name: str
    shapes: tuple[ArrayShape, ...]
    opcode: str
    operands: tuple[str, ...]
    attributes: str
    parameter_number: int | None = None


@dataclasses.dataclass(frozen=True)
class HeavyOp:
    """A matmul or convolution as XLA executes it.

    Attributes:
        primitive: the HLO opcode (``dot``, ``convolution``) or the custom
            call target (``__cudnn$convForward``, ``__cublas$lt$matmul``).
        operand_dtypes: dtypes of its two data operands.
        output_dtype: dtype of its result.
        flops: multiply-adds times two, times the times it runs.
        op_name: the ``op_name`` of its metadata: the JAX name stack it was
            traced under (``jit(step)/transpose(jvp(jaxamp_fp8))/dot_general``),
            empty if the HLO carries none.
        source: where in Python it was traced (``file.py:12:8``), empty if
            unknown.
    """

    primitive: str
    operand_dtypes: tuple[str, str]
    output_dtype: str
    flops: int
    op_name: str = ""
    source: str = ""


def _matching_paren(text: str, start: int) -> int:
    """Index of the parenthesis that closes the one at `start`."""
    depth = 0
    for index in range(start, len(text)):
        if text[index] == "(":
            depth += 1
        elif text[index] == ")":
            depth -= 1
            if depth == 0:
                return index
    raise ValueError(f"Unbalanced parentheses in HLO text: {text[start : start + 120]!r}")


def _parse_shapes(text: str) -> tuple[ArrayShape, ...]:
    shapes = []
    for match in re.finditer(r"\b(\w+)\[([^\]]*)\]", text):
        dims = tuple(int(dim.lstrip("<=")) for dim in match.group(2).split(",") if dim.strip())
        shapes.append(ArrayShape(match.group(1), dims))
    return tuple(shapes)


def _parse_instruction(line: str) -> Instruction | None:
    match = _INSTRUCTION.match(line)
    if match is None:
        return None
    name, rest = match.groups()
    if rest.startswith("("):
        shape_end = _matching_paren(rest, 0) + 1
    else:
        shape_end = rest.find(" ")
        if shape_end < 0:
            return None
    shape_text, rest = rest[:shape_end], rest[shape_end:].lstrip()
    opcode_match = _OPCODE.match(rest)
    if opcode_match is None:
        return None
    operands_start = opcode_match.end() - 1
    operands_end = _matching_paren(rest, operands_start)
    operand_text = rest[operands_start + 1 : operands_end]
    return Instruction(
        name=name,
        shapes=_parse_shapes(shape_text),
        opcode=opcode_match.group(1),
        operands=tuple(re.findall(r"%([\w.\-]+)", operand_text)),
        attributes=rest[operands_end + 1 :],
        parameter_number=int(operand_text) if opcode_match.group(1) == "parameter" else None,
    )


@dataclasses.dataclass(frozen=True)
class HloModule:
    """The computations of one HLO module, parsed from its text.

    Attributes:
        computations: instructions of each computation, by computation name.
        entry: the name of the entry computation.
        stack_frames: source location (``file:line:column``) of each
            ``stack_frame_id`` the instructions' metadata refers to.
    """

    computations: dict[str, tuple[Instruction, ...]]
    entry: str
    stack_frames: dict[int, str] = dataclasses.field(default_factory=dict)

    @classmethod
    def parse(cls, hlo_text: str) -> HloModule:
        """Parses ``Compiled.as_text()`` (or any HLO module text)."""
        computations: dict[str, list[Instruction]] = {}
        tables: dict[str, dict[int, str]] = {}
        entry, current, table = None, None, None
        for line in hlo_text.splitlines():
            if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
                table = tables.setdefault(line, {})
                continue
            row = _TABLE_ROW.match(line) if table is not None and current is None else None
            if row is not None:
                table[int(row.group(1))] = row.group(2)
                continue
            table = None
            if current is None:
                header = _COMPUTATION_HEADER.match(line)
                if header and not line.startswith((" ", "HloModule")):
                    current = header.group(2)
                    computations[current] = []
                    if header.group(1):
                        entry = current
                continue
            if line.startswith("}"):
                current = None
                continue
            instruction = _parse_instruction(line)
            if instruction is not None:
                computations[current].append(instruction)
        if entry is None:
            raise ValueError(
                "No ENTRY computation found in the HLO text; pass the text of a whole "
                "module, e.g. jax.jit(f).lower(*args).compile().as_text()."
            )
        return cls({name: tuple(body) for name, body in computations.items()}, entry, _stack_frames(tables))

    def shapes_of(self, computation: str) -> dict[str, tuple[ArrayShape, ...]]:
        """Result shapes of a computation's instructions, by name."""
        return {instruction.name: instruction.shapes for instruction in self.computations[computation]}


def _stack_frames(tables: dict[str, dict[int, str]]) -> dict[int, str]:
    """``file:line:column`` of each stack frame (its innermost location) in the header tables."""
    files = {key: value.strip('"') for key, value in tables.get("FileNames", {}).items()}
    locations = {}
    for key, value in tables.get("FileLocations", {}).items():
        fields = {name: int(number) for name, number in _TABLE_FIELD.findall(value)}
        locations[key] = (
            f"{files.get(fields.get('file_name_id'), '?')}:{fields.get('line', 0)}:{fields.get('column', 0)}"
        )
    frames = {}
    for key, value in tables.get("StackFrames", {}).items():
        fields = {name: int(number) for name, number in _TABLE_FIELD.findall(value)}
        frames[key] = locations.get(fields.get("file_location_id"), "")
    return frames


def metadata_key(instruction: Instruction, module: HloModule) -> tuple[str, str]:
    """The instruction's ``(op_name, source location)`` from its metadata.

    XLA keeps an operation's metadata when it rewrites it (a ``dot`` into a
    cuBLAS call, into a GEMM fusion, split into several GEMMs), so this key
    finds the compiled form of an operation of the program before
    optimization.
    """
    op_name = _OP_NAME.search(instruction.attributes)
    frame = _STACK_FRAME_ID.search(instruction.attributes)
    source = module.stack_frames.get(int(frame.group(1)), "") if frame else ""
    return (op_name.group(1) if op_name else "", source)


def _called_computations(instruction: Instruction) -> list[str]:
    called = _CALLED.findall(instruction.attributes)
    for group in _CALLED_LIST.findall(instruction.attributes):
        called.extend(name.strip().lstrip("%") for name in group.split(",") if name.strip())
    return called


def _trip_count(instruction: Instruction) -> int:
    match = _TRIP_COUNT.search(instruction.attributes)
    return int(match.group(1)) if match else 1


def _dims_attribute(attributes: str, key: str) -> tuple[int, ...]:
    match = re.search(rf"\b{key}=\{{([\d,]*)\}}", attributes)
    return tuple(int(dim) for dim in match.group(1).split(",") if dim) if match else ()


def _dim_labels(attributes: str) -> tuple[str, str, str]:
    match = re.search(r"\bdim_labels=(\w+)_(\w+)->(\w+)", attributes)
    if match is None:
        raise ValueError(f"A convolution without dim_labels in HLO: {attributes[:200]!r}")
    return match.group(1), match.group(2), match.group(3)


def _dot_flops(lhs: ArrayShape, out: ArrayShape, contracting: tuple[int, ...]) -> int:
    return 2 * math.prod(out.dims) * math.prod(lhs.dims[axis] for axis in contracting)


def _convolution_flops(rhs: ArrayShape, out: ArrayShape, rhs_labels: str) -> int:
    # Every output element sums over the kernel's spatial window and the
    # kernel's input features (already divided by the feature groups).
    window = math.prod(size for label, size in zip(rhs_labels, rhs.dims) if label.isdigit())
    return 2 * math.prod(out.dims) * window * rhs.dims[rhs_labels.index("i")]


def _cudnn_convolution_flops(target: str, operands, out: ArrayShape, labels) -> int:
    """FLOPs of a cuDNN convolution call, whichever direction it computes.

    Its dim_labels describe the forward convolution ``y = conv(x, w)``; the
    call computes ``y`` (forward: operands x, w), ``dx`` (backward input:
    operands dy, w) or ``w``'s gradient (backward filter: operands x, dy).
    All three cost ``2 * size(w) * (size(y) / features(y))`` FLOPs.
    """
    if "BackwardInput" in target:
        forward_out, kernel = operands[0], operands[1]
    elif "BackwardFilter" in target:
        forward_out, kernel = operands[1], out
    else:
        forward_out, kernel = out, operands[1]
    out_labels = labels[2]
    features = forward_out.dims[out_labels.index("f")]
    return 2 * math.prod(kernel.dims) * math.prod(forward_out.dims) // features


def _gemm_contracting_dims(attributes: str) -> tuple[int, ...]:
    match = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', attributes)
    if match is None:
        raise ValueError(f"A cuBLAS call without dot_dimension_numbers in HLO: {attributes[:200]!r}")
    return tuple(int(json.loads(item)) for item in match.group(1).split(",") if item)


def _custom_call_target(attributes: str) -> str:
    match = re.search(r'custom_call_target="([^"]+)"', attributes)
    return match.group(1) if match else ""


def _heavy_op(
    instruction: Instruction, shapes: dict[str, tuple[ArrayShape, ...]], module: HloModule | None = None
) -> HeavyOp | None:
    """The instruction as a `HeavyOp`, or None if it is not a matmul or convolution."""
    target = _custom_call_target(instruction.attributes) if instruction.opcode == "custom-call" else ""
    is_cudnn_convolution = target.startswith("__cudnn$conv")
    is_cublas_gemm = target.startswith("__cublas$")
    is_block_scaled = target == BLOCK_SCALED_DOT
    if instruction.opcode not in ("dot", "convolution") and not (is_cudnn_convolution or is_cublas_gemm or is_block_scaled):
        return None
    lhs, rhs = (shapes[name][0] for name in instruction.operands[:2])
    out = instruction.shapes[0]  # custom calls return (result, workspace)
    if instruction.opcode == "dot":
        flops = _dot_flops(lhs, out, _dims_attribute(instruction.attributes, "lhs_contracting_dims"))
    elif instruction.opcode == "convolution":
        flops = _convolution_flops(rhs, out, _dim_labels(instruction.attributes)[1])
    elif is_cudnn_convolution:
        flops = _cudnn_convolution_flops(target, (lhs, rhs), out, _dim_labels(instruction.attributes))
    elif is_block_scaled:
        flops = _dot_flops(lhs, out, (len(lhs.dims) - 1,))
    else:
        flops = _dot_flops(lhs, out, _gemm_contracting_dims(instruction.attributes))
    op_name, source = metadata_key(instruction, module) if module is not None else ("", "")
    return HeavyOp(target or instruction.opcode, (lhs.dtype, rhs.dtype), out.dtype, flops, op_name, source)


def walk(
    module: HloModule,
    ops_of: Callable[[Instruction, dict, int], Iterable[Any]],
    weight: Callable[[Any], float],
    *,
    computation: str | None = None,
    repeats: int = 1,
    descend: Callable[[Instruction], bool] = lambda instruction: True,
) -> Iterator[Any]:
    """What `ops_of` finds in every instruction the program executes, loops unrolled.

    The walk follows the program's control flow from `computation` (the
    entry by default):

    ```text
    for instruction in computation:
        yield from ops_of(instruction, shapes, repeats)
        if not descend(instruction): continue
        conditional: walk each branch; yield the branch heaviest by sum(weight)
                     (a step runs one branch: count the most it can cost)
        while:       walk condition and body with repeats * trip count
        otherwise:   walk every called computation (fusions, calls) with repeats
    ```

    Args:
        module: the parsed module.
        ops_of: the ops an instruction contributes, given the computation's
            shapes by name and how often the instruction runs.
        weight: an op's cost, to choose a conditional's branch.
        computation: where to start; the entry computation by default.
        repeats: how often `computation` runs.
        descend: whether to walk the computations an instruction calls
            (a collective's ``to_apply`` is scalar arithmetic, not program).
    """
    computation = module.entry if computation is None else computation
    shapes = module.shapes_of(computation)
    for instruction in module.computations[computation]:
        yield from ops_of(instruction, shapes, repeats)
        if not descend(instruction):
            continue
        called = [name for name in _called_computations(instruction) if name in module.computations]
        into = functools.partial(walk, module, ops_of, weight, descend=descend)
        if instruction.opcode == "conditional":
            branches = [list(into(computation=branch, repeats=repeats)) for branch in called]
            yield from max(branches, key=lambda ops: sum(weight(op) for op in ops), default=[])
            continue
        body_repeats = repeats * _trip_count(instruction) if instruction.opcode == "while" else repeats
        for name in called:
            yield from into(computation=name, repeats=body_repeats)


def _heavy_ops_of(
    module: HloModule, instruction: Instruction, shapes: dict, repeats: int
) -> Iterator[HeavyOp]:
    op = _heavy_op(instruction, shapes, module)
    if op is not None:
        yield dataclasses.replace(op, flops=op.flops * repeats)


def heavy_ops(hlo_text: str) -> list[HeavyOp]:
    """Every matmul and convolution that the HLO module executes.

    Args:
        hlo_text: an HLO module's text, typically
            ``jax.jit(f).lower(*args).compile().as_text()``.

    Returns:
        The operations in the order the entry computation reaches them.
    """
    module = HloModule.parse(hlo_text)
    return list(walk(module, functools.partial(_heavy_ops_of, module), weight=lambda op: op.flops))


def bytes_accessed(hlo_text: str) -> int:
    """Bytes the compiled program reads and writes in device memory, estimated.

    Each top-level instruction of the entry computation (a fusion is one
    kernel, a custom call one library call) reads its operands and writes
    its result once; traffic inside a fusion stays in registers and caches.
    Loop bodies count once per known iteration, a conditional its largest
    branch. A custom call's workspace (its result tuple's trailing scratch
    buffer) is not counted. This is the byte count a roofline needs when
    the executable's own ``cost_analysis()`` is unavailable, as for a
    program compiled for a GPU target without a GPU.

    Args:
        hlo_text: an HLO module's text.

    Returns:
        Estimated bytes moved to and from device memory.
    """
    module = HloModule.parse(hlo_text)
    return _traffic(module, module.entry)


def _traffic(module: HloModule, computation: str) -> int:
    shapes = module.shapes_of(computation)
    total = 0
    for instruction in module.computations[computation]:
        called = [name for name in _called_computations(instruction) if name in module.computations]
        if instruction.opcode == "while":
            total += _trip_count(instruction) * sum(_traffic(module, name) for name in called)
        elif instruction.opcode == "conditional":
            total += max((_traffic(module, name) for name in called), default=0)
        elif instruction.opcode == "call":
            total += sum(_traffic(module, name) for name in called)
        elif instruction.opcode not in _NO_TRAFFIC_OPCODES:
            results = instruction.shapes[:1] if instruction.opcode == "custom-call" else instruction.shapes
            operands = (shape for name in instruction.operands for shape in shapes.get(name, ()))
            total += sum(shape.num_bytes for shape in (*results, *operands))
    return total


# Operations through which an FP8 value stays "dequantized FP8" on its way to a
# matmul: the widening convert itself, the scale multiply or divide, and the
# layout changes XLA folds into a GEMM's operands.
_DEQUANTIZE_OPCODES = frozenset(
    {"convert", "multiply", "divide", "reshape", "transpose", "broadcast", "bitcast", "copy", "slice"}
)  # fmt: skip


# A tuple carries the marks of its elements (a call's result, a loop's carry).
_PASS_THROUGH_OPCODES = _DEQUANTIZE_OPCODES | {"tuple", "get-tuple-element"}


def _is_fp8(shape: ArrayShape) -> bool:
    return shape.dtype.startswith(("float8_", "float4_"))


def fp8_fed_matmuls(hlo_text: str) -> set[tuple[str, str]]:
    """The matmuls and convolutions that a program before optimization feeds FP8 values.

    Reads the HLO of a lowered, not yet optimized program (see
    `lowered_hlo_text`) and marks every value that is an FP8 array or
    derives from one through a dequantize (`_DEQUANTIZE_OPCODES`:
    ``convert``, the scale's ``multiply``/``divide``, layout changes):

    ```text
    fp8_fed(v) = v has an FP8 element type
                 or v = op(operands) with op in _DEQUANTIZE_OPCODES
                    and fp8_fed(some operand)
                 or v is a parameter of a called computation whose
                    argument is fp8_fed, or a call's result whose root is
    ```

    A ``dot`` or ``convolution`` with an fp8_fed operand asked for FP8
    math, whatever XLA then makes of it (the classic quantize-dequantize
    pattern ``convert(convert(x, f8), bf16) @ w`` is one). Loop bodies and
    branches are read with unmarked parameters: an FP8 value that enters
    a loop through its carry is not followed.

    Args:
        hlo_text: the HLO text of a lowered program, with metadata.

    Returns:
        The `metadata_key` (op_name, source) of each such matmul.
    """
    module = HloModule.parse(hlo_text)
    found: set[tuple[str, str]] = set()
    visited: set[str] = set()

    def visit(computation: str, arguments_fed: tuple[bool, ...]) -> bool:
        """Marks `computation`'s values; returns whether its root is fp8_fed."""
        visited.add(computation)
        fed: dict[str, bool] = {}
        value = False
        for instruction in module.computations[computation]:
            operands_fed = tuple(fed.get(name, False) for name in instruction.operands)
            called = [name for name in _called_computations(instruction) if name in module.computations]
            value = any(_is_fp8(shape) for shape in instruction.shapes)
            if instruction.opcode == "parameter":
                number = instruction.parameter_number
                value = value or (
                    number is not None and number < len(arguments_fed) and arguments_fed[number]
                )
            elif instruction.opcode == "call":
                for name in called:
                    value = visit(name, operands_fed) or value
            else:
                value = value or (instruction.opcode in _PASS_THROUGH_OPCODES and any(operands_fed))
                if instruction.opcode in ("dot", "convolution") and any(operands_fed[:2]):
                    found.add(metadata_key(instruction, module))
                # Loop bodies, branches, reductions: read once, their parameters unmarked.
                for name in called:
                    if name not in visited:
                        visit(name, ())
            fed[instruction.name] = value
        return value  # XLA prints a computation's root last

    visit(module.entry, ())
    return found


def lowered_hlo_text(lowered: Any) -> str:
    """The HLO text, with metadata, of a ``jax.jit(f).lower(...)`` result.

    ``Lowered.as_text(dialect="hlo")`` drops the metadata (op_name, source
    location) that ties an operation to its optimized form; the HLO module
    of ``Lowered.compiler_ir("hlo")`` prints it.
    """
    return lowered.compiler_ir("hlo").as_hlo_module().to_string()
