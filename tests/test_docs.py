"""The documentation: every example runs as written, and the site builds strict, offline.

Each page's ``python`` blocks run in order, each on its own unless the page
marks it as going on from the block before it (``<!-- continues -->``), their
printed output compared with the page where it shows it
(`markdown_examples`); a deliberately broken example must fail that run.
The site builds with ``mkdocs build --strict``, so a broken link, a missing
page or an unresolved API reference fails the suite.
"""

import functools
import html.parser
import importlib
import importlib.util
import os
import pathlib
import re
import subprocess
import sys
import textwrap

import pytest
from fresh_processes import FreshProcess, xla_flags
from markdown_examples import ExampleFailed, python_blocks, run_file, run_page

import jaxamp

REPO = pathlib.Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
PAGES_WITH_EXAMPLES = [page for page in PAGES if python_blocks(page.read_text(encoding="utf-8"))]


@pytest.fixture(autouse=True)
def _run_from_the_repository_root(monkeypatch):
    """The examples import `experiments` from the repository root, as a reader's do."""
    monkeypatch.chdir(REPO)
    monkeypatch.syspath_prepend(str(REPO))


@pytest.mark.parametrize("page", PAGES_WITH_EXAMPLES, ids=lambda page: str(page.relative_to(REPO)))
def test_every_example_of_the_page_runs_and_prints_what_the_page_shows(page):
    """Fails when an example raises or a shown figure (a GFLOPs count, a dtype) changes."""
    assert run_file(page, str(page.relative_to(REPO))) > 0


BROKEN_EXAMPLES = {
    "a name the page never defines": """
        ```python
        print(undefined_model)
        ```
        """,
    "printed output other than the page shows": """
        ```python
        print(1 + 1)
        ```

        ```text
        3
        ```
        """,
    "a doctest whose output differs": """
        ```python
        >>> 2 * 2
        5
        ```
        """,
    "a name defined on another page": """
        ```python
        print(defined_on_the_first_page)
        ```
        """,
    "a name from the block before, without the continues mark": """
        ```python
        width = 3
        ```

        ```python
        print("x" * width)
        ```
        """,
    "the continues mark on a page's first block": """
        <!-- continues -->
        ```python
        print(1)
        ```
        """,
}


@pytest.mark.parametrize("markdown", BROKEN_EXAMPLES.values(), ids=BROKEN_EXAMPLES.keys())
def test_a_broken_example_fails_the_run(markdown):
    """The runner's negative case: each broken page must raise, naming the page and the block.

    A runner that ignored output, swallowed exceptions or leaked one page's
    namespace into the next would let one of these pass.
    """
    run_page("```python\ndefined_on_the_first_page = 1\n```\n", "first.md")
    with pytest.raises(ExampleFailed, match=r"broken\.md, block at line \d+"):
        run_page(textwrap.dedent(markdown).lstrip("\n"), "broken.md")


def test_a_block_marked_continues_runs_after_the_block_before_it_and_its_output_is_compared():
    """Fails if the runner misses a block, ignores the mark, or lets an unmarked block see an earlier one."""
    page = textwrap.dedent(
        """
        ```python
        width = 3
        ```

        Between two blocks, prose.

        <!-- continues -->
        ```python
        print("x" * width)
        ```

        ```text
        xxx
        ```

        <!-- continues -->

        ```python
        >>> width + 1
        4
        ```

        ```python
        print("width" in dir())
        ```

        ```text
        False
        ```
        """
    )
    assert run_page(page, "page.md") == 4


# The reference: one page per public namespace.
REFERENCE = {"jaxamp": "jaxamp.md", "jaxamp.fp8": "fp8.md", "jaxamp.fsdp": "fsdp.md", "jaxamp.diagnostics": "diagnostics.md"}


def _reference_page(namespace: str) -> str:
    return (REPO / "docs" / "reference" / REFERENCE[namespace]).read_text(encoding="utf-8")


def _summary_names(page: str) -> list[str]:
    """The names of the summary table that opens a reference page: its first table, before any entry."""
    before_entries = page.split("\n::: ", 1)[0]
    rows = [line for line in before_entries.splitlines() if line.startswith("| [`")]
    return [re.match(r"\| \[`(\w+)", row)[1] for row in rows]


