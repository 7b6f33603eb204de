"""The storage layer: every byte Ravex reads or writes goes through one of these.

``resolve(dst)`` picks the backend from the destination's spelling: a plain
path is the local filesystem (:mod:`.local`); ``objdir://PATH`` is the test
backend with object-store semantics (:mod:`.objdir`), whose bucket is PATH's
parent directory. See :mod:`.base` for the surface.
"""

from __future__ import annotations

import os
from pathlib import Path

from .base import ABSENT, Output, PreconditionFailed, Sink, Stat, Storage
from .local import LocalStorage, remove_tree

__all__ = ["ABSENT", "LocalStorage", "Output", "PreconditionFailed", "Sink", "Stat", "Storage", "local_view", "remove_tree", "resolve"]

_OBJDIR = "objdir://"
_buckets: dict[str, Storage] = {}


def resolve(dst: str | Path) -> tuple[Storage, str]:
    """(backend, key) for a destination."""
    text = os.fspath(dst)
    if not text.startswith(_OBJDIR):
        return LocalStorage(), text
    from .objdir import ObjectDirStorage

    path = os.path.abspath(text[len(_OBJDIR):])
    root, key = os.path.dirname(path), os.path.basename(path)
    if root not in _buckets:
        _buckets[root] = ObjectDirStorage(root)
    return _buckets[root], key


def local_view(src: str | Path) -> Path:
    """Where readers map a source's bytes: the path itself, or an objdir object's
    backing file (read-only; the same bytes a ranged GET would return)."""
    storage, key = resolve(src)
    return Path(key) if storage.scheme == "file" else storage.local_path(key)

