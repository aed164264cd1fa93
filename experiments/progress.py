"""The progress bar inside an epoch: on a terminal only.

In a log file or a pipe a bar's carriage-return frames are noise, so there
each epoch prints just its one summary line (see `experiments.results`).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

import jax

from experiments.distributed import host_value


def bar_wanted(enabled: bool) -> bool:
    """Whether to draw a bar: asked for, and stderr is a terminal."""
    return enabled and sys.stderr.isatty()


class Progress:
    """A per-epoch progress bar showing one step's loss and images/s.

    The loss shown (``step_loss``: one step's, not a mean) is that of a step
    dispatched at the previous refresh, long finished by now, so reading it
    never waits for the device to drain its queue of steps. The rate counts
    only finished steps, timed from the first step seen to finish: dispatch
    is asynchronous, so a clock started at the first dispatch would divide
    queued, unfinished steps by a short time (the first rate was 50-1000x too
    high). No rate is shown until two refreshes have finished. A line logged
    while the bar is drawn goes through `write`, so that it never joins the
    bar's line.
    """

    def __init__(
        self,
        total: int,
        description: str,
        enabled: bool,
        batch_size: int,
        initial: int = 0,
        rate_name: str = "img_s",
    ):
        self._bar = None
        if bar_wanted(enabled):
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total, initial=initial, desc=description, leave=False, unit="step")
        self._batch_size = batch_size  # examples per step: images, or tokens (rate_name="tokens_s")
        self._rate_name = rate_name
        self._pending: tuple[int, jax.Array] | None = None
        self._first_finished: tuple[int, float] | None = None  # (step, when it was seen finished)
        self._refresh_every = max(1, total // 50)

    def update(self, step: int, loss: jax.Array) -> None:
        if self._bar is None:
            return
        self._bar.update(1)
        if step % self._refresh_every:
            return
        if self._pending is not None:
            finished_step, finished_loss = self._pending
            postfix = {"step_loss": f"{float(host_value(finished_loss)):.4f}"}  # waits for that step
            now = time.perf_counter()
            if self._first_finished is None:
                self._first_finished = (finished_step, now)
            else:
                first_step, first_time = self._first_finished
                rate = (finished_step - first_step) * self._batch_size / (now - first_time)
                postfix[self._rate_name] = f"{rate:,.0f}"
            self._bar.set_postfix(postfix)
        self._pending = (step, loss)

    def describe(self, description: str) -> None:
        """Replaces the bar's description (the CIFAR epoch's bar says ``testing`` during the test pass)."""
        if self._bar is not None:
            self._bar.set_description(description)

    def write(self, line: str, log: Callable[[str], None] = print) -> None:
        """Logs `line` with `log` on a line of its own, the bar drawn again below it.

        The bar is cleared first, as ``tqdm.write`` does; without a bar this is
        ``log(line)``.
        """
        if self._bar is None:
            log(line)
            return
        with self._bar.external_write_mode():
            log(line)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
