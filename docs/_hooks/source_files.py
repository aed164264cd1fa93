"""MkDocs hook: the repository files that the pages link to become part of the site.

The pages cite their evidence by relative links into the repository
(``../../results/...`` from ``docs/results/``, ``../../tests/test_grads.py``
from ``docs/dev/``), so the links work where the Markdown is read in place.
MkDocs only knows files under ``docs/`` and, in strict mode, fails on a link
to anything else. This hook finds every relative
link of every page that leads out of ``docs/`` into the repository, and adds
each target that exists to the site's files (published under ``_source/``),
so MkDocs resolves and checks such links like any other. A link to a file
that does not exist is left alone, and strict mode fails on it as it should.
"""

from __future__ import annotations

import os
import posixpath
import re

from mkdocs.structure.files import File, Files, InclusionLevel

# Inline Markdown links and images: [text](target) or ![alt](target "title").
_LINK = re.compile(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
# Reference-style link definitions: [label]: target
_DEFINITION = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?([^\s>]+)>?", re.MULTILINE)
# Fenced code is not prose: links inside it are not followed.
_FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)


def _outside_targets(markdown: str, page_uri: str) -> set[str]:
    """Relative link targets of one page that lead above the docs folder."""
    targets = set()
    prose = _FENCE.sub("", markdown)
    for target in _LINK.findall(prose) + _DEFINITION.findall(prose):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith(("#", "/")):
            continue
        path = target.split("#", 1)[0]
        resolved = posixpath.normpath(posixpath.join(posixpath.dirname(page_uri), path))
        if resolved.startswith("../"):
            targets.add(resolved)
    return targets


def on_files(files: Files, config) -> Files:
    """Adds each existing repository file that a page links to."""
    docs_dir = config["docs_dir"]
    # A linked Markdown file (a results table) becomes a page whose own links
    # are followed in turn.
    to_read = [(file.src_uri, file.abs_src_path) for file in files.documentation_pages()]
    added: set[str] = set()
    while to_read:
        page_uri, page_path = to_read.pop()
        with open(page_path, encoding="utf-8") as handle:
            targets = _outside_targets(handle.read(), page_uri)
        for src_uri in sorted(targets - added):
            abs_path = os.path.normpath(os.path.join(docs_dir, src_uri))
            if not os.path.isfile(abs_path):
                continue  # left unresolved: strict mode reports the broken link
            added.add(src_uri)
            # Linked tables are pages outside the navigation on purpose.
            inclusion = InclusionLevel.NOT_IN_NAV if src_uri.endswith(".md") else InclusionLevel.INCLUDED
            source = File.generated(config, src_uri, abs_src_path=abs_path, inclusion=inclusion)
            source.dest_uri = "_source/" + re.sub(r"^(\.\./)+", "", source.dest_uri)
            files.append(source)
            if src_uri.endswith(".md"):
                to_read.append((src_uri, abs_path))
    return files


# An API directive (``::: jaxamp.X``) and its indented options.
_API_DIRECTIVE = re.compile(r"^:::.*(?:\n {4}.*)*\n?", re.MULTILINE)
# A link to an entry such a directive renders (``[`Policy`](#jaxamp.Policy)``, ``(jaxamp.md#jaxamp.X)``).
_API_ENTRY_LINK = re.compile(r"\[([^\]]*)\]\((?:[\w-]+\.md)?#jaxamp\.[\w.]+\)")


def on_page_markdown(markdown: str, page, config, files) -> str:
    """A page of the docs folder reached again through a file outside it (the results index links
    to the guides) is a second copy: its API directives are left out, so that each object of the
    API reference is rendered once and cross-references find one page for it, and the links to
    their entries keep their text alone."""
    docs_folder = "../" + os.path.basename(os.path.normpath(config["docs_dir"])) + "/"
    if page.file.src_uri.startswith(docs_folder):
        return _API_ENTRY_LINK.sub(r"\1", _API_DIRECTIVE.sub("", markdown))
    return markdown
