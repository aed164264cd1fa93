"""The progress bar on a terminal: it shows the latest loss, and log lines never join its line.

The bar draws only on a terminal, so these tests hand it one: a text buffer
that says it is a terminal, standing for both stdout and stderr as a real
terminal shows both. `_screen` replays what was written as a terminal would
(a carriage return goes back to the start of the line).
"""

import contextlib
import io
import re

import jax.numpy as jnp

from experiments import progress as progress_module
from experiments.progress import Progress


class _Terminal(io.StringIO):
    def isatty(self):
        return True


@contextlib.contextmanager
def _a_terminal():
    """One fake terminal as stdout and stderr, inside the test itself.

    Not a fixture: pytest's output capture sets `sys.stdout` and `sys.stderr`
    again when the test's call begins, over what a fixture set.
    """
    screen = _Terminal()
    with contextlib.redirect_stdout(screen), contextlib.redirect_stderr(screen):
        yield screen


def _screen(written: str) -> list[str]:
    """The lines a terminal shows after `written`, trailing spaces dropped."""
    lines, column = [[]], 0
    for char in written:
        if char == "\n":
            lines.append([])
            column = 0
        elif char == "\r":
            column = 0
        else:
            line = lines[-1]
            line[column : column + 1] = [char]
            column += 1
    return ["".join(line).rstrip() for line in lines]


def test_the_bar_shows_the_loss_of_the_latest_finished_refresh():
    """Losses 10, 20, ..., 60: after step k the bar shows step k-1's loss (a step known to be finished),
    labelled as one step's loss."""
    shown = []
    with _a_terminal() as terminal:
        progress = Progress(total=6, description="epoch 1/1", enabled=True, batch_size=8)
        for step, loss in enumerate([10.0, 20.0, 30.0, 40.0, 50.0, 60.0], start=1):
            progress.update(step, jnp.float32(loss))
            frame = terminal.getvalue().rsplit("\r", 1)[-1]
            shown.append(re.search(r"step_loss=([\d.]+)", frame)[1] if "step_loss=" in frame else None)
        progress.close()
    assert shown == [None, "10.0000", "20.0000", "30.0000", "40.0000", "50.0000"]


def test_the_rate_counts_finished_steps_from_the_first_one_seen_finished(monkeypatch):
    """Steps are dispatched at once and finish later, so the first refresh has no rate to give (it
    was 50-1000x too high when timed from the first dispatch); from the second finished refresh on,
    the rate is the steps finished since then over the time since then. A clock that moves 2 s per
    refresh, 8 images a step: 16 images in 2 s, 8 img/s, whatever the dispatch times."""
    clock = iter(float(second) for second in range(0, 100, 2))
    monkeypatch.setattr(progress_module.time, "perf_counter", lambda: next(clock))
    rates = []
    with _a_terminal() as terminal:
        progress = Progress(total=5, description="epoch 1/1", enabled=True, batch_size=8)
        for step in range(1, 6):
            progress.update(step, jnp.float32(1.0))
            frame = terminal.getvalue().rsplit("\r", 1)[-1]
            rates.append(re.search(r"img_s=([\d,]+)", frame)[1] if "img_s=" in frame else None)
        progress.close()
    # step 1: nothing finished yet; step 2: step 1 finished, the clock starts; step 3 on: a rate
    assert rates == [None, None, "4", "4", "4"]


def test_a_line_written_while_the_bar_is_live_stands_on_its_own_line():
    """An evaluation line logged mid-run is a whole screen line, and the bar is drawn again after it."""
    with _a_terminal() as terminal:
        progress = Progress(total=4, description="tiny seed 0", enabled=True, batch_size=64, rate_name="tokens_s")
        progress.update(1, jnp.float32(5.0))
        progress.update(2, jnp.float32(4.0))
        progress.write("step     2/4 | held-out loss 4.4037", print)
        progress.update(3, jnp.float32(3.0))
        screen = _screen(terminal.getvalue())
        progress.close()
    assert "step     2/4 | held-out loss 4.4037" in screen
    assert "step_loss=4.0000" in screen[-1] and "tokens_s=" in screen[-1]


def test_without_a_bar_a_written_line_goes_straight_to_the_log():
    """Off a terminal (or with the bar turned off) `write` is the log alone."""
    logged = []
    progress = Progress(total=4, description="epoch 1/1", enabled=False, batch_size=8)
    progress.update(1, jnp.float32(1.0))
    progress.write("epoch 1/1 | loss 1.0", logged.append)
    progress.close()
    assert logged == ["epoch 1/1 | loss 1.0"]


def test_the_cifar_bar_says_it_is_testing_through_the_test_pass():
    """The bar sat at 100% through the test pass with nothing saying so."""
    from experiments import cifar

    with _a_terminal() as terminal:
        exit_code = cifar.main(["--model", "resnet_tiny", "--data", "synthetic", "--epochs", "1",
                                "--batch-size", "8", "--steps-per-epoch", "2"])  # fmt: skip
    assert exit_code == 0
    frames = terminal.getvalue().split("\r")
    testing = [frame for frame in frames if "epoch 1/1: testing" in frame]
    assert testing and "2/2" in testing[0], frames