@pytest.mark.parametrize("namespace", REFERENCE)
def test_each_reference_page_opens_with_one_line_for_every_public_name_and_enters_only_public_ones(namespace):
    """The summary omitted low_precision_optimizer and optimizer_for_policy; an entry for a name
    that is not public (a private helper) fails too. Every name's entry is checked by
    tests/test_public_api.py."""
    page = _reference_page(namespace)
    public = importlib.import_module(namespace).__all__
    summary = _summary_names(page)
    assert sorted(summary) == sorted(public) and len(summary) == len(set(summary))
    entered = set(re.findall(rf"^::: {re.escape(namespace)}\.(\w+)$", page, re.MULTILINE))
    assert sorted(entered - set(public)) == []


def test_a_summary_table_that_misses_a_name_is_caught():
    """The check's negative case: a name left out of the summary, or listed only after the entries."""
    page = "# `jaxamp.fsdp`\n\n| name | what |\n|---|---|\n| [`is_narrower(a, b)`](#x) | ... |\n\n::: jaxamp.fsdp.is_narrower\n"
    assert _summary_names(page) == ["is_narrower"]
    late = "# `jaxamp.fsdp`\n\n::: jaxamp.fsdp.is_narrower\n\n| [`is_narrower`](#x) | ... |\n"
    assert _summary_names(late) == []


def test_every_relative_link_of_the_readme_leads_to_a_file():
    """The README is not part of the site, so its links are checked here."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    readme = re.sub(r"^```.*?^```", "", readme, flags=re.MULTILINE | re.DOTALL)
    targets = re.findall(r"\]\(([^)\s]+)\)", readme)
    relative = [t.split("#")[0] for t in targets if not re.match(r"^[a-z]+:", t) and not t.startswith("#")]
    assert relative, "the README links into the docs"
    assert [t for t in relative if not (REPO / t).exists()] == []


@functools.cache
def _hook(name: str):
    """One of the site's hooks (docs/_hooks/NAME.py), loaded as the build loads it."""
    spec = importlib.util.spec_from_file_location(name, REPO / "docs" / "_hooks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# The pages written for developers: the development page and its notes under docs/dev/.
DEVELOPER_PAGES = [REPO / "docs" / "development.md", *sorted((REPO / "docs" / "dev").rglob("*.md"))]
# Every other page a user reads: the README, the site's pages, and the results folder's tables (the site
# publishes those its pages link).
RESULTS_TABLES = sorted((REPO / "results").rglob("*.md"))
USER_PAGES = [page for page in PAGES if page not in DEVELOPER_PAGES] + RESULTS_TABLES


def _links_into_the_tests(markdown: str, page: pathlib.Path) -> list[str]:
    """The page's links (inline or reference-style, outside code blocks) to a file under tests/,
    found as the site's build finds a link out of the docs folder."""
    page_uri = pathlib.Path(os.path.relpath(page, REPO / "docs")).as_posix()
    targets = _hook("source_files")._outside_targets(markdown, page_uri)
    return sorted(target for target in targets if target.startswith("../tests/"))


def test_no_user_page_links_a_test_file():
    """User pages are for users: a claim the tests check says so in words, a figure names its
    command and results folder; the tests behind each claim are listed in docs/dev/tested-claims.md."""
    linking = {
        str(page.relative_to(REPO)): links
        for page in USER_PAGES
        if (links := _links_into_the_tests(page.read_text(encoding="utf-8"), page))
    }
    assert linking == {}


def test_a_link_into_the_tests_is_caught_wherever_a_page_lies_and_a_command_is_not():
    """The check's negative case: an inline and a reference-style link from the README, a guide and
    a results table are caught; a file named in backticks and a command in a code block are no links."""
    for page, target in [
        (REPO / "README.md", "tests/test_grads.py"),
        (REPO / "docs" / "guides" / "flax.md", "../../tests/test_grads.py"),
        (REPO / "results" / "question" / "table.md", "../../tests/test_grads.py#L3"),
    ]:
        for link in (f"The [test]({target}).", f"The [test][t].\n\n[t]: {target}\n"):
            assert _links_into_the_tests(link, page) == ["../tests/test_grads.py"], (page, link)
    named = "`tests/test_fp8.py`\n\n```bash\npytest tests/test_fp8.py  # [t](tests/test_fp8.py)\n```\n"
    assert _links_into_the_tests(named, REPO / "README.md") == []


# Every proxy points at a closed port, and no host bypasses them: no fetch can succeed.
OFFLINE = {
    **{name: "http://127.0.0.1:9" for name in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY",
                                              "ALL_PROXY", "all_proxy")},
    "NO_PROXY": "",
    "no_proxy": "",
    "NO_MKDOCS_2_WARNING": "1",
}  # fmt: skip


