"""How the FP8 matmuls of an autocast function quantize their operands: a diagnostic run.

`fp8_quantization_stats` runs ``jaxamp.autocast(fun, "mixed_float8")`` once
with every FP8 quantization reporting its counts to the host through the
FP8 kernel's observer hook (`jaxamp.fp8`), for a notebook or a logging
step; `jaxamp.autocast` itself stays a pure transformation.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from jaxamp._autocast.transform import autocast_with_fp8_observer
from jaxamp._policy import get_policy


@dataclasses.dataclass(frozen=True)
class Fp8TensorStats:
    """How one tensor quantized (one FP8 operand or cotangent).

    Attributes:
        role: ``"lhs"`` or ``"rhs"`` (forward operands) or ``"cotangent"``
            (the backward's incoming gradient).
        shape: the tensor's shape.
        fp8_dtype: ``"float8_e4m3fn"`` or ``"float8_e5m2"``.
        elements: its number of values.
        nonzero: how many were not zero.
        underflowed: nonzero finite values that quantized to zero.
        saturated: finite values whose scaled magnitude lies beyond the FP8
            range even once rounded to it (above 464 for ``float8_e4m3fn``,
            61440 for ``float8_e5m2``), which the clip brought back to the
            largest value. Zero by construction under current scaling: the
            scale maps the amax onto the largest value (at most a rounding
            above it, which the cast rounds back).
        non_finite: infs and NaNs (which make the GEMM's result NaN).
        amax: the largest magnitude.
    """

    role: str
    shape: tuple[int, ...]
    fp8_dtype: str
    elements: int
    nonzero: int
    underflowed: int
    saturated: int
    non_finite: int
    amax: float


@dataclasses.dataclass(frozen=True)
class Fp8QuantizationStats:
    """Every FP8 quantization of one call, in the order they ran.

    Attributes:
        tensors: one `Fp8TensorStats` per quantized tensor.
    """

    tensors: tuple[Fp8TensorStats, ...]

    @property
    def underflowed(self) -> int:
        """Nonzero values that quantized to zero, over all tensors."""
        return sum(tensor.underflowed for tensor in self.tensors)

    @property
    def saturated(self) -> int:
        """Values beyond the FP8 range once rounded (clipped to it), over all tensors."""
        return sum(tensor.saturated for tensor in self.tensors)

    @property
    def non_finite(self) -> int:
        """Infs and NaNs met, over all tensors."""
        return sum(tensor.non_finite for tensor in self.tensors)

    @property
    def underflow_fraction(self) -> float:
        """Underflowed values as a fraction of the nonzero values (0 when none)."""
        nonzero = sum(tensor.nonzero for tensor in self.tensors)
        return self.underflowed / nonzero if nonzero else 0.0


def fp8_quantization_stats(
    fun: Callable[..., Any],
    policy: Any = "mixed_float8",
    *,
    gradient_argnums: int | Sequence[int] | None = None,
) -> Callable[..., Fp8QuantizationStats]:
    """A diagnostic: how the FP8 matmuls of ``autocast(fun, policy)`` quantize their operands.

    ``fp8_quantization_stats(fun)(*args)`` runs ``jaxamp.autocast(fun,
    policy)(*args)`` once with every FP8 quantization reporting its counts
    to the host (``jax.debug.callback``), and returns them. `autocast`
    itself stays a pure transformation with no outputs added; this is a
    separate run, for a notebook or a logging step, not the train step.
    With `gradient_argnums` it runs ``jax.grad(autocast(fun, policy),
    gradient_argnums)`` instead (`fun` returns a scalar loss), so the
    backward's cotangent quantizations (``float8_e5m2``) are counted too.

    Examples:
        >>> stats = jaxamp.diagnostics.fp8_quantization_stats(loss_fn, gradient_argnums=0)(params, x, y)
        >>> stats.underflow_fraction, stats.saturated, stats.non_finite

    Args:
        fun: the function, as given to `jaxamp.autocast`.
        policy: a policy with FP8 matmuls (``"mixed_float8"`` by default).
        gradient_argnums: None to run `fun` forward only; an int or ints to
            run its gradient with respect to those arguments.

    Returns:
        A function of `fun`'s arguments returning `Fp8QuantizationStats`.

    Raises:
        ValueError: `policy` has no per-tensor FP8 matmuls.
    """
    resolved = get_policy(policy)
    if not resolved.fp8_matmuls:
        raise ValueError(
            f"fp8_quantization_stats needs a policy with FP8 matmuls; {str(resolved)!r} has none. "
            "Pass 'mixed_float8' (or add ',matmul=float8' to the policy string)."
        )
    if resolved.matmul_format != "float8":
        raise ValueError(
            f"fp8_quantization_stats counts per-tensor FP8's quantizations; {str(resolved)!r} runs "
            f"{resolved.matmul_format}, whose block scales it does not read. Pass 'mixed_float8'."
        )

    def stats_fun(*args, **kwargs) -> Fp8QuantizationStats:
        records: list[Fp8TensorStats] = []

        def observer(role, shape, fp8_dtype, counts):
            values = {name: np.asarray(value).item() for name, value in counts.items()}
            records.append(Fp8TensorStats(role, shape, fp8_dtype, **values))

        observed = autocast_with_fp8_observer(fun, resolved, observer)
        if gradient_argnums is not None:
            observed = jax.grad(observed, gradient_argnums)
        jax.block_until_ready(observed(*args, **kwargs))
        jax.effects_barrier()
        return Fp8QuantizationStats(tuple(records))

    return functools.wraps(fun, updated=())(stats_fun)
