"""The compiled core from Python: the planner's contract at the boundary."""

from __future__ import annotations

import pytest

from ravex_convert import _core


def test_plan_runs_flat_to_boxes() -> None:
    runs = _core.plan_runs([4, 3], [("flat", 0, 6), ("flat", 6, 6)], [("box", [0, 0], [1, 3]), ("box", [1, 0], [3, 3])])
    assert runs == [(0, 0, 0, 0, 3), (1, 0, 3, 0, 3), (1, 1, 0, 3, 6)]


def test_every_target_element_written_once() -> None:
    # ZeRO-style flat partitions of a 7x5 tensor at world size 3 (12 elements each,
    # the last one short) into FSDP-style dim-0 shards at world size 2 (4 + 3 rows).
    shape = [7, 5]
    sources = [("flat", 0, 12), ("flat", 12, 12), ("flat", 24, 11)]
    targets = [("box", [0, 0], [4, 5]), ("box", [4, 0], [3, 5])]
    runs = _core.plan_runs(shape, sources, targets)
    written = {0: [0] * 20, 1: [0] * 15}
    for t, s, src, dst, n in runs:
        for i in range(n):
            written[t][dst + i] += 1
            # the element's global index is the same on both sides
            assert sources[s][1] + src + i == targets[t][1][0] * 5 + dst + i
    assert all(c == 1 for counts in written.values() for c in counts)


def test_uncovered_target_is_an_error() -> None:
    with pytest.raises(ValueError, match="in no source chunk"):
        _core.plan_runs([10], [("flat", 0, 5)], [("flat", 0, 10)])
