"""A Markdown table, as the measurements write them.

    table(["recipe", "bytes/param", "ms/step"], [["float32", "12.00", "3.1"]])

gives::

    | recipe | bytes/param | ms/step |
    |---|---:|---:|
    | float32 | 12.00 | 3.1 |

The first column is left-aligned and the others right-aligned (figures), unless
`align` says otherwise, one letter per column: ``l`` left, ``r`` right.
Cells are written as given (``str`` of each): the caller formats its figures.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

_RULES = {"l": "---", "r": "---:"}


def table(header: Sequence[str], rows: Iterable[Sequence[object]], align: str | None = None) -> str:
    """The Markdown table of `header` and `rows`, one line each, ending in a newline.

    Raises:
        ValueError: `align` or a row does not have one entry per column.
    """
    align = align or "l" + "r" * (len(header) - 1)
    if len(align) != len(header) or set(align) - set(_RULES):
        raise ValueError(f"align={align!r}: give l or r for each of the {len(header)} columns.")
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(_RULES[letter] for letter in align) + "|"]
    for row in rows:
        if len(row) != len(header):
            raise ValueError(f"a row of {len(row)} cells in a table of {len(header)} columns: {list(row)!r}")
        lines.append("| " + " | ".join(str(cell) for cell in row) + " |")
    return "\n".join(lines) + "\n"
