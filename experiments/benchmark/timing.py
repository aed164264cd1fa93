"""Timing discipline shared by every section.

Each variant is a callable that runs one step and returns something to
block on. `interleaved_samples` warms every variant up, then, round after
round, times a few steps of each back to back (alternating the order every
round): a busy machine's noise falls on every variant alike, so their
ratios hold when absolute times do not. `interleaved_medians` gives the
median seconds per step of each.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import jax


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    """Runs `fn` once; returns its result (ready) and the seconds it took."""
    start = time.perf_counter()
    result = jax.block_until_ready(fn())
    return result, time.perf_counter() - start


def seconds_per_step(
    step: Callable[[], Any], steps: int, synchronize: Callable[[Any], Any] | None = None
) -> float:
    """Seconds per call of `step`, over `steps` calls ending in one sync."""
    synchronize = synchronize or jax.block_until_ready
    start = time.perf_counter()
    result = None
    for _ in range(steps):
        result = step()
    synchronize(result)
    return (time.perf_counter() - start) / steps


def interleaved_samples(
    steps_by_variant: dict[str, Callable[[], Any]],
    rounds: int,
    steps: int,
    warmup: int = 2,
    synchronize: Callable[[Any], Any] | None = None,
) -> dict[str, list[float]]:
    """Seconds per step of each variant in each round, timed interleaved.

    Args:
        steps_by_variant: one callable per variant; each call runs one step
            (and carries its own state, e.g. in a closure).
        rounds: timed rounds, one sample of each variant per round.
        steps: steps per variant per round.
        warmup: untimed steps of each variant before the first round.
        synchronize: waits for a step's result (default: ``block_until_ready``).

    Returns:
        The samples, one per round, by variant.
    """
    if rounds < 1 or steps < 1:
        raise ValueError(f"rounds={rounds} and steps={steps} must both be at least 1.")
    for step in steps_by_variant.values():
        seconds_per_step(step, max(1, warmup), synchronize)
    samples: dict[str, list[float]] = {variant: [] for variant in steps_by_variant}
    order = list(steps_by_variant)
    for round_index in range(rounds):
        for variant in order if round_index % 2 == 0 else reversed(order):
            samples[variant].append(seconds_per_step(steps_by_variant[variant], steps, synchronize))
    return samples


def interleaved_medians(
    steps_by_variant: dict[str, Callable[[], Any]],
    rounds: int,
    steps: int,
    warmup: int = 2,
    synchronize: Callable[[Any], Any] | None = None,
) -> dict[str, float]:
    """Median seconds per step of each variant over `interleaved_samples`' rounds (same arguments)."""
    samples = interleaved_samples(steps_by_variant, rounds, steps, warmup, synchronize)
    return {variant: statistics.median(times) for variant, times in samples.items()}


class StatefulStep:
    """A jitted step ``state, *args -> state, output`` as a no-argument callable.

    Each call feeds the previous state back in (the step may donate it) and
    the next of `inputs` (cycled), so timing loops stay free of bookkeeping.
    """

    def __init__(self, step: Callable, state: Any, inputs: list[tuple]):
        self.step, self.state, self.inputs, self.calls = step, state, inputs, 0

    def __call__(self) -> Any:
        args = self.inputs[self.calls % len(self.inputs)]
        self.calls += 1
        self.state, output = self.step(self.state, *args)
        return self.state, output
