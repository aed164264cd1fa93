"""The oldest JAX release jaxamp supports, checked once when jaxamp is imported.

`pyproject.toml` asks pip for the same lower bound, but an environment can
still hold an older JAX (``pip install --no-deps``, a conda or system
package), on which jaxamp is not tested; the check refuses it with the
command that upgrades it rather than letting it fail later in an untested
way. A JAX newer than the newest tested release is not refused: autocast's
rules are resolved by name when it is applied, so a release that adds or
removes primitives changes which rules apply, never whether jaxamp imports
(`jaxamp._autocast.primitives`).
"""

from __future__ import annotations

import re

import jax

OLDEST = (0, 10, 2)
SUPPORTED = f">={'.'.join(map(str, OLDEST))}"  # as pyproject.toml writes it


def release(version: str) -> tuple[int, ...]:
    """The leading numeric parts of a version string: ``"0.12.0.1"`` -> (0, 12, 0, 1).

    A development or local suffix ends the release (``"0.10.2.dev20260101"``,
    ``"0.10.2+cuda"``, ``"0.11.0rc1"`` -> the numbers before it).
    """
    numbers = []
    for part in version.split("."):
        digits = re.match(r"\d+", part)
        if digits is None:
            break
        numbers.append(int(digits.group()))
        if digits.end() != len(part):
            break
    return tuple(numbers)


def check(version: str = jax.__version__) -> None:
    """Raises ImportError if `version` of JAX is older than jaxamp supports.

    Raises:
        ImportError: naming the installed and the supported releases, and the
            command that installs a supported one.
    """
    if release(version) < OLDEST:
        raise ImportError(
            f"jaxamp needs jax{SUPPORTED}, and this environment has jax {version}, an older release "
            f"jaxamp is not tested on. Upgrade JAX: pip install -U 'jax{SUPPORTED}'"
        )
