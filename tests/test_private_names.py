"""No module of ``ravex_convert`` reaches into another one's private names (issue 42).

What several modules use is public where it is defined (a shared helper moves to a
module named for it); an underscore means "may move", so no other module may lean
on it. Read from the source with ``ast``, as tests/test_import_graph.py reads the
import graph; no module is imported. Two forms count, anywhere in a module (at the
top, inside a function, under ``if TYPE_CHECKING``):

- ``from m import _name`` (relative or absolute), and
- ``m._name`` through a name an import bound to the module ``m``.

A private *module* (``ravex_convert._core``, ``formats._framework``) is the
package's own and may be imported by any module of it; only the names inside a
module are checked.
"""

from __future__ import annotations

import ast
from pathlib import Path

from test_import_graph import modules

PACKAGE = "ravex_convert"


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _dotted(node: ast.expr) -> str | None:
    """``a.b.c`` for a chain of attributes on a name, else None."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(node.id)
    return ".".join(reversed(parts))


def _base(node: ast.ImportFrom, here: str) -> str:
    """The module a ``from ... import`` reads from, relative imports resolved against ``here``."""
    if not node.level:
        return node.module or ""
    base = here
    for _ in range(node.level - 1):
        base = base.rpartition(".")[0]
    return f"{base}.{node.module}" if node.module else base


def private_uses(name: str, path: Path, known: dict[str, Path]) -> list[str]:
    """``importer:line: module._name`` for each private name of another module of ``known`` that
    module ``name`` (at ``path``) imports or reaches through a module it imported."""
    here = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    bound: dict[str, str] = {}  # a local name -> the module it names
    out: list[str] = []

    def check(module: str, attr: str, line: int) -> None:
        if module in known and module != name and _private(attr) and f"{module}.{attr}" not in known:
            out.append(f"{name}:{line}: {module}.{attr}")

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.asname is not None:
                    bound[a.asname] = a.name
                else:
                    top = a.name.partition(".")[0]
                    bound[top] = top
        elif isinstance(node, ast.ImportFrom):
            base = _base(node, here)
            for a in node.names:
                if f"{base}.{a.name}" in known:
                    bound[a.asname or a.name] = f"{base}.{a.name}"
                else:
                    check(base, a.name, node.lineno)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            chain = _dotted(node.value)
            if chain is None:
                continue
            head, _, rest = chain.partition(".")
            if head in bound:
                check(f"{bound[head]}.{rest}" if rest else bound[head], node.attr, node.lineno)
    return out


def test_the_checker_finds_both_forms(tmp_path: Path) -> None:
    # not vacuous: each form is found, and what is allowed is let through
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    files = {
        "pkg/__init__.py": "",
        "pkg/_private_mod.py": "def _hidden(): ...\n",
        "pkg/other.py": "def _helper(): ...\ndef shared(): ...\n",
        "pkg/sub/__init__.py": "",
        "pkg/sub/user.py": (
            "from ..other import _helper, shared\n"                  # line 1: a private name, relative
            "from .. import _private_mod\n"                           # line 2: a private module: allowed
            "import pkg.other\n"                                      # line 3
            "from .. import other as o\n"                             # line 4
            "def f():\n"
            "    from pkg.other import _helper as h\n"                # line 6: inside a function, absolute
            "    return o._helper, pkg.other._helper, _private_mod._hidden, _own, o.__name__\n"  # line 7: three
            "def _own(): ...\n"
        ),
    }
    for rel, text in files.items():
        (tmp_path / rel).write_text(text)
    known = {"pkg": pkg / "__init__.py", "pkg._private_mod": pkg / "_private_mod.py", "pkg.other": pkg / "other.py",
             "pkg.sub": pkg / "sub" / "__init__.py", "pkg.sub.user": pkg / "sub" / "user.py"}
    found = private_uses("pkg.sub.user", known["pkg.sub.user"], known)
    assert sorted(found) == sorted([
        "pkg.sub.user:1: pkg.other._helper",
        "pkg.sub.user:6: pkg.other._helper",
        "pkg.sub.user:7: pkg.other._helper",
        "pkg.sub.user:7: pkg.other._helper",
        "pkg.sub.user:7: pkg._private_mod._hidden",
    ])
    assert private_uses("pkg.other", known["pkg.other"], known) == []


def test_no_module_uses_another_modules_private_name() -> None:
    known = modules()
    ours = {name: path for name, path in known.items() if name == PACKAGE or name.startswith(PACKAGE + ".")}
    assert {"ravex_convert.formats.torch_save", "ravex_convert.formats._framework", "ravex_convert._core"} <= ours.keys()
    found = [use for name, path in sorted(ours.items()) for use in private_uses(name, path, ours)]
    assert not found, ("private names used from another module (make the name public where it is defined, "
                       "or move what several modules share to a module of its own):\n" + "\n".join(found))
