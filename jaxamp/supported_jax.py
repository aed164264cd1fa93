"""The JAX releases jaxamp supports, checked once when jaxamp is imported.

`pyproject.toml` asks pip for the same range, but an environment can still
hold an older JAX (``pip install --no-deps``, a conda or system package).
Such a JAX lacks primitives that autocast's rules table names (jax 0.10.0
exports no ``lax.mulhi_p``, ``stack_p``, ``unstack_p`` or ``stage_p``;
0.10.1 no ``lax.mulhi_p``), and the import would otherwise fail deep inside
that table with an ``AttributeError``. A JAX newer than the range is not
refused here: the registry of primitives (`jaxamp.jaxpr_policy.registry`)
says what it cannot read, if anything.
"""

from __future__ import annotations

import re

import jax

OLDEST = (0, 10, 2)
SUPPORTED = f">={'.'.join(map(str, OLDEST))},<0.13"  # as pyproject.toml writes it


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
            f"jaxamp needs jax{SUPPORTED}, and this environment has jax {version}: autocast's rules "
            "name primitives that older releases lack (jax.lax.mulhi_p first appears in 0.10.2). "
            f"Upgrade JAX: pip install -U 'jax{SUPPORTED}'"
        )
