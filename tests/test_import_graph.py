"""The import graph of Ravex's three packages has no circle (issue 30).

The graph is read from the source with ``ast``; no module is imported. Every
import counts: at the top of a module, inside a function, and under
``if TYPE_CHECKING``. A circle of type hints is a circle a reader has to follow
all the same. Relative imports are resolved against the importing module's
package.
"""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import REPO, run_without_torch

PACKAGES = ("ravex", "ravex_convert", "ravex_runtime")


def modules() -> dict[str, Path]:
    """Every module of the packages by its dotted name (a package by its own name, for its ``__init__``);
    a compiled module by its stub (``ravex_convert/_core.pyi``)."""
    out: dict[str, Path] = {}
    for pkg in PACKAGES:
        for path in sorted([*(REPO / pkg).rglob("*.py"), *(REPO / pkg).rglob("*.pyi")]):
            parts = path.relative_to(REPO).with_suffix("").parts
            out.setdefault(".".join(parts[:-1] if parts[-1] == "__init__" else parts), path)
    return out


def _known(name: str, known: dict[str, Path]) -> str | None:
    """The module ``name`` imports: itself, or the nearest package above it that is ours."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The modules of the packages that module ``name`` imports anywhere in its source."""
    here = name if path.name == "__init__.py" else name.rpartition(".")[0]  # where relative imports start
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            out.update(t for a in node.names if (t := _known(a.name, known)) is not None)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                base = f"{base}.{node.module}" if node.module else base
            else:
                base = node.module or ""
            for a in node.names:
                # ``from pkg import sub``: the submodule when there is one, else the module the name is in
                t = f"{base}.{a.name}" if f"{base}.{a.name}" in known else _known(base, known)
                if t is not None:
                    out.add(t)
    out.discard(name)
    return out


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """One circle through each group of modules that reach each other (Tarjan's strongly connected
    components), as a list of modules that starts and ends with the same one."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    groups: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(g.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group: set[str] = set()
            while True:
                w = stack.pop()
                on.discard(w)
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(group)

    for v in sorted(g):
        if v not in index:
            visit(v)
    out = []
    for group in groups:
        start = min(group)
        # the shortest way back to start inside the group (breadth first)
        prev: dict[str, str] = {}
        todo, found = [start], None
        while todo and found is None:
            nxt = []
            for v in todo:
                for w in sorted(g[v] & group):
                    if w == start:
                        found = v
                        break
                    if w not in prev:
                        prev[w] = v
                        nxt.append(w)
                if found is not None:
                    break
            todo = nxt
        assert found is not None
        path = [found]
        while path[-1] != start:
            path.append(prev[path[-1]])
        out.append([start, *reversed(path[:-1]), start])
    return out


def test_the_graph_is_read() -> None:
    # not vacuous: the packages are found, and relative imports (module-level and function-local) resolved
    g = graph()
    assert {"ravex", "ravex.cli", "ravex_convert.convert", "ravex_convert._core", "ravex_runtime.session"} <= g.keys()
    assert "ravex_runtime.config" in g["ravex_runtime.session"]  # from .config import ... (relative)
    assert "ravex_runtime.runtime" in g["ravex_runtime.api"]  # imported inside train_loop's runner
    assert "ravex_runtime.status" in g["ravex.cli"]  # imported inside a command


def test_the_cycle_finder_names_a_circle() -> None:
    g = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e2"}, "e2": {"e"}}
    assert sorted(cycles(g)) == [["a", "b", "c", "a"], ["e", "e2", "e"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circles() -> None:
    found = cycles(graph())
    assert not found, "import circles: " + "; ".join(" -> ".join(c) for c in found)


def test_import_ravex_stays_light() -> None:
    # Session is exported lazily (the packages' __getattr__): naming it is what imports torch
    run_without_torch("import ravex, ravex_runtime\nassert 'Session' in ravex.__all__ and 'Session' in ravex_runtime.__all__")


def test_session_is_exported() -> None:
    import ravex
    import ravex_runtime
    from ravex_runtime.session import Session

    assert ravex.Session is Session and ravex_runtime.Session is Session
    assert "Session" in dir(ravex) and "Session" in dir(ravex_runtime)
