"""Ctrl-C in the commands (`experiments.interrupts`): it always stops them, is held back through a
save, and ends in a clean exit.

A whole command interrupted is in tests/test_resume.py (SIGINT mid-run and
while XLA compiles, in fresh processes) and below (at several delays from the
first compile on, the signal landing where Python drops its exception:
tests/interrupted_runs.py); the parts alone are checked with a real SIGINT
sent to this process.
"""

import gc
import json
import os
import signal
import subprocess
import sys
import threading

import pytest
from fresh_processes import FreshProcess, xla_flags

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


def test_a_ctrl_c_whose_exception_python_dropped_still_stops_the_command(python_handles_ctrl_c, monkeypatch):
    """Python drops an exception raised inside a garbage collection's callback (JAX's
    ``_xla_gc_callback``): a run interrupted there went on, wrote its results and exited 0."""
    dropped = []
    monkeypatch.setattr(sys, "unraisablehook", lambda unraisable: dropped.append(unraisable.exc_type))

    def ctrl_c_during_a_collection(phase, info):
        if phase == "start" and not dropped:
            ctrl_c()
            for _ in range(1000):  # the handler runs here, inside the callback
                pass

    reached = []
    with pytest.raises(KeyboardInterrupt), interrupts.watched():
        gc.callbacks.insert(0, ctrl_c_during_a_collection)
        try:
            gc.collect()
        finally:
            gc.callbacks.remove(ctrl_c_during_a_collection)
        reached.append("the collection returned")
        interrupts.stop_if_interrupted()
        reached.append("the next step")
    assert dropped == [KeyboardInterrupt] and reached == ["the collection returned"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_dropped_ctrl_c_with_no_step_left_stops_the_command_at_the_blocks_end(python_handles_ctrl_c):
    with pytest.raises(KeyboardInterrupt), interrupts.watched():
        with pytest.raises(KeyboardInterrupt):
            ctrl_c()  # the exception, caught here, stands for one Python dropped
    with interrupts.watched():
        interrupts.stop_if_interrupted()  # a new block forgets the earlier signal


def test_a_ctrl_c_under_watch_raises_at_once_and_is_held_back_through_a_save(python_handles_ctrl_c):
    reached = []
    with pytest.raises(KeyboardInterrupt), interrupts.watched():
        with pytest.raises(KeyboardInterrupt):
            ctrl_c()
        with pytest.raises(KeyboardInterrupt), interrupts.deferred():
            ctrl_c()
            reached.append("the save")
        reached.append("after the save")
    assert reached == ["the save", "after the save"]


def test_a_ctrl_c_held_back_through_a_save_outside_a_command_leaves_no_stop_behind(python_handles_ctrl_c):
    with pytest.raises(KeyboardInterrupt), interrupts.deferred():
        ctrl_c()
    interrupts.stop_if_interrupted()
    with interrupts.watched():
        interrupts.stop_if_interrupted()


def test_watch_leaves_an_ignored_ctrl_c_and_a_handler_of_the_callers_own_alone(python_handles_ctrl_c):
    for handler in (signal.SIG_IGN, lambda signum, frame: None):
        signal.signal(signal.SIGINT, handler)
        with interrupts.watched():
            assert signal.getsignal(signal.SIGINT) is handler
            ctrl_c()
            interrupts.stop_if_interrupted()
    signal.signal(signal.SIGINT, signal.default_int_handler)


INTERRUPTED_RUNS = FreshProcess(
    "interrupted_runs", "tests/interrupted_runs.py", "{dir}", env={"XLA_FLAGS": xla_flags()}, timeout=600
)


@pytest.fixture(scope="module")
def interrupted_runs():
    """tests/interrupted_runs.py: a tiny training run sent SIGINT at several delays from its first compile on."""
    completed = INTERRUPTED_RUNS.result()
    assert completed.returncode == 0, completed.stderr
    return [json.loads(line) for line in completed.stdout.splitlines()]


def test_ctrl_c_stops_a_run_wherever_it_lands_from_the_first_compile_on(interrupted_runs):
    """Each run exits 130 with the interrupted run's one message and writes no results, also where
    Python dropped the KeyboardInterrupt (it went on, wrote its results and exited 0)."""
    assert len(interrupted_runs) >= 3
    for run in interrupted_runs:
        shown = {key: run[key] for key in ("delay_s", "in_a_collection", "stderr_tail")}
        assert run["returncode"] == interrupts.INTERRUPTED, shown
        assert run["messages"] == [
            "interrupted; no checkpoint was kept (no --checkpoint-dir). No epoch finished, so nothing was "
            f"written to {run['out']}. To be able to resume an interrupted run, add --checkpoint-dir DIR (and "
            "--checkpoint-every N for mid-epoch checkpoints)."
        ], shown
        assert not run["wrote_results"], shown
        assert run["dropped"] == run["in_a_collection"], shown  # the fault was met where it was made
