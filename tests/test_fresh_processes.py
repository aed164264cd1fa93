"""The runner of fresh processes started early (tests/fresh_processes.py).

The commands here are plain ``python -c`` lines: no JAX, a few milliseconds each.
"""

import os
import subprocess
import time
import types

import pytest
from fresh_processes import REPO_ROOT, FreshProcess, needed, start_needed


def fake_item(module, *fixturenames):
    """What `needed` reads of a collected test: its module and the fixtures it uses."""
    return types.SimpleNamespace(module=module, fixturenames=list(fixturenames))


def test_a_command_nothing_started_runs_when_its_result_is_asked_for_with_its_environment():
    """Fails if the extra variables, the repository root as cwd or the `{dir}` folder were lost."""
    run = FreshProcess(
        "greeting",
        "-c",
        "import os, sys; print(os.environ['GREETING'], os.getcwd(), os.path.isdir(sys.argv[1]))",
        "{dir}",
        env={"GREETING": "hello"},
    )
    completed = run.result()
    assert completed.returncode == 0, completed.stderr
    assert completed.stdout.split() == ["hello", REPO_ROOT, "True"]
    assert run.result() is completed  # run once, however often asked
    run.stop()
    assert not os.path.exists(run.directory)


def test_only_the_commands_a_selected_test_uses_start_in_the_order_first_needed():
    """Fails if an unused command started, or one needed by a later test came first."""
    module = types.SimpleNamespace(
        FIRST=FreshProcess("first", "-c", "print(1)"),
        SECOND=FreshProcess("second", "-c", "print(2)"),
        UNUSED=FreshProcess("unused", "-c", "print(3)"),
    )
    items = [fake_item(module, "tmp_path"), fake_item(module, "second"), fake_item(module, "first", "second")]
    assert needed(items) == [module.SECOND, module.FIRST]

    start_needed(items)
    assert [module.FIRST.result().stdout, module.SECOND.result().stdout] == ["1\n", "2\n"]
    assert module.UNUSED.directory is None  # never started
    for run in (module.FIRST, module.SECOND):
        run.stop()


def test_a_command_past_its_timeout_is_killed_and_its_test_fails():
    run = FreshProcess("slow", "-c", "import time; time.sleep(60)", timeout=0.5)
    started = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        run.result()
    assert time.monotonic() - started < 30
    run.stop()


def test_stopping_kills_a_command_that_still_runs():
    """What the end of a session does with a command no test waited for."""
    module = types.SimpleNamespace(SLOW=FreshProcess("slow", "-c", "import time; time.sleep(60)"))
    start_needed([fake_item(module, "slow")])
    deadline = time.monotonic() + 30
    while module.SLOW._process is None:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    module.SLOW.stop()
    assert module.SLOW.result().returncode == -9  # SIGKILL


def test_commands_started_early_see_the_environment_the_session_started_with(monkeypatch):
    """Fails if a command started in the background took a variable a running test had just set.

    The first command holds the queue for half a second; the variable changes meanwhile.
    """
    monkeypatch.setenv("FRESH_PROCESS_PROBE", "as the session started")
    module = types.SimpleNamespace(
        FIRST=FreshProcess("first", "-c", "import time; time.sleep(0.5)"),
        PROBE=FreshProcess("probe", "-c", "import os; print(os.environ['FRESH_PROCESS_PROBE'])"),
    )
    start_needed([fake_item(module, "first", "probe")])
    monkeypatch.setenv("FRESH_PROCESS_PROBE", "set by a test")
    assert module.PROBE.result().stdout == "as the session started\n"
    for run in (module.FIRST, module.PROBE):
        run.stop()
