"""FP8 delayed scaling: the amax history a train step carries, and the step that records into it.

One job: run a loss function with its FP8 matmuls scaled from an
`Fp8History` (TransformerEngine's delayed scaling), and return the history
with the step's amaxes in it. Current scaling stays the default: nothing
here runs unless asked for.

The history remembers the recent amaxes (largest magnitudes) of the tensors
that FP8 matmuls quantize, and reduces them to the amax the next step scales
by, as TransformerEngine's ``DelayedScaling`` recipe does:

```text
history:  float32 (rows, 3, length); row = one FP8 site (a matmul), column =
          lhs, rhs, cotangent; history[..., 0] the newest amax
amax():   reduce(history, "max" over the window | "most_recent")  * 2**margin
record(amaxes, keep):                     # once per step, after the step
    if keep and all(isfinite(amaxes)):
        history = concat(amaxes[..., None], history[..., :-1])   # newest in, oldest out
    else:
        history unchanged                 # a non-finite amax never enters
    recorded = True
```

Until the first step is recorded (``recorded`` is False, a static field) the
FP8 sites use current scaling (the amax of the tensor now), so no step runs
with a made-up scale. ``recorded`` is static, so the first step and the
later ones are two programs under ``jax.jit`` (it retraces once); a history
carried through ``lax.scan`` must be recorded once before the loop.
A row whose history holds only zeros (its tensor was all zeros, or the
first step was skipped) scales by 1, TransformerEngine's rule.

`delayed_value_and_grad(fun, loss_scale)` returns a function of
``(history, *args)`` that computes:

```python
probe = zeros((history.rows, 3))           # one row per FP8 site
def probed(probe, *args):
    with delayed_scaling(history, probe):  # each FP8 site: scales from history.amax()
        return loss_scale.scale(fun(*args))  # (current scaling until a step is recorded)
value, (amaxes, scaled_grads) = value_and_grad(probed, argnums=(probe, *argnums))(probe, *args)
grads = loss_scale.unscale(scaled_grads)
grads_finite = all_finite(grads) and all(isfinite(amaxes))
history = history.record(amaxes, keep=grads_finite)   # a skipped step records nothing
return value, grads, grads_finite, history
```

The amaxes are the gradient of a probe (`jaxamp._probe`; `Fp8Sites` is its
client): while a function runs under `delayed_scaling`, each FP8 site (each
`jaxamp.fp8_dot_general` or FP8 convolution, in the order they are traced)
takes its row of the history's amaxes (its scales) and its row of the
probe, and its custom VJP gives, as the derivative of its probe row, the
amaxes of the tensors it quantized:

```text
row i = sites.rows(1)                    # (amax_in[i], probe[i]), in trace order
forward:  q_lhs, amax_lhs = quantize(lhs, scale from amax_in[i, 0])   # scale known first
          q_rhs, amax_rhs = quantize(rhs, scale from amax_in[i, 1])
backward: q_g,   amax_g   = quantize(g,   scale from amax_in[i, 2])
          d probe[i] = (amax_lhs, amax_rhs, amax_g)
```

so every amax, forward and backward, leaves the step without a host
callback. Inside `jaxamp.autocast` the rewrite takes a block of rows per
call (one per matmul and convolution it could run in FP8) as inputs of the
rewritten program, so the rewrite stays cached; matmuls inside loops,
conditionals, checkpoints and custom derivative rules keep current scaling
(their amaxes cannot leave those bodies). The
cotangent's amax is that of the scaled cotangent, which is what the site
quantizes. A step with a non-finite amax is skipped as any non-finite step
is (`grads_finite` is False; pass it to ``TrainState.apply_gradients`` or
a `DynamicLossScale`), and leaves the history as it was.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
from flax import struct

from jaxamp._finite import all_finite
from jaxamp._probe import SLOTS, Probe, opened

REDUCTIONS = ("max", "most_recent")
"""How `Fp8History.amax` reduces a row's window (TransformerEngine's ``amax_compute_algo``)."""

DEFAULT_LENGTH = 1024
"""TransformerEngine's default ``amax_history_len``."""


