"""The declared dependencies are what the packages import: nothing imported
goes undeclared (a fresh `pip install` would then fail at the first command),
and nothing declared goes unused (a user pays for installing it)."""

from __future__ import annotations

import ast
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("ravex", "ravex_convert", "ravex_runtime")
# import name -> distribution name, where they differ
DIST = {"yaml": "pyyaml"}
# imported only inside the functions that use them, for the frameworks a user
# already has when they use that part (DESIGN.md: "the light path")
OPTIONAL = {"deepspeed", "transformers", "lightning", "accelerate"}


def _imports() -> set[str]:
    found: set[str] = set()
    for pkg in PACKAGES:
        for file in (ROOT / pkg).rglob("*.py"):
            for node in ast.walk(ast.parse(file.read_text(), str(file))):
                if isinstance(node, ast.Import):
                    found.update(a.name.split(".")[0] for a in node.names)
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    found.add(node.module.split(".")[0])
    return {m for m in found if m not in sys.stdlib_module_names and m not in PACKAGES and m != "__future__"}


def _declared() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = set()
    for dep in project["dependencies"]:
        name = dep
        for sep in "<>=!~[; ":
            name = name.split(sep)[0]
        names.add(name.lower())
    return names


def test_every_third_party_import_is_declared() -> None:
    needed = {DIST.get(m, m).lower() for m in _imports() - OPTIONAL}
    assert needed - _declared() == set(), "imported but not in [project.dependencies]"


def test_every_declared_dependency_is_imported() -> None:
    used = {DIST.get(m, m).lower() for m in _imports()}
    assert _declared() - used == set(), "declared in [project.dependencies] but never imported"
