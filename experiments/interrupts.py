"""Ctrl-C in the experiments' commands: always stops them, held back where it must not land, a clean exit.

A ``KeyboardInterrupt`` may never reach the command: Python drops an
exception raised inside a garbage-collection callback (JAX registers one,
``_xla_gc_callback``) with a line "Exception ignored in ...", and a Ctrl-C
that lands there would let the run go on and exit 0. So each command runs
`watched`: a SIGINT handler that raises ``KeyboardInterrupt`` as Python's own
does and also keeps the signal's arrival, which the command reads between
its steps and units of work (`stop_if_interrupted`) and once more at the
end; it stops there as from the exception.

A ``KeyboardInterrupt`` must not land in two places:

* inside a checkpoint save: orbax writes in background threads, and an
  interrupt inside the save leaves a thread that fails noisily at exit.
  `deferred` holds it back until the save is complete.
* at the interpreter's exit while an interrupted XLA compilation still runs:
  jaxlib checks for signals while it compiles and raises
  ``KeyboardInterrupt`` in the waiting Python thread, but the compilation
  goes on in XLA's own threads, and the interpreter's teardown under it ends
  in a segmentation fault (exit status 139 instead of 130, after the
  command's own message). Any ``jit`` compiles, so a Ctrl-C at startup
  (state initialisation, the ahead-of-time compiles) meets one.
  `exit_status` ends a command's process without that teardown once its
  message is printed.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator

# 128 + SIGINT, as a shell reports a command stopped by Ctrl-C.
INTERRUPTED = 130

# Set by the SIGINT handler of `watched` (and `deferred`), read by `stop_if_interrupted`.
_arrived = threading.Event()


def _keep_and_interrupt(signum, frame):
    """The SIGINT handler of `watched`: keeps the arrival, then does what Python's own handler does."""
    _arrived.set()
    raise KeyboardInterrupt


def _pythons_own(handler) -> bool:
    """Whether `handler` is Python's Ctrl-C handler, or `watched`'s, which stands in for it."""
    return handler is signal.default_int_handler or handler is _keep_and_interrupt


@contextlib.contextmanager
def watched() -> Iterator[None]:
    """Runs a command's work so that a Ctrl-C stops it, wherever the signal lands.

    Algorithm::

        on entry:            install the handler
        on a SIGINT:         keep its arrival; raise KeyboardInterrupt (as Python does)
        stop_if_interrupted: raise KeyboardInterrupt if a SIGINT arrived
        at the block's end:  restore the previous handler; if a SIGINT arrived and
                             no exception is on its way out, raise KeyboardInterrupt

    As `deferred`, outside the main thread or where SIGINT is not Python's to
    handle (ignored, or a handler of the caller's own) the block runs as it
    would without this, and `stop_if_interrupted` never raises.

    Raises:
        KeyboardInterrupt: at the block's end, if a SIGINT arrived during it
            whose exception did not reach the command.
    """
    previous = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or not _pythons_own(previous):
        yield
        return
    signal.signal(signal.SIGINT, _keep_and_interrupt)
    try:
        yield
        stop_if_interrupted()
    finally:
        signal.signal(signal.SIGINT, previous)
        _arrived.clear()  # the next command starts afresh


def stop_if_interrupted() -> None:
    """Raises KeyboardInterrupt if a SIGINT arrived in the `watched` block: called between steps.

    Cheap (a flag read, no host sync), so a training loop calls it every step.

    Raises:
        KeyboardInterrupt: a SIGINT arrived, whether or not its own
            ``KeyboardInterrupt`` reached the command.
    """
    if _arrived.is_set():
        raise KeyboardInterrupt


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """Holds back the first SIGINT (Ctrl-C) until the block ends; a second one interrupts at once.

    Algorithm::

        on the first SIGINT:  remember it
        on a second SIGINT:   restore the previous handler, raise KeyboardInterrupt
        at the block's end:   restore the previous handler; if a SIGINT was
                              remembered, raise KeyboardInterrupt

    Outside the main thread (which alone receives signals and may set their
    handlers), and where SIGINT is not Python's to handle (ignored, or a
    handler of the caller's own), the block runs as it would without this.

    Raises:
      KeyboardInterrupt: at the block's end, if a SIGINT arrived during it.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGINT)
    if not _pythons_own(previous):
        yield
        return
    received = []

    def hold(signum, frame):
        if previous is _keep_and_interrupt:  # inside `watched`: kept for its readers too
            _arrived.set()
        if received:
            signal.signal(signal.SIGINT, previous)
            raise KeyboardInterrupt
        received.append(signum)

    signal.signal(signal.SIGINT, hold)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if received:
        raise KeyboardInterrupt


def exit_status(entry_point: bool) -> int:
    """What a command's `main` returns once it has said it was interrupted.

    Called from the command line (`entry_point`), the process ends here,
    with status 130 and its output flushed, without the interpreter's
    teardown (see the module docstring: an interrupted compilation may still
    be running). Every file the command writes is complete by then: results
    are written atomically and checkpoint saves finish before a Ctrl-C takes
    effect. Called from Python (tests, a notebook), it returns 130.
    """
    if not entry_point:
        return INTERRUPTED
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(INTERRUPTED)
