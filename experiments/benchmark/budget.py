"""A time budget that skips, and lists, the work that would not fit.

Work is run in order of importance. Before each piece, the caller states
how long it expects it to take (from what was already measured: a compile
time, a step time); if that no longer fits in what is left, the piece is
skipped with the reason, instead of overrunning.
"""

from __future__ import annotations

import dataclasses
import time


class SkipWork(Exception):
    """Raised inside a piece of work to skip it; the message says why."""


@dataclasses.dataclass
class Budget:
    """Seconds left for the run (``None``: no limit) and what was skipped.

    Attributes:
        seconds: the whole run's budget, or None for no limit.
        skipped: ``{"work": ..., "reason": ...}`` for each skipped piece.
    """

    seconds: float | None = None
    skipped: list[dict[str, str]] = dataclasses.field(default_factory=list)
    start: float = dataclasses.field(default_factory=time.monotonic)

    def remaining(self) -> float:
        if self.seconds is None:
            return float("inf")
        return self.seconds - (time.monotonic() - self.start)

    def require(self, work: str, expected_seconds: float) -> None:
        """Raises `SkipWork` if `work`, expected to take that long, would not fit."""
        left = self.remaining()
        if expected_seconds > left:
            raise SkipWork(
                f"{work}: expected {expected_seconds:.0f}s, {max(left, 0):.0f}s of the budget left"
            )

    def skip(self, work: str, reason: str) -> None:
        """Records a skipped piece of work and says so."""
        self.skipped.append({"work": work, "reason": reason})
        print(f"skipped {work}: {reason}", flush=True)
