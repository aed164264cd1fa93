"""The probe: a zero-valued input whose gradient carries amaxes out of a step.

One job: hand out, in the order a function's sites are traced, the rows of a
zero-valued float32 ``(rows, 3)`` array that the caller differentiates. A
site's custom VJP gives the amaxes it saw as the derivative of its row, so
they leave the step as the probe's gradient: no host callback, no effect.
Two clients use it, each while it is open (`opened`):

* the overflow record (`jaxamp._scaling.overflow`): each matmul's and
  convolution's output amax forward, and its cotangents' backward;
* FP8 delayed scaling (`jaxamp.fp8._delayed`): each FP8 GEMM's operand and
  cotangent amaxes, beside the history's amaxes it scales by.

The rows are counted by a first trace without a probe (every take gives
zeros), then taken for real:

```text
sizing = Probe(None);  trace fun under the client      # sizing.size rows taken
probe = zeros((sizing.size, 3))
grad of fun under the client, w.r.t. probe too          # d probe = the amaxes
```

`jaxamp.autocast` takes a block of rows per call (one per matmul and
convolution of the traced program, `Client.take`) and passes them in as
inputs of the rewritten program, so the rewrite stays cached; while it
builds that program the client says what the rewrite does at each site
(`Client.rewriting`, `Hooks`). The engine knows the clients by this
protocol alone.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any, Protocol

import jax
import jax.numpy as jnp

SLOTS = 3
"""Columns of a row: the amaxes of one site's two operands and of its output (or cotangent)."""


class Probe:
    """The rows of a probe, handed out in trace order (see the module docstring).

    Args:
        rows: the zero-valued float32 ``(rows, 3)`` input, or None to count
            the rows (every take then gets zeros).
        refusal: ``refusal(taken, rows)``, the message of the error raised
            where more rows are taken than there are.
    """

    def __init__(self, rows: jax.Array | None, refusal: Callable[[int, int], str]):
        self.rows = rows
        self.size = 0
        self._refusal = refusal

    def take(self, count: int) -> jax.Array:
        """The next `count` rows.

        Raises:
            RuntimeError: more rows taken than the probe has (the function
                traced more sites than when it was sized).
        """
        start, self.size = self.size, self.size + count
        if self.rows is None:
            return jnp.zeros([count, SLOTS], jnp.float32)
        if self.size > self.rows.shape[0]:
            raise RuntimeError(self._refusal(self.size, self.rows.shape[0]))
        return self.rows[start : self.size]


class Hooks(Protocol):
    """What a rewrite calls at each site, while a client's rows of one call are in it.

    Attributes:
        taps: whether the rewrite calls `tap_operands` and `record` at its sites
            (FP8 delayed scaling takes its rows in the FP8 kernels instead).
    """

    taps: bool

    def tap_operands(self, invals: Sequence[Any]) -> list:
        """The operands of the next site, tapped for the backward pass."""

    def record(self, site: Any, output: Any) -> Any:
        """Records `site` (its ``name``, ``source``, ``primitive``), whose output is `output`; returns it."""

    def outputs(self) -> list:
        """The rewrite's extra outputs, after its last site."""

    def recorded(self) -> Any:
        """What the rewrite keeps of its sites, handed to `Client.finish` at every call."""


class Client(Protocol):
    """What `jaxamp.autocast` asks of the probe's client open around a call.

    Attributes:
        purpose: what the client does, for an error that names two.
        alone: the advice of that error, where this client's purpose comes first.
        blocks: how many ``(rows, 3)`` float32 blocks a rewrite takes as inputs.
    """

    purpose: str
    alone: str
    blocks: int

    def key(self, leaves: Sequence[Any]) -> Hashable:
        """What besides shapes and dtypes decides the rewrite of a call on `leaves`."""

    def take(self, rows: int) -> list[jax.Array]:
        """The blocks of one call with `rows` sites."""

    def closed(self) -> contextlib.AbstractContextManager:
        """Inside, no rows are taken: while a function is traced, and in a body whose amaxes cannot
        leave it (a loop, a conditional)."""

    def rewriting(self, blocks: Sequence[Any], leaves: Sequence[Any], key: Hashable) -> contextlib.AbstractContextManager:
        """Open while the rewrite of one call is traced on `blocks`; yields its `Hooks`."""

    def finish(self, outputs: Sequence[Any], recorded: Any, unrecorded: int) -> None:
        """After a call: its rewrite's extra outputs, what its hooks recorded, how many matmuls and
        convolutions it did not watch."""


_OPEN: contextvars.ContextVar[tuple] = contextvars.ContextVar("jaxamp_probe_clients", default=())


@contextlib.contextmanager
def opened(client: Client | None) -> Iterator[Client | None]:
    """Opens `client` inside; None: no client inside (`autocast` calls traced inside another's trace
    are part of its rewrite)."""
    token = _OPEN.set((*_OPEN.get(), client) if client is not None else ())
    try:
        yield client
    finally:
        _OPEN.reset(token)


def open_client() -> Client | None:
    """The client open here, or None.

    Raises:
        NotImplementedError: two clients are open (one call cannot do both).
    """
    clients = _OPEN.get()
    if len(clients) > 1:
        first, *others = sorted(clients, key=lambda client: client.purpose)
        raise NotImplementedError(
            f"jaxamp.autocast cannot {' and '.join(client.purpose for client in (first, *others))} in one "
            f"call; {first.alone}"
        )
    return clients[0] if clients else None
