"""What a sharded program communicates: its collectives, by dtype and bytes.

Reads HLO text (``jax.jit(f).lower(*args).compile().as_text()``, or the
partitioned module `compile_with_partitioned_hlo` returns) and lists each
collective: all-gather, reduce-scatter, all-reduce, all-to-all and
collective-permute, synchronous or split into ``-start``/``-done`` pairs,
combined (one instruction, several arrays) or not, and inside the
computations an ``async-start`` wraps. Each array of each collective is one
`Collective` with its dtype, the bytes one device hands in and the bytes it
gets back; loops count once per known iteration.

Which HLO to read: XLA's SPMD partitioner decides which collectives a
program runs and in which dtype, for every backend alike;
`compile_with_partitioned_hlo` returns its output. Backends may rewrite them
afterwards: XLA on CPU widens every bfloat16 collective to float32 (its
collectives have no bfloat16 arithmetic), so the CPU executable moves
float32 whatever the program asked for, while XLA for an NVIDIA GPU keeps
bfloat16 collectives (compile for one without a GPU through
`jaxamp.diagnostics._gpu_targets`). The parser relies only on the documented text form.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import tempfile
from collections.abc import Iterator
from typing import Any

from jaxamp.diagnostics._hlo_report import ArrayShape, HloModule, Instruction, walk

COLLECTIVE_KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")


@dataclasses.dataclass(frozen=True)
class Collective:
    """One array of one collective, as one device sees it.

    Attributes:
        kind: ``all-gather``, ``reduce-scatter``, ``all-reduce``,
            ``all-to-all`` or ``collective-permute`` (``-start`` folded in).
        dtype: the array's dtype (numpy name: ``bfloat16``, ``float32``, ...).
        operand_bytes: bytes this device hands in (a shard for an
            all-gather, a full local gradient for a reduce-scatter).
        result_bytes: bytes it gets back (the full parameter of an
            all-gather, its shard of the sum for a reduce-scatter).
        count: times it runs per call of the program.
    """

    kind: str
    dtype: str
    operand_bytes: int
    result_bytes: int
    count: int = 1


def _collective_kind(opcode: str) -> str | None:
    base = opcode.removesuffix("-start")
    return base if base in COLLECTIVE_KINDS else None


def _instruction_collectives(
    instruction: Instruction, shapes: dict[str, tuple[ArrayShape, ...]], repeats: int
) -> Iterator[Collective]:
    kind = _collective_kind(instruction.opcode)
    if kind is None:
        return
    operands = [shape for name in instruction.operands for shape in shapes.get(name, ())]
    if instruction.opcode == f"{kind}-start" and kind != "all-reduce":
        # ((operands...), (results...)) or (operand, result, context...): the
        # results follow the operands in the flattened tuple.
        results = list(instruction.shapes[len(operands) : 2 * len(operands)])
    else:
        results = list(instruction.shapes)
    for operand, result in zip(operands, results):
        yield Collective(kind, operand.dtype, operand.num_bytes, result.num_bytes, repeats)


def collectives(hlo_text: str) -> list[Collective]:
    """Every collective the HLO module runs, one entry per array.

    Args:
        hlo_text: an HLO module's text.

    Returns:
        The collectives in the order the entry computation reaches them.
    """
    return list(
        walk(
            HloModule.parse(hlo_text),
            _instruction_collectives,
            weight=lambda op: op.operand_bytes * op.count,
            descend=lambda instruction: _collective_kind(instruction.opcode) is None,
        )
    )


@dataclasses.dataclass(frozen=True)
class CollectiveTotal:
    """The collectives of one kind and dtype, summed.

    Attributes:
        kind: as in `Collective`.
        dtype: as in `Collective`.
        count: arrays communicated per call.
        operand_bytes: bytes handed in per call, per device.
        result_bytes: bytes received per call, per device.
    """

    kind: str
    dtype: str
    count: int
    operand_bytes: int
    result_bytes: int


def collective_totals(hlo_text: str) -> list[CollectiveTotal]:
    """`collectives` summed by kind and dtype, in `COLLECTIVE_KINDS` order."""
    totals: dict[tuple[str, str], list[int]] = {}
    for op in collectives(hlo_text):
        entry = totals.setdefault((op.kind, op.dtype), [0, 0, 0])
        entry[0] += op.count
        entry[1] += op.operand_bytes * op.count
        entry[2] += op.result_bytes * op.count
    order = {kind: index for index, kind in enumerate(COLLECTIVE_KINDS)}
    return [
        CollectiveTotal(kind, dtype, *numbers)
        for (kind, dtype), numbers in sorted(totals.items(), key=lambda item: (order[item[0][0]], item[0][1]))
    ]


def compile_with_partitioned_hlo(lowered: Any) -> tuple[Any, str]:
    """Compiles `lowered` and returns the HLO module right after XLA's SPMD partitioner.

    Compiles ``lowered`` (a ``jax.jit(f).lower(...)`` result) with XLA's
    documented dump options and reads back the module as the partitioner
    left it: the collectives are placed and typed, no backend pass has run.

    Args:
        lowered: a ``jax.stages.Lowered``.

    Returns:
        ``(compiled, partitioned_text)``: the ``jax.stages.Compiled`` (whose
        ``as_text()`` is the backend's final program) and the HLO text.

    Raises:
        RuntimeError: XLA wrote no module after the partitioner: a program
            on a single device is not partitioned, and an executable served
            by JAX's persistent compilation cache is not compiled at all.
    """
    with tempfile.TemporaryDirectory() as dump_dir:
        compiled = lowered.compile(
            compiler_options={
                "xla_dump_to": dump_dir,
                "xla_dump_hlo_as_text": True,
                "xla_dump_hlo_pass_re": "spmd-partitioning",
            }
        )
        found = sorted(glob.glob(os.path.join(dump_dir, "*after_spmd-partitioning*.txt")))
        if not found:
            raise RuntimeError(
                "XLA wrote no HLO module after SPMD partitioning: the program runs on one device, "
                "JAX's persistent compilation cache served the executable (run without "
                "jax_compilation_cache_dir), or this XLA names its dumps differently. Read "
                "lowered.compile().as_text() instead."
            )
        with open(found[-1], encoding="utf-8") as dump:
            return compiled, dump.read()