def _mkdocs_build(config: pathlib.Path, site: pathlib.Path) -> subprocess.CompletedProcess:
    """`mkdocs build --strict`, offline."""
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(config), "--site-dir", str(site)],
        check=False,
        cwd=config.parent,
        env={**os.environ, **OFFLINE},
        capture_output=True,
        text=True,
        timeout=300,
    )


# The project's site, built from the repository root (where mkdocs.yml is) in the
# background while the examples run (tests/fresh_processes.py).
SITE = FreshProcess(
    "site_build", "-m", "mkdocs", "build", "--strict", "--config-file", str(REPO / "mkdocs.yml"),
    "--site-dir", "{dir}/site", env=OFFLINE, timeout=300,
)  # fmt: skip


@pytest.fixture
def site_build():
    """The finished build of the project's site and the folder it wrote."""
    return SITE.result(), pathlib.Path(SITE.directory) / "site"


def test_the_documentation_site_builds_in_strict_mode_offline(site_build):
    """Fails on a broken link or anchor, a page missing from the nav, an unknown API entry, a fetch."""
    build, site = site_build
    assert build.returncode == 0, build.stderr
    assert all((site / "reference" / page.removesuffix(".md") / "index.html").is_file() for page in REFERENCE.values())
    # The evidence the pages link to is published beside them.
    assert (site / "_source" / "tests" / "test_grads.py").is_file()


class _ProseOfTheApiPage(html.parser.HTMLParser):
    """Collects a page's blockquotes and the text that stands outside code blocks.

    Attributes:
        blockquotes: how many ``<blockquote>`` elements the page holds.
        prose: the text outside every ``<pre>`` and ``<code>`` element.
    """

    def __init__(self):
        super().__init__()
        self.blockquotes = 0
        self.prose: list[str] = []
        self._code_depth = 0

    def handle_starttag(self, tag, attrs):
        self.blockquotes += tag == "blockquote"
        self._code_depth += tag in ("pre", "code")

    def handle_endtag(self, tag):
        self._code_depth -= tag in ("pre", "code") and self._code_depth > 0

    def handle_data(self, data):
        if not self._code_depth:
            self.prose.append(data)


def _garbled_examples(page_html: str) -> tuple[int, list[str]]:
    """The blockquotes of a rendered page, and its prose lines that hold a ``>>>`` example."""
    parser = _ProseOfTheApiPage()
    parser.feed(page_html)
    lines = "".join(parser.prose).splitlines()
    return parser.blockquotes, [line.strip() for line in lines if ">>>" in line]


def test_a_docstring_example_rendered_as_prose_is_caught():
    """The check's negative case: an ``Example:`` section renders its ``>>>`` lines as blockquotes."""
    garbled = "<p>Example:</p><blockquote><blockquote><blockquote><p>x = 1</p></blockquote></blockquote></blockquote>"
    assert _garbled_examples(garbled) == (3, [])
    assert _garbled_examples("<p>&gt;&gt;&gt; x = 1</p>") == (0, [">>> x = 1"])
    highlighted = '<div class="highlight"><pre><span></span><code><span class="o">&gt;&gt;&gt;</span> x</code></pre></div>'
    assert _garbled_examples(highlighted) == (0, [])


def _api_headings(page_html: str) -> list[str]:
    """The name in each mkdocstrings heading of the API page (signature and labels left out)."""
    headings = re.findall(r'<h\d id="[^"]*" class="doc doc-heading">(.*?)<a href=', page_html, re.DOTALL)
    names = []
    for heading in headings:
        text = html.unescape(re.sub(r"<[^>]+>", "", heading)).strip()
        names.append(text.split()[0].split("(", 1)[0])  # without a label such as "dataclass"
    return names


