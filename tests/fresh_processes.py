"""Commands that need a fresh Python process, started while other tests run.

Some checks need a JAX that starts with 8 virtual CPU devices, which only a
new process can have, and such a process spends most of its time compiling
on one core. A test module declares each such command once, at module level,
as a `FreshProcess` named after the fixture that reads its result::

    PARITY = FreshProcess("parity", "tests/fsdp_parity_run.py", env={"XLA_FLAGS": xla_flags()})

    @pytest.fixture(scope="module")
    def parity():
        return json.loads(PARITY.result().stdout)

Once pytest has collected and selected the tests, `start_needed` starts, in
one background thread and one at a time, every command whose fixture a
selected test uses, in the order the tests come, in the environment the
session started with; the main process runs the
other tests meanwhile, so on two cores the two run side by side. `result`
waits for the command (or, where nothing started it, runs it there and then)
and returns what it printed; the test asserts on that exactly as it would on
a command it had run itself. What is left running when the session ends is
killed, and the temporary folders are removed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterable

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The suite compiles hundreds of small XLA programs and runs each a few times,
# so most of its time is compiling, and most of a CPU compile is LLVM
# optimizing the generated code. At LLVM -O0 the HLO XLA optimizes and its
# memory and cost analyses are unchanged (the tests read those), results
# differ in the last float32 bits, and compiling the tiny ResNet's
# initialization takes about a quarter of the time and its train step about
# 60%. Every process of the suite compiles this way, so the runs a test
# compares are built alike.
SUITE_XLA_FLAGS = ("--xla_backend_optimization_level=0",)


def xla_flags(*flags: str) -> str:
    """The value of XLA_FLAGS for a process of the suite: the suite's flags, then `flags`."""
    return " ".join((*SUITE_XLA_FLAGS, *filter(None, flags)))


class FreshProcess:
    """One command run as ``python ARGV...`` from the repository root, at most once.

    Attributes:
        fixture: the name of the fixture that reads the result: a selected
            test that uses it makes the command start early.
        argv: the arguments after ``python``; ``{dir}`` in one stands for a
            fresh temporary folder the command may write into.
        env: variables set on top of this process's environment.
        timeout: seconds the command may run.
        directory: the temporary folder, once the command started.
    """

    def __init__(self, fixture: str, *argv: str, env: dict[str, str] | None = None, timeout: float = 900):
        self.fixture = fixture
        self.argv = argv
        self.env = dict(env or {})
        self.timeout = timeout
        self.directory: str | None = None
        self._claimed = False
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._process: subprocess.Popen | None = None
        self._outcome: subprocess.CompletedProcess | BaseException | None = None

    def _claim(self) -> bool:
        """True for the one caller that is to run the command."""
        with self._lock:
            claimed, self._claimed = self._claimed, True
            return not claimed

    def _run(self, environ: dict[str, str] | None = None) -> None:
        """Runs the command in `environ` (by default this process's environment now), updated with `env`."""
        _RAN.append(self)
        try:
            if _STOPPING.is_set():
                raise RuntimeError("the test session ended before this command started")
            self.directory = tempfile.mkdtemp(prefix=f"fresh-{self.fixture}-")
            argv = [sys.executable, *(arg.replace("{dir}", self.directory) for arg in self.argv)]
            self._process = subprocess.Popen(
                argv, cwd=REPO_ROOT, env={**(os.environ if environ is None else environ), **self.env},
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            )  # fmt: skip
            if _STOPPING.is_set():  # the session ended while it started
                self._process.kill()
            try:
                stdout, stderr = self._process.communicate(timeout=self.timeout)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.communicate()
                raise
            self._outcome = subprocess.CompletedProcess(argv, self._process.returncode, stdout, stderr)
        except BaseException as error:  # noqa: BLE001 - handed to the test that waits for the result
            self._outcome = error
        finally:
            self._done.set()

    def result(self) -> subprocess.CompletedProcess:
        """What the command printed and its exit status, waiting for it to end.

        Raises:
            subprocess.TimeoutExpired: it ran past `timeout` (and was killed).
        """
        if self._claim():
            self._run()
        self._done.wait()
        if isinstance(self._outcome, BaseException):
            raise self._outcome
        return self._outcome

    def last_json_line(self):
        """The JSON value the command printed last, once it exited 0.

        Raises:
            AssertionError: it exited otherwise (the message is its stderr).
        """
        completed = self.result()
        assert completed.returncode == 0, completed.stderr
        return json.loads(completed.stdout.splitlines()[-1])

    def stop(self) -> None:
        """Kills the command if it still runs and removes its temporary folder."""
        if self._process is not None and self._process.poll() is None:
            self._process.kill()
        self._done.wait(timeout=30)
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)


_RAN: list[FreshProcess] = []
_STOPPING = threading.Event()


def needed(items: Iterable) -> list[FreshProcess]:
    """The fresh processes whose fixture a selected test uses, in the order they are first needed."""
    found: list[FreshProcess] = []
    for item in items:
        module = getattr(item, "module", None)  # none for a doctest or a non-Python item
        fixturenames = getattr(item, "fixturenames", ())
        for value in vars(module).values() if module is not None else ():
            if isinstance(value, FreshProcess) and value.fixture in fixturenames and value not in found:
                found.append(value)
    return found


def start_needed(items: Iterable) -> None:
    """Starts, one after another in a background thread, each fresh process a selected test needs."""
    runs = [run for run in needed(items) if run._claim()]
    if not runs:
        return
    # The environment as the session starts: a test that sets a variable for itself
    # (monkeypatch.setenv) while a command starts must not hand it on.
    environ = dict(os.environ)

    def run_all():
        for run in runs:
            run._run(environ)

    threading.Thread(target=run_all, name="fresh-processes", daemon=True).start()


def stop_all() -> None:
    """Kills what still runs and removes the temporary folders (at the end of the session)."""
    _STOPPING.set()
    for run in _RAN:
        run.stop()
