"""JSON objects whose keys are all different.

``json.loads`` keeps the last of two equal keys without a word; in a checkpoint's
metadata (a safetensors header, a native store's JSON) two entries for one name
mean the reader would pick one of two tensors silently. Pass
:func:`unique_pairs` as ``object_pairs_hook`` and catch :class:`DuplicateKey`.
"""

from __future__ import annotations

from typing import Any

__all__ = ["DuplicateKey", "unique_pairs"]


class DuplicateKey(ValueError):
    """An object names ``key`` twice."""

    def __init__(self, key: str):
        super().__init__(key)
        self.key = key


def unique_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    d = dict(pairs)
    if len(d) != len(pairs):
        seen: set[str] = set()
        for k, _ in pairs:
            if k in seen:
                raise DuplicateKey(k)
            seen.add(k)
    return d