def _reference_html(site: pathlib.Path) -> dict[str, str]:
    return {
        namespace: (site / "reference" / page.removesuffix(".md") / "index.html").read_text(encoding="utf-8")
        for namespace, page in REFERENCE.items()
    }


def test_the_api_reference_renders_each_public_name_once_as_itself(site_build):
    """`::: jaxamp.loss_scaling` rendered the module of that name, not the function: an internal
    helper (require_skip_counting) in the reference, LossScalingState and loss_scale_of twice.
    A value two namespaces export (jaxamp.fp8.fp8_dot_general is jaxamp.fp8_dot_general) is
    rendered once, under the first namespace that exports it. Also: no reST ``::`` shown as
    text, and each page's summary table has no empty header row."""
    build, site = site_build
    assert build.returncode == 0, build.stderr
    pages = _reference_html(site)
    headings = [heading for page in pages.values() for heading in _api_headings(page)]
    public, seen = [], []
    # jaxamp.fp8.FP8_FALLBACK_REASONS is entered as jaxamp.diagnostics.FP8_FALLBACK_REASONS.
    for namespace in ("jaxamp", "jaxamp.diagnostics", "jaxamp.fsdp", "jaxamp.fp8"):
        module = importlib.import_module(namespace)
        for name in module.__all__:
            value = getattr(module, name)
            if not any(value is other for other in seen):
                public.append(f"{namespace}.{name}")
                seen.append(value)
    assert {name: headings.count(name) for name in public if headings.count(name) != 1} == {}
    for page in pages.values():
        assert "require_skip_counting" not in page
        parser = _ProseOfTheApiPage()
        parser.feed(page)
        assert [line for line in "".join(parser.prose).splitlines() if re.search(r"(?<!:)::(?!:)", line)] == []
        first_header = re.search(r"<thead>(.*?)</thead>", page, re.DOTALL)[1]
        assert all(cell.strip() for cell in re.findall(r"<th[^>]*>(.*?)</th>", first_header, re.DOTALL))


def test_every_example_of_the_api_reference_renders_as_code(site_build):
    """Fails when a docstring's section name is one the parser does not know (``Example:``).

    mkdocstrings' Google parser renders an ``Examples:`` section as highlighted
    code; under any other name the ``>>>`` lines become nested blockquotes
    run together into one paragraph, which ``--strict`` lets through.
    """
    build, site = site_build
    assert build.returncode == 0, build.stderr
    pages = sorted((site / "reference").rglob("*.html"))
    assert pages
    garbled = {}
    for page in pages:
        blockquotes, prose_examples = _garbled_examples(page.read_text(encoding="utf-8"))
        if blockquotes or prose_examples:
            garbled[str(page.relative_to(site))] = (blockquotes, prose_examples)
    assert garbled == {}
    # The examples are there, as code: one per Examples section of the public API.
    assert sum(page.count("&gt;&gt;&gt;") for page in _reference_html(site).values()) >= 10


@pytest.mark.parametrize(
    ("target", "builds"), [("../tests/test_grads.py", True), ("../tests/test_that_does_not_exist.py", False)]
)
def test_a_link_into_the_repository_builds_only_when_its_file_exists(tmp_path, target, builds):
    """The docs hook publishes linked repository files, and leaves a missing one for strict mode to fail."""
    project = tmp_path / "project"
    (project / "docs").mkdir(parents=True)
    (project / "tests").mkdir()
    (project / "tests" / "test_grads.py").write_text("")
    (project / "docs" / "index.md").write_text(f"# Page\n\nThe [evidence]({target}).\n")
    (project / "mkdocs.yml").write_text(
        f"site_name: t\nnav: [index.md]\nhooks: [{REPO / 'docs' / '_hooks' / 'source_files.py'}]\n"
    )
    build = _mkdocs_build(project / "mkdocs.yml", tmp_path / "site")
    assert (build.returncode == 0) == builds, build.stderr
    if not builds:
        assert "test_that_does_not_exist.py" in build.stderr