class Fp8History(struct.PyTreeNode):
    """Amax histories of the FP8 sites of a step, for delayed scaling (see the module docstring).

    Attributes:
        amax_history: float32 ``(rows, 3, length)``, newest amax first.
        recorded: whether a step has been recorded; before it, current scaling.
        reduction: ``"max"`` (the largest amax in the window, the default) or
            ``"most_recent"``.
        margin: the scale is divided by ``2**margin`` (headroom above the amax).

    Examples:
        >>> history = jaxamp.fp8.Fp8History.create(rows=2, length=4)
        >>> history.amax_history.shape
        (2, 3, 4)
    """

    amax_history: jax.Array
    recorded: bool = struct.field(pytree_node=False, default=False)
    reduction: str = struct.field(pytree_node=False, default="max")
    margin: int = struct.field(pytree_node=False, default=0)

    @classmethod
    def create(
        cls,
        rows: int,
        length: int = DEFAULT_LENGTH,
        reduction: Literal["max", "most_recent"] = "max",
        margin: int = 0,
    ) -> Fp8History:
        """An empty history of `rows` FP8 sites (TransformerEngine's defaults: 1024, "max", 0).

        Raises:
            ValueError: `rows` is negative, `length` below 1, `reduction`
                unknown, or `rows`, `length` or `margin` not a whole number.
        """
        if reduction not in REDUCTIONS:
            raise ValueError(f"Unknown amax reduction {reduction!r}; valid: {', '.join(REDUCTIONS)}.")
        rows, length, margin = (_whole("rows", rows), _whole("length", length), _whole("margin", margin))
        if length < 1 or rows < 0:
            raise ValueError(
                f"An FP8 history needs length >= 1 and rows >= 0; got length {length}, rows {rows}."
            )
        return cls(jnp.zeros((rows, SLOTS, length), jnp.float32), False, reduction, margin)

    @property
    def rows(self) -> int:
        """How many FP8 sites the history has rows for."""
        return self.amax_history.shape[0]

    def amax(self) -> jax.Array:
        """Per row and column, the amax the next step scales by: float32 ``(rows, 3)``."""
        if self.reduction == "max":
            reduced = jnp.max(self.amax_history, axis=-1)
        else:
            reduced = self.amax_history[..., 0]
        return reduced * jnp.float32(2.0**self.margin)

    def record(self, amaxes: jax.Array, keep: jax.Array | bool = True) -> Fp8History:
        """The history with `amaxes` (``(rows, 3)``) as its newest entry, unless the step is not kept.

        Args:
            amaxes: the step's amaxes, one per row and column.
            keep: whether the step counts (its gradients were finite); a step
                not kept, or with a non-finite amax, leaves the window as it was.

        Raises:
            ValueError: `amaxes` is not ``(rows, 3)``.
        """
        if amaxes.shape != self.amax_history.shape[:-1]:
            raise ValueError(
                f"Fp8History.record needs amaxes of shape {self.amax_history.shape[:-1]} (rows, "
                f"lhs/rhs/cotangent); got {amaxes.shape}."
            )
        amaxes = amaxes.astype(jnp.float32)
        rolled = jnp.concatenate([amaxes[..., None], self.amax_history[..., :-1]], axis=-1)
        enters = jnp.logical_and(keep, jnp.all(jnp.isfinite(amaxes)))
        return self.replace(amax_history=jnp.where(enters, rolled, self.amax_history), recorded=True)



