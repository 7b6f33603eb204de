"""The kill-anywhere soak (integration/soak.py), short: 8 SIGKILLs at seeded random
instants of one realistic training script, every segment continuing bit-identically."""

from __future__ import annotations

from pathlib import Path

import pytest
from soak import soak

pytestmark = pytest.mark.slow


def test_eight_kills_anywhere_lose_nothing_and_diverge_nowhere(tmp_path: Path) -> None:
    # 8, not fewer: with 6 kills only 2 segments trained with a checkpoint to take (CI, 2026-12-06), under the floor of 3
    res = soak(tmp_path, kills=8, seed=1)
    assert res.problems == []
    assert res.kills == 8
    assert res.segments == 9
    # A runtime that started from scratch each time would log the same losses: the resumes must be real.
    # Every segment that trained a step while the store held a checkpoint said it resumed (a problem
    # otherwise); how many segments that is depends on where the timed kills land on a loaded machine
    # (9 to 12 of 21 seen with 20 kills), so the floor is on those and on the resumes together.
    assert res.eligible >= 3 and res.resumed >= res.eligible, (res.eligible, res.resumed)
    assert max(res.redone) <= 6
