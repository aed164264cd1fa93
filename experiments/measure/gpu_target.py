"""A program compiled for a GPU on a machine without one, as the measurements compile them.

    device = target_device("h200")          # needs the CUDA PJRT plugin
    program = compile_for(step, (state, batch), device, donate_argnums=0)
    program.text, program.compiled.memory_analysis(), program.seconds

The arguments may be arrays or ``jax.ShapeDtypeStruct``s: they are placed
on the target's compile-only device (`jaxamp.diagnostics.on_device`) and
the function is lowered and compiled there; nothing runs. Without the
plugin, `target_device` stops the command with one line saying what to
install (jaxamp's message).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable
from typing import Any

import jax

import jaxamp


def target_device(target: str | jaxamp.diagnostics.GpuSpec) -> Any:
    """The compile-only device of `target` (`jaxamp.diagnostics.gpu_target_device`).

    Raises:
        SystemExit: the CUDA PJRT plugin is not installed; the message says what to install.
    """
    try:
        return jaxamp.diagnostics.gpu_target_device(target)
    except RuntimeError as error:
        if jaxamp.diagnostics.cuda_plugin_available():
            raise
        raise SystemExit(f"error: {error}") from None


@dataclasses.dataclass(frozen=True)
class CompiledProgram:
    """A function compiled for a GPU target.

    Attributes:
        lowered: the lowered program (its StableHLO says what was asked for).
        compiled: the executable (``memory_analysis()``; nothing can run it here).
        text: the optimized HLO (what XLA would run).
        seconds: the time lowering and compiling took.
    """

    lowered: Any
    compiled: Any
    text: str
    seconds: float


def compile_for(
    fun: Callable,
    args: Any,
    device: Any,
    *,
    donate_argnums: int | tuple[int, ...] = (),
    context: contextlib.AbstractContextManager | None = None,
) -> CompiledProgram:
    """``jax.jit(fun)`` lowered for `args` placed on `device` and compiled.

    Args:
        fun: the function.
        args: its positional arguments (arrays or ``ShapeDtypeStruct``s), a tuple.
        device: a compile-only device (`target_device`).
        donate_argnums: arguments whose buffers the program may reuse, as for ``jax.jit``.
        context: entered around lowering and compiling (a matmul precision, an FP8 target).
    """
    start = time.perf_counter()
    with context or contextlib.nullcontext():
        lowered = jax.jit(fun, donate_argnums=donate_argnums).lower(
            *jaxamp.diagnostics.on_device(args, device)
        )
        compiled = lowered.compile()
    seconds = time.perf_counter() - start
    return CompiledProgram(lowered, compiled, compiled.as_text(), seconds)
