"""The CLI reference in docs/cli.md is generated from --help; it must not drift."""

from __future__ import annotations

import subprocess
import sys

from conftest import REPO


def test_cli_reference_is_current() -> None:
    res = subprocess.run([sys.executable, str(REPO / "scripts" / "gen_cli_docs.py"), "--check"], capture_output=True, text=True, check=False)
    assert res.returncode == 0, "docs/cli.md is stale: run `python scripts/gen_cli_docs.py`\n" + res.stderr
