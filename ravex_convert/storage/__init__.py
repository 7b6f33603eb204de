"""The storage layer: every byte Ravex reads or writes goes through one of these.

``resolve(dst)`` picks the backend from the destination's spelling: a plain
path is the local filesystem (:mod:`.local`); ``objdir:PATH`` (or the URL form
``objdir:///abs/path``) is the test backend with object-store semantics
(:mod:`.objdir`), whose bucket is PATH's parent directory (or, while a lease
or an output is open in a bucket that holds PATH, that bucket). With ``RAVEX_STORAGE=objdir`` in the environment every plain
path goes through the objdir backend too: the test suite runs the writers'
tests that way, so that no writer can quietly depend on rename, in-place
updates or flock. See :mod:`.base` for the surface.
"""

from __future__ import annotations

import os
from pathlib import Path

from .base import ABSENT, Output, PreconditionFailed, Sink, Stat, Storage
from .local import LocalStorage, remove_tree

__all__ = ["ABSENT", "LocalStorage", "Output", "PreconditionFailed", "Sink", "Stat", "Storage", "is_objdir", "local_view", "remove_tree", "resolve"]

_OBJDIR = "objdir:"
_buckets: dict[str, Storage] = {}


def resolve(dst: str | Path) -> tuple[Storage, str]:
    """(backend, key) for a destination."""
    text = os.fspath(dst)
    if not text.startswith(_OBJDIR):
        if os.environ.get("RAVEX_STORAGE", "local") != "objdir":
            return LocalStorage(), text
        text = _OBJDIR + text
    from .objdir import ObjectDirStorage, in_use

    rest = text[len(_OBJDIR):]
    path = os.path.abspath(rest.removeprefix("//"))  # pathlib folds "objdir://x" to "objdir:/x"
    root, key = os.path.dirname(path), os.path.basename(path)
    # A path inside a bucket in use (a lease held or an output open there) is a key of that
    # bucket, the outermost one: the checkpoint directories of a native store being written
    # are objects of the store's bucket, not buckets of their own.
    for outer in sorted(in_use(), key=len):
        if path.startswith(outer.rstrip(os.sep) + os.sep):
            root, key = outer, os.path.relpath(path, outer).replace(os.sep, "/")
            break
    if root not in _buckets:
        _buckets[root] = ObjectDirStorage(root)
    return _buckets[root], key


def is_objdir(dst: str | Path) -> bool:
    """Whether ``dst`` is spelled as an objdir destination (not: routed there by RAVEX_STORAGE)."""
    return os.fspath(dst).startswith(_OBJDIR)


def local_view(src: str | Path) -> Path:
    """Where readers map a source's bytes: the path itself, or an objdir object's
    backing file (read-only; the same bytes a ranged GET would return)."""
    storage, key = resolve(src)
    return Path(key) if storage.scheme == "file" else storage.local_path(key)

