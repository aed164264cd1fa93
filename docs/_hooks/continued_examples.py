"""MkDocs hook: an example that goes on from the one before it says so on the rendered page.

A ``python`` block that runs after the block before it, in its namespace, is
marked in the Markdown by the line ``<!-- continues -->`` above its fence
(tests/markdown_examples.py reads the mark). A comment is invisible on the
site, so a reader copying that block alone would miss the names it needs.
This hook puts a visible line in the comment's place on the rendered page;
the Markdown, and the mark the tests read, stay as written.
"""

from __future__ import annotations

import re

MARK = "<!-- continues -->"
SHOWN = (
    '<p class="continues"><em>Continues the example above: run it after that one, in the same '
    "Python session.</em></p>"
)

# The mark on a line of its own, outside fenced code (fences are matched first and kept).
_FENCE_OR_MARK = re.compile(
    r"^(```|~~~).*?^\1[^\n]*$|^[ ]{0,3}" + re.escape(MARK) + r"[ \t]*$", re.MULTILINE | re.DOTALL
)


def shown(markdown: str) -> str:
    """`markdown` with each continues mark replaced by the visible line (and a blank line after it)."""
    return _FENCE_OR_MARK.sub(lambda match: match[0] if match[1] else SHOWN + "\n", markdown)


def on_page_markdown(markdown: str, page, config, files) -> str:
    """The MkDocs event: every page's Markdown before it is rendered."""
    return shown(markdown)
