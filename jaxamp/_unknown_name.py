"""One job: the message for a mistyped name, with the nearest valid one.

``unknown precision policy 'mixed_flaot16'. Did you mean mixed_float16? Choose one of: ...``

The library (`jaxamp.get_policy`) and the experiments' flags (``--precision``,
``--model``) answer a mistyped name with this one message. It imports nothing
but the standard library, so that the flags can read it before JAX loads:
`experiments.flags` loads this file by its path, without running jaxamp's
``__init__``.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence


def nearest_name(text: str, names: Sequence[str]) -> str | None:
    """The name of `names` closest to `text` (case and spaces ignored), or None where none is close."""
    nearest = difflib.get_close_matches("".join(text.split()).lower(), names, n=1, cutoff=0.6)
    return nearest[0] if nearest else None


def unknown_name(what: str, text: str, names: Sequence[str], listing: str | None = None) -> str:
    """The message for a name that is none of `names`: the nearest one, then the valid ones.

    ``unknown model 'resnet19'. Did you mean resnet18? Choose one of: mobilenetv2, resnet101, ...``

    Args:
        what: what a name names (``model``).
        text: the name as given.
        names: the valid names, searched for the nearest.
        listing: the valid names as a few lines of their own, grouped (default: `names`
            comma-separated, on the message's line).
    """
    nearest = nearest_name(text, names)
    hint = f" Did you mean {nearest}?" if nearest else ""
    choices = f":\n{listing}" if listing else f": {', '.join(names)}"
    return f"unknown {what} {text!r}.{hint} Choose one of{choices}"
