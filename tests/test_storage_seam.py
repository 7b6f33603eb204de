"""Only the storage package knows the backends (issue 42).

Read from the source with ``ast``, as tests/test_import_graph.py reads the import graph; no
module is imported. Outside ``ravex_convert/storage/`` no module may

- branch on how a location is spelled: compare a string to a scheme (``"s3"``, ``"objdir"``,
  ``"file"``, ``"r2"``), test a prefix or a suffix against one (``"s3://"``, ``"objdir:"``),
  or read a backend's ``scheme``;
- name S3: an identifier (a name, an attribute, an import, a function, a class, an argument)
  with "s3" in it, which is also how S3 state would be held;
- import a backend module of the package (``storage.s3``, ``storage.objdir``, ...).

Strings in messages and docstrings may mention ``s3://`` for users: they branch on nothing.
The compiled module's stub (``_core.pyi``) declares the core's S3 client and is not Python
that runs; the core itself is tested in Rust.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from conftest import REPO

PACKAGES = ("ravex", "ravex_convert", "ravex_runtime")
STORAGE = REPO / "ravex_convert" / "storage"
SCHEMES = {"s3", "r2", "objdir", "file", "local"}
SPELLINGS = ("s3:", "objdir:", "file:")
_S3 = re.compile(r"s3", re.IGNORECASE)
_PREFIX_TESTS = {"startswith", "endswith", "removeprefix", "removesuffix", "partition", "split", "find", "index", "rfind"}
_BACKENDS = {"s3", "s3conf", "objdir", "objstore", "local", "base"}


def _scheme_text(node: ast.AST) -> str | None:
    """The string of ``node`` where it is a scheme or a scheme's spelling (in a tuple too)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        v = node.value
        if v in SCHEMES - {"local", "file"} or v.startswith(SPELLINGS):
            return v
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        for e in node.elts:
            if (t := _scheme_text(e)) is not None:
                return t
    return None


def _identifiers(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Name):
        return [node.id]
    if isinstance(node, ast.Attribute):
        return [node.attr]
    if isinstance(node, ast.alias):
        return [node.name, *([node.asname] if node.asname else [])]
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [node.name]
    if isinstance(node, ast.arg):
        return [node.arg]
    if isinstance(node, ast.keyword) and node.arg:
        return [node.arg]
    if isinstance(node, (ast.Global, ast.Nonlocal)):
        return list(node.names)
    if isinstance(node, ast.ImportFrom) and node.module:
        return [node.module]
    return []


def _module(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def findings(source: str, name: str) -> list[str]:
    """What module ``name`` (its ``source``) does that only the storage package may do."""
    here = name.rpartition(".")[0]
    out: list[str] = []
    for node in ast.walk(ast.parse(source)):
        line = getattr(node, "lineno", 0)
        out += [f"{name}:{line}: names {i!r}" for i in _identifiers(node) if _S3.search(i)]
        if isinstance(node, ast.Compare):
            for side in [node.left, *node.comparators]:
                if (t := _scheme_text(side)) is not None:
                    out.append(f"{name}:{line}: compares with the scheme {t!r}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _PREFIX_TESTS:
            for arg in node.args:
                if (t := _scheme_text(arg)) is not None:
                    out.append(f"{name}:{line}: {node.func.attr}({t!r})")
        elif isinstance(node, ast.Attribute) and node.attr == "scheme":
            out.append(f"{name}:{line}: reads a backend's scheme")
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = here
                for _ in range(node.level - 1):
                    pkg = pkg.rpartition(".")[0]
                base = f"{pkg}.{base}" if base else pkg
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
            out += [f"{name}:{line}: imports {t}" for t in targets
                    if t.startswith("ravex_convert.storage.") and t.split(".")[2] in _BACKENDS]
        elif isinstance(node, ast.Import):
            out += [f"{name}:{line}: imports {a.name}" for a in node.names
                    if a.name.startswith("ravex_convert.storage.") and a.name.split(".")[2] in _BACKENDS]
    return out


def _outside_storage() -> list[Path]:
    files = [p for pkg in PACKAGES for p in sorted((REPO / pkg).rglob("*.py"))]
    return [p for p in files if STORAGE not in p.parents]


def test_the_checks_find_what_they_look_for() -> None:
    # not vacuous: each kind of finding is found in a snippet, and in the storage package itself
    snippet = '''
from ravex_convert.storage.s3 import split
from .storage import objdir
if path.startswith("s3://") or storage.scheme == "file" or kind in ("s3", "r2"):
    S3_UNREACHABLE = set()
x = text.removeprefix("objdir:")
'''
    found = findings(snippet, "ravex_convert.example")
    for what in ("names 'S3_UNREACHABLE'", "startswith('s3://')", "reads a backend's scheme", "compares with the scheme 's3'",
                 "removeprefix('objdir:')", "imports ravex_convert.storage.s3", "imports ravex_convert.storage.objdir"):
        assert any(what in f for f in findings(snippet, "ravex_convert.example")), (what, found)
    inside = [f for p in sorted(STORAGE.glob("*.py")) for f in findings(p.read_text(encoding="utf-8"), _module(p))]
    assert any("startswith('s3://')" in f or "S3" in f for f in inside)
    assert len(_outside_storage()) > 50  # the packages were found


def test_no_module_outside_storage_knows_a_backend() -> None:
    found = [f for p in _outside_storage() for f in findings(p.read_text(encoding="utf-8"), _module(p))]
    assert not found, "outside ravex_convert/storage/:\n" + "\n".join(found)