def _commands(script: str) -> list[str]:
    """A shell text's command lines: comments and blank lines dropped."""
    lines = [line.split(" #", 1)[0].strip() for line in script.splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


def test_ci_installs_exactly_as_the_readmes_set_up_does():
    """Fails when the README's set-up command and `.ci/run`'s drift apart, or the set-up gets noisy."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    set_up = readme.split("## Set up", 1)[1]
    set_up_block = re.search(r"```bash\n(.*?)```", set_up, re.DOTALL)[1]
    assert _commands(set_up_block) == ["bash scripts/setup.sh"]
    ci = _commands((REPO / ".ci" / "run").read_text(encoding="utf-8"))
    # CI adds the optional TensorFlow group (the README names it) for the tests of TFDS preparing CIFAR-10.
    assert ci[ci.index("bash scripts/setup.sh") + 1 :] == [
        ".venv/bin/pip install -q --group tensorflow",
        ".venv/bin/python -m pytest",
    ]
    assert "--group tensorflow" in set_up
    script = _commands((REPO / "scripts" / "setup.sh").read_text(encoding="utf-8"))
    installs = [line for line in script if "pip install" in line]
    assert installs and all(" -q " in line for line in installs), installs
    assert any("--group experiments --group test" in line for line in installs)


def test_a_continued_example_says_so_on_the_rendered_page(site_build):
    """The ``<!-- continues -->`` mark was invisible on the site: a reader copying such a block alone
    lacked the names of the block before it, with nothing on the page to say so."""
    build, site = site_build
    assert build.returncode == 0, build.stderr
    shown = "Continues the example above: run it after that one, in the same Python session."
    marked = {page: page.read_text(encoding="utf-8").count("\n<!-- continues -->\n") for page in PAGES}
    for page, marks in marked.items():
        if page.name == "README.md" or not marks:
            continue
        relative = page.relative_to(REPO / "docs").with_suffix("")
        html_page = site / relative / "index.html" if relative.name != "index" else site / "index.html"
        rendered = html_page.read_text(encoding="utf-8")
        assert rendered.count(shown) == marks, relative
        assert not re.search(re.escape(shown) + r"</em></p>\s*<p>", rendered), "not right above its code"
    assert sum(marked.values()) >= 30


def test_the_nnx_recipe_runs_verbatim_from_an_empty_folder(tmp_path):
    """docs/guides/flax.md's NNX train step needs the library alone: run from an empty folder,
    with only jaxamp importable beside the installed packages (no `experiments`)."""
    page = (REPO / "docs" / "guides" / "flax.md").read_text(encoding="utf-8")
    section = page.split("## Training an NNX model")[1]
    recipe = python_blocks(section)[0]
    assert not recipe.continues and recipe.expected_output
    library, empty = tmp_path / "library", tmp_path / "empty"
    library.mkdir()
    empty.mkdir()
    (library / "jaxamp").symlink_to(REPO / "jaxamp")
    process = subprocess.run(
        [sys.executable, "-c", recipe.code], check=False, cwd=empty, capture_output=True, text=True,
        timeout=600, env={**os.environ, "PYTHONPATH": str(library), "XLA_FLAGS": xla_flags()},
    )  # fmt: skip
    assert process.returncode == 0, process.stderr[-3000:]
    assert process.stdout.splitlines() == recipe.expected_output.splitlines()
    assert os.listdir(empty) == []


def test_the_pages_write_the_projects_commands_as_the_readme_does():
    """The experiments, the tests and the site run from the set-up's venv, `.venv/bin/python -m ...`,
    as the README writes them; guides wrote a bare `python` or `pytest`, another Python than the
    set-up's. The changelog (history) and docs/dev (runs in copies of the repository) are left out."""
    bare = re.compile(r"^(python3? -m (experiments|pytest|mkdocs|mutmut)\b|pytest |mkdocs (build|serve)|python3? -c )")
    fence = re.compile(r"^```(\w*)\n(.*?)^```", re.MULTILINE | re.DOTALL)
    found = []
    for page in PAGES:
        if page.name == "changelog.md" or "dev" in page.relative_to(REPO).parts:
            continue
        text = page.read_text(encoding="utf-8")
        lines = [line.strip() for match in fence.finditer(text) if match[1] == "bash"
                 for line in match[2].splitlines()]  # fmt: skip
        lines += re.findall(r"`([^`]+)`", fence.sub("", text).replace("\n", " "))
        found += [f"{page.relative_to(REPO)}: {line}" for line in lines if bare.match(line.strip())]
    assert found == [], found
