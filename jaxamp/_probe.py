"""The probe: a zero-valued input whose gradient carries amaxes out of a step.

One job: hand out, in trace order, the rows of a zero-valued float32
``(rows, 3)`` array that the caller differentiates; a site's custom VJP gives
the amaxes it saw as the derivative of its row, so they leave the step with
no host callback. Two clients use it: the overflow record
(`jaxamp._scaling.overflow`) and FP8 delayed scaling (`jaxamp.fp8._delayed`).
A first trace without rows counts them (every take gives zeros).
`jaxamp.autocast` knows a client by `Client` alone: per call it takes a
block of rows (one per matmul and convolution) as inputs of the rewritten
program, so the rewrite stays cached, and calls the client's `Hooks` at
each site while it builds that program.
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
    """Rows of a probe in trace order; ``rows=None`` counts them. `refusal(taken, rows)` is the
    message of the ``RuntimeError`` raised where more rows are taken than there are."""

    def __init__(self, rows: jax.Array | None, refusal: Callable[[int, int], str]):
        self.rows = rows
        self.size = 0
        self._refusal = refusal

    def take(self, count: int) -> jax.Array:
        start, self.size = self.size, self.size + count
        if self.rows is None:
            return jnp.zeros([count, SLOTS], jnp.float32)
        if self.size > self.rows.shape[0]:
            raise RuntimeError(self._refusal(self.size, self.rows.shape[0]))
        return self.rows[start : self.size]


class Hooks(Protocol):
    """What a rewrite calls at each site (``taps``: whether it calls `tap_operands` and `record`;
    FP8 delayed scaling takes its rows in its kernels instead)."""

    taps: bool

    def tap_operands(self, invals: Sequence[Any]) -> list: ...
    def record(self, site: Any, output: Any) -> Any: ...  # site: name, source, primitive
    def outputs(self) -> list: ...  # the rewrite's extra outputs
    def recorded(self) -> Any: ...  # kept with the rewrite, handed to `Client.finish`


class Client(Protocol):
    """The probe's client open around an `autocast` call: `blocks` ``(rows, 3)`` inputs per call,
    its `purpose` and the advice where it is open with another (`alone`)."""

    purpose: str
    alone: str
    blocks: int

    def key(self, leaves: Sequence[Any]) -> Hashable: ...  # what else decides the rewrite
    def take(self, rows: int) -> list[jax.Array]: ...  # one call's blocks
    def closed(self) -> contextlib.AbstractContextManager: ...  # no rows taken inside
    def rewriting(self, blocks, leaves, key) -> contextlib.AbstractContextManager: ...  # yields Hooks
    def finish(self, outputs: Sequence[Any], recorded: Any, unrecorded: int) -> None: ...


_OPEN: contextvars.ContextVar[tuple] = contextvars.ContextVar("jaxamp_probe_clients", default=())


@contextlib.contextmanager
def opened(client: Client | None) -> Iterator[Client | None]:
    """Opens `client` inside; None: none inside (autocast calls traced in another's trace)."""
    token = _OPEN.set((*_OPEN.get(), client) if client is not None else ())
    try:
        yield client
    finally:
        _OPEN.reset(token)


def open_client() -> Client | None:
    """The client open here, or None; ``NotImplementedError`` where two are (one call cannot do both)."""
    clients = _OPEN.get()
    if len(clients) > 1:
        ordered = sorted(clients, key=lambda client: client.purpose)
        raise NotImplementedError(
            f"jaxamp.autocast cannot {' and '.join(client.purpose for client in ordered)} in one call; "
            f"{ordered[0].alone}"
        )
    return clients[0] if clients else None
