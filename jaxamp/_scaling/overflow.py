"""Where a step overflowed: the largest magnitude of each matmul and convolution, forward and backward.

One job: the record that names the first op that overflowed, and the
session that collects it while a function runs.

An `OverflowRecord` is what `jaxamp.scaled_value_and_grad(...,
record_overflow=True)` returns beside the gradients (and `record_overflow`
for a forward pass alone): per matrix multiplication and convolution that
`jaxamp.autocast` or `jaxamp.apply_policy` ran, in program order, the
largest magnitude (amax) of its output in the forward pass and of its
operands' cotangents (the outputs of its two backward matmuls) in the
backward pass. An inf or a NaN among them is an overflow. The record is a
small pytree (two float32 vectors) that a jitted step returns; the sites
(module path or source line, primitive, dtype, shape) are static metadata.

`first_overflow` names the first op that overflowed in the order the step
ran it: the first site, in program order, whose forward amax is not finite;
else the *last* site, in program order, whose backward amax is not finite
(the backward pass runs the program in reverse, and an overflow spreads to
every site it reaches after).

How the amaxes are collected: the function runs inside an *overflow
session* (`overflow_session`), a client of the probe (`jaxamp._probe`).
Every `autocast` call traced inside it takes its rows of the session's
probe (a zero-valued float32 ``(sites, 3)`` input that the caller
differentiates), taps each matmul and convolution (`_Recorder`) and adds
its forward amaxes to the session. The backward amaxes leave the step as
the probe's gradient (`with_backward`): no host callback, no effect.
Nothing changes when no session is open.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxamp._probe import Probe, opened
from jaxamp._scaling.nonfinite import host_value


@dataclasses.dataclass(frozen=True)
class OverflowSite:
    """One matmul or convolution a record watches.

    Attributes:
        name: the op's path in the name stack: the Flax module path
            (linen's ``MLP/Dense_2``; under `jaxamp.apply_policy`, an NNX
            layer's attribute path ``blocks/0/attn``), the
            ``jax.named_scope``s around it (Equinox's ``eqx.nn.Linear``, a
            user's own); where the name stack holds none (plain JAX, an NNX
            model through `jaxamp.autocast` alone), its source line. A second
            op of the same name is numbered (``Attention [2]``).
        source: the user's source line of the op (``model.py:41
            (Block.__call__)``), outside JAX and the libraries.
        primitive: ``dot_general`` or ``conv_general_dilated``.
        dtype: the dtype the op ran in (its output's), e.g. ``float16``.
        shape: its output's shape.
    """

    name: str
    source: str
    primitive: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def dtype_max(self) -> float:
        """The largest finite value of the op's dtype (65504 for float16)."""
        return float(jnp.finfo(self.dtype).max)


@dataclasses.dataclass(frozen=True)
class FirstOverflow:
    """The first op that overflowed in a step (host-side, from `OverflowRecord.first_overflow`).

    Attributes:
        site: the op.
        pass_: ``"forward"`` or ``"backward"``.
        amax: its largest magnitude there (inf or NaN).
        index: its position among the record's sites.
    """

    site: OverflowSite
    pass_: str
    amax: float
    index: int

    def __str__(self) -> str:
        where = (
            self.site.name
            if self.site.name == self.site.source
            else f"{self.site.name} at {self.site.source}"
        )
        return (
            f"{self.pass_} overflow first in {where} ({self.site.primitive}, {self.site.dtype}, "
            f"amax {self.amax:g}; the dtype's max is {self.site.dtype_max:g})"
        )


@struct.dataclass
class OverflowRecord:
    """The largest magnitude of each matmul and convolution of a step, forward and backward.

    Attributes:
        forward_amax: float32, one per site: the largest magnitude of the
            op's output.
        backward_amax: float32, one per site: the largest magnitude of the
            cotangents of its output and of its operands (the backward
            matmuls' outputs), as the backward pass computed them, loss
            scale included (an inf wins over a NaN); zeros where the
            backward pass was not recorded.
        sites: the ops, in program order (static metadata).
        unrecorded: matmuls and convolutions the record does not watch
            (inside loops, conditionals, ``jax.checkpoint`` blocks or custom
            derivative rules) (static).
        backward_recorded: whether `backward_amax` was recorded (static).
    """

    forward_amax: jax.Array
    backward_amax: jax.Array
    sites: tuple[OverflowSite, ...] = struct.field(pytree_node=False)
    unrecorded: int = struct.field(pytree_node=False, default=0)
    backward_recorded: bool = struct.field(pytree_node=False, default=False)

    @property
    def overflowed(self) -> jax.Array:
        """Whether any site overflowed, forward or backward (a scalar bool; jit-safe)."""
        return jnp.logical_not(
            jnp.all(jnp.isfinite(self.forward_amax)) & jnp.all(jnp.isfinite(self.backward_amax))
        )

    def first_overflow(self) -> FirstOverflow | None:
        """The first op that overflowed, in the order the step ran it, or None (host)."""
        forward = np.asarray(host_value(self.forward_amax), np.float64)
        backward = np.asarray(host_value(self.backward_amax), np.float64)
        for index in range(len(self.sites)):
            if not np.isfinite(forward[index]):
                return FirstOverflow(self.sites[index], "forward", float(forward[index]), index)
        for index in reversed(range(len(self.sites))):
            if not np.isfinite(backward[index]):
                return FirstOverflow(self.sites[index], "backward", float(backward[index]), index)
        return None

    def summary(self) -> str:
        """One line: the first overflow, or that there was none among the sites watched (host)."""
        first = self.first_overflow()
        watched = f"{len(self.sites)} matmuls and convolutions watched"
        if self.unrecorded:
            watched += f", {self.unrecorded} not (inside loops, conditionals, checkpoints or custom rules)"
        passes = "forward and backward" if self.backward_recorded else "forward only"
        if first is None:
            return f"no overflow ({watched}, {passes})"
        return f"{first} ({watched}, {passes})"

    def table(self) -> str:
        """A Markdown table: one row per site with its dtype and both amaxes (host)."""
        forward = np.asarray(host_value(self.forward_amax), np.float64)
        backward = np.asarray(host_value(self.backward_amax), np.float64)
        rows = [
            "| # | op | primitive | dtype | forward amax | backward amax |",
            "|---:|---|---|---|---:|---:|",
        ]
        for index, site in enumerate(self.sites):
            back = f"{backward[index]:.4g}" if self.backward_recorded else "-"
            rows.append(
                f"| {index} | {site.name} | {site.primitive} | {site.dtype} | {forward[index]:.4g} | {back} |"
            )
        return "\n".join(rows)

    def cleared(self) -> OverflowRecord:
        """The same sites with every amax 0: the record of a step in which nothing overflowed.

        What a `jaxamp.TrainState` starts from to keep the last skipped
        step's record (``overflow_record=``), and the identity of `worst`.
        """
        return self.replace(
            forward_amax=jnp.zeros(self.forward_amax.shape, jnp.float32),
            backward_amax=jnp.zeros(self.backward_amax.shape, jnp.float32),
        )

    def worst(self, other: OverflowRecord) -> OverflowRecord:
        """Site by site, the worse of two records of the same program (jit-safe).

        For gradient accumulation: the record of a step of K micro-batches is
        the worst of their K records. Worse means, as in `amax`: an inf beats
        a NaN, and a NaN beats any finite value; between finite values the
        larger wins.

        Raises:
            ValueError: the records watch different sites (different programs).
        """
        self.check_same_sites(other, "OverflowRecord.worst")
        return self.replace(
            forward_amax=_worse(self.forward_amax, other.forward_amax),
            backward_amax=_worse(self.backward_amax, other.backward_amax),
        )

    def check_same_sites(self, other: OverflowRecord, where: str) -> None:
        """Raises unless `other` records the same sites (the same step function) as this record.

        Raises:
            ValueError: naming `where`, both site counts and the fix.
        """
        if self.sites != other.sites or self.backward_recorded != other.backward_recorded:
            raise ValueError(
                f"{where} got records of different step functions: one watches {len(self.sites)} "
                f"sites, the other {len(other.sites)}, or their sites differ. Combine or keep only the "
                "records of one step function (the micro-batches of one step, the steps of one run)."
            )

    @classmethod
    def concatenate(cls, records: list[OverflowRecord]) -> OverflowRecord:
        """The records of several calls, in the order they ran, as one."""
        if not records:
            empty = jnp.zeros([0], jnp.float32)
            return cls(empty, empty, (), 0, False)
        return cls(
            jnp.concatenate([record.forward_amax for record in records]),
            jnp.concatenate([record.backward_amax for record in records]),
            tuple(site for record in records for site in record.sites),
            sum(record.unrecorded for record in records),
            all(record.backward_recorded for record in records),
        )


_NAN_MARK = float(np.finfo(np.float32).max)


def _badness(value: jax.Array) -> jax.Array:
    """2 for an inf, 1 for a NaN, 0 for a finite amax: the order in which `worst` ranks them."""
    return jnp.where(jnp.isinf(value), 2, jnp.where(jnp.isnan(value), 1, 0))


def _worse(first: jax.Array, second: jax.Array) -> jax.Array:
    first_badness, second_badness = _badness(first), _badness(second)
    return jnp.where(
        first_badness == second_badness,
        jnp.fmax(first, second),  # both finite (the larger), both inf, or both NaN
        jnp.where(first_badness > second_badness, first, second),
    )


def amax(value: Any) -> jax.Array:
    """The largest magnitude of `value` in float32: inf if it holds an inf, else NaN if it holds
    a NaN (an overflow's inf turns into NaNs where it meets its own negative or a zero); 0 if
    it is empty.

    One reduction, which reads `value` once:

    ```python
    magnitude = abs(value) in float32, with each NaN replaced by float32's largest value
    largest = max(magnitude)          # inf beats the mark, the mark beats any half value
    amax = NaN if largest == mark else largest
    ```
    """
    if value.size == 0:
        return jnp.zeros([], jnp.float32)
    magnitude = jnp.abs(value.astype(jnp.float32))
    largest = jnp.max(jnp.where(jnp.isnan(magnitude), _NAN_MARK, magnitude))
    return jnp.where(largest == _NAN_MARK, jnp.nan, largest)


try:  # the tracers of an enclosing jax.grad (JVP, or linearize from JAX 0.5 on)
    from jax._src.interpreters.ad import JVPTracer as _JVPTracer
    from jax._src.interpreters.ad import LinearizeTracer as _LinearizeTracer

    _DIFFERENTIATED_TRACERS: tuple = (_JVPTracer, _LinearizeTracer)
except ImportError:  # pragma: no cover - a JAX release that moved them: every input counts
    _DIFFERENTIATED_TRACERS = ()


def _refusal(taken: int, rows: int) -> str:
    return (
        "record_overflow: the function ran more matmuls under autocast than when the probe was "
        "sized; a function recorded for overflows must run the same autocast calls every time "
        "it is traced."
    )


class OverflowSession:
    """The probe rows and the records of every recorded `autocast` call in one function call.

    A client of the probe (`jaxamp._probe.Client`): each `autocast` call
    inside takes one row per matmul and convolution it watches, and adds its
    `OverflowRecord` to `records` (forward amaxes only; `with_backward` reads
    the backward ones from the probe's gradient).

    Args:
        probe: the zero-valued ``(sites, 3)`` float32 input whose gradient
            holds the backward amaxes, or None to size the probe (each call
            then gets zeros).
    """

    purpose = "record overflows (record_overflow)"
    alone = "record the overflows in a run without delayed scaling."
    blocks = 1

    def __init__(self, probe: jax.Array | None = None):
        self._probe = Probe(probe, _refusal)
        self.records: list[OverflowRecord] = []
        self.offsets: list[int] = []

    @property
    def size(self) -> int:
        """The rows taken so far."""
        return self._probe.size

    def key(self, leaves: Sequence[Any]) -> tuple[bool, ...]:
        """Per leaf of an `autocast` call, whether an enclosing ``jax.grad`` differentiates it.

        A recording rewrite taps no operand that is an input nobody
        differentiates (the data): its cotangent would be computed for the
        tap alone (the first layer's input gradient, a whole matmul). Where
        JAX's tracer classes cannot be read, every leaf counts as
        differentiated (each operand is tapped).
        """
        if not _DIFFERENTIATED_TRACERS:
            return (True,) * len(leaves)
        return tuple(isinstance(leaf, _DIFFERENTIATED_TRACERS) for leaf in leaves)

    def take(self, rows: int) -> list[jax.Array]:
        self.offsets.append(self._probe.size)
        return [self._probe.take(rows)]

    def closed(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def rewriting(self, blocks, leaves, key) -> Iterator[_Recorder]:
        yield _Recorder(blocks[0], [leaf for leaf, differentiated in zip(leaves, key) if not differentiated])

    def finish(self, outputs: Sequence[Any], recorded: tuple, unrecorded: int) -> None:
        (forward_amax,) = outputs
        self.records.append(OverflowRecord(forward_amax, jnp.zeros_like(forward_amax), recorded, unrecorded))


@jax.custom_vjp
def _tap(value: jax.Array, slot: jax.Array) -> jax.Array:
    """`value` unchanged; the derivative of `slot` is the largest magnitude of `value`'s cotangent."""
    del slot
    return value


def _tap_forward(value, slot):
    del slot
    return value, None


def _tap_backward(_, cotangent):
    return cotangent, amax(cotangent)


_tap.defvjp(_tap_forward, _tap_backward)


def _is_traced_floating(value: Any) -> bool:
    return isinstance(value, jax.Array) and jnp.issubdtype(value.dtype, jnp.floating)


class _Recorder:
    """What a recording rewrite does at each site (the probe's `Hooks`), in program order:

    ```python
    lhs, rhs = tap(lhs, probe[i, 0]), tap(rhs, probe[i, 1])  # identity forward
    out = tap(the op under its rule, probe[i, 2])
    forward_amax[i] = max(abs(out))
    # backward: tap's derivative passes the cotangent on unchanged and gives
    # max(abs(cotangent)) as the derivative of its probe slot
    ```

    so a site's backward amax covers the cotangent it receives (its output's)
    and the two it gives (the outputs of its backward matmuls). An operand that
    is one of `constant_inputs` (an input nobody differentiates) is not tapped.
    """

    taps = True

    def __init__(self, probe: jax.Array, constant_inputs: Sequence[Any] = ()):
        self.probe = probe
        self._constant_inputs = {id(value) for value in constant_inputs}
        self.sites: list[OverflowSite] = []
        self.forward: list[jax.Array] = []

    def tap_operands(self, invals: Sequence[Any]) -> list:
        index = len(self.sites)
        return [
            _tap(value, self.probe[index, slot])
            if slot < 2 and _is_traced_floating(value) and id(value) not in self._constant_inputs
            else value
            for slot, value in enumerate(invals)
        ]

    def record(self, site: Any, output: Any) -> Any:
        self.sites.append(OverflowSite(site.name, site.source, site.primitive, str(output.dtype), tuple(output.shape)))
        self.forward.append(amax(output))
        return _tap(output, self.probe[len(self.sites) - 1, 2]) if _is_traced_floating(output) else output

    def outputs(self) -> list:
        return [jnp.stack(self.forward) if self.forward else jnp.zeros([0], jnp.float32)]

    def recorded(self) -> tuple:
        return tuple(self.sites)


@contextlib.contextmanager
def overflow_session(probe: jax.Array | None = None) -> Iterator[OverflowSession]:
    """Records the overflows of every `autocast` call made inside (see the module docstring)."""
    with opened(OverflowSession(probe)) as session:
        yield session


def with_backward(
    records: Sequence[OverflowRecord], offsets: Sequence[int], probe_gradient: jax.Array
) -> OverflowRecord:
    """A session's records as one, their backward amaxes read from the probe's gradient.

    Each call's sites own the probe rows from its offset (`OverflowSession.take`)
    on, one row per site (the amaxes of its operands' and its output's
    cotangents), in order.
    """
    records = [
        record.replace(
            # fmax: an inf in one cotangent wins over a NaN (inf - inf) in another.
            backward_amax=functools.reduce(jnp.fmax, probe_gradient[offset : offset + len(record.sites)].T),
            backward_recorded=True,
        )
        for record, offset in zip(records, offsets, strict=True)
    ]
    return OverflowRecord.concatenate(records)


def record_overflow(fun: Callable[..., Any]) -> Callable[..., tuple[Any, OverflowRecord]]:
    """`fun`, whose autocast calls record each matmul's and convolution's forward amax.

    For a forward pass (an evaluation, a notebook): ``record_overflow(fun)(*args)``
    returns ``(fun(*args), record)``. For the backward pass too, use
    ``jaxamp.scaled_value_and_grad(loss_fn, loss_scale, record_overflow=True)``.

    Examples:
        >>> model = jaxamp.autocast(mlp, "mixed_float16")
        >>> logits, record = jaxamp.diagnostics.record_overflow(model)(params, x)
        >>> record.summary()
        'no overflow (4 matmuls and convolutions watched, forward only)'

    Args:
        fun: a function that calls `jaxamp.autocast` or `jaxamp.apply_policy`
            functions (or is one).
    """
    if not callable(fun):
        raise TypeError(f"record_overflow needs a function; got {type(fun).__name__}: {fun!r}.")

    @functools.wraps(fun)
    def recorded(*args, **kwargs):
        with overflow_session(None) as session:
            outputs = fun(*args, **kwargs)
        return outputs, OverflowRecord.concatenate(session.records)

    return recorded
