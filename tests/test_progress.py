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
    """Losses 10, 20, ..., 60: after step k the bar shows step k-1's loss (a step known to be finished)."""
    shown = []
    with _a_terminal() as terminal:
        progress = Progress(total=6, description="epoch 1/1", enabled=True, batch_size=8)
        for step, loss in enumerate([10.0, 20.0, 30.0, 40.0, 50.0, 60.0], start=1):
            progress.update(step, jnp.float32(loss))
            frame = terminal.getvalue().rsplit("\r", 1)[-1]
            shown.append(re.search(r"loss=([\d.]+)", frame)[1] if "loss=" in frame else None)
            assert re.search(r"img_s=[\d,]+", frame) or step == 1, frame
        progress.close()
    assert shown == [None, "10.0000", "20.0000", "30.0000", "40.0000", "50.0000"]


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
    assert "loss=4.0000" in screen[-1] and "tokens_s=" in screen[-1]


def test_without_a_bar_a_written_line_goes_straight_to_the_log():
    """Off a terminal (or with the bar turned off) `write` is the log alone."""
    logged = []
    progress = Progress(total=4, description="epoch 1/1", enabled=False, batch_size=8)
    progress.update(1, jnp.float32(1.0))
    progress.write("epoch 1/1 | loss 1.0", logged.append)
    progress.close()
    assert logged == ["epoch 1/1 | loss 1.0"]
