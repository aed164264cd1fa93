"""Ctrl-C in the experiments' commands: held back where it must not land, and a clean exit.

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
    if previous is not signal.default_int_handler:
        yield
        return
    received = []

    def hold(signum, frame):
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
