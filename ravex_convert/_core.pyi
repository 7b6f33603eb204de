"""Ravex's compiled core (Rust): the reshard planner.

Private: call it through ``ravex_convert``; its surface may change.
"""

from collections.abc import Sequence
from typing import Literal, TypeAlias

__version__: str

# A piece of a logical tensor (row-major, C order): an N-d box, stored
# row-major within the box, or a range of the flattened tensor (ZeRO).
_Box: TypeAlias = tuple[Literal["box"], Sequence[int], Sequence[int]]  # offsets, sizes
_Flat: TypeAlias = tuple[Literal["flat"], int, int]  # start, length
_Region: TypeAlias = _Box | _Flat

def plan_runs(
    global_shape: Sequence[int],
    sources: Sequence[_Region],
    targets: Sequence[_Region],
) -> list[tuple[int, int, int, int, int]]:
    """Plan the copies that fill every target chunk of one tensor from its source chunks.

    Returns ``(target_index, source_index, src_elem, dst_elem, len)`` tuples,
    grouped by target in target order and sorted by ``dst_elem`` within a
    target. Offsets and lengths count elements of each chunk's own storage.
    Every target element is written exactly once; where source chunks
    overlap, the first one listed wins. The GIL is released while planning.

    Raises ``ValueError`` for a malformed or out-of-bounds region, or when a
    target element lies in no source chunk.

    >>> plan_runs([4, 3], [("flat", 0, 6), ("flat", 6, 6)],
    ...           [("box", [0, 0], [1, 3]), ("box", [1, 0], [3, 3])])
    [(0, 0, 0, 0, 3), (1, 0, 3, 0, 3), (1, 1, 0, 3, 6)]
    """
