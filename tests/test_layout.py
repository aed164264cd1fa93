"""The package's layout: one home per idea, private paths marked, imports that only run down.

Read from the source (no import runs): every ``import`` and ``from ... import``
of a jaxamp module, at any depth of a function, is an edge of the graph.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = REPO_ROOT / "jaxamp"
PUBLIC_NAMESPACES = ("diagnostics", "fp8", "fsdp")


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(REPO_ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: pathlib.Path, known: set[str]) -> set[str]:
    """The modules of `known` that `path` imports (``from package import module`` included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in known)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                if submodule in known:  # ``from package import module``: the module alone
                    found.add(submodule)
                elif node.module in known:
                    found.add(node.module)
    return found


def import_graph(root: pathlib.Path) -> dict[str, set[str]]:
    paths = sorted(root.rglob("*.py"))
    known = {module_name(path) for path in paths}
    return {module_name(path): imported_modules(path, known) - {module_name(path)} for path in paths}


def cycle_in(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as the list of its nodes, or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for successor in sorted(graph.get(node, ())):
            if state.get(successor) == 1:
                return stack[stack.index(successor):] + [successor]
            if successor not in state and (found := visit(successor)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def room_of(module: str) -> str:
    """The top-level module or folder of jaxamp that holds `module` (``jaxamp`` for the face)."""
    parts = module.split(".")
    return ".".join(parts[:2])


def test_no_module_of_jaxamp_imports_one_that_imports_it_back():
    """Fails on any import cycle between jaxamp's modules, a lazy import inside a function included."""
    assert cycle_in(import_graph(PACKAGE)) is None


def test_the_top_level_modules_and_folders_import_each_other_without_a_cycle_on_six_levels_or_fewer():
    """A folder is one room: the rooms form a hierarchy, the public face on top, at most six deep."""
    rooms: dict[str, set[str]] = {}
    for module, imports in import_graph(PACKAGE).items():
        rooms.setdefault(room_of(module), set()).update(room_of(other) for other in imports)
    rooms = {room: imports - {room} for room, imports in rooms.items()}
    assert cycle_in(rooms) is None

    def level(room: str) -> int:
        return 1 + max((level(other) for other in rooms[room]), default=0)

    assert level("jaxamp") <= 6, {room: level(room) for room in rooms}
    # 16 with _unknown_name, the one module of the standard library alone: the commands' flags load
    # it by its path before JAX, so it cannot sit in a room whose other modules import JAX.
    assert len(rooms) - 1 <= 16, sorted(rooms)


@pytest.mark.parametrize("root", ["jaxamp", "experiments"])
def test_no_import_cycle_in_the_repository(root):
    assert cycle_in(import_graph(REPO_ROOT / root)) is None


def test_every_module_but_the_public_namespaces_is_private():
    """The path says what is public: `jaxamp`, `jaxamp.diagnostics`, `jaxamp.fp8`, `jaxamp.fsdp`."""
    public = []
    for path in PACKAGE.rglob("*.py"):
        parts = [part for part in path.relative_to(PACKAGE).with_suffix("").parts if part != "__init__"]
        namespace_face = len(parts) <= 1 and (not parts or parts[0] in PUBLIC_NAMESPACES)
        if not namespace_face and not any(part.startswith("_") for part in parts):
            public.append(str(path.relative_to(REPO_ROOT)))
    assert public == []
