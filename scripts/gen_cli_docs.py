"""Write docs/cli.md's reference section from the commands' own --help, so the
two cannot drift (tests/test_docs.py fails when they differ).

    python scripts/gen_cli_docs.py          # rewrite docs/cli.md
    python scripts/gen_cli_docs.py --check  # exit 1 if it is stale
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

from ravex.cli import main

DOC = Path(__file__).resolve().parents[1] / "docs" / "cli.md"
MARK = "<!-- generated from --help below; edit ravex/cli.py, then run scripts/gen_cli_docs.py -->"


def reference() -> str:
    parts = []
    ctx = click.Context(main, info_name="ravex", terminal_width=100)
    parts.append("### `ravex`\n\n```text\n" + main.get_help(ctx) + "\n```\n")
    for name in sorted(main.commands):
        cmd = main.commands[name]
        sub = click.Context(cmd, info_name=name, parent=ctx, terminal_width=100)
        parts.append(f"### `ravex {name}`\n\n```text\n" + cmd.get_help(sub) + "\n```\n")
    return "\n".join(parts)


def render() -> str:
    text = DOC.read_text()
    head = text.split(MARK)[0]
    return head + MARK + "\n\n" + reference()


if __name__ == "__main__":
    new = render()
    if "--check" in sys.argv:
        sys.exit(0 if DOC.read_text() == new else 1)
    DOC.write_text(new)
