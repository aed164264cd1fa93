"""Runs the Python examples of a Markdown page, as a reader would, in order.

Every fenced ``python`` (or ``py``) block of a page runs on its own, in a
fresh namespace, as a reader who copies that one block would run it: its
imports are its own. A block that goes on from the one before it says so with
the line ``<!-- continues -->`` just above its fence (nothing but blank lines
between them); it runs in the namespace of the block before it, after it.
The comment is invisible on the rendered page, so the prose around such a
block should say that it goes on. A block's printed output is checked where
the page shows it:

- a fenced ``text`` block right after a ``python`` block (nothing but blank
  lines between them) is what that block prints, compared line by line with
  trailing spaces ignored;
- a ``python`` block written in ``>>>`` style runs as a doctest, each
  ``>>>`` example's output compared with the lines under it.

Fences of other languages (``bash``, ``text`` anywhere else) are not run.
The line numbers of a failure are the page's own.

Why not a plugin: pytest's doctest on Markdown needs every example in
``>>>`` form and knows nothing of fences, and pytest-markdown-docs runs each
fence alone unless marked, and compares no printed output. This module is
the few lines both behaviours need.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import doctest
import io
import pathlib
import re

_FENCE_OPEN = re.compile(r"^(?P<indent> {0,3})(?P<fence>`{3,}|~{3,})\s*(?P<info>[^`\s]*)")

# Above a block's fence: the block goes on from the block before it.
CONTINUES = "<!-- continues -->"


class ExampleFailed(AssertionError):
    """An example of a page raised, or printed something other than the page shows."""


@dataclasses.dataclass(frozen=True)
class Block:
    """One fenced ``python`` block and the output the page shows for it.

    Attributes:
        line: the page's line number of the block's first code line (1-based).
        code: the block's code.
        expected_output: the ``text`` block right after it, or None.
        continues: whether the page marks it as going on from the block
            before it (`CONTINUES` above its fence).
    """

    line: int
    code: str
    expected_output: str | None
    continues: bool = False

    @property
    def is_doctest(self) -> bool:
        """Whether the block is written in ``>>>`` style."""
        return self.code.lstrip().startswith(">>>")


def _fences(markdown: str) -> list[tuple[str, int, int, str]]:
    """Every fenced block as (info, first code line, line after the fence, code)."""
    lines = markdown.splitlines()
    fences = []
    index = 0
    while index < len(lines):
        opening = _FENCE_OPEN.match(lines[index])
        if not opening:
            index += 1
            continue
        fence, indent = opening["fence"], len(opening["indent"])
        body = []
        end = index + 1
        while end < len(lines) and not lines[end].strip().startswith(fence):
            body.append(lines[end][indent:] if lines[end][:indent].isspace() else lines[end])
            end += 1
        fences.append((opening["info"].lower(), index + 2, end + 1, "\n".join(body) + "\n"))
        index = end + 1
    return fences


def python_blocks(markdown: str) -> list[Block]:
    """The page's ``python`` blocks, each with the output shown right after it."""
    lines = markdown.splitlines()
    fences = _fences(markdown)
    blocks = []
    for position, (info, first_line, after, code) in enumerate(fences):
        if info not in ("python", "py"):
            continue
        expected = None
        if position + 1 < len(fences):
            next_info, next_first, _, next_code = fences[position + 1]
            between = lines[after : next_first - 2]
            if next_info == "text" and not any(line.strip() for line in between):
                expected = next_code
        above = [line.strip() for line in lines[: first_line - 2] if line.strip()]
        continues = bool(above) and above[-1] == CONTINUES
        blocks.append(Block(line=first_line, code=code, expected_output=expected, continues=continues))
    return blocks


def _normalized(text: str) -> list[str]:
    return [line.rstrip() for line in text.rstrip().splitlines()]


def _run_doctest(block: Block, namespace: dict, name: str) -> None:
    parser = doctest.DocTestParser()
    test = parser.get_doctest(block.code, namespace, name, name, block.line - 1)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    report = io.StringIO()
    result = runner.run(test, out=report.write, clear_globs=False)
    if result.failed:
        raise ExampleFailed(f"{name}, block at line {block.line}:\n{report.getvalue()}")


def run_block(block: Block, namespace: dict, name: str) -> None:
    """Runs one block in `namespace`; raises ExampleFailed on any failure.

    The code is compiled under the page's name, padded so that a traceback's
    line numbers are the page's.
    """
    if block.is_doctest:
        _run_doctest(block, namespace, name)
        return
    code = compile("\n" * (block.line - 1) + block.code, name, "exec")
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            exec(code, namespace)  # noqa: S102 - running the page's examples is the point
    except Exception as error:
        raise ExampleFailed(
            f"{name}, block at line {block.line} raised {type(error).__name__}: {error}"
        ) from error
    if block.expected_output is not None:
        shown, got = _normalized(block.expected_output), _normalized(printed.getvalue())
        if shown != got:
            diff = "\n".join(difflib.unified_diff(shown, got, "shown on the page", "printed", lineterm=""))
            raise ExampleFailed(f"{name}, block at line {block.line} printed other output:\n{diff}")


def run_page(markdown: str, name: str) -> int:
    """Runs every ``python`` block of a page in order, each in a fresh namespace unless it continues.

    Args:
        markdown: the page's text.
        name: the page's path, used in tracebacks and messages.

    Returns:
        The number of blocks run.

    Raises:
        ExampleFailed: a block raised, or printed other output than the page
            shows, or the page's first block is marked as continuing.
    """
    blocks = python_blocks(markdown)
    namespace: dict = {}
    for position, block in enumerate(blocks):
        if not block.continues:
            namespace = {"__name__": "__main__"}
        elif position == 0:
            raise ExampleFailed(
                f"{name}, block at line {block.line} is marked {CONTINUES!r} but no block comes before it: "
                "remove the mark"
            )
        run_block(block, namespace, name)
    return len(blocks)


def run_file(path: pathlib.Path, name: str | None = None) -> int:
    """`run_page` on a file."""
    return run_page(path.read_text(encoding="utf-8"), name or str(path))
