"""Ctrl-C in the commands (`experiments.interrupts`): held back through a save, then a clean exit.

A whole command interrupted is in tests/test_resume.py (SIGINT mid-run and
while XLA compiles, in fresh processes); here the two parts alone, with a
real SIGINT sent to this process.
"""

import os
import signal
import subprocess
import sys
import threading

import pytest

from experiments import interrupts

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def python_handles_ctrl_c():
    """SIGINT raises KeyboardInterrupt, as in a terminal (a test runner's worker may ignore it)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def ctrl_c():
    os.kill(os.getpid(), signal.SIGINT)


def test_a_ctrl_c_inside_the_block_takes_effect_at_its_end(python_handles_ctrl_c):
    finished = []
    with pytest.raises(KeyboardInterrupt), interrupts.deferred():
        ctrl_c()
        finished.append("the save")
    assert finished == ["the save"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_second_ctrl_c_interrupts_the_block_at_once(python_handles_ctrl_c):
    reached = []
    with pytest.raises(KeyboardInterrupt), interrupts.deferred():
        ctrl_c()
        reached.append("after the first")
        ctrl_c()
        reached.append("after the second")
    assert reached == ["after the first"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_block_without_ctrl_c_ends_normally_and_restores_the_handler(python_handles_ctrl_c):
    with interrupts.deferred():
        assert signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_an_error_inside_the_block_restores_the_handler(python_handles_ctrl_c):
    with pytest.raises(ValueError), interrupts.deferred():
        raise ValueError("the save failed")
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_handler_of_the_callers_own_is_left_alone(python_handles_ctrl_c):
    received = []
    own = signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
    try:
        with interrupts.deferred():
            assert signal.getsignal(signal.SIGINT) is not signal.default_int_handler
            handler = signal.getsignal(signal.SIGINT)
            ctrl_c()
        assert received == [signal.SIGINT] and signal.getsignal(signal.SIGINT) is handler
    finally:
        signal.signal(signal.SIGINT, own)


def test_outside_the_main_thread_the_block_runs_as_without_it(python_handles_ctrl_c):
    seen = []

    def in_a_thread():
        with interrupts.deferred():
            seen.append(signal.getsignal(signal.SIGINT))

    thread = threading.Thread(target=in_a_thread)
    thread.start()
    thread.join()
    assert seen == [signal.default_int_handler]


def test_from_python_the_status_is_returned_and_from_the_command_line_the_process_ends_with_it():
    assert interrupts.exit_status(entry_point=False) == 130 == interrupts.INTERRUPTED
    ends = (
        "import sys; from experiments import interrupts; print('said', end=''); "
        "print('on stderr', end='', file=sys.stderr); interrupts.exit_status(entry_point=True); "
        "print('never')"
    )
    process = subprocess.run([sys.executable, "-c", ends], cwd=REPO_ROOT, capture_output=True, text=True,
                             timeout=60, check=False)  # fmt: skip
    assert (process.returncode, process.stdout, process.stderr) == (130, "said", "on stderr")
