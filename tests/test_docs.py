"""The docs stay true to the tree: the CLI reference in docs/cli.md is generated from --help and
must not drift; every relative link in the Markdown resolves (files and heading anchors); the
README's first screen stays one screen."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

FIRST_SCREEN_LINES = 50  # the README up to its second section: what Ravex is, the two commands, what works


def test_cli_reference_is_current() -> None:
    res = subprocess.run([sys.executable, str(REPO / "scripts" / "gen_cli_docs.py"), "--check"], capture_output=True, text=True, check=False)
    assert res.returncode == 0, "docs/cli.md is stale: run `python scripts/gen_cli_docs.py`\n" + res.stderr


def _pages() -> list[Path]:
    return sorted([REPO / "README.md", REPO / "CHANGELOG.md", REPO / "bench" / "README.md", *(REPO / "docs").rglob("*.md")])


def _prose(text: str) -> str:
    """The text without fenced code blocks and inline code, where `](` is not a link."""
    text = re.sub(r"(?ms)^```.*?^```", "", text)
    return re.sub(r"`[^`\n]*`", "", text)


def _anchors(path: Path) -> set[str]:
    """GitHub's heading ids: lower case, punctuation dropped, spaces to hyphens, repeats numbered."""
    seen: dict[str, int] = {}
    out = set()
    for h in re.findall(r"(?m)^#{1,6} +(.+?) *$", re.sub(r"(?ms)^```.*?^```", "", path.read_text())):
        slug = re.sub(r"[^\w\- ]", "", h.replace("`", "").lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


@pytest.mark.parametrize("page", _pages(), ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(page: Path) -> None:
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", _prose(page.read_text())):
        if re.match(r"^[a-z]+:", target):
            continue  # http(s), mailto: not checked here
        file, _, anchor = target.partition("#")
        dest = (page.parent / file).resolve() if file else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(REPO)}")
    assert not broken, f"{page.relative_to(REPO)}: broken links\n" + "\n".join(broken)


def test_readme_first_screen() -> None:
    lines = (REPO / "README.md").read_text().splitlines()
    second = [i for i, line in enumerate(lines) if line.startswith("## ")][1]
    screen = "\n".join(lines[:second])
    assert second <= FIRST_SCREEN_LINES, f"README's first screen is {second} lines (at most {FIRST_SCREEN_LINES})"
    for command in ("scripts/demo.sh", "scripts/test.sh"):
        assert command in screen and (REPO / command).exists(), command
    works = screen.split("## What works", 1)[1]
    claims = [line for line in works.splitlines() if line.startswith("- ")]
    assert claims, "no 'what works' list"
    for claim in claims:
        assert re.search(r"\d", claim) and "](" in claim, f"a 'what works' line needs a number and a link to its evidence: {claim}"