class Fp8Sites:
    """The amax and probe rows of the FP8 sites of one function call (see the module docstring).

    A client of the probe (`jaxamp._probe.Client`) for `jaxamp.autocast`, and
    the rows the FP8 kernels take (`current_fp8_sites`).

    Args:
        amax: float32 ``(rows, 3)``, the amaxes the sites scale by, or None
            for current scaling.
        probe: the zero-valued float32 ``(rows, 3)`` whose gradient receives
            the amaxes, or None to count the sites (every take gets zeros).
    """

    purpose = "run FP8 delayed scaling (jaxamp.fp8.delayed_scaling)"
    alone = "run the delayed scaling in a call that records no overflows."
    blocks = 2

    def __init__(self, amax: jax.Array | None, probe: jax.Array | None):
        if probe is not None and amax is not None and amax.shape != probe.shape:
            raise ValueError(
                f"FP8 sites need amax and probe of one shape; got {amax.shape} and {probe.shape}."
            )
        self.amax = amax
        self._probe = Probe(probe, self._refusal)

    @staticmethod
    def _refusal(taken: int, rows: int) -> str:
        return (
            f"FP8 delayed scaling: the function ran more FP8 sites ({taken} so far) than its history "
            f"has rows ({rows}). Size the history with jaxamp.fp8.init_fp8_history on the "
            "same function and arguments; it must trace the same matmuls every time."
        )

    @property
    def current_scaling(self) -> bool:
        """Whether the sites scale by the amax of the tensor now (no history yet)."""
        return self.amax is None

    @property
    def size(self) -> int:
        """The rows taken so far."""
        return self._probe.size

    def rows(self, count: int) -> tuple[jax.Array | None, jax.Array]:
        """The amax rows (None under current scaling) and probe rows of the next `count` sites."""
        start = self._probe.size
        probe = self._probe.take(count)
        if self.amax is None:
            return None, probe
        if self._probe.rows is None:
            return jnp.zeros([count, SLOTS], jnp.float32), probe
        return self.amax[start : start + count], probe

    def key(self, leaves) -> str:
        return "current" if self.current_scaling else "delayed"

    def take(self, rows: int) -> list[jax.Array]:
        amax, probe = self.rows(rows)
        return [jnp.zeros_like(probe) if amax is None else amax, probe]

    def closed(self) -> contextlib.AbstractContextManager:
        return fp8_sites(None)

    @contextlib.contextmanager
    def rewriting(self, blocks, leaves, key) -> Iterator[_KernelsTakeTheRows]:
        amax, probe = blocks
        with fp8_sites(Fp8Sites(None if key == "current" else amax, probe)):
            yield _KernelsTakeTheRows()

    def finish(self, outputs, recorded, unrecorded) -> None:
        del outputs, recorded, unrecorded


class _KernelsTakeTheRows:
    """The probe's `Hooks` under delayed scaling: the FP8 kernels take the rows themselves."""

    taps = False

    def outputs(self) -> list:
        return []

    def recorded(self) -> None:
        return None


_SITES: contextvars.ContextVar[Fp8Sites | None] = contextvars.ContextVar("jaxamp_fp8_sites", default=None)


def current_fp8_sites() -> Fp8Sites | None:
    """The FP8 sites the kernels take their rows from here, or None (current scaling, no amaxes out)."""
    return _SITES.get()


@contextlib.contextmanager
def fp8_sites(sites: Fp8Sites | None) -> Iterator[Fp8Sites | None]:
    """Runs the code inside with `sites` (None: no delayed scaling inside)."""
    token = _SITES.set(sites)
    try:
        yield sites
    finally:
        _SITES.reset(token)


@contextlib.contextmanager
def delayed_scaling(history: Fp8History, probe: jax.Array | None = None) -> Iterator[Fp8Sites]:
    """Inside, FP8 matmuls scale from `history` and send their amaxes out through `probe`'s gradient.

    Covers `jaxamp.fp8_dot_general`, `jaxamp.fp8.fp8_convolution`, and the
    FP8 matmuls of `jaxamp.autocast` / `jaxamp.apply_policy` under
    ``"mixed_float8"`` called inside, taking history rows in the order they
    are traced. Before `history` is recorded the sites use current scaling.
    A direct `fp8_dot_general` call must not sit inside a loop body
    (``lax.scan``, ``fori_loop``): its row's gradient would sum the amaxes
    of the iterations (`autocast` keeps such matmuls on current scaling).
    The lower-level form of `delayed_value_and_grad`, for a step written by hand:

    Examples:
        >>> def probed(w, probe, x):
        ...     with jaxamp.fp8.delayed_scaling(history, probe):
        ...         return jaxamp.fp8_dot_general(x, w, (((1,), (0,)), ((), ()))).astype(jnp.float32).sum()
        >>> grads, amaxes = jax.grad(probed, argnums=(0, 1))(w, jnp.zeros((history.rows, 3)), x)
        >>> history = history.record(amaxes)

    Args:
        history: the amax history; its rows must match the FP8 sites traced inside.
        probe: zero-valued float32 ``(history.rows, 3)``, differentiated by
            the caller; None to run without sending amaxes out (evaluation).

    Raises:
        ValueError: (on exit) the code inside ran another number of FP8 sites than `history` has rows.
    """
    amax = history.amax() if history.recorded else None
    if probe is None:
        probe = jnp.zeros((history.rows, SLOTS), jnp.float32)
    with fp8_sites(Fp8Sites(amax, probe)) as sites, opened(sites):
        yield sites
    if sites.size != history.rows:
        raise ValueError(
            f"FP8 delayed scaling: the function ran {sites.size} FP8 sites (matmuls autocast could run in "
            f"FP8 included) but the history has {history.rows} rows. Size it with "
            "jaxamp.fp8.init_fp8_history(fun, *args) on the same function and arguments."
        )


