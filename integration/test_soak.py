"""The kill-anywhere soak (integration/soak.py), short: 20 SIGKILLs at seeded random
instants of one realistic training script, every segment continuing bit-identically."""

from __future__ import annotations

from pathlib import Path

import pytest
from soak import soak

pytestmark = pytest.mark.slow


def test_twenty_kills_anywhere_lose_nothing_and_diverge_nowhere(tmp_path: Path) -> None:
    res = soak(tmp_path, kills=20, seed=1)
    assert res.problems == []
    assert res.kills == 20
    assert res.segments == 21
    # A runtime that started from scratch each time would log the same losses: the resumes must be real.
    assert res.resumed >= 10, f"only {res.resumed} of 21 segments resumed from a checkpoint"
    assert max(res.redone) <= 6
