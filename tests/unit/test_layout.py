"""The tree reads like a map: no import circle in ``gateway/`` or ``bench/`` (not even a typed or a lazy
one), no module of the gateway over 500 lines, and the README's layout names every module and nothing that
is gone.

The layers themselves are import-linter's contracts (``[tool.importlinter]`` in pyproject.toml), which CI
runs with ``lint-imports``; this file finds what a layer contract cannot: a circle inside one layer.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "gateway"
MAX_LINES = 500


def _modules(package: Path = PACKAGE) -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its own name, for its ``__init__``)."""
    found = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of the package that ``name`` imports anywhere: at the top, under ``TYPE_CHECKING`` or in a
    function."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                origin = f"{base}.{node.module}" if node.module else base
            else:
                origin = node.module or ""
            # ``from gateway.web import wire`` imports the module gateway.web.wire, not the package.
            submodules = [f"{origin}.{alias.name}" for alias in node.names]
            targets = [m for m in submodules if m in modules]
            if len(targets) < len(submodules):
                targets.append(origin)
        else:
            continue
        for target in targets:
            while target and target not in modules:  # gateway.store.tables.tasks -> gateway.store.tables
                target = target.rpartition(".")[0]
            if target and target != name and "." in target:  # the package's root is no module of its own
                out.add(target)
    return out


def _circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of ``graph``, or ``None``."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)) is not None:
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)) is not None:
            return found
    return None


def test_the_circle_finder_finds_a_circle() -> None:
    assert _circle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _circle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


@pytest.mark.parametrize("package", ["gateway", "bench"])
def test_no_module_of_the_package_imports_another_that_imports_it_back(package: str) -> None:
    modules = _modules(ROOT / package)
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert _circle(graph) is None


def test_no_module_is_longer_than_500_lines() -> None:
    lengths = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py")}
    long = {path: n for path, n in lengths.items() if n > MAX_LINES}
    assert long == {}


def _layout_section() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```\n(.*?)```", section, re.S)
    assert block is not None, "README's Layout section has no tree"
    return block.group(1).splitlines()


def _named_in_layout() -> set[str]:
    """The paths the README's layout tree names, from its indentation (two spaces a level)."""
    named: set[str] = set()
    folders: list[str] = []
    for line in _layout_section():
        match = re.match(r"( *)(\S+)", line)
        if match is None or not re.fullmatch(r"[\w.]+/?|[\w]+(/[\w]+)*/", match.group(2)):
            continue  # a description's continuation line
        depth = len(match.group(1)) // 2
        if len(match.group(1)) > 2 * len(folders) + 2:
            continue  # an indented description, not an entry
        del folders[depth:]
        name = match.group(2)
        path = "/".join([*folders, name.rstrip("/")])
        named.add(path)
        if name.endswith("/"):
            folders.append(name.rstrip("/"))
    return named


def test_the_readme_layout_names_every_module_and_nothing_else() -> None:
    named = _named_in_layout()
    in_tree = {
        str(path.relative_to(ROOT))
        for path in PACKAGE.rglob("*.py")
        if path.name != "__init__.py" and "versions" not in path.parts
    }
    assert in_tree - named == set(), "modules the README's layout does not name"
    gone = {p for p in named if p.endswith(".py") and not (ROOT / p).exists()}
    assert gone == set(), "the README's layout names modules that do not exist"