def init_fp8_history(
    fun: Callable[..., Any],
    *args: Any,
    length: int = DEFAULT_LENGTH,
    reduction: Literal["max", "most_recent"] = "max",
    margin: int = 0,
    **kwargs: Any,
) -> Fp8History:
    """An empty `Fp8History` with one row per FP8 site of ``fun(*args, **kwargs)``.

    `fun` is traced abstractly (``jax.eval_shape``) to count its sites;
    nothing runs. Defaults are TransformerEngine's (1024 steps, "max", margin 0).
    """
    sizing = Fp8Sites(None, None)
    with fp8_sites(sizing), opened(sizing):
        jax.eval_shape(functools.partial(fun, **kwargs), *args)
    return Fp8History.create(sizing.size, length, reduction, margin)


def delayed_value_and_grad(
    fun: Callable[..., Any],
    loss_scale: Any = None,
    *,
    has_aux: bool = False,
    argnums: int | Sequence[int] = 0,
) -> Callable[..., tuple]:
    """Like `jaxamp.scaled_value_and_grad`, with FP8 delayed scaling (see the module docstring).

    Examples:
        >>> history = jaxamp.fp8.init_fp8_history(loss_fn, params, batch)
        >>> value_and_grad = jaxamp.fp8.delayed_value_and_grad(loss_fn)
        >>> loss, grads, grads_finite, history = value_and_grad(history, params, batch)

    Args:
        fun: the loss function; its FP8 matmuls (``autocast(..., "mixed_float8")``
            or `jaxamp.fp8_dot_general`) scale from the history.
        loss_scale: any loss scale; None (the default) scales nothing, as
            `jaxamp.NoOpLossScale` does.
        has_aux: whether `fun` returns ``(loss, aux)``.
        argnums: which of `fun`'s positional arguments to differentiate.

    Returns:
        A function of ``(history, *args, **kwargs)`` returning
        ``(value, grads, grads_finite, history)``: `value` is `fun`'s own
        result, `grads` unscaled, `grads_finite` false when a gradient or an
        amax is not finite, and `history` the new history (the old one
        if the step is not finite).
    """
    scale, unscale = (_unchanged, _unchanged) if loss_scale is None else (loss_scale.scale, loss_scale.unscale)
    single = isinstance(argnums, int)
    shifted = (0, *((argnums + 1,) if single else (index + 1 for index in argnums)))

    def value_and_grads(history: Fp8History, *args, **kwargs):
        def probed(probe, *args):
            with delayed_scaling(history, probe):
                output = fun(*args, **kwargs)
            loss = output[0] if has_aux else output
            return scale(jnp.asarray(loss)), output

        probe = jnp.zeros((history.rows, SLOTS), jnp.float32)
        (_, value), (amaxes, *scaled_grads) = jax.value_and_grad(probed, argnums=shifted, has_aux=True)(
            probe, *args
        )
        grads = unscale(scaled_grads[0] if single else tuple(scaled_grads))
        grads_finite = jnp.logical_and(all_finite(grads), jnp.all(jnp.isfinite(amaxes)))
        return value, grads, grads_finite, history.record(amaxes, keep=grads_finite)

    return value_and_grads


def _whole(name: str, value: Any) -> int:
    """`value` as an int, refused unless it is a whole number (a margin of 1.5 is not rounded away)."""
    if isinstance(value, bool) or not float(value).is_integer():
        raise ValueError(
            f"Fp8History.create: {name} must be a whole number; got {value!r}. Pass an int (a margin "
            "counts powers of two of headroom: the amax is multiplied by 2**margin)."
        )
    return int(value)


def _unchanged(tree: Any) -> Any:
    return tree
